import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lab import nvfp4
import oracles
from oracles import decode_blocks, e2m1_from_bits, e2m1_round, e4m3_from_bits
from strategies import nvfp4_blocks


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------


@st.composite
def float_matrices(draw, max_rows=4, max_blocks=4):
    """(rows, K) float32 with per-block magnitudes spread over many decades, some zero blocks."""
    rows = draw(st.integers(1, max_rows))
    blocks = draw(st.integers(1, max_blocks))
    base = draw(hnp.arrays(np.float32, (rows, blocks * 16), elements=st.floats(-1, 1, width=32)))
    exps = draw(hnp.arrays(np.int32, (rows, blocks), elements=st.integers(-12, 12)))
    x = base * np.repeat(np.ldexp(np.float32(1), exps), 16, axis=1)
    assume(np.abs(x).max() > 0)
    return x.astype(np.float32)


def half_e2m1_step(q):
    a = np.abs(q)
    return np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, 1.0))


def half_e4m3_step(v):
    v = np.asarray(v, dtype=np.float64)
    e = np.floor(np.log2(np.maximum(v, 2.0**-6)))
    return 2.0 ** (e - 3) / 2


# ---------------------------------------------------------------------------------------------
# codes and tables
# ---------------------------------------------------------------------------------------------


def test_e2m1_table_matches_bit_layout_and_ml_dtypes():
    nib = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(nvfp4.E2M1_VALUES, e2m1_from_bits(nib))
    np.testing.assert_array_equal(nvfp4.E2M1_VALUES, nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert np.signbit(nvfp4.E2M1_VALUES[8]) and nvfp4.E2M1_VALUES[8] == 0  # nibble 8 is -0.0


def test_e4m3_decode_all_codes():
    bits = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(nvfp4.decode_e4m3(bits), e4m3_from_bits(bits).astype(np.float32))
    assert nvfp4.decode_e4m3(np.array([0x7E], np.uint8))[0] == 448.0
    assert nvfp4.decode_e4m3(np.array([0x01], np.uint8))[0] == 2.0**-9


def test_e4m3_encode_round_trips_every_finite_positive_code_and_saturates():
    bits = np.arange(0, 0x7F, dtype=np.uint8)
    np.testing.assert_array_equal(nvfp4.encode_e4m3(nvfp4.decode_e4m3(bits)), bits)
    np.testing.assert_array_equal(nvfp4.encode_e4m3([449.0, 1e30, np.inf]), [0x7E] * 3)
    # ties to even: 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39)
    assert nvfp4.encode_e4m3([1.0625])[0] == 0x38
    assert nvfp4.encode_e4m3([-0.0])[0] == 0x00
    with pytest.raises(ValueError, match="negative"):
        nvfp4.encode_e4m3([-1.0])
    assert nvfp4.encode_e4m3([-1.0], allow_negative=True)[0] == 0xB8
    with pytest.raises(ValueError, match="NaN"):
        nvfp4.encode_e4m3([np.nan])


@settings(deadline=None)
@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 3), st.integers(1, 8).map(lambda n: 2 * n)),
                  elements=st.integers(0, 15)))
def test_nibble_order_even_element_in_low_nibble(nibbles):
    packed = nvfp4.pack_nibbles(nibbles)
    assert packed.shape == (nibbles.shape[0], nibbles.shape[1] // 2)
    np.testing.assert_array_equal(packed & 0x0F, nibbles[:, 0::2])
    np.testing.assert_array_equal(packed >> 4, nibbles[:, 1::2])
    np.testing.assert_array_equal(nvfp4.unpack_nibbles(packed), nibbles)
    np.testing.assert_array_equal(nvfp4.decode_codes(packed), e2m1_from_bits(nibbles))


def test_quantize_known_bytes():
    # block 0: 0.5 then 6, scale 6/(6*1) = 1.0 (0x38) -> nibbles 1 (low) and 7 (high) = 0x71
    # block 1: -1.5 then 3, scale 3/6 = 0.5 (0x30) -> q = -3, 6 -> nibbles 0xD and 7 = 0x7D
    x = np.zeros((1, 32), np.float32)
    x[0, :2] = [0.5, 6.0]
    x[0, 16:18] = [-1.5, 3.0]
    t = nvfp4.quantize(x, global_scale=1.0)
    assert t.packed[0, 0] == 0x71 and t.packed[0, 8] == 0x7D
    np.testing.assert_array_equal(t.scales[0], [0x38, 0x30])
    np.testing.assert_array_equal(nvfp4.dequantize(t), x)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError):
        nvfp4.pack_nibbles(np.array([[16, 0]], np.uint8))
    with pytest.raises(ValueError):
        nvfp4.pack_nibbles(np.array([[1, 2, 3]], np.uint8))
    with pytest.raises(ValueError):
        nvfp4.unpack_nibbles(np.array([[1, 2]], np.int32))


# ---------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------


@settings(deadline=None)
@given(float_matrices(), st.one_of(st.none(), st.floats(1e-4, 1e2)))
def test_quantize_error_bounds_per_block(x, global_scale):
    t = nvfp4.quantize(x, global_scale)
    rows, K = x.shape
    g = np.float32(t.global_scale)
    if global_scale is None:
        g_raw = np.float32(np.abs(x).max()) / np.float32(2688)
        assert g == (np.maximum(g_raw, np.float32(2.0**-126)) if g_raw > 0 else np.float32(1.0))
    s = e4m3_from_bits(t.scales)  # (rows, K/16)
    v = e2m1_from_bits(nvfp4.unpack_nibbles(t.packed)).reshape(rows, K // 16, 16)
    xb = x.reshape(rows, K // 16, 16).astype(np.float64)
    block_amax = np.abs(xb).max(axis=-1)
    s_in = block_amax / (6.0 * float(g))
    # block scale: RNE of amax / (6 g) within half an e4m3 step, saturating at 448
    sat = s_in > 448
    assert (s[sat] == 448).all()
    ok = ~sat
    assert (np.abs(s[ok] - s_in[ok]) <= half_e4m3_step(s_in[ok]) * (1 + 1e-6) + 2.0**-11).all()
    # the amax maps to at most 6 x scale x global
    deq = nvfp4.dequantize(t).reshape(rows, K // 16, 16)
    assert (np.abs(deq).max(axis=-1) <= 6 * s * float(g) * (1 + 1e-12)).all()
    # every element within half an e2m1 step of its scaled input (clipped at 6)
    nz = s > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        # the recipe divides by the float32 product s * g (rounded once, maybe subnormal)
        q = xb / (s.astype(np.float32) * g).astype(np.float64)[..., None]
    err = np.abs(v - np.clip(q, -6, 6))
    bound = half_e2m1_step(np.clip(q, -6, 6)) * (1 + 1e-5)
    assert (err[nz] <= bound[nz]).all()
    # zero-scale blocks encode +0 everywhere
    assert (nvfp4.unpack_nibbles(t.packed).reshape(rows, K // 16, 16)[~nz] == 0).all()


@settings(deadline=None)
@given(float_matrices(), st.one_of(st.none(), st.floats(1e-3, 10)))
def test_quantize_matches_documented_float32_recipe_bit_for_bit(x, global_scale):
    """Re-derive every code from the module docstring's arithmetic, with an independent e2m1
    rounding; a GPU quantize kernel is checked against exactly this."""
    t = nvfp4.quantize(x, global_scale)
    rows, K = x.shape
    f32 = np.float32
    if global_scale is None:
        g = f32(np.abs(x).max()) / f32(2688)
        g = max(g, f32(2.0**-126)) if g > 0 else f32(1.0)
    else:
        g = f32(global_scale)
    xb = x.reshape(rows, K // 16, 16)
    s_in = np.minimum(np.abs(xb).max(axis=-1) / (f32(6) * g), f32(448))
    want_scales = s_in.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(t.scales, want_scales)
    denom = (e4m3_from_bits(want_scales).astype(f32) * g).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = (xb / denom[..., None]).astype(f32)
    want = e2m1_round(np.where(denom[..., None] > 0, q, 0))
    got = e2m1_from_bits(nvfp4.unpack_nibbles(t.packed)).reshape(want.shape)
    np.testing.assert_array_equal(got, want)
    # signs survive rounding to zero inside a scaled block: -tiny gets nibble 8
    nib = nvfp4.unpack_nibbles(t.packed).reshape(want.shape)
    neg_zero = (denom[..., None] > 0) & (q < 0) & (want == 0)
    assert (nib[neg_zero] == 8).all()


def recipe(x, g):
    """The module docstring's float32 recipe, written out again with an independent e2m1 RNE."""
    f32 = np.float32
    rows, K = x.shape
    xb = x.reshape(rows, K // 16, 16)
    s_in = np.minimum(np.abs(xb).max(axis=-1) / (f32(6) * g), f32(448))
    scales = s_in.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    denom = (e4m3_from_bits(scales).astype(f32) * g).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = (xb / denom[..., None]).astype(f32)
    return scales, e2m1_round(np.where(denom[..., None] > 0, q, 0)).reshape(rows, K)


def nudge(v, rng):
    """Each value kept, or moved one float32 ulp down or up, at random."""
    step = rng.choice([-1, 0, 1], v.shape)
    toward = np.where(step > 0, np.float32(np.inf), np.float32(-np.inf))
    return np.where(step == 0, v, np.nextafter(v, toward)).astype(np.float32)


@settings(deadline=None, max_examples=200)
@given(nvfp4_blocks())
def test_quantize_matches_recipe_on_drawn_edge_blocks(case):
    """Blocks drawn on e2m1 midpoints and one ulp beside them, on the grid with elements that
    round to -0, zero blocks with -0.0, scales rounding to zero or to e4m3 subnormals, and
    saturating scales: a failure shrinks to the block and element that differ."""
    x, g = case
    t = nvfp4.quantize(x, g)
    if g is None:
        raw = np.float32(np.abs(x).max()) / np.float32(2688)
        g = max(raw, np.float32(2.0**-126)) if raw > 0 else np.float32(1.0)
    assert t.global_scale == g
    scales, values = recipe(x, g)
    np.testing.assert_array_equal(t.scales, scales)
    nib = nvfp4.unpack_nibbles(t.packed)
    np.testing.assert_array_equal(e2m1_from_bits(nib), values)
    # the sign survives rounding to zero in a block with a scale, never in a zero block
    scaled = np.repeat(scales > 0, 16, axis=1)
    np.testing.assert_array_equal(nib == 8, scaled & (values == 0) & np.signbit(x))
    # oracles.quantize, which test_reference's dense layer uses, is the same definition
    packed, codes = oracles.quantize(x, g)
    np.testing.assert_array_equal(codes, t.scales)
    np.testing.assert_array_equal(packed, t.packed)


def test_drawn_edge_blocks_reach_every_rule():
    """The strategy above does produce what it is meant to: a check that it is still aimed."""
    from hypothesis import find

    def has(pred):
        return find(nvfp4_blocks(static_global=True), lambda c: pred(*c), settings=settings(max_examples=2000))

    has(lambda x, g: (nvfp4.quantize(x, g).scales == 0x7E).any())
    has(lambda x, g: (nvfp4.quantize(x, g).scales == 0).any() and (x != 0).any())
    has(lambda x, g: ((nvfp4.quantize(x, g).scales > 0) & (nvfp4.quantize(x, g).scales < 8)).any())
    has(lambda x, g: (nvfp4.unpack_nibbles(nvfp4.quantize(x, g).packed) == 8).any())


def test_quantize_on_rounding_boundaries_matches_recipe():
    """Inputs placed on and one ulp either side of every e2m1 and e4m3 rounding midpoint:
    a reordered division or a reciprocal-multiply shows up here."""
    rng = np.random.default_rng(7)
    f32 = np.float32
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], f32)
    codes = np.arange(1, 0x7E, dtype=np.uint8)
    s_vals = nvfp4.decode_e4m3(codes)
    s_mids = ((s_vals + nvfp4.decode_e4m3(codes + 1)) / 2).astype(f32)  # e4m3 midpoints
    for _ in range(40):
        g = f32(np.exp(rng.uniform(np.log(1e-6), np.log(1e2))))
        # e2m1 boundaries: blocks with amax 6 * s * g (scale lands on s), elements at midpoints
        s = rng.choice(s_vals, 256).astype(f32)
        denom = (s * g).astype(f32)
        el = (rng.choice(mids, (256, 15)) * denom[:, None]).astype(f32)
        el = nudge(el, rng)
        lead = (f32(6) * denom).astype(f32)[:, None]
        x = np.concatenate([lead, el * rng.choice([-1, 1], el.shape)], axis=1).astype(f32)
        # e4m3 boundaries: block amax on and next to (s_mid * 6 g)
        a = (rng.choice(s_mids, (256, 1)) * (f32(6) * g)).astype(f32)
        a = nudge(a, rng)
        y = np.concatenate([a, rng.uniform(-1, 1, (256, 15)).astype(f32) * a], axis=1).astype(f32)
        for m in (x, y):
            m = m.reshape(-1, 64)
            t = nvfp4.quantize(m, g)
            scales, values = recipe(m, g)
            np.testing.assert_array_equal(t.scales, scales)
            np.testing.assert_array_equal(e2m1_from_bits(nvfp4.unpack_nibbles(t.packed)), values)


@settings(deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(-20, 10), st.data())
def test_values_on_the_grid_round_trip_bit_exactly(rows, blocks, log2_global, data):
    """x = e2m1 x e4m3 x 2**k with a +-6 in every block is reproduced code for code."""
    nibbles = data.draw(hnp.arrays(np.uint8, (rows, blocks, 16), elements=st.integers(0, 15)))
    lead = data.draw(hnp.arrays(np.uint8, (rows, blocks), elements=st.sampled_from([7, 15])))
    nibbles[..., 0] = lead  # the block's amax is 6 x its scale
    scales = data.draw(hnp.arrays(np.uint8, (rows, blocks), elements=st.integers(1, 0x7E)))
    g = np.float32(2.0**log2_global)
    packed = nvfp4.pack_nibbles(nibbles.reshape(rows, blocks * 16))
    x = nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scales, g), np.float32)
    t = nvfp4.quantize(x, g)
    np.testing.assert_array_equal(t.scales, scales)
    np.testing.assert_array_equal(t.packed, packed)  # -0.0 inputs come back as nibble 8


def test_round_trip_relative_error_on_gaussian_data():
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    y = nvfp4.dequantize(nvfp4.quantize(x))
    rel = np.linalg.norm(y - x) / np.linalg.norm(x)
    assert 0.02 < rel < 0.12  # e2m1 with per-16 scales: ~9% on Gaussian data


def test_batched_quantize_equals_per_matrix():
    x = np.random.default_rng(1).standard_normal((3, 5, 32)).astype(np.float32)
    x[1] *= 100
    t = nvfp4.quantize(x)
    assert t.global_scale.shape == (3,) and t.shape == (3, 5, 32) and t.K == 32
    for i in range(3):
        ti = nvfp4.quantize(x[i])
        np.testing.assert_array_equal(t.packed[i], ti.packed)
        np.testing.assert_array_equal(t.scales[i], ti.scales)
        assert t.global_scale[i] == ti.global_scale


def test_zero_blocks_and_zero_matrix():
    x = np.zeros((2, 32), np.float32)
    x[1, 20] = -3.0
    t = nvfp4.quantize(x)
    assert t.scales[0].tolist() == [0, 0] and t.scales[1, 0] == 0 and t.scales[1, 1] > 0
    assert (t.packed[0] == 0).all() and (t.packed[1, :8] == 0).all()
    z = nvfp4.quantize(np.zeros((2, 16)))
    assert z.global_scale == 1.0 and (z.packed == 0).all() and (z.scales == 0).all()
    # -0.0 inputs in an all-zero block still encode as +0
    assert (nvfp4.quantize(-np.zeros((1, 16)), 1.0).packed == 0).all()


def test_saturation_of_scales_and_elements():
    # global far too small: every block scale saturates at 448 and elements clip at +-6
    x = np.linspace(-100, 100, 32, dtype=np.float32).reshape(1, 32)
    t = nvfp4.quantize(x, global_scale=1e-3)
    assert (t.scales == 0x7E).all()
    v = nvfp4.decode_codes(t.packed)
    assert v.max() == 6 and v.min() == -6


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_inf_in_x_raise(bad):
    x = np.ones((2, 16))
    x[1, 3] = bad
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        nvfp4.quantize(x)


def test_float64_beyond_float32_range_raises():
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        nvfp4.quantize(np.full((1, 16), 1e300))


@pytest.mark.parametrize("g", [np.nan, np.inf, 0.0, -1.0])
def test_bad_global_raises(g):
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4.quantize(np.ones((1, 16)), g)


def test_shape_checks():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(np.ones((2, 24)))
    with pytest.raises(ValueError, match="rows, K"):
        nvfp4.quantize(np.ones(16))
    with pytest.raises(ValueError, match="broadcast"):
        nvfp4.quantize(np.ones((3, 2, 16)), np.ones(2))
    with pytest.raises(ValueError, match="scales"):
        nvfp4.NVFP4Tensor(np.zeros((2, 8), np.uint8), np.zeros((2, 2), np.uint8), np.float32(1))
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4.NVFP4Tensor(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8), np.ones(2, np.float32))


@settings(deadline=None)
@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 5), st.integers(1, 4).map(lambda n: 8 * n))),
       st.data())
def test_dequantize_blocks_is_exact_product(packed, data):
    scales = data.draw(hnp.arrays(np.uint8, (packed.shape[0], packed.shape[1] // 8),
                                  elements=st.integers(0, 0x7E)))
    np.testing.assert_array_equal(nvfp4.dequantize_blocks(packed, scales), decode_blocks(packed, scales))
    t = nvfp4.NVFP4Tensor(packed, scales, np.float32(0.375))
    np.testing.assert_array_equal(nvfp4.dequantize(t), decode_blocks(packed, scales) * 0.375)


# ---------------------------------------------------------------------------------------------
# CUTLASS swizzled scale layout
# ---------------------------------------------------------------------------------------------


def cutlass_offsets(rows, k16):
    kt = -(-k16 // 4)
    m, kb = np.meshgrid(np.arange(rows), np.arange(k16), indexing="ij")
    return (m // 128) * (kt * 512) + (kb // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + kb % 4


@settings(deadline=None)
@given(st.integers(0, 300), st.integers(0, 13), st.integers(0, 2**32 - 1))
def test_swizzle_follows_cutlass_formula_and_inverts(rows, k16, seed):
    s = np.random.default_rng(seed).integers(1, 256, (rows, k16), dtype=np.uint8)  # no zeros
    buf = nvfp4.swizzle_scales(s)
    assert buf.shape == (nvfp4.swizzled_size(rows, k16),)
    assert buf.size == (-(-rows // 128) * 128) * (-(-k16 // 4) * 4)
    off = cutlass_offsets(rows, k16)
    assert len(np.unique(off)) == off.size  # injective
    np.testing.assert_array_equal(buf[off], s)
    pad = np.ones(buf.size, bool)
    pad[off.ravel()] = False
    assert (buf[pad] == 0).all()  # every other byte is padding, zero
    np.testing.assert_array_equal(nvfp4.unswizzle_scales(buf, rows, k16), s)


@settings(deadline=None)
@given(st.integers(1, 260), st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_unswizzle_then_swizzle_is_identity_on_padded_buffers(rows, k16, seed):
    """The inverse direction: any buffer with zero padding survives unswizzle -> swizzle."""
    size = nvfp4.swizzled_size(rows, k16)
    rng = np.random.default_rng(seed)
    buf = np.zeros(size, np.uint8)
    off = cutlass_offsets(rows, k16).ravel()
    buf[off] = rng.integers(0, 256, off.size, dtype=np.uint8)
    np.testing.assert_array_equal(nvfp4.swizzle_scales(nvfp4.unswizzle_scales(buf, rows, k16)), buf)


def test_swizzle_batched_and_validation():
    s = np.random.default_rng(0).integers(0, 256, (3, 130, 6), dtype=np.uint8)
    b = nvfp4.swizzle_scales(s)
    for i in range(3):
        np.testing.assert_array_equal(b[i], nvfp4.swizzle_scales(s[i]))
    np.testing.assert_array_equal(nvfp4.unswizzle_scales(b, 130, 6), s)
    with pytest.raises(ValueError, match="need"):
        nvfp4.unswizzle_scales(b[0][:-1], 130, 6)
    with pytest.raises(ValueError, match="uint8"):
        nvfp4.swizzle_scales(s.astype(np.int16))
