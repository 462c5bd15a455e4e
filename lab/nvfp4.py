"""NVFP4 as the lab defines it: the NumPy code here is the definition every kernel must match.

Storage (ModelOpt NVFP4) of a logical float tensor X of shape (..., rows, K), K % 16 == 0:

    packed       (..., rows, K//2)  uint8    element 2j in the low nibble, 2j+1 in the high
    scales       (..., rows, K//16) uint8    raw float8_e4m3fn bits, one per 16 elements along K
    global_scale (...)              float32  one per 2-D matrix (shape () for a 2-D tensor)

    X[..., r, k] = e2m1(nibble) * e4m3(scales[..., r, k // 16]) * global_scale[...]

A nibble is ``sign << 3 | index`` into E2M1_GRID = {0, 0.5, 1, 1.5, 2, 3, 4, 6}; nibble 8 is
-0.0. An e4m3 scale byte is float8_e4m3fn (bias 7, no infinities, 0x7F/0xFF are NaN, largest
finite 448, smallest subnormal 2**-9).

Quantizing, exactly (every operation in IEEE float32, round to nearest even):

1. Inputs. ``x`` is cast to float32 first. Any NaN or Inf in it (including float64 values
   beyond the float32 range) raises ValueError naming ``x``. A given ``global_scale`` is cast
   to float32 and must be finite and > 0, else ValueError naming ``global_scale``.
2. Global. When ``global_scale`` is None it is computed per matrix (per leading index):
   ``g = amax_f32 / float32(6 * 448)`` with ``amax_f32 = max |x|`` over the last two axes. An
   all-zero matrix (or one so small that g underflows to 0) gets ``g = 1.0``; a g below the
   smallest normal float32 (2**-126) is raised to 2**-126, so that a computed global is never a
   float32 subnormal (whose few significant bits would make ``6 * g`` and ``s * g`` coarse).
3. Block scale. For each block of 16 along K:
   ``s_in = block_amax_f32 / (float32(6) * g)`` (the product ``6 * g`` is rounded first), then
   ``min(s_in, 448)``, then RNE to e4m3. So scales saturate at 448 (0x7E) and never become
   NaN; s_in at or below 2**-10 rounds to the zero code (ties to even).
4. Elements. With ``s`` the *decoded* block scale as float32:
   ``q = x_f32 / (s * g)`` where ``s * g`` is rounded to float32 first, then
   ``clip(q, -6, 6)``, then RNE to e2m1 (ties go to the even grid point: 0.25 -> 0,
   0.75 -> 1, 2.5 -> 2, 5 -> 4). Values past +-6 saturate to +-6.
5. Zero blocks. A block whose ``s * g`` is 0 in float32 (in practice: its scale code is 0
   because the block is all zeros or its s_in is at most 2**-10) encodes all 16 codes
   as nibble 0 (+0.0). Its dequantized values are exactly 0.
6. Signs. In a block with a non-zero scale the sign is kept: a negative element that rounds
   to zero, or an input of -0.0, gets nibble 8 (-0.0). Scales are always non-negative.

A GPU quantize kernel matches this bit for bit when it performs the same float32 operations
in the same order with IEEE division (a reciprocal-multiply, or --use_fast_math, which makes
``/`` approximate, does not match; tests/test_nvfp4.py puts inputs on every rounding midpoint).

The CUTLASS block-scaled scale layout (Sm1xxBlockScaledConfig) is provided by
:func:`swizzle_scales` / :func:`unswizzle_scales` to stay comparable with CUTLASS engines.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16  # elements per e4m3 block scale, along K

_E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_VALUES = np.concatenate([_E2M1_GRID, -_E2M1_GRID]).astype(np.float32)  # by nibble
E2M1_VALUES.setflags(write=False)

_F8 = ml_dtypes.float8_e4m3fn
_F4 = ml_dtypes.float4_e2m1fn
_E4M3_TABLE = np.arange(256, dtype=np.uint8).view(_F8).astype(np.float32)  # NaN at 0x7F, 0xFF
_E4M3_TABLE.setflags(write=False)
_F32_TINY = np.float32(2.0**-126)  # smallest normal float32: floor of a computed global
_GLOBAL_DIVISOR = np.float32(E2M1_MAX * E4M3_MAX)  # 2688: maps amax onto 6 * 448


@dataclass
class NVFP4Tensor:
    """An NVFP4 tensor of logical shape (..., rows, K); see the module docstring."""

    packed: np.ndarray  # (..., rows, K//2) uint8: element 2j low nibble, 2j+1 high nibble
    scales: np.ndarray  # (..., rows, K//16) uint8: raw float8_e4m3fn bits
    global_scale: np.ndarray  # (...) float32: shape packed.shape[:-2]

    def __post_init__(self):
        self.packed = np.asarray(self.packed)
        self.scales = np.asarray(self.scales)
        self.global_scale = np.asarray(self.global_scale, dtype=np.float32)
        if self.packed.dtype != np.uint8 or self.scales.dtype != np.uint8:
            raise ValueError(
                f"packed and scales must be uint8, got {self.packed.dtype} and {self.scales.dtype}"
            )
        _check_block_shapes(self.packed, self.scales)
        if self.global_scale.shape != self.packed.shape[:-2]:
            raise ValueError(
                f"global_scale has shape {self.global_scale.shape}, expected "
                f"{self.packed.shape[:-2]} (packed.shape[:-2])"
            )

    @property
    def K(self) -> int:
        return self.packed.shape[-1] * 2

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.K)


def _check_block_shapes(packed: np.ndarray, scales: np.ndarray) -> None:
    if packed.ndim < 1 or scales.ndim != packed.ndim:
        raise ValueError(
            f"packed {packed.shape} and scales {scales.shape} must have the same number of dims"
        )
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] != scales.shape[-1] * (BLOCK // 2):
        raise ValueError(
            f"packed {packed.shape} needs scales of shape {(*packed.shape[:-1], packed.shape[-1] // 8)}"
            f" (one per 16 elements), got {scales.shape}"
        )


# ---------------------------------------------------------------------------------------------
# e4m3 and e2m1 codes
# ---------------------------------------------------------------------------------------------


def decode_e4m3(bits) -> np.ndarray:
    """Raw float8_e4m3fn bytes -> float32 (0x7F and 0xFF decode to NaN)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint8:
        raise ValueError(f"e4m3 bits must be uint8, got {bits.dtype}")
    return _E4M3_TABLE[bits]


def encode_e4m3(values, allow_negative: bool = False) -> np.ndarray:
    """float -> raw float8_e4m3fn bytes: float32 first, RNE, saturating at +-448 (Inf too).

    NaN raises ValueError; so does a negative value unless ``allow_negative``. Without
    ``allow_negative``, -0.0 encodes as +0 (0x00).
    """
    v = np.asarray(values, dtype=np.float32)
    if np.isnan(v).any():
        raise ValueError("values contains NaN; e4m3 scales must be numbers")
    if not allow_negative:
        if (v < 0).any():
            raise ValueError("values contains negative numbers (pass allow_negative=True)")
        v = np.where(v == 0, np.float32(0), v)
    v = np.clip(v, -E4M3_MAX, E4M3_MAX)
    return v.astype(_F8).view(np.uint8)


def unpack_nibbles(packed) -> np.ndarray:
    """(..., K//2) uint8 -> (..., K) uint8 nibbles; element 2j from the low nibble."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def pack_nibbles(nibbles) -> np.ndarray:
    """(..., K) uint8 nibbles (each < 16) -> (..., K//2) uint8; element 2j in the low nibble."""
    nibbles = np.asarray(nibbles)
    if nibbles.dtype != np.uint8:
        raise ValueError(f"nibbles must be uint8, got {nibbles.dtype}")
    if nibbles.shape[-1] % 2:
        raise ValueError(f"last dim must be even, got {nibbles.shape[-1]}")
    if (nibbles > 15).any():
        raise ValueError("nibbles must be < 16")
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def decode_codes(packed) -> np.ndarray:
    """(..., K//2) packed uint8 -> (..., K) float32 e2m1 values (without any scale)."""
    return E2M1_VALUES[unpack_nibbles(packed)]


def dequantize_blocks(packed, scales) -> np.ndarray:
    """e2m1 x e4m3 as float64 (..., K), without the global scale.

    Every product is exact in float64 (and in fp16): this is what the GEMM kernels multiply.
    """
    packed = np.asarray(packed)
    scales = np.asarray(scales)
    _check_block_shapes(packed, scales)
    vals = decode_codes(packed).astype(np.float64)
    vals = vals.reshape(*vals.shape[:-1], scales.shape[-1], BLOCK)
    vals *= decode_e4m3(scales).astype(np.float64)[..., None]
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize(t: NVFP4Tensor, dtype=np.float64) -> np.ndarray:
    """NVFP4Tensor -> e2m1 x e4m3 x global, computed in float64, returned as ``dtype``."""
    out = dequantize_blocks(t.packed, t.scales)
    out *= t.global_scale.astype(np.float64)[..., None, None]
    return out.astype(dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------------------------


def quantize(x, global_scale=None) -> NVFP4Tensor:
    """Quantize x (..., rows, K), K % 16 == 0, to NVFP4 exactly as the module docstring says.

    ``global_scale``: None (computed per matrix as amax / 2688), or a float or array
    broadcastable to ``x.shape[:-2]`` (static scales such as a checkpoint's input_scale).
    """
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"x must be (..., rows, K), got shape {x.shape}")
    rows, K = x.shape[-2:]
    if K % BLOCK:
        raise ValueError(f"x's last dim K={K} must be a multiple of {BLOCK}")
    lead = x.shape[:-2]
    with np.errstate(over="ignore"):
        xf = x.astype(np.float32)
    if not np.isfinite(xf).all():
        raise ValueError("x contains NaN or Inf (after conversion to float32)")

    if global_scale is None:
        if rows == 0 or K == 0:
            amax = np.zeros(lead, dtype=np.float32)
        else:
            amax = np.max(np.abs(xf), axis=(-2, -1))
        g = np.asarray(amax / _GLOBAL_DIVISOR, dtype=np.float32)
        g = np.where(g > 0, np.maximum(g, _F32_TINY), np.float32(1.0)).astype(np.float32)
    else:
        with np.errstate(over="ignore"):
            g = np.asarray(global_scale, dtype=np.float32)
        if not np.isfinite(g).all() or (g <= 0).any():
            raise ValueError(f"global_scale must be finite and > 0, got {global_scale!r}")
        try:
            g = np.broadcast_to(g, lead).astype(np.float32)
        except ValueError:
            raise ValueError(
                f"global_scale of shape {g.shape} does not broadcast to {lead} (x.shape[:-2])"
            ) from None

    xb = xf.reshape(*lead, rows, K // BLOCK, BLOCK)
    gb = g[..., None, None]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        block_amax = np.max(np.abs(xb), axis=-1) if K else np.zeros(xb.shape[:-1], np.float32)
        s_in = block_amax / (np.float32(E2M1_MAX) * gb)
        s_in = np.minimum(s_in, np.float32(E4M3_MAX))
        scales = s_in.astype(np.float32).astype(_F8).view(np.uint8)
        denom = _E4M3_TABLE[scales] * gb  # float32: decoded scale x global, rounded once
        q = xb / denom[..., None]
        q = np.clip(q, -E2M1_MAX, E2M1_MAX).astype(np.float32)
        zero = denom == 0
        q[zero] = 0.0  # x / 0 is NaN or Inf: zero blocks encode as +0
    codes = q.astype(_F4).view(np.uint8) & 0x0F
    codes = codes.reshape(*lead, rows, K)
    return NVFP4Tensor(pack_nibbles(codes), np.ascontiguousarray(scales), g)


# ---------------------------------------------------------------------------------------------
# CUTLASS Sm1xxBlockScaledConfig scale layout
# ---------------------------------------------------------------------------------------------

SWIZZLE_ROWS = 128  # rows per scale atom
SWIZZLE_COLS = 4  # scale columns (64 elements of K) per atom; an atom is 512 bytes


def swizzled_size(rows: int, k16: int) -> int:
    """Bytes of the swizzled layout: rows padded to 128, K/16 padded to 4."""
    return _round_up(rows, SWIZZLE_ROWS) * _round_up(k16, SWIZZLE_COLS)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def swizzle_scales(scales) -> np.ndarray:
    """(..., rows, K16) uint8 -> (..., swizzled_size) uint8 in CUTLASS's block-scaled layout.

    ``off = (m//128)*(Kt*512) + (kb//4)*512 + (m%32)*16 + ((m%128)//32)*4 + kb%4`` with
    ``Kt = padded(K16)/4``; padding bytes are 0.
    """
    scales = np.asarray(scales)
    if scales.dtype != np.uint8 or scales.ndim < 2:
        raise ValueError(f"scales must be (..., rows, K16) uint8, got {scales.shape} {scales.dtype}")
    *lead, rows, k16 = scales.shape
    rp, kp = _round_up(rows, SWIZZLE_ROWS), _round_up(k16, SWIZZLE_COLS)
    padded = np.zeros((*lead, rp, kp), dtype=np.uint8)
    padded[..., :rows, :k16] = scales
    n = len(lead)
    # m = mb*128 + i*32 + j, kb = kt*4 + c  ->  byte order (mb, kt, j, i, c)
    t = padded.reshape(*lead, rp // 128, 4, 32, kp // 4, 4)
    t = t.transpose(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return np.ascontiguousarray(t).reshape(*lead, rp * kp)


def unswizzle_scales(buf, rows: int, k16: int) -> np.ndarray:
    """Inverse of :func:`swizzle_scales`: (..., swizzled_size) uint8 -> (..., rows, k16) uint8."""
    buf = np.asarray(buf)
    if rows < 0 or k16 < 0:
        raise ValueError(f"rows and k16 must be >= 0, got {rows}, {k16}")
    if buf.dtype != np.uint8 or buf.ndim < 1:
        raise ValueError(f"buf must be (..., nbytes) uint8, got {buf.shape} {buf.dtype}")
    rp, kp = _round_up(rows, SWIZZLE_ROWS), _round_up(k16, SWIZZLE_COLS)
    if buf.shape[-1] != rp * kp:
        raise ValueError(
            f"buf has {buf.shape[-1]} bytes, rows={rows}, k16={k16} need {rp * kp}"
        )
    lead = buf.shape[:-1]
    n = len(lead)
    t = buf.reshape(*lead, rp // 128, kp // 4, 32, 4, 4)  # (mb, kt, j, i, c)
    t = t.transpose(*range(n), n, n + 3, n + 2, n + 1, n + 4)  # (mb, i, j, kt, c)
    return np.ascontiguousarray(t.reshape(*lead, rp, kp)[..., :rows, :k16])
