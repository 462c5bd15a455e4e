"""Decoders written from the format's bit layout, independent of lab.nvfp4 and ml_dtypes."""

import numpy as np


def e2m1_from_bits(nibbles) -> np.ndarray:
    n = np.asarray(nibbles).astype(np.int64)
    sign = np.where(n & 8, -1.0, 1.0)
    e, m = (n >> 1) & 3, n & 1
    mag = np.where(e == 0, 0.5 * m, 2.0 ** (e - 1) * (1 + 0.5 * m))
    return sign * mag


def e4m3_from_bits(bits) -> np.ndarray:
    b = np.asarray(bits).astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m / 8 * 2.0**-6, 2.0 ** (e - 7) * (1 + m / 8))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return sign * mag


def unpack(packed) -> np.ndarray:
    p = np.asarray(packed)
    out = np.empty((*p.shape[:-1], 2 * p.shape[-1]), dtype=np.uint8)
    out[..., 0::2] = p & 15
    out[..., 1::2] = p >> 4
    return out


def decode_blocks(packed, scales) -> np.ndarray:
    """e2m1 x e4m3 in float64, (..., K)."""
    v = e2m1_from_bits(unpack(packed))
    s = np.repeat(e4m3_from_bits(scales), 16, axis=-1)
    return v * s


GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_round(q) -> np.ndarray:
    """Round-to-nearest-even onto the e2m1 grid, saturating at +-6; returns signed values."""
    q = np.asarray(q, dtype=np.float64)
    a = np.minimum(np.abs(q), 6.0)
    d = np.abs(a[..., None] - GRID)
    best = d.min(axis=-1, keepdims=True)
    ties = d == best
    # among tied grid points take the one with an even index (mantissa bit 0)
    even = ties & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(axis=-1), even.argmax(axis=-1), ties.argmax(axis=-1))
    return np.where(q < 0, -1.0, 1.0) * GRID[idx]


E4M3_FINITE = e4m3_from_bits(np.arange(0x7F))  # codes 0x00..0x7E, ascending values 0 .. 448


def e4m3_round(v) -> np.ndarray:
    """Round-to-nearest-even of values in [0, 448] onto the e4m3 codes (uint8), from the value
    table above: the two neighbours' midpoint is exact in float64, so each comparison is exact."""
    v = np.asarray(v, dtype=np.float64)
    if not ((v >= 0) & (v <= 448)).all():
        raise ValueError("e4m3_round takes values in [0, 448]")
    hi = np.clip(np.searchsorted(E4M3_FINITE, v, side="left"), 1, 0x7E)
    lo = hi - 1
    mid = (E4M3_FINITE[lo] + E4M3_FINITE[hi]) / 2
    up = (v > mid) | ((v == mid) & (hi % 2 == 0))
    return np.where(up, hi, lo).astype(np.uint8)


def fold_e4m3(bits, ratio) -> tuple[np.ndarray, np.ndarray]:
    """Option (b)'s scale fold as lab/scale_fold.py documents it, from the codes' bits:
    (folded codes, saturated). s * float32(r) is exact in float64 (4 + 24 significant bits), so
    its cast to float32 is the float32 product; then min 448 and e4m3 RNE."""
    exact = e4m3_from_bits(bits) * np.asarray(ratio, np.float32).astype(np.float64)
    with np.errstate(over="ignore"):
        p = exact.astype(np.float32).astype(np.float64)
    return e4m3_round(np.minimum(p, 448.0)), exact > 448


def quantize(x, g) -> tuple[np.ndarray, np.ndarray]:
    """lab/nvfp4.py's documented recipe with a static global g, written apart from it: (packed
    (rows, K/2) uint8, scales (rows, K/16) uint8). The float32 operations in the documented
    order; e4m3 and e2m1 rounding by the value tables above; the sign kept (nibble 8 for -0) in
    blocks with a scale, all codes 0 in blocks without."""
    f32 = np.float32
    x = np.asarray(x).astype(f32)
    g = f32(g)
    rows, k = x.shape
    xb = x.reshape(rows, k // 16, 16)
    s_in = np.minimum(np.abs(xb).max(axis=-1) / (f32(6) * g), f32(448))
    scales = e4m3_round(s_in)
    denom = (e4m3_from_bits(scales).astype(f32) * g).astype(f32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip((xb / denom).astype(f32), f32(-6), f32(6))
    scaled = denom > 0
    mag = np.abs(e2m1_round(np.where(scaled, q, 0)))
    nib = np.searchsorted(GRID, mag) + 8 * (scaled & np.signbit(q))
    nib = np.where(scaled, nib, 0).astype(np.uint8).reshape(rows, k)
    return (nib[:, 0::2] | nib[:, 1::2] << 4).astype(np.uint8), scales


WEIGHT_ARRAYS = ("w13_packed", "w13_scales", "w2_packed", "w2_scales", "gate_global", "up_global", "w2_global")


def assert_same_weights(a, b) -> None:
    """Two MoEWeights hold the same arrays (dtype, shape, every bit) and input scales."""
    for f in WEIGHT_ARRAYS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape, f
        np.testing.assert_array_equal(x, y, err_msg=f)
    assert a.w13_input_scale == b.w13_input_scale and a.w2_input_scale == b.w2_input_scale
