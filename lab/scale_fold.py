"""Option (b): fold the gate/up global ratio into one half's e4m3 block scales at load.

gate value = e2m1 * s_gate * G_gate, up value = e2m1 * s_up * G_up. w13 runs with one global
per expert once one half's block scales absorb the ratio of the two globals. Two directions:

    into="gate"     s_gate -> e4m3(s_gate * r), r = G_gate / G_up; one global G_up. For r > 1
                    every code with s * r > 448 saturates (clamps to 448).
    into="smaller"  the half with the smaller global absorbs g_small / g_large <= 1 and the
                    larger global becomes the expert's one: s -> e4m3(s * g_small / g_large).
                    Scales only shrink, so nothing saturates; the smallest codes lose bits or
                    flush to zero instead. What an engine does.

Folding, exactly: ``p = decode(s) * float32(r)`` in float32, then ``min(p, 448)``, then RNE to
e4m3 (ml_dtypes as the oracle). A code is *saturated* when the exact product
``s * float32(r) > 448`` (computed in float64, where it is exact); those fold to 448.

On a whole layer (:func:`fold_weights`, :func:`layer_effect`): each expert's own factor,
divided in float32 from its float32 globals (``r_e = G_gate[e] / G_up[e]``, or
``g_small / g_large``) as the fold-b loader does, is folded into its half, and both halves'
globals become the one global, so for into="gate"

    option (a)  g = h_gate(s_gate) * gate_global[e],         u = h_up * up_global[e]
    option (b)  g = h_gate(e4m3(s_gate * r_e)) * up_global[e], u = h_up * up_global[e]

(into="smaller" alike, with the half and the global each expert's own), and the float64
reference (lab/reference.py) runs both. :func:`quantized_weights` gives weights quantized from
real-valued tensors, whose block scales crowd towards 448 where random codes spread evenly.

Relative errors are checks.rel_error's: None (undefined) against an all-zero reference.
"""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np

from . import nvfp4, reference
from .checks import rel_error
from .nvfp4 import E4M3_MAX, decode_e4m3, encode_e4m3
from .problem import W2_INPUT_SCALE, W13_INPUT_SCALE, MoEProblem, MoEWeights, Routing

INTO = ("gate", "smaller")  # the fold directions (module docstring)

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
    |e4m3(s*r) - s*r| / (s*r); a mean or maximum over no code (no non-zero code, or every one
    saturated) is None.
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
    err_sum, err_max, err_max_unsat = 0.0, None, None  # maxima over no code: undefined
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
            err_max = max(err_max or 0.0, float(rel[present].max()))
        if (present & ~sat).any():
            err_max_unsat = max(err_max_unsat or 0.0, float(rel[present & ~sat].max()))
    return {
        "codes": n,
        "zero_codes": zeros,
        "mean_rel_err": err_sum / n if n else None,  # no non-zero code: nothing to average
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


def _check_into(into: str) -> None:
    if into not in INTO:
        raise ValueError(f"into must be one of {', '.join(INTO)}, got {into!r}")


def fold_plan(weights: MoEWeights, into: str = "gate") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per expert: (folds into the gate half (E,) bool, else the up half; the factor (E,)
    float32 its scales are multiplied by; the one global (E,) float32 that remains).

    into="gate": always the gate half, factor G_gate / G_up, global G_up. into="smaller": the
    half whose global is smaller, factor g_small / g_large <= 1 (1 when equal), global g_large.
    """
    _check_into(into)
    g = weights.gate_global.astype(np.float32)
    u = weights.up_global.astype(np.float32)
    if into == "gate":
        return np.ones(g.shape, bool), gate_up_ratio(weights), u.copy()
    gate_smaller = g < u
    small, large = np.minimum(g, u), np.maximum(g, u)
    return gate_smaller, (small / large).astype(np.float32), large.astype(np.float32)


def folded_half_scales(weights: MoEWeights, into: str = "gate") -> tuple[np.ndarray, np.ndarray]:
    """(E, I, H/16) e4m3 bits of the half each expert folds into, and the factor (E,) float32."""
    i = weights.intermediate
    into_gate, factor, _ = fold_plan(weights, into)
    half = np.where(into_gate[:, None, None], weights.w13_scales[:, :i], weights.w13_scales[:, i:])
    return half, factor


def fold_w13_scales(weights: MoEWeights, into: str = "gate") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(w13 scales (E, 2I, H/16) with each expert's half folded, the one global (E,) float32,
    saturated (E, I, H/16) bool over the folded half). The other half is copied unchanged."""
    i = weights.intermediate
    into_gate, factor, one_global = fold_plan(weights, into)
    half, _ = folded_half_scales(weights, into)
    folded, saturated = fold_scales(half, factor[:, None, None])
    scales = weights.w13_scales.copy()
    scales[into_gate, :i] = folded[into_gate]
    scales[~into_gate, i:] = folded[~into_gate]
    return scales, one_global, saturated


def fold_weights(weights: MoEWeights, into: str = "gate") -> tuple[MoEWeights, np.ndarray]:
    """Option (b) as weights: (MoEWeights whose folded half's scales are e4m3(s * factor) and
    whose gate and up globals are both the one global, saturated (E, I, H/16) bool over the
    folded half). Packed codes and w2 are shared, not copied."""
    scales, one_global, saturated = fold_w13_scales(weights, into)
    return replace(weights, w13_scales=scales, gate_global=one_global.copy(), up_global=one_global.copy()), saturated


def scale_stats(weights: MoEWeights, into: str = "gate") -> tuple[dict, list[dict]]:
    """Folding each expert's own factor into its folded half's actual block scales: (all
    experts together, one dict per expert), each :func:`fold_stats` plus 'ratio' (G_gate /
    G_up), 'factor' and 'half' per expert."""
    into_gate, factor, _ = fold_plan(weights, into)
    half, _ = folded_half_scales(weights, into)
    r = gate_up_ratio(weights)
    per = [{"expert": e, "ratio": float(r[e]), "factor": float(factor[e]), "half": "gate" if into_gate[e] else "up",
            **fold_stats(half[e], float(factor[e]))} for e in range(weights.experts)]
    return fold_stats(half, factor.astype(np.float64)), per


def gate_scale_stats(weights: MoEWeights) -> tuple[dict, list[dict]]:
    """scale_stats into the gate half: each expert's own ratio into its gate block scales."""
    return scale_stats(weights, "gate")


def half_weight_error(weights: MoEWeights, folded: MoEWeights, saturated: np.ndarray, expert: int,
                      half: str = "gate") -> dict:
    """One expert's folded half (gate or up), dequantized with its globals, option (b) against
    (a): weights_rel (relative Frobenius error of the weights), weights_rel_unsaturated (over
    blocks whose scale did not saturate), saturated_energy (share of the weights' squared norm in
    saturated blocks: where the largest blocks saturate, they carry much of the error). A
    relative error with nothing to be relative to (zero weights, or every block saturated) is
    None."""
    i, e = weights.intermediate, expert
    rows = slice(0, i) if half == "gate" else slice(i, 2 * i)
    ga = weights.gate_global if half == "gate" else weights.up_global
    gb = folded.gate_global if half == "gate" else folded.up_global
    wa = nvfp4.dequantize_blocks(weights.w13_packed[e, rows], weights.w13_scales[e, rows]) * float(ga[e])
    wb = nvfp4.dequantize_blocks(folded.w13_packed[e, rows], folded.w13_scales[e, rows]) * float(gb[e])
    sat = np.repeat(saturated[e], nvfp4.BLOCK, axis=-1)
    na = float(np.sum(wa * wa))
    nsat = float(np.sum(wa[sat] ** 2))
    unsat = float(np.sum((wb - wa)[~sat] ** 2))
    return {"weights_rel": rel_error(wb, wa),
            "weights_rel_unsaturated": float(np.sqrt(unsat / (na - nsat))) if na > nsat else None,
            "saturated_energy": nsat / na if na else None}


def gate_weight_error(weights: MoEWeights, folded: MoEWeights, saturated: np.ndarray, expert: int) -> dict:
    """half_weight_error of the gate half, under the gate direction's names (gate_rel,
    gate_rel_unsaturated, saturated_energy)."""
    err = half_weight_error(weights, folded, saturated, expert, "gate")
    return {"gate_rel": err["weights_rel"], "gate_rel_unsaturated": err["weights_rel_unsaturated"],
            "saturated_energy": err["saturated_energy"]}


def _rows_of(offsets, experts) -> np.ndarray:
    return np.concatenate([np.arange(offsets[e], offsets[e + 1]) for e in experts] or [np.zeros(0, np.int64)])


def layer_effect(weights: MoEWeights, x, routing: Routing, experts, into: str = "gate") -> dict:
    """Option (b)'s layer output against option (a)'s on `experts`' rows, both against the
    float64 option (a) reference (reference.layer on the checkpoint's own scales and globals).

    Keys: into, experts, rows; out_b (||out_b - out_a|| / ||out_a||, both float64: the fold
    alone, what run_layer's fold-b row measures against float64), out_a_bf16 and out_b_bf16
    (each option's bf16 output, as the layer hands it on, against float64 option (a)), a_b (the
    SwiGLU output a), a_q_codes_changed (fraction of w2 input codes the fold flips), ref_zero
    (option (a)'s output is all zero on these rows: every relative error is then None),
    per_expert ([{expert, rows, out_b, folded_half, **half_weight_error}], with gate_rel and
    gate_rel_unsaturated too when folding into the gate).
    """
    experts = sorted(int(e) for e in experts)
    wb, saturated = fold_weights(weights, into)
    into_gate, _, _ = fold_plan(weights, into)
    ra = reference.layer(x, routing, weights, experts)
    rb = reference.layer(x, routing, wb, experts)
    offs = routing.offsets
    rows = _rows_of(offs, experts)
    out_a, out_b = ra["out"][rows], rb["out"][rows]

    def bf16(v):
        return v.astype(ml_dtypes.bfloat16).astype(np.float64)

    def per_expert(e):
        half = "gate" if into_gate[e] else "up"
        err = half_weight_error(weights, wb, saturated, e, half)
        entry = {"expert": e, "rows": int(offs[e + 1] - offs[e]), "folded_half": half,
                 "out_b": rel_error(rb["out"][offs[e]:offs[e + 1]], ra["out"][offs[e]:offs[e + 1]]), **err}
        if into == "gate":
            entry.update(gate_rel=err["weights_rel"], gate_rel_unsaturated=err["weights_rel_unsaturated"])
        return entry

    changed = ra["a_q"].packed[rows] != rb["a_q"].packed[rows]
    return {
        "into": into,
        "experts": experts,
        "rows": int(rows.size),
        "out_b": rel_error(out_b, out_a),
        "out_a_bf16": rel_error(bf16(out_a), out_a),
        "out_b_bf16": rel_error(bf16(out_b), out_a),
        "a_b": rel_error(rb["a"][rows], ra["a"][rows]),
        "a_q_codes_changed": float(changed.mean()) if changed.size else None,
        "ref_zero": not np.any(out_a),
        "per_expert": [per_expert(e) for e in experts],
    }


# ---------------------------------------------------------------------------------------------
# weights quantized from real-valued tensors
# ---------------------------------------------------------------------------------------------

WEIGHT_STD = 0.02  # typical of trained projection weights; puts the globals near the study's 4.65e-5
ROW_SPREAD = 0.25  # lognormal sigma of each output row's scale: rows of a trained matrix differ in norm


def quantized_weights(problem: MoEProblem, seed: int = 0, progress=None) -> MoEWeights:
    """NVFP4 weights quantized (nvfp4.quantize, the global from each matrix's amax as ModelOpt
    computes it) from real-valued tensors: N(0, WEIGHT_STD) with a lognormal scale per output
    row, the gate half drawn problem.gate_up_ratio times larger than the up half, so the
    globals' ratio is about that and each half's largest block scale is 448. Unlike
    random_weights' codes, block scales crowd towards the top codes, where folding x r
    saturates. ``progress``: called with a line every few experts (a few hundred ms each at the
    study's shape)."""
    problem = problem.validate()
    E, H, I = problem.experts, problem.hidden, problem.intermediate
    w13_packed = np.empty((E, 2 * I, H // 2), np.uint8)
    w13_scales = np.empty((E, 2 * I, H // nvfp4.BLOCK), np.uint8)
    w2_packed = np.empty((E, H, I // 2), np.uint8)
    w2_scales = np.empty((E, H, I // nvfp4.BLOCK), np.uint8)
    gate_g, up_g, w2_g = (np.empty(E, np.float32) for _ in range(3))
    rng = np.random.default_rng([seed, 6])

    def draw(rows, k, scale):
        row = np.exp(ROW_SPREAD * rng.standard_normal((rows, 1))).astype(np.float32)
        return rng.standard_normal((rows, k), dtype=np.float32) * (np.float32(WEIGHT_STD * scale) * row)

    step = max(1, E // 8)
    for e in range(E):
        if progress and e % step == 0:
            progress(f"quantizing real-valued weights: expert {e + 1} of {E}")
        for rows, scale, glob in ((slice(0, I), problem.gate_up_ratio, gate_g), (slice(I, 2 * I), 1.0, up_g)):
            q = nvfp4.quantize(draw(I, H, scale))
            w13_packed[e, rows], w13_scales[e, rows], glob[e] = q.packed, q.scales, q.global_scale
        q = nvfp4.quantize(draw(H, I, 1.0))
        w2_packed[e], w2_scales[e], w2_g[e] = q.packed, q.scales, q.global_scale
    return MoEWeights(w13_packed, w13_scales, gate_g, up_g, w2_packed, w2_scales, w2_g,
                      W13_INPUT_SCALE, W2_INPUT_SCALE)
