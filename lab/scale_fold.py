"""Option (b): fold the gate/up global ratio into one half's e4m3 block scales at load.

gate value = e2m1 * s_gate * G_gate = e2m1 * (s_gate * r) * G_up with r = G_gate / G_up, so
w13 can run with one global if every gate block scale becomes e4m3(s_gate * r). The cost is a
rounding error on every block scale and, for r > 1, saturation of the codes with s * r > 448.
(Folding 1/r into the up half instead trades saturation for lost precision at small codes.)

Folding, exactly: ``p = decode(s) * float32(r)`` in float32, then ``min(p, 448)``, then RNE to
e4m3 (ml_dtypes as the oracle). A code is *saturated* when the exact product
``s * float32(r) > 448`` (computed in float64, where it is exact); those fold to 448.
"""

from __future__ import annotations

import numpy as np

from .nvfp4 import E4M3_MAX, decode_e4m3, encode_e4m3

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
    max_rel_err_unsaturated, saturated, flushed_to_zero. Relative error is
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
    n = zeros = sat_n = flushed = 0
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
