"""fused-layer: the whole layer as one persistent launch that keeps the w13 -> w2 dependency
the one-launch-2G ceiling breaks.

    [w13 units + SwiGLU + quantize epilogue (expert-major)] then [w2 units, bf16 epilogue]
    one grid, one unit counter; a w2 unit of expert e reads a_q once ready[e] says every w13
    unit of e has written it (release by the writers, acquire by the reader)

It cannot deadlock: every w13 unit is handed out before any w2 unit, so a CTA waiting on
ready[e] waits only on units that running CTAs own and finish without waiting (the kernel's
header says more). Counters reset at the end of the launch, so the graph replays need no
host work. Output: bf16 bits straight from the w2 epilogue (the fp32 `out` is not written).
"""

from __future__ import annotations

import numpy as np

from lab.kernels import gemm_config as gc
from lab.kernels import grouped_gemm as gg
from lab.kernels import swiglu_quant as sq

from .fused_swiglu import fusion_for
from .one_launch_2g import pair_config, pair_plan
from .separate import run_plan

name = "fused-layer"
expect = "match"


def launches(layer, cfg: gc.GemmConfig) -> list[tuple[gc.GemmConfig, tuple[int, int]]]:
    """(config, counts_in) of each launch: `cfg` (pair_plan's) over every expert, or, where both
    GEMMs' plans split by expert size at the same bounds, one fused layer per size class, on the
    tile pair_config gives that class's counts (in cfg's layout)."""
    bounds = [r for _, r in layer.w13_plan]
    if len(bounds) < 2 or bounds != [r for _, r in layer.w2_plan]:
        return [(cfg, gc.ALL_COUNTS)]
    p, layout = layer.problem, (cfg.block_rows, cfg.k_step)
    out = []
    for lo, hi in bounds:
        c = np.where((layer.counts >= lo) & (layer.counts <= hi), layer.counts, 0)
        out.append((pair_config(gc.heuristic(2 * p.intermediate, p.hidden, c, layout),
                                gc.heuristic(p.hidden, p.intermediate, c, layout)), (lo, hi)))
    return out


# Past this many tokens on its largest expert, a class leaves the layer mode for its plans' image
# tiles. One pass of the layer mode holds 64 tokens, yet the staged form was level at 40-45 tokens
# (uniform mean 24, skew 0.4) and 4.6% faster at 56 (uniform mean 32: 1.700 against 1.782 ms), the
# layer mode 0.8% faster at 35 (mean 20); run_layer and token_axis at 5053665,
# results/studies/fused_layer_large_class.json `hot_tokens`.
HOT_TOKENS = 48


def hot_image_plan(layer, cfg: gc.GemmConfig, launches_: list, hot_tokens: int = HOT_TOKENS,
                   same_layout: bool = True):
    """(w13 config, w2 config, counts_in) of the experts that leave the layer mode for their
    plans' image tiles: the large class where the plans split both GEMMs at the same bounds, or
    every expert where each plan is one launch; on an image tile (NVFP4 activations) in both GEMMs,
    and only where the largest expert passes `hot_tokens`. `same_layout`: only where those tiles
    share the fused layer's weight layout (the register-SwiGLU form runs on its paired weights).
    None otherwise."""
    if len(launches_) > 2 or layer.counts.max() <= hot_tokens:
        return None
    (w13_hot, r13), (w2_hot, r2) = layer.w13_plan[-1], layer.w2_plan[-1]
    layout = (cfg.block_rows, cfg.k_step)
    if not (len(layer.w13_plan) == len(layer.w2_plan) == len(launches_) and r13 == r2 == launches_[-1][1]
            and w13_hot.image and w2_hot.image
            and (not same_layout or (w13_hot.block_rows, w13_hot.k_step) == (w2_hot.block_rows, w2_hot.k_step) == layout)):
        return None
    return w13_hot, w2_hot, r13


class FusedLayer:
    """Under skewed routing (two size classes, gemm_plan) the small experts' layer is one
    persistent launch on the runner's side stream; where the large experts pass HOT_TOKENS
    (hot_image_plan) theirs runs beside it on the main stream as fused-out's stages on their
    plans' image tiles: w13 writing h, the SwiGLU kernel on the class's rows, w2 with the bf16
    epilogue. Else each class is one fused layer. Under uniform routing past HOT_TOKENS on the
    largest expert every expert takes those stages the same way (the layer mode decodes the
    weights once per 64 tokens: 50-85% slower than separate from 64 tokens per expert up,
    results/h200/token_axis.json), so fused-layer is fused-out there.
    `large` says how the large experts run: "staged" (above), "swiglu" (fused-layer-swiglu, the
    form of ea736dd-d1bc039: w13 with the SwiGLU epilogue, in the consumers' registers on the
    160-token tile; the register SwiGLU costs ~45% of w13 at 128 tokens per expert, notes/gemm-log.md
    v27, and this form was 1-36% slower than the staged one at skew 0.8-1.2 and 64-512 tokens per
    expert, v28), or None (fused-layer-classes: one fused layer per size class, the form of
    947d39e-0015690)."""

    name = name
    expect = expect
    stages = ("layer",)
    fp32_out = False  # the w2 epilogue writes bf16 only

    def __init__(self, large: str | None = "staged", hot_tokens: int = HOT_TOKENS):
        if large not in ("swiglu", "staged", None):
            raise ValueError(f"large: expected 'staged', 'swiglu' or None, got {large!r}")
        if isinstance(hot_tokens, bool) or not isinstance(hot_tokens, (int, np.integer)) or hot_tokens < 0:
            raise ValueError(f"hot_tokens: expected an int >= 0 (tokens on the largest expert), got {hot_tokens!r}")
        self.graph = None
        self.large = large
        self.hot_tokens = hot_tokens
        if large is None:
            self.name = f"{name}-classes"
        elif large == "swiglu":
            self.name = f"{name}-swiglu"

    def prepare(self, runner, layer) -> None:
        part = layer.full
        self.cfg, self.w13, self.w2 = pair_plan(layer, paired=True)
        self.launches = launches(layer, self.cfg)
        self.fusion = fusion_for(runner, layer, part.gate_global, part.up_global, out_bf16=part.out_bf16)
        self.hot = (hot_image_plan(layer, self.cfg, self.launches, self.hot_tokens, same_layout=self.large == "swiglu")
                    if self.large else None)
        if self.large == "swiglu":  # (w13's SwiGLU epilogue: no out_bf16)
            self.hot_fusion = fusion_for(runner, layer, part.gate_global, part.up_global)
        self.run(runner, layer)  # compiles, and checks the launch's arguments once
        self.graph = runner.capture(lambda: self._launch(runner, layer))

    def _launch(self, runner, layer) -> None:
        part = layer.full

        def layer_launch(cfg, counts_in, s):
            gg.fused_layer(self.w13, part.x_packed, part.x_scales, part.offsets, part.w13_alpha, self.w2,
                           part.w2_alpha, self.fusion, cfg, stream=s, counts_in=counts_in)

        with runner.stage("layer"):
            if self.hot is None:  # one launch, or one per size class side by side on two streams
                run_plan(runner, self.launches, layer_launch, runner.stream, split_streams=True)
                return
            w13_hot, w2_hot, counts_in = self.hot
            if len(self.launches) == 2:  # the small experts' fused layer beside the large ones
                runner.fork()
                layer_launch(*self.launches[0], runner.side)
            if self.large == "staged":  # (w13 on the weights without gate/up pairing: h as the SwiGLU kernel reads it)
                gg.grouped_gemm(part.w13, part.x_packed, part.x_scales, part.offsets, part.w13_alpha, part.h, w13_hot,
                                stream=runner.stream, counts_in=counts_in)
                sq.swiglu_quant(part.h, part.offsets, part.gate_global, part.up_global, layer.weights.w2_input_scale,
                                part.a_packed, part.a_scales, runner.counter, stream=runner.stream, counts_in=counts_in)
            else:
                gg.swiglu_gemm(self.w13, part.x_packed, part.x_scales, part.offsets, part.w13_alpha, self.hot_fusion,
                               w13_hot, stream=runner.stream, counts_in=counts_in)
            w2 = part.w2 if self.large == "staged" else self.w2  # (staged: separate's weights, any layout)
            gg.grouped_gemm(w2, part.a_packed, part.a_scales, part.offsets, part.w2_alpha, part.out_bf16, w2_hot,
                            stream=runner.stream, nonfinite=runner.counter, counts_in=counts_in)
            if len(self.launches) == 2:
                runner.join()

    def run(self, runner, layer) -> None:
        if self.graph is None or runner.timing_stages:
            self._launch(runner, layer)
        else:
            with runner.stage("layer"):
                runner.replay(self.graph)
