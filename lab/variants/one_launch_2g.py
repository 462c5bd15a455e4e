"""one-launch-2G: every w13 problem and every w2 problem in one grouped launch of 2E groups.

It breaks the per-expert w13 -> w2 dependency (w2 reads a before SwiGLU has written it), so its
output is wrong by construction: it is timed only as the scheduling ceiling of any single-kernel
fusion, and always shown as invalid.
"""

from __future__ import annotations

name = "one-launch-2G"
expect = "ceiling"


class OneLaunch2G:
    name = name
    expect = expect
    stages = ("w13+w2",)

    def prepare(self, runner, layer) -> None:
        raise NotImplementedError(
            "needs the two-problem GEMM launch (all w13 and w2 groups in one grid), "
            "which lab/kernels/grouped_gemm.py does not provide yet")

    def run(self, runner, layer) -> None:
        raise NotImplementedError("one-launch-2G: prepare() first")
