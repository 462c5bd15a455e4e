"""Token tiles past 64 (max_frags 12, 16 and 20: wgmma m64n96, m64n128 and m64n160). The heuristic
picks 256-row ones on the activation image (tests/test_gemm_image.py); the decoder-warp 128-token
tiles here stay timeable through bench_gemm --config (notes/gemm.md)."""

from __future__ import annotations

import numpy as np
import pytest

from lab import checks, reference
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg
from lab.kernels import jit
from config_mirror import assert_config_mirror


def test_large_tiles_need_wgmma_and_the_plain_epilogue():
    ok = gc.GemmConfig(8, 1, 128, 4, 16, 1).validate(4096, 4096)
    assert ok.token_tile == 128 and ok.block_rows == 128 and ok.decoder_warps == 3
    with pytest.raises(ValueError, match="with wgmma"):
        gc.GemmConfig(8, 1, 128, 4, 16, 0).validate()
    with pytest.raises(ValueError, match="with wgmma"):
        gc.GemmConfig(8, 2, 128, 4, 16, 1, mode="swiglu").validate()
    with pytest.raises(ValueError, match="max_frags"):
        gc.GemmConfig(8, 1, 128, 4, 10, 1).validate()
    # the heuristic: once the 99th percentile passes 64 tokens, the 256-row 96-token image tile
    # (paired, 4 stages) up to 96 and the 160-token one past that; the 160-token tile takes 3
    # unpaired stages, so it runs where K holds an odd number of chunks
    assert gc.heuristic(4096, 4096, [9] * 8).max_frags <= 8
    assert gc.heuristic(4096, 4096, [64] * 8).max_frags == 8
    for counts, frags, stages in (([65] * 8, 12, 4), ([96] * 8, 12, 4), ([97] * 8, 20, 3), ([128] * 8, 20, 3),
                                  ([160] * 8, 20, 3), ([700] * 8, 20, 3)):
        cfg = gc.heuristic(4096, 4096, counts)
        assert (cfg.max_frags, cfg.stages, cfg.mma, cfg.image, cfg.block_rows) == (frags, stages, 1, True, 256), cfg
        assert cfg.paired_stages == (frags != 20) and cfg.producer_warps == (4 if frags > 12 else 1), cfg
    assert gc.GemmConfig(8, 2, 128, 4, 16, 1, image=True).producer_warps == 4  # (compiled, timeable, not picked)
    assert gc.heuristic(4096, 3 * 128, [90] * 8).max_frags == 8  # (no pairs: the 64-token tile)
    assert gc.heuristic(4096, 3 * 128, [150] * 8).max_frags == 20
    # no wgmma without whole warpgroups (64-row blocks: two consumer warps): the 64-token tile
    small = gc.heuristic(192, 256, [300] * 8)
    assert (small.max_frags, small.mma, small.image) == (8, 0, False), small


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg", gc.SHIPPED_LARGE, ids=lambda c: c.expression.split("<")[1][:-1])
def test_large_tiles_compile_without_spills(cfg):
    for read_only in (False,):
        info = jit.ptxas_report(gg.SOURCE, cfg.expression_for(read_only))
        assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info
        assert info.registers <= 65536 // cfg.threads, info
        assert not info.wgmma_serialized, info


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", gc.SHIPPED_LARGE, ids=lambda c: c.expression.split("<")[1][:-1])
def test_large_tiles_match_float64(cfg):
    """Every token count of a 128-token tile and past it (several passes), empty experts
    included: relative error <= 1e-5 against float64, every element written."""
    import cupy as cp

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    counts = np.array([0, 1, 7, 8, 9, 63, 64, 65, 127, 128, 129, 300, 0])
    e, n, k = counts.size, 256, 256
    packed = rng.integers(0, 256, (e, n, k // 2), np.uint8)
    scales = rng.integers(1, 127, (e, n, k // 16)).astype(np.uint8)
    rows = int(counts.sum())
    xp = rng.integers(0, 256, (rows, k // 2), np.uint8)
    xs = rng.integers(1, 127, (rows, k // 16)).astype(np.uint8)
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int32)
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(cfg.block_rows, cfg.k_step))
    out = cp.full((rows, n), cp.nan, cp.float32)
    gg.grouped_gemm(prep, cp.asarray(xp), cp.asarray(xs), cp.asarray(offsets), cp.asarray(alpha), out, cfg)
    got = out.get()
    assert np.isfinite(got).all(), f"seed {seed}: unwritten or non-finite outputs"
    want = reference.grouped_gemm(xp, xs, offsets, packed, scales, alpha)
    err = checks.rel_error(got, want)
    assert err is not None and err <= 1e-5, f"seed {seed}: {err:.2e}"


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
def test_large_tiles_smem_mirror(tmp_path):
    assert_config_mirror(tmp_path, gc.SHIPPED_LARGE)
