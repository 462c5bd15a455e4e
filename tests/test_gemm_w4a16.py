"""The grouped GEMM with bf16 activations (W4A16): the same kernel, prepared weights, pipeline
and tiles as W4A4, chosen by GemmConfig.act; the activations converted to fp16 as they are."""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from lab import checks, nvfp4, reference
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg
from lab.kernels import jit
from config_mirror import assert_config_mirror


def test_w4a16_configs_size_bf16_rows_and_name_the_activation():
    c = gc.GemmConfig(4, 4, 128, 3, 2)
    b = replace(c, act="bf16")
    # a stage holds 16 tokens x 128 k of bf16 (4 KB) instead of codes and scales (1 KB + 128 B)
    assert b.smem_bytes - c.smem_bytes == 3 * (16 * 128 * 2 - (16 * 64 + 16 * 8))
    assert b.expression.endswith("lab_gemm::Act::bf16, false, false>") and c.expression.endswith("Act::nvfp4, false, false>")
    with pytest.raises(ValueError, match="act must be one of"):
        replace(c, act="fp8").validate()
    assert gc.heuristic(4096, 4096, [9] * 8, act="bf16") == replace(gc.heuristic(4096, 4096, [9] * 8), act="bf16")
    assert {cfg.act for cfg in gc.SHIPPED_W4A16} == {"bf16"} and len(gc.SHIPPED_W4A16) >= 4


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg", gc.SHIPPED_W4A16 + gc.SHIPPED_FUSED_W4A16, ids=lambda c: c.expression.split("<")[1][:-1])
def test_w4a16_instantiations_compile_without_spills(cfg):
    for read_only in (False,):  # (the read-only pattern reads the same bytes however it is fed)
        info = jit.ptxas_report(gg.SOURCE, cfg.expression_for(read_only))
        assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info
        assert info.registers <= 65536 // cfg.threads, info
        assert not info.wgmma_serialized, info


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
def test_w4a16_smem_mirror_equals_the_kernels_config(tmp_path):
    assert_config_mirror(tmp_path, gc.SHIPPED_W4A16 + gc.SHIPPED_FUSED_W4A16,
                         extra=lambda conf, c: [f"{conf}::ACC_SCALE == 16384.0f"])


def test_bf16_activations_are_refused_in_the_wrong_form():
    pytest.importorskip("cupy")
    from lab.gpu import gpu_available

    if not gpu_available():
        pytest.skip("needs a CUDA GPU (the launcher's checks take device arrays)")
    import cupy as cp

    packed = np.random.default_rng(0).integers(0, 256, (2, 64, 64), np.uint8)
    scales = np.full((2, 64, 8), 0x38, np.uint8)
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(64, 128))
    cfg = replace(gc.heuristic(64, 128, [3, 2], (64, 128)), act="bf16")
    off, alpha, out = cp.asarray([0, 3, 5], cp.int32), cp.ones(2, cp.float32), cp.zeros((5, 64), cp.float32)
    with pytest.raises(ValueError, match=r"x: expected \(T, 128\) uint16"):
        gg.grouped_gemm(prep, cp.zeros((5, 64), cp.uint8), None, off, alpha, out, cfg)
    with pytest.raises(ValueError, match="no block scales"):
        gg.grouped_gemm(prep, cp.zeros((5, 128), cp.uint16), cp.zeros((5, 8), cp.uint8), off, alpha, out, cfg)


def _bf16(rng, shape, tiny=False):
    """Random bf16 values spanning 2^-14..2^8 in magnitude (the exact fp16 range and a few
    binades past 1), both signs, some zeros; `tiny` adds fp16-subnormal magnitudes."""
    mag = 2.0 ** rng.uniform(-24 if tiny else -14, 8, shape)
    v = (mag * rng.choice([-1.0, 1.0], shape) * (rng.random(shape) > 0.05)).astype(np.float32)
    return v.astype(ml_dtypes.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", gc.SHIPPED_W4A16, ids=lambda c: c.expression.split("<")[1][:-1])
def test_w4a16_gemm_matches_float64_and_is_deterministic(cfg):
    """out[r] = alpha[e] * x[r] @ dec(w[e]).T with x the bf16 values as given: relative error
    <= 1e-5 against float64 (the conversion to fp16 is exact in this range; only the fp32 sums
    round), every element written, the same bits on a second run. Ragged counts with empty
    experts and one expert past the token tile."""
    import cupy as cp

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    n, k = (512, 256) if cfg.block_rows <= 256 else (cfg.block_rows, 256)
    n = -(-n // cfg.block_rows) * cfg.block_rows
    counts = np.array([0, 3, cfg.token_tile + 5, 1, 0, 17])
    e = counts.size
    packed = rng.integers(0, 256, (e, n, k // 2), np.uint8)
    scales = rng.integers(1, 127, (e, n, k // 16)).astype(np.uint8)
    x = _bf16(rng, (int(counts.sum()), k))
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int32)
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(cfg.block_rows, cfg.k_step))
    outs = []
    for _ in range(2):
        out = cp.full((x.shape[0], n), cp.nan, cp.float32)
        gg.grouped_gemm(prep, cp.asarray(x.view(np.uint16)), None, cp.asarray(offsets), cp.asarray(alpha), out, cfg)
        outs.append(out.get())
    assert np.isfinite(outs[0]).all(), f"seed {seed}: unwritten or non-finite outputs"
    assert checks.compare_bits(outs[0].view(np.uint32), outs[1].view(np.uint32))[0], f"seed {seed}: not deterministic"
    want = reference.grouped_gemm_w4a16(x, offsets, packed, scales, alpha)
    err = checks.rel_error(outs[0], want)
    assert err is not None and err <= 1e-5, f"seed {seed}: rel error {err:.2e}"


@pytest.mark.gpu
def test_w4a16_fp16_subnormal_activations_cost_at_most_their_rounding():
    """bf16 magnitudes below 2^-14 become fp16 subnormals (rounded to a multiple of 2^-24): each
    output element stays within sum_k |w_k| 2^-25 of float64, on top of the fp32 sums' error."""
    import cupy as cp

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    cfg = gc.heuristic(256, 256, [9, 9], act="bf16")
    packed = rng.integers(0, 256, (2, 256, 128), np.uint8)
    scales = rng.integers(1, 127, (2, 256, 16)).astype(np.uint8)
    x = _bf16(rng, (18, 256), tiny=True)
    offsets = np.array([0, 9, 18], np.int32)
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(cfg.block_rows, cfg.k_step))
    out = cp.full((18, 256), cp.nan, cp.float32)
    gg.grouped_gemm(prep, cp.asarray(x.view(np.uint16)), None, cp.asarray(offsets), cp.ones(2, cp.float32), out, cfg)
    got = out.get().astype(np.float64)
    xf = x.astype(np.float64)
    for ex in range(2):
        w = nvfp4.dequantize_blocks(packed[ex], scales[ex])
        r = slice(offsets[ex], offsets[ex + 1])
        want = xf[r] @ w.T
        # fp32 sums of exact products: (K + 1) 2^-23 of sum |x w| (as test_grouped_gemm bounds
        # them); the subnormal rounding: half of fp16's 2^-24 spacing per |w|
        bound = (np.abs(xf[r]) @ np.abs(w).T) * (256 + 1) * 2.0**-23 + np.abs(w).sum(axis=1)[None, :] * 2.0**-25
        assert (np.abs(got[r] - want) <= bound).all(), f"seed {seed}, expert {ex}"



def separate_against_float64(runner, layer, x, routing, weights):
    """Run separate (the exact W4A4 baseline) on `layer`: (rows, want, err) with the routed rows the
    float64 layer on unquantized activations computes, its output there, and separate's relative
    error against it, the figure an approximate variant's end-to-end error is held against."""
    from lab.variants import make

    sep = make("separate")
    runner.prepare(sep, layer)
    runner.checked_run(sep, layer)
    rows, want = reference.layer_unquantized(x, routing, weights)
    return rows, want, checks.rel_error(layer.out_bf16.get().view(ml_dtypes.bfloat16).astype(np.float64)[rows], want)

@pytest.mark.gpu
@pytest.mark.parametrize("tokens, skew", [(24, 0.0), (300, 1.0)])
def test_w4a16_layer_matches_its_own_float64_reference_and_beats_w4a4s_error(tokens, skew):
    """The w4a16 variant stage by stage against float64 on what each stage read (x as bf16, a as
    the SwiGLU kernel's bf16): h and the fp32 output within 1e-5; end to end, against the float64
    layer on unquantized activations, a smaller error than separate's (W4A4)."""
    from lab.layer import load_layer, upload_weights
    from lab.problem import MoEProblem, make_routing, random_activations, random_weights
    from lab.runner import Runner
    from lab.variants import make

    p = MoEProblem(experts=8, hidden=256, intermediate=128, top_k=2)
    seed = int(np.random.default_rng().integers(2**31))
    w = random_weights(p, seed=seed)
    routing = make_routing(tokens, p.experts, p.top_k, skew=skew, seed=seed)
    x = random_activations(tokens, p.hidden, seed=seed)
    runner = Runner()
    layer = load_layer(runner, upload_weights(w), routing, x)
    rows, want, err_w4a4 = separate_against_float64(runner, layer, x, routing, w)
    v = make("w4a16")
    runner.prepare(v, layer)
    runner.checked_run(v, layer)
    xb = v.x.get().view(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(xb, x[routing.row_token].astype(ml_dtypes.bfloat16).astype(np.float64))
    h, a = layer.h.get().astype(np.float64), v.a.get().view(ml_dtypes.bfloat16).astype(np.float64)
    out = layer.out.get().astype(np.float64)
    I = p.intermediate
    h_want, out_want = np.zeros_like(h), np.zeros_like(out)
    for e in range(p.experts):
        r0, r1 = routing.offsets[e], routing.offsets[e + 1]
        h_want[r0:r1] = xb[r0:r1] @ nvfp4.dequantize_blocks(w.w13_packed[e], w.w13_scales[e]).T
        out_want[r0:r1] = w.w2_global[e] * (a[r0:r1] @ nvfp4.dequantize_blocks(w.w2_packed[e], w.w2_scales[e]).T)
    assert checks.rel_error(h, h_want) <= 1e-5, f"seed {seed}: h"
    assert checks.rel_error(out, out_want) <= 1e-5, f"seed {seed}: out"
    g = h[:, :I] * np.repeat(w.gate_global, np.diff(routing.offsets))[:, None]
    u = h[:, I:] * np.repeat(w.up_global, np.diff(routing.offsets))[:, None]
    a_want = (g / (1 + np.exp(-g)) * u).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.mean(a != a_want) < 1e-2, f"seed {seed}: SwiGLU's bf16 codes"  # float32 vs float64 ties only
    err = checks.rel_error(layer.out_bf16.get().view(ml_dtypes.bfloat16).astype(np.float64)[rows], want)
    assert err < err_w4a4 / 5, f"seed {seed}: W4A16 {err:.2e} against W4A4 {err_w4a4:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, skew", [(16, 0.0), (40, 0.0), (80, 0.0), (300, 1.0), (400, 0.0)])
def test_w4a16_fused_variants_equal_w4a16_bit_for_bit(tokens, skew):
    """w4a16-fused (the SwiGLU epilogue writing bf16) and w4a16-layer (one launch) run the same
    arithmetic as w4a16's separate launches: the same output bits, at token tiles of 8 to 64
    (the fused tiles' stage counts differ from the plain ones there) and with the hot expert
    past one tile."""
    from lab.layer import load_layer, upload_weights
    from lab.problem import MoEProblem, make_routing, random_activations, random_weights
    from lab.runner import Runner
    from lab.variants import make

    p = MoEProblem(experts=8, hidden=256, intermediate=128, top_k=2)
    seed = int(np.random.default_rng().integers(2**31))
    routing = make_routing(tokens, p.experts, p.top_k, skew=skew, seed=seed)
    runner = Runner()
    layer = load_layer(runner, upload_weights(random_weights(p, seed=seed)), routing,
                       random_activations(tokens, p.hidden, seed=seed))
    base = make("w4a16")
    runner.prepare(base, layer)
    runner.checked_run(base, layer)
    want = layer.out_bf16.get()
    for name in ("w4a16-fused", "w4a16-layer"):
        v = make(name)
        runner.prepare(v, layer)
        runner.checked_run(v, layer)
        ok, msg = checks.compare_bits(layer.out_bf16.get(), want)
        assert ok, f"seed {seed}, {name}: {msg}"
        if name == "w4a16-layer":  # the staged form past the hot threshold, as fused-layer's
            from lab.variants.fused_layer import HOT_TOKENS

            assert v.staged == (int(routing.counts.max()) > HOT_TOKENS), (seed, int(routing.counts.max()))
