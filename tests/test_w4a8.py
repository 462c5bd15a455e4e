"""lab/w4a8.py against definitions written from the formats' bits (tests/oracles.py), and
lab/kernels/gemm/decode_fp8.cuh compiled for the host and for sm_90a."""

from __future__ import annotations

import importlib.util
import math
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lab import nvfp4, reference, w4a8
from lab.kernels import jit, sass
from lab.problem import MoEProblem, make_routing, random_activations, random_weights
from oracles import E4M3_FINITE, decode_blocks, e4m3_from_bits, e4m3_round, unpack
from strategies import ragged_counts

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
f32 = np.float32
needs_nvcc = pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")


# ---------------------------------------------------------------------------------------------
# strategies and bit-level helpers
# ---------------------------------------------------------------------------------------------

# scale codes: anywhere in 0x00..0x7E, the subnormal and zero end, and the top
SCALE_CODE = st.one_of(st.integers(0, 0x7E), st.integers(0, 0x12), st.integers(0x70, 0x7E))


@st.composite
def nvfp4_weights(draw, max_mats=3, max_rows=4, max_blocks=3):
    """(packed (E, rows, 8 * blocks) uint8 of any nibbles, scales (E, rows, blocks) uint8)."""
    shape = (draw(st.integers(1, max_mats)), draw(st.integers(1, max_rows)), draw(st.integers(1, max_blocks)))
    packed = draw(hnp.arrays(np.uint8, (*shape[:2], 8 * shape[2])))
    scales = draw(hnp.arrays(np.uint8, shape, elements=SCALE_CODE))
    return packed, scales


def half_ulp(mag):
    """Half the e4m3 spacing at magnitude mag (0 < mag <= 448): 2^-10 in the subnormal range."""
    mag = np.asarray(mag, np.float64)
    e = np.floor(np.log2(np.maximum(mag, 2.0**-6)))
    return 2.0 ** (e - 4)


def exact_weights(packed, scales, p_rows):
    """m * s * 2^-p from the bits, p (E, rows)."""
    return decode_blocks(packed, scales) * np.exp2(-np.asarray(p_rows, np.float64))[..., None]


def nibbles(packed):
    return unpack(packed)


def p_rows(p, rows_shape):
    """p per matrix (...) or per row (..., rows) -> (..., rows)."""
    p = np.asarray(p)
    return p if p.shape == rows_shape else np.broadcast_to(p[..., None], rows_shape)


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


@given(nvfp4_weights(), st.integers(0, 12), st.booleans())
def test_weights_round_to_nearest_even_within_half_an_ulp(w, extra, per_row):
    """Every weight's code is the oracle's RNE of m * s * 2^-p with the nibble's sign; within half
    an e4m3 ulp, exact when representable; the counts are those of the values. `extra` raises p
    past the chosen one, into e4m3's subnormal range and below."""
    packed, scales = w
    p = w4a8.choose_p(packed, scales, per_row) + extra
    c = w4a8.convert_weights(packed, scales, p)
    pr = p_rows(p, packed.shape[:-1])
    exact = exact_weights(packed, scales, pr)
    mag = np.abs(exact)
    assert mag.max() <= 448
    np.testing.assert_array_equal(c.codes & 0x7F, e4m3_round(mag))
    np.testing.assert_array_equal(c.codes >> 7, nibbles(packed) >> 3)
    got = e4m3_from_bits(c.codes & 0x7F)
    nz = mag > 0
    assert (np.abs(got - mag)[nz] <= half_ulp(mag[nz])).all()
    representable = np.isin(mag, E4M3_FINITE)
    np.testing.assert_array_equal(got[representable], mag[representable])
    assert c.rounded == np.count_nonzero(got != mag) == np.count_nonzero(~representable)
    assert c.subnormal == np.count_nonzero(nz & (mag < 2.0**-6))
    assert c.flushed == np.count_nonzero(nz & (got == 0))
    assert c.nonzero == np.count_nonzero(nz) and c.size == mag.size
    np.testing.assert_array_equal(c.values(), np.where(c.codes >> 7, -got, got))
    np.testing.assert_array_equal(w4a8.exact_values(packed, scales, p), exact)


@given(nvfp4_weights(), st.booleans())
def test_p_is_the_smallest_that_keeps_every_weight_within_448(w, per_row):
    packed, scales = w
    amax = np.abs(decode_blocks(packed, scales)).max(axis=-1)  # per row
    if not per_row:
        amax = amax.max(axis=-1)
    p = w4a8.choose_p(packed, scales, per_row)
    assert p.shape == amax.shape and p.dtype == np.int32
    assert (amax * np.exp2(-p.astype(float)) <= 448).all()
    assert (np.where(amax > 0, amax * np.exp2(1 - p.astype(float)) > 448, p == 0)).all()
    if per_row:  # the per-expert p is the largest of its non-zero rows'
        live = np.where(amax > 0, p, -99).max(axis=-1)
        np.testing.assert_array_equal(w4a8.choose_p(packed, scales), np.where(live > -99, live, 0))
    assume((amax > 0).any())
    at = np.unravel_index(np.argmax(amax > 0), amax.shape)
    low = p.copy()
    low[at] -= 1
    with pytest.raises(ValueError, match=rf"p={low[at]} .*needs p >= {p[at]}"):
        w4a8.convert_weights(packed, scales, low)


@given(hnp.arrays(f32, st.tuples(st.integers(1, 3), st.integers(1, 8), st.sampled_from([16, 48])),
                  elements=st.floats(-1, 1, width=32)), st.integers(-60, 60))
def test_a_global_from_the_amax_makes_p_3(x, e):
    """nvfp4.quantize's computed global puts a 6 in a block of scale 448 in every matrix that is
    not all zero: p = 3 per matrix, whatever the magnitude (short of amax / 2688 below float32's
    normal range, where the global is floored at 2^-126)."""
    x = (x * np.float32(2.0**e)).astype(f32)
    q = nvfp4.quantize(x)
    amax = np.abs(x).max(axis=(1, 2))
    assume(((amax == 0) | (amax / f32(2688) >= 2.0**-126)).all())
    live = amax > 0
    np.testing.assert_array_equal(w4a8.choose_p(q.packed, q.scales), np.where(live, 3, 0))


def test_smallest_p_on_the_edges():
    amax = np.array([0.0, 448.0, 448.0 * (1 + 2.0**-52), 2688.0, 2.0**-10, 224.0, 449.0])
    np.testing.assert_array_equal(w4a8.smallest_p(amax), [0, 0, 1, 3, -18, -1, 1])


def all_pairs_block():
    """packed (127, 8), scales (127, 1): row c is scale code c with the 16 nibbles 0..15."""
    nib = np.tile(np.arange(16, dtype=np.uint8), (127, 1))
    return (nib[:, 0::2] | nib[:, 1::2] << 4).astype(np.uint8), np.arange(127, dtype=np.uint8)[:, None]


@pytest.mark.parametrize("p", range(-12, 8))
def test_exactly_the_predicted_weights_round(p):
    """Over every finite scale code and all 16 e2m1 codes (rows that would exceed 448 at this p
    left out): a weight rounds iff predict_rounding says so, and the rule in words holds: a
    normal result rounds iff its magnitude is 1.5, 3 or 6 and the scale's mantissa is 1, 3, 5, 6
    or 7 (normal code) or 7 (subnormal code); a result below 2^-6 iff it is off the 2^-9 grid."""
    packed, scales = all_pairs_block()
    keep = e4m3_from_bits(scales[:, 0]) * 6 * 2.0**-p <= 448
    packed, scales = packed[keep], scales[keep]
    c = w4a8.convert_weights(packed, scales, np.full(len(scales), p))
    mag = np.abs(exact_weights(packed, scales, np.full(len(scales), p)))
    rounds = e4m3_from_bits(c.codes & 0x7F) != mag
    code = np.broadcast_to(scales, mag.shape).astype(int)
    idx = np.broadcast_to(np.arange(16) & 7, mag.shape)
    np.testing.assert_array_equal(rounds, w4a8.predict_rounding(code, idx, p))
    normal = mag >= 2.0**-6
    mant, expo = code & 7, code >> 3
    three = np.isin(idx, [3, 5, 7])
    stated = three & np.where(expo > 0, np.isin(mant, [1, 3, 5, 6, 7]), mant == 7)
    np.testing.assert_array_equal(rounds[normal], stated[normal])
    sub = (mag > 0) & ~normal
    np.testing.assert_array_equal(rounds[sub], (mag[sub] * 2**9) % 1 != 0)
    assert not rounds[mag == 0].any()


def test_mantissa_110_rounds_too():
    """The claim "only scales whose last mantissa bit is set" misses 0b110: 1.5 x 1.75 = 2.625
    needs five significant bits."""
    packed = np.array([[0x33] * 8], np.uint8)  # magnitude 1.5 everywhere
    c = w4a8.convert_weights(packed, np.array([[0x3E]], np.uint8), np.array([0]))  # scale 1.75
    assert e4m3_from_bits(0x3E) == 1.75 and c.rounded == 16
    assert set(e4m3_from_bits(c.codes & 0x7F).ravel()) == {2.5}  # 2.625 is a tie: to the even 2.5


@pytest.mark.parametrize("code", [0x7F, 0x80, 0xB8, 0xFF])
def test_scale_codes_that_are_nan_or_negative_are_refused(code):
    packed = np.zeros((2, 8), np.uint8)
    scales = np.array([[0x38], [code]], np.uint8)
    with pytest.raises(ValueError, match=rf"scales .*0x{code:02X} at \(1, 0\)"):
        w4a8.convert_weights(packed, scales)
    with pytest.raises(ValueError, match="scales"):
        w4a8.choose_p(packed, scales)


def test_weight_argument_errors_name_the_argument():
    packed, scales = np.zeros((2, 3, 8), np.uint8), np.zeros((2, 3, 1), np.uint8)
    with pytest.raises(ValueError, match=r"p must have shape \(2,\) .* or \(2, 3\)"):
        w4a8.convert_weights(packed, scales, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="p must hold integers"):
        w4a8.convert_weights(packed, scales, np.zeros(2))
    with pytest.raises(ValueError, match="scales of shape"):
        w4a8.convert_weights(packed, np.zeros((2, 3, 2), np.uint8))
    with pytest.raises(ValueError, match="packed must be"):
        w4a8.convert_weights(np.zeros(8, np.uint8), np.zeros(1, np.uint8))


@given(nvfp4_weights(), st.integers(-4, 10))
def test_table_equals_the_direct_conversion(w, shift):
    """Each weight's code is its block's table row at its magnitude index, with its sign; every
    entry is the oracle's RNE, or NaN (0x7F) past 448 and in row 0x7F."""
    packed, scales = w
    p = w4a8.choose_p(packed, scales) + max(shift, 0)
    c = w4a8.convert_weights(packed, scales, p)
    nib = nibbles(packed)
    for e in range(packed.shape[0]):
        table = w4a8.magnitude_table(int(p[e]))
        via = table[np.repeat(scales[e], 16, axis=-1), nib[e] & 7] | (nib[e] & 8) << 4
        np.testing.assert_array_equal(c.codes[e], via)
    table = w4a8.magnitude_table(shift)
    assert table.shape == (128, 8) and table.dtype == np.uint8
    mag = e4m3_from_bits(np.arange(127))[:, None] * np.array([0, .5, 1, 1.5, 2, 3, 4, 6]) * 2.0**-shift
    over = mag > 448
    np.testing.assert_array_equal(table[:127][~over], e4m3_round(mag[~over]))
    assert (table[:127][over] == 0x7F).all() and (table[0x7F] == 0x7F).all()
    t32 = table.astype(np.uint32)
    np.testing.assert_array_equal(table.view("<u4")[:, 0], t32[:, 0] | t32[:, 1] << 8 | t32[:, 2] << 16 | t32[:, 3] << 24)


# ---------------------------------------------------------------------------------------------
# the decode word layout and decode_fp8.cuh
# ---------------------------------------------------------------------------------------------


@given(nvfp4_weights(), st.integers(0, 8))
def test_decode_of_the_word_layout_equals_the_conversion(w, extra):
    packed, scales = w
    p = w4a8.choose_p(packed, scales) + extra
    c = w4a8.convert_weights(packed, scales, p)
    words = w4a8.decode_words(packed)
    assert words.shape == (*packed.shape[:-1], packed.shape[-1] // 4) and words.dtype == np.uint32
    for e in range(packed.shape[0]):
        rows = w4a8.magnitude_table(int(p[e]))[np.repeat(scales[e], 2, axis=-1)]  # the block of each word
        lo, hi = w4a8.decode_fp8_reference(words[e], rows, rows)
        got = np.stack([lo, hi], axis=-1).view(np.uint8).reshape(c.codes[e].shape)
        np.testing.assert_array_equal(got, c.codes[e])


def test_decode_words_is_the_standard_word_with_its_signs_permuted():
    rng = np.random.default_rng()
    packed = rng.integers(0, 256, (5, 64), np.uint8)
    std = packed.view("<u4")
    words = w4a8.decode_words(packed)
    np.testing.assert_array_equal(words & 0x77777777, std & 0x77777777)
    for e, bit in enumerate([7, 15, 23, 31, 3, 11, 19, 27]):
        np.testing.assert_array_equal((words >> bit) & 1, (std >> (4 * e + 3)) & 1)


def _decode_records(rng):
    """(records (n, 5) uint32: word, lo0, lo1, hi0, hi1) over p in a few values and every scale
    code: per code the sixteen words whose eight elements all hold one code (each nibble position
    sees every code with every table), random words, and random words with two tables."""
    recs = []
    uniform = np.array([int("".join([f"{v:x}"] * 8), 16) for v in range(16)], np.uint32)
    for p in (-6, 0, 3, 9):
        table = w4a8.magnitude_table(p).view("<u4")  # (128, 2)
        for code in range(128):
            words = np.concatenate([uniform, rng.integers(0, 2**32, 48, dtype=np.uint32)])
            other = table[rng.integers(0, 128, 16)]
            recs.append(np.column_stack([words, np.tile(table[code], (len(words), 2))]))
            recs.append(np.column_stack([rng.integers(0, 2**32, 16, dtype=np.uint32), np.tile(table[code], (16, 1)),
                                         other]))
    return np.concatenate(recs).astype(np.uint32)


def build_decode_check(tmp_path) -> Path:
    exe = tmp_path / "decode_fp8_check"
    proc = subprocess.run([jit.nvcc_path(), "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                           f"-I{jit.KERNEL_DIR / 'gemm'}", "-o", str(exe), str(FIXTURES / "decode_fp8_check.cu")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


def ptx_prmt(a, b, c):
    """PTX prmt.b32's generic form as its documentation states it: {b, a} as bytes 0..7; output
    byte n is byte c[4n+2:4n], or with c[4n+3] set that byte's bit 7 replicated."""
    src = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros(a.shape, np.uint64)
    for n in range(4):
        sel = (c.astype(np.uint64) >> np.uint64(4 * n)) & np.uint64(15)
        byte = (src >> (np.uint64(8) * (sel & np.uint64(7)))) & np.uint64(255)
        byte = np.where(sel & np.uint64(8), np.where(byte & np.uint64(128), np.uint64(255), np.uint64(0)), byte)
        out |= byte << np.uint64(8 * n)
    return out.astype(np.uint32)


@needs_nvcc
def test_host_prmt_is_the_ptx_instruction(tmp_path):
    """The host prmt (the decode's host path) against the instruction's documented semantics,
    sign replication included, on random operands and every selector nibble in each position."""
    exe = build_decode_check(tmp_path)
    rng = np.random.default_rng()
    n = 4096
    a, b, c = (rng.integers(0, 2**32, n, dtype=np.uint32) for _ in range(3))
    c[:16 * 4] = (np.arange(16, dtype=np.uint32)[:, None] << (4 * np.arange(4, dtype=np.uint32))).ravel()
    (tmp_path / "p.bin").write_bytes(np.column_stack([a, b, c]).astype("<u4").tobytes())
    run = subprocess.run([str(exe), "prmt", str(tmp_path / "p.bin"), str(tmp_path / "q.bin")], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith(f"ok {n}"), run.stdout + run.stderr
    np.testing.assert_array_equal(np.frombuffer((tmp_path / "q.bin").read_bytes(), "<u4"), ptx_prmt(a, b, c))


@needs_nvcc
def test_decode_header_on_the_host_matches_the_reference_bit_for_bit(tmp_path):
    exe = build_decode_check(tmp_path)
    recs = _decode_records(np.random.default_rng())
    (tmp_path / "in.bin").write_bytes(recs.astype("<u4").tobytes())
    run = subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith(f"ok {len(recs)}"), run.stdout + run.stderr
    got = np.frombuffer((tmp_path / "out.bin").read_bytes(), "<u4").reshape(-1, 2)
    t = np.ascontiguousarray(recs[:, 1:]).view(np.uint8).reshape(-1, 2, 8)
    lo, hi = w4a8.decode_fp8_reference(recs[:, 0], t[:, 0], t[:, 1])
    bad = np.flatnonzero((got[:, 0] != lo) | (got[:, 1] != hi))
    assert bad.size == 0, (f"{bad.size} records differ, first {recs[bad[0]]}: {got[bad[0]]} vs "
                           f"{lo[bad[0]]}, {hi[bad[0]]}")


@needs_nvcc
@pytest.mark.parametrize("kernel", ["decode_fp8_probe", "decode_fp8_probe2"])
def test_decode_compiles_for_sm90a_without_spills_in_seven_instructions(kernel, tmp_path):
    """One word through the decode in a kernel: no stack, no spills, and between its load and its
    store seven instructions (the header's count: mask, two shifts, two PRMT, two LOP3), not
    counting the address arithmetic."""
    _, report = jit.compile_cubin("decode_fp8_probe.cu", kernel, tmp_path, FIXTURES)
    info = jit._parse_ptxas(report, kernel)
    assert info.stack_bytes == 0 and info.spill_stores == 0 and info.spill_loads == 0, info
    if sass.nvdisasm_path() is None:
        pytest.skip("counting instructions needs nvdisasm")
    code = sass.kernel_sass("decode_fp8_probe.cu", kernel, FIXTURES)
    frame = {"LDC", "S2R", "ULDC", "LDG", "STG", "EXIT", "BRA", "NOP"}
    work = [i for i in code if i.base not in frame and not i.opcode.startswith("IMAD.WIDE")]
    assert [i.base for i in work].count("PRMT") == 2, work
    assert len(work) == 7, work


# ---------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------


def test_ml_dtypes_e4m3_cast_is_round_to_nearest_even_and_overflows_to_nan():
    """Why quantize_act clips first: ml_dtypes rounds float32 to e4m3 to nearest even, subnormals
    included, and makes NaN of what lies past 464."""
    fin = E4M3_FINITE
    mids = ((fin[:-1] + fin[1:]) / 2).astype(f32)
    probes = np.concatenate([fin.astype(f32), mids, np.nextafter(mids, f32(0)), np.nextafter(mids, f32(1000))])
    probes = probes[probes <= 448]
    np.testing.assert_array_equal(probes.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), e4m3_round(probes))
    over = np.array([464, 464.00003, 500, 1e30], f32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert over[0] == 0x7E and (over[1:] == 0x7F).all()


def oracle_quantize_act(x, group=128):
    """The module docstring's recipe from the bits: float32 operations in its order, RNE by the
    oracle's value table, the sign from the float's sign bit."""
    x = np.asarray(x).astype(f32)
    rows, K = x.shape
    G = -(-K // group)
    xp = np.zeros((rows, G * group), f32)
    xp[:, :K] = x
    xb = xp.reshape(rows, G, group)
    amax = np.maximum(np.abs(xb).max(axis=-1), f32(2.0**-116))
    inv = (f32(448) / amax).astype(f32)
    s = (amax / f32(448)).astype(f32)
    q = (xb * inv[..., None]).astype(f32)
    codes = e4m3_round(np.minimum(np.abs(q).astype(np.float64), 448)) | (np.signbit(q).astype(np.uint8) << 7)
    return codes.reshape(rows, G * group)[:, :K], s


@st.composite
def activations(draw, max_rows=4, max_k=300):
    """(rows, K) float32, K any size: per 32-column stretch a magnitude 2^e (e in -140..127, so
    float32 subnormals and values near its top), some stretches zero (+0 and -0)."""
    rows, K = draw(st.integers(1, max_rows)), draw(st.integers(1, max_k))
    base = draw(hnp.arrays(f32, (rows, K), elements=st.floats(-1, 1, width=32)))
    stretches = -(-K // 32)
    exps = draw(hnp.arrays(np.int32, (rows, stretches), elements=st.one_of(
        st.integers(-20, 20), st.integers(-140, -110), st.integers(100, 127))))
    zero = draw(hnp.arrays(np.bool_, (rows, stretches)))
    mult = np.repeat(np.ldexp(np.float64(1), exps), 32, axis=1)[:, :K]
    x = np.clip(base * mult, -np.finfo(f32).max, np.finfo(f32).max).astype(f32)
    x[np.repeat(zero, 32, axis=1)[:, :K]] *= f32(0)  # keeps the sign: -0.0 where base < 0
    return x


E4M3_MIDPOINTS = (E4M3_FINITE[:-1] + E4M3_FINITE[1:]) / 2


@st.composite
def midpoint_activations(draw, max_rows=3, max_groups=3):
    """(rows, 128 * groups) float32 whose x * inv (inv = float32(448 / amax), amax the group's
    first element) lands on an e4m3 value or rounding midpoint, or one float32 ulp of x beside
    it: where the order of the recipe's float32 operations decides the code (x / s_x instead of
    x * inv, or another rounding, would flip some of them)."""
    rows, groups = draw(st.integers(1, max_rows)), draw(st.integers(1, max_groups))
    amax = draw(hnp.arrays(f32, (rows, groups, 1), elements=st.floats(2.0**-100, 2.0**100, width=32)))
    targets = np.concatenate([E4M3_MIDPOINTS, E4M3_FINITE[1:]])
    pick = draw(hnp.arrays(np.int16, (rows, groups, 128), elements=st.integers(0, len(targets) - 1)))
    neg = draw(hnp.arrays(np.bool_, (rows, groups, 128)))
    ulps = draw(hnp.arrays(np.int8, (rows, groups, 128), elements=st.integers(-1, 1)))
    inv = (f32(448) / amax).astype(f32)
    t = targets[pick].astype(f32)
    x = (t / inv).astype(f32)
    best = x.copy()
    for step in (-2, -1, 1, 2):  # a float32 x whose product rounds onto the target, if any
        c = x
        for _ in range(abs(step)):
            c = np.nextafter(c, f32(np.inf) if step > 0 else f32(0))
        hit = (c * inv).astype(f32) == t
        best = np.where(hit & ((best * inv).astype(f32) != t), c, best)
    best = np.where(ulps == 0, best, np.nextafter(best, np.where(ulps > 0, f32(np.inf), f32(0)))).astype(f32)
    best = np.minimum(best, amax)
    best[..., 0] = amax[..., 0]
    return np.where(neg, -best, best).astype(f32).reshape(rows, groups * 128)


@given(st.one_of(activations(), midpoint_activations()))
def test_quantize_act_is_the_documented_recipe(x):
    x8, s = w4a8.quantize_act(x)
    want8, want_s = oracle_quantize_act(x)
    assert x8.dtype == np.uint8 and s.dtype == np.float32 and s.shape == (x.shape[0], -(-x.shape[1] // 128))
    np.testing.assert_array_equal(x8, want8)
    np.testing.assert_array_equal(s, want_s)


@given(st.one_of(activations(), midpoint_activations()))
def test_quantize_act_is_within_the_e4m3_bound_and_saturates_at_its_amax(x):
    """|dec(x8) s - x| <= 2^-4 |x| (half an ulp at 3 mantissa bits) + 2^-10 s (the subnormal
    step) + the float32 roundings of inv, s and x * inv; each group's amax element codes +-448;
    nothing is NaN."""
    x8, s = w4a8.quantize_act(x)
    assert np.isfinite(s).all() and (s > 0).all() and ((x8 & 0x7F) != 0x7F).all()
    s_cols = np.repeat(s.astype(np.float64), 128, axis=1)[:, : x.shape[1]]
    dec = e4m3_from_bits(x8) * s_cols
    xd = x.astype(np.float64)
    assert (np.abs(dec - xd) <= 2.0**-4 * np.abs(xd) + 2.0**-10 * s_cols + 2.0**-21 * np.abs(xd)).all()
    K = x.shape[1]
    for g in range(s.shape[1]):
        cols = slice(128 * g, min(K, 128 * g + 128))
        amax = np.abs(x[:, cols]).max(axis=1)
        live = amax >= 2.0**-116
        assert ((x8[live, cols] & 0x7F).max(axis=1) == 0x7E).all()
        np.testing.assert_array_equal(s[live, g], (amax[live] / f32(448)).astype(f32))


@given(st.integers(1, 4), st.integers(1, 400), st.booleans())
def test_quantize_act_of_zero_groups_has_no_nan(rows, K, negative):
    x = np.full((rows, K), -0.0 if negative else 0.0, f32)
    x8, s = w4a8.quantize_act(x)
    assert (x8 == (0x80 if negative else 0)).all()
    assert (s == f32(2.0**-116) / f32(448)).all() and s.min() >= 2.0**-126


@given(activations(max_k=260))
def test_a_short_last_group_is_the_zero_padded_one(x):
    K = x.shape[1]
    padded = np.zeros((x.shape[0], -(-K // 128) * 128), f32)
    padded[:, :K] = x
    x8, s = w4a8.quantize_act(x)
    p8, ps = w4a8.quantize_act(padded)
    np.testing.assert_array_equal(x8, p8[:, :K])
    np.testing.assert_array_equal(s, ps)
    assert not p8[:, K:].any()


def test_quantize_act_group_is_a_parameter():
    x = np.random.default_rng().standard_normal((3, 96)).astype(f32)
    x8, s = w4a8.quantize_act(x, group=96)
    assert s.shape == (3, 1)
    np.testing.assert_array_equal(s[:, 0], (np.abs(x).max(axis=1) / f32(448)).astype(f32))


def test_quantize_act_errors_name_the_argument():
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        w4a8.quantize_act(np.array([[1.0, np.nan]]))
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        w4a8.quantize_act(np.array([[1.0, 1e39]]))  # past float32
    with pytest.raises(ValueError, match=r"x must be \(rows, K\)"):
        w4a8.quantize_act(np.ones(4))
    with pytest.raises(ValueError, match="group must be a positive int"):
        w4a8.quantize_act(np.ones((2, 4)), group=0)


# ---------------------------------------------------------------------------------------------
# the GEMM contract
# ---------------------------------------------------------------------------------------------


def e4m3_codes(rng, shape):
    """Random finite e4m3 codes, both signs."""
    c = rng.integers(0, 0x7F, shape).astype(np.uint8)
    return c | (rng.integers(0, 2, shape).astype(np.uint8) << 7)


def brute_force(x8, s_x, offsets, w8, p, alpha, absolute=False):
    """One output at a time: 2^p alpha sum_g s_x sum_k x8 w8, each group's sum by math.fsum."""
    rows, K = x8.shape
    N = w8.shape[1]
    out = np.zeros((rows, N))
    xd, wd = e4m3_from_bits(x8), e4m3_from_bits(w8)
    if absolute:
        xd, wd, alpha = np.abs(xd), np.abs(wd), np.abs(alpha)
    for r in range(rows):
        e = int(np.searchsorted(offsets, r, side="right") - 1)
        for n in range(N):
            pe = p[e] if p.ndim == 1 else p[e, n]
            groups = [math.fsum(xd[r, k] * wd[e, n, k] for k in range(g, min(K, g + 128))) for g in range(0, K, 128)]
            out[r, n] = 2.0 ** int(pe) * float(alpha[e]) * math.fsum(float(s_x[r, g]) * v for g, v in enumerate(groups))
    return out


@given(ragged_counts(max_experts=4, hot=(1, 8)), st.integers(1, 6), st.sampled_from([16, 64, 144, 272]),
       st.booleans(), st.integers(0, 2**32 - 1))
def test_gemm_equals_the_brute_force_sum(counts, n, k, per_row, seed):
    rng = np.random.default_rng(seed)
    E, rows = counts.size, int(counts.sum())
    offsets = np.r_[0, np.cumsum(counts)]
    x8 = e4m3_codes(rng, (rows, k))
    s_x = (2.0 ** rng.uniform(-20, 5, (rows, -(-k // 128)))).astype(f32)
    w8 = e4m3_codes(rng, (E, n, k))
    p = rng.integers(-19, 4, (E, n) if per_row else E).astype(np.int32)
    alpha = rng.uniform(1e-5, 1e-3, E).astype(f32)
    got = w4a8.gemm(x8, s_x, offsets, w8, p, alpha)
    mag = w4a8.gemm_abs(x8, s_x, offsets, w8, p, alpha)
    want, want_mag = brute_force(x8, s_x, offsets, w8, p, alpha), brute_force(x8, s_x, offsets, w8, p, alpha, True)
    tol = (k + 8) * 2.0**-53 * want_mag  # float64 sums of k exact products, and the scalings
    assert (np.abs(got - want) <= tol).all()
    assert (np.abs(mag - want_mag) <= tol).all()
    assert (np.abs(got) <= mag).all()


def test_gemm_leaves_other_experts_nan():
    rng = np.random.default_rng()
    offsets = np.array([0, 3, 3, 7, 9])
    x8, s_x = e4m3_codes(rng, (9, 160)), rng.uniform(0.5, 2, (9, 2)).astype(f32)
    w8, p, alpha = e4m3_codes(rng, (4, 5, 160)), np.array([0, 1, 2, 3], np.int32), np.ones(4)
    full = w4a8.gemm(x8, s_x, offsets, w8, p, alpha)
    part = w4a8.gemm(x8, s_x, offsets, w8, p, alpha, experts=[2])
    assert np.isnan(part[:3]).all() and np.isnan(part[7:]).all()
    np.testing.assert_array_equal(part[3:7], full[3:7])
    assert np.isfinite(full).all()


def test_gemm_errors_name_the_argument():
    rng = np.random.default_rng()
    offsets = np.array([0, 2])
    x8, s_x, w8 = e4m3_codes(rng, (2, 128)), np.ones((2, 1), f32), e4m3_codes(rng, (1, 3, 128))
    p, alpha = np.zeros(1, np.int32), np.ones(1)
    bad = x8.copy()
    bad[1, 5] = 0xFF
    with pytest.raises(ValueError, match=r"x8 holds the e4m3 NaN code 0xFF at \(1, 5\)"):
        w4a8.gemm(bad, s_x, offsets, w8, p, alpha)
    badw = w8.copy()
    badw[0, 2, 7] = 0x7F
    with pytest.raises(ValueError, match=r"w8 holds the e4m3 NaN code 0x7F at \(0, 2, 7\)"):
        w4a8.gemm_abs(x8, s_x, offsets, badw, p, alpha)
    with pytest.raises(ValueError, match=r"s_x must have shape \(2, 1\)"):
        w4a8.gemm(x8, np.ones((2, 2), f32), offsets, w8, p, alpha)
    with pytest.raises(ValueError, match=r"p must have shape \(1,\) or \(1, 3\)"):
        w4a8.gemm(x8, s_x, offsets, w8, np.zeros(3, np.int32), alpha)
    with pytest.raises(ValueError, match=r"alpha must have shape \(1,\)"):
        w4a8.gemm(x8, s_x, offsets, w8, p, np.ones(2))
    with pytest.raises(ValueError, match="offsets must rise"):
        w4a8.gemm(x8, s_x, np.array([0, 3]), w8, p, alpha)
    with pytest.raises(ValueError, match="expert 0's weights have shape"):
        w4a8.gemm(x8, s_x, offsets, e4m3_codes(rng, (1, 3, 64)), p, alpha)


def test_epilogue_factor_is_exact_or_names_the_global():
    g = np.array([4.65e-5, 1.0], f32)
    f = w4a8.epilogue_factor(np.array([3, -2]), g)
    assert f.dtype == np.float32
    np.testing.assert_array_equal(f, [g[0] * f32(8), f32(0.25)])
    with pytest.raises(ValueError, match="global_scale"):
        w4a8.epilogue_factor(3, np.float32(3e38))
    with pytest.raises(ValueError, match="global_scale"):
        w4a8.epilogue_factor(-30, np.float32(1e-30))


# ---------------------------------------------------------------------------------------------
# the float32 SwiGLU
# ---------------------------------------------------------------------------------------------


def f32_ulp(v):
    """float64: the float32 spacing at |v| (2^-149 for subnormals and zero)."""
    v = np.abs(np.asarray(v, np.float64)).astype(f32)
    with np.errstate(over="ignore"):
        return np.spacing(np.maximum(v, f32(2.0**-126))).astype(np.float64)


def silu64(g):
    g = np.asarray(g, np.float64)
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-g))


SILU_EDGES = np.array([0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-126, -(2.0**-126), 1e-30, -1e-30,
                       0.34657359, -0.34657359, 0.3465736, -0.3465736, 0.69314718, -0.69314718, 1.0, -1.0,
                       16.6, 17.0, -17.0, -87.33, -87.34, -90.0, -99.0, -103.27, -103.28, -103.97, -104.0,
                       -127.99, -128.0, -128.01, -1e30, 1e30, 3.4e38, -3.4e38], np.float64).astype(f32)


def draw_g(rng, n):
    """float32 g over silu's whole domain: uniform on [-140, 140], magnitudes log-uniform from
    2^-149 to 2^40 of both signs, and the edges (zeros, subnormals, the reduction's k steps, t and
    silu crossing into the subnormals, the clamp at -128, the largest finite)."""
    u = rng.uniform(-140, 140, n)
    m = np.exp2(rng.uniform(-149, 40, n)) * rng.choice([-1.0, 1.0], n)
    return np.concatenate([u.astype(f32), m.astype(f32), SILU_EDGES])


def test_exp_is_within_its_stated_ulps_and_exact_at_the_ends():
    rng = np.random.default_rng()
    x = -np.abs(draw_g(rng, 200_000))
    x = x[x >= -128]
    t = w4a8.exp_f32(x)
    assert t.dtype == f32
    err = np.abs(t - np.exp(x.astype(np.float64))) / f32_ulp(np.exp(x.astype(np.float64)))
    assert err.max() <= w4a8.EXP_ULPS, f"exp({x[np.argmax(err)]!r}) is {err.max():.3f} ulp off"
    np.testing.assert_array_equal(w4a8.exp_f32(np.array([0.0, -0.0, -104.0, -128.0, -np.inf], f32)),
                                  np.array([1, 1, 0, 0, 0], f32))


def test_silu_is_within_its_stated_ulps_of_the_float64_silu_of_the_same_g():
    rng = np.random.default_rng()
    g = draw_g(rng, 300_000)
    s = w4a8.silu_f32(g)
    assert s.dtype == f32
    want = silu64(g)
    err = np.abs(s - want) / f32_ulp(want)
    at = int(np.argmax(err))
    assert err[at] <= w4a8.SILU_ULPS, f"silu({g[at]!r}) = {s[at]!r}, float64 {want[at]!r}: {err[at]:.3f} ulp"


def test_silu_edges():
    """Signed zeros keep their sign; past 16.6 the sigmoid is 1 in float32 and silu(g) = g; at and
    below the clamp silu is -0 (the float64 value is below 2^-170); a subnormal g gives g / 2."""
    z = w4a8.silu_f32(np.array([0.0, -0.0], f32))
    assert z.view(np.uint32).tolist() == [0, 0x80000000]
    big = np.array([16.7, 17.0, 100.0, 1e30, 3.4e38, np.inf], f32)
    np.testing.assert_array_equal(w4a8.silu_f32(big), big)
    low = np.array([-128.0, -128.01, -300.0, -3.4e38, -np.inf], f32)
    assert (w4a8.silu_f32(low).view(np.uint32) == 0x80000000).all()
    sub = np.ldexp(np.arange(2, 200, 2, dtype=f32), -149).astype(f32)  # even multiples: g / 2 exact
    np.testing.assert_array_equal(w4a8.silu_f32(sub), sub / f32(2))
    np.testing.assert_array_equal(w4a8.silu_f32(-sub), -sub / f32(2))
    assert w4a8.silu_f32(np.array([-103.0], f32))[0] < 0  # silu's own subnormals survive the exp's


def _rn(v):
    """float64 -> float32 -> float64: one float32 rounding (of an exact or a double-rounded result:
    for +, -, *, / of float32 operands double then float is the float32 result, 53 >= 2 * 24 + 2)."""
    with np.errstate(over="ignore"):
        return np.asarray(v, np.float64).astype(f32).astype(np.float64)


def silu_from_the_docstring(g):
    """lab/w4a8.py's SwiGLU recipe as its module docstring states it, in float64 with a float32
    rounding after every operation (an independent restatement, not the function under test)."""
    g = np.asarray(g, f32).astype(np.float64)
    x = np.fmax(-np.abs(g), -128.0)
    k = np.rint(_rn(x * float(np.float32(1.4426950408889634))))
    r = _rn(_rn(x - _rn(k * 0.693145751953125)) - _rn(k * float(np.float32(1.428606820309417e-06))))
    q = float(np.float32(1 / 5040))
    for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1, 1):
        q = _rn(_rn(q * r) + float(np.float32(c)))
    t = _rn(q * np.exp2(k))  # exact in float64, rounded once
    d = _rn(1.0 + t)
    neg = _rn(_rn(x * q) / d) * np.exp2(k)
    return np.where(np.signbit(g), _rn(neg), _rn(g / d)).astype(f32)


def test_silu_is_the_docstrings_recipe_bit_for_bit():
    """Every operation is one float32 rounding in the stated order: no float64 promotion, no
    fused multiply-add, subnormals kept (the restatement rounds each float64 result once)."""
    rng = np.random.default_rng()
    g = draw_g(rng, 100_000)
    got, want = w4a8.silu_f32(g), silu_from_the_docstring(g)
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, f"{diff.size} differ, first silu({g[diff[0]]!r}) = {got[diff[0]]!r} vs {want[diff[0]]!r}"


def random_swiglu_input(rng, counts, i):
    counts = np.asarray(counts)
    e = counts.size
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    rows = int(offsets[-1])
    h = (rng.standard_normal((rows, 2 * i)) * np.exp2(rng.integers(-20, 20, (rows, 1)))).astype(f32)
    gate = (rng.uniform(0.5, 2.0, e) * np.exp2(rng.integers(-12, 4, e))).astype(f32)
    up = (gate * rng.uniform(0.7, 0.9, e)).astype(f32)
    return h, offsets, gate, up


def test_swiglu_f32_against_the_float64_reference_on_the_same_h():
    """|a - reference.swiglu| <= (|g| + 10) 2^-24 |ref| + ((SILU_ULPS + 1) |u| + 1) 2^-149: g's
    float32 rounding costs (1 + |g|) 2^-24 through exp (its condition number), u's 2^-24, silu
    2 SILU_ULPS 2^-24 and the product 2^-24; where silu is subnormal its error is absolute, in
    units of 2^-149, and u multiplies it."""
    rng = np.random.default_rng()
    counts = [5, 0, 17, 3, 0, 40]
    h, offsets, gate, up = random_swiglu_input(rng, counts, 96)
    edges = np.clip(SILU_EDGES, -1e30, 1e30)  # (g * u must stay finite)
    h[1, : len(edges)] = edges / gate[0]  # the edges as g (up to the product's rounding)
    h[1, 96: 96 + len(edges)] = f32(0.5)
    a = w4a8.swiglu_f32(h, offsets, gate, up)
    assert a.dtype == f32
    ref = reference.swiglu(h, offsets, gate, up)
    e_row = np.repeat(np.arange(len(counts)), counts)
    g = np.abs(h[:, :96].astype(np.float64) * gate[e_row][:, None])
    u = np.abs(h[:, 96:].astype(np.float64) * up[e_row][:, None])
    bound = (g + 10) * 2.0**-24 * np.abs(ref) + ((w4a8.SILU_ULPS + 1) * u + 1) * 2.0**-149
    err = np.abs(a - ref)
    at = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), f"a{at} = {a[at]!r} vs {ref[at]!r} (g {g[at]!r}): {err[at] / bound[at]:.2f} x bound"


def test_swiglu_quant_is_the_quantize_of_the_float32_swiglu_and_keeps_to_its_experts():
    rng = np.random.default_rng()
    h, offsets, gate, up = random_swiglu_input(rng, [7, 0, 12, 4], 192)  # I = 192: one short group
    a, a8, s_a = w4a8.swiglu_quant(h, offsets, gate, up)
    want8, want_s = w4a8.quantize_act(w4a8.swiglu_f32(h, offsets, gate, up))
    np.testing.assert_array_equal(a8, want8)
    np.testing.assert_array_equal(s_a.view(np.uint32), want_s.view(np.uint32))
    h2 = h.copy()
    h2[offsets[0]:offsets[1]] = np.nan  # expert 0 not asked for: its rows may hold anything
    pa, pa8, ps = w4a8.swiglu_quant(h2, offsets, gate, up, experts=[2, 3])
    rows = np.arange(offsets[2], offsets[4])
    np.testing.assert_array_equal(pa[rows], a[rows])
    np.testing.assert_array_equal(pa8[rows], a8[rows])
    assert np.isnan(pa[: offsets[1]]).all() and not pa8[: offsets[1]].any() and not ps[: offsets[1]].any()


def test_swiglu_errors_name_the_argument():
    rng = np.random.default_rng(0)
    h, offsets, gate, up = random_swiglu_input(rng, [3, 2], 64)
    with pytest.raises(ValueError, match="h must be"):
        w4a8.swiglu_f32(h.astype(np.float64), offsets, gate, up)
    with pytest.raises(ValueError, match="gate_global"):
        w4a8.swiglu_f32(h, offsets, gate.astype(np.float64), up)
    with pytest.raises(ValueError, match="up_global"):
        w4a8.swiglu_f32(h, offsets, gate, up[:1])
    with pytest.raises(ValueError, match="offsets"):
        w4a8.swiglu_f32(h, np.array([0, 3, 4]), gate, up)
    bad = h.copy()
    bad[4, 70] = np.inf
    with pytest.raises(ValueError, match=r"h holds NaN or Inf \(row 4, column 70\)"):
        w4a8.swiglu_f32(bad, offsets, gate, up)
    w4a8.swiglu_f32(bad, offsets, gate, up, experts=[0])  # row 4 is expert 1's
    big = h.copy()
    big[1, 3], big[1, 64 + 3] = 1e30, 1e30
    with pytest.raises(ValueError, match="h: the SwiGLU overflows float32 at row 1, column 3"):
        w4a8.swiglu_f32(big, offsets, gate, np.full(2, 1e10, f32))


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------


def dense_w4a8_layer(x_rows, offsets, w, per_row):
    """The layer in one dense pass per expert from the bits: weights by the oracle's RNE of
    m * s * 2^-p (p from the amax of each matrix or row), activations by oracle_quantize_act."""
    E, I = w.experts, w.intermediate

    def w8_of(packed, scales):
        v = decode_blocks(packed, scales)
        amax = np.abs(v).max(axis=-1, keepdims=True)
        if not per_row:
            amax = np.full_like(amax, amax.max())
        p = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / 448)), 0)
        q = e4m3_from_bits(e4m3_round(np.abs(v) * 2.0**-p))
        return np.where(v < 0, -q, q), 2.0**p

    def fp8(a):
        codes, s = oracle_quantize_act(a)
        return e4m3_from_bits(codes) * np.repeat(s.astype(np.float64), 128, axis=1)[:, : a.shape[1]]

    out = np.zeros((x_rows.shape[0], w.hidden))
    xq = fp8(x_rows)
    for e in range(E):
        r = slice(offsets[e], offsets[e + 1])
        if offsets[e + 1] == offsets[e]:
            continue
        w13, f13 = w8_of(w.w13_packed[e], w.w13_scales[e])
        w2, f2 = w8_of(w.w2_packed[e], w.w2_scales[e])
        h = ((xq[r] @ w13.T) * f13[:, 0]).astype(f32)  # the contract's h, rounded as a GEMM writes it
        g, u = h[:, :I] * w.gate_global[e], h[:, I:] * w.up_global[e]  # float32 products
        a = w4a8.silu_f32(g) * u  # the float32 SwiGLU's own tests are in the SwiGLU section
        out[r] = (fp8(a) @ w2.T) * f2[:, 0] * float(w.w2_global[e])
    return out


@pytest.mark.parametrize("per_row", [False, True])
def test_layer_rows_matches_a_dense_computation(per_row):
    """H = 192: the w13 K ends in a 64-column group, I = 64: w2's K is one short group."""
    seed = int(np.random.default_rng().integers(2**31))
    problem = MoEProblem(experts=4, hidden=192, intermediate=64, top_k=2)
    w = random_weights(problem, seed)
    routing = make_routing(40, 4, 2, skew=1.0, seed=seed)
    x_rows = random_activations(40, 192, seed)[routing.row_token]
    got = w4a8.layer_rows(x_rows, routing.offsets, w, per_row=per_row)
    want = dense_w4a8_layer(x_rows, routing.offsets, w, per_row)
    scale = np.abs(want).max()
    assert np.abs(got["out"] - want).max() <= 1e-12 * scale, f"seed {seed}"
    p13, p2 = w4a8.layer_p(w, per_row)
    np.testing.assert_array_equal(got["p13"], p13)
    np.testing.assert_array_equal(got["p2"], p2)
    part = w4a8.layer_rows(x_rows, routing.offsets, w, per_row=per_row, experts=[1, 3])
    rows = np.r_[routing.offsets[1]:routing.offsets[2], routing.offsets[3]:routing.offsets[4]]
    np.testing.assert_array_equal(part["out"][rows], got["out"][rows])
    others = np.setdiff1d(np.arange(routing.rows), rows)
    assert np.isnan(part["out"][others]).all() and not part["a8"][others].any()


def test_layer_rows_refuses_a_p_that_overflows():
    problem = MoEProblem(experts=2, hidden=64, intermediate=64, top_k=1)
    w = random_weights(problem, 1)
    routing = make_routing(4, 2, 1, seed=1)
    x_rows = random_activations(4, 64, 1)[routing.row_token]
    p13, p2 = w4a8.layer_p(w)
    with pytest.raises(ValueError, match=r"p=.* exceed 448"):
        w4a8.layer_rows(x_rows, routing.offsets, w, p13=p13 - 1, p2=p2)


# ---------------------------------------------------------------------------------------------
# the error study
# ---------------------------------------------------------------------------------------------


def test_error_study_orders_the_variants_as_their_activation_bits(tmp_path):
    """On a small layer: bf16 activations beat fp8, fp8 beats NVFP4; the fp8 activations alone, and
    each recipe's weights alone, cost less than the recipe; a fifth to a quarter of the weights
    round; the JSON holds the tables."""
    spec = importlib.util.spec_from_file_location("w4a8_error_study", ROOT / "scripts" / "w4a8_error_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--hidden", "256", "--intermediate", "128", "--tokens", "64", "--json",
                     str(tmp_path / "t.json")]) == 0
    import json

    res = json.loads((tmp_path / "t.json").read_text())
    err = {r["variant"]: r["rel_error"] for r in res["errors"]}
    assert set(err) == {"w4a16", "w4a8", "w4a8-row", "a8-only", "w8-only", "fp8-rowwise", "rowwise-w-only", "w4a4"}
    assert err["w4a16"] < err["a8-only"] < err["w4a8"] < err["w4a4"]
    # each recipe's weights alone cost less than the recipe, and more than nothing
    assert 0 < err["w8-only"] < err["w4a8"] and 0 < err["rowwise-w-only"] < err["fp8-rowwise"]
    assert 0 < err["w4a16"] < 1e-2 and err["w4a4"] < 0.5
    total = [r for r in res["weights"] if r["matrix"] == "all" and r["p_rule"] == "expert"][0]
    assert 0.15 < total["rounded_fraction"] < 0.3


def test_error_study_runs_on_the_gpu_scripts_synthetic_layer(tmp_path):
    """--weights synthetic takes lab/problem.py random_weights: the same tables, named in the
    config, with the codes' rounding above the Student-t layer's (uniform codes, any scale)."""
    spec = importlib.util.spec_from_file_location("w4a8_error_study", ROOT / "scripts" / "w4a8_error_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--weights", "synthetic", "--experts", "2", "--hidden", "256", "--intermediate", "128",
                     "--tokens", "64", "--json", str(tmp_path / "s.json")]) == 0
    import json

    res = json.loads((tmp_path / "s.json").read_text())
    assert res["config"]["weights"] == "synthetic"
    err = {r["variant"]: r["rel_error"] for r in res["errors"]}
    assert err["w4a16"] < err["a8-only"] < err["w4a8"] < err["w4a4"]
    total = [r for r in res["weights"] if r["matrix"] == "all" and r["p_rule"] == "expert"][0]
    assert total["rounded_fraction"] > 0.25 and total["subnormal_fraction"] > 0.01
