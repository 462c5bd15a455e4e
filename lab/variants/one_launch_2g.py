"""one-launch-2G: every w13 problem and every w2 problem in one grouped launch of 2E groups.

    [x_q -> h (w13, E groups)] + [a_q -> out (w2, E groups)]   one grid, one unit counter

It breaks the per-expert w13 -> w2 dependency (w2 reads a_q before SwiGLU has written it this
run), so its output is wrong by construction: it is timed only as the scheduling ceiling of any
single-kernel fusion, and always shown as invalid. SwiGLU and the bf16 conversion are left out,
as a fused kernel would fold them into its epilogues.
"""

from __future__ import annotations

from dataclasses import replace

from lab.kernels import grouped_gemm as gg

name = "one-launch-2G"
expect = "ceiling"


def pair_config(w13_cfg: gg.GemmConfig, w2_cfg: gg.GemmConfig) -> gg.GemmConfig:
    """One tile for both GEMMs: w13's, with the larger token tile of the two."""
    if (w13_cfg.block_rows, w13_cfg.k_step) != (w2_cfg.block_rows, w2_cfg.k_step):
        raise ValueError(f"one-launch-2G: w13 and w2 weights must share a layout, got "
                         f"{(w13_cfg.block_rows, w13_cfg.k_step)} and {(w2_cfg.block_rows, w2_cfg.k_step)}")
    return replace(w13_cfg, max_frags=max(w13_cfg.max_frags, w2_cfg.max_frags))


class OneLaunch2G:
    name = name
    expect = expect
    stages = ("w13+w2",)

    def prepare(self, runner, layer) -> None:
        self.cfg = pair_config(layer.w13_cfg, layer.w2_cfg)
        self.cfg.validate(layer.full.w13.n, layer.full.w13.k).validate(layer.full.w2.n, layer.full.w2.k)
        self.run(runner, layer)  # compiles, and checks the launch's arguments once

    def run(self, runner, layer) -> None:
        part = layer.full
        with runner.stage("w13+w2"):
            gg.grouped_gemm_pair(
                (part.w13, part.x_packed, part.x_scales, part.offsets, part.w13_alpha, part.h),
                (part.w2, part.a_packed, part.a_scales, part.offsets, part.w2_alpha, part.out),
                self.cfg, stream=runner.stream)
