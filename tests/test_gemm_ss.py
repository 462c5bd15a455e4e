"""The tile whose weights are decoded into shared memory (GemmConfig mma=2): tokens as wgmma's A
operand from the activation image, each stage's weights decoded once by decoder warps of their
own into B core matrices that both consumer warpgroups read. Its configuration rules, its compile
and its size-class launch; that it computes what the register-A image tile computes, bit for bit,
and writes bf16 as the conversion rounds it: test_gemm_image.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lab import checks
from lab.gemm_bench import config_of, parse_config
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg
from lab.kernels import jit
from config_mirror import assert_config_mirror
from test_gemm_image import _problem

IDS = lambda c: c.expression.split("<")[1][:-1]  # noqa: E731


def test_ss_tile_roles_and_sizes():
    c = gc.GemmConfig(8, 2, 64, 8, 8, 2, image=True).validate(4096, 4096)
    assert c == config_of(parse_config("8,2,64,8,2,0,8,1"), gc.GemmConfig())
    assert c.decoder_warps == 4 and c.producer_warps == 1 and c.epilogue_warps == 0 and c.threads == 13 * 32
    # per stage: raw weights (256 x 64 codes and scales), 64 image rows x 64 k, decoded 256 x 64 fp16
    register_a = replace(c, mma=1)
    assert c.smem_bytes - register_a.smem_bytes == 2 * 256 * 64 * 2
    assert c in gc.SHIPPED_SS and replace(c, act="bf16") in gc.SHIPPED_SS


@pytest.mark.parametrize("bad", [dict(image=False), dict(max_frags=4), dict(row_tiles=4), dict(warps=4),
                                 dict(mode="swiglu")])
def test_ss_tile_refuses_shapes_it_cannot_run(bad):
    c = replace(gc.GemmConfig(8, 2, 64, 8, 8, 2, image=True), **bad)
    with pytest.raises(ValueError, match="mma=2"):
        c.validate()


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg", gc.SHIPPED_SS, ids=IDS)
def test_ss_tiles_compile_without_spills(cfg):
    for counts_in in (False, True):
        info = jit.ptxas_report(gg.SOURCE, cfg.expression_for(False, counts_in))
        assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info
        assert info.registers <= 65536 // (4 * 32 * -(-cfg.threads // 128)), info
        assert not info.wgmma_serialized, info


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
def test_ss_smem_mirror(tmp_path):
    assert_config_mirror(tmp_path, gc.SHIPPED_SS)


@pytest.mark.gpu
def test_ss_tile_writes_only_its_size_class():
    """A size-class launch (counts_in) writes exactly the experts of its class, with the bits of
    the whole launch; the rest keep their poison. (Its bf16 output: test_gemm_image.py.)"""
    import cupy as cp

    cfg = gc.SHIPPED_SS[0]
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    counts = np.array([0, 3, 63, 65, 131, 0, 40, 17])
    e, n, k = counts.size, 256, 256
    packed = rng.integers(0, 256, (e, n, k // 2), np.uint8)
    scales = rng.integers(1, 127, (e, n, k // 16)).astype(np.uint8)
    offsets, xq, xs, _ = _problem(rng, "nvfp4", counts, k)
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(cfg.block_rows, cfg.k_step))
    args = (cp.asarray(xq), cp.asarray(xs), cp.asarray(offsets), cp.asarray(alpha))
    rows = xq.shape[0]
    full = cp.full((rows, n), cp.nan, cp.float32)
    gg.grouped_gemm(prep, *args, full, cfg)
    part = cp.full((rows, n), cp.nan, cp.float32)
    gg.grouped_gemm(prep, *args, part, cfg, counts_in=(17, 65))
    inside = np.repeat((counts >= 17) & (counts <= 65), counts)
    got, want = part.get(), full.get()
    assert np.isfinite(want).all(), f"seed {seed}: unwritten or non-finite outputs"
    assert checks.compare_bits(got[inside].view(np.uint32), want[inside].view(np.uint32))[0], f"seed {seed}"
    assert np.isnan(got[~inside]).all(), f"seed {seed}: rows outside the class were written"
