"""Activation kernels: NVFP4 quantize, SwiGLU + quantize, fp32 -> bf16.

CPU: the kernel's arithmetic (e2m1 thresholds, e4m3 decode by bits, bf16 rounding by bits)
re-run in NumPy against lab.nvfp4 / ml_dtypes, argument checks, and ptxas (no spills).
GPU: the kernels themselves, bit for bit against lab.nvfp4.quantize.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lab import nvfp4, reference
from lab.kernels import jit
from lab.kernels import swiglu_quant as sq
from strategies import nvfp4_blocks, ragged_counts

f32 = np.float32
MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], f32)


# ---------------------------------------------------------------------------------------------
# inputs that hit every rule of the format
# ---------------------------------------------------------------------------------------------


def hard_matrix(seed: int, rows: int, blocks: int, g: float) -> np.ndarray:
    """(rows, 16 * blocks) float32 whose blocks are each one of: Gaussian at a random decade,
    exact e2m1 midpoints (ties), one ulp off midpoints, zeros and -0.0, saturating (scale input
    past 448), tiny (scale rounds to 0 or to an e4m3 subnormal), and grid values with negatives
    that round to -0."""
    rng = np.random.default_rng(seed)
    g = f32(g)
    x = np.empty((rows, blocks, 16), f32)
    s_vals = nvfp4.decode_e4m3(np.arange(1, 0x7F, dtype=np.uint8))
    for r in range(rows):
        for b in range(blocks):
            kind = rng.integers(0, 7)
            if kind == 0:  # Gaussian over many decades
                x[r, b] = rng.standard_normal(16) * f32(10.0 ** rng.uniform(-8, 4))
            elif kind in (1, 2):  # midpoints of a scale s: amax 6*s*g pins the scale to s
                denom = f32(rng.choice(s_vals) * g)
                el = rng.choice(MIDPOINTS, 16) * denom * rng.choice([-1, 1], 16)
                el = el.astype(f32)
                if kind == 2:
                    el = np.nextafter(el, rng.choice([-np.inf, np.inf], 16).astype(f32)).astype(f32)
                el[0] = f32(6) * denom
                x[r, b] = el
            elif kind == 3:  # zeros, -0.0 and a few tiny negatives
                x[r, b] = 0
                x[r, b, rng.integers(0, 16, 4)] = -0.0
                if rng.random() < 0.5:
                    x[r, b, rng.integers(0, 16)] = 1.0
                    x[r, b, rng.integers(0, 16, 3)] = -1e-3
            elif kind == 4:  # saturating block scale
                x[r, b] = rng.standard_normal(16) * f32(448 * 6) * g * f32(rng.uniform(1, 100))
            elif kind == 5:  # tiny: scale input near 2**-10 (zero code) and e4m3 subnormals
                amax = f32(6) * g * f32(2.0 ** rng.uniform(-11, -5))
                x[r, b] = (rng.uniform(-1, 1, 16) * amax).astype(f32)
                x[r, b, 0] = amax
            else:  # grid values x scale x g, with negatives that round to -0
                denom = f32(rng.choice(s_vals) * g)
                x[r, b] = rng.choice(nvfp4.E2M1_VALUES, 16) * denom
                x[r, b, rng.integers(0, 16)] = -0.1 * denom
    return x.reshape(rows, blocks * 16).astype(f32)


# ---------------------------------------------------------------------------------------------
# CPU: the kernel's arithmetic in NumPy
# ---------------------------------------------------------------------------------------------


def kernel_e2m1(q, xp=np):
    """swiglu_quant.cu e2m1_encode: threshold comparisons on |q|, sign bit copied (NumPy or CuPy)."""
    a = xp.abs(q)
    i = ((a > 0.25).astype(xp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) +
         (a > 5.0)).astype(xp.uint8)
    return i | ((q.view(xp.uint32) >> 28) & 8).astype(xp.uint8)


def kernel_e4m3_decode(c: np.ndarray) -> np.ndarray:
    """swiglu_quant.cu e4m3_decode: exponent field 0 -> m * 2^-9, else float32 bits."""
    c = c.astype(np.uint32)
    e, m = (c >> 3) & 0xF, c & 7
    normal = (((e + 120) << 23) | (m << 20)).astype(np.uint32).view(f32)
    return np.where(e == 0, m.astype(f32) * f32(2.0**-9), normal).astype(f32)


def kernel_bf16(x, xp=np):
    """nvfp4_act.cuh bf16x2_bits, one value at a time (NumPy or CuPy)."""
    u = x.astype(xp.float32).view(xp.uint32).astype(xp.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return xp.where(nan, (u >> 16) | 0x40, r).astype(xp.uint16)


def kernel_quantize(x: np.ndarray, g) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's quantize4 on whole rows (ml_dtypes standing in for the e4m3 cvt)."""
    g = f32(g)
    rows, K = x.shape
    xb = x.astype(f32).reshape(rows, K // 16, 16)
    amax = np.abs(xb).max(axis=-1)
    s_in = np.minimum(amax / (f32(6) * g), f32(448)).astype(f32)
    code = s_in.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    denom = (kernel_e4m3_decode(code) * g).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.minimum(np.maximum(xb / denom[..., None], f32(-6)), f32(6)).astype(f32)
    nib = np.where(denom[..., None] != 0, kernel_e2m1(q), 0).astype(np.uint8)
    return nvfp4.pack_nibbles(nib.reshape(rows, K)), code


def test_e2m1_thresholds_match_ml_dtypes_on_every_midpoint_and_neighbour():
    grid = nvfp4.E2M1_VALUES[:8]
    pts = np.concatenate([grid, MIDPOINTS, np.float32([1e-30, 2.0**-149, 5.9999995, 6.0])])
    near = np.concatenate([pts, np.nextafter(pts, f32(np.inf)), np.nextafter(pts, f32(-np.inf))])
    near = np.concatenate([near, -near, np.float32([0.0, -0.0])])
    near = np.clip(near, -6, 6).astype(f32)
    want = near.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    np.testing.assert_array_equal(kernel_e2m1(near), want)


def test_e4m3_decode_by_bits_matches_every_finite_code():
    codes = np.arange(0, 0x7F, dtype=np.uint8)
    np.testing.assert_array_equal(kernel_e4m3_decode(codes), nvfp4.decode_e4m3(codes))


BF16_EDGES = np.array([0, 0x80000000, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x00008000, 0x7F800000,
                       0x00007FFF, 0x807FFFFF, 0x7F7F8000, 0xFF7F7FFF], np.uint32)  # ties, subnormals, overflow


def float32_bits(shape):
    """float32 bit patterns drawn whole: every sign, exponent and the low 16 bits bf16 rounds on
    (ties 0x8000 among them), so a failure shrinks to the value that rounds wrong."""
    high = st.one_of(st.integers(0, 0xFFFF), st.sampled_from([0x0000, 0x8000, 0x7F7F, 0xFF7F, 0x3F80, 0x0080]))
    low = st.one_of(st.integers(0, 0xFFFF), st.sampled_from([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF]))
    return hnp.arrays(np.uint32, shape, elements=st.tuples(high, low).map(lambda hl: hl[0] << 16 | hl[1]))


@settings(max_examples=200)
@given(float32_bits(st.integers(1, 64)))
def test_bf16_rounding_by_bits_matches_ml_dtypes(bits):
    bits = np.concatenate([BF16_EDGES, bits])
    x = bits.view(f32)
    x = x[~np.isnan(x)]  # ml_dtypes keeps NaN payloads its own way; the GPU test checks NaNs
    np.testing.assert_array_equal(kernel_bf16(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))


@settings(max_examples=150)
@given(nvfp4_blocks(max_rows=6, max_blocks=6, static_global=True))
def test_kernel_arithmetic_equals_nvfp4_quantize(case):
    """The quantizer as the kernel writes it (thresholds, decode by bits, zero-block rule, sign
    rule) is lab.nvfp4's definition, on ties, zeros, saturation and subnormal scales."""
    x, g = case
    t = nvfp4.quantize(x, g)
    packed, scales = kernel_quantize(x, g)
    np.testing.assert_array_equal(scales, t.scales)
    np.testing.assert_array_equal(packed, t.packed)


def test_hard_matrix_covers_every_rule():
    x = np.concatenate([hard_matrix(s, 8, 8, 0.01) for s in range(4)])
    t = nvfp4.quantize(x, 0.01)
    nib = nvfp4.unpack_nibbles(t.packed)
    assert (t.scales == 0).any() and (t.scales == 0x7E).any()  # zero blocks, saturated blocks
    assert ((t.scales > 0) & (t.scales < 8)).any()  # e4m3 subnormal scales
    assert (nib == 8).any() and (nib == 7).any() and (nib == 15).any()  # -0, +-6


# ---------------------------------------------------------------------------------------------
# CPU: argument checks and ptxas
# ---------------------------------------------------------------------------------------------


def _qargs(rows=4, k=64, t=None, dtype=np.float32):
    t = rows if t is None else t
    return (np.zeros((t, k), dtype), np.zeros((rows, k // 2), np.uint8), np.zeros((rows, k // 16), np.uint8),
            np.zeros(1, np.uint32))


@pytest.mark.parametrize("mutate, word", [
    (lambda a: (np.zeros((4, 60), np.float32),) + a[1:], "K=60"),  # K not a multiple of 16
    (lambda a: (np.zeros((4, 64), np.float64),) + a[1:], "x: expected"),  # float64 input
    (lambda a: (np.zeros(64, np.float32),) + a[1:], "x: expected (T, K)"),  # 1-D input
    (lambda a: (np.zeros((4, 128), np.float32)[:, ::2],) + a[1:], "C-contiguous"),  # strided
    (lambda a: a[:1] + (np.zeros((4, 31), np.uint8),) + a[2:], "out_packed"),
    (lambda a: a[:2] + (np.zeros((4, 4), np.float32),) + a[3:], "out_scales"),
    (lambda a: a[:3] + (np.zeros(2, np.uint32),), "counter"),
])
def test_quantize_input_rejects_bad_arguments(mutate, word):
    with pytest.raises(ValueError, match=word.replace("(", r"\(").replace(")", r"\)")):
        sq.check_quantize_input(*mutate(_qargs()))


def test_quantize_input_checks_row_token_and_accepts_bf16_bits():
    x, p, s, c = _qargs(rows=6, t=3, dtype=np.uint16)
    assert sq.check_quantize_input(x, p, s, c, np.zeros(6, np.int32)) == (6, 64)
    with pytest.raises(ValueError, match="row_token"):
        sq.check_quantize_input(x, p, s, c, np.zeros(6, np.int64))
    with pytest.raises(ValueError, match="out_packed"):  # outputs follow row_token's length
        sq.check_quantize_input(x, p, s, c, np.zeros(5, np.int32))


def _sargs(rows=5, i=64, e=3):
    return dict(h=np.zeros((rows, 2 * i), np.float32), offsets=np.zeros(e + 1, np.int32),
                gate_global=np.ones(e, np.float32), up_global=np.ones(e, np.float32),
                out_packed=np.zeros((rows, i // 2), np.uint8), out_scales=np.zeros((rows, i // 16), np.uint8),
                counter=np.zeros(1, np.uint32))


@pytest.mark.parametrize("key, value, word", [
    ("h", np.zeros((5, 100), np.float32), "h: expected"),  # 2I not a multiple of 32
    ("h", np.zeros((5, 128), np.float16), "h: expected"),
    ("offsets", np.zeros(4, np.int64), "offsets"),
    ("offsets", np.zeros(1, np.int32), "offsets"),  # no expert
    ("gate_global", np.ones(2, np.float32), "gate_global"),
    ("up_global", np.ones(3, np.float64), "up_global"),
    ("out_packed", np.zeros((5, 64), np.uint8), "out_packed"),
    ("out_scales", np.zeros((4, 4), np.uint8), "out_scales"),
    ("counter", np.zeros(1, np.int64), "counter"),
])
def test_swiglu_quant_rejects_bad_arguments(key, value, word):
    args = _sargs()
    assert sq.check_swiglu_quant(**args) == (5, 64, 3)
    args[key] = value
    with pytest.raises(ValueError, match=word):
        sq.check_swiglu_quant(**args)
    with pytest.raises(ValueError, match="a_out"):
        sq.check_swiglu_quant(**_sargs(), a_out=np.zeros((5, 63), np.float32))


@pytest.mark.parametrize("bad", [(0, 5), (5, 4), (1.5, 3), "ab", (1, 2, 3), (1, 2**31)])
def test_swiglu_quant_rejects_bad_counts_in_before_the_gpu(bad):
    """A size class that is not 1 <= lo <= hi < 2**31 is refused before any device work (the
    host arrays here would be refused after it)."""
    args = _sargs()
    with pytest.raises(ValueError, match="counts_in"):
        sq.swiglu_quant(args["h"], args["offsets"], args["gate_global"], args["up_global"], 0.01,
                        args["out_packed"], args["out_scales"], args["counter"], counts_in=bad)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), 1e39])
def test_global_scale_must_be_finite_positive_float32(value):
    with pytest.raises(ValueError, match="global"):
        sq.check_global("global_scale", value)


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("expression", sq.EXPRESSIONS)
def test_kernels_compile_for_sm90a_without_spills(expression):
    info = jit.ptxas_report(sq.SOURCE, expression)
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info
    assert info.registers <= 64, info


# ---------------------------------------------------------------------------------------------
# GPU: the kernels
# ---------------------------------------------------------------------------------------------


def gpu_quantize(x, g, row_token=None):
    import cupy as cp

    rows = x.shape[0] if row_token is None else len(row_token)
    k = x.shape[1]
    packed = cp.full((rows, k // 2), 0xAA, cp.uint8)
    scales = cp.full((rows, k // 16), 0xAA, cp.uint8)
    counter = cp.zeros(1, cp.uint32)
    rt = None if row_token is None else cp.asarray(row_token, dtype=cp.int32)
    sq.quantize_input(cp.asarray(x), g, packed, scales, counter, row_token=rt)
    return packed.get(), scales.get(), int(counter.get()[0])


def assert_codes_equal(got_packed, got_scales, t: nvfp4.NVFP4Tensor):
    """Bitwise equality, reporting the first differing element."""
    bad = np.argwhere(got_scales != t.scales)
    assert bad.size == 0, f"scale differs first at {tuple(bad[0])}: {got_scales[tuple(bad[0])]:#x} vs {t.scales[tuple(bad[0])]:#x}"
    gn, wn = nvfp4.unpack_nibbles(got_packed), nvfp4.unpack_nibbles(t.packed)
    bad = np.argwhere(gn != wn)
    assert bad.size == 0, f"code differs first at {tuple(bad[0])}: {gn[tuple(bad[0])]} vs {wn[tuple(bad[0])]}"


@pytest.mark.gpu
@settings(max_examples=40)
@given(nvfp4_blocks(max_rows=9, max_blocks=40, static_global=True))
def test_gpu_quantize_input_matches_nvfp4_bit_for_bit(case):
    """Ties, zeros, -0.0, saturating and subnormal scales, drawn block by block; K up to 640 so
    a row spans several block steps of the kernel's loop. The NumPy copy of the kernel's
    arithmetic (kernel_quantize) gives the same bits as the kernel itself."""
    x, g = case
    packed, scales, bad = gpu_quantize(x, g)
    assert bad == 0
    assert_codes_equal(packed, scales, nvfp4.quantize(x, g))
    kp, ks = kernel_quantize(x, g)
    np.testing.assert_array_equal(scales, ks)
    np.testing.assert_array_equal(packed, kp)


@pytest.mark.gpu
def test_gpu_every_scale_code_decodes_like_kernel_e4m3_decode():
    """Each of the 126 finite positive scale codes pinned by its block's amax (6 * s), the other
    elements on e2m1 values and midpoints times s and one ulp beside them: the codes depend on
    the kernel's decode of s through s * g, so they match kernel_quantize (kernel_e4m3_decode)
    and lab.nvfp4 for every code."""
    rng = np.random.default_rng()
    codes = np.arange(1, 0x7F, dtype=np.uint8)
    s = kernel_e4m3_decode(codes)
    steps = np.concatenate([nvfp4.E2M1_VALUES[:8], MIDPOINTS])
    el = (rng.choice(steps, (codes.size, 4, 15)) * s[:, None, None]).astype(f32)
    el = np.where(rng.random(el.shape) < 0.5, el, np.nextafter(el, rng.choice([-np.inf, np.inf], el.shape).astype(f32)))
    el = np.where(rng.random(el.shape) < 0.5, el, -el).astype(f32)
    x = np.concatenate([np.broadcast_to((f32(6) * s)[:, None, None], (codes.size, 4, 1)), el], axis=-1)
    x = x.reshape(codes.size, 64).astype(f32)
    packed, scales, bad = gpu_quantize(x, 1.0)
    assert bad == 0 and (scales == codes[:, None]).all()
    kp, ks = kernel_quantize(x, 1.0)
    np.testing.assert_array_equal(scales, ks)
    np.testing.assert_array_equal(packed, kp)
    assert_codes_equal(packed, scales, nvfp4.quantize(x, 1.0))


@pytest.mark.gpu
def test_gpu_e2m1_encode_is_kernel_e2m1_on_every_float32_in_range():
    """Every float32 in [-6, 6] (subnormals and -0.0 included) as q = x / (s * g) with s * g = 1:
    blocks of 16 whose first element 6 pins the scale to 1.0 (0x38) under global 1, so each code
    is the kernel's e2m1_encode of the value itself, against kernel_e2m1 on the device."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    top = int(np.float32(6).view(np.uint32))
    rows, free = 1 << 21, 16 * 15  # 16 blocks of K = 256 a row, 15 free elements each
    x = cp.empty((rows, 16, 16), cp.float32)
    packed, scales = cp.empty((rows, 128), cp.uint8), cp.empty((rows, 16), cp.uint8)
    counter = cp.zeros(1, cp.uint32)
    seen = 0
    for sign in (0, 0x80000000):
        for start in range(0, top + 1, rows * free):
            bits = cp.zeros(rows * free, cp.uint32)  # +0.0 pads the last chunk
            n = min(rows * free, top + 1 - start)
            bits[:n] = cp.arange(start, start + n, dtype=cp.uint32) | cp.uint32(sign)
            seen += n
            x[:, :, 0] = 6.0
            x[:, :, 1:] = bits.view(cp.float32).reshape(rows, 16, 15)
            packed.fill(0xAA)
            scales.fill(0xAA)
            sq.quantize_input(x.reshape(rows, 256), 1.0, packed, scales, counter)
            assert bool((scales == 0x38).all())
            nib = cp.stack([packed & 15, packed >> 4], axis=-1).reshape(rows, 16, 16)
            want = kernel_e2m1(x, xp=cp)
            bad = cp.argwhere(nib != want)
            if bad.size:
                r, b, c = (int(v) for v in bad[0])
                v = float(x[r, b, c])
                pytest.fail(f"{int(bad.shape[0])} codes differ; first {v!r} ({np.float32(v).view(np.uint32):#010x}): "
                            f"kernel {int(nib[r, b, c])}, kernel_e2m1 {int(want[r, b, c])}")
    assert seen == 2 * (top + 1) and int(counter.get()[0]) == 0


@pytest.mark.gpu
def test_gpu_quantize_on_rounding_boundaries_for_many_globals():
    rng = np.random.default_rng(3)
    for g in np.exp(rng.uniform(np.log(1e-7), np.log(1e2), 24)).astype(f32):
        x = hard_matrix(int(rng.integers(2**31)), 64, 8, g)
        packed, scales, bad = gpu_quantize(x, g)
        assert bad == 0
        assert_codes_equal(packed, scales, nvfp4.quantize(x, g))


@pytest.mark.gpu
@settings(max_examples=20)
@given(st.integers(0, 2**31), st.integers(1, 20), st.integers(1, 12))
def test_gpu_quantize_bf16_input_with_gather(seed, tokens, rows):
    """bf16 bits in, rows gathered by row_token (repeats allowed): row r is quantize(x[rt[r]])."""
    rng = np.random.default_rng(seed)
    g = f32(32 / 2688)
    x = (rng.standard_normal((tokens, 256)) * 10.0 ** rng.uniform(-3, 1)).astype(ml_dtypes.bfloat16)
    rt = rng.integers(0, tokens, rows).astype(np.int32)
    packed, scales, bad = gpu_quantize(x.view(np.uint16), g, rt)
    assert bad == 0
    assert_codes_equal(packed, scales, nvfp4.quantize(x[rt], g))


@pytest.mark.gpu
def test_gpu_quantize_counts_non_finite_inputs():
    x = hard_matrix(0, 4, 8, 0.01)
    packed, scales, bad = gpu_quantize(x, 0.01)
    assert bad == 0
    x[1, 3], x[2, 100], x[3, 127] = np.nan, np.inf, -np.inf
    assert gpu_quantize(x, 0.01)[2] == 3
    xb = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert gpu_quantize(xb, 0.01)[2] == 3


def gpu_swiglu(h, offsets, gate, up, g2, a_out=True):
    import cupy as cp

    rows, two_i = h.shape
    i = two_i // 2
    packed = cp.full((rows, i // 2), 0xAA, cp.uint8)
    scales = cp.full((rows, i // 16), 0xAA, cp.uint8)
    counter = cp.zeros(1, cp.uint32)
    a = cp.full((rows, i), cp.nan, cp.float32) if a_out else None
    sq.swiglu_quant(cp.asarray(h), cp.asarray(offsets), cp.asarray(gate), cp.asarray(up), g2, packed, scales,
                    counter, a_out=a)
    return packed.get(), scales.get(), (a.get() if a_out else None), int(counter.get()[0])


def assert_swiglu_close(a, ref, h, offsets, gate, up):
    """fp32 SwiGLU within a few ulp of float64: g carries half an ulp, which silu's condition
    number (1 + |g|) amplifies; expf adds 2 ulp. Below 2^-126, where expf(-|g|) may lose its
    subnormal digits, the error is bounded absolutely by |g u| 2^-125."""
    i = h.shape[1] // 2
    e = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    g = np.abs(h[:, :i].astype(np.float64) * gate[e][:, None])
    u = np.abs(h[:, i:].astype(np.float64) * up[e][:, None])
    bound = np.abs(ref) * 2.0**-24 * (8 + 2 * g) + (1 + g) * u * 2.0**-125 + 2.0**-149
    err = np.abs(a - ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"a{worst} = {a[worst]!r}, float64 {ref[worst]!r}"


@pytest.mark.gpu
@settings(max_examples=30)
@given(counts=ragged_counts(max_experts=7, hot=(20, 40)), i=st.sampled_from([16, 64, 256, 1088]),
       seed=st.integers(0, 2**31), data=st.data())
def test_gpu_swiglu_quant_codes_are_nvfp4_of_its_fp32_values(counts, i, seed, data):
    """Codes and scales equal nvfp4.quantize of the kernel's own fp32 SwiGLU values bit for bit,
    those values match the float64 SwiGLU to a few ulp, and writing a_out changes no code.
    Drawn: ragged counts (empty experts, a hot one), each row's magnitude (huge and tiny rows:
    saturating and zero-code blocks of a) and which rows are all zeros or -0.0."""
    rows = int(counts.sum())
    assume(rows > 0)
    rng = np.random.default_rng(seed)
    row_exp = data.draw(hnp.arrays(np.int8, rows, elements=st.integers(-40, 20)), label="row_exp")
    zero_rows = data.draw(hnp.arrays(np.int8, rows, elements=st.integers(0, 9)), label="zero_rows")
    h = (rng.standard_normal((rows, 2 * i)) * np.ldexp(1.0, row_exp)[:, None]).astype(f32)
    h[rng.random(h.shape) < 0.01] = 0.0
    h[zero_rows == 0] = 0.0
    h[zero_rows == 1] = -0.0
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    experts = len(counts)
    gate = (4.65e-5 * np.exp(0.1 * rng.standard_normal(experts))).astype(f32)
    up = (gate / f32(1.2308)).astype(f32)
    g2 = f32(16 / 2688)
    packed, scales, a, bad = gpu_swiglu(h, offsets, gate, up, g2)
    assert bad == 0
    assert_codes_equal(packed, scales, nvfp4.quantize(a, g2))
    ref = reference.swiglu(h, offsets, gate, up)
    assert_swiglu_close(a, ref, h, offsets, gate, up)
    p2, s2, _, _ = gpu_swiglu(h, offsets, gate, up, g2, a_out=False)
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(s2, scales)


@pytest.mark.gpu
@settings(max_examples=10)
@given(counts=ragged_counts(max_experts=7, hot=(20, 40)), seed=st.integers(0, 2**31), cut=st.integers(1, 40))
def test_gpu_swiglu_quant_size_class_writes_only_its_rows(counts, seed, cut):
    """counts_in: the rows of experts with cut..2**31-1 tokens get the codes and scales of the
    full launch bit for bit, and with 1..cut-1 the others; a row outside the class keeps its
    poison (the fused layer's small class writes those rows at the same time)."""
    import cupy as cp

    rows, i = int(counts.sum()), 64
    assume(rows > 0)
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((rows, 2 * i)).astype(f32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    gate = (4.65e-5 * np.exp(0.1 * rng.standard_normal(len(counts)))).astype(f32)
    up = (gate / f32(1.2308)).astype(f32)
    g2 = f32(16 / 2688)
    packed, scales, _, _ = gpu_swiglu(h, offsets, gate, up, g2, a_out=False)
    row_count = np.repeat(counts, counts)
    d = [cp.asarray(v) for v in (h, offsets, gate, up)]
    both_p, both_s = np.full_like(packed, 0xAA), np.full_like(scales, 0xFF)
    for lo, hi in ((cut, 2**31 - 1), (1, cut - 1)) if cut > 1 else ((cut, 2**31 - 1),):
        p_ = cp.full(packed.shape, 0xAA, cp.uint8)
        s_ = cp.full(scales.shape, 0xFF, cp.uint8)
        sq.swiglu_quant(*d, g2, p_, s_, cp.zeros(1, cp.uint32), counts_in=(lo, hi))
        inside = (row_count >= lo) & (row_count <= hi)
        p_, s_ = p_.get(), s_.get()
        np.testing.assert_array_equal(p_[inside], packed[inside])
        np.testing.assert_array_equal(s_[inside], scales[inside])
        assert (p_[~inside] == 0xAA).all() and (s_[~inside] == 0xFF).all()
        both_p[inside], both_s[inside] = p_[inside], s_[inside]
    if cut > 1:  # the two classes together: the full launch
        np.testing.assert_array_equal(both_p, packed)
        np.testing.assert_array_equal(both_s, scales)


@pytest.mark.gpu
def test_gpu_swiglu_uses_each_rows_expert_globals():
    """Identical h rows under different experts differ exactly by their globals."""
    rng = np.random.default_rng(5)
    h = np.repeat(rng.standard_normal((1, 128)).astype(f32), 6, axis=0)
    offsets = np.array([0, 2, 2, 5, 6], np.int32)  # expert 1 empty
    gate = np.array([1.0, 9.0, 0.5, 2.0], f32)
    up = np.array([1.0, 9.0, 3.0, 0.25], f32)
    _, _, a, bad = gpu_swiglu(h, offsets, gate, up, f32(0.01))
    assert bad == 0
    rows_expert = [0, 0, 2, 2, 2, 3]
    for r, e in enumerate(rows_expert):
        g, u = h[r, :64].astype(np.float64) * gate[e], h[r, 64:].astype(np.float64) * up[e]
        want = (g / (1 + np.exp(-g)) * u)[None, :]
        assert_swiglu_close(a[r:r + 1], want, h[r:r + 1], np.array([0, 1]), gate[e:e + 1], up[e:e + 1])


@pytest.mark.gpu
def test_gpu_swiglu_keeps_subnormal_products():
    """No product of the SwiGLU is flushed to zero (CuPy compiles with -ftz=true; the kernel's
    products carry no .ftz): a subnormal a, and a subnormal g times a large u, which is a normal a.
    Both have |g| far below an ulp of 1, so exp(-|g|) = 1 and sigmoid(g) = 1/2 exactly, and a is
    the float32 (g * 1/2) * u bit for bit. The first pair is what the drawn test above found
    (row_exp -37), where the flushed kernel gave a = 0 against 4.76e-39."""
    gate, up = np.array([4.7681144e-05], f32), np.array([3.873996e-05], f32)
    pairs = np.array([[9.211522e-19, 5.596009e-12],  # g 4.4e-23, u 2.2e-16: a 4.76e-39 (subnormal)
                      [-9.211522e-19, 5.596009e-12],  # its negative
                      [1.0e-34, 1.0e30],  # g 4.8e-39 (subnormal), u 3.9e25: a 9.2e-14 (normal)
                      [1.0e-34, -3.0e29]], f32)
    i = 16
    h = np.zeros((len(pairs), 2 * i), f32)
    h[:, 0], h[:, i] = pairs[:, 0], pairs[:, 1]
    h[:, 1:i] = np.ldexp(np.arange(1, i, dtype=f32), -140)  # more subnormal gates beside (u = 0: a = 0)
    offsets = np.array([0, len(pairs)], np.int32)
    g2 = f32(16 / 2688)
    packed, scales, a, bad = gpu_swiglu(h, offsets, gate, up, g2)
    assert bad == 0
    g = (h[:, 0] * gate[0]).astype(f32)
    u = (h[:, i] * up[0]).astype(f32)
    want = ((g * f32(0.5)).astype(f32) * u).astype(f32)
    assert (np.abs(want) > 0).all() and (np.abs(want[:2]) < np.finfo(f32).tiny).all()
    np.testing.assert_array_equal(a[:, 0].view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(a[:, 1:], 0.0)
    assert_codes_equal(packed, scales, nvfp4.quantize(a, g2))
    ref = reference.swiglu(h, offsets, gate, up)
    assert_swiglu_close(a, ref, h, offsets, gate, up)


@pytest.mark.gpu
def test_gpu_swiglu_stays_finite_and_close_for_very_negative_gate():
    """silu(g) for g down to -100: no overflow of exp (the kernel takes expf(-|g|)), no NaN."""
    g = -np.linspace(0, 100, 64, dtype=f32)
    h = np.concatenate([g, np.ones(64, f32)])[None, :].astype(f32)
    one = np.ones(1, f32)
    _, _, a, bad = gpu_swiglu(h, np.array([0, 1], np.int32), one, one, f32(1e-3))
    assert bad == 0
    ref = reference.swiglu(h, np.array([0, 1]), one, one)
    assert_swiglu_close(a, ref, h, np.array([0, 1]), one, one)


@pytest.mark.gpu
def test_gpu_swiglu_counts_every_non_finite_a():
    rng = np.random.default_rng(6)
    h = rng.standard_normal((4, 64)).astype(f32)
    offsets = np.array([0, 4], np.int32)
    one = np.ones(1, f32)
    assert gpu_swiglu(h, offsets, one, one, f32(0.01))[3] == 0
    h[0, 3] = np.nan  # gate NaN: a is NaN
    h[1, 40] = np.inf  # up Inf: a is +-Inf (or NaN if silu(g) is 0)
    h[2, 5] = f32(3e38)  # finite h, g = h * 4 overflows: a is +-Inf
    h[3, 7], h[3, 39] = 0.0, -np.inf  # silu(0) * -Inf: NaN
    assert gpu_swiglu(h, offsets, one * 4, one, f32(0.01))[3] == 4


BF16_POISON = 0x7FAB  # a signalling-NaN bf16: the kernel quiets every NaN it writes, and rounds no finite value here


@pytest.mark.gpu
@settings(max_examples=20)
@given(st.integers(1, 33), st.integers(0, 2**32 - 1), float32_bits((64,)))
def test_gpu_to_bf16_rounds_like_ml_dtypes(rows, seed, drawn):
    """Every row but the last is uniform float32 bits from `seed` (rows x 64 drawn element by
    element would pass Hypothesis's 8 KiB of entropy per example); the last is drawn, and shrinks."""
    import cupy as cp

    bits = np.random.default_rng(seed).integers(0, 2**32, (rows, 64), dtype=np.uint64).astype(np.uint32)
    bits[-1] = drawn
    x = bits.view(f32)
    x = np.where(np.isfinite(x), x, f32(1.0)).astype(f32)
    x[0, :4] = [0.0, -0.0, 1.00390625, 1.01171875]  # ties to even, both directions
    # subnormals, the largest float (rounds to Inf), Inf, and NaNs beside finite values of their
    # pair (the kernel converts two at a time; a pair with a NaN takes the per-value path)
    x[0, 4:16] = np.array([0x00008000, 0x007FFFFF, 0x80000001, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,
                           0x7FC00001, 0x3F800000, 0x40000000, 0xFFA00000, 0xFFC00000, 0x7F800001],
                          dtype=np.uint32).view(f32)
    out = cp.full((rows, 64), BF16_POISON, cp.uint16)  # +0.0 (zeros) would pass where nothing was written
    counter = cp.zeros(1, cp.uint32)
    sq.to_bf16(cp.asarray(x), out, counter)
    with np.errstate(invalid="ignore"):  # (NaNs cast by ml_dtypes are replaced by the kernel's NaN bits)
        want = np.where(np.isnan(x), kernel_bf16(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(out.get(), want)
    assert int(counter.get()[0]) == int((~np.isfinite(want.view(ml_dtypes.bfloat16).astype(f32))).sum())


@pytest.mark.gpu
def test_gpu_to_bf16_is_kernel_bf16_on_every_float32():
    """All 2^32 bit patterns, in chunks of 2^28, against the NumPy copy of the kernel's rounding
    (kernel_bf16, run with CuPy); the counter counts exactly the non-finite bf16 outputs."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    chunk = 1 << 28
    out = cp.empty(chunk, cp.uint16)
    counter = cp.zeros(1, cp.uint32)
    non_finite = 0
    for start in range(0, 1 << 32, chunk):
        x = cp.arange(start, start + chunk, dtype=cp.uint64).astype(cp.uint32).view(cp.float32)
        out.fill(BF16_POISON)
        sq.to_bf16(x, out, counter)
        want = kernel_bf16(x, xp=cp)
        bad = cp.flatnonzero(out != want)
        if bad.size:
            j = int(bad[0])
            pytest.fail(f"{int(bad.size)} differ in chunk {start:#x}; first {start + j:#010x}: "
                        f"kernel {int(out[j]):#06x}, kernel_bf16 {int(want[j]):#06x}")
        non_finite += int(((want & 0x7F80) == 0x7F80).sum())
    assert non_finite == (1 << 24) + (1 << 16)  # Inf/NaN inputs, and finite values past bf16's largest
    assert int(counter.get()[0]) == non_finite


@pytest.mark.gpu
def test_gpu_launchers_reject_host_arrays():
    x, p, s, c = _qargs()
    with pytest.raises(ValueError, match="CuPy array"):
        sq.quantize_input(x, 1.0, p, s, c)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["quantize", "sigmoid"])
def test_branch_free_division_is_correctly_rounded_where_it_is_used(case):
    """div_refined against div.rn on 2^24 random pairs per case: quantize's denominators over
    fast_block's whole range with quotients where e2m1 rounding looks (2^-3..8, many of them
    on e2m1 rounding boundaries), and the sigmoid's t / (1 + t) for t in [2^-60, 1]."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    rng = np.random.default_rng(3 if case == "quantize" else 4)
    n = 1 << 24
    if case == "quantize":
        d = (2.0 ** rng.uniform(-60, 60, n)).astype(np.float32)
        q = 2.0 ** rng.uniform(-3, 3, n)
        edges = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        near = rng.random(n) < 0.5  # half of them within a few ulp of a rounding boundary
        q[near] = rng.choice(edges, near.sum()) * (1 + rng.integers(-8, 9, near.sum()) * 2.0**-24)
        v = (q * d).astype(np.float32) * np.where(rng.random(n) < 0.5, -1, 1).astype(np.float32)
    else:
        t = (2.0 ** rng.uniform(-60, 0, n)).astype(np.float32)
        d = (np.float32(1) + t).astype(np.float32)
        v = np.where(rng.random(n) < 0.5, np.float32(1), t).astype(np.float32)
    bad = cp.zeros(1, cp.uint64)
    fn = jit.kernel(sq.SOURCE, "lab_act::div_check")
    fn((1024,), (256,), (cp.asarray(v), cp.asarray(d), np.uint64(n), bad))
    assert int(bad.get()[0]) == 0
