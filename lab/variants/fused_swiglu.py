"""fused-swiglu: the w13 GEMM whose epilogue is SwiGLU + NVFP4 quantize (h never reaches
memory), then w2 and the bf16 conversion, captured once as a CUDA graph and replayed.

    x_q --w13 + SwiGLU + quantize--> a_q (rows, I) --w2--> out f32 --out--> bf16

Past 96 tokens per expert w13 runs the 160-token image tile with the SwiGLU in its consumers'
registers, and w2 an image tile whose epilogue writes the bf16 output (fused-out's w2 stage);
below, the fused w13 tile hands its h tiles to epilogue warps (at most 64 tokens per pass).

w13 is laid out a second time at load (prepare_weights(pair_gate_up=True)) so that one CTA
computes gate columns c..c+127 and up columns I+c..I+c+127; each half keeps its own per-expert
global in the epilogue (option (a)). The epilogue runs the activation kernels' arithmetic on the
value the plain epilogue would have stored, so the output equals `separate`'s bit for bit.
"""

from __future__ import annotations

from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg

from .separate import launch_w2_out, run_plan

name = "fused-swiglu"
expect = "match"


def paired_w13(weights, layout: tuple[int, int] | None = None) -> gw.PreparedWeights:
    """w13 prepared with gate/up pairing (in `layout`, default the heuristic's), once per
    DeviceWeights and layout (kept in its cache)."""
    import cupy as cp

    key = ("w13_paired", layout)
    if key not in weights.cache:
        h = weights.host
        weights.cache[key] = gw.prepare_weights(h.w13_packed, h.w13_scales, xp=cp, layout=layout, pair_gate_up=True)
    return weights.cache[key]


def fusion_for(runner, layer, gate_global, up_global, out_bf16=None) -> gg.Fusion:
    return gg.Fusion(gate_global, up_global, layer.weights.w2_input_scale, layer.a_packed, layer.a_scales,
                     runner.counter, out_bf16)


def launch(runner, layer, w13, w13_alpha, fusion) -> None:
    part = layer.full
    with runner.stage("w13+act"):
        # (gemm_plan: two launches by expert size under skew, side by side on two streams)
        run_plan(runner, layer.w13_plan, lambda cfg, counts_in, s: gg.swiglu_gemm(
            w13, part.x_packed, part.x_scales, part.offsets, w13_alpha, fusion, cfg, stream=s,
            counts_in=counts_in), runner.stream, split_streams=True)
    launch_w2_out(runner, layer, part, runner.stream, fuse_out=True, split_streams=True)


def stages_for(w2_cfg) -> tuple[str, ...]:
    """The stages launch() times: w2 with the bf16 output in its epilogue where it runs an image
    tile (launch_w2_out's "w2+out"), else w2 and the conversion."""
    return ("w13+act", "w2+out") if w2_cfg.image else ("w13+act", "w2", "out")


class FusedSwiglu:
    name = name
    expect = expect
    stages = ("w13+act", "w2", "out")  # (prepare sets the plan's: stages_for)

    def __init__(self, graph: bool = True):
        self.use_graph = graph
        self.graph = None

    def weights(self, runner, layer):
        """(w13 weights, w13 alpha (E,), gate global (E,), up global (E,)) this variant runs."""
        w = layer.weights
        return paired_w13(w), w.w13_alpha, w.gate_global, w.up_global

    def prepare(self, runner, layer) -> None:
        self.fp32_out = not layer.w2_cfg.image  # (an image w2 writes the bf16 output only)
        self.stages = stages_for(layer.w2_cfg)
        w13, alpha, gate, up = self.weights(runner, layer)
        self.args = (w13, alpha, fusion_for(runner, layer, gate, up))
        launch(runner, layer, *self.args)  # compiles, and checks the arguments once
        if self.use_graph:
            self.graph = runner.capture(lambda: launch(runner, layer, *self.args))

    def run(self, runner, layer) -> None:
        if self.graph is None or runner.timing_stages:
            launch(runner, layer, *self.args)  # direct launches, so that each stage gets its events
        else:
            with runner.stage("graph"):
                runner.replay(self.graph)

