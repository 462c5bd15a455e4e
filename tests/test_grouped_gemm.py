"""Grouped GEMM: layout and heuristics on the CPU; the kernel against float64 on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lab import checks, models, nvfp4, reference
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg
from lab.kernels import jit
from lab.problem import make_routing, tokens_for_mean
from config_mirror import assert_config_mirror


def random_nvfp4(rng, shape, scale_codes=(1, 127)):
    """Random codes over all 16 nibbles and e4m3 scales over the given code range."""
    packed = rng.integers(0, 256, shape[:-1] + (shape[-1] // 2,), dtype=np.uint8)
    scales = rng.integers(*scale_codes, shape[:-1] + (shape[-1] // 16,), dtype=np.uint8)
    return packed, scales


# Block-scale profiles of a row: the codes its blocks draw from. A row of zero and subnormal
# scales (codes 1-7, 2^-9 .. 7 * 2^-9) has every one of its products tiny, so a kernel that
# flushes them loses the whole of such an output element, not a share too small to see.
SCALE_PROFILES = (
    np.arange(1, 0x7F),  # every finite positive code
    np.arange(1, 8),  # e4m3 subnormals
    np.arange(0, 8),  # zero and subnormals
    np.array([0, 1, 2, 3, 0x7E]),  # the extremes together
    np.array([0]),  # an all-zero row
)


def profiled_scales(rng, profiles, k16):
    """(rows, k16) e4m3 codes, row r drawn from SCALE_PROFILES[profiles[r]]."""
    profiles = np.asarray(profiles)
    out = np.empty((profiles.size, k16), np.uint8)
    for p, codes in enumerate(SCALE_PROFILES):
        rows = np.flatnonzero(profiles.reshape(-1) == p)
        out[rows] = rng.choice(codes, (rows.size, k16)).astype(np.uint8)
    return out.reshape(profiles.shape + (k16,))


def edge_nvfp4(rng, shape, profiles):
    """Random codes over all 16 nibbles with block scales by row profile (profiled_scales)."""
    packed = rng.integers(0, 256, shape[:-1] + (shape[-1] // 2,), dtype=np.uint8)
    return packed, profiled_scales(rng, profiles, shape[-1] // 16)


def assert_within_element_bound(got, xq, xs, offsets, packed, scales, alpha):
    """Every output element within (K + 1) * 2^-23 of alpha * sum_k |x_k w_k|, the float64 sum
    of the exact products' magnitudes: the kernel's products are exact and only its fp32
    accumulation (and the alpha product) round. Elements of all-zero blocks are exactly 0."""
    k = 2 * xq.shape[1]
    ref = reference.grouped_gemm(xq, xs, offsets, packed, scales, alpha)
    mag = reference.grouped_gemm(xq & 0x77, xs, offsets, packed & 0x77, scales, np.abs(alpha))  # sign bits cleared
    err = np.abs(got.astype(np.float64) - ref)
    bound = (k + 1) * 2.0**-23 * mag
    bad = np.argwhere(~(err <= bound))
    if bad.size:
        r, n = bad[0]
        raise AssertionError(f"{len(bad)} elements past the bound, first out[{r}, {n}] = {got[r, n]!r}, float64 "
                             f"{ref[r, n]!r}, sum |x w| {mag[r, n]!r} (x scales {np.unique(xs[r]).tolist()})")


# ------------------------------------------------------------------------------- CPU: layout


@settings(max_examples=25)
@given(e=st.integers(1, 3), nt=st.integers(1, 5), ka=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_prepare_is_a_bijection(e, nt, ka, seed):
    rng = np.random.default_rng(seed)
    n, k = 64 * nt, 64 * ka
    packed, scales = random_nvfp4(rng, (e, n, k))
    layout = (64 * [1, 1, 2, 4][nt % 4] if n % (64 * [1, 1, 2, 4][nt % 4]) == 0 else 64, 64)
    prep = gw.prepare_weights(packed, scales, layout=layout)
    assert prep.data.shape == (e, n // layout[0], k // 64, layout[0] // 16, 1, gw.ATOM_BYTES)
    p2, s2 = gw.unprepare_weights(prep)
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(s2, scales)


def codes_through_decode_words(packed, scales) -> np.ndarray:
    """(E, N, K) float64: the e2m1 values decode_words (the NumPy copy of the kernel's decode_a)
    gives each lane's registers from the prepared words, put back where the kernel uses them:
    lane 4g+t, register q holds rows g + 8*(q&1), k slots 2t + 8*(q>>1) + {0, 1} as fp16 v*2^-14
    (slot c of a k16 step being column K_SLOTS[c])."""
    e, n, k = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
    data = gw.prepare_weights(packed, scales, layout=(64, 64)).data  # [e][block][kc][tile][katom]
    atoms = data.transpose(0, 1, 3, 2, 4, 5).reshape(e, n // 16, k // 64, gw.ATOM_BYTES)
    words = atoms[..., :512].copy().view(np.uint32)
    regs = gw.decode_words(words.reshape(e, n // 16, k // 64, 32, 4))
    out = np.full((e, n, k), np.nan)
    for q in range(4):
        h = regs[q].view(np.float16).reshape(e, n // 16, k // 64, 8, 4, 4, 2).astype(np.float64) * 2.0**14
        for g in range(8):
            for t in range(4):
                for j in range(4):
                    for half in range(2):
                        rows = np.arange(n // 16) * 16 + g + 8 * (q & 1)
                        cols = np.arange(k // 64) * 64 + 16 * j + gw.K_SLOTS[2 * t + 8 * (q >> 1) + half]
                        out[:, rows[:, None], cols[None, :]] = h[:, :, :, g, t, j, half]
    return out


def test_decode_emulation_gives_each_lane_its_fragment():
    """decode_words on the prepared words yields every code where the kernel's MMA fragments
    expect it (codes_through_decode_words), -0.0 included."""
    rng = np.random.default_rng()
    packed, scales = random_nvfp4(rng, (2, 64, 128))
    got = codes_through_decode_words(packed, scales)
    want = nvfp4.decode_codes(packed).astype(np.float64)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_activation_decode_fills_the_same_k_slots():
    """decode_x_words (the kernel's decode_x) on a raw NVFP4 word puts k = K_SLOTS[2a], K_SLOTS[2a+1]
    in register a as fp16 v*2^-14: the activations' B fragments use the weights' slot order."""
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(4096, 8), dtype=np.uint8)  # 16 codes = one k16 block
    codes = nvfp4.decode_codes(raw)  # (4096, 16) float: k = 0..15
    words = raw.view(np.uint32)  # (4096, 2): k 0..7, k 8..15
    for w in range(2):
        regs = gw.decode_x_words(words[:, w])
        for a in range(4):
            h = regs[a].view(np.float16).reshape(-1, 2).astype(np.float64) * 2.0**14
            for half in range(2):
                slot = 8 * w + 2 * a + half
                np.testing.assert_array_equal(h[:, half], codes[:, gw.K_SLOTS[slot]])


def test_permute_k_round_trip():
    rng = np.random.default_rng(6)
    packed = rng.integers(0, 256, size=(3, 5, 64), dtype=np.uint8)
    out = gw.permute_k(packed, gw.K_SLOTS)
    codes, got = nvfp4.decode_codes(packed), nvfp4.decode_codes(out)
    np.testing.assert_array_equal(got.reshape(3, 5, -1, 16), codes.reshape(3, 5, -1, 16)[..., gw.K_SLOTS])
    np.testing.assert_array_equal(gw.permute_k(out, np.argsort(gw.K_SLOTS)), packed)
    assert sorted(gw.K_SLOTS.tolist()) == list(range(16))


def test_scales_sit_where_the_kernel_reads_them():
    rng = np.random.default_rng(2)
    packed, scales = random_nvfp4(rng, (2, 64, 192))
    data = gw.prepare_weights(packed, scales, layout=(64, 64)).data  # [e][block][kc][tile][1][576]
    for e, nt, ka, g, j in [(0, 0, 0, 0, 0), (1, 3, 2, 7, 3), (0, 2, 1, 5, 1)]:
        got = data[e, 0, ka, nt, 0, 512 + 8 * g + 2 * j: 512 + 8 * g + 2 * j + 2]
        want = [scales[e, nt * 16 + g, ka * 4 + j], scales[e, nt * 16 + g + 8, ka * 4 + j]]
        assert list(got) == want


def test_fp16_product_of_code_and_scale_is_exact():
    """v * 2^-14 (fp16, maybe subnormal) times any e4m3 scale is exact in fp16: the kernel's
    weight decode loses nothing, tiny scales included."""
    v = nvfp4.E2M1_VALUES.astype(np.float64)
    s = nvfp4.decode_e4m3(np.arange(1, 127, dtype=np.uint8)).astype(np.float64)
    exact = (v[:, None] * 2.0**-14) * s[None, :]
    code16 = (v * 2.0**-14).astype(np.float16)
    assert np.array_equal(code16.astype(np.float64), v * 2.0**-14)
    prod = (code16[:, None] * s.astype(np.float16)[None, :]).astype(np.float64)
    np.testing.assert_array_equal(prod, exact)


def emulated_gemm(xq, xs, offsets, packed, scales, alpha, flush_subnormal_x_scales=False):
    """A GEMM as the kernel does it in arithmetic, one k at a time: exact products, a float32
    running sum, one float32 alpha product; optionally with e4m3 subnormal activation scales
    (codes 1-7) read as 0, as a kernel that flushes them would."""
    xs = np.where((xs > 0) & (xs < 8), 0, xs).astype(np.uint8) if flush_subnormal_x_scales else xs
    x = nvfp4.dequantize_blocks(xq, xs)
    w = nvfp4.dequantize_blocks(packed, scales)
    e_of_row = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    prod = (x[:, None, :] * w[e_of_row]).astype(np.float32)  # exact: a handful of significant bits
    acc = np.cumsum(prod, axis=-1, dtype=np.float32)[..., -1]
    return (acc * alpha[e_of_row, None]).astype(np.float32)


def test_element_bound_passes_fp32_accumulation_and_fails_a_kernel_flushing_subnormal_scales():
    """The GPU tests' per-element bound on the kernel's own arithmetic (emulated), and on the
    same arithmetic with subnormal activation scales flushed, which the bound must reject."""
    rng = np.random.default_rng()
    p = len(SCALE_PROFILES)
    counts = np.array([2 * p, 0, 3 * p])
    e, n, k = len(counts), 2 * p, 256
    offsets = np.concatenate([[0], np.cumsum(counts)])
    packed, scales = edge_nvfp4(rng, (e, n, k), np.tile(np.arange(n) % p, (e, 1)))
    xq, xs = edge_nvfp4(rng, (int(offsets[-1]), k), np.arange(int(offsets[-1])) % p)
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    assert_within_element_bound(emulated_gemm(xq, xs, offsets, packed, scales, alpha), xq, xs, offsets,
                                packed, scales, alpha)
    flushed = emulated_gemm(xq, xs, offsets, packed, scales, alpha, flush_subnormal_x_scales=True)
    with pytest.raises(AssertionError, match="past the bound"):
        assert_within_element_bound(flushed, xq, xs, offsets, packed, scales, alpha)


def test_prepare_rejects_bad_shapes():
    with pytest.raises(ValueError, match="w_packed"):
        gw.prepare_weights(np.zeros((64, 32), np.uint8), np.zeros((64, 4), np.uint8))
    with pytest.raises(ValueError, match="w_scales"):
        gw.prepare_weights(np.zeros((1, 64, 32), np.uint8), np.zeros((1, 64, 3), np.uint8))
    with pytest.raises(ValueError, match="multiples of 64"):
        gw.prepare_weights(np.zeros((1, 48, 32), np.uint8), np.zeros((1, 48, 4), np.uint8))


# ------------------------------------------------------------------------ CPU: configurations


@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 2048), (64, 64), (192, 320), (128, 896)])
@pytest.mark.parametrize("mean", [0.5, 2, 8, 32, 300])
def test_heuristic_gives_a_valid_config(n, k, mean):
    counts = np.random.default_rng(0).poisson(mean, 64)
    cfg = gc.heuristic(n, k, counts)
    assert n % cfg.block_rows == 0 and k % cfg.k_step == 0
    assert cfg.smem_bytes <= gc.SMEM_LIMIT
    if (counts > 0).any():  # Poisson counts: the percentile's tile (the model is for skewed routing)
        assert cfg.max_frags == _percentile_frags(counts, cfg, k)


def _percentile_frags(counts, cfg, k) -> int:
    """The heuristic's token tile under uniform routing: the smallest compiled tile holding the
    99th percentile in one pass; past 64 tokens, on an image tile of 8 warps x 2 row tiles, the
    96-token image tile up to 96 where K holds its K_STEP chunks in pairs, else the 160-token one
    (3 stages, no pairs)."""
    q = int(np.ceil(np.quantile(counts[counts > 0], 0.99)))
    if q > 64 and cfg.image and (cfg.warps, cfg.row_tiles) == (8, 2):
        if q > 96:
            return 20
        if k % (2 * cfg.k_step) == 0:
            return 12
    return gc.frags_for(q)


@pytest.mark.parametrize("model", sorted(models.MODELS))
def test_uniform_routings_keep_the_percentile_tile(model):
    """The token-tile model changes nothing under uniform routing, at any shape the lab presets or
    mean from 1 to 2048: the committed uniform results describe the heuristic as it is. (Without
    the dispersion test the model would move llama-4-maverick's w13 at mean 12 to a 16-token tile,
    which no run has measured.)"""
    m = models.MODELS[model]
    for mean in (1, 2, 4, 8, 12, 16, 24, 32, 64, 128, 512, 2048):
        routing = make_routing(tokens_for_mean(mean, m.experts, m.top_k), m.experts, m.top_k, seed=mean)
        counts = np.diff(routing.offsets)
        for n, k in ((2 * m.intermediate, m.hidden), (m.hidden, m.intermediate)):
            cfg = gc.heuristic(n, k, counts)
            assert cfg.max_frags == _percentile_frags(counts, cfg, k), (mean, n, k)


@pytest.mark.parametrize("skew, frags, mma, ctas", [(0.4, 2, 0, 2), (1.2, 4, 0, 0)])
def test_skewed_routing_takes_the_tile_measured_fastest(skew, frags, mma, ctas):
    """Mean 8 at the study's shape: bench_gemm measured (w13 / w2 % of the read) at skew 0.4 the
    16-token tile 84.2 / 83.4 against the percentile's 32-token one 77.9 / 76.3, and at skew 1.2
    the 32-token mma.sync tile 67.3 / 66.2 against the percentile's 64-token wgmma one 63.3 / 61.5
    (notes/gemm-log.md v20)."""
    routing = make_routing(tokens_for_mean(8, 288, 8), 288, 8, skew=skew, seed=0)
    for n, k in ((4096, 4096), (4096, 2048)):
        cfg = gc.heuristic(n, k, np.diff(routing.offsets))
        assert (cfg.max_frags, cfg.mma, cfg.ctas_per_sm) == (frags, mma, ctas), cfg


def test_token_tile_model():
    assert gc.modelled_time(np.zeros(8, int), 2, 16, 2) == 1.0
    one_pass = gc.modelled_time(np.full(256, 8), 1, 16, 2)
    assert one_pass == pytest.approx(1.03, rel=0.02)  # every expert in one 8-token pass, a small tail
    assert gc.modelled_time(np.full(256, 16), 1, 16, 2) == pytest.approx(2 * one_pass)  # two passes each
    # one hot expert: its units are longer than a CTA's share of the rest, so the tail binds
    hot = np.r_[np.full(255, 8), 400]
    assert gc.modelled_time(hot, 1, 16, 2) > gc.modelled_time(hot, 8, 16, 1)


def test_frags_for():
    assert [gc.frags_for(c) for c in (1, 8, 9, 16, 17, 32, 33, 64, 65, 1000)] == [1, 1, 2, 2, 4, 4, 8, 8, 8, 8]


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="k_step"):
        gc.GemmConfig(k_step=96).validate()
    with pytest.raises(ValueError, match="shared memory"):
        gc.GemmConfig(warps=8, row_tiles=4, k_step=256, stages=12, max_frags=8).validate()
    with pytest.raises(ValueError, match="multiple of the block"):
        gc.GemmConfig(warps=8, row_tiles=2).validate(n=192, k=256)
    cfg = gc.GemmConfig(warps=4, row_tiles=1)  # 64-row blocks; the unit ring holds 15 bits of block
    cfg.validate(n=((1 << 15) - 1) * cfg.block_rows, k=256)
    with pytest.raises(ValueError, match="row blocks"):
        cfg.validate(n=(1 << 15) * cfg.block_rows, k=256)


def test_shipped_configs_fit():
    for cfg in gc.SHIPPED_CONFIGS:
        cfg.validate()
        assert cfg.launch_smem(1024) <= gc.SMEM_LIMIT


def test_resident_ctas():
    small = gc.GemmConfig(8, 2, 128, 4, 2)
    assert gc.resident_ctas(small, 288, 64) == 2  # ~96 KB of shared memory each
    assert gc.resident_ctas(gc.GemmConfig(8, 2, 128, 4, 8), 288, 143) == 1


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
def test_smem_mirror_equals_the_kernels_config(tmp_path):
    """GemmConfig.smem_bytes, .threads and .stage_bytes agree with Config<> for every shipped and
    fused instantiation."""
    assert_config_mirror(tmp_path, sorted(set(gc.SHIPPED_CONFIGS) | set(gc.SHIPPED_FUSED), key=str))


def _heuristic_tiles() -> list:
    """Every tile the heuristic picks over a spread of shapes and token counts."""
    seen = {}
    for n in (64, 128, 192, 256, 384, 512, 4096):
        for k in (64, 128, 320, 4096):
            for count in (1, 9, 17, 40, 70, 300):
                cfg = gc.heuristic(n, k, np.full(8, count))
                seen[cfg.expression] = cfg
    return sorted(seen.values(), key=lambda c: c.expression)


def test_the_heuristic_picks_wgmma_for_64_token_tiles_only():
    tiles = _heuristic_tiles()
    for cfg in tiles:  # wgmma needs whole warpgroups of consumers
        assert cfg.mma == (cfg.max_frags >= 8 and cfg.warps % 4 == 0), cfg
        assert cfg.image == (cfg.mma == 1), cfg  # every wgmma tile reads the activation image
    assert any(cfg.mma for cfg in tiles)


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg", _heuristic_tiles(), ids=lambda c: c.expression.split("<")[1][:-1])
def test_heuristic_tiles_compile_without_spills(cfg):
    """Tiles outside SHIPPED_CONFIGS that small shapes lead to: no spills, no serialized wgmma."""
    info = jit.ptxas_report(gg.SOURCE, cfg.expression)
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info
    assert info.registers <= 65536 // cfg.threads, info
    assert not info.wgmma_serialized, info


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg", gc.SHIPPED_CONFIGS, ids=lambda c: c.expression.split("<")[1][:-1])
def test_shipped_configs_compile_without_spills(cfg):
    for read_only in (False, True):
        info = jit.ptxas_report(gg.SOURCE, cfg.expression_for(read_only))
        assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info
        assert info.registers <= 65536 // cfg.threads, info
        assert not info.wgmma_serialized, info


def _split_tiles():
    """The tiles gemm_plan splits into (both mma.sync) and split_configs' wgmma tiles, as their
    counts_in instantiations take them."""
    from lab.problem import make_routing

    counts = np.array([0, 1, 3, 9, 12, 16, 5, 2, 40, 150, 270, 7] * 8)
    plans = [gc.gemm_plan(n, k, counts) for n, k in ((4096, 4096), (4096, 2048))]
    plans += [gc.split_configs(4096, 4096, counts, 16)]
    for skew in (0.4, 0.8, 1.2):  # the study's skewed routings at mean 8 (0.4: the 64-token image tile)
        c = make_routing(288, 288, 8, skew=skew, seed=0).counts
        plans += [gc.gemm_plan(n, k, c) for n, k in ((4096, 4096), (4096, 2048))]
    return sorted({cfg for plan in plans for cfg, _ in plan}, key=lambda c: c.expression)


def assert_counts_in_compiles_clean(cfg) -> None:
    """cfg's COUNTS_IN instantiation (one size class of a split): no spills, registers for its
    threads, no serialized wgmma."""
    info = jit.ptxas_report(gg.SOURCE, cfg.expression_for(False, counts_in=True))
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info
    assert info.registers <= 65536 // cfg.threads, info
    assert not info.wgmma_serialized, info


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg", _split_tiles(), ids=lambda c: c.expression.split("<")[1][:-1])
def test_split_tiles_compile_without_spills(cfg):
    """The instantiation that takes one size class (COUNTS_IN) of every tile a split launches."""
    assert_counts_in_compiles_clean(cfg)


def test_gemm_plan_splits_skewed_routing_by_expert_size():
    """One launch for uniform routing (and, with bf16 activations, wherever the heuristic keeps the
    16-token tile); two by expert size at SPLIT_AT for skewed routing whose one launch runs a
    mma.sync tile (with bf16 activations: one past 16 tokens): the
    hot experts on an image tile with NVFP4 activations, on mma.sync with bf16 ones (whose k16
    sums round); one prepared layout; each plan covers every count exactly once."""
    from lab.problem import make_routing

    assert gc.split_configs(4096, 4096, [3, 300], 16, wgmma=False)[1][0].mma == 0
    for mean, skew, splits in ((8, 0.0, ()), (8, 0.4, ("nvfp4",)), (8, 0.8, gc.ACTS), (8, 1.2, gc.ACTS),
                               (32, 0.0, ()), (32, 1.2, ()), (512, 0.0, ())):
        counts = make_routing(int(mean * 288 / 8), 288, 8, skew=skew, seed=3).counts
        for (n, k), act in [(nk, a) for nk in ((4096, 4096), (4096, 2048)) for a in gc.ACTS]:
            plan = gc.gemm_plan(n, k, counts, act=act)
            one = gc.heuristic(n, k, counts, act=act)
            split = act in splits
            assert (len(plan) == 2) == split, (mean, skew, act, plan)
            if not split:
                assert plan == ((one, gc.ALL_COUNTS),)
                continue
            assert [r for _, r in plan] == [(1, gc.SPLIT_AT), (gc.SPLIT_AT + 1, gc.ALL_COUNTS[1])]
            (cold, _), (hot, _) = plan
            assert one.mma == 0 and cold.mma == 0 and not cold.image, plan
            assert hot.image if act == "nvfp4" else (hot.mma == 0 and not hot.image), plan
            assert {(c.block_rows, c.k_step) for c, _ in plan} == {(one.block_rows, one.k_step)}
            active = counts[counts > 0]
            covered = sum(((active >= lo) & (active <= hi)).astype(int) for _, (lo, hi) in plan)
            assert (covered == 1).all()


# ---------------------------------------------------------------------------------- GPU


def run_gemm(cp, packed, scales, xq, xs, offsets, alpha, cfg=None, poison=np.nan):
    e, n, k = gw.check_weight_shapes(packed, scales)
    counts = np.diff(offsets)
    cfg = cfg or gc.heuristic(n, k, counts)
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(cfg.block_rows, cfg.k_step))
    out = cp.full((xq.shape[0], n), poison, dtype=cp.float32)
    gg.grouped_gemm(prep, cp.asarray(xq), cp.asarray(xs), cp.asarray(offsets.astype(np.int32)),
                    cp.asarray(alpha.astype(np.float32)), out, cfg)
    return out.get()


def counts_strategy():
    return st.lists(st.one_of(st.just(0), st.integers(1, 20), st.integers(120, 200)), min_size=1, max_size=16)


profile_index = st.integers(0, len(SCALE_PROFILES) - 1)


@pytest.mark.gpu
@settings(max_examples=30)
@given(counts=counts_strategy(), nb=st.integers(1, 4), ka=st.integers(1, 12), seed=st.integers(0, 2**31),
       data=st.data())
def test_gemm_matches_float64(counts, nb, ka, seed, data):
    """Drawn: ragged counts, N, K, and each activation row's and weight row's block-scale
    profile (zero, subnormal and largest codes on both operands); each element within the fp32
    accumulation bound of sum |x_k w_k|, and the whole within 1e-5."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    rng = np.random.default_rng(seed)
    e, n, k = len(counts), 64 * nb, 64 * ka
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows = int(offsets[-1])
    w_prof = data.draw(hnp.arrays(np.int8, (e, n), elements=profile_index), label="weight row profiles")
    x_prof = data.draw(hnp.arrays(np.int8, rows, elements=profile_index), label="activation row profiles")
    packed, scales = edge_nvfp4(rng, (e, n, k), w_prof)
    xq, xs = edge_nvfp4(rng, (rows, k), x_prof)
    alpha = rng.uniform(1e-6, 1e-2, e).astype(np.float32)
    got = run_gemm(cp, packed, scales, xq, xs, offsets, alpha)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    assert_within_element_bound(got, xq, xs, offsets, packed, scales, alpha)
    ref = reference.grouped_gemm(xq, xs, offsets, packed, scales, alpha)
    if got.size and np.abs(ref).max() > 0:
        assert checks.rel_error(got, ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("mma", [0, 1])
def test_zero_subnormal_and_largest_scales_on_both_operands(mma):
    """Every pairing of row profiles (all codes, subnormal, zero + subnormal, extremes, all
    zero) between activations and weights, each output element against its own bound: a kernel
    that flushes subnormal scales, or mistakes code 0, fails on the tiny elements."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    rng = np.random.default_rng()
    p = len(SCALE_PROFILES)
    counts = np.array([3 * p, 0, 9 * p])  # both fragment paths, an empty expert between
    e, n, k = len(counts), 256, 256
    offsets = np.concatenate([[0], np.cumsum(counts)])
    packed, scales = edge_nvfp4(rng, (e, n, k), np.tile(np.arange(n) % p, (e, 1)))
    xq, xs = edge_nvfp4(rng, (int(offsets[-1]), k), np.arange(int(offsets[-1])) % p)
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    cfg = gc.GemmConfig(4, 4, 128, 3, 8 if mma else 2, mma)
    got = run_gemm(cp, packed, scales, xq, xs, offsets, alpha, cfg)
    assert np.isfinite(got).all()
    assert_within_element_bound(got, xq, xs, offsets, packed, scales, alpha)


@pytest.mark.gpu
@pytest.mark.parametrize("mma", [0, 1])
@pytest.mark.parametrize("frags", [1, 2, 4, 8])
def test_every_token_count_per_instruction(mma, frags):
    """Counts 0..70 cover every fragment count (and so every wgmma N) and multi-pass experts."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    rng = np.random.default_rng(11 + frags)
    counts = np.array([0, 1, 7, 8, 9, 15, 16, 17, 23, 24, 31, 33, 40, 47, 48, 56, 63, 64, 65, 70])
    e, n, k = len(counts), 256, 256
    offsets = np.concatenate([[0], np.cumsum(counts)])
    packed, scales = random_nvfp4(rng, (e, n, k))
    xq, xs = random_nvfp4(rng, (int(offsets[-1]), k))
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    cfg = gc.GemmConfig(4, 4, 128, 3, frags, mma)
    got = run_gemm(cp, packed, scales, xq, xs, offsets, alpha, cfg)
    assert np.isfinite(got).all()
    ref = reference.grouped_gemm(xq, xs, offsets, packed, scales, alpha)
    worst = max((checks.rel_error(got[offsets[i]:offsets[i + 1]], ref[offsets[i]:offsets[i + 1]]), i)
                for i in range(e) if counts[i])
    assert worst[0] <= 1e-5, f"expert {worst[1]} with {counts[worst[1]]} tokens: {worst[0]:.2e}"
    assert_within_element_bound(got, xq, xs, offsets, packed, scales, alpha)


@pytest.mark.gpu
def test_subnormal_fp16_weights_are_not_flushed():
    """Scale code 1 (2^-9) makes every decoded weight an fp16 subnormal (v * 2^-23)."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    rng = np.random.default_rng(5)
    e, n, k, c = 2, 64, 256, 9
    packed, _ = random_nvfp4(rng, (e, n, k))
    scales = np.ones((e, n, k // 16), np.uint8)
    xq, xs = random_nvfp4(rng, (e * c, k), scale_codes=(60, 80))
    offsets = np.array([0, c, 2 * c])
    alpha = np.ones(e, np.float32)
    got = run_gemm(cp, packed, scales, xq, xs, offsets, alpha)
    ref = reference.grouped_gemm(xq, xs, offsets, packed, scales, alpha)
    assert checks.rel_error(got, ref) <= 1e-5
    assert_within_element_bound(got, xq, xs, offsets, packed, scales, alpha)


@pytest.mark.gpu
def test_decode_words_is_what_the_kernel_decodes():
    """One-hot activations (1.0 at k = r, zero blocks elsewhere) make out[r, c] the kernel's
    decoded weight w[c, r] itself (one exact product, alpha 1): every one equals the NumPy copy
    decode_words' value times its e4m3 scale, on weights holding every byte value."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    rng = np.random.default_rng()
    n, k = 128, 128
    packed = rng.permutation(np.tile(np.arange(256, dtype=np.uint8), n * k // 2 // 256)).reshape(1, n, k // 2)
    scales = rng.integers(1, 0x7F, (1, n, k // 16), dtype=np.uint8)
    r = np.arange(k)
    nib = np.zeros((k, k), np.uint8)
    nib[r, r] = 2  # e2m1 1.0
    xq = nvfp4.pack_nibbles(nib)
    xs = np.zeros((k, k // 16), np.uint8)
    xs[r, r // 16] = 0x38  # e4m3 1.0
    got = run_gemm(cp, packed, scales, xq, xs, np.array([0, k]), np.ones(1, np.float32))
    want = codes_through_decode_words(packed, scales)[0] * np.repeat(nvfp4.decode_e4m3(scales[0]), 16, axis=-1)
    bad = np.argwhere(got.T != want)
    assert bad.size == 0, (f"{len(bad)} weights differ, first w[{bad[0][0]}, {bad[0][1]}]: kernel "
                           f"{got.T[tuple(bad[0])]!r}, decode_words {want[tuple(bad[0])]!r}")


@pytest.mark.gpu
def test_all_configs_bitwise_equal_and_deterministic():
    """Every shipped configuration, mma.sync or wgmma, writes identical bits, run after run."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    rng = np.random.default_rng(7)
    counts = np.array([0, 3, 8, 9, 17, 40, 70, 130, 1])
    e, n, k = len(counts), 256, 512
    offsets = np.concatenate([[0], np.cumsum(counts)])
    packed, scales = random_nvfp4(rng, (e, n, k))
    xq, xs = random_nvfp4(rng, (int(offsets[-1]), k))
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    ref = reference.grouped_gemm(xq, xs, offsets, packed, scales, alpha)
    # mma.sync and wgmma may add the 16 products of a k16 step in different orders, but with
    # NVFP4 on both sides those sums are exact (gemm_config.gemm_plan): the families agree too.
    first = None
    for mma in (0, 1):
        cfgs = [c for c in gc.SHIPPED_CONFIGS if c.mma == mma]
        outs = [run_gemm(cp, packed, scales, xq, xs, offsets, alpha, cfg) for cfg in cfgs]
        outs.append(run_gemm(cp, packed, scales, xq, xs, offsets, alpha, cfgs[0], poison=7.0))
        assert checks.rel_error(outs[0], ref) <= 1e-5, f"mma={mma}"
        first = outs[0] if first is None else first
        for cfg, o in zip(cfgs + ["rerun"], outs):
            bad = np.argwhere(o.view(np.uint32) != first.view(np.uint32))
            assert bad.size == 0, f"{cfg}: first mismatch at {bad[0].tolist()}"


@pytest.mark.gpu
def test_one_expert_takes_all_tokens_and_empty_problem():
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    rng = np.random.default_rng(9)
    e, n, k = 4, 128, 256
    packed, scales = random_nvfp4(rng, (e, n, k))
    xq, xs = random_nvfp4(rng, (300, k))
    offsets = np.array([0, 0, 300, 300, 300])
    alpha = np.ones(e, np.float32)
    got = run_gemm(cp, packed, scales, xq, xs, offsets, alpha)
    ref = reference.grouped_gemm(xq, xs, offsets, packed, scales, alpha)
    assert checks.rel_error(got, ref) <= 1e-5
    empty = run_gemm(cp, packed, scales, xq[:0], xs[:0], np.zeros(e + 1, np.int64), alpha)
    assert empty.shape == (0, n)


@pytest.mark.gpu
def test_launch_rejects_bad_arguments():
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    rng = np.random.default_rng(3)
    packed, scales = random_nvfp4(rng, (2, 64, 128))
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(64, 128))
    xq, xs = cp.asarray(random_nvfp4(rng, (5, 128))[0]), cp.asarray(random_nvfp4(rng, (5, 128))[1])
    off = cp.asarray(np.array([0, 2, 5], np.int32))
    alpha = cp.ones(2, cp.float32)
    out = cp.empty((5, 64), cp.float32)
    cfg = gc.heuristic(64, 128, [2, 3])
    with pytest.raises(ValueError, match="x_packed"):
        gg.grouped_gemm(prep, xq[:, :32], xs, off, alpha, out, cfg)
    with pytest.raises(ValueError, match="offsets"):
        gg.grouped_gemm(prep, xq, xs, off.astype(cp.int64), alpha, out, cfg)
    with pytest.raises(ValueError, match="alpha"):
        gg.grouped_gemm(prep, xq, xs, off, alpha[:1], out, cfg)
    with pytest.raises(ValueError, match="out"):
        gg.grouped_gemm(prep, xq, xs, off, alpha, out[:, :32], cfg)


@pytest.mark.gpu
def test_two_problems_in_one_launch_equal_two_launches():
    """grouped_gemm_pair on independent problems (different N, K, experts, empty experts) gives
    bitwise what two grouped_gemm launches give."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    rng = np.random.default_rng(21)
    cfg = gc.GemmConfig(4, 4, 128, 3, 2)
    probs, singles = [], []
    for e, n, k, counts in ((5, 256, 512, [3, 0, 17, 9, 1]), (3, 512, 256, [12, 0, 5])):
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        packed, scales = random_nvfp4(rng, (e, n, k))
        xq, xs = random_nvfp4(rng, (int(offsets[-1]), k))
        alpha = rng.uniform(0.5, 2, e).astype(np.float32)
        prep = gw.prepare_weights(packed, scales, xp=cp, layout=(cfg.block_rows, cfg.k_step))
        args = [prep, cp.asarray(xq), cp.asarray(xs), cp.asarray(offsets), cp.asarray(alpha),
                cp.full((int(offsets[-1]), n), cp.nan, dtype=cp.float32)]
        probs.append(tuple(args))
        gg.grouped_gemm(*args[:5], args[5], cfg)
        singles.append(args[5].get())
        args[5].fill(cp.nan)
    gg.grouped_gemm_pair(probs[0], probs[1], cfg)
    for single, pr in zip(singles, probs):
        got = pr[5].get()
        assert np.isfinite(got).all()
        bad = np.argwhere(got.view(np.uint32) != single.view(np.uint32))
        assert bad.size == 0, f"first mismatch at {bad[0].tolist()}"


def test_split_configs_take_each_size_class_on_its_tile():
    """Two launches by expert size: the cold class on the heuristic's tile for its counts, the hot
    one past hot_from on the tile for theirs (an image tile past 64 tokens), one prepared layout;
    one launch where a class is empty; a clear error for a bad threshold or count range."""
    counts = np.array([0, 3, 9, 12, 300, 5, 0, 140, 7])
    plan = gc.split_configs(4096, 4096, counts, 32)
    assert [r for _, r in plan] == [(1, 32), (33, gc.ALL_COUNTS[1])]
    cold, hot = plan[0][0], plan[1][0]
    assert cold == gc.heuristic(4096, 4096, np.where(counts <= 32, counts, 0)) and not cold.image
    assert hot == gc.heuristic(4096, 4096, np.where(counts > 32, counts, 0)) and hot.image and hot.max_frags == 20
    assert (cold.block_rows, cold.k_step) == (hot.block_rows, hot.k_step)
    assert [r for _, r in gc.split_configs(4096, 4096, np.array([0, 3, 9]), 32)] == [(1, 32)]
    assert [r for _, r in gc.split_configs(4096, 4096, np.array([0, 300]), 32)] == [(33, gc.ALL_COUNTS[1])]
    for bad in (0, 2.5, [], [16, 16], [32, 16], [0, 16], "16"):
        with pytest.raises(ValueError, match="hot_from"):
            gc.split_configs(4096, 4096, counts, bad)
    # several bounds: one class between each two, each on the tile for its counts; empty ones skipped
    more = np.r_[counts, 50, 80]
    three = gc.split_configs(4096, 4096, more, [16, 96])
    assert [r for _, r in three] == [(1, 16), (17, 96), (97, gc.ALL_COUNTS[1])]
    assert [c.max_frags * 8 for c, _ in three] == [16, 96, 160] and three[1][0].image
    assert gc.split_configs(4096, 4096, more, (16,)) == gc.split_configs(4096, 4096, more, 16)
    assert [r for _, r in gc.split_configs(4096, 4096, counts, [8, 10, 11])] == [(1, 8), (9, 10), (12, gc.ALL_COUNTS[1])]
    assert gc.counts_range(None) == gc.ALL_COUNTS and gc.counts_range((3, 5)) == (3, 5)
    for bad in ((0, 5), (5, 3), (1.5, 3), "ab", (1, 2**31)):
        with pytest.raises(ValueError, match="counts_in"):
            gc.counts_range(bad)


def random_grouped(rng, counts: np.ndarray, n: int, k: int):
    """A grouped GEMM's random inputs for `counts`: offsets (int32), rows, NVFP4 weights (E, n, k)
    as packed codes and scales, activations (rows, k) the same way, and per-expert alpha."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = int(offsets[-1])
    packed, scales = random_nvfp4(rng, (len(counts), n, k))
    xq, xs = random_nvfp4(rng, (rows, k))
    return offsets, rows, packed, scales, xq, xs, rng.uniform(0.5, 2, len(counts)).astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("hot_from", [1, 16, 64, 200, (16, 64)], ids=str)
def test_split_launches_write_their_experts_as_their_tiles_do(hot_from):
    """Each launch of split_configs writes exactly its experts' rows (the rest keep the poison),
    bit for bit what the same tile writes for them unfiltered; both together within 1e-5 of
    float64 and bit for bit one launch of a mma.sync tile over every expert."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    counts = np.array([0, 1, 7, 16, 17, 40, 0, 64, 65, 100, 161, 3, 330])
    n, k = 512, 256
    offsets, rows, packed, scales, xq, xs, alpha = random_grouped(rng, counts, n, k)
    plan = gc.split_configs(n, k, counts, hot_from)
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(plan[0][0].block_rows, plan[0][0].k_step))
    args = (cp.asarray(xq), cp.asarray(xs), cp.asarray(offsets), cp.asarray(alpha))
    both = cp.full((rows, n), cp.nan, cp.float32)
    for cfg, counts_in in plan:
        alone, whole = cp.full((rows, n), cp.nan, cp.float32), cp.full((rows, n), cp.nan, cp.float32)
        gg.grouped_gemm(prep, *args, alone, cfg, counts_in=counts_in)
        gg.grouped_gemm(prep, *args, whole, cfg)
        gg.grouped_gemm(prep, *args, both, cfg, counts_in=counts_in)
        mine = np.repeat((counts >= counts_in[0]) & (counts <= counts_in[1]), counts)
        a = alone.get()
        assert np.isnan(a[~mine]).all(), f"seed {seed}, {cfg}, {counts_in}: rows of other experts written"
        ok, msg = checks.compare_bits(a[mine].view(np.uint32), whole.get()[mine].view(np.uint32))
        assert ok, f"seed {seed}, {cfg}, {counts_in}: {msg}"
    got = both.get()
    assert np.isfinite(got).all(), f"seed {seed}: rows no launch wrote"
    # and bit for bit what one launch of the heuristic's mma.sync tile writes: NVFP4 products of a
    # k16 step sum exactly, so the families agree (gemm_plan relies on it)
    one = gc.heuristic(n, k, counts, wgmma=False)
    whole = cp.full((rows, n), cp.nan, cp.float32)
    gg.grouped_gemm(prep, *args, whole, one)
    ok, msg = checks.compare_bits(got.view(np.uint32), whole.get().view(np.uint32))
    assert ok, f"seed {seed}, split at {hot_from} against one launch of {one}: {msg}"
    ref = reference.grouped_gemm(xq, xs, offsets, packed, scales, alpha)
    assert checks.rel_error(got, ref) <= 1e-5, f"seed {seed}"


@pytest.mark.gpu
def test_a_size_class_of_more_experts_than_threads_computes_them_all():
    """An image tile's size-class launch with more experts in the class than the CTA has threads
    (the compaction and the split-unit scan each take them in several rounds), most of them of
    equal counts: every expert of the class is computed once, bit for bit what the unfiltered
    launch writes, and no other row is written."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    counts = np.r_[rng.integers(65, 68, 430), rng.integers(100, 300, 6), rng.integers(0, 17, 40)]
    rng.shuffle(counts)
    n, k = 256, 256
    offsets, rows, packed, scales, xq, xs, alpha = random_grouped(rng, counts, n, k)
    counts_in = (17, gc.ALL_COUNTS[1])
    cfg = gc.heuristic(n, k, np.where(counts >= 17, counts, 0))
    assert cfg.image and cfg.threads < int((counts >= 17).sum()), cfg
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(cfg.block_rows, cfg.k_step))
    args = (cp.asarray(xq), cp.asarray(xs), cp.asarray(offsets), cp.asarray(alpha))
    alone, whole = cp.full((rows, n), cp.nan, cp.float32), cp.full((rows, n), cp.nan, cp.float32)
    gg.grouped_gemm(prep, *args, alone, cfg, counts_in=counts_in)
    gg.grouped_gemm(prep, *args, whole, cfg)
    mine = np.repeat(counts >= 17, counts)
    a = alone.get()
    assert np.isnan(a[~mine]).all(), f"seed {seed}: rows of other experts written"
    ok, msg = checks.compare_bits(a[mine].view(np.uint32), whole.get()[mine].view(np.uint32))
    assert ok, f"seed {seed}: {msg}"


def test_each_size_class_counts_its_units_on_its_own_counters(monkeypatch):
    """A split's launches may run side by side on two streams (separate.run_plan): each size class
    gets its own unit and readiness counters for the same output and offsets; the same class
    finds its counters again (graph replays rely on the kernel leaving them at zero)."""
    from types import SimpleNamespace

    monkeypatch.setattr(gg, "_SCHED", {})  # (the fake arrays' keys stay out of the real cache)
    arr = lambda p: SimpleNamespace(data=SimpleNamespace(ptr=p))  # noqa: E731
    fake_cp = SimpleNamespace(cuda=SimpleNamespace(Device=lambda: SimpleNamespace(id=0)), int32="int32",
                              zeros=lambda n, dtype: object())
    out, off = arr(0x1000), arr(0x2000)
    state = lambda counts_in: gg._scheduler_state(fake_cp, out, off, None, 7, counts_in)  # noqa: E731
    cold, hot, every = state((1, 16)), state((17, gc.ALL_COUNTS[1])), state(gc.ALL_COUNTS)
    assert len({id(cold[0]), id(hot[0]), id(every[0])}) == 3 and cold[1] is not hot[1]
    assert state((1, 16)) is cold and state(gc.ALL_COUNTS) is every
