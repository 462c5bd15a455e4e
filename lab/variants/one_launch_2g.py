"""one-launch-2G: every w13 problem and every w2 problem in one grouped launch of 2E groups.

    [x_q -> h (w13, E groups)] + [a_q -> out (w2, E groups)]   one grid, one unit counter

It breaks the per-expert w13 -> w2 dependency (w2 reads a_q before SwiGLU has written it this
run), so its output is wrong by construction: it is timed only as the scheduling ceiling of any
single-kernel fusion, and always shown as invalid. SwiGLU and the bf16 conversion are left out,
as a fused kernel would fold them into its epilogues.
"""

from __future__ import annotations

from dataclasses import replace

from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg

name = "one-launch-2G"
expect = "ceiling"


def pair_config(w13_cfg: gc.GemmConfig, w2_cfg: gc.GemmConfig) -> gc.GemmConfig:
    """One tile for both GEMMs of a launch: w13's, with the larger token tile of the two; the
    two must share a weight layout."""
    if (w13_cfg.block_rows, w13_cfg.k_step) != (w2_cfg.block_rows, w2_cfg.k_step):
        raise ValueError(f"one launch of two GEMMs: w13 and w2 weights must share a layout, got "
                         f"{(w13_cfg.block_rows, w13_cfg.k_step)} and {(w2_cfg.block_rows, w2_cfg.k_step)}")
    return replace(w13_cfg, max_frags=max(w13_cfg.max_frags, w2_cfg.max_frags))


def pair_plan(layer, paired: bool = False):
    """(config, w13, w2) for both GEMMs in one launch: one tile, so one weight layout. Where the
    heuristic's layouts for w13 and w2 differ (small or odd shapes), both are prepared once more
    in the layout they can share (gemm_weights.shared_layout), cached with the device weights.
    The tile is pair_config's. `paired`: w13 with gate/up rows paired (the fused layer)."""
    import cupy as cp

    from .fused_swiglu import paired_w13

    w = layer.weights
    p = layer.problem
    layout = gw.shared_layout([(2 * p.intermediate, p.hidden), (p.hidden, p.intermediate)])
    if layout == (layer.w13_cfg.block_rows, layer.w13_cfg.k_step) == (layer.w2_cfg.block_rows, layer.w2_cfg.k_step):
        w13_cfg, w2_cfg, w2 = layer.w13_cfg, layer.w2_cfg, w.w2
        w13 = paired_w13(w) if paired else w.w13
    else:
        w13_cfg = gc.heuristic(2 * p.intermediate, p.hidden, layer.counts, layout)
        w2_cfg = gc.heuristic(p.hidden, p.intermediate, layer.counts, layout)
        if ("w2", layout) not in w.cache:
            w.cache[("w2", layout)] = gw.prepare_weights(w.host.w2_packed, w.host.w2_scales, xp=cp, layout=layout)
        if not paired and ("w13", layout) not in w.cache:
            w.cache[("w13", layout)] = gw.prepare_weights(w.host.w13_packed, w.host.w13_scales, xp=cp, layout=layout)
        w2 = w.cache[("w2", layout)]
        w13 = paired_w13(w, layout) if paired else w.cache[("w13", layout)]
    return pair_config(w13_cfg, w2_cfg), w13, w2


class OneLaunch2G:
    name = name
    expect = expect
    stages = ("w13+w2",)

    def prepare(self, runner, layer) -> None:
        self.cfg, self.w13, self.w2 = pair_plan(layer)
        self.cfg.validate(self.w13.n, self.w13.k).validate(self.w2.n, self.w2.k)
        self.run(runner, layer)  # compiles, and checks the launch's arguments once

    def run(self, runner, layer) -> None:
        part = layer.full
        with runner.stage("w13+w2"):
            gg.grouped_gemm_pair(
                (self.w13, part.x_packed, part.x_scales, part.offsets, part.w13_alpha, part.h),
                (self.w2, part.a_packed, part.a_scales, part.offsets, part.w2_alpha, part.out),
                self.cfg, stream=runner.stream)
