"""Option (b): fold the gate/up global ratio into one half's e4m3 block scales at load.

gate value = e2m1 * s_gate * G_gate = e2m1 * (s_gate * r) * G_up with r = G_gate / G_up, so
w13 can run with one global if every gate block scale becomes e4m3(s_gate * r). The cost is a
rounding error on every block scale and, for r > 1, saturation of the codes with s * r > 448.
(Folding 1/r into the up half instead trades saturation for lost precision at small codes.)

Folding, exactly: ``p = decode(s) * float32(r)`` in float32, then ``min(p, 448)``, then RNE to
e4m3 (ml_dtypes as the oracle). A code is *saturated* when the exact product
``s * float32(r) > 448`` (computed in float64, where it is exact); those fold to 448.

On a whole layer (:func:`fold_weights`, :func:`layer_effect`): each expert's own ratio
``r_e = float32(gate_global[e]) / float32(up_global[e])`` (divided in float32, as the fold-b
loader does) is folded into its gate half and the gate global becomes the up global, so

    option (a)  g = h_gate(s_gate) * gate_global[e],         u = h_up * up_global[e]
    option (b)  g = h_gate(e4m3(s_gate * r_e)) * up_global[e], u = h_up * up_global[e]

and the float64 reference (lab/reference.py) runs both.
"""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np

from . import nvfp4, reference
from .nvfp4 import E4M3_MAX, decode_e4m3, encode_e4m3
from .problem import MoEWeights, Routing

FINITE_POSITIVE_CODES = np.arange(0x01, 0x7F, dtype=np.uint8)  # the 126 finite positive e4m3 codes


def fold_scales(scales_bits, ratio) -> tuple[np.ndarray, np.ndarray]:
    """(folded e4m3 bits uint8, saturated bool mask), both shaped like `scales_bits`.

    ``ratio``: a positive float, or an array broadcastable to scales_bits (e.g. (E, 1, 1) for
    one ratio per expert). Scale codes must be finite and non-negative (sign bit clear, not NaN).
    """
    bits = np.asarray(scales_bits)
    if bits.dtype != np.uint8:
        raise ValueError(f"scales_bits must be uint8 e4m3 bits, got {bits.dtype}")
    if ((bits & 0x7F) == 0x7F).any():
        raise ValueError("scales_bits contains NaN codes (0x7F or 0xFF)")
    if (bits & 0x80).any():
        raise ValueError("scales_bits contains negative codes (sign bit set)")
    r = np.asarray(ratio, dtype=np.float32)
    if not np.isfinite(r).all() or (r <= 0).any():
        raise ValueError(f"ratio must be finite and > 0, got {ratio!r}")
    s = decode_e4m3(bits)
    with np.errstate(over="ignore"):
        p = s * r  # float32
    saturated = s.astype(np.float64) * r.astype(np.float64) > E4M3_MAX
    return encode_e4m3(np.minimum(p, np.float32(E4M3_MAX))), np.broadcast_to(saturated, p.shape).copy()


def _code_stats(ratio: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per code 0..255 (NaN and negative codes masked out): relative error, saturated, zeroed."""
    codes = np.arange(256, dtype=np.uint8)
    valid = ((codes & 0x7F) != 0x7F) & ((codes & 0x80) == 0)
    folded, sat = fold_scales(np.where(valid, codes, 0).astype(np.uint8), ratio)
    exact = decode_e4m3(np.where(valid, codes, 0).astype(np.uint8)).astype(np.float64) * float(np.float32(ratio))
    got = decode_e4m3(folded).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(exact > 0, np.abs(got - exact) / exact, 0.0)
    return rel, sat, (got == 0) & (exact > 0)


def fold_stats(scales_bits, ratio) -> dict:
    """Folding error over the codes in `scales_bits` (zero codes are counted, not averaged).

    ``ratio``: a float, or a 1-D array with one ratio per leading index of scales_bits (one
    per expert). Keys: codes (non-zero codes), zero_codes, mean_rel_err, max_rel_err,
    max_rel_err_unsaturated, saturated, flushed_to_zero, inexact (non-zero codes whose folded
    value is not exactly s*r: the scales the fold changes). Relative error is
    |e4m3(s*r) - s*r| / (s*r).
    """
    bits = np.asarray(scales_bits)
    if bits.dtype != np.uint8:
        raise ValueError(f"scales_bits must be uint8 e4m3 bits, got {bits.dtype}")
    ratios = np.asarray(ratio, dtype=np.float64)
    if ratios.ndim == 0:
        groups = [(float(ratios), bits)]
    elif ratios.ndim == 1 and bits.ndim >= 1 and len(ratios) == bits.shape[0]:
        groups = list(zip(ratios.tolist(), bits))
    else:
        raise ValueError(f"ratio must be a float or ({bits.shape[:1]},) per leading index, got {ratios.shape}")
    n = zeros = sat_n = flushed = inexact = 0
    err_sum, err_max, err_max_unsat = 0.0, 0.0, 0.0
    for r, b in groups:
        hist = np.bincount(np.asarray(b).ravel(), minlength=256)
        if hist[0x7F] or hist[0xFF]:
            raise ValueError("scales_bits contains NaN codes (0x7F or 0xFF)")
        if hist[0x80:].any():
            raise ValueError("scales_bits contains negative codes (sign bit set)")
        rel, sat, zeroed = _code_stats(r)
        present = hist > 0
        present[0] = False
        zeros += int(hist[0])
        n += int(hist[1:].sum())
        err_sum += float((hist * rel).sum())
        sat_n += int(hist[sat].sum())
        flushed += int(hist[zeroed].sum())
        inexact += int(hist[1:][rel[1:] > 0].sum())
        if present.any():
            err_max = max(err_max, float(rel[present].max()))
        if (present & ~sat).any():
            err_max_unsat = max(err_max_unsat, float(rel[present & ~sat].max()))
    return {
        "codes": n,
        "zero_codes": zeros,
        "mean_rel_err": err_sum / n if n else 0.0,
        "max_rel_err": err_max,
        "max_rel_err_unsaturated": err_max_unsat,
        "saturated": sat_n,
        "flushed_to_zero": flushed,
        "inexact": inexact,
    }


def probe(ratio: float, scales_bits=None) -> dict:
    """Error of folding `ratio` into e4m3 scales: {"ratio", "all_codes", "scales"}.

    "all_codes" is :func:`fold_stats` over the 126 finite positive codes, each once;
    "scales" the same over `scales_bits` (e.g. a checkpoint's gate scales), or None.
    """
    ratio = float(ratio)
    out = {"ratio": ratio, "all_codes": fold_stats(FINITE_POSITIVE_CODES, ratio), "scales": None}
    if scales_bits is not None:
        out["scales"] = fold_stats(scales_bits, ratio)
    return out


# ---------------------------------------------------------------------------------------------
# a whole layer: option (b)'s weights, its scale error per expert, its effect on the output
# ---------------------------------------------------------------------------------------------


def gate_up_ratio(weights: MoEWeights) -> np.ndarray:
    """(E,) float32: each expert's gate/up global ratio, divided in float32."""
    return (weights.gate_global.astype(np.float32) / weights.up_global.astype(np.float32)).astype(np.float32)


def fold_weights(weights: MoEWeights) -> tuple[MoEWeights, np.ndarray]:
    """Option (b) as weights: (MoEWeights whose gate half scales are e4m3(s * r_e) and whose
    gate_global is up_global, saturated (E, I, H/16) bool). Other arrays are shared, not copied."""
    i = weights.intermediate
    scales = weights.w13_scales.copy()
    scales[:, :i], saturated = fold_scales(weights.w13_scales[:, :i], gate_up_ratio(weights)[:, None, None])
    return replace(weights, w13_scales=scales, gate_global=weights.up_global.copy()), saturated


def gate_scale_stats(weights: MoEWeights) -> tuple[dict, list[dict]]:
    """Folding each expert's own ratio into its actual gate block scales: (all experts
    together, one dict per expert), each :func:`fold_stats` plus 'ratio' per expert."""
    i, r = weights.intermediate, gate_up_ratio(weights)
    gate = weights.w13_scales[:, :i]
    per = [{"expert": e, "ratio": float(r[e]), **fold_stats(gate[e], float(r[e]))} for e in range(weights.experts)]
    return fold_stats(gate, r.astype(np.float64)), per


def gate_weight_error(weights: MoEWeights, folded: MoEWeights, saturated: np.ndarray, expert: int) -> dict:
    """The gate half of one expert, dequantized with its globals, option (b) against (a):
    gate_rel (relative Frobenius error of the weights), gate_rel_unsaturated (over blocks whose
    scale did not saturate), saturated_energy (share of the weights' squared norm in saturated
    blocks: where the largest blocks saturate, they carry much of the error)."""
    i, e = weights.intermediate, expert
    wa = nvfp4.dequantize_blocks(weights.w13_packed[e, :i], weights.w13_scales[e, :i]) * float(weights.gate_global[e])
    wb = nvfp4.dequantize_blocks(folded.w13_packed[e, :i], folded.w13_scales[e, :i]) * float(folded.gate_global[e])
    sat = np.repeat(saturated[e], nvfp4.BLOCK, axis=-1)
    na = float(np.sum(wa * wa))
    nsat = float(np.sum(wa[sat] ** 2))
    unsat = float(np.sum((wb - wa)[~sat] ** 2))
    return {"gate_rel": float(np.sqrt(np.sum((wb - wa) ** 2) / na)) if na else 0.0,
            "gate_rel_unsaturated": float(np.sqrt(unsat / (na - nsat))) if na > nsat else 0.0,
            "saturated_energy": nsat / na if na else 0.0}


def _rows_of(offsets, experts) -> np.ndarray:
    return np.concatenate([np.arange(offsets[e], offsets[e + 1]) for e in experts] or [np.zeros(0, np.int64)])


def layer_effect(weights: MoEWeights, x, routing: Routing, experts) -> dict:
    """Option (b)'s layer output against option (a)'s on `experts`' rows, both against the
    float64 option (a) reference (reference.layer on the checkpoint's own scales and globals).

    Keys: experts, rows; out_b (||out_b - out_a|| / ||out_a||, both float64: the fold alone,
    what run_layer's fold-b row measures against float64), out_a_bf16 and out_b_bf16 (each
    option's bf16 output, as the layer hands it on, against float64 option (a)), a_b (the SwiGLU
    output a), a_q_codes_changed (fraction of w2 input codes the fold flips), per_expert
    ([{expert, rows, out_b, **gate_weight_error}]).
    """
    experts = sorted(int(e) for e in experts)
    wb, saturated = fold_weights(weights)
    ra = reference.layer(x, routing, weights, experts)
    rb = reference.layer(x, routing, wb, experts)
    offs = routing.offsets
    rows = _rows_of(offs, experts)
    out_a, out_b = ra["out"][rows], rb["out"][rows]

    def bf16(v):
        return v.astype(ml_dtypes.bfloat16).astype(np.float64)

    changed = ra["a_q"].packed[rows] != rb["a_q"].packed[rows]
    return {
        "experts": experts,
        "rows": int(rows.size),
        "out_b": reference.rel_frobenius(out_b, out_a),
        "out_a_bf16": reference.rel_frobenius(bf16(out_a), out_a),
        "out_b_bf16": reference.rel_frobenius(bf16(out_b), out_a),
        "a_b": reference.rel_frobenius(rb["a"][rows], ra["a"][rows]),
        "a_q_codes_changed": float(changed.mean()) if changed.size else 0.0,
        "per_expert": [{"expert": e, "rows": int(offs[e + 1] - offs[e]),
                        "out_b": reference.rel_frobenius(rb["out"][offs[e]:offs[e + 1]], ra["out"][offs[e]:offs[e + 1]]),
                        **gate_weight_error(weights, wb, saturated, e)}
                       for e in experts],
    }
