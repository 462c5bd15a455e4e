"""w4a16: the layer with NVFP4 weights and bf16 activations (what engines serving NVFP4
checkpoints on Hopper run), on the same grouped GEMM with GemmConfig.act "bf16", as a CUDA graph.

    x (T, H) --gather, bf16 (in prepare, as the input quantize)--> x_bf16 (rows, H)
    x_bf16 --w13--> h (rows, 2I) f32 --act: SwiGLU, bf16--> a_bf16 (rows, I) --w2--> out f32 --out--> bf16

The same prepared weights as every variant; the w13 alpha is 1 (its globals are SwiGLU's, as in
separate) and the w2 alpha is w2_global (a is the activation itself, not a quantized code).
Against the lab's float64 reference (quantized activations) its output is approximate, and closer
than W4A4's to the float64 layer on unquantized activations (reference.layer_unquantized), whose
inputs it rounds only to bf16. Activations the fp16 conversion cannot hold (|v| >= 65536) are
counted as non-finite values are: a checked run refuses them.
"""

from __future__ import annotations

import numpy as np

from lab.kernels import gemm_config as gc
from lab.kernels import grouped_gemm as gg
from lab.kernels import swiglu_quant as sq

name = "w4a16"
expect = "approx"


def bf16_operands(runner, layer):
    """(x_bf16 (rows, H), a_bf16 (rows, I), ones (E,), w2_global (E,), w13 config, w2 config) for
    the W4A16 variants: runner buffers, x gathered and rounded once (as the W4A4 variants'
    input quantize, outside the timed layer). ValueError if x holds values fp16 cannot hold."""
    p, w = layer.problem, layer.weights
    x = runner.buffer("w4a16/x", (layer.rows, p.hidden), np.uint16)
    a = runner.buffer("w4a16/a", (layer.rows, p.intermediate), np.uint16)
    ones = runner.buffer("w4a16/ones", (p.experts,), np.float32)
    w2_global = runner.buffer("w4a16/w2_global", (p.experts,), np.float32)
    with runner.stream:
        runner.counter.fill(0)
        sq.gather_bf16(layer.x, layer.row_token, x, runner.counter, stream=runner.stream)
        ones.fill(1.0)
        w2_global.set(np.asarray(w.host.w2_global, np.float32))
    bad = runner.read_counter()
    if bad:
        raise ValueError(f"x: {bad} values fp16 cannot hold (|x| >= 65536, Inf or NaN): the W4A16 GEMM converts "
                         f"its activations to fp16")
    cfg13 = gc.heuristic(2 * p.intermediate, p.hidden, layer.counts, act="bf16")
    cfg2 = gc.heuristic(p.hidden, p.intermediate, layer.counts, act="bf16")
    return x, a, ones, w2_global, cfg13, cfg2


class _Graphed:
    """prepare() sets up and captures self.launch; run() replays it (direct launches while the
    runner times stages, so that each stage gets its events)."""

    stages = ("graph",)

    def __init__(self, graph: bool = True):
        self.use_graph = graph
        self.graph = None

    def prepare(self, runner, layer) -> None:
        self.setup(runner, layer)
        self.launch(runner, layer)  # compiles every kernel and checks the arguments before capture
        if self.use_graph:
            self.graph = runner.capture(lambda: self.launch(runner, layer))

    def run(self, runner, layer) -> None:
        if self.graph is None or runner.timing_stages:
            self.launch(runner, layer)
        else:
            with runner.stage("graph"):
                runner.replay(self.graph)

    def w2_out(self, runner, layer) -> None:
        w, s = layer.weights, runner.stream
        with runner.stage("w2", s):
            gg.grouped_gemm(w.w2, self.a, None, layer.offsets, self.w2_global, layer.out, self.cfg2, stream=s)
        with runner.stage("out", s):
            sq.to_bf16(layer.out, layer.out_bf16, runner.counter, stream=s)


class W4A16(_Graphed):
    name = name
    expect = expect

    def setup(self, runner, layer) -> None:
        self.x, self.a, self.ones, self.w2_global, self.cfg13, self.cfg2 = bf16_operands(runner, layer)

    def launch(self, runner, layer) -> None:
        w, s = layer.weights, runner.stream
        with runner.stage("w13", s):
            gg.grouped_gemm(w.w13, self.x, None, layer.offsets, self.ones, layer.h, self.cfg13, stream=s)
        with runner.stage("act", s):
            sq.swiglu_bf16(layer.h, layer.offsets, w.gate_global, w.up_global, self.a, runner.counter, stream=s)
        self.w2_out(runner, layer)


class W4A16Fused(_Graphed):
    """w4a16-fused: w13 with the SwiGLU epilogue writing bf16 a (h never reaches memory), then w2
    and the bf16 conversion; the same bits as w4a16 (the epilogue runs the same SwiGLU)."""

    name = "w4a16-fused"
    expect = "approx"

    def setup(self, runner, layer) -> None:
        from .fused_swiglu import paired_w13

        self.x, self.a, self.ones, self.w2_global, self.cfg13, self.cfg2 = bf16_operands(runner, layer)
        self.w13 = paired_w13(layer.weights)
        w = layer.weights
        self.fusion = gg.Fusion(w.gate_global, w.up_global, 1.0, self.a, None, runner.counter)

    def launch(self, runner, layer) -> None:
        with runner.stage("w13+act", runner.stream):
            gg.swiglu_gemm(self.w13, self.x, None, layer.offsets, self.ones, self.fusion, self.cfg13,
                           stream=runner.stream)
        self.w2_out(runner, layer)


class W4A16Layer(_Graphed):
    """w4a16-layer: the whole W4A16 layer in one persistent launch (the fused layer's kernel with
    bf16 activations); bf16 output straight from the w2 epilogue. Past HOT_TOKENS on the largest
    expert it runs staged, as fused-layer does: w4a16's w13 and SwiGLU, then w2 writing the bf16
    output from its epilogue where w2 runs an image tile (one pass of the layer mode holds 64
    tokens, and at 2048 tokens per expert the one-launch form took 1.7x w4a16's time). Either
    form writes w4a16's bits (the epilogue rounds as the conversion kernel does)."""

    name = "w4a16-layer"
    expect = "approx"
    fp32_out = False

    def setup(self, runner, layer) -> None:
        from dataclasses import replace

        from .fused_layer import HOT_TOKENS
        from .one_launch_2g import pair_plan

        self.x, self.a, self.ones, self.w2_global, self.cfg13, self.cfg2 = bf16_operands(runner, layer)
        self.staged = int(layer.counts.max()) > HOT_TOKENS
        if self.staged:
            self.fp32_out = not self.cfg2.image  # (an image w2 writes the bf16 output only)
            return
        cfg, self.w13, self.w2 = pair_plan(layer, paired=True)  # one tile, one layout for both GEMMs
        self.cfg = replace(cfg, act="bf16")  # (fused_config fits its stages to shared memory)
        w = layer.weights
        self.fusion = gg.Fusion(w.gate_global, w.up_global, 1.0, self.a, None, runner.counter, layer.out_bf16)

    def launch(self, runner, layer) -> None:
        if not self.staged:
            with runner.stage("layer", runner.stream):
                gg.fused_layer(self.w13, self.x, None, layer.offsets, self.ones, self.w2, self.w2_global,
                               self.fusion, self.cfg, stream=runner.stream)
            return
        w, s = layer.weights, runner.stream
        with runner.stage("w13", s):
            gg.grouped_gemm(w.w13, self.x, None, layer.offsets, self.ones, layer.h, self.cfg13, stream=s)
        with runner.stage("act", s):
            sq.swiglu_bf16(layer.h, layer.offsets, w.gate_global, w.up_global, self.a, runner.counter, stream=s)
        if self.cfg2.image:
            with runner.stage("w2", s):
                gg.grouped_gemm(w.w2, self.a, None, layer.offsets, self.w2_global, layer.out_bf16, self.cfg2,
                                stream=s, nonfinite=runner.counter)
        else:
            self.w2_out(runner, layer)
