"""The tile whose weights are decoded into shared memory (GemmConfig mma=2): tokens as wgmma's A
operand from the activation image, each stage's weights decoded once by decoder warps of their
own into B core matrices that both consumer warpgroups read. Its configuration rules, its
compile, and that it computes what the register-A image tile computes, bit for bit."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lab import checks, reference
from lab.gemm_bench import config_of, parse_config
from lab.kernels import grouped_gemm as gg
from lab.kernels import jit
from config_mirror import assert_config_mirror
from test_gemm_image import _problem

IDS = lambda c: c.expression.split("<")[1][:-1]  # noqa: E731


def test_ss_tile_roles_and_sizes():
    c = gg.GemmConfig(8, 2, 64, 8, 8, 2, image=True).validate(4096, 4096)
    assert c == config_of(parse_config("8,2,64,8,2,0,8,1"), gg.GemmConfig())
    assert c.decoder_warps == 4 and c.producer_warps == 1 and c.epilogue_warps == 0 and c.threads == 13 * 32
    # per stage: raw weights (256 x 64 codes and scales), 64 image rows x 64 k, decoded 256 x 64 fp16
    register_a = replace(c, mma=1)
    assert c.smem_bytes - register_a.smem_bytes == 2 * 256 * 64 * 2
    assert c in gg.SHIPPED_SS and replace(c, act="bf16") in gg.SHIPPED_SS


@pytest.mark.parametrize("bad", [dict(image=False), dict(max_frags=4), dict(row_tiles=4), dict(warps=4),
                                 dict(mode="swiglu")])
def test_ss_tile_refuses_shapes_it_cannot_run(bad):
    c = replace(gg.GemmConfig(8, 2, 64, 8, 8, 2, image=True), **bad)
    with pytest.raises(ValueError, match="mma=2"):
        c.validate()


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("cfg", gg.SHIPPED_SS, ids=IDS)
def test_ss_tiles_compile_without_spills(cfg):
    for counts_in in (False, True):
        info = jit.ptxas_report(gg.SOURCE, cfg.expression_for(False, counts_in))
        assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info
        assert info.registers <= 65536 // (4 * 32 * -(-cfg.threads // 128)), info
        assert not info.wgmma_serialized, info


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
def test_ss_smem_mirror(tmp_path):
    assert_config_mirror(tmp_path, gg.SHIPPED_SS)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", gg.SHIPPED_SS, ids=IDS)
def test_ss_tiles_match_float64_and_the_register_a_tile_bit_for_bit(cfg):
    """Counts around the 64-token tile and past it (several token blocks), empty experts included,
    N of three row blocks: relative error <= 1e-5 against float64, every element written over a
    NaN poison, the same bits on a second run and as the shipped 64-token image tile (weights as
    the register A operand)."""
    import cupy as cp

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    counts = np.array([0, 1, 7, 9, 63, 64, 65, 131, 0, 300])
    e, n, k = counts.size, 768, 512
    packed = rng.integers(0, 256, (e, n, k // 2), np.uint8)
    scales = rng.integers(1, 127, (e, n, k // 16)).astype(np.uint8)
    offsets, xq, xs, xf = _problem(rng, cfg.act, counts, k)
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    args = (cp.asarray(xq), None if xs is None else cp.asarray(xs), cp.asarray(offsets), cp.asarray(alpha))
    twin = gg.GemmConfig(8, 2, 128, 4, 8, 1, act=cfg.act, image=True)
    outs = []
    for c in (cfg, cfg, twin):
        prep = gg.prepare_weights(packed, scales, xp=cp, layout=(c.block_rows, c.k_step))
        out = cp.full((xq.shape[0], n), cp.nan, cp.float32)
        gg.grouped_gemm(prep, *args, out, c)
        outs.append(out.get())
    assert np.isfinite(outs[0]).all(), f"seed {seed}: unwritten or non-finite outputs"
    for other in outs[1:]:
        ok, msg = checks.compare_bits(outs[0].view(np.uint32), other.view(np.uint32))
        assert ok, f"seed {seed}: {msg}"
    if cfg.act == "nvfp4":
        want = reference.grouped_gemm(xq, xs, offsets, packed, scales, alpha)
    else:
        want = reference.grouped_gemm_w4a16(xf, offsets, packed, scales, alpha)
    err = checks.rel_error(outs[0], want)
    assert err is not None and err <= 1e-5, f"seed {seed}: {err:.2e}"


@pytest.mark.gpu
def test_ss_tile_writes_bf16_and_only_its_size_class():
    """A uint16 out: the bits of the fp32 output through swiglu_quant.to_bf16 with the same count of
    non-finite outputs (alpha = inf on one expert); and a size-class launch (counts_in) writes
    exactly the experts of its class, with the bits of the whole launch."""
    import cupy as cp

    from lab.kernels import swiglu_quant as sq

    cfg = gg.SHIPPED_SS[0]
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    counts = np.array([0, 3, 63, 65, 131, 0, 40, 17])
    e, n, k = counts.size, 256, 256
    packed = rng.integers(0, 256, (e, n, k // 2), np.uint8)
    scales = rng.integers(1, 127, (e, n, k // 16)).astype(np.uint8)
    offsets, xq, xs, _ = _problem(rng, "nvfp4", counts, k)
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    alpha[6] = np.inf
    prep = gg.prepare_weights(packed, scales, xp=cp, layout=(cfg.block_rows, cfg.k_step))
    args = (cp.asarray(xq), cp.asarray(xs), cp.asarray(offsets), cp.asarray(alpha))
    rows = xq.shape[0]
    out32 = cp.full((rows, n), cp.nan, cp.float32)
    gg.grouped_gemm(prep, *args, out32, cfg)
    want, c_want = cp.full((rows, n), 0xFFFF, cp.uint16), cp.zeros(1, cp.uint32)
    sq.to_bf16(out32, want, c_want)
    got, c_got = cp.full((rows, n), 0xFFFF, cp.uint16), cp.zeros(1, cp.uint32)
    gg.grouped_gemm(prep, *args, got, cfg, nonfinite=c_got)
    ok, msg = checks.compare_bits(got.get(), want.get())
    assert ok, f"seed {seed}: {msg}"
    assert int(c_got.get()[0]) == int(c_want.get()[0]) > 0, f"seed {seed}: {c_got.get()} against {c_want.get()}"
    part = cp.full((rows, n), cp.nan, cp.float32)
    gg.grouped_gemm(prep, *args, part, cfg, counts_in=(17, 65))
    inside = np.repeat((counts >= 17) & (counts <= 65), counts)
    got_part, full = part.get(), out32.get()
    assert checks.compare_bits(got_part[inside].view(np.uint32), full[inside].view(np.uint32))[0], f"seed {seed}"
    assert np.isnan(got_part[~inside]).all(), f"seed {seed}: rows outside the class were written"
