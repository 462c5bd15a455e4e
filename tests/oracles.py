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
