"""cublas-fp16: the layer as a user without NVFP4 kernels would run it. Weights dequantized to
fp16 once at load, cuBLAS strided-batched GEMMs over experts padded to the largest row count
(cupy.matmul), SwiGLU in a CuPy elementwise kernel, activations kept in fp16.

    xpad (E, M, H) f16 = e2m1 x e4m3 of x_q (exact in fp16; built in prepare, like input quantize)
    w13  (E, H, 2I) f16 = e2m1 x e4m3 x 2^-14 (exact in fp16, subnormals included; no overflow)
    h16  = xpad @ w13                                   (E, M, 2I) f16, fp32 accumulation
    a16  = silu(h16_gate * gm[e]) * (h16_up * um[e])    gm = x_global * 2^14 * gate_global[e]
    o16  = a16 @ w2                                     (E, M, H) f16, w2 (E, I, H) like w13
    out  = o16[pad_rows] * 2^14 * w2_global[e]          (rows, H) f32, then bf16 bits

Its output is approximate: h and a are rounded to fp16 and a is not quantized to NVFP4, so it
differs from the float64 reference by about the NVFP4 quantization error of a.
"""

from __future__ import annotations

import numpy as np

from lab import nvfp4
from lab.kernels import swiglu_quant as sq

name = "cublas-fp16"
expect = "approx"
TWO14 = 2.0**14
DEQUANT_CHUNK = 8  # experts per dequantization step (bounds the temporaries)

_SWIGLU = None
_SCATTER = None


def _kernels(cp):
    global _SWIGLU, _SCATTER
    if _SWIGLU is None:
        _SWIGLU = cp.ElementwiseKernel(
            "T hg, T hu, float32 gm, float32 um", "T a",
            "float g = (float)hg * gm; float u = (float)hu * um; a = (T)(g / (1.0f + expf(-g)) * u);",
            "lab_cublas_swiglu")
        _SCATTER = cp.ElementwiseKernel(
            "raw T o, raw int32 pad_rows, raw float32 mult, int32 n", "float32 y",
            "const long long r = i / n, c = i - r * n; y = (float)o[(long long)pad_rows[r] * n + c] * mult[r];",
            "lab_cublas_gather_rows")
    return _SWIGLU, _SCATTER


def dequant_fp16_t(cp, packed, scales):
    """(E, N, K) NVFP4 (host) -> (E, K, N) fp16 of e2m1 x e4m3 x 2^-14, exact, transposed so the
    layer's matmuls are plain row-major (x @ w)."""
    e, n, half_k = packed.shape
    k = 2 * half_k
    out = cp.empty((e, k, n), dtype=cp.float16)
    code = cp.asarray((nvfp4.E2M1_VALUES * np.float32(2.0**-14)).astype(np.float16))
    scale = cp.asarray(nvfp4.decode_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float16))
    for e0 in range(0, e, DEQUANT_CHUNK):
        e1 = min(e, e0 + DEQUANT_CHUNK)
        p = cp.asarray(packed[e0:e1])
        v = cp.stack([code[p & 0xF], code[p >> 4]], axis=-1).reshape(e1 - e0, n, k // 16, 16)
        v *= scale[cp.asarray(scales[e0:e1])][..., None]
        out[e0:e1] = v.reshape(e1 - e0, n, k).transpose(0, 2, 1)
    return out


class CublasFp16:
    name = name
    expect = expect
    stages = ("w13", "act", "w2", "out")

    def prepare(self, runner, layer) -> None:
        cp = runner.cp
        w = layer.weights
        E, H, I = layer.problem.experts, layer.problem.hidden, layer.problem.intermediate
        if "fp16_t" not in w.cache:
            w.cache["fp16_t"] = (dequant_fp16_t(cp, w.host.w13_packed, w.host.w13_scales),
                                 dequant_fp16_t(cp, w.host.w2_packed, w.host.w2_scales))
        self.w13, self.w2 = w.cache["fp16_t"]
        counts, offs = layer.counts, layer.offsets_host
        M = max(1, int(counts.max()))
        self.M = M
        buf = runner.buffer
        self.xpad = buf(f"{name}/xpad", (E, M, H), np.float16)
        self.h16 = buf(f"{name}/h16", (E, M, 2 * I), np.float16)
        self.a16 = buf(f"{name}/a16", (E, M, I), np.float16)
        self.o16 = buf(f"{name}/o16", (E, M, H), np.float16)
        expert_of_row = np.repeat(np.arange(E), counts)
        pad_rows = (expert_of_row * M + (np.arange(layer.rows) - offs[expert_of_row])).astype(np.int32)
        self.pad_rows = buf(f"{name}/pad_rows", (layer.rows,), np.int32)
        self.pad_rows.set(pad_rows, stream=runner.stream)
        g1 = np.float64(w.w13_input_scale) * TWO14
        gm = (g1 * w.host.gate_global.astype(np.float64)).astype(np.float32).reshape(E, 1, 1)
        um = (g1 * w.host.up_global.astype(np.float64)).astype(np.float32).reshape(E, 1, 1)
        self.gm = buf(f"{name}/gm", (E, 1, 1), np.float32)
        self.um = buf(f"{name}/um", (E, 1, 1), np.float32)
        self.gm.set(gm, stream=runner.stream)
        self.um.set(um, stream=runner.stream)
        mult = (TWO14 * w.host.w2_global.astype(np.float64)[expert_of_row]).astype(np.float32)
        self.mult = buf(f"{name}/mult", (layer.rows,), np.float32)
        self.mult.set(mult, stream=runner.stream)
        # dequantized input rows, scattered into the padded layout (zeros elsewhere)
        with runner.stream:
            xcode = cp.asarray(nvfp4.E2M1_VALUES.astype(np.float16))
            xs = cp.asarray(nvfp4.decode_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float16))
            p = layer.x_packed
            v = cp.stack([xcode[p & 0xF], xcode[p >> 4]], axis=-1).reshape(layer.rows, H // 16, 16)
            v *= xs[layer.x_scales][..., None]
            self.xpad.fill(0)
            self.xpad.reshape(E * M, H)[self.pad_rows] = v.reshape(layer.rows, H)
        self.swiglu, self.scatter = _kernels(cp)
        self.run(runner, layer)  # compiles the elementwise kernels, picks cuBLAS algorithms

    def run(self, runner, layer) -> None:
        cp = runner.cp
        I = layer.problem.intermediate
        H = layer.problem.hidden
        with runner.stage("w13"):
            cp.matmul(self.xpad, self.w13, out=self.h16)
        with runner.stage("act"):
            self.swiglu(self.h16[..., :I], self.h16[..., I:], self.gm, self.um, self.a16)
        with runner.stage("w2"):
            cp.matmul(self.a16, self.w2, out=self.o16)
        with runner.stage("out"):
            self.scatter(self.o16, self.pad_rows, self.mult, np.int32(H), layer.out)
            sq.to_bf16(layer.out, layer.out_bf16, runner.counter, stream=runner.stream)
