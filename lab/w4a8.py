"""W4A8: NVFP4 weights on the fp8 (e4m3) tensor cores. The NumPy code here is the definition every
W4A8 kernel must match; the GEMM contract and the layer reference are float64.

Weights. The NVFP4 codes stay as they are in memory (lab/nvfp4.py: e2m1 nibbles, one e4m3 scale
per 16 elements, a float32 global per matrix). In registers each weight becomes one e4m3 value

    w8[n, k] = RNE_e4m3( e2m1(nibble) * e4m3(scale[n, k // 16]) * 2^-p )

with p an integer per expert (per matrix) or, optionally, per row; 2^p goes into the epilogue's
factor together with the global. The exact product m * s * 2^-p (m in {0, .5, 1, 1.5, 2, 3, 4, 6})
is rounded to nearest even onto e4m3 (subnormals included, 2^-10 and below flush to zero, ties
to even); the sign is the nibble's sign bit, kept on zeros (nibble 8, and a negative value that
flushes, give 0x80). No weight is saturated: p is chosen so that none exceeds 448.

The p rule (choose_p): p is the smallest integer with amax * 2^-p <= 448, where amax is the
largest |m * s| of the matrix (or row); an all-zero matrix gets p = 0. Smaller p never overflows
less, and larger p only pushes more values below e4m3's normal range (2^-6), so this p has the
fewest subnormal and flushed weights of all p that do not overflow. No product m * s lies in
(448, 464), the values that RNE without saturation would still take to 448, so "exceeds 448" and
"does not round to a finite e4m3" are the same test. amax <= 6 * 448 gives p <= 3; a p given by
the caller that lets a value exceed 448 raises ValueError naming ``p``. A matrix quantized with
its global computed from its amax (nvfp4.quantize without a global, as ModelOpt does) has a block
with scale 448 holding a 6, so amax = 2688 and p = 3 for every such matrix (w13's gate and up
halves alike): one table and a constant 2^3 in the epilogue. A per-row p differs from it only in
rows whose largest |m * s| is below 224, and changes only weights that fall below 2^-6 at p = 3
(|m * s| < 1/8: blocks some 2000 times below the matrix's amax); at or above 2^-6 which weights
round does not depend on p.

Which weights round. An e4m3 value has a 4-bit significand. With M the scale's significand
(8 + mantissa for a normal scale code, the mantissa for a subnormal one), m * s * 2^-p is
n * 2^L with n = (2m) * M an integer. m in {0.5, 1, 2, 4} only shifts, so those products are
exact wherever the result is normal; m in {1.5, 3, 6} multiplies M by 3, and 3 * M needs more
than 4 significant bits for normal scale mantissas 1, 3, 5, 6 and 7 (27, 33, 39, 42 = 0b101010,
45) and for the subnormal scale mantissa 7 (21); mantissas 0, 2, 4 (24, 30, 36) and subnormal
1..6 stay exact. (So not only odd mantissas: 0b110 rounds too.) A result below 2^-6 is exact iff
it is a multiple of 2^-9. predict_rounding states this rule from the bits; the tests check it
against the conversion over every scale code, magnitude and several p.

Decode table (magnitude_table): for a given p, the eight e4m3 magnitude bytes of a block, by
scale code: table[c, j] = RNE_e4m3(E2M1_GRID[j] * e4m3(c) * 2^-p), uint8 (128, 8), its rows read
as two little-endian uint32 words (magnitudes 0..3, then 4..7), the two source registers of a
byte permute. Entries that would exceed 448, and the whole row of the NaN scale code 0x7F, hold
0x7F (e4m3 NaN): a wrong p shows as NaN in the output instead of a silently saturated weight.
lab/kernels/gemm/decode_fp8.cuh decodes eight codes per 32-bit word through it, on the word
layout of decode_words (see there).

Activations (quantize_act), the 1x128 recipe: per row and per group of 128 columns of K (the
last group is short when K % 128 != 0, which is the same as zero-padding x to a multiple of 128;
the layer's K is a multiple of 64 by lab/problem.py), every operation in IEEE float32, RNE:

    amax  = max |x| over the group, raised to AMAX_FLOOR = 2^-116 (an all-zero group included)
    inv   = 448 / amax                  (one division per group)
    s_x   = amax / 448                  (the stored scale; a division, not 1 / inv)
    x8    = e4m3( clip(x * inv, -448, 448) )   RNE, so saturating as cvt.rn.satfinite does

The floor keeps inv finite and s_x a normal float32 (2^-116 / 448 > 2^-126) for any group, so
no NaN arises anywhere: an all-zero group gets codes 0 (0x80 for -0.0) and s_x = 2^-116 / 448.
The group's amax element maps to +-448 exactly (x * inv is within two float32 ulps of 448).
x * inv is not x / s_x (the product is cheaper in a kernel, and the scale that is stored is
the one the contract uses; the difference is two float32 roundings, far below e4m3's).
ml_dtypes.float8_e4m3fn's cast from float32 is RNE with subnormals, and turns values past 464
into NaN rather than saturating, hence the clip before it.

The contract (gemm), for grouped row t of expert e:

    out[t, n] = 2^p[e (, n)] * alpha[e] * sum_g s_x[t, g] * sum_{k in g} x8[t, k] * w8[e, n, k]

alpha is the weight's global (w2: w2_global; w13: 1, its gate and up globals are SwiGLU's, as in
lab/reference.py). Every product x8 * w8 is exact in float64, and so is each group's partial
sum; only the sums across groups round (relative 2^-53). A kernel's only deviation from it is
the tensor core's accumulation: fp8 wgmma keeps fewer mantissa bits than fp32 while it adds up a
group, whose partial the kernel promotes into an fp32 accumulator with s_x. gemm_abs gives the
same sum over |x8 * w8| (all factors positive), the per-element scale of that error: a kernel is
checked as |got - gemm| <= c * 2^-12 * gemm_abs (ACCUMULATION_REL is the 2^-12).

SwiGLU (swiglu_f32, the act kernel's definition bit for bit): on float32 h (the w13 GEMM's
output) with the expert's float32 gate and up globals, every step one IEEE float32 operation
rounded to nearest even, subnormals kept:

    g = h_gate * gate_global          u = h_up * up_global
    x = max(-|g|, -128)               (NaN -> -128, as fmax and PTX max.f32 ignore NaN)
    k = rint(x * LOG2E)               (an integer in [-185, 0], ties to even)
    r = (x - k * LN2_HI) - k * LN2_LO (Cody-Waite: k * LN2_HI and the first difference exact)
    q = EXP_POLY[0]; q = q * r + c for c in EXP_POLY[1:]   (Taylor to r^7, Horner, no FMA)
    t = (q * 2^(k+64)) * 2^-64        (exp(x), rounded once: the first product is exact)
    d = 1 + t
    silu = g / d                                  where g's sign bit is clear
         = (((x * q) / d) * 2^(k+64)) * 2^-64     where it is set (g * exp(g) / (1 + exp(g)),
                                                   its 2^k applied last so that it keeps every
                                                   bit down to the subnormals)
    a = silu * u

The exponential is not the libm one: no two libraries round exp alike, and a definition the
kernel and NumPy both compute from +, *, / and rint is reproducible bit for bit. Its accuracy,
measured over every finite float32 input (all 2^32 bit patterns, against float64): t within
EXP_ULPS = 1.22 ulp of exp(x) (the worst, 1.212, at x = -71.05), silu within SILU_ULPS = 3.35 ulp
of the float64 silu of the same float32 g (the worst, 3.344, at g = -5.939; subnormal results in
units of 2^-149); tests/test_w4a8.py checks both bounds on fresh draws. a = silu * u adds one
rounding: relative (2 SILU_ULPS + 1) 2^-24 where silu is normal. Against reference.swiglu on the
same h the float32 rounding of g adds (1 + |g|) 2^-24 relative (the exponential's condition
number), as for every float32 SwiGLU. For g <= -128 silu is -0 (the float64 value is below
2^-170). CUDA's expf is within 2 ulp but is not this function, which is why the act kernel does
not call it.

Layer (layer_rows): x -> quantize_act -> w13 (p13, alpha 1) -> h rounded to float32 -> SwiGLU
with the gate and up globals (swiglu_f32) -> quantize_act -> w2 (p2, alpha w2_global). Given a
w13 GEMM that returned the float64 contract rounded to float32, the kernels compute exactly
this; their only deviation is the GEMMs' accumulation.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from . import nvfp4, reference
from .problem import MoEWeights

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
E4M3_MIN_SUBNORMAL = 2.0**-9
FP8_GROUP = 128  # columns of K per activation scale (DeepSeek-V3's 1x128)
AMAX_FLOOR = np.float32(2.0**-116)  # see the module docstring: inv finite, s_x normal
ACCUMULATION_REL = 2.0**-12  # the bound is c x this x gemm_abs; c up to 5.05 measured (tests/test_w4a8_gemm.py C)
SCALE_CODES = 128  # non-negative e4m3 codes: the table's rows
NAN_CODE = 0x7F

_F8 = ml_dtypes.float8_e4m3fn
_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E4M3 = np.arange(256, dtype=np.uint8).view(_F8).astype(np.float64)  # NaN at 0x7F, 0xFF
_E4M3.setflags(write=False)
_F32_448 = np.float32(E4M3_MAX)


def decode_e4m3(codes) -> np.ndarray:
    """e4m3 bytes -> float64 (0x7F and 0xFF are NaN)."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise ValueError(f"e4m3 codes must be uint8, got {codes.dtype}")
    return _E4M3[codes]


def _rne_e4m3(magnitude32: np.ndarray) -> np.ndarray:
    """float32 magnitudes in [0, 448] (exact) -> e4m3 codes, RNE."""
    return magnitude32.astype(_F8).view(np.uint8)


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


def _check_weights(packed, scales) -> tuple[np.ndarray, np.ndarray]:
    packed, scales = np.asarray(packed), np.asarray(scales)
    if packed.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if packed.ndim < 2:
        raise ValueError(f"packed must be (..., rows, K/2), got shape {packed.shape}")
    nvfp4._check_block_shapes(packed, scales)
    bad = scales >= NAN_CODE
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"scales must be finite non-negative e4m3 codes 0x00..0x7E, got 0x{int(scales[at]):02X} "
                         f"at {at}")
    return packed, scales


_TOP_OF_BYTE = np.maximum(np.arange(256) & 7, (np.arange(256) >> 4) & 7).astype(np.uint8)  # larger magnitude index


def _row_amax(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(..., rows) float64: the largest |m * s| of each row, exact."""
    top = _TOP_OF_BYTE[packed].reshape(*scales.shape, nvfp4.BLOCK // 2)  # a byte holds two codes
    while top.shape[-1] > 1:  # halving: numpy's max over a short last axis is the slower way
        half = top.shape[-1] // 2
        top = np.maximum(top[..., :half], top[..., half:])
    top = top[..., 0]
    return (_GRID[top] * _E4M3[scales]).max(axis=-1, initial=0.0)


def smallest_p(amax) -> np.ndarray:
    """int32: the smallest p with amax * 2^-p <= 448 (exactly), 0 where amax is 0."""
    amax = np.asarray(amax, dtype=np.float64)
    pos = amax > 0
    safe = np.where(pos, amax, E4M3_MAX)
    p = np.ceil(np.log2(safe / E4M3_MAX)).astype(np.int64)
    p = np.where(np.ldexp(safe, -p) > E4M3_MAX, p + 1, p)  # log2 may land one off either way
    p = np.where(np.ldexp(safe, -(p - 1)) <= E4M3_MAX, p - 1, p)
    return np.where(pos, p, 0).astype(np.int32)


def choose_p(packed, scales, per_row: bool = False) -> np.ndarray:
    """The module docstring's p: (...) int32 for weights (..., rows, K/2) (one p per matrix, e.g.
    per expert of an (E, N, K/2) tensor), or (..., rows) with ``per_row``. Matrices are read one
    at a time (the unpacked codes of one matrix are the only temporary)."""
    packed, scales = _check_weights(packed, scales)
    lead = packed.shape[:-2]
    amax = np.zeros(packed.shape[:-1])

    def one(i) -> None:
        amax[i] = _row_amax(packed[i], scales[i])

    # matrices on the host's cores (NumPy's gathers release the GIL; each writes its own rows)
    with ThreadPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, 16))) as pool:
        list(pool.map(one, np.ndindex(*lead)))
    return smallest_p(amax if per_row else amax.max(axis=-1, initial=0.0))


def _broadcast_p(p, packed: np.ndarray) -> np.ndarray:
    """p as given (per matrix (...) or per row (..., rows)) -> (..., rows) int64."""
    arr = np.asarray(p)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"p must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    lead, rows = packed.shape[:-2], packed.shape[-2]
    if arr.shape == lead:
        return np.broadcast_to(arr[..., None], (*lead, rows))
    if arr.shape == (*lead, rows):
        return arr
    raise ValueError(f"p must have shape {lead} (per matrix) or {(*lead, rows)} (per row), got {arr.shape}")


@dataclass
class FP8Weights:
    """NVFP4 weights converted to e4m3 (module docstring). The counts are over all elements."""

    codes: np.ndarray  # (..., rows, K) uint8 e4m3 bytes, the sign bit from the nibble
    p: np.ndarray  # (...) or (..., rows) int32, as chosen or given
    rounded: int  # weights whose e4m3 value differs from m * s * 2^-p (flushed ones included)
    subnormal: int  # non-zero weights with |m * s * 2^-p| < 2^-6 (e4m3 subnormal or flushed)
    flushed: int  # non-zero weights that became zero
    nonzero: int  # weights with m * s != 0

    @property
    def size(self) -> int:
        return self.codes.size

    def values(self) -> np.ndarray:
        """float64 (..., rows, K): the e4m3 values, without 2^p and the global."""
        return decode_e4m3(self.codes)


def exact_values(packed, scales, p) -> np.ndarray:
    """float64 (..., rows, K): m * s * 2^-p, signed (exact in float64), p per matrix or per row."""
    packed, scales = _check_weights(packed, scales)
    pr = _broadcast_p(p, packed)
    v = nvfp4.dequantize_blocks(packed, scales)
    return np.ldexp(v, -pr[..., None])


def convert_weights(packed, scales, p=None, per_row: bool = False) -> FP8Weights:
    """NVFP4 (packed (..., rows, K/2), scales (..., rows, K/16)) -> FP8Weights.

    ``p``: None chooses it (choose_p, per matrix or with ``per_row`` per row); else integers of
    shape (...) or (..., rows). A p that lets any value exceed 448 raises ValueError naming p,
    the first such matrix or row, its amax and the smallest p it allows."""
    packed, scales = _check_weights(packed, scales)
    if p is None:
        p = choose_p(packed, scales, per_row)
    pr = _broadcast_p(p, packed)
    nib = nvfp4.unpack_nibbles(packed)
    mag = _GRID[nib & 7].reshape(*scales.shape, nvfp4.BLOCK) * _E4M3[scales][..., None]
    mag = np.ldexp(mag.reshape(nib.shape), -pr[..., None])  # exact: <= 6 significant bits
    over = mag > E4M3_MAX
    if over.any():
        at = tuple(int(i) for i in np.argwhere(over.any(axis=-1))[0])
        amax = float(np.ldexp(mag[at].max(), int(pr[at])))
        raise ValueError(f"p={int(pr[at])} lets weights of row {at} exceed 448 (amax |m * s| = {amax}); "
                         f"that row needs p >= {int(smallest_p(amax))}")
    codes = _rne_e4m3(mag.astype(np.float32)) | ((nib & 8) << 4).astype(np.uint8)
    got = _E4M3[codes & 0x7F]
    nonzero = mag > 0
    return FP8Weights(
        codes=codes,
        p=np.asarray(p).astype(np.int32),
        rounded=int(np.count_nonzero(got != mag)),
        subnormal=int(np.count_nonzero(nonzero & (mag < E4M3_MIN_NORMAL))),
        flushed=int(np.count_nonzero(nonzero & (got == 0))),
        nonzero=int(np.count_nonzero(nonzero)),
    )


def predict_rounding(scale_codes, magnitude_index, p) -> np.ndarray:
    """bool: does e2m1 magnitude ``magnitude_index`` (0..7) times e4m3 ``scale_codes`` (0..0x7E)
    times 2^-p round on its way to e4m3? The module docstring's rule, from the bits alone."""
    c = np.asarray(scale_codes).astype(np.int64)
    j = np.asarray(magnitude_index).astype(np.int64)
    p = np.asarray(p).astype(np.int64)
    expo, mant = c >> 3, c & 7
    sig = np.where(expo > 0, 8 + mant, mant)  # the scale is sig * 2^lsb
    lsb = np.where(expo > 0, expo - 10, -9)
    twice_m = np.array([0, 1, 2, 3, 4, 6, 8, 12])[j]  # 2m, an integer
    n = twice_m * sig  # the product is n * 2^(lsb - 1 - p)
    L = lsb - 1 - p
    zero = n == 0
    tz = np.zeros_like(n)
    odd = np.where(zero, 1, n)
    while (odd % 2 == 0).any():
        even = odd % 2 == 0
        odd = np.where(even, odd // 2, odd)
        tz = tz + even
    bits = np.floor(np.log2(np.where(zero, 1, n))).astype(np.int64)  # value = 2^(bits + L) * (1 + ...)
    normal = bits + L >= -6
    too_wide = np.ceil(np.log2(odd + 1)).astype(np.int64) > 4
    off_grid = L + tz < -9
    return ~zero & np.where(normal, too_wide, off_grid)


def magnitude_table(p: int) -> np.ndarray:
    """uint8 (128, 8): table[c, j] = RNE_e4m3(E2M1_GRID[j] * e4m3(c) * 2^-p); 0x7F (NaN) where
    that exceeds 448 and in row 0x7F. ``.view('<u4')`` gives each row's two permute registers."""
    p = int(p)
    s = _E4M3[:SCALE_CODES]
    mag = np.ldexp(_GRID[None, :] * np.where(np.isnan(s), 0.0, s)[:, None], -p)
    bad = (mag > E4M3_MAX) | np.isnan(s)[:, None]
    table = _rne_e4m3(np.where(bad, 0.0, mag).astype(np.float32))
    table[bad] = NAN_CODE
    return table


# ---------------------------------------------------------------------------------------------
# the decode word layout (lab/kernels/gemm/decode_fp8.cuh)
# ---------------------------------------------------------------------------------------------

INDEX_MASK = 0x77777777
SIGN_MASK = 0x80808080


def decode_words(packed) -> np.ndarray:
    """(..., K/2) NVFP4 packed codes -> (..., K/8) uint32 words in decode_fp8.cuh's layout.

    Word w holds elements e0..e7 = 8w..8w+7 (within one 16-element block). Bits 4j..4j+2 hold
    e_j's magnitude index (j = 0..7, the nibble order of the standard word); the eight nibble sign
    bits are re-laid: bit 8j+7 holds e_j's sign and bit 8j+3 holds e_(4+j)'s (j = 0..3). The low
    half (masked) is the permute selector of e0..e3, the high half that of e4..e7; the signs of
    e0..e3 already sit on their output bytes' bit 7, those of e4..e7 four bits below theirs."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim < 1 or packed.shape[-1] % 4:
        raise ValueError(f"packed must be uint8 (..., K/2) with K % 8 == 0, got {packed.dtype} {packed.shape}")
    nib = nvfp4.unpack_nibbles(packed).astype(np.uint32)
    nib = nib.reshape(*nib.shape[:-1], -1, 8)
    shifts = 4 * np.arange(8, dtype=np.uint32)
    words = ((nib & 7) << shifts).sum(axis=-1, dtype=np.uint32)
    sign = nib >> 3
    sign_bit = np.array([7, 15, 23, 31, 3, 11, 19, 27], dtype=np.uint32)
    words |= (sign << sign_bit).sum(axis=-1, dtype=np.uint32)
    return words.astype(np.uint32)


def decode_fp8_reference(words, table_lo, table_hi) -> tuple[np.ndarray, np.ndarray]:
    """What decode_fp8.cuh computes, element by element: words (uint32, decode_words' layout),
    table_lo / table_hi (..., 8) uint8 magnitude rows for e0..e3 and e4..e7 (the same row when
    the word lies in one block). Returns (out_lo, out_hi) uint32: byte j of out_lo is e_j's e4m3
    code, byte j of out_hi is e_(4+j)'s; each is table[index] with the element's sign bit."""
    w = np.asarray(words).astype(np.uint64)
    lo, hi = np.asarray(table_lo), np.asarray(table_hi)
    if lo.dtype != np.uint8 or hi.dtype != np.uint8 or lo.shape[-1] != 8 or hi.shape[-1] != 8:
        raise ValueError(f"table_lo and table_hi must be (..., 8) uint8, got {lo.dtype} {lo.shape}, "
                         f"{hi.dtype} {hi.shape}")
    sign_bit = [7, 15, 23, 31, 3, 11, 19, 27]
    outs = []
    for half, table in ((0, lo), (1, hi)):
        out = np.zeros(w.shape, np.uint64)
        for j in range(4):
            e = 4 * half + j
            idx = ((w >> np.uint64(4 * e)) & np.uint64(7)).astype(np.intp)
            byte = np.take_along_axis(np.broadcast_to(table, (*w.shape, 8)), idx[..., None], axis=-1)[..., 0]
            byte = byte.astype(np.uint64) | (((w >> np.uint64(sign_bit[e])) & np.uint64(1)) << np.uint64(7))
            out |= byte << np.uint64(8 * j)
        outs.append(out.astype(np.uint32))
    return outs[0], outs[1]


# ---------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------


def quantize_act(x, group: int = FP8_GROUP) -> tuple[np.ndarray, np.ndarray]:
    """x (rows, K) float -> (x8 (rows, K) uint8 e4m3 codes, s_x (rows, ceil(K / group)) float32),
    exactly as the module docstring says. NaN or Inf in x (after the float32 cast) raises
    ValueError naming x. ``group`` other than 128 is for studies (group = K: one scale per row)."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x must be (rows, K), got shape {x.shape}")
    if not isinstance(group, (int, np.integer)) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    with np.errstate(over="ignore"):
        xf = x.astype(np.float32)
    if not np.isfinite(xf).all():
        raise ValueError("x contains NaN or Inf (after conversion to float32)")
    rows, K = xf.shape
    G = -(-K // group)
    xp = np.zeros((rows, G * group), np.float32)
    xp[:, :K] = xf
    xb = xp.reshape(rows, G, group)
    amax = np.maximum(np.abs(xb).max(axis=-1, initial=np.float32(0)), AMAX_FLOOR)
    inv = (_F32_448 / amax).astype(np.float32)
    s_x = (amax / _F32_448).astype(np.float32)
    q = np.clip((xb * inv[..., None]).astype(np.float32), -_F32_448, _F32_448)
    x8 = q.astype(_F8).view(np.uint8).reshape(rows, G * group)[:, :K]
    return np.ascontiguousarray(x8), s_x


# ---------------------------------------------------------------------------------------------
# the contract
# ---------------------------------------------------------------------------------------------


def _scaled_rows(x8: np.ndarray, s_x: np.ndarray, group: int, absolute: bool) -> np.ndarray:
    """float64 (rows, K): x8 * s_x of its group, exact (4 x 24 significant bits)."""
    xd = decode_e4m3(x8)
    s = np.repeat(s_x.astype(np.float64), group, axis=1)[:, : x8.shape[1]]
    return np.abs(xd) * s if absolute else xd * s


def _check_codes(name: str, codes: np.ndarray) -> None:
    nan = (codes & 0x7F) == NAN_CODE
    if nan.any():
        at = tuple(int(i) for i in np.argwhere(nan)[0])
        raise ValueError(f"{name} holds the e4m3 NaN code 0x{int(codes[at]):02X} at {at}")


def _grouped(x8, s_x, offsets, num_experts: int, n: int, weight_of: Callable[[int], np.ndarray], p_of,
             alpha, experts, absolute: bool, group: int) -> np.ndarray:
    x8, s_x = np.asarray(x8), np.asarray(s_x)
    if x8.dtype != np.uint8 or x8.ndim != 2:
        raise ValueError(f"x8 must be (rows, K) uint8, got {x8.dtype} {x8.shape}")
    rows, K = x8.shape
    G = -(-K // group)
    if s_x.shape != (rows, G):
        raise ValueError(f"s_x must have shape {(rows, G)} (one per {group} columns of K), got {s_x.shape}")
    if not np.isfinite(s_x).all() or (s_x < 0).any():
        raise ValueError("s_x must be finite and >= 0")
    _check_codes("x8", x8)
    offs = reference._check_offsets(offsets, rows, num_experts)
    alpha = np.asarray(alpha, dtype=np.float64)
    if alpha.shape != (num_experts,):
        raise ValueError(f"alpha must have shape ({num_experts},), got {alpha.shape}")
    out = np.full((rows, n), np.nan)
    for e in reference._expert_list(experts, num_experts):
        r0, r1 = offs[e], offs[e + 1]
        if r1 == r0:
            continue
        w8 = weight_of(e)
        if w8.shape != (n, K):
            raise ValueError(f"expert {e}'s weights have shape {w8.shape}, expected {(n, K)}")
        wd = np.abs(decode_e4m3(w8)) if absolute else decode_e4m3(w8)
        xs = _scaled_rows(x8[r0:r1], s_x[r0:r1], group, absolute)
        factor = np.ldexp(abs(alpha[e]) if absolute else alpha[e], np.asarray(p_of(e)))
        out[r0:r1] = (xs @ wd.T) * factor
    return out


def _p_getter(p, num_experts: int, n: int):
    p = np.asarray(p)
    if p.dtype.kind not in "iu":
        raise ValueError(f"p must be integers, got {p.dtype}")
    if p.shape not in ((num_experts,), (num_experts, n)):
        raise ValueError(f"p must have shape ({num_experts},) or ({num_experts}, {n}), got {p.shape}")
    return lambda e: p[e].astype(np.int64)


def gemm(x8, s_x, offsets, w8, p, alpha, experts=None, group: int = FP8_GROUP) -> np.ndarray:
    """The W4A8 GEMM contract (module docstring): out (rows, N) float64 for x8 (rows, K) uint8,
    s_x (rows, ceil(K/128)) float32, offsets (E+1,), w8 (E, N, K) uint8 e4m3, p (E,) or (E, N)
    int, alpha (E,) float. Rows of experts not asked for are NaN."""
    return _gemm(x8, s_x, offsets, w8, p, alpha, experts, group, absolute=False)


# The accumulation bound a W4A8 kernel's output meets against gemm: |got - gemm| <= ACCUMULATION_C
# 2^-12 gemm_abs + TINY (measured, not a worst case: tests/test_w4a8_gemm.py says how it was set).
ACCUMULATION_C = 8.0
TINY = 2.0**-126  # one float32 result's rounding at the bottom of the normal range


def gemm_abs(x8, s_x, offsets, w8, p, alpha, experts=None, group: int = FP8_GROUP) -> np.ndarray:
    """gemm with every term's magnitude: 2^p |alpha| sum_g s_x sum_k |x8 w8| (rows, N) float64,
    the scale of the accumulation error a kernel may show (|got - gemm| <= c 2^-12 gemm_abs)."""
    return _gemm(x8, s_x, offsets, w8, p, alpha, experts, group, absolute=True)


def _gemm(x8, s_x, offsets, w8, p, alpha, experts, group: int, absolute: bool) -> np.ndarray:
    w8 = np.asarray(w8)
    if w8.dtype != np.uint8 or w8.ndim != 3:
        raise ValueError(f"w8 must be (E, N, K) uint8 e4m3 codes, got {w8.dtype} {w8.shape}")
    _check_codes("w8", w8)
    E, N, _ = w8.shape
    return _grouped(x8, s_x, offsets, E, N, lambda e: w8[e], _p_getter(p, E, N), alpha, experts, absolute, group)


def epilogue_factor(p, global_scale) -> np.ndarray:
    """float32 2^p * global, the kernel's epilogue factor: exact (a power-of-two scaling), or
    ValueError naming global_scale when it leaves the normal float32 range."""
    g = np.asarray(global_scale, dtype=np.float32)
    with np.errstate(over="ignore", under="ignore"):
        f = np.ldexp(g.astype(np.float64), np.asarray(p).astype(np.int64))
        f32 = f.astype(np.float32)
    if not (np.isfinite(f32).all() and (np.abs(f32[f32 != 0]) >= np.float32(2.0**-126)).all() and (f32 == f).all()):
        raise ValueError(f"global_scale: 2^p * global_scale leaves the normal float32 range (p={p!r})")
    return f32


# ---------------------------------------------------------------------------------------------
# SwiGLU in float32 (the module docstring's definition; lab/kernels/w4a8_act.cu swiglu_quant)
# ---------------------------------------------------------------------------------------------

LOG2E = np.float32(1.4426950408889634)  # 0x3FB8AA3B
LN2_HI = np.float32(0.693145751953125)  # 0x3F317200: 15 significant bits, so k * LN2_HI is exact for |k| < 512
LN2_LO = np.float32(1.428606820309417e-06)  # 0x35BFBE8E: ln 2 - LN2_HI, rounded
EXP_POLY = tuple(np.float32(1.0 / math.factorial(n)) for n in range(7, -1, -1))  # 1/7! .. 1/0!, Horner order
EXP_FLOOR = np.float32(-128.0)  # exp(-128) and silu(-128) are far below float32's smallest subnormal
EXP_ULPS = 1.22  # the module docstring's accuracy figures (exhaustive over float32; not a tolerance)
SILU_ULPS = 3.35
_F32_ONE = np.float32(1.0)
_F32_2M64 = np.float32(2.0**-64)


def _pow2(k: np.ndarray) -> np.ndarray:
    """float32 2^(k+64) for int32 k in [-190, 63], from the bits (exact, normal)."""
    return ((k.astype(np.int32) + np.int32(64 + 127)) << np.int32(23)).astype(np.int32).view(np.float32)


def exp_parts(x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The definition's exponential of float32 x <= 0 (or NaN), in parts: (x clamped to
    [EXP_FLOOR, 0], q float32 in [0.7, 1.42], k int32) with exp(x) ~ q * 2^k."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    with np.errstate(all="ignore"):
        xc = np.fmax(x, EXP_FLOOR)
        k = np.rint(xc * LOG2E)
        r = (xc - k * LN2_HI) - k * LN2_LO
        q = np.full(xc.shape, EXP_POLY[0], np.float32)
        for c in EXP_POLY[1:]:
            q = q * r + c
    return xc, q, k.astype(np.int32)


def _scale(v: np.ndarray, k: np.ndarray) -> np.ndarray:
    """v * 2^k rounded once: the first product is exact wherever the module docstring uses it."""
    with np.errstate(all="ignore"):
        return (v * _pow2(k)) * _F32_2M64


def exp_f32(x) -> np.ndarray:
    """The definition's exp(x) for float32 x <= 0: t of the module docstring."""
    _, q, k = exp_parts(x)
    return _scale(q, k)


def silu_f32(g) -> np.ndarray:
    """The definition's silu(g) = g / (1 + exp(-g)) for float32 g (module docstring)."""
    g = np.asarray(g)
    if g.dtype != np.float32:
        raise ValueError(f"g must be float32, got {g.dtype}")
    x, q, k = exp_parts(-np.abs(g))
    with np.errstate(all="ignore"):
        d = _F32_ONE + _scale(q, k)
        return np.where(np.signbit(g), _scale((x * q) / d, k), g / d)


def _row_globals(name: str, value, offsets: np.ndarray) -> np.ndarray:
    v = np.asarray(value)
    if v.dtype != np.float32 or v.shape != (len(offsets) - 1,):
        raise ValueError(f"{name}: expected ({len(offsets) - 1},) float32 (one per expert), got {v.shape} {v.dtype}")
    return np.repeat(v, np.diff(offsets))


def _expert_mask(offsets: np.ndarray, experts) -> np.ndarray:
    mask = np.zeros(int(offsets[-1]), bool)
    for e in reference._expert_list(experts, len(offsets) - 1):
        mask[offsets[e]: offsets[e + 1]] = True
    return mask


def swiglu_f32(h, offsets, gate_global, up_global, experts=None) -> np.ndarray:
    """a (rows, I) float32 = silu_f32(h_gate * gate_global[e]) * (h_up * up_global[e]) in float32,
    the module docstring's definition, for h (rows, 2I) float32 grouped by offsets (E+1,) and
    gate/up globals (E,) float32. Rows of experts not in ``experts`` are NaN (their h may be).
    NaN or Inf in the rows computed, or an a that overflows float32, raises ValueError naming h."""
    h = np.asarray(h)
    if h.dtype != np.float32 or h.ndim != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be (rows, 2I) float32, got {h.dtype} {h.shape}")
    rows, I = h.shape[0], h.shape[1] // 2
    offs = reference._check_offsets(offsets, rows, len(np.asarray(offsets)) - 1)
    gate, up = _row_globals("gate_global", gate_global, offs), _row_globals("up_global", up_global, offs)
    mask = _expert_mask(offs, experts)
    hm = h[mask]
    if not np.isfinite(hm).all():
        at = np.argwhere(~np.isfinite(hm))[0]
        raise ValueError(f"h holds NaN or Inf (row {int(np.flatnonzero(mask)[at[0]])}, column {int(at[1])})")
    with np.errstate(all="ignore"):
        g = hm[:, :I] * gate[mask][:, None]
        u = hm[:, I:] * up[mask][:, None]
        am = silu_f32(g) * u
    if not np.isfinite(am).all():
        at = np.argwhere(~np.isfinite(am))[0]
        raise ValueError(f"h: the SwiGLU overflows float32 at row {int(np.flatnonzero(mask)[at[0]])}, column "
                         f"{int(at[1])}")
    a = np.full((rows, I), np.nan, np.float32)
    a[mask] = am
    return a


def swiglu_quant(h, offsets, gate_global, up_global, experts=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The act stage: (a (rows, I) float32, a8 (rows, I) uint8, s_a (rows, ceil(I/128)) float32) =
    swiglu_f32 then quantize_act, what the act kernel writes bit for bit. Rows of experts not
    asked for: a NaN, codes and scales zero."""
    a = swiglu_f32(h, offsets, gate_global, up_global, experts)
    a8, s_a = _quantize_rows(a, offsets, experts)
    return a, a8, s_a


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------


def layer_p(weights: MoEWeights, per_row: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(p13, p2): choose_p of w13 (gate and up rows together) and of w2, per expert or per row."""
    return (choose_p(weights.w13_packed, weights.w13_scales, per_row),
            choose_p(weights.w2_packed, weights.w2_scales, per_row))


def _quantize_rows(a: np.ndarray, offsets, experts) -> tuple[np.ndarray, np.ndarray]:
    """quantize_act of the rows of `experts` only (the others may be NaN): zero codes and zero
    scales elsewhere, as reference.quantize_activations does."""
    if experts is None:
        return quantize_act(a)
    offs = reference._check_offsets(offsets, a.shape[0], len(offsets) - 1)
    mask = np.zeros(a.shape[0], bool)
    for e in reference._expert_list(experts, len(offs) - 1):
        mask[offs[e]: offs[e + 1]] = True
    x8 = np.zeros(a.shape, np.uint8)
    s = np.zeros((a.shape[0], -(-a.shape[1] // FP8_GROUP)), np.float32)
    x8[mask], s[mask] = quantize_act(a[mask])
    return x8, s


def layer_rows(x_rows, offsets, weights: MoEWeights, p13=None, p2=None, per_row: bool = False,
               experts=None) -> dict:
    """The W4A8 layer on grouped rows x_rows (rows, H) with offsets (E+1,), stage by stage as
    reference.layer_rows does for W4A4:

        x8, s_x = quantize_act(x_rows)
        h   = gemm(x8, s_x, w13 e4m3 with p13, alpha 1)       (rows, 2I) float64, with 2^p13
        a, a8, s_a = swiglu_quant(float32(h), gate_global, up_global)   a (rows, I) float32
        out = gemm(a8, s_a, w2 e4m3 with p2, alpha w2_global) (rows, H) float64

    p13 / p2: None (choose_p per expert, or per row with ``per_row``) or given. Weights are
    converted one expert at a time. Returns x8, s_x, h, a, a8, s_a, out, p13, p2."""
    x_rows = np.asarray(x_rows)
    E, I, H = weights.experts, weights.intermediate, weights.hidden
    if x_rows.ndim != 2 or x_rows.shape[1] != H:
        raise ValueError(f"x_rows must be (rows, H={H}), got {x_rows.shape}")
    sel = reference._expert_list(experts, E)
    if p13 is None or p2 is None:
        auto13, auto2 = np.zeros((E, 2 * I) if per_row else E, np.int32), np.zeros((E, H) if per_row else E, np.int32)
        for e in sel:
            auto13[e] = choose_p(weights.w13_packed[e], weights.w13_scales[e], per_row)
            auto2[e] = choose_p(weights.w2_packed[e], weights.w2_scales[e], per_row)
        p13 = auto13 if p13 is None else p13
        p2 = auto2 if p2 is None else p2
    p13, p2 = np.asarray(p13), np.asarray(p2)
    x8, s_x = quantize_act(x_rows)

    def w13_of(e):
        return convert_weights(weights.w13_packed[e], weights.w13_scales[e], p13[e]).codes

    def w2_of(e):
        return convert_weights(weights.w2_packed[e], weights.w2_scales[e], p2[e]).codes

    h = _grouped(x8, s_x, offsets, E, 2 * I, w13_of, _p_getter(p13, E, 2 * I), np.ones(E), experts, False,
                 FP8_GROUP)
    with np.errstate(over="ignore"):
        h32 = h.astype(np.float32)  # what a w13 GEMM without accumulation error would write
    a, a8, s_a = swiglu_quant(h32, offsets, weights.gate_global, weights.up_global, experts)
    out = _grouped(a8, s_a, offsets, E, H, w2_of, _p_getter(p2, E, H), weights.w2_global.astype(np.float64),
                   experts, False, FP8_GROUP)
    return {"x8": x8, "s_x": s_x, "h": h, "a": a, "a8": a8, "s_a": s_a, "out": out, "p13": p13, "p2": p2}
