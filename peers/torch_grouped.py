"""torch-bf16 and torch-fp8: the layer through PyTorch's grouped GEMMs, on the lab's runner.

Both take the same NVFP4 weights as the lab, dequantized once (e2m1 x e4m3 x the weight's
global: exact in float32) into their own format, and the same routing and input:

    torch-bf16   weights bf16; x gathered to rows, bf16 (in prepare, as the lab's input quantize)
                 w13  h = _grouped_mm(x, w13ᵀ)                       (rows, 2I) bf16
                 act  a = silu(h_gate) * h_up                        (rows, I)  bf16
                 w2   out = _grouped_mm(a, w2ᵀ)                       (rows, H)  bf16
    torch-fp8    weights fp8 e4m3, one float32 scale per output row (amax / 448); x rows fp8
                 with one scale per row (in prepare)
                 w13  h = _scaled_grouped_mm(x8, w13_8ᵀ, sx, sw13)    bf16 out, fast accumulation
                 act  a = silu(h_gate) * h_up, then per row: sa = amax / 448, a8 = fp8(a / sa)
                 w2   out = _scaled_grouped_mm(a8, w2_8ᵀ, sa, sw2)

The gate/up/w2 globals live in the dequantized weights, so SwiGLU is the plain one. Launches go
to the runner's stream (torch.cuda.ExternalStream over it), so NVTX ranges and CUDA events are
the runner's as for every variant; arrays cross between CuPy and torch through DLPack, without
copies. Output stays in the peer (`result`), as bf16: copying it into the layer's buffers would
add a pass over the output that the peer does not need.
"""

from __future__ import annotations

import numpy as np

from lab import nvfp4

NAME_BF16 = "torch-bf16"
NAME_FP8 = "torch-fp8"
INSTALL_HINT = "torch is not installed: pip install -e '.[peers]' adds it"
FP8_MAX = 448.0
DEQUANT_CHUNK = 8  # experts per dequantization step (bounds the float32 temporaries)
TINY = 1e-12  # floor of a row's scale: an all-zero row quantizes to zeros, not NaN


def _torch():
    """The torch module, or NotImplementedError saying why the peer cannot run."""
    try:
        import torch
    except ImportError:
        raise NotImplementedError(INSTALL_HINT) from None
    for fn in ("_grouped_mm", "_scaled_grouped_mm"):
        if not hasattr(torch, fn):
            raise NotImplementedError(f"torch {torch.__version__} has no torch.{fn} (2.8 or newer has it)")
    if not torch.cuda.is_available():
        raise NotImplementedError(f"torch {torch.__version__} sees no CUDA device")
    return torch


def dequantize(torch, packed: np.ndarray, scales: np.ndarray, row_global: np.ndarray, device):
    """(e, n, k/2) codes, (e, n, k/16) e4m3 scales and (e, n) float32 globals -> (e, n, k)
    float32 on `device`: e2m1 x e4m3 x global (the first two exact, the global one rounding)."""
    e, n, half_k = packed.shape
    k = 2 * half_k
    p = torch.from_numpy(np.ascontiguousarray(packed)).to(device)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(e, n, k // nvfp4.BLOCK, nvfp4.BLOCK).long()
    e2m1 = torch.from_numpy(np.array(nvfp4.E2M1_VALUES)).to(device)
    e4m3 = torch.from_numpy(nvfp4.decode_e4m3(np.arange(256, dtype=np.uint8))).to(device)
    s = e4m3[torch.from_numpy(np.ascontiguousarray(scales)).to(device).long()]
    g = torch.from_numpy(np.ascontiguousarray(row_global, dtype=np.float32)).to(device)
    return (e2m1[codes] * s[..., None]).reshape(e, n, k) * g[..., None]


def rowwise_fp8(torch, a):
    """(rows, k) -> (fp8 e4m3 rows, (rows,) float32 scales) with a = fp8 * scale per row."""
    amax = a.abs().amax(dim=-1).float()
    scale = torch.clamp(amax, min=TINY) / FP8_MAX
    return (a.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def _weights(torch, host, kind: str, device) -> dict:
    """The peer's weights from the lab's NVFP4 ones: w13 (E, 2I, H), w2 (E, H, I) in `kind`
    (bf16, or fp8 with per-row scales), built DEQUANT_CHUNK experts at a time."""
    E, I = host.experts, host.intermediate
    g13 = np.concatenate([np.repeat(host.gate_global[:, None], I, 1), np.repeat(host.up_global[:, None], I, 1)], 1)
    g2 = np.repeat(host.w2_global[:, None], host.hidden, 1)
    out = {}
    for name, packed, scales, glob in (("w13", host.w13_packed, host.w13_scales, g13),
                                       ("w2", host.w2_packed, host.w2_scales, g2)):
        parts, row_scales = [], []
        for e0 in range(0, E, DEQUANT_CHUNK):
            e1 = min(E, e0 + DEQUANT_CHUNK)
            w = dequantize(torch, packed[e0:e1], scales[e0:e1], glob[e0:e1], device)
            if kind == "bf16":
                parts.append(w.to(torch.bfloat16))
            else:
                w8, s = rowwise_fp8(torch, w)
                parts.append(w8)
                row_scales.append(s)
            del w
        out[name] = torch.cat(parts)  # (E, N, K): its transpose is the column-major (E, K, N) operand
        if row_scales:
            out[name + "_scale"] = torch.cat(row_scales).contiguous()  # (E, N) float32
    return out


class TorchGrouped:
    """A peer on the runner contract: name, expect, stages, prepare(runner, layer), run(runner,
    layer), plus result(layer) -> the fp32 output on the host (for the approx check)."""

    expect = "approx"
    stages = ("w13", "act", "w2")

    def __init__(self, kind: str):
        if kind not in ("bf16", "fp8"):
            raise ValueError(f"kind: expected 'bf16' or 'fp8', got {kind!r}")
        self.kind = kind
        self.name = NAME_BF16 if kind == "bf16" else NAME_FP8
        self.torch = None
        self.out = None

    def prepare(self, runner, layer) -> None:
        torch = self.torch = _torch()
        cp = runner.cp
        device = torch.device("cuda", cp.cuda.Device().id)
        self.stream = torch.cuda.ExternalStream(runner.stream.ptr, device=device)
        key = ("torch", self.kind)
        if key not in layer.weights.cache:  # shared by every batch of these weights
            layer.weights.cache[key] = _weights(torch, layer.weights.host, self.kind, device)
        w = layer.weights.cache[key]
        runner.synchronize()
        with torch.cuda.stream(self.stream):
            x = torch.from_dlpack(layer.x)
            if x.dtype == torch.int16 or x.dtype == torch.uint16:  # bf16 bits
                x = x.view(torch.bfloat16)
            rows = torch.from_dlpack(layer.row_token).long()
            xr = x[rows]
            self.offs = torch.from_numpy(np.asarray(layer.offsets_host[1:], dtype=np.int32)).to(device)
            self.w13_t, self.w2_t = w["w13"].transpose(-2, -1), w["w2"].transpose(-2, -1)
            if self.kind == "bf16":
                self.x = xr.to(torch.bfloat16).contiguous()
            else:
                self.x, self.x_scale = rowwise_fp8(torch, xr)
                self.w13_scale, self.w2_scale = w["w13_scale"], w["w2_scale"]
        self.intermediate = layer.problem.intermediate
        self.run(runner, layer)  # the first call picks torch's kernels; not timed
        runner.synchronize()

    def _gemm(self, a, a_scale, w_t, w_scale):
        torch = self.torch
        if self.kind == "bf16":
            return torch._grouped_mm(a, w_t, offs=self.offs)
        return torch._scaled_grouped_mm(a, w_t, a_scale, w_scale, offs=self.offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    def run(self, runner, layer) -> None:
        torch, I = self.torch, self.intermediate
        with torch.cuda.stream(self.stream):
            with runner.stage("w13"):
                h = self._gemm(self.x, getattr(self, "x_scale", None), self.w13_t, getattr(self, "w13_scale", None))
            with runner.stage("act"):
                a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
                a_scale = None
                if self.kind == "fp8":
                    a, a_scale = rowwise_fp8(torch, a)
            with runner.stage("w2"):
                self.out = self._gemm(a, a_scale, self.w2_t, getattr(self, "w2_scale", None))

    def result(self, layer) -> np.ndarray:
        """The last run's output (rows, H) as float32 on the host."""
        if self.out is None:
            raise RuntimeError(f"{self.name}: no output yet (run it first)")
        with self.torch.cuda.stream(self.stream):
            return self.out.float().cpu().numpy()
