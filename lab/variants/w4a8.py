"""w4a8: the layer with NVFP4 weights on the fp8 tensor cores and 1x128 fp8 activations
(lab/w4a8.py is the definition), one launch per stage on the runner's stream:

    x (T, H) --input: 1x128 fp8, rows gathered (in prepare, as every variant's input quantize)--> x8, s_x
    x8 (rows, H) --w13: W4A8 GEMM--> h (rows, 2I) f32 --act: SwiGLU + 1x128 fp8--> a8 (rows, I), s_a
    a8 --w2: W4A8 GEMM--> out (rows, H) f32 --out--> out_bf16

Where a GEMM's plan is the activation-image kernel (large batches: w4a8_gemm.image_by_default),
w13's image is written with the input, outside the timed layer (the gathered rows in the order
the kernel's stages read them), and w2's epilogue writes out_bf16 itself: stages w13, act,
"w2+out", no float32 output.

The input is quantized outside the timed layer, as separate's (load_layer), w4a16's gather and the
torch peers' quantize are: quantize_act_gpu on the T token rows, then the codes and scales of
each grouped row gathered by row_token (the quantization is per row, so these are the bits of
quantize_act on x[row_token], lab/w4a8.py layer_rows' first stage). The weights are converted
once per DeviceWeights (prepare_w4a8_weights with the p of lab/w4a8.py choose_p per expert,
kept in its cache); the w13 GEMM's alpha is 1 (its gate and up globals are the SwiGLU's, as in
separate) and w2's is w2_global. The output rows stay in grouped order and go to bf16 through
the conversion every unfused variant ends with: the routed combine with the router's weights is
outside the layer, for every variant alike.

Against lab/w4a8.py layer_rows the output is the float64 contract up to the GEMMs' accumulation
(the act stage is bit for bit its definition on the h the GEMM wrote), so `expect` is approx;
`tensor` is fp8: token_axis compares it with the fp8 tensor ceiling.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from lab.kernels import jit
from lab.kernels import swiglu_quant as sq
from lab.kernels import w4a8_gemm as wg

name = "w4a8"
expect = "approx"
tensor = "fp8"
STAGES = ("w13", "act", "w2", "out")
CACHE_KEY = "w4a8"
PAIRED_KEY = "w4a8/w13-paired"
MAX_EXPERTS = 65535  # the GEMM's grid z


def check_problem(problem) -> None:
    """What the W4A8 kernels need of the layer's shape, before anything is allocated or launched:
    ValueError naming the dimension. The GEMM takes N and K in multiples of 64 (w13: N = 2I, K =
    H; w2: N = H, K = I) and one expert per grid z; the act kernel takes I % 4 == 0."""
    e, h, i = int(problem.experts), int(problem.hidden), int(problem.intermediate)
    if h <= 0 or h % wg.ROWS:
        raise ValueError(f"hidden: H={h} must be a positive multiple of {wg.ROWS} for the W4A8 GEMM "
                         f"(w13's K and w2's N)")
    if i <= 0 or i % wg.ROWS:
        raise ValueError(f"intermediate: I={i} must be a positive multiple of {wg.ROWS} for the W4A8 GEMM "
                         f"(w2's K; w13's N is 2I)")
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"experts: E={e} must lie in [1, {MAX_EXPERTS}] (the W4A8 GEMM's grid z)")


def prepared_weights(weights, paired: bool = False) -> tuple[wg.W4A8Weights, wg.W4A8Weights]:
    """(w13, w2) in the W4A8 GEMM's layout on the device, p per expert by lab/w4a8.py choose_p,
    each converted once per DeviceWeights and kept in its cache ("w4a8/w13", "w4a8/w2"). With
    `paired`, w13 in the fused epilogue's row order (w4a8_gemm.py paired_rows; cache
    "w4a8/w13-paired"; a row order does not change an expert's p): the plain w13 is then not
    converted. A scale code the conversion refuses (negative or NaN) raises ValueError naming the
    matrix, before anything is uploaded."""
    host = weights.host
    w13_key = PAIRED_KEY if paired else CACHE_KEY + "/w13"
    want = {w13_key: ("w13", host.w13_packed, host.w13_scales), CACHE_KEY + "/w2": ("w2", host.w2_packed, host.w2_scales)}
    made = {}
    for key, (label, packed, scales) in want.items():
        if key in weights.cache:
            continue
        order = wg.paired_rows(packed.shape[1] // 2) if key == PAIRED_KEY else None
        try:
            made[key] = wg.prepare_w4a8_weights(packed, scales, rows=order)
        except ValueError as err:
            raise ValueError(f"{label}_scales / {label}_packed: {err}") from None
    # every missing matrix converted before any is uploaded: a refused w2 leaves no device memory behind
    for key, prep in made.items():
        weights.cache[key] = prep.to_device()
    return weights.cache[w13_key], weights.cache[CACHE_KEY + "/w2"]


def image_buffers(runner, plan, prep, rows: int, name: str):
    """The activation image an image plan launches with (w4a8_gemm.image_workspace), as runner
    buffers, so that it is allocated in prepare and every variant of one layer shares it; None
    for any other plan. A variant whose kernels come from another tree (token_axis --tree) gets
    its own (jit.current_tree_key): that tree's pre-pass may lay the image out differently, and
    w13's image is written in prepare, before any variant runs."""
    if not plan.image:
        return None
    n = wg.image_rows(rows, prep.experts, plan.tokens)
    key = f"w4a8/{name}_image{plan.tokens}{jit.current_tree_key()}"
    return wg.W4A8Image(plan.tokens, runner.buffer(key, (n, prep.k), np.uint8),
                        runner.buffer(f"{key}_sx", (n, prep.k // wg.GROUP_K), np.float32))


class W4A8:
    name = name
    expect = expect
    tensor = tensor
    stages = STAGES

    paired = False  # w13 in the fused epilogue's row order
    image13 = None  # w13's activation image, where its plan is the image kernel's (plan_w13)
    # the stages before w2's; prepare sets `stages`: then w2 with the bf16 output in its epilogue
    # where it runs the activation-image kernel ("w2+out"), else w2 and the conversion
    head_stages = ("w13", "act")

    def prepare(self, runner, layer) -> None:
        check_problem(layer.problem)
        if self.paired:
            wg.paired_rows(layer.problem.intermediate)  # names I before anything is converted
        p, w = layer.problem, layer.weights
        rows, E, H, I = layer.rows, p.experts, p.hidden, p.intermediate
        self.w13, self.w2 = prepared_weights(w, paired=self.paired)
        buf = runner.buffer
        self.x8 = buf("w4a8/x8", (rows, H), np.uint8)
        self.s_x = buf("w4a8/s_x", (rows, -(-H // wg.GROUP_K)), np.float32)
        self.a8 = buf("w4a8/a8", (rows, I), np.uint8)
        self.s_a = buf("w4a8/s_a", (rows, -(-I // wg.GROUP_K)), np.float32)
        self.ones = buf("w4a8/ones", (E,), np.float32)
        self.w2_global = buf("w4a8/w2_global", (E,), np.float32)
        s = runner.stream
        with s:
            self.ones.fill(1.0)
            self.w2_global.set(np.asarray(w.host.w2_global, np.float32), stream=s)
        # every check of both GEMMs, on the values run() launches with: run() reads nothing back
        offs = layer.offsets_host
        self.plan2 = wg.plan_w4a8_gemm(self.w2, self.a8, self.s_a, offs, np.asarray(w.host.w2_global, np.float32),
                                       layer.out)
        if self.plan2.image:  # its epilogue writes the bf16 output: no float32 output, no conversion pass
            self.plan2 = replace(self.plan2, bf16_out=True)
        self.fp32_out = not self.plan2.bf16_out
        self.stages = self.head_stages + (("w2+out",) if self.plan2.bf16_out else ("w2", "out"))
        self.image2 = image_buffers(runner, self.plan2, self.w2, rows, "w2")
        self.plan_w13(runner, layer)
        self.quantize_input(runner, layer)

    def plan_w13(self, runner, layer) -> None:
        w, offs = layer.weights, layer.offsets_host
        self.plan13 = wg.plan_w4a8_gemm(self.w13, self.x8, self.s_x, offs, np.ones(layer.problem.experts, np.float32),
                                        layer.h)
        self.image13 = image_buffers(runner, self.plan13, self.w13, layer.rows, "w13")
        # and the act stage's, once: run() launches it unchecked (launch_swiglu_quant)
        wg.check_swiglu_args(layer.h, layer.offsets, w.gate_global, w.up_global, self.a8, self.s_a, runner.counter)

    def quantize_input(self, runner, layer) -> None:
        """x8, s_x of the grouped rows: the T token rows quantized, then gathered by row_token
        (temporaries of T rows, freed after prepare), and where w13 runs the activation-image
        kernel, written into its image (the gather's rows in the order its stages read them). So
        the input reaches the timed layer as every variant's does: quantized and laid out for its
        first GEMM. ValueError if x holds NaN or Inf."""
        cp, s = runner.cp, runner.stream
        with runner.stage("input", s), s:
            runner.counter.fill(0)
            tok8, tok_s, _ = wg.quantize_act_gpu(layer.x, nonfinite=runner.counter, stream=s)
            cp.take(tok8, layer.row_token, axis=0, out=self.x8)
            cp.take(tok_s, layer.row_token, axis=0, out=self.s_x)
            if self.image13 is not None:
                wg.launch_x_image(self.plan13, self.w13, self.x8, self.s_x, layer.offsets, self.image13, s)
        bad = runner.read_counter()
        del tok8, tok_s
        if bad:
            raise ValueError(f"x: {bad} non-finite values (the W4A8 input quantizer met them)")

    def run(self, runner, layer) -> None:
        w, s = layer.weights, runner.stream
        with runner.stage("w13", s):  # (its image, where it has one, written with the input)
            wg.launch_w4a8_gemm(self.plan13, self.w13, self.x8, self.s_x, layer.offsets, self.ones, layer.h, s,
                                self.image13, write_image=False)
        with runner.stage("act", s):
            wg.launch_swiglu_quant(layer.h, layer.offsets, w.gate_global, w.up_global, self.a8, self.s_a,
                                   runner.counter, s)
        self.run_w2(runner, layer)

    def run_w2(self, runner, layer) -> None:
        """w2 and the bf16 output, in their stages."""
        s = runner.stream
        if self.plan2.bf16_out:
            with runner.stage("w2+out", s):
                self.launch_w2(runner, layer)
            return
        with runner.stage("w2", s):
            self.launch_w2(runner, layer)
        with runner.stage("out", s):
            sq.to_bf16(layer.out, layer.out_bf16, runner.counter, stream=s)

    def launch_w2(self, runner, layer) -> None:
        """w2's launch: the bf16 output where the plan writes it, else the float32 one."""
        if self.plan2.bf16_out:
            wg.launch_w4a8_gemm(self.plan2, self.w2, self.a8, self.s_a, layer.offsets, self.w2_global,
                                layer.out_bf16, runner.stream, self.image2, runner.counter)
        else:
            wg.launch_w4a8_gemm(self.plan2, self.w2, self.a8, self.s_a, layer.offsets, self.w2_global, layer.out,
                                runner.stream, self.image2)


class W4A8Fused(W4A8):
    """w4a8-fused: w13 with the SwiGLU and the 1x128 quantize in its epilogue (w4a8_gemm.cu
    w4a8_gemm_swiglu: gate and up rows paired in each thread, a cluster of four CTAs per
    128-column group of I sharing the group's amax), so h never reaches memory; then w2 and the
    output conversion as w4a8. Its a8, s_a and output are w4a8's bits (same h, same SwiGLU and
    quantize functions). Needs I % 128 == 0."""

    name = "w4a8-fused"
    stages = ("w13+act", "w2", "out")
    head_stages = ("w13+act",)
    paired = True

    def plan_w13(self, runner, layer) -> None:
        w, offs = layer.weights, layer.offsets_host
        ones = np.ones(layer.problem.experts, np.float32)
        # where the plain w13 would run the activation-image kernel, the fused one does too (its
        # decode-ahead form at the same tile, or its largest; its image written with the input)
        plain = wg.plan_w4a8_gemm(self.w13, self.x8, self.s_x, offs, ones, None)
        fused = dict(tokens=min(plain.tokens, wg.IMAGE_TILES[-1]), image=True, ahead=True) if plain.image else {}
        # alpha checked on the host: the device's ones are still being filled on the runner's stream
        self.plan13 = wg.plan_w4a8_gemm_swiglu(self.w13, self.x8, self.s_x, offs, ones, w.gate_global, w.up_global,
                                               self.a8, self.s_a, runner.counter, **fused)
        self.image13 = image_buffers(runner, self.plan13, self.w13, layer.rows, "w13")

    def run(self, runner, layer) -> None:
        w, s = layer.weights, runner.stream
        with runner.stage("w13+act", s):
            wg.launch_w4a8_gemm_swiglu(self.plan13, self.w13, self.x8, self.s_x, layer.offsets, self.ones,
                                       w.gate_global, w.up_global, self.a8, self.s_a, runner.counter, s,
                                       self.image13, write_image=False)
        self.run_w2(runner, layer)


# Past this many tokens on the largest expert, w4a8-layer runs w4a8-fused's launches instead of
# its one launch (whose largest token tile is 32: an expert past it is decoded once a 32-token
# block, where w4a8-fused's 64-token tile decodes it once).
LAYER_HOT_TOKENS = 32


class W4A8Layer(W4A8Fused):
    """w4a8-layer: the layer as one persistent launch (w4a8_gemm.cu w4a8_layer): w13 with the
    SwiGLU + quantize epilogue then w2 with the bf16 output, an expert's w2 starting once its w13
    is done, so no launch boundary drains the device between the GEMMs. Its a8, s_a and bf16
    output are w4a8-fused's bits (the same sums, SwiGLU, quantize and rounding). Where the largest
    expert has more than `hot_tokens` tokens it runs w4a8-fused's three launches (in the one
    "layer" stage). In the one launch the fp32 output is not written (fp32_out False). Its token
    tile is `tokens` (one of w4a8_gemm.LAYER_TILES) or, by default, w4a8_gemm.layer_tile's.
    On an H200, on the old tile (the smallest holding the largest expert), it was slower than w4a8
    (0.903 against 0.796 ms at 1 token per expert, 1.678 against 1.598 at 8;
    results/studies/w4a8_layer_and_smem_a_h200.json); on an H100 with the tile by issue it matches
    w4a8 (1.469 against 1.472 ms at 8; results/h100/token_axis_w4a8_resident_layer_tile.json)."""

    name = "w4a8-layer"
    stages = ("layer",)

    def __init__(self, hot_tokens: int = LAYER_HOT_TOKENS, tokens: int | None = None):
        if isinstance(hot_tokens, bool) or not isinstance(hot_tokens, (int, np.integer)) or hot_tokens < 0:
            raise ValueError(f"hot_tokens: expected an int >= 0 (tokens on the largest expert), got {hot_tokens!r}")
        if tokens is not None:
            wg.layer_expression(tokens)  # names the argument when it is not one of the layer's tiles
        self.hot_tokens = int(hot_tokens)
        self.tokens = tokens  # the one launch's token tile; None: wg.layer_tile of the experts' counts
        self.fp32_out = False

    def prepare(self, runner, layer) -> None:
        h, e = int(layer.problem.hidden), int(layer.problem.experts)
        if h % (2 * wg.ROWS):
            raise ValueError(f"hidden: H={h} must be a positive multiple of {2 * wg.ROWS} for the layer kernel "
                             f"(w2's 128-row blocks)")
        if e > wg.LAYER_MAX_EXPERTS:
            raise ValueError(f"experts: E={e}; the layer kernel takes at most {wg.LAYER_MAX_EXPERTS}")
        super().prepare(runner, layer)  # w4a8-fused's checks, weights, buffers, input and plans
        self.stages = ("layer",)
        self.one_launch = int(layer.counts.max(initial=0)) <= self.hot_tokens
        self.fp32_out = not self.one_launch and not self.plan2.bf16_out
        if not self.one_launch:
            return
        E = layer.problem.experts
        self.sync = runner.buffer("w4a8/layer_sync", (E + 2,), np.int32)
        with runner.stream:
            self.sync.fill(0)  # each launch leaves it zero again
        w = layer.weights
        self.plan = wg.plan_w4a8_layer(self.w13, self.w2, self.x8, self.s_x, layer.offsets_host,
                                       np.ones(E, np.float32), np.asarray(w.host.w2_global, np.float32),
                                       w.gate_global, w.up_global, self.a8, self.s_a, layer.out_bf16,
                                       runner.counter, self.sync, tokens=self.tokens)

    def run(self, runner, layer) -> None:
        w, s = layer.weights, runner.stream
        with runner.stage("layer", s):
            if self.one_launch:
                wg.launch_w4a8_layer(self.plan, self.w13, self.w2, self.x8, self.s_x, layer.offsets, self.ones,
                                     self.w2_global, w.gate_global, w.up_global, self.a8, self.s_a, layer.out_bf16,
                                     runner.counter, self.sync, s)
                return
            wg.launch_w4a8_gemm_swiglu(self.plan13, self.w13, self.x8, self.s_x, layer.offsets, self.ones,
                                       w.gate_global, w.up_global, self.a8, self.s_a, runner.counter, s,
                                       self.image13, write_image=False)
            self.launch_w2(runner, layer)
            if not self.plan2.bf16_out:
                sq.to_bf16(layer.out, layer.out_bf16, runner.counter, stream=s)
