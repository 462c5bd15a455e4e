"""Fused kernels: the gate/up pairing of w13 on the CPU (and that every fused instantiation
compiles without spills); on the GPU, the fused SwiGLU epilogue and the fused layer against the
separate kernels, bit for bit, on Hypothesis-drawn problems, and their pre-launch checks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.checks import compare_bits
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg
from lab.kernels import jit
from test_grouped_gemm import (SCALE_PROFILES, assert_counts_in_compiles_clean, counts_strategy, edge_nvfp4,
                               random_nvfp4)

# ------------------------------------------------------------------------------- CPU


@settings(max_examples=30)
@given(e=st.integers(1, 3), halves=st.integers(1, 4), block=st.sampled_from([64, 128, 256]),
       ka=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_pairing_puts_gate_and_up_columns_in_one_block(e, halves, block, ka, seed):
    rng = np.random.default_rng(seed)
    i = halves * block // 2
    packed, scales = random_nvfp4(rng, (e, 2 * i, 64 * ka))
    paired = gw.pair_gate_up_rows(packed, block)
    half = block // 2
    for b in range(2 * i // block):
        np.testing.assert_array_equal(paired[:, b * block:b * block + half], packed[:, b * half:(b + 1) * half])
        np.testing.assert_array_equal(paired[:, b * block + half:(b + 1) * block],
                                      packed[:, i + b * half:i + (b + 1) * half])
    np.testing.assert_array_equal(gw.unpair_gate_up_rows(paired, block), packed)
    prep = gw.prepare_weights(packed, scales, layout=(block, 64), pair_gate_up=True)
    assert prep.pair_gate_up and prep.experts_slice(0, 1).pair_gate_up
    p2, s2 = gw.unprepare_weights(prep)
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(s2, scales)


def test_fused_config_adds_the_epilogue_warps_and_fits_shared_memory():
    for f in gc.MAX_FRAGS_CHOICES:
        plain = gc.GemmConfig(*((4, 4) if f <= 2 else (8, 2)), 128, 4, f)
        fused = gc.fused_config(plain, "layer")
        assert fused.threads % 128 == 0 and fused.epilogue_warps >= 1 and fused.expression.endswith("lab_gemm::Mode::layer, lab_gemm::Act::nvfp4, false, false>")
        assert fused.smem_bytes > plain.smem_bytes and fused.smem_bytes + 4096 <= gc.SMEM_LIMIT
        assert fused.stages == 4
        if f <= 2:  # the plain heuristic's three stages become four in fused CTAs of 8-16 tokens
            assert gc.fused_config(replace(plain, stages=3), "swiglu").stages == gc.FUSED_SMALL_STAGES
    with pytest.raises(ValueError, match="mode must be"):
        gc.GemmConfig(mode="fused").validate()


def test_pairing_rejects_halves_that_do_not_split():
    with pytest.raises(ValueError, match="pair_gate_up"):
        gw.pair_gate_up_rows(np.zeros((1, 192, 8), np.uint8), 256)  # I = 96 is not a multiple of 128


def _split_layer(skew: float = 1.2, mean: int = 8):
    """The study's problem at `mean` and `skew`, as much of a Layer as the fused variants' plans read."""
    from types import SimpleNamespace

    from lab.problem import MoEProblem, make_routing

    p = MoEProblem()
    counts = make_routing(mean * p.experts // p.top_k, p.experts, p.top_k, skew=skew, seed=0).counts
    return SimpleNamespace(problem=p, counts=counts, w13_plan=gc.gemm_plan(2 * p.intermediate, p.hidden, counts),
                           w2_plan=gc.gemm_plan(p.hidden, p.intermediate, counts))


def _split_fused_tiles():
    """The fused instantiations split launches take (COUNTS_IN): fused-swiglu's w13 plan, the
    fused layer's launches by size class, at skew 0.4, 0.8 and 1.2."""
    from lab.variants import fused_layer

    cfgs = set()
    for skew in (0.4, 0.8, 1.2):
        layer = _split_layer(skew)
        cfgs |= {gc.fused_config(c, "swiglu") for c, _ in layer.w13_plan}
        cfgs |= {gc.fused_config(c, "layer") for c, _ in fused_layer.launches(layer, _one_tile(layer))}
    return sorted(cfgs, key=lambda c: c.expression)


def _one_tile(layer):
    """pair_plan's tile for the whole layer (the study's shapes share the heuristic's layout)."""
    from lab.variants.one_launch_2g import pair_config

    p = layer.problem
    return pair_config(gc.heuristic(2 * p.intermediate, p.hidden, layer.counts),
                       gc.heuristic(p.hidden, p.intermediate, layer.counts))


def test_fused_layer_runs_one_launch_per_size_class_under_skew():
    """Where both GEMMs' plans split at the same bounds, the fused layer runs one persistent launch
    per size class, each on pair_config's tile for that class's counts; else one launch."""
    from lab.variants import fused_layer

    layer = _split_layer(1.2)
    one = _one_tile(layer)
    got = fused_layer.launches(layer, one)
    assert [r for _, r in got] == [(1, gc.SPLIT_AT), (gc.SPLIT_AT + 1, gc.ALL_COUNTS[1])]
    assert got[0][0].max_frags <= 2 < got[1][0].max_frags
    assert {(c.block_rows, c.k_step) for c, _ in got} == {(one.block_rows, one.k_step)}
    # at skew 0.4 (17-45 tokens) the large class stays one fused layer
    low = _split_layer(0.4)
    assert low.counts.max() <= fused_layer.HOT_TOKENS
    assert fused_layer.hot_image_plan(low, _one_tile(low), fused_layer.launches(low, _one_tile(low))) is None
    uniform = _split_layer(0.0)
    assert fused_layer.launches(uniform, _one_tile(uniform)) == [(_one_tile(uniform), gc.ALL_COUNTS)]


def test_fused_layer_runs_its_large_class_on_image_tiles_under_skew():
    """Under skew the large experts' class leaves the layer mode for its plans' image tiles (w13,
    the SwiGLU kernel on its rows, w2 with the bf16 epilogue) at the plans' bounds; the
    register-SwiGLU form (fused-layer-swiglu) only in the fused layer's weight layout. With one
    launch (uniform routing) every expert leaves once the largest passes HOT_TOKENS."""
    from lab.variants import fused_layer

    assert fused_layer.FusedLayer().large == "staged" and fused_layer.FusedLayer().hot_tokens == fused_layer.HOT_TOKENS
    for bad in (-1, 2.5, None, True):
        with pytest.raises(ValueError, match="hot_tokens"):
            fused_layer.FusedLayer(hot_tokens=bad)
    with pytest.raises(ValueError, match="large"):
        fused_layer.FusedLayer(large="register")
    for skew in (0.6, 0.8, 1.2):
        layer = _split_layer(skew)
        one = _one_tile(layer)
        launches = fused_layer.launches(layer, one)
        hot = fused_layer.hot_image_plan(layer, one, launches, same_layout=False)
        assert hot is not None, skew
        w13_hot, w2_hot, counts_in = hot
        assert counts_in == (gc.SPLIT_AT + 1, gc.ALL_COUNTS[1])
        assert w13_hot.image and w2_hot.image
        assert (w13_hot, w2_hot) == (layer.w13_plan[-1][0], layer.w2_plan[-1][0])
        # (the 160-token tile takes the SwiGLU in its registers; the 96-token one, the heuristic's
        # for the 17-93-token class at skew 0.6, fuses on its epilogue warps)
        assert gc.fused_config(w13_hot, "swiglu").swiglu_regs == (w13_hot.max_frags == 20), (skew, w13_hot)
        assert {(c.block_rows, c.k_step) for c in (w13_hot, w2_hot)} == {(one.block_rows, one.k_step)}
        assert fused_layer.hot_image_plan(layer, one, launches) == hot
        # a threshold at the largest expert keeps the class in the layer mode
        assert fused_layer.hot_image_plan(layer, one, launches, int(layer.counts.max())) is None
    # at skew 0.4 (17-45 tokens) the large class stays one fused layer
    low = _split_layer(0.4)
    assert low.counts.max() <= fused_layer.HOT_TOKENS
    assert fused_layer.hot_image_plan(low, _one_tile(low), fused_layer.launches(low, _one_tile(low))) is None
    assert fused_layer.hot_image_plan(low, _one_tile(low), fused_layer.launches(low, _one_tile(low)), 16) is not None
    uniform = _split_layer(0.0)
    assert fused_layer.hot_image_plan(uniform, _one_tile(uniform), fused_layer.launches(uniform, _one_tile(uniform))) is None
    # uniform, once the largest expert passes HOT_TOKENS: every expert, on the plans' one launch each
    for mean in (32, 128, 512):
        large = _split_layer(0.0, mean)
        one = _one_tile(large)
        launches = fused_layer.launches(large, one)
        assert launches == [(one, gc.ALL_COUNTS)]
        assert large.counts.max() > fused_layer.HOT_TOKENS, mean
        w13_all, w2_all, counts_in = fused_layer.hot_image_plan(large, one, launches)
        assert counts_in == gc.ALL_COUNTS and w13_all.image and w2_all.image, mean
        assert (w13_all, w2_all) == (large.w13_plan[0][0], large.w2_plan[0][0])
    # ...and not while the largest expert holds at most HOT_TOKENS (mean 24: 40 tokens)
    mid = _split_layer(0.0, 24)
    assert mid.counts.max() <= fused_layer.HOT_TOKENS
    assert mid.w13_plan[0][0].image
    assert fused_layer.hot_image_plan(mid, _one_tile(mid), fused_layer.launches(mid, _one_tile(mid))) is None


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg", _split_fused_tiles(), ids=lambda c: c.expression.split("<")[1][:-1])
def test_split_fused_instantiations_compile_without_spills(cfg):
    assert_counts_in_compiles_clean(cfg)


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg", gc.SHIPPED_FUSED, ids=lambda c: c.expression.split("<")[1][:-1])
def test_fused_instantiations_compile_without_spills(cfg):
    info = jit.ptxas_report(gg.SOURCE, cfg.expression)
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info
    assert info.registers <= 65536 // cfg.threads, info
    assert not info.wgmma_serialized, info
    plain = replace(cfg, mode="plain")
    # the fused kernel keeps as many CTAs per SM as the plain one
    plain_regs = jit.ptxas_report(gg.SOURCE, plain.expression).registers
    assert gc.resident_ctas(cfg, 288, info.registers) == gc.resident_ctas(plain, 288, plain_regs)


# ------------------------------------------------------------------------------- GPU


def _problem(cp, rng, counts, h, i):
    """Device arrays of a small layer: NVFP4 input, w13 (plain and paired), w2, globals."""
    from lab.kernels import swiglu_quant as sq

    e = len(counts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = int(offsets[-1])
    # every row takes one of the GEMM tests' scale profiles: zero, subnormal and largest codes
    # (h rows of zeros and of tiny values reach the epilogue's zero-block and subnormal rules)
    p = len(SCALE_PROFILES)
    w13p, w13s = edge_nvfp4(rng, (e, 2 * i, h), rng.integers(0, p, (e, 2 * i)))
    w2p, w2s = edge_nvfp4(rng, (e, h, i), rng.integers(0, p, (e, h)))
    xq, xs = edge_nvfp4(rng, (rows, h), rng.integers(0, p, rows))
    d = dict(
        offsets=cp.asarray(offsets), offsets_host=offsets, rows=rows,
        w13=gw.prepare_weights(w13p, w13s, xp=cp), w13_paired=gw.prepare_weights(w13p, w13s, xp=cp, pair_gate_up=True),
        w2=gw.prepare_weights(w2p, w2s, xp=cp), xq=cp.asarray(xq), xs=cp.asarray(xs),
        alpha13=cp.asarray(rng.uniform(0.5, 2, e).astype(np.float32) * np.float32(2.0**-6)),
        alpha2=cp.asarray(rng.uniform(0.5, 2, e).astype(np.float32) * np.float32(2.0**-6)),
        gate=cp.asarray(rng.uniform(0.2, 3, e).astype(np.float32)),
        up=cp.asarray(rng.uniform(0.2, 3, e).astype(np.float32)),
        act_global=float(np.float32(rng.uniform(0.05, 2) / 448)),
        counter=cp.zeros(1, cp.uint32), sq=sq)
    return d


def _separate(cp, d, cfg13, cfg2):
    """h, a_q and bf16 output through the separate kernels."""
    sq = d["sq"]
    rows, i, h = d["rows"], d["w13"].n // 2, d["w2"].n
    hbuf = cp.full((rows, 2 * i), np.nan, cp.float32)
    ap, as_ = cp.full((rows, i // 2), 0xFF, cp.uint8), cp.full((rows, i // 16), 0xFF, cp.uint8)
    out = cp.full((rows, h), np.nan, cp.float32)
    ob = cp.full((rows, h), 0xFFFF, cp.uint16)
    gg.grouped_gemm(d["w13"], d["xq"], d["xs"], d["offsets"], d["alpha13"], hbuf, cfg13)
    sq.swiglu_quant(hbuf, d["offsets"], d["gate"], d["up"], d["act_global"], ap, as_, d["counter"])
    gg.grouped_gemm(d["w2"], ap, as_, d["offsets"], d["alpha2"], out, cfg2)
    sq.to_bf16(out, ob, d["counter"])
    return ap.get(), as_.get(), ob.get()


def _fusion(cp, d, with_bf16):
    rows, i, h = d["rows"], d["w13"].n // 2, d["w2"].n
    ob = cp.full((rows, h), 0xFFFF, cp.uint16) if with_bf16 else None
    return gg.Fusion(d["gate"], d["up"], d["act_global"], cp.full((rows, i // 2), 0xFF, cp.uint8),
                     cp.full((rows, i // 16), 0xFF, cp.uint8), d["counter"], ob)


@pytest.mark.gpu
@settings(max_examples=25)
@given(counts=counts_strategy(), h=st.sampled_from([256, 512]), i=st.sampled_from([128, 256, 384]),
       seed=st.integers(0, 2**31))
def test_fused_kernels_equal_the_separate_kernels_bitwise(counts, h, i, seed):
    """swiglu_gemm's a_q and fused_layer's bf16 output against grouped_gemm + swiglu_quant +
    grouped_gemm + to_bf16, on ragged counts (zeros, multi-pass experts) and drawn globals."""
    from lab.gpu import require_gpu
    from lab.variants.one_launch_2g import pair_config

    cp = require_gpu("test")
    rng = np.random.default_rng(seed)
    d = _problem(cp, rng, np.array(counts), h, i)
    cfg13 = gc.heuristic(2 * i, h, np.array(counts))
    cfg2 = gc.heuristic(h, i, np.array(counts))
    want_p, want_s, want_bf16 = _separate(cp, d, cfg13, cfg2)
    assert d["counter"].get()[0] == 0

    fz = _fusion(cp, d, with_bf16=False)
    gg.swiglu_gemm(d["w13_paired"], d["xq"], d["xs"], d["offsets"], d["alpha13"], fz, cfg13)
    np.testing.assert_array_equal(fz.a_scales.get(), want_s)
    np.testing.assert_array_equal(fz.a_packed.get(), want_p)

    cfg = pair_config(cfg13, cfg2)
    for _ in range(2):  # the second launch runs on counters the first one reset
        fz = _fusion(cp, d, with_bf16=True)
        gg.fused_layer(d["w13_paired"], d["xq"], d["xs"], d["offsets"], d["alpha13"], d["w2"], d["alpha2"], fz, cfg)
        np.testing.assert_array_equal(fz.out_bf16.get(), want_bf16)
        np.testing.assert_array_equal(fz.a_packed.get(), want_p)
    assert d["counter"].get()[0] == 0
    for sched, ready in gg._SCHED.values():
        assert not sched.get().any() and not ready.get().any(), "counters not reset by the launch"


@pytest.mark.gpu
@pytest.mark.parametrize("i", [128, 256])
def test_register_swiglu_epilogue_equals_the_separate_kernels_bitwise(i):
    """Past 96 tokens per expert swiglu_gemm runs the 160-token image tile with SwiGLU + quantize
    in the consumers' registers (swiglu_regs): a_q's codes and scales bit for bit those of
    grouped_gemm + swiglu_quant, over counts around the tile and past it (several passes), the
    GEMM tests' scale profiles (zero blocks, subnormals), and the same count of non-finite SwiGLU
    values where one expert's gate global overflows them."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    counts = np.array([0, 3, 159, 160, 161, 323, 0, 97, 130])
    h = 256
    d = _problem(cp, rng, counts, h, i)
    cfg13 = gc.heuristic(2 * i, h, counts)
    fused = gc.fused_config(cfg13, "swiglu")
    assert fused.swiglu_regs and fused.max_frags == 20 and fused.epilogue_warps == 0, fused
    for overflow in (False, True):
        if overflow:
            d["gate"][5] = np.float32(3e38)
        rows = d["rows"]
        hbuf = cp.full((rows, 2 * i), np.nan, cp.float32)
        want_p, want_s = cp.full((rows, i // 2), 0xFF, cp.uint8), cp.full((rows, i // 16), 0xFF, cp.uint8)
        d["counter"].fill(0)
        gg.grouped_gemm(d["w13"], d["xq"], d["xs"], d["offsets"], d["alpha13"], hbuf, cfg13)
        d["sq"].swiglu_quant(hbuf, d["offsets"], d["gate"], d["up"], d["act_global"], want_p, want_s, d["counter"])
        want_bad = int(d["counter"].get()[0])
        assert (want_bad > 0) == overflow, want_bad
        for _ in range(2):  # deterministic, and over the first launch's output
            d["counter"].fill(0)
            fz = _fusion(cp, d, with_bf16=False)
            gg.swiglu_gemm(d["w13_paired"], d["xq"], d["xs"], d["offsets"], d["alpha13"], fz, cfg13)
            ok, msg = compare_bits(fz.a_scales.get(), want_s.get())
            assert ok, f"seed {seed}, overflow {overflow}, scales: {msg}"
            ok, msg = compare_bits(fz.a_packed.get(), want_p.get())
            assert ok, f"seed {seed}, overflow {overflow}, codes: {msg}"
            assert int(d["counter"].get()[0]) == want_bad, f"seed {seed}: {d['counter'].get()} against {want_bad}"


@pytest.mark.gpu
def test_fused_layer_on_a_fixed_small_problem():
    """One deterministic case (empty, single-fragment and multi-pass experts): what
    compute-sanitizer runs (memcheck, racecheck, synccheck)."""
    test_fused_kernels_equal_the_separate_kernels_bitwise.hypothesis.inner_test(
        counts=[0, 3, 70, 9, 0, 16], h=256, i=256, seed=7)


@pytest.mark.gpu
def test_fused_epilogue_counts_non_finite_values():
    """A huge alpha overflows h: the SwiGLU values are Inf or NaN and the counter says so."""
    from lab.gpu import require_gpu

    cp = require_gpu("test")
    rng = np.random.default_rng(5)
    d = _problem(cp, rng, np.array([9, 0, 17]), 256, 128)
    d["alpha13"].fill(np.float32(3e38))
    fz = _fusion(cp, d, with_bf16=False)
    gg.swiglu_gemm(d["w13_paired"], d["xq"], d["xs"], d["offsets"], d["alpha13"], fz,
                   gc.heuristic(256, 256, np.array([9, 0, 17])))
    assert d["counter"].get()[0] > 0


@pytest.mark.gpu
def test_fused_layer_counts_non_finite_outputs_as_the_separate_path_does():
    """One expert's huge w2 alpha overflows its bf16 outputs to Inf: fused_layer's epilogue warps
    (which write the w2 output) count exactly the values to_bf16 counts, with the same bits."""
    from lab.gpu import require_gpu
    from lab.variants.one_launch_2g import pair_config

    cp = require_gpu("test")
    rng = np.random.default_rng(11)
    counts = np.array([9, 17, 0, 5])
    d = _problem(cp, rng, counts, 256, 128)
    d["alpha2"][1] = np.float32(3e38)
    cfg13, cfg2 = gc.heuristic(256, 256, counts), gc.heuristic(256, 128, counts)
    _, _, want_bf16 = _separate(cp, d, cfg13, cfg2)
    want = int(d["counter"].get()[0])
    assert 0 < want <= counts[1] * 256, want  # expert 1's outputs only
    d["counter"].fill(0)
    fz = _fusion(cp, d, with_bf16=True)
    gg.fused_layer(d["w13_paired"], d["xq"], d["xs"], d["offsets"], d["alpha13"], d["w2"], d["alpha2"], fz,
                   pair_config(cfg13, cfg2))
    np.testing.assert_array_equal(fz.out_bf16.get(), want_bf16)
    assert int(d["counter"].get()[0]) == want


@pytest.mark.gpu
def test_fused_launches_reject_bad_arguments_before_launch():
    from lab.gpu import require_gpu
    from lab.variants.one_launch_2g import pair_config

    cp = require_gpu("test")
    rng = np.random.default_rng(1)
    counts = np.array([3, 5])
    d = _problem(cp, rng, counts, 256, 128)
    cfg = gc.heuristic(256, 256, counts)
    fz = _fusion(cp, d, with_bf16=False)
    with pytest.raises(ValueError, match="pair_gate_up=True"):
        gg.swiglu_gemm(d["w13"], d["xq"], d["xs"], d["offsets"], d["alpha13"], fz, cfg)
    bad = gg.Fusion(d["gate"], d["up"], d["act_global"], fz.a_packed[:, :-1], fz.a_scales, d["counter"])
    with pytest.raises(ValueError, match="a_packed"):
        gg.swiglu_gemm(d["w13_paired"], d["xq"], d["xs"], d["offsets"], d["alpha13"], bad, cfg)
    bad = gg.Fusion(d["gate"], d["up"], float("nan"), fz.a_packed, fz.a_scales, d["counter"])
    with pytest.raises(ValueError, match="act_global"):
        gg.swiglu_gemm(d["w13_paired"], d["xq"], d["xs"], d["offsets"], d["alpha13"], bad, cfg)
    cfgp = pair_config(cfg, gc.heuristic(256, 128, counts))
    with pytest.raises(ValueError, match="out_bf16"):
        gg.fused_layer(d["w13_paired"], d["xq"], d["xs"], d["offsets"], d["alpha13"], d["w2"], d["alpha2"], fz, cfgp)
    fz2 = _fusion(cp, d, with_bf16=True)
    strided = cp.full((fz2.out_bf16.shape[0], 2 * fz2.out_bf16.shape[1]), 0xFFFF, cp.uint16)[:, ::2]
    with pytest.raises(ValueError, match="out_bf16: expected a C-contiguous"):
        gg.fused_layer(d["w13_paired"], d["xq"], d["xs"], d["offsets"], d["alpha13"], d["w2"], d["alpha2"],
                       replace(fz2, out_bf16=strided), cfgp)
    with pytest.raises(ValueError, match="share one offsets"):
        gg._launch([(d["w13_paired"], d["xq"], d["xs"], d["offsets"], d["alpha13"], None),
                    (d["w2"], fz2.a_packed, fz2.a_scales, d["offsets"].copy(), d["alpha2"], None)],
                   cfgp, None, False, fz2)
