"""cublas-fp16: the same layer with fp16 weights dequantized at load and cuBLAS GEMMs through
cupy.matmul: the row a user would pick instead of NVFP4 kernels. It reads 4x the weight bytes
of the NVFP4 path. Two ways to drive cuBLAS:

    cublas-fp16          one strided-batched GEMM per projection over experts padded to the
                         largest row count M (rows laid out (E, M): P = E * M padded rows)
    cublas-fp16-experts  one GEMM per expert with rows, on the grouped rows (P = rows), launched
                         from Python (CuPy cannot capture cuBLAS calls in a CUDA graph: "calling
                         cuBLAS API during stream capture is currently unsupported")

    xin (P, H) f16 = e2m1 x e4m3 of x_q (exact in fp16; built in prepare, like input quantize)
    w13 (E, H, 2I) f16 = e2m1 x e4m3 x 2^-14 (exact in fp16, subnormals included; never overflows)
    w13:  h16 = xin @ w13[e]                              (P, 2I) f16, fp32 accumulation
    act:  a32 = silu(h16_gate * gm[p]) * (h16_up * um[p])  (P, I) f32, gm = x_global 2^14 gate_global[e]
          a_q = quantize_input(a32, w2_input_scale)       the lab's quantizer, as in separate
          a16 = e2m1 x e4m3 of a_q                         exact in fp16
    w2:   o16 = a16 @ w2[e]                               (P, H) f16, w2 (E, I, H) like w13
    out:  out = o16[pad_rows] * 2^14 * w2_alpha[e]        (rows, H) f32, then bf16 bits

Its output is approximate: h and the GEMM outputs are rounded to fp16, so a few codes of a_q
land on the other side of a rounding boundary and out carries fp16 rounding.
"""

from __future__ import annotations

import numpy as np

from lab import nvfp4
from lab.kernels import swiglu_quant as sq

name = "cublas-fp16"
name_per_expert = "cublas-fp16-experts"
expect = "approx"
TWO14 = 2.0**14
DEQUANT_CHUNK = 8  # experts per dequantization step (bounds the temporaries)

# e2m1 x e4m3 of element i of an NVFP4 row-major matrix (row length n; p and s flat), exact in fp16.
_DEQUANT_BODY = """
const long long r = i / n, c = i - r * n;
const unsigned int byte = p[r * (n / 2) + c / 2];
const unsigned int nib = (c & 1) ? (byte >> 4) : (byte & 15u);
const unsigned int e = (nib >> 1) & 3u, m = nib & 1u;
float v = e == 0 ? 0.5f * m : (float)(1 << (e - 1)) * (1.0f + 0.5f * m);
if (nib & 8u) v = -v;
const unsigned int sc = s[r * (n / 16) + c / 16], se = (sc >> 3) & 15u, sm = sc & 7u;
const float sv = se == 0 ? sm * 0.001953125f : __uint_as_float(((se + 120u) << 23) | (sm << 20));
y = (float16)(v * sv);
"""

_KERNELS: dict = {}


def _kernels(cp):
    if not _KERNELS:
        _KERNELS["swiglu"] = cp.ElementwiseKernel(
            "float16 hg, float16 hu, float32 gm, float32 um", "float32 a",
            "const float g = (float)hg * gm, u = (float)hu * um;"
            "const float t = expf(-fabsf(g));"
            "a = g * ((g >= 0.0f ? 1.0f : t) / (1.0f + t)) * u;",
            "lab_cublas_swiglu")
        _KERNELS["dequant"] = cp.ElementwiseKernel(
            "raw uint8 p, raw uint8 s, int64 n", "float16 y", _DEQUANT_BODY, "lab_cublas_dequant")
        _KERNELS["gather"] = cp.ElementwiseKernel(
            "raw float16 o, raw int32 pad_rows, raw float32 mult, int64 n", "float32 y",
            "const long long r = i / n, c = i - r * n; y = (float)o[(long long)pad_rows[r] * n + c] * mult[r];",
            "lab_cublas_gather_rows")
    return _KERNELS


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
    expect = expect

    def __init__(self, per_expert: bool = False):
        self.per_expert = per_expert
        self.name = name_per_expert if per_expert else name

    @property
    def stages(self) -> tuple[str, ...]:
        return ("w13", "act", "w2", "out")

    def prepare(self, runner, layer) -> None:
        cp = runner.cp
        w = layer.weights
        E, H, I = layer.problem.experts, layer.problem.hidden, layer.problem.intermediate
        if "fp16_t" not in w.cache:
            w.cache["fp16_t"] = (dequant_fp16_t(cp, w.host.w13_packed, w.host.w13_scales),
                                 dequant_fp16_t(cp, w.host.w2_packed, w.host.w2_scales))
        self.w13, self.w2 = w.cache["fp16_t"]
        counts, offs = layer.counts, layer.offsets_host
        expert_of_row = np.repeat(np.arange(E), counts)
        if self.per_expert:
            P, self.M = layer.rows, None
            pad_rows = np.arange(layer.rows, dtype=np.int32)
            expert_of_padded = expert_of_row
            self.experts = [(e, int(offs[e]), int(offs[e + 1])) for e in np.flatnonzero(counts)]
        else:
            self.M = M = max(1, int(counts.max()))
            P = E * M
            pad_rows = (expert_of_row * M + (np.arange(layer.rows) - offs[expert_of_row])).astype(np.int32)
            expert_of_padded = np.repeat(np.arange(E), M)
        g1 = np.float64(w.w13_input_scale) * TWO14
        host = {
            "pad_rows": pad_rows,
            "gm": (g1 * w.host.gate_global.astype(np.float64)[expert_of_padded]).astype(np.float32).reshape(P, 1),
            "um": (g1 * w.host.up_global.astype(np.float64)[expert_of_padded]).astype(np.float32).reshape(P, 1),
            "mult": (TWO14 * w.w2_alpha.get().astype(np.float64)[expert_of_row]).astype(np.float32),
        }
        pre = self.name
        for key, value in host.items():
            arr = runner.buffer(f"{pre}/{key}", value.shape, value.dtype)
            arr.set(value, stream=runner.stream)
            setattr(self, key, arr)
        for key, shape, dtype in (("xin", (P, H), np.float16), ("h16", (P, 2 * I), np.float16),
                                  ("a32", (P, I), np.float32), ("ap", (P, I // 2), np.uint8),
                                  ("as_", (P, I // 16), np.uint8), ("a16", (P, I), np.float16),
                                  ("o16", (P, H), np.float16)):
            setattr(self, key, runner.buffer(f"{pre}/{key}", shape, dtype))
        self.k = _kernels(cp)
        with runner.stream:  # the input, dequantized into its (padded) rows
            x16 = cp.empty((layer.rows, H), cp.float16)
            if layer.rows:
                self.k["dequant"](layer.x_packed.reshape(-1), layer.x_scales.reshape(-1), np.int64(H), x16)
            self.xin.fill(0)
            self.xin[self.pad_rows] = x16
        self.launch(runner, layer)  # compiles the elementwise kernels, picks cuBLAS algorithms

    def _gemm(self, cp, x, w, out) -> None:
        if self.per_expert:
            for e, r0, r1 in self.experts:
                cp.matmul(x[r0:r1], w[e], out=out[r0:r1])
        else:
            E, M = w.shape[0], self.M
            cp.matmul(x.reshape(E, M, -1), w, out=out.reshape(E, M, -1))

    def launch(self, runner, layer) -> None:
        cp = runner.cp
        I, H = layer.problem.intermediate, layer.problem.hidden
        with runner.stage("w13"):
            self._gemm(cp, self.xin, self.w13, self.h16)
        with runner.stage("act"):
            self.k["swiglu"](self.h16[:, :I], self.h16[:, I:], self.gm, self.um, self.a32)
            sq.quantize_input(self.a32, layer.weights.w2_input_scale, self.ap, self.as_, runner.counter,
                              stream=runner.stream)
            self.k["dequant"](self.ap.reshape(-1), self.as_.reshape(-1), np.int64(I), self.a16)
        with runner.stage("w2"):
            self._gemm(cp, self.a16, self.w2, self.o16)
        with runner.stage("out"):
            self.k["gather"](self.o16.reshape(-1), self.pad_rows, self.mult, np.int64(H), layer.out)
            sq.to_bf16(layer.out, layer.out_bf16, runner.counter, stream=runner.stream)

    def run(self, runner, layer) -> None:
        self.launch(runner, layer)
