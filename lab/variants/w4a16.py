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

from lab.kernels import grouped_gemm as gg
from lab.kernels import swiglu_quant as sq

name = "w4a16"
expect = "approx"
STAGES = ("w13", "act", "w2", "out")


class W4A16:
    name = name
    expect = expect
    stages = ("graph",)

    def __init__(self, graph: bool = True):
        self.use_graph = graph
        self.graph = None

    def prepare(self, runner, layer) -> None:
        p, w = layer.problem, layer.weights
        rows = layer.rows
        self.x = runner.buffer("w4a16/x", (rows, p.hidden), np.uint16)
        self.a = runner.buffer("w4a16/a", (rows, p.intermediate), np.uint16)
        with runner.stream:
            runner.counter.fill(0)
            sq.gather_bf16(layer.x, layer.row_token, self.x, runner.counter, stream=runner.stream)
        bad = runner.read_counter()
        if bad:
            raise ValueError(f"x: {bad} values fp16 cannot hold (|x| >= 65536, Inf or NaN): the W4A16 GEMM "
                             f"converts its activations to fp16")
        self.cfg13 = gg.heuristic(2 * p.intermediate, p.hidden, layer.counts, act="bf16")
        self.cfg2 = gg.heuristic(p.hidden, p.intermediate, layer.counts, act="bf16")
        self.ones = runner.buffer("w4a16/ones", (p.experts,), np.float32)
        self.w2_global = runner.buffer("w4a16/w2_global", (p.experts,), np.float32)
        with runner.stream:
            self.ones.fill(1.0)
            self.w2_global.set(np.asarray(w.host.w2_global, np.float32))
        self.launch(runner, layer)  # compiles every kernel before capture
        if self.use_graph:
            self.graph = runner.capture(lambda: self.launch(runner, layer))

    def launch(self, runner, layer) -> None:
        w, s = layer.weights, runner.stream
        with runner.stage("w13", s):
            gg.grouped_gemm(w.w13, self.x, None, layer.offsets, self.ones, layer.h, self.cfg13, stream=s)
        with runner.stage("act", s):
            sq.swiglu_bf16(layer.h, layer.offsets, w.gate_global, w.up_global, self.a, runner.counter, stream=s)
        with runner.stage("w2", s):
            gg.grouped_gemm(w.w2, self.a, None, layer.offsets, self.w2_global, layer.out, self.cfg2, stream=s)
        with runner.stage("out", s):
            sq.to_bf16(layer.out, layer.out_bf16, runner.counter, stream=s)

    def run(self, runner, layer) -> None:
        if self.graph is None or runner.timing_stages:
            self.launch(runner, layer)  # direct launches, so that each stage gets its events
        else:
            with runner.stage("graph"):
                runner.replay(self.graph)
