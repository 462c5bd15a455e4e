"""Float64 reference of the MoE layer, stage by stage and expert by expert.

    x (T, H) float
      -> gather rows by routing.row_token            (rows, H), rows grouped by expert
      -> quantize_activations(w13_input_scale)       x_q NVFP4 (rows, H)
      -> w13: alpha = x_q.global_scale               h float64 (rows, 2I), weight globals NOT applied
      -> swiglu: g = h[:, :I] * gate_global[e],      a float64 (rows, I)
                 u = h[:, I:] * up_global[e], a = silu(g) * u      (option (a) of the study)
      -> quantize_activations(w2_input_scale)        a_q NVFP4 (rows, I)
      -> w2: alpha = float32(a_q.global * w2_global[e])            out float64 (rows, H)
      -> out_bf16                                    (rows, H) bfloat16, still in grouped row order

Each stage is callable alone, so a kernel can be checked on its own inputs. ``experts``
(None for all, or an iterable of expert ids) restricts the work to those experts: rows of the
other experts are NaN in float outputs and hold zero codes and zero scales in NVFP4 outputs.
The GEMM products are exact (e2m1 x e4m3 fits in float64 with room to spare); only the sums
round, in float64.
"""

from __future__ import annotations

from typing import Iterable

import ml_dtypes
import numpy as np

from . import nvfp4
from .nvfp4 import NVFP4Tensor
from .problem import MoEWeights, Routing


def _expert_list(experts: Iterable[int] | None, num_experts: int) -> list[int]:
    if experts is None:
        return list(range(num_experts))
    out = sorted({int(e) for e in experts})
    if out and (out[0] < 0 or out[-1] >= num_experts):
        raise ValueError(f"experts must lie in [0, {num_experts}), got {out[0]}..{out[-1]}")
    return out


def _check_offsets(offsets: np.ndarray, rows: int, num_experts: int) -> np.ndarray:
    offsets = np.asarray(offsets)
    if offsets.shape != (num_experts + 1,):
        raise ValueError(f"offsets must have shape ({num_experts + 1},), got {offsets.shape}")
    if offsets[0] != 0 or offsets[-1] != rows or (np.diff(offsets) < 0).any():
        raise ValueError(f"offsets must rise from 0 to rows={rows}, got {offsets[0]}..{offsets[-1]}")
    return offsets.astype(np.int64)


def grouped_gemm(x_packed, x_scales, offsets, w_packed, w_scales, alpha, experts=None) -> np.ndarray:
    """The GEMM kernel contract: out[r] = alpha[e] * dec(x[r]) @ dec(w[e]).T for r in expert e.

    x_packed (rows, K/2) uint8, x_scales (rows, K/16) uint8, offsets (E+1,) int,
    w_packed (E, N, K/2) uint8, w_scales (E, N, K/16) uint8, alpha (E,) float.
    dec() is nvfp4.dequantize_blocks (e2m1 x e4m3, no global). Returns (rows, N) float64.
    """
    x_packed, x_scales = np.asarray(x_packed), np.asarray(x_scales)
    w_packed, w_scales = np.asarray(w_packed), np.asarray(w_scales)
    if w_packed.ndim != 3 or x_packed.ndim != 2:
        raise ValueError(f"need x (rows, K/2) and w (E, N, K/2), got {x_packed.shape}, {w_packed.shape}")
    E, N, half_k = w_packed.shape
    if x_packed.shape[1] != half_k:
        raise ValueError(f"x has K={2 * x_packed.shape[1]}, weights K={2 * half_k}")
    rows = x_packed.shape[0]
    offs = _check_offsets(offsets, rows, E)
    alpha = np.asarray(alpha, dtype=np.float64)
    if alpha.shape != (E,):
        raise ValueError(f"alpha must have shape ({E},), got {alpha.shape}")
    out = np.full((rows, N), np.nan)
    for e in _expert_list(experts, E):
        r0, r1 = offs[e], offs[e + 1]
        if r1 == r0:
            continue
        xd = nvfp4.dequantize_blocks(x_packed[r0:r1], x_scales[r0:r1])
        wd = nvfp4.dequantize_blocks(w_packed[e], w_scales[e])
        out[r0:r1] = alpha[e] * (xd @ wd.T)
    return out


def grouped_gemm_w4a16(x, offsets, w_packed, w_scales, alpha, experts=None) -> np.ndarray:
    """The GEMM contract with activations as they are (W4A16): out[r] = alpha[e] * x[r] @
    dec(w[e]).T for r in expert e, x (rows, K) any float dtype (bf16 included). Returns (rows, N)
    float64; rows of experts not asked for stay NaN."""
    x = np.asarray(x).astype(np.float64)
    w_packed, w_scales = np.asarray(w_packed), np.asarray(w_scales)
    if w_packed.ndim != 3 or x.ndim != 2 or x.shape[1] != 2 * w_packed.shape[2]:
        raise ValueError(f"need x (rows, K) and w (E, N, K/2) of one K, got {x.shape}, {w_packed.shape}")
    E, N, _ = w_packed.shape
    offs = _check_offsets(offsets, x.shape[0], E)
    alpha = np.asarray(alpha, dtype=np.float64)
    if alpha.shape != (E,):
        raise ValueError(f"alpha must have shape ({E},), got {alpha.shape}")
    out = np.full((x.shape[0], N), np.nan)
    for e in _expert_list(experts, E):
        r0, r1 = offs[e], offs[e + 1]
        if r1 > r0:
            out[r0:r1] = alpha[e] * (x[r0:r1] @ nvfp4.dequantize_blocks(w_packed[e], w_scales[e]).T)
    return out


def w13(x_q: NVFP4Tensor, offsets, weights: MoEWeights, experts=None) -> np.ndarray:
    """h (rows, 2I) float64 = x_global * dec(x) @ dec(w13[e]).T; gate/up globals not applied."""
    alpha = np.full(weights.experts, float(x_q.global_scale))
    return grouped_gemm(x_q.packed, x_q.scales, offsets, weights.w13_packed, weights.w13_scales, alpha, experts)


def _silu(g: np.ndarray) -> np.ndarray:
    # g * sigmoid(g), with sigmoid written so exp never overflows
    e = np.exp(-np.abs(g))
    return g * np.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def swiglu(h, offsets, gate_global, up_global, experts=None) -> np.ndarray:
    """a (rows, I) float64 = silu(h_gate * gate_global[e]) * (h_up * up_global[e])."""
    h = np.asarray(h, dtype=np.float64)
    gate_global = np.asarray(gate_global, dtype=np.float64)
    up_global = np.asarray(up_global, dtype=np.float64)
    E = gate_global.shape[0]
    if h.ndim != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be (rows, 2I), got {h.shape}")
    if up_global.shape != (E,):
        raise ValueError(f"gate_global {gate_global.shape} and up_global {up_global.shape} must both be (E,)")
    I = h.shape[1] // 2
    offs = _check_offsets(offsets, h.shape[0], E)
    out = np.full((h.shape[0], I), np.nan)
    for e in _expert_list(experts, E):
        r0, r1 = offs[e], offs[e + 1]
        g = h[r0:r1, :I] * gate_global[e]
        u = h[r0:r1, I:] * up_global[e]
        out[r0:r1] = _silu(g) * u
    return out


def quantize_activations(a, input_scale, offsets=None, experts=None) -> NVFP4Tensor:
    """NVFP4 of a (rows, K) with the static global `input_scale` (nvfp4.quantize).

    With `offsets` and `experts`, only those experts' rows are quantized; the others get zero
    codes and zero scales (their float rows may be NaN).
    """
    a = np.asarray(a)
    if experts is None:
        return nvfp4.quantize(a, global_scale=input_scale)
    if offsets is None:
        raise ValueError("experts needs offsets")
    offs = _check_offsets(offsets, a.shape[0], len(offsets) - 1)
    sel = _expert_list(experts, len(offs) - 1)
    mask = np.zeros(a.shape[0], dtype=bool)
    for e in sel:
        mask[offs[e] : offs[e + 1]] = True
    part = nvfp4.quantize(a[mask], global_scale=input_scale)
    packed = np.zeros((a.shape[0], a.shape[1] // 2), dtype=np.uint8)
    scales = np.zeros((a.shape[0], a.shape[1] // nvfp4.BLOCK), dtype=np.uint8)
    packed[mask], scales[mask] = part.packed, part.scales
    return NVFP4Tensor(packed, scales, part.global_scale)


def w2_alpha(a_q: NVFP4Tensor, weights: MoEWeights) -> np.ndarray:
    """(E,) float32: the w2 GEMM's alpha, the activation global times w2_global, in float32."""
    return (np.float32(a_q.global_scale) * weights.w2_global.astype(np.float32)).astype(np.float32)


def w2(a_q: NVFP4Tensor, offsets, weights: MoEWeights, experts=None) -> np.ndarray:
    """out (rows, H) float64 = alpha[e] * dec(a) @ dec(w2[e]).T, alpha = w2_alpha()."""
    return grouped_gemm(
        a_q.packed, a_q.scales, offsets, weights.w2_packed, weights.w2_scales, w2_alpha(a_q, weights), experts
    )


def layer(x, routing: Routing, weights: MoEWeights, experts=None) -> dict:
    """The whole layer on tokens x (T, H). Returns every intermediate, keyed by stage:

    x_q NVFP4Tensor (rows, H); h (rows, 2I) float64; a (rows, I) float64;
    a_q NVFP4Tensor (rows, I); out (rows, H) float64; out_bf16 (rows, H) bfloat16.
    Outputs stay in grouped row order (row r is token routing.row_token[r]); combining the
    top_k rows of a token with router weights is outside this layer.
    """
    x = np.asarray(x)
    if x.shape != (routing.tokens, weights.hidden):
        raise ValueError(f"x must be (T, H) = ({routing.tokens}, {weights.hidden}), got {x.shape}")
    if routing.experts != weights.experts:
        raise ValueError(f"routing has {routing.experts} experts, weights {weights.experts}")
    ref = layer_rows(x[routing.row_token], routing.offsets, weights, experts)
    ref["out_bf16"] = ref["out"].astype(ml_dtypes.bfloat16)
    return ref


def layer_rows(x_rows, offsets, weights: MoEWeights, experts=None) -> dict:
    """layer()'s stages on grouped rows given directly: x_rows (rows, H) in expert order, offsets
    (E+1,) over them. Offsets that give every expert but a sample no rows (lab/checks
    compact_offsets) run the float64 layer on that sample's rows alone. Returns x_q, h, a, a_q,
    out as layer() does."""
    x_q = quantize_activations(x_rows, weights.w13_input_scale)
    h = w13(x_q, offsets, weights, experts)
    a = swiglu(h, offsets, weights.gate_global, weights.up_global, experts)
    a_q = quantize_activations(a, weights.w2_input_scale, offsets, experts)
    return {"x_q": x_q, "h": h, "a": a, "a_q": a_q, "out": w2(a_q, offsets, weights, experts)}


def layer_unquantized(x, routing: Routing, weights: MoEWeights, experts=None) -> tuple[np.ndarray, np.ndarray]:
    """The layer as it would be without activation quantization: the NVFP4 weights (with their
    globals) applied to x as given and to the SwiGLU output as computed, in float64.

        h = x[row] @ dec(w13[e]).T;  a = silu(h_gate * gate_global[e]) * (h_up * up_global[e])
        out = w2_global[e] * (a @ dec(w2[e]).T)

    The error every implementation pays against it (the lab's quantized activations, a peer's
    fp8 or bf16 arithmetic) is the error a user of the layer pays. Only the rows of `experts`
    (default all) are computed: returns (rows, out) with rows the grouped row indices of those
    experts in expert order and out (len(rows), H) float64."""
    x = np.asarray(x)
    if x.shape != (routing.tokens, weights.hidden):
        raise ValueError(f"x must be (T, H) = ({routing.tokens}, {weights.hidden}), got {x.shape}")
    E, I = weights.experts, weights.intermediate
    offs = _check_offsets(routing.offsets, routing.rows, E)
    rows, outs = [], []
    for e in _expert_list(experts, E):
        r0, r1 = offs[e], offs[e + 1]
        if r1 == r0:
            continue
        xr = x[routing.row_token[r0:r1]].astype(np.float64)  # this expert's rows only: x may be large
        h = xr @ nvfp4.dequantize_blocks(weights.w13_packed[e], weights.w13_scales[e]).T
        a = _silu(h[:, :I] * float(weights.gate_global[e])) * (h[:, I:] * float(weights.up_global[e]))
        w2d = nvfp4.dequantize_blocks(weights.w2_packed[e], weights.w2_scales[e])
        rows.append(np.arange(r0, r1))
        outs.append(float(weights.w2_global[e]) * (a @ w2d.T))
    if not rows:
        return np.zeros(0, dtype=np.int64), np.zeros((0, weights.hidden))
    return np.concatenate(rows), np.concatenate(outs)
