"""The activation image (gemm/act_image.cuh): the GEMM's B operand decoded once per launch, by a
pre-pass or (GemmConfig.builders) by the launch's own producer warpgroup, for tiles without
decoder warps (GemmConfig.image). Its layout, the tiles that use it, and that they compute what
the decoder-warp tiles compute, bit for bit."""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from lab import checks, reference
from lab.gemm_bench import config_of, parse_config
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg
from lab.kernels import jit
from config_mirror import assert_config_mirror
from oracles import decode_blocks

IDS = lambda c: c.expression.split("<")[1][:-1] + (", build_image" if c.build_image else "")  # noqa: E731


def test_image_tiles_have_no_decoder_warps_and_no_raw_stage():
    c = gc.GemmConfig(8, 2, 128, 4, 12, 1, image=True).validate(4096, 4096)
    assert c.decoder_warps == 0 and c.threads == 9 * 32 and c.token_tile == 96
    dec = replace(c, image=False)
    # the decoder tile's raw NVFP4 stage (codes and scales) is gone; the decoded ring stays
    assert dec.smem_bytes - c.smem_bytes == 4 * (96 * 64 + 96 * 8)
    assert replace(c, act="bf16").smem_bytes == c.smem_bytes
    # past 64 tokens, with an even ring, the stages go in pairs: K in pairs of K_STEP chunks
    assert c.paired_stages and not replace(c, stages=3).paired_stages
    assert not replace(c, max_frags=8).paired_stages
    with pytest.raises(ValueError, match="in pairs"):
        c.validate(4096, 3 * 128)
    replace(c, max_frags=8).validate(4096, 3 * 128)
    assert gc.heuristic(4096, 3 * 128, [90] * 8).max_frags == 8  # (no pairs: the 64-token image tile)
    assert gc.heuristic(4096, 3 * 128, [300] * 8).max_frags == 20  # (3 stages, unpaired)
    for bad in (dict(mma=0), dict(mode="swiglu")):
        with pytest.raises(ValueError, match="image"):
            replace(c, **bad).validate()
    # a fused launch of an image or large tile runs the 64-token decoder tile
    for mode in ("swiglu", "layer"):
        f = gc.fused_config(c, mode)
        assert not f.image and f.max_frags == 8 and f.mode == mode and f.decoder_warps >= 1
    assert config_of(parse_config("8,2,128,4,1,0,12,1"), gc.GemmConfig()) == gc.GemmConfig(8, 2, 128, 4, 12, 1, image=True)
    assert not config_of(parse_config("8,2,128,4,1,0,12"), gc.GemmConfig()).image
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="image 0/1"):
        parse_config("8,2,128,4,1,0,12,3")
    built = config_of(parse_config("8,2,128,4,1,0,12,2"), gc.GemmConfig())
    assert built == gc.GemmConfig(8, 2, 128, 4, 12, 1, image=True, build_image=True) and built.builders


@pytest.mark.parametrize("seed", range(20))
def test_image_groups_of_experts_never_overlap(seed):
    """Expert e's groups start at offsets[e] // 8 + e (act_image.cuh) and need ceil(count / 8):
    disjoint, in order, and inside image_groups(T, E) for any counts."""
    rng = np.random.default_rng(seed)
    e = int(rng.integers(1, 40))
    counts = rng.integers(0, 30, e) * rng.integers(0, 2, e) + rng.integers(0, 3, e)
    offsets = np.r_[0, np.cumsum(counts)]
    start = offsets[:-1] // 8 + np.arange(e)
    end = start + -(-counts // 8)
    assert (end <= np.r_[start[1:], gg.image_groups(int(offsets[-1]), e)]).all()


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("bf16_out", [False, True], ids=["fp32-out", "bf16-out"])
@pytest.mark.parametrize("cfg", gc.SHIPPED_IMAGE, ids=IDS)
def test_image_tiles_compile_without_spills(cfg, bf16_out):
    info = jit.ptxas_report(gg.SOURCE, cfg.expression_for(False, bf16_out=bf16_out))
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info
    assert info.registers <= 65536 // (4 * 32 * -(-cfg.threads // 128)), info
    assert not info.wgmma_serialized and not info.setmaxnreg_ignored, info


BUILDER_TILES = [c for c in gc.SHIPPED_IMAGE if c.builders]
# the 64- and 96-token image tiles (and 256 x 128 on one row tile) with the image built in the launch
BUILT_TILES = [replace(c, build_image=True) for c in gc.SHIPPED_IMAGE if c.mma == 1 and c.warps == 8 and not c.wide]


def test_builder_tiles_are_the_producer_warpgroup_ones():
    """The in-kernel image (BUILDERS) exists for the register-A image tiles with a producer
    warpgroup (its three idle warps build), and is refused by name for any other tile."""
    assert {(c.max_frags, c.act) for c in BUILDER_TILES} == {(f, a) for f in (16, 20) for a in gc.ACTS}
    assert all(c.producer_warps == 4 for c in BUILDER_TILES)
    assert not any(c.builders for c in gc.SHIPPED_IMAGE if c.producer_warps == 1)
    assert not any(c.builders for c in gc.SHIPPED_SS + gc.SHIPPED_CONFIGS)
    cfg = BUILDER_TILES[-1]
    assert cfg.expression_for(False, builders=True).endswith("false, false, false, true>")
    assert cfg.expression_for(False, True, bf16_out=True, builders=True).endswith("false, true, true, true>")
    with pytest.raises(ValueError, match="builders"):
        gc.SHIPPED_IMAGE[0].expression_for(False, builders=True)
    # build_image: the same warpgroup on the smaller image tiles, on request; its wgmma group size and
    # epilogue are the tile's own (WIDE), and a fused launch of it runs the decoder tile as before
    assert {c.max_frags for c in BUILT_TILES} == {8, 12, 16} and all(c.builders and c.threads == 12 * 32 for c in BUILT_TILES)
    assert not any(c.wide for c in BUILT_TILES) and all(c.wide for c in BUILDER_TILES)
    assert not gc.fused_config(BUILT_TILES[0], "swiglu").build_image
    for bad in (dict(image=False, build_image=True), dict(mma=2), dict(warps=4)):
        with pytest.raises(ValueError, match="build_image|mma=2"):
            replace(BUILT_TILES[0], **bad).validate()


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("form", ["fp32-out", "bf16-out", "counts-in", "read-only", "swiglu"])
@pytest.mark.parametrize("cfg", BUILDER_TILES + BUILT_TILES, ids=IDS)
def test_builder_tiles_compile_without_spills(cfg, form):
    """Every instantiation a launch with the in-kernel image can ask for: no spills (the builder
    warps hold the producer warpgroup's 56 registers), no serialized wgmma."""
    if form == "swiglu":
        if cfg.act != "nvfp4" or not cfg.wide:
            pytest.skip("the register SwiGLU epilogue: NVFP4 activations on the wide tiles")
        expr = gc.fused_config(cfg, "swiglu").expression_for(False, builders=True)
    else:
        expr = cfg.expression_for(form == "read-only", form == "counts-in", bf16_out=form == "bf16-out", builders=True)
    info = jit.ptxas_report(gg.SOURCE, expr)
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info
    assert info.registers <= 65536 // (4 * 32 * -(-cfg.threads // 128)), info
    assert not info.wgmma_serialized and not info.setmaxnreg_ignored, info


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("act", gc.ACTS)
def test_image_kernel_compiles_without_spills(act):
    info = jit.ptxas_report(gg.SOURCE, f"lab_gemm::act_image<lab_gemm::Act::{act}>")
    assert info.spill_stores == 0 and info.spill_loads == 0 and info.stack_bytes == 0, info


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
def test_image_smem_mirror(tmp_path):
    assert_config_mirror(tmp_path, [*gc.SHIPPED_IMAGE, *BUILT_TILES])


def test_a_split_larger_class_takes_the_pre_pass_unless_told():
    """prepass_by_default: the pre-pass for a size class from above one token, builders over every
    expert and for the smaller class; use_prepass overrides it either way, and unwinds."""
    assert gg.prepass_by_default(gc.counts_range(None)) is False
    assert gg.prepass_by_default((1, 16)) is False
    assert gg.prepass_by_default((17, 2**31 - 1)) is True
    assert gg._PREPASS == [None]
    with gg.use_prepass(False):
        assert gg._PREPASS[-1] is False
        with gg.use_prepass():
            assert gg._PREPASS[-1] is True
    assert gg._PREPASS == [None]


@pytest.mark.skipif(jit.nvcc_path() is None, reason="needs nvcc")
def test_image_piece_numbering_on_the_host(tmp_path):
    """The in-kernel image's piece numbering, the kernel's own functions compiled for the host
    (tests/fixtures/image_pieces_check.cu): over random routings of one or two problems, every
    piece maps to one (expert, k chunk, token block) and back, every unit stage's piece is one of
    them exactly once, and the launch's pieces fit grouped_gemm.image_pieces' bound."""
    import subprocess
    from pathlib import Path

    src = Path(__file__).resolve().parent / "fixtures" / "image_pieces_check.cu"
    exe = tmp_path / "image_pieces_check"
    proc = subprocess.run([jit.nvcc_path(), "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                           f"-I{jit.KERNEL_DIR / 'gemm'}", "-o", str(exe), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seed = int(np.random.default_rng().integers(2**31))
    run = subprocess.run([str(exe), str(seed), "400"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok"), f"seed {seed}: {run.stdout[-2000:]}"


def _problem(rng, act, counts, k=256):
    rows = int(np.sum(counts))
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int32)
    if act == "bf16":
        mag = 2.0 ** rng.uniform(-14, 8, (rows, k))
        x = (mag * rng.choice([-1.0, 1.0], (rows, k))).astype(np.float32).astype(ml_dtypes.bfloat16)
        return offsets, x.view(np.uint16), None, x.astype(np.float64)
    xp = rng.integers(0, 256, (rows, k // 2), np.uint8)
    xs = rng.integers(1, 127, (rows, k // 16)).astype(np.uint8)
    return offsets, xp, xs, decode_blocks(xp, xs)


def _gemm_case(cp, rng, cfg, counts, n, k):
    """Random weights in cfg's layout, a routed problem of `counts` and alpha: the prepared weights,
    the launch's device arguments (x, scales, offsets, alpha), the host offsets and x."""
    e = counts.size
    packed = rng.integers(0, 256, (e, n, k // 2), np.uint8)
    scales = rng.integers(1, 127, (e, n, k // 16)).astype(np.uint8)
    offsets, xq, xs, _ = _problem(rng, cfg.act, counts, k)
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(cfg.block_rows, cfg.k_step))
    args = (cp.asarray(xq), None if xs is None else cp.asarray(xs), cp.asarray(offsets), cp.asarray(alpha))
    return prep, args, offsets, xq


@pytest.mark.gpu
@pytest.mark.parametrize("act", gc.ACTS)
def test_image_layout_holds_each_token_in_its_expert_groups(act):
    """image[q][grp][half][row][8] (fp16): token t of expert e at group offsets[e] // 8 + e + t // 8,
    row t % 8; k16 block q's values in K_SLOTS order, times 2^-14 for NVFP4 rows (the decoders'
    scaling); every other slot zero. The buffer is poisoned first."""
    import cupy as cp

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    counts = np.array([0, 5, 8, 17, 0, 0, 1, 30])
    k = 256
    offsets, xq, xs, xf = _problem(rng, act, counts, k)
    e = counts.size
    prep = gw.PreparedWeights(cp.zeros(1, cp.uint8), e, 256, k, 256, 128)
    rows, groups = int(counts.sum()), gg.image_groups(int(counts.sum()), e)
    xq_d, xs_d, off_d = cp.asarray(xq), None if xs is None else cp.asarray(xs), cp.asarray(offsets)
    space = cp.full(gg.image_bytes(rows, e, k) + 512, 0xFF, cp.uint8)  # poisoned: every slot must be written
    img_buf = gg.activation_image(prep, xq_d, xs_d, off_d, act, space[256:])
    assert img_buf.size == (k // 16) * groups * 256 and img_buf.data.ptr == space.data.ptr + 256
    assert (space[:256] == 0xFF).all() and (space[256 + img_buf.size:] == 0xFF).all()  # nothing past it
    with pytest.raises(ValueError, match="at least"):
        gg.activation_image(prep, xq_d, xs_d, off_d, act, space[:img_buf.size - 16])
    img = img_buf.get().view(np.float16).reshape(k // 16, groups, 2, 8, 8).astype(np.float64)
    want = np.zeros_like(img)
    scale = 2.0**-14 if act == "nvfp4" else 1.0
    for ex in range(e):
        for t in range(counts[ex]):
            grp, row = offsets[ex] // 8 + ex + t // 8, t % 8
            v = xf[offsets[ex] + t].reshape(k // 16, 16)[:, gw.K_SLOTS] * scale
            want[:, grp, :, row, :] = v.reshape(k // 16, 2, 8)
    want = want.astype(np.float16).astype(np.float64)  # bf16 -> fp16 rounds; NVFP4 is exact
    assert np.array_equal(img, want), f"seed {seed}"
    # with counts_in (a launch over one size class) only those experts' groups are written
    space.fill(0xFF)
    part = gg.activation_image(prep, xq_d, xs_d, off_d, act, space[256:], counts_in=(5, 17)).get()
    part = part.view(np.uint16).reshape(k // 16, groups, 2, 8, 8)
    g0 = offsets[:-1] // 8 + np.arange(e)  # each expert's first group; it owns those up to the next one's
    owner = np.searchsorted(g0, np.arange(groups), side="right") - 1
    mine = ((counts == 0) | ((counts >= 5) & (counts <= 17)))[owner]  # (empty experts' groups: zeros)
    assert mine.any() and (~mine).any()
    assert np.array_equal(part[:, mine].view(np.float16).astype(np.float64), want[:, mine]), f"seed {seed}"
    assert (part[:, ~mine] == 0xFFFF).all(), f"seed {seed}: groups of other experts written"


def test_image_workspace_grows_per_stream_and_keeps_what_graphs_may_hold():
    pytest.importorskip("cupy")
    from lab.gpu import gpu_available

    if not gpu_available():
        pytest.skip("needs a CUDA GPU")
    import cupy as cp

    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    a = gg.image_workspace(1000, s1)
    assert gg.image_workspace(900, s1) is a and gg.image_workspace(1000, s2) is not a
    b = gg.image_workspace(1500, s1)
    assert b.size >= 2000 and b is not a and gg.image_workspace(10, s1) is b
    assert any(buf is a for buf in gg._WORKSPACES[(cp.cuda.Device().id, s1.ptr)])


def _twin(cfg):
    """The decoder-warp tile of the same shape, where the lab compiles one; else (the 256-row
    tiles past 96 tokens, with a producer warpgroup) the 96-token image tile of the same rows; for
    mma 2, the register-A 64-token image tile."""
    if cfg.mma == 2:
        return gc.GemmConfig(8, 2, 128, 4, 8, 1, act=cfg.act, image=True)
    dec = replace(cfg, image=False)
    known = set(gc.SHIPPED_CONFIGS) | set(gc.SHIPPED_LARGE) | set(gc.SHIPPED_W4A16)
    if dec in known:
        return dec
    return replace(cfg, max_frags=12, stages=4) if cfg.producer_warps > 1 else None


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", gc.SHIPPED_IMAGE + gc.SHIPPED_SS, ids=IDS)
def test_image_tiles_match_float64_and_their_decoder_twins_bit_for_bit(cfg):
    """Counts around each token tile and past it (several passes), empty experts included:
    relative error <= 1e-5 against float64, every element written, the same bits on a second
    run, and the same bits as the decoder-warp tile of the same shape (the image holds exactly
    what the decoders write) or, for the producer-warpgroup tiles, as the 96-token image tile;
    for the tile with the weights decoded into shared memory (mma 2), as the register-A one."""
    import cupy as cp

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    tt = cfg.token_tile
    counts = np.array([0, 1, 7, 9, tt - 1, tt, tt + 1, 2 * tt + 3, 0, 300])
    e, n, k = counts.size, 256, 256
    n = -(-n // cfg.block_rows) * cfg.block_rows
    packed = rng.integers(0, 256, (e, n, k // 2), np.uint8)
    scales = rng.integers(1, 127, (e, n, k // 16)).astype(np.uint8)
    offsets, xq, xs, xf = _problem(rng, cfg.act, counts, k)
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    args = (cp.asarray(xq), None if xs is None else cp.asarray(xs), cp.asarray(offsets), cp.asarray(alpha))
    outs = []
    for c in (cfg, cfg, _twin(cfg)):
        if c is None:
            continue
        prep = gw.prepare_weights(packed, scales, xp=cp, layout=(c.block_rows, c.k_step))
        out = cp.full((xq.shape[0], n), cp.nan, cp.float32)
        gg.grouped_gemm(prep, args[0], args[1], args[2], args[3], out, c)
        outs.append(out.get())
    assert np.isfinite(outs[0]).all(), f"seed {seed}: unwritten or non-finite outputs"
    for other in outs[1:]:
        assert checks.compare_bits(outs[0].view(np.uint32), other.view(np.uint32))[0], f"seed {seed}: bits differ"
    if cfg.act == "nvfp4":
        want = reference.grouped_gemm(xq, xs, offsets, packed, scales, alpha)
    else:
        want = reference.grouped_gemm_w4a16(xf, offsets, packed, scales, alpha)
    err = checks.rel_error(outs[0], want)
    assert err is not None and err <= 1e-5, f"seed {seed}: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [c for c in gc.SHIPPED_IMAGE if c.warps == 8 and c.row_tiles == 2] + [gc.SHIPPED_SS[0]],
                         ids=IDS)
def test_image_tiles_write_bf16_as_the_conversion_rounds_it(cfg):
    """A uint16 out: the bits of the fp32 output through swiglu_quant.to_bf16, and the same count
    of non-finite outputs (an expert with alpha = inf makes them: inf, and NaN where the sum is
    zero), every element written over a poisoned buffer."""
    import cupy as cp

    from lab.kernels import swiglu_quant as sq

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    tt = cfg.token_tile
    counts = np.array([0, 3, tt - 1, tt + 1, 2 * tt + 3, 0, 40])
    e, n, k = counts.size, 256, 256
    packed = rng.integers(0, 256, (e, n, k // 2), np.uint8)
    scales = rng.integers(1, 127, (e, n, k // 16)).astype(np.uint8)
    offsets, xq, xs, _ = _problem(rng, cfg.act, counts, k)
    alpha = rng.uniform(0.5, 2, e).astype(np.float32)
    alpha[6] = np.inf
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(cfg.block_rows, cfg.k_step))
    args = (cp.asarray(xq), None if xs is None else cp.asarray(xs), cp.asarray(offsets), cp.asarray(alpha))
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
    assert np.isfinite(out32.get()[:offsets[6]]).all(), f"seed {seed}: unwritten fp32 outputs"


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [1, 3])
def test_a_launch_on_part_of_the_sms_computes_every_unit(sms):
    """`sms` caps the persistent grid (a launch beside another on a second stream); the unit
    counter still hands out every unit: the bits of the launch on every SM, over a poisoned out.
    Out-of-range caps are refused before the launch."""
    import cupy as cp

    cfg = gc.GemmConfig(8, 2, 128, 3, 20, 1, image=True)
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    counts = np.array([5, 0, 170, 33, 1, 90])
    n = 512
    prep, args, _, xq = _gemm_case(cp, rng, cfg, counts, n, 256)
    full = cp.full((xq.shape[0], n), cp.nan, cp.float32)
    gg.grouped_gemm(prep, *args, full, cfg)
    part = cp.full_like(full, cp.nan)
    gg.grouped_gemm(prep, *args, part, cfg, sms=sms)
    assert np.isfinite(part.get()).all(), f"seed {seed}: unwritten outputs"
    ok, msg = checks.compare_bits(part.get().view(np.uint32), full.get().view(np.uint32))
    assert ok, f"seed {seed}: {msg}"
    for bad in (0, jit.sm_count() + 1, 2.5, -1):
        with pytest.raises(ValueError, match="sms"):
            gg.grouped_gemm(prep, *args, part, cfg, sms=bad)


def test_bf16_out_is_refused_where_it_cannot_run():
    """A bf16 out needs an image tile and a counter; a counter needs a bf16 out: clear errors
    before any launch (no GPU needed to reach them)."""
    cp = pytest.importorskip("cupy")
    from lab.gpu import gpu_available

    if not gpu_available():
        pytest.skip("needs a CUDA GPU")
    e, n, k, rows = 2, 256, 256, 8
    prep = gw.prepare_weights(np.zeros((e, n, k // 2), np.uint8), np.ones((e, n, k // 16), np.uint8), xp=cp)
    xq, xs = cp.zeros((rows, k // 2), cp.uint8), cp.ones((rows, k // 16), cp.uint8)
    off, alpha = cp.asarray(np.array([0, 4, 8], np.int32)), cp.ones(e, cp.float32)
    bf, c = cp.zeros((rows, n), cp.uint16), cp.zeros(1, cp.uint32)
    img = gc.GemmConfig(8, 2, 128, 4, 8, 1, image=True)
    with pytest.raises(ValueError, match="image tile"):
        gg.grouped_gemm(prep, xq, xs, off, alpha, bf, gc.GemmConfig(8, 2, 128, 4, 8, 1), nonfinite=c)
    with pytest.raises(ValueError, match="nonfinite"):
        gg.grouped_gemm(prep, xq, xs, off, alpha, bf, img)
    with pytest.raises(ValueError, match="nonfinite"):
        gg.grouped_gemm(prep, xq, xs, off, alpha, cp.zeros((rows, n), cp.float32), img, nonfinite=c)
    with pytest.raises(ValueError, match="nonfinite"):
        gg.grouped_gemm(prep, xq, xs, off, alpha, bf, img, nonfinite=cp.zeros(2, cp.uint32))
    with pytest.raises(ValueError, match="out"):
        gg.grouped_gemm(prep, xq, xs, off, alpha, cp.zeros((rows, n + 1), cp.uint16), img, nonfinite=c)


def test_bf16_output_is_an_instantiation_of_its_own():
    """A register-A image tile's bf16 output compiles apart (BF16_OUT), the fp32 one keeps the
    twelve-argument name; the MMA = 2 tile chooses its output at run time."""
    cfg = gc.SHIPPED_IMAGE[-1]
    assert cfg.expression_for(False).endswith("false, false>")
    assert cfg.expression_for(False, bf16_out=True).endswith("false, false, true>")
    assert cfg.expression_for(False, True, bf16_out=True).endswith("false, true, true>")
    ss = gc.SHIPPED_SS[0]
    assert ss.expression_for(False, bf16_out=True) == ss.expression_for(False)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", BUILDER_TILES + BUILT_TILES, ids=IDS)
def test_in_kernel_image_is_the_pre_pass_image_and_leaves_its_flags_at_zero(cfg):
    """The builder warps write, for every expert's groups, exactly the bytes the pre-pass writes
    (a poisoned workspace, read back after the launch); the launch computes the same bits as with
    the pre-pass, alone, as a size class (counts_in), and as the second problem of a pair launch;
    and every launch leaves its unit counter, piece counter and readiness flags at zero."""
    import cupy as cp

    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    tt = cfg.token_tile
    counts = np.array([0, 1, 7, 9, tt - 1, tt, tt + 1, 2 * tt + 3, 0, 300, 40])
    e, n, k = counts.size, 256, 512
    prep, args, offsets, xq = _gemm_case(cp, rng, cfg, counts, n, k)
    rows = xq.shape[0]
    stream = cp.cuda.Stream(non_blocking=True)
    nbytes = gg.image_bytes(rows, e, k)
    with stream:
        space = gg.image_workspace(nbytes, stream)
        want_img = gg.activation_image(prep, args[0], args[1], args[2], cfg.act, cp.empty(nbytes, cp.uint8)).get()
        space[:nbytes].fill(0xFF)
        got = cp.full((rows, n), cp.nan, cp.float32)
        gg.grouped_gemm(prep, *args, got, cfg, stream=stream)
        img = space[:nbytes].get()
        want = cp.full_like(got, cp.nan)
        gg.grouped_gemm(prep, *args, want, cfg, stream=stream, prepass=True)
        stream.synchronize()
    groups = gg.image_groups(rows, e)
    g0 = offsets[:-1] // 8 + np.arange(e)
    owned = np.zeros(groups, bool)
    for ex in range(e):
        owned[g0[ex]:g0[ex] + -(-counts[ex] // 8)] = True
    shape = (k // 16, groups, 256)
    assert np.array_equal(img.reshape(shape)[:, owned], want_img.reshape(shape)[:, owned]), f"seed {seed}: image bytes"
    assert np.isfinite(got.get()).all(), f"seed {seed}: unwritten outputs"
    ok, msg = checks.compare_bits(got.get().view(np.uint32), want.get().view(np.uint32))
    assert ok, f"seed {seed}: against the pre-pass: {msg}"
    # a size class of the same launch: those experts' rows, the same bits
    part = cp.full_like(got, cp.nan)
    gg.grouped_gemm(prep, *args, part, cfg, counts_in=(tt, 2 * tt + 3))
    mine = np.repeat((counts >= tt) & (counts <= 2 * tt + 3), counts)
    p = part.get()
    assert np.isnan(p[~mine]).all(), f"seed {seed}: rows of other experts written"
    assert checks.compare_bits(p[mine].view(np.uint32), want.get()[mine].view(np.uint32))[0], f"seed {seed}: class"
    # two problems in one launch (the one-launch form): each problem's pieces and flags apart
    first, second = cp.full_like(got, cp.nan), cp.full_like(got, cp.nan)
    gg.grouped_gemm_pair((prep, *args, first), (prep, *args, second), cfg)
    for out in (first, second):
        assert checks.compare_bits(out.get().view(np.uint32), want.get().view(np.uint32))[0], f"seed {seed}: pair"
    cp.cuda.Device().synchronize()
    for sched, ready in gg._SCHED.values():
        assert not sched.get().any(), "unit or piece counters not reset by the launch"
    for kept in gg._IMAGE_READY.values():
        assert not kept[-1].get().any(), "image readiness flags not reset by the launch"
