"""W4A8 grouped GEMM and its activation kernels (sources: w4a8_gemm.cu, w4a8_act.cu): the 1x128
quantizer (quantize_act_gpu) and SwiGLU + quantize (swiglu_quant_gpu).

    out[r, n] = 2^p[e] * alpha[e] * sum_g s_x[r, g] * sum_{k in g} x8[r, k] * w8[e, n, k]
                for offsets[e] <= r < offsets[e+1]

lab/w4a8.py defines every term (w8 from the NVFP4 weights through the magnitude table, x8 and s_x
from quantize_act) and `gemm`, the float64 contract; the kernel's only deviation is its
accumulation (fp8 wgmma within a 128-column group, fp32 across groups).

Arguments (CuPy arrays on the launch's device unless said otherwise):
    prep      W4A8Weights   prepare_w4a8_weights(packed (E, N, K/2), scales (E, N, K/16)), then
                            .to_device(); N and K multiples of 64
    x8        (rows, K)     uint8    e4m3 codes, rows grouped by expert
    s_x       (rows, G)     float32  G = ceil(K / 128)
    offsets   (E+1,)        int      host or device; rows of expert e are offsets[e]:offsets[e+1]
    alpha     (E,)          float32  host or device; the weight global (1 for w13)
    out       (rows, N)     float32  rows of experts with tokens are written, others untouched

w4a8_gemm reads offsets and alpha on the host (a synchronizing copy when they live on the
device): offsets to check them and size the grid, alpha to check that 2^p * alpha stays a normal
float32 (lab/w4a8.py epilogue_factor). A caller that launches the same shapes many times (a
layer variant) runs those checks once (plan_w4a8_gemm) and then launch_w4a8_gemm, which reads
nothing on the host and allocates nothing, with offsets and alpha already on the device.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from lab import nvfp4, w4a8
from lab.kernels import jit

GEMM_SOURCE = "w4a8_gemm.cu"
ACT_SOURCE = "w4a8_act.cu"
ACT_HEADER = "w4a8_act.cuh"  # the quantize and SwiGLU arithmetic both sources include
TOKEN_TILES = (8, 16, 32, 64, 128)  # wgmma N: tokens per CTA pass
ROWS = 64  # weight rows per CTA (wgmma M)
THREADS = 128
STEP_K = 32
GROUP_K = w4a8.FP8_GROUP
ACT_WARPS = 8  # (row, group) units per quantize block

# Within each 32 of K the prepared codes are stored in this order: stored[8c + i] = K_ORDER[8c + i],
# the logical k of element i of lane c's A fragment. The kernel permutes K inside each k32 step
# (its activations are stored so, w4a8_gemm.cu's sigma): lane c's fragment (a0 at the tensor
# core's k 4c..4c+3, a2 at 16+4c..16+4c+3) holds logical k 8c..8c+7, so the order is the
# natural one and each 32-bit word of eight codes lies in one 16-block.
K_ORDER = np.arange(32, dtype=np.intp)
K_UNORDER = np.argsort(K_ORDER)


def max_stages(tokens: int) -> int:
    """The deepest ring a token tile's CTA fits in 48 KiB of static shared memory beside the fused
    epilogue's arrays (w4a8_gemm.cu's DefaultStages is this for every tile)."""
    return {64: 3, 128: 2}.get(tokens, 4)


def gemm_expression(tokens: int, promote: bool = True, stages: int | None = None) -> str:
    """The kernel instantiation for a token tile; promote=False is the form without promotion,
    built for the accuracy study only (scripts/w4a8_promotion_study.py); `stages` sets the ring's
    depth (2 .. max_stages(tokens); None: the shipped depth), for the depth study only
    (scripts/w4a8_stage_study.py)."""
    if tokens not in TOKEN_TILES:
        raise ValueError(f"tokens: the token tile must be one of {TOKEN_TILES}, got {tokens!r}")
    if stages is not None and not (isinstance(stages, (int, np.integer)) and 2 <= stages <= max_stages(tokens)):
        raise ValueError(f"stages: expected an int from 2 to {max_stages(tokens)} for token tile {tokens}, "
                         f"got {stages!r}")
    if stages is None:
        return f"lab_w4a8::w4a8_gemm<{tokens}>" if promote else f"lab_w4a8::w4a8_gemm<{tokens}, false>"
    return f"lab_w4a8::w4a8_gemm<{tokens}, {'true' if promote else 'false'}, {int(stages)}>"


GEMM_EXPRESSIONS = tuple(gemm_expression(t) for t in TOKEN_TILES)
# compiled in their own module, only when the study asks for them
UNPROMOTED_EXPRESSIONS = tuple(gemm_expression(t, promote=False) for t in TOKEN_TILES)
CLUSTER = 4  # CTAs of the fused epilogue's cluster: one 128-column group of I


def swiglu_expression(tokens: int) -> str:
    """w13 with the SwiGLU + 1x128 quantize in its epilogue (w4a8_gemm.cu w4a8_gemm_swiglu)."""
    gemm_expression(tokens)  # names the argument when it is not a tile
    return f"lab_w4a8::w4a8_gemm_swiglu<{tokens}>"


FUSED_EXPRESSIONS = tuple(swiglu_expression(t) for t in TOKEN_TILES)
WIDE_TILES = (8, 16, 32, 64, 128)  # the two-warpgroup CTA's tiles (128: a ring in dynamic shared memory)
FUSED_WIDE_TILES = (8, 16, 32, 64)  # and the fused epilogue's on it


def wide_expression(tokens: int, stages: int | None = None) -> str:
    """The two-warpgroup CTA (w4a8_gemm.cu w4a8_gemm_wide): 128 weight rows over one activation
    tile, the same bits as w4a8_gemm (GemmPlan.warpgroups = 2; the default from WIDE_FROM tokens,
    wide_warpgroups). `stages` sets its ring's depth (2 .. max_wide_stages(tokens); None: the
    shipped one, wide_stages), for the depth study only (scripts/w4a8_stage_study.py)."""
    if tokens not in WIDE_TILES:
        raise ValueError(f"tokens: the two-warpgroup CTA takes a token tile of {WIDE_TILES}, got {tokens!r}")
    if stages is None:
        return f"lab_w4a8::w4a8_gemm_wide<{tokens}>"
    top = max_wide_stages(tokens)
    if isinstance(stages, bool) or not (isinstance(stages, (int, np.integer)) and 2 <= stages <= top):
        raise ValueError(f"stages: expected an int from 2 to {top} for the two-warpgroup CTA's token tile "
                         f"{tokens}, got {stages!r}")
    return f"lab_w4a8::w4a8_gemm_wide<{tokens}, {int(stages)}>"


def wide_stages(tokens: int) -> int:
    """The two-warpgroup CTA's shipped ring depth (w4a8_gemm.cu WideStages)."""
    return {128: 3, 64: 2}.get(tokens, 4)


def wide_stage_bytes(tokens: int) -> int:
    """One stage of the two-warpgroup CTA's ring (w4a8_gemm.cu Stage<T, 2>): 8 KiB of words, 1 KiB
    of block scales, the tile's activation bytes (32 a token a step) and scales, 128-byte aligned."""
    raw = 2 * 4 * THREADS * 8 + 2 * ROWS * 8 + 4 * tokens * 32 + 4 * tokens
    return -(-raw // 128) * 128


def max_wide_stages(tokens: int) -> int:
    """The deepest ring the depth study builds for the two-warpgroup CTA: what fits in the 227 KiB
    of shared memory a CTA may have beside its static arrays (the table and the epilogue's, under
    2 KiB), at most 8."""
    return min(8, (227 * 1024 - 2048) // wide_stage_bytes(tokens))


def wide_ring_bytes(tokens: int, stages: int | None = None) -> int:
    """The dynamic shared memory a two-warpgroup launch passes: the ring, where it is dynamic (the
    128-token tile's, and any past 46 KiB: w4a8_gemm.cu WideRingIsDynamic), else none (the static
    rings)."""
    s = wide_stages(tokens) if stages is None else int(stages)
    ring = s * wide_stage_bytes(tokens)
    return ring if tokens == 128 or ring > 46 * 1024 else 0


# compiled in their own module, only when a plan asks for them
WIDE_EXPRESSIONS = tuple(wide_expression(t) for t in WIDE_TILES)

SS_TILES = (64, 128)  # the shared-memory-A kernel's tiles
SS_ABUF = 4 * ROWS * 32  # one warpgroup's decoded group (w4a8_gemm.cu SS_ABUF)


def ss_expression(tokens: int) -> str:
    """The two-warpgroup CTA with both wgmma operands in shared memory (w4a8_gemm.cu w4a8_gemm_ss):
    the weights decoded there, group g + 1's decode under group g's wgmmas (GemmPlan.smem_a)."""
    if tokens not in SS_TILES:
        raise ValueError(f"tokens: the shared-memory-A kernel takes a token tile of {SS_TILES}, got {tokens!r}")
    return f"lab_w4a8::w4a8_gemm_ss<{tokens}>"


def ss_stages(tokens: int) -> int:
    """Its ring's depth (w4a8_gemm.cu SsStages)."""
    return 3 if tokens == 128 else 4


def ss_smem_bytes(tokens: int) -> int:
    """The dynamic shared memory of a shared-memory-A launch: its ring, then two buffers of decoded
    weights for each warpgroup."""
    return ss_stages(tokens) * wide_stage_bytes(tokens) + 2 * 2 * SS_ABUF


SS_EXPRESSIONS = tuple(ss_expression(t) for t in SS_TILES)

RES_TILES = (8, 16)  # the resident-activation kernel's tiles
RES_STAGES = 4  # its ring of weights (w4a8_gemm.cu ResStages)
WEIGHT_STAGE_BYTES = (GROUP_K // STEP_K * THREADS + ROWS) * 8  # one group's words and scales (WeightStage)


def res_expression(tokens: int) -> str:
    """The one-warpgroup CTA with its token block's activations resident in shared memory for the
    whole of K and the weights' ring filled by bulk copies (w4a8_gemm.cu w4a8_gemm_res;
    GemmPlan.resident): no copies a thread in the group loop."""
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens not in RES_TILES:
        raise ValueError(f"tokens: the resident-activation kernel takes a token tile of {RES_TILES}, got {tokens!r}")
    return f"lab_w4a8::w4a8_gemm_res<{tokens}>"


def res_smem_bytes(tokens: int, k: int) -> int:
    """The dynamic shared memory of a resident-activation launch: the ring, then the block's
    T x K activation bytes and its T x K / 128 scales."""
    return RES_STAGES * WEIGHT_STAGE_BYTES + tokens * k + 4 * tokens * (k // GROUP_K)


RES_EXPRESSIONS = tuple(res_expression(t) for t in RES_TILES)
RES_DEFAULT_TILES = (8,)  # where a default plan takes it (the one-warpgroup CTA's tiles of RES_TILES)


def resident_by_default(plan, k: int) -> bool:
    """Whether a default plan runs the resident-activation kernel: a one-warpgroup plan at a tile of
    RES_DEFAULT_TILES, promoted, with K a multiple of 128. Only 8: at 16 tokens and K = 4096 its
    84 KiB of shared memory leave two CTAs an SM and it was 23% slower than the ring kernel (w13,
    mean 8, H100); at 8 it matched the ring kernel at mean 1 (588.8 against 587.2 us w13, 299.7
    against 302.0 w2: the H100 reads at 96-98% there) and was 5-12% faster at mean 8
    (results/studies/w4a8_resident_h100.json). Its issue savings are for the H200, where the
    8-token ring kernel is issue bound; not yet timed there."""
    return (plan.tokens in RES_DEFAULT_TILES and plan.warpgroups == 1 and plan.promote and not plan.smem_a
            and plan.stages is None and k % GROUP_K == 0 and res_smem_bytes(plan.tokens, k) <= RES_MAX_SMEM)


IMAGE_TILES = (64, 128)  # the activation-image kernel's tiles
IMAGE_SUB = 64  # its sub-tiled form's wgmma batch (tokens): GemmPlan.sub
IMAGE_AHEAD_TILES = IMAGE_TILES + (192,)  # its decode-ahead form's: 192 only in batches of IMAGE_SUB
IMAGE_STAGES = 4  # its ring's depth (w4a8_gemm.cu ImageStages)
IMAGE_K = 4 * GROUP_K  # K must be a multiple of this: whole groups, and scale-image rows of 16-byte pieces


def image_sub(tokens: int, sub: int | None) -> int:
    """The wgmma batch of an image launch at `tokens`: `sub` (0, or IMAGE_SUB on a tile above it),
    or by default the tile's own (IMAGE_SUB at 192, whose whole-tile sums would not fit the
    registers; 0, the whole tile, below)."""
    if sub is None:
        return IMAGE_SUB if tokens > 128 else 0
    if (isinstance(sub, bool) or sub not in (0, IMAGE_SUB) or (sub and tokens <= IMAGE_SUB)
            or (tokens > 128 and not sub)):
        raise ValueError(f"sub: the image kernel's wgmma batch is 0 (the whole tile, up to 128 tokens) or "
                         f"{IMAGE_SUB} (tiles above {IMAGE_SUB}), got {sub!r} at a {tokens}-token tile")
    return int(sub)


def image_expression(tokens: int, stages: int | None = None, ahead: bool = False, bf16: bool = False,
                     sub: int | None = None) -> str:
    """The two-warpgroup CTA fed by bulk copies from an activation image, a producer warp and
    consumer warpgroups that never wait for each other (w4a8_gemm.cu w4a8_gemm_image;
    GemmPlan.image); `stages` sets its ring's depth (2 .. 8; None: IMAGE_STAGES), for the depth
    study only; `ahead` the form that decodes group g + 1 while g's wgmmas run (GemmPlan.ahead: a
    producer warpgroup whose registers go to the consumers); `bf16` the form whose epilogue writes
    the output as bf16 bits (GemmPlan.bf16_out); `sub` the decode-ahead form whose group issues its
    wgmmas in batches of IMAGE_SUB tokens into two buffers in turn (GemmPlan.sub; image_sub: the
    192-token tile's only form)."""
    tiles = IMAGE_AHEAD_TILES if ahead else IMAGE_TILES
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens not in tiles:
        raise ValueError(f"tokens: the activation-image kernel takes a token tile of {tiles}"
                         f"{' (192: the decode-ahead form)' if not ahead else ''}, got {tokens!r}")
    sub = image_sub(tokens, sub)
    if sub and not ahead:
        raise ValueError("sub: the wgmma batches are a form of the decode-ahead image kernel (ahead=True)")
    if stages is not None and (isinstance(stages, bool) or not (isinstance(stages, (int, np.integer))
                                                                 and 2 <= stages <= 8)):
        raise ValueError(f"stages: expected an int from 2 to 8 for the activation-image kernel, got {stages!r}")
    if sub:
        depth = IMAGE_STAGES if stages is None else int(stages)
        return f"lab_w4a8::w4a8_gemm_image<{tokens}, {depth}, true, {str(bool(bf16)).lower()}, {sub}>"
    if ahead or bf16:
        depth = IMAGE_STAGES if stages is None else int(stages)
        return f"lab_w4a8::w4a8_gemm_image<{tokens}, {depth}, {str(bool(ahead)).lower()}{', true' if bf16 else ''}>"
    if stages is None:
        return f"lab_w4a8::w4a8_gemm_image<{tokens}>"
    return f"lab_w4a8::w4a8_gemm_image<{tokens}, {int(stages)}>"


def x_image_expression(tokens: int) -> str:
    """The pre-pass that writes a launch's activation image (w4a8_gemm.cu w4a8_x_image)."""
    image_expression(tokens, ahead=True)
    return f"lab_w4a8::w4a8_x_image<{tokens}>"


def image_stage_bytes(tokens: int) -> int:
    """One stage of the activation-image kernel's ring (ImageStage<T>): both warpgroups' words and
    block scales (9 KiB), the group's T x 128 activation bytes and T scales, 128-byte aligned."""
    raw = 2 * 4 * THREADS * 8 + 2 * ROWS * 8 + tokens * GROUP_K + 4 * tokens
    return -(-raw // 128) * 128


def image_smem_bytes(tokens: int, stages: int | None = None) -> int:
    """The dynamic shared memory of an activation-image launch: its ring."""
    return (IMAGE_STAGES if stages is None else int(stages)) * image_stage_bytes(tokens)


SPLIT_TILES = (128, 192)  # the split-roles kernel's tiles (wgmma batches of IMAGE_SUB tokens)
SPLIT_ABUFS = 3  # its decoded groups in shared memory (w4a8_gemm.cu SPLIT_ABUFS)
SPLIT_THREADS = 4 * THREADS  # two consumer warpgroups, a decoder and a producer warpgroup


def split_expression(tokens: int, bf16: bool = False) -> str:
    """The split-roles CTA (w4a8_gemm.cu w4a8_gemm_split; GemmPlan.split): the activation image's
    producer and ring, a decoder warpgroup writing each group's e4m3 weights into shared memory, two
    consumer warpgroups whose wgmmas read both operands from there; `bf16` its bf16 epilogue."""
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens not in SPLIT_TILES:
        raise ValueError(f"tokens: the split-roles kernel takes a token tile of {SPLIT_TILES}, got {tokens!r}")
    return f"lab_w4a8::w4a8_gemm_split<{tokens}, {str(bool(bf16)).lower()}>"


def split_smem_bytes(tokens: int) -> int:
    """The dynamic shared memory of a split-roles launch: the image kernel's ring, then its decoded
    groups (SPLIT_ABUFS x 128 rows x 128 bytes)."""
    return image_smem_bytes(tokens) + SPLIT_ABUFS * 2 * SS_ABUF


SPLIT_EXPRESSIONS = tuple(split_expression(t, b) for b in (False, True) for t in SPLIT_TILES)

IMAGE_EXPRESSIONS = (tuple(image_expression(t, ahead=a, bf16=b) for b in (False, True) for a in (False, True)
                           for t in IMAGE_TILES)
                     + tuple(image_expression(t, ahead=True, bf16=b) for b in (False, True)
                             for t in IMAGE_AHEAD_TILES if t not in IMAGE_TILES)
                     + tuple(x_image_expression(t) for t in IMAGE_AHEAD_TILES))
# A consumer warp's group loop in the activation-image kernel (static SASS; a test pins them): the
# issue model that picks its tile (image_by_default), as GROUP_ISSUE does the ring kernels'.
IMAGE_ISSUE = {64: 208, 128: 249}
# The same for its decode-ahead form, whose loop takes two groups a trip (363 and 443): the form
# default plans take (on an H100 it was 5-19% faster than the plain one at 128 and 512 tokens per
# expert, results/studies/w4a8_image_ahead_h100.json).
IMAGE_AHEAD_ISSUE = {64: 182, 128: 222}
# The 192-token tile's (wgmma batches of 64): a group of a block with at most 128 tokens runs two
# batches, of a fuller one three (static SASS of the two-group loop: 239 and 291 a group; a test
# pins the loop).
IMAGE_BATCH_ISSUE = {192: (239, 291)}


def image_issue(counts, tokens: int) -> int:
    """The decode-ahead image kernel's group-loop instructions over the experts' token `counts` at a
    tile of IMAGE_AHEAD_TILES: blocks x IMAGE_AHEAD_ISSUE, or for a batched tile each block at its
    own batches' count (IMAGE_BATCH_ISSUE)."""
    counts = np.asarray(counts, np.int64)
    if tokens not in IMAGE_BATCH_ISSUE:
        return int((-(-counts // tokens)).sum()) * IMAGE_AHEAD_ISSUE[tokens]
    two, three = IMAGE_BATCH_ISSUE[tokens]
    full, rest = counts // tokens, counts % tokens
    return int(full.sum()) * three + int((rest > 2 * IMAGE_SUB).sum()) * three + int(
        ((rest > 0) & (rest <= 2 * IMAGE_SUB)).sum()) * two


def image_tile(counts) -> int:
    """The decode-ahead image kernel's default tile for the experts' token `counts`: of
    IMAGE_AHEAD_TILES the one whose blocks issue least (image_issue), ties to the larger."""
    cost = {t: image_issue(counts, t) for t in IMAGE_AHEAD_TILES}
    return min(cost, key=lambda t: (cost[t], -t))


def image_by_default(plan, prep, counts, tokens: int | None = None, token_blocks: int | None = None):
    """The plan a default launch takes where the ring CTA's tile has reached DEFAULT_MAX_TILE: the
    activation-image kernel in its decode-ahead form (N % 128 == 0, K % IMAGE_K == 0) at `tokens` if
    forced, else at image_tile's (128 once most busy experts have more than 64 tokens, 192 in wgmma
    batches once most have more than 128). Any other plan is returned as it is. Against the
    two-warpgroup ring CTA at 64 tokens on an H100 (results/studies/w4a8_image_h100.json), the
    128-token image kernel took w13 from 4161 to 2635 us at 128 tokens per expert and from 14846
    to 8455 at 512, w2 from 2112 to 1463 and 7531 to 4444, its pre-pass included."""
    if (plan.tokens < DEFAULT_MAX_TILE or plan.token_blocks == 0 or not plan.promote or plan.stages is not None
            or prep.n % (2 * ROWS) or prep.k % IMAGE_K):
        return plan
    counts = np.asarray(counts, np.int64)
    t = int(tokens) if tokens is not None else image_tile(counts)
    blocks = min(-(-int(counts.max()) // t), 65535) if token_blocks is None else int(token_blocks)
    return replace(plan, tokens=t, token_blocks=blocks, warpgroups=2, resident=False, smem_a=False, image=True,
                   ahead=True, sub=image_sub(t, None))


@dataclass(frozen=True)
class W4A8Image:
    """The activation image an activation-image launch writes and reads (w4a8_gemm.cu
    w4a8_x_image): x (image rows x K) uint8, sx (image rows x K / 128) float32, image rows =
    rows + experts x tokens (each expert's blocks padded to whole tiles)."""

    tokens: int
    x: object
    sx: object


def image_rows(rows: int, experts: int, tokens: int) -> int:
    """Rows of a launch's activation image: every expert's token blocks, each a whole tile."""
    return rows + experts * tokens


def image_workspace(plan, prep, rows: int, stream=None) -> W4A8Image | None:
    """Allocate (on `stream`) the activation image an image plan's launches over `rows` rows of
    activations write and read (launch_w4a8_gemm's `image`); None for a plan that needs none. A
    caller that launches many times allocates it once."""
    import cupy as cp

    if not plan.image:
        return None
    n = image_rows(rows, prep.experts, plan.tokens)
    with (stream if stream is not None else cp.cuda.get_current_stream()):
        return W4A8Image(plan.tokens, cp.empty((n, prep.k), cp.uint8), cp.empty((n, prep.k // GROUP_K), cp.float32))


# The most dynamic shared memory a resident launch may ask for: an sm_90 CTA's 227 KiB less the
# kernel's static table and barriers (1.2 KiB). K up to ~26000 at 8 tokens; past it the ring kernel.
RES_MAX_SMEM = 227 * 1024 - 2048


def swiglu_wide_expression(tokens: int) -> str:
    """The fused w13 on the two-warpgroup CTA (w4a8_gemm_swiglu_wide): the same a8 and s_a."""
    if tokens not in FUSED_WIDE_TILES:
        raise ValueError(f"tokens: the fused two-warpgroup CTA takes a token tile of {FUSED_WIDE_TILES}, "
                         f"got {tokens!r}")
    return f"lab_w4a8::w4a8_gemm_swiglu_wide<{tokens}>"


FUSED_WIDE_EXPRESSIONS = tuple(swiglu_wide_expression(t) for t in FUSED_WIDE_TILES)


def image_swiglu_expression(tokens: int, ahead: bool = False) -> str:
    """The fused w13 on the activation-image kernel (w4a8_gemm_image_swiglu, clusters of two):
    the same a8 and s_a; `ahead` its form with the decode one group ahead. At 128 tokens only the
    ahead form: the plain one spills (the SwiGLU's values beside the accumulators, 168 registers a
    thread); the ahead form's consumers have 224."""
    image_expression(tokens)  # names the tile it lacks
    if tokens == 128 and not ahead:
        raise ValueError("tokens: the 128-token fused image kernel is its decode-ahead form only (ahead=True)")
    return f"lab_w4a8::w4a8_gemm_image_swiglu<{tokens}{f', {IMAGE_STAGES}, true' if ahead else ''}>"


FUSED_IMAGE_EXPRESSIONS = (image_swiglu_expression(64),) + tuple(image_swiglu_expression(t, True) for t in IMAGE_TILES)
ACT_EXPRESSIONS = ("lab_w4a8_act::quantize_act<float>", "lab_w4a8_act::quantize_act<lab_w4a8_act::uint16_t>",
                   "lab_w4a8_act::swiglu_quant")
SWIGLU_EXPRESSION = ACT_EXPRESSIONS[2]


# The largest tile token_tile picks. 128 (two warpgroups' worth of accumulators in one: 191
# registers, two CTAs an SM, a ring of two) decodes each weight once for twice the tokens, but
# on an H100 it was only 1% faster than 64 at 512 tokens per expert and 1.9-4.6x slower at 1-32
# (results/studies/w4a8_loader_and_decode_ahead_h100.json); on the two-warpgroup CTA it matched
# 64 at 512 (14130 against 14159 us, w13) and was 11% slower at 128 (results/studies/
# w4a8_kperm_wide_h100.json): it runs only when asked for.
DEFAULT_MAX_TILE = 64


# From this token tile up, a plan takes the two-warpgroup CTA where N allows (wide_warpgroups):
# on an H100 it was 7-9% faster at 32-token tiles and 17-31% at 64 (results/studies/
# w4a8_wide_h100.json), and 1.3% slower at 8, where nothing is read twice from L2 that matters.
WIDE_FROM = 16


def wide_warpgroups(tokens: int, n: int) -> int:
    """The warpgroups a plan takes by default: 2 from WIDE_FROM tokens when N % 128 == 0, else 1."""
    return 2 if WIDE_FROM <= tokens <= DEFAULT_MAX_TILE and n % (2 * ROWS) == 0 else 1


# Instructions a warp issues for one 128-column group of 64 weight rows at each default tile (the
# group loop's static SASS in the CTA a plan takes there: one warpgroup at 8, two from 16; tests
# pin them). Decoding is paid once a token block, so a smaller tile that splits the largest
# experts can still issue less: at mean 8 on the study layer (largest expert 20 tokens) 16 tokens
# issue 6.5% less than 32 and measured 5% faster on an H100 (results/studies/
# w4a8_tile16_occupancy_bulk_h100.json: w13 931.5 against 980.5 us, w2 484.0 against 511.1).
# At 8 tokens a default plan now runs the resident-activation kernel, whose loop is shorter (~150
# static, ~125 in the warps without thread 0's refills), but 8 stays at the ring kernel's count:
# the shorter loop did not make 8-token blocks beat 16-token ones at mean 8 on an H100 (w13 1017.9
# against 931.7 us; results/studies/w4a8_resident_h100.json), which the smaller count would pick.
GROUP_ISSUE = {8: 196, 16: 209, 32: 225, 64: 320}


def token_tile(counts) -> int:
    """The default token tile for the experts' token `counts`: of TOKEN_TILES up to
    DEFAULT_MAX_TILE, the one whose token blocks issue the fewest group-loop instructions,
    sum over experts of ceil(count / T) x GROUP_ISSUE[T] (ties to the larger tile: fewer blocks
    read the weights again); TOKEN_TILES[0] when every count is zero."""
    return least_issue_tile(counts, tuple(GROUP_ISSUE))


def least_issue_tile(counts, tiles, issue=None) -> int:
    """Of `tiles` (keys of `issue`, smallest first; default GROUP_ISSUE), the one whose token
    blocks over the experts' `counts` issue the fewest group-loop instructions, sum of
    ceil(count / T) x issue[T], ties to the larger; tiles[0] when every count is zero."""
    issue = GROUP_ISSUE if issue is None else issue
    counts = np.asarray(counts, np.int64)
    cost = {t: int((-(-counts // t)).sum()) * issue[t] for t in tiles}
    return min(cost, key=lambda t: (cost[t], -t)) if counts.any() else tiles[0]


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


@dataclass
class W4A8Weights:
    """(E, N, K) NVFP4 weights in the kernel's layout (w4a8_gemm.cu's header). Arrays are NumPy
    after preparation, CuPy after `to_device`."""

    words: object  # (E, N/64, K/32, 128, 2) uint32
    scales: object  # (E, N/64, ceil(K/128), 64, 8) uint8
    tables: object  # (P, 128, 8) uint8, magnitude_table of each distinct p
    table_of: object  # (E,) int32: expert e's table
    p: object  # (E,) int32
    experts: int
    n: int
    k: int

    @property
    def on_device(self) -> bool:
        return not isinstance(self.words, np.ndarray)

    def to_device(self) -> "W4A8Weights":
        from lab.gpu import require_gpu

        cp = require_gpu("W4A8Weights.to_device")
        dev = W4A8Weights(*(cp.ascontiguousarray(cp.asarray(a)) for a in
                            (self.words, self.scales, self.tables, self.table_of, self.p)),
                          self.experts, self.n, self.k)
        # the copies land before this returns: the runners launch on non-blocking streams, which
        # do not wait for the current one
        cp.cuda.get_current_stream().synchronize()
        return dev

    def to_host(self) -> "W4A8Weights":
        def host(a):
            return a if isinstance(a, np.ndarray) else a.get()

        return W4A8Weights(*(host(a) for a in (self.words, self.scales, self.tables, self.table_of, self.p)),
                           self.experts, self.n, self.k)


def _check_nvfp4(packed, scales) -> tuple[int, int, int]:
    if packed.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if packed.ndim != 3:
        raise ValueError(f"packed: expected (E, N, K/2), got shape {packed.shape}")
    e, n, k = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
    if scales.shape != (e, n, k // 16):
        raise ValueError(f"scales: expected {(e, n, k // 16)}, got {scales.shape}")
    if n % ROWS or n == 0:
        raise ValueError(f"packed: N={n} must be a positive multiple of {ROWS}")
    if k % 64 or k == 0:
        raise ValueError(f"packed: K={k} must be a positive multiple of 64")
    return e, n, k


# The word of eight codes is a bitwise OR of what each of its four source bytes contributes (the
# magnitudes and signs of a byte's two codes land on bits of their own), so decode_words of the
# reordered codes is four table lookups per word: WORD_OF_BYTE[m][v] is decode_words of one word
# whose byte m is v and the rest zero. Word c of a 32-element step holds K_ORDER[8c .. 8c+7] =
# elements 8c..8c+7, packed in bytes 4c..4c+3 of the step's 16.
WORD_OF_BYTE = np.stack([w4a8.decode_words(np.eye(4, dtype=np.uint8)[m][None, :] * np.arange(256, dtype=np.uint8)[:, None])[:, 0]
                         for m in range(4)])
SOURCE_BYTES = np.array([[4 * c, 4 * c + 1, 4 * c + 2, 4 * c + 3] for c in range(4)], np.intp)


def _reordered_words(packed) -> np.ndarray:
    """(n, K/2) packed codes of one matrix -> (n, K/8) uint32: decode_words of the codes in K_ORDER,
    by table (a tenth of the time of unpacking, reordering and decode_words; equal bit for bit,
    tests/test_w4a8_gemm.py)."""
    n, half = packed.shape
    steps = packed.reshape(n, half // 16, 16)
    words = WORD_OF_BYTE[0][steps[..., SOURCE_BYTES[:, 0]]]
    for m in range(1, 4):
        words |= WORD_OF_BYTE[m][steps[..., SOURCE_BYTES[:, m]]]
    return words.reshape(n, half // 4)


def prepare_w4a8_weights(packed, scales, p=None, rows=None) -> W4A8Weights:
    """NVFP4 weights (packed (E, N, K/2), scales (E, N, K/16), lab/nvfp4.py's layout) -> the
    kernel's layout. ``p``: None (lab/w4a8.py choose_p per expert) or (E,) integers, each at
    least the chosen one (a smaller p lets weights exceed 448: ValueError naming p). A per-row p
    is not supported by this kernel. ``rows``: a permutation of N the prepared rows take (row r
    of the result is row rows[r] of the input; paired_rows for the fused epilogue), applied one
    expert at a time, so no permuted copy of the whole tensor is made (an expert's p does not
    depend on its row order). Experts are converted on the host's cores, each with its own
    temporaries."""
    packed, scales = np.asarray(packed), np.asarray(scales)
    e, n, k = _check_nvfp4(packed, scales)
    if rows is not None:
        rows = np.asarray(rows)
        if rows.shape != (n,) or rows.dtype.kind not in "iu" or not np.array_equal(np.sort(rows), np.arange(n)):
            raise ValueError(f"rows: expected a permutation of range({n}) (N of the weights), got shape "
                             f"{rows.shape} dtype {rows.dtype}")
    w4a8._check_weights(packed, scales)  # scale codes 0x00..0x7E
    smallest = w4a8.choose_p(packed, scales)
    if p is None:
        p = smallest
    else:
        p = np.asarray(p)
        if p.dtype.kind not in "iu":
            raise ValueError(f"p must hold integers, got dtype {p.dtype}")
        if p.shape != (e,):
            raise ValueError(f"p must have shape ({e},) (one per expert; this kernel takes no per-row p), "
                             f"got {p.shape}")
        low = np.flatnonzero(p < smallest)
        if low.size:
            i = int(low[0])
            raise ValueError(f"p={int(p[i])} lets weights of expert {i} exceed 448; that expert needs p >= "
                             f"{int(smallest[i])}")
    p = p.astype(np.int32)
    nb, ks, groups = n // ROWS, k // STEP_K, -(-k // GROUP_K)
    words = np.empty((e, nb, ks, THREADS, 2), np.uint32)
    prepared_scales = np.zeros((e, nb, groups, ROWS, 8), np.uint8)

    def convert(i: int) -> None:
        wd = _reordered_words(packed[i] if rows is None else packed[i][rows])  # (n, k/8): word 4s + c of row n
        # row n = 64b + 16w + 8h + g, thread 32w + 4g + c
        words[i] = wd.reshape(nb, 4, 2, 8, ks, 4).transpose(0, 4, 1, 3, 5, 2).reshape(nb, ks, THREADS, 2)
        padded = np.zeros((n, groups * 8), np.uint8)
        padded[:, : k // 16] = scales[i] if rows is None else scales[i][rows]
        prepared_scales[i] = padded.reshape(nb, ROWS, groups, 8).transpose(0, 2, 1, 3)

    # experts on the host's cores: NumPy's gathers and copies release the GIL, and each expert
    # writes only its own slices
    with ThreadPoolExecutor(max_workers=max(1, min(e, os.cpu_count() or 1, 16))) as pool:
        list(pool.map(convert, range(e)))
    distinct, table_of = np.unique(p, return_inverse=True)
    tables = np.stack([w4a8.magnitude_table(int(q)) for q in distinct])
    return W4A8Weights(words, prepared_scales, tables, table_of.astype(np.int32).reshape(e), p, e, n, k)


def random_prepared(cp, rng, experts: int, n: int, k: int) -> W4A8Weights:
    """Prepared weights of the kernel's layout drawn at random, on the device, for studies and
    profiles that time the kernels: random codes and signs, block scale codes 0x28..0x48, p = 0.
    A kernel's time does not depend on the values, and converting a real layer costs minutes of
    CPU. Not a layer: the words and scales are nobody's NVFP4 weights."""
    for label, v in (("experts", experts), ("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{label}: expected a positive int, got {v!r}")
    if n % ROWS or k % ROWS:
        raise ValueError(f"n, k: expected multiples of {ROWS}, got n={n}, k={k}")
    groups = -(-k // GROUP_K)
    words = cp.asarray(rng.integers(0, 2**32, (experts, n // ROWS, k // STEP_K, THREADS, 2), np.uint32))
    scales = cp.asarray(rng.integers(0x28, 0x49, (experts, n // ROWS, groups, ROWS, 8), np.uint8))
    tables = cp.asarray(w4a8.magnitude_table(0)[None])
    zeros = cp.zeros(experts, cp.int32)
    return W4A8Weights(words, scales, tables, zeros, zeros, experts, n, k)


def random_act(cp, rng, rows: int, k: int):
    """(x8, s_x) on the device for random_prepared's studies: finite e4m3 codes (0x7F and 0xFF,
    the NaNs, left out) and scales in [0.5, 2)."""
    x8 = rng.integers(0, 0x7F, (rows, k), np.uint8) | (rng.integers(0, 2, (rows, k), np.uint8) << 7)
    s_x = rng.uniform(0.5, 2.0, (rows, -(-k // GROUP_K))).astype(np.float32)
    return cp.asarray(x8), cp.asarray(s_x)


def paired_rows(intermediate: int) -> np.ndarray:
    """(2I,) row order of w13 for the fused epilogue: prepared row 64b + 16w + 8h + g is original
    row h I + 32b + 8w + g (gate i = 32b + 8w + g for h = 0, its up row for h = 1), so each thread
    of CTA b holds the gate and up sums of the same column i (w4a8_gemm.cu's SwiGLU epilogue).
    I must be a multiple of 128: a group of I is four whole CTAs."""
    i = int(intermediate)
    if i <= 0 or i % GROUP_K:
        raise ValueError(f"intermediate: I={i} must be a positive multiple of {GROUP_K} for the fused W4A8 "
                         f"epilogue (a 128-column group of I is a cluster of {CLUSTER} CTAs)")
    b, w, h, g = np.meshgrid(np.arange(i // 32), np.arange(4), np.arange(2), np.arange(8), indexing="ij")
    return (h * i + 32 * b + 8 * w + g).reshape(-1)


def undecode_words(words) -> np.ndarray:
    """Inverse of lab/w4a8.py decode_words: (..., K/8) uint32 -> (..., K/2) packed uint8."""
    words = np.asarray(words).astype(np.uint32)
    sign_bit = np.array([7, 15, 23, 31, 3, 11, 19, 27], np.uint32)
    j = np.arange(8, dtype=np.uint32)
    nib = ((words[..., None] >> (4 * j)) & 7) | (((words[..., None] >> sign_bit) & 1) << 3)
    return nvfp4.pack_nibbles(nib.astype(np.uint8).reshape(*words.shape[:-1], -1))


def unprepare_w4a8_weights(prep: W4A8Weights) -> tuple[np.ndarray, np.ndarray]:
    """W4A8Weights -> (packed (E, N, K/2), scales (E, N, K/16)), the inverse of preparation."""
    prep = prep.to_host()
    e, n, k = prep.experts, prep.n, prep.k
    nb, ks = n // ROWS, k // STEP_K
    wd = prep.words.reshape(e, nb, ks, 4, 8, 4, 2).transpose(0, 1, 3, 6, 4, 2, 5).reshape(e, n, k // 8)
    nib = nvfp4.unpack_nibbles(undecode_words(wd)).reshape(e, n, ks, STEP_K)[..., K_UNORDER].reshape(e, n, k)
    scales = prep.scales.transpose(0, 1, 3, 2, 4).reshape(e, n, -1)[..., : k // 16]
    return nvfp4.pack_nibbles(nib), np.ascontiguousarray(scales)


# ---------------------------------------------------------------------------------------------
# compilation
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _module(name: str, expressions: tuple[str, ...], tree=jit.KERNEL_DIR):
    """The module of `expressions` from source `name` of `tree` (lab/kernels, or the tree that
    jit.use_tree names: one module per tree, for same-process A/Bs of kernel edits)."""
    import cupy as cp

    # decode_fp8.cuh includes <cstdint> for its host build; NVRTC has no C++ standard library,
    # and on the device the header's types come from ptx.cuh (included before it).
    code = jit.source(name, tree).replace("#include <cstdint>\n", "")
    return cp.RawModule(code=code, options=jit.ARCH_OPTIONS, name_expressions=expressions)


def _shipped_or_study(expressions: tuple[str, ...], stages, expression_of):
    """A GEMM kernel: at the shipped depth (stages None) from its family's module `expressions`,
    else (a study's depth or form) compiled in a module of its own. expression_of(stages) names it."""
    expr = expression_of(stages)
    if stages is None and expr in expressions:
        return _kernel(GEMM_SOURCE, expressions, expr)
    return _kernel(GEMM_SOURCE, (expr,), expr)


def _kernel(name: str, expressions: tuple[str, ...], expression: str):
    from lab.gpu import require_gpu

    require_gpu(f"compiling {expression}")
    return _module(name, expressions, jit.current_tree()).get_function(expression)


# ---------------------------------------------------------------------------------------------
# the GEMM
# ---------------------------------------------------------------------------------------------


def _host(a, what: str) -> np.ndarray:
    if isinstance(a, np.ndarray) or np.isscalar(a) or isinstance(a, (list, tuple)):
        return np.asarray(a)
    if hasattr(a, "get"):
        return a.get()
    raise ValueError(f"{what}: expected a NumPy or CuPy array, got {type(a).__name__}")


def _check_device_array(cp, name, a, shape, dtype) -> None:
    if not isinstance(a, cp.ndarray):
        raise ValueError(f"{name}: expected a CuPy array, got {type(a).__name__}")
    if tuple(a.shape) != tuple(shape) or a.dtype != np.dtype(dtype):
        raise ValueError(f"{name}: expected {tuple(shape)} {np.dtype(dtype).name}, got {tuple(a.shape)} {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")


def check_gemm_args(prep: W4A8Weights, x8, s_x, offsets, alpha, out=None) -> tuple[np.ndarray, np.ndarray]:
    """Every check of a launch, before any work on the device: one ValueError naming the first
    bad argument. Returns the host offsets (int64) and alpha (float32)."""
    if not isinstance(prep, W4A8Weights):
        raise ValueError(f"prep: expected W4A8Weights from prepare_w4a8_weights, got {type(prep).__name__}")
    if prep.n % ROWS or prep.k % 64:
        raise ValueError(f"prep: N={prep.n} and K={prep.k} must be multiples of {ROWS} and 64")
    if not 1 <= prep.experts < 65536:
        raise ValueError(f"prep: {prep.experts} experts; the grid takes 1 to 65535")
    if not prep.on_device:
        raise ValueError("prep: the weights are on the host; call prep.to_device() once")
    from lab.gpu import require_gpu

    cp = require_gpu("the W4A8 GEMM")
    e, n, k = prep.experts, prep.n, prep.k
    g = -(-k // GROUP_K)
    for name, a, shape, dtype in (("prep.words", prep.words, (e, n // ROWS, k // STEP_K, THREADS, 2), np.uint32),
                                  ("prep.scales", prep.scales, (e, n // ROWS, g, ROWS, 8), np.uint8),
                                  ("prep.table_of", prep.table_of, (e,), np.int32),
                                  ("prep.p", prep.p, (e,), np.int32)):
        _check_device_array(cp, name, a, shape, dtype)
    if prep.tables.ndim != 3 or tuple(prep.tables.shape[1:]) != (128, 8):
        raise ValueError(f"prep.tables: expected (P, 128, 8), got {tuple(prep.tables.shape)}")
    _check_device_array(cp, "prep.tables", prep.tables, prep.tables.shape, np.uint8)
    if not isinstance(x8, cp.ndarray) or x8.ndim != 2:
        raise ValueError(f"x8: expected a (rows, {k}) uint8 CuPy array, got {getattr(x8, 'shape', type(x8))}")
    rows = x8.shape[0]
    _check_device_array(cp, "x8", x8, (rows, k), np.uint8)
    if x8.data.ptr % 16:
        raise ValueError("x8: must start on a 16-byte boundary (the kernel copies 16-byte pieces)")
    _check_device_array(cp, "s_x", s_x, (rows, g), np.float32)
    offs = _host(offsets, "offsets")
    if offs.dtype.kind not in "iu" or offs.shape != (e + 1,):
        raise ValueError(f"offsets: expected ({e + 1},) integers, got {offs.shape} {offs.dtype}")
    offs = offs.astype(np.int64)
    if offs[0] != 0 or offs[-1] != rows or (np.diff(offs) < 0).any():
        raise ValueError(f"offsets: must rise monotonically from 0 to rows={rows}, got {offs.tolist()[:8]}...")
    if rows >= 2**31:
        raise ValueError(f"x8: {rows} rows do not fit the kernel's int32 offsets")
    al = _host(alpha, "alpha")
    if al.shape != (e,) or al.dtype != np.float32:
        raise ValueError(f"alpha: expected ({e},) float32, got {al.shape} {al.dtype}")
    try:
        w4a8.epilogue_factor(_host(prep.p, "prep.p"), al)
    except ValueError as err:
        raise ValueError(f"alpha: {err}") from None
    if out is not None:
        _check_device_array(cp, "out", out, (rows, n), np.float32)
    return offs, al


@dataclass(frozen=True)
class GemmPlan:
    """One launch's shape, from the host offsets: the token tile and the grid's height (0: no
    expert has rows, nothing to launch)."""

    tokens: int
    token_blocks: int
    promote: bool = True
    stages: int | None = None  # the ring's depth; None: the shipped one (the depth study sets it)
    warpgroups: int = 1  # 2: the two-warpgroup CTA (128 weight rows a CTA; needs N % 128 == 0)
    smem_a: bool = False  # the two-warpgroup CTA with the decoded weights in shared memory (w4a8_gemm_ss)
    resident: bool = False  # the one-warpgroup CTA with the activations resident (w4a8_gemm_res)
    image: bool = False  # the two-warpgroup CTA fed from an activation image (w4a8_gemm_image)
    ahead: bool = False  # (image) its form with the decode one group ahead, a producer warpgroup
    bf16_out: bool = False  # (image) the output written as bf16 bits (uint16) by the epilogue
    sub: int = 0  # (image, ahead) each group's wgmmas in batches of this many tokens (0: the whole tile)
    split: bool = False  # (image) the split-roles CTA: a decoder warpgroup, A from shared memory (w4a8_gemm_split)


def gemm_plan(offsets, tokens: int | None = None, token_blocks: int | None = None, warpgroups: int = 1) -> GemmPlan:
    """The launch shape for host offsets (E+1,): `tokens` forces the token tile (one of
    TOKEN_TILES; by default token_tile's, the one that issues least over the experts' blocks);
    `token_blocks` the grid's height (default: one token tile per CTA for the largest expert);
    `warpgroups` 2 asks for the two-warpgroup CTA (a tile of WIDE_TILES)."""
    if not isinstance(warpgroups, (int, np.integer)) or isinstance(warpgroups, bool) or warpgroups not in (1, 2):
        raise ValueError(f"warpgroups: expected 1 or 2, got {warpgroups!r}")
    if tokens is not None:
        gemm_expression(tokens)  # names the argument when it is not a tile
        if warpgroups == 2:
            wide_expression(tokens)
    if token_blocks is not None and not (isinstance(token_blocks, (int, np.integer)) and 1 <= token_blocks < 65536):
        raise ValueError(f"token_blocks: expected an int from 1 to 65535, got {token_blocks!r}")
    counts = np.diff(np.asarray(offsets, np.int64))
    max_count = int(counts.max(initial=0))
    if max_count == 0:
        return GemmPlan(tokens or TOKEN_TILES[0], 0, warpgroups=warpgroups)
    t = token_tile(counts) if tokens is None else tokens
    if warpgroups == 2:
        wide_expression(t)
    return GemmPlan(t, min(-(-max_count // t), 65535) if token_blocks is None else int(token_blocks),
                    warpgroups=warpgroups)


def plan_w4a8_gemm(prep: W4A8Weights, x8, s_x, offsets, alpha, out, tokens: int | None = None,
                   token_blocks: int | None = None, warpgroups: int | None = None) -> GemmPlan:
    """check_gemm_args and gemm_plan: everything launch_w4a8_gemm leaves to its caller, for
    these arguments (host or device offsets and alpha: their values are what is checked).
    warpgroups None: wide_warpgroups for the plan's tile and N."""
    offs, _ = check_gemm_args(prep, x8, s_x, offsets, alpha, out)
    return _plan(prep, offs, tokens, token_blocks, warpgroups)


def _plan(prep: W4A8Weights, offs, tokens, token_blocks, warpgroups, image: bool = True) -> GemmPlan:
    """The default plan where warpgroups is None (the activation-image kernel where
    image_by_default takes it, unless `image` is False: a launch that has no image form)."""
    if warpgroups is None:
        # an image-only tile (192) plans as the largest ring tile, then takes its own
        image_only = image and tokens is not None and tokens not in TOKEN_TILES and tokens in IMAGE_AHEAD_TILES
        plan = gemm_plan(offs, TOKEN_TILES[-1] if image_only else tokens, token_blocks)
        plan = replace(plan, warpgroups=wide_warpgroups(plan.tokens, prep.n))
        plan = replace(plan, resident=resident_by_default(plan, prep.k))
        if not image:
            return plan
        plan = image_by_default(plan, prep, np.diff(np.asarray(offs, np.int64)), tokens, token_blocks)
        if image_only and not plan.image:
            raise ValueError(f"tokens: {tokens} is a tile of the activation-image kernel only, which takes N a "
                             f"multiple of {2 * ROWS} and K of {IMAGE_K}, got N={prep.n}, K={prep.k}")
        return plan
    _check_warpgroups(prep, warpgroups)
    return gemm_plan(offs, tokens, token_blocks, warpgroups)


def _check_image(plan: GemmPlan, prep: W4A8Weights, x8, image) -> None:
    """What an image plan needs beyond plan_w4a8_gemm's checks: the two-warpgroup CTA, promoted,
    N % 128 == 0, K % 512 == 0, and a workspace of the plan's tile sized for x8's rows."""
    if plan.warpgroups != 2 or not plan.promote or plan.smem_a or plan.resident:
        raise ValueError("plan: the activation-image kernel is the two-warpgroup CTA, promoted")
    if plan.split:
        if plan.ahead or plan.sub or plan.stages is not None:
            raise ValueError("plan: the split-roles kernel has its own batches and ring (no `ahead`, `sub` or `stages`)")
        split_expression(plan.tokens, plan.bf16_out)
    else:
        image_expression(plan.tokens, plan.stages, plan.ahead, plan.bf16_out, plan.sub)
    if prep.n % (2 * ROWS) or prep.k % IMAGE_K:
        raise ValueError(f"plan: the activation-image kernel takes N a multiple of {2 * ROWS} and K a multiple of "
                         f"{IMAGE_K}, got N={prep.n}, K={prep.k}")
    if not isinstance(image, W4A8Image) or image.tokens != plan.tokens:
        raise ValueError(f"image: expected the W4A8Image image_workspace allocates for a {plan.tokens}-token image "
                         f"plan, got {type(image).__name__}")
    n = image_rows(x8.shape[0], prep.experts, plan.tokens)
    if tuple(image.x.shape) != (n, prep.k) or tuple(image.sx.shape) != (n, prep.k // GROUP_K):
        raise ValueError(f"image: expected x ({n}, {prep.k}) and sx ({n}, {prep.k // GROUP_K}) for {x8.shape[0]} rows, "
                         f"got {tuple(image.x.shape)} and {tuple(image.sx.shape)}")


def launch_x_image(plan: GemmPlan, prep: W4A8Weights, x8, s_x, offsets, image: W4A8Image, stream) -> None:
    """The pre-pass of an image plan alone (w4a8_gemm.cu w4a8_x_image): x8 and s_x written into
    `image` as the plan's launches read it, on `stream`, with no checks (the plan's)."""
    if plan.token_blocks == 0:
        return
    pre = _kernel(GEMM_SOURCE, IMAGE_EXPRESSIONS, x_image_expression(plan.tokens))
    pieces = plan.tokens * (prep.k // STEP_K)
    with stream:
        pre((-(-pieces // 256), plan.token_blocks, prep.experts), (256,),
            (x8, s_x, offsets, image.x, image.sx, np.int32(prep.k)))


def _launch_image(fn, plan: GemmPlan, prep: W4A8Weights, x8, s_x, offsets, image: W4A8Image, stream,
                  write_image: bool, args: tuple) -> None:
    """An image kernel's launch (plain or fused): its ring's shared memory, the pre-pass unless
    the caller wrote the image, then the grid (128-row blocks of N, token blocks, experts) of
    288 threads, 384 for the decode-ahead form's producer warpgroup, or SPLIT_THREADS."""
    smem = split_smem_bytes(plan.tokens) if plan.split else image_smem_bytes(plan.tokens, plan.stages)
    if fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    if write_image:
        launch_x_image(plan, prep, x8, s_x, offsets, image, stream)
    with stream:
        threads = SPLIT_THREADS if plan.split else 3 * THREADS if plan.ahead else 2 * THREADS + 32
        fn((prep.n // (2 * ROWS), plan.token_blocks, prep.experts), (threads,), args, shared_mem=smem)


def _check_bf16_out(prep: W4A8Weights, x8, out, nonfinite) -> None:
    """A bf16_out launch's output and counter: shapes, dtypes and layout only (no device reads)."""
    for name, a, shape, dtype in (("out", out, (x8.shape[0], prep.n), np.uint16),
                                  ("nonfinite", nonfinite, (1,), np.uint32)):
        if tuple(getattr(a, "shape", ())) != shape or getattr(a, "dtype", None) != np.dtype(dtype):
            raise ValueError(f"{name}: a bf16_out launch expected {shape} {np.dtype(dtype).name}, got "
                             f"{getattr(a, 'shape', type(a).__name__)} {getattr(a, 'dtype', '')}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous")


def _check_warpgroups(prep: W4A8Weights, warpgroups: int) -> None:
    if warpgroups == 2 and prep.n % (2 * ROWS):
        raise ValueError(f"warpgroups: the two-warpgroup CTA takes N a multiple of {2 * ROWS}, got N={prep.n}")


def launch_w4a8_gemm(plan: GemmPlan, prep: W4A8Weights, x8, s_x, offsets, alpha, out, stream,
                     image: W4A8Image | None = None, nonfinite=None, write_image: bool = True) -> None:
    """One launch on `stream` with no host reads and no allocation (graph-capturable): offsets
    (E+1,) int32 and alpha (E,) float32 on the device, holding the values plan_w4a8_gemm
    checked, with the same prep, x8, s_x and out. An image plan (GemmPlan.image) also takes the
    workspace image_workspace allocated for it, and launches the pre-pass that fills it first
    (launch_x_image), unless `write_image` is False: the caller wrote it from these x8 and s_x
    already. A bf16_out plan writes `out` as (rows, N) uint16 bf16 bits and adds the number of
    non-finite values it wrote to `nonfinite` ((1,) uint32)."""
    if plan.image:
        _check_image(plan, prep, x8, image)
    elif plan.ahead or plan.bf16_out or plan.sub or plan.split:
        raise ValueError("plan: `ahead`, `bf16_out`, `sub` and `split` are forms of the activation-image kernel "
                         "(GemmPlan.image)")
    if plan.bf16_out:
        _check_bf16_out(prep, x8, out, nonfinite)
    if plan.token_blocks == 0:
        return
    w, smem = plan.warpgroups, 0
    if plan.image:
        if plan.split:
            fn = _kernel(GEMM_SOURCE, SPLIT_EXPRESSIONS, split_expression(plan.tokens, plan.bf16_out))
        else:
            fn = _shipped_or_study(IMAGE_EXPRESSIONS, plan.stages,
                                   lambda s: image_expression(plan.tokens, s, plan.ahead, plan.bf16_out, plan.sub))
        _launch_image(fn, plan, prep, x8, s_x, offsets, image, stream, write_image,
                      (prep.words, prep.scales, prep.tables, prep.table_of, prep.p, alpha, image.x, image.sx, offsets,
                       out, np.int32(prep.n), np.int32(prep.k), nonfinite if plan.bf16_out else np.uint64(0)))
        return
    if plan.smem_a and (w != 2 or plan.stages is not None or not plan.promote):
        raise ValueError("plan: the shared-memory-A kernel is the two-warpgroup CTA at its shipped depth, promoted")
    if plan.resident and (w != 1 or plan.stages is not None or not plan.promote or plan.smem_a):
        raise ValueError("plan: the resident-activation kernel is the one-warpgroup CTA at its shipped depth, promoted")
    if plan.resident:
        if prep.k % GROUP_K:
            raise ValueError(f"plan: the resident-activation kernel takes K a multiple of {GROUP_K}, got K={prep.k}")
        smem = res_smem_bytes(plan.tokens, prep.k)
        if smem > RES_MAX_SMEM:
            raise ValueError(f"plan: the resident-activation kernel holds T x K = {plan.tokens} x {prep.k} activation "
                             f"bytes, {smem} bytes of shared memory with its ring; at most {RES_MAX_SMEM}")
        fn = _kernel(GEMM_SOURCE, RES_EXPRESSIONS, res_expression(plan.tokens))
        if fn.max_dynamic_shared_size_bytes < smem:
            fn.max_dynamic_shared_size_bytes = smem
    elif plan.smem_a:
        smem = ss_smem_bytes(plan.tokens)
        fn = _kernel(GEMM_SOURCE, SS_EXPRESSIONS, ss_expression(plan.tokens))
        if fn.max_dynamic_shared_size_bytes < smem:
            fn.max_dynamic_shared_size_bytes = smem
    elif w == 2:
        if not plan.promote:
            raise ValueError("plan: the two-warpgroup CTA is promoted only")
        smem = wide_ring_bytes(plan.tokens, plan.stages)
        fn = _shipped_or_study(WIDE_EXPRESSIONS, plan.stages, lambda s: wide_expression(plan.tokens, s))
        if smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:
            fn.max_dynamic_shared_size_bytes = smem
    else:
        fn = _shipped_or_study(GEMM_EXPRESSIONS if plan.promote else UNPROMOTED_EXPRESSIONS, plan.stages,
                               lambda s: gemm_expression(plan.tokens, plan.promote, s))
    with stream:
        fn((prep.n // (w * ROWS), plan.token_blocks, prep.experts), (w * THREADS,),
           (prep.words, prep.scales, prep.tables, prep.table_of, prep.p, alpha, x8, s_x, offsets, out,
            np.int32(prep.n), np.int32(prep.k)), shared_mem=smem)


def w4a8_gemm(prep: W4A8Weights, x8, s_x, offsets, alpha, out=None, stream=None, tokens: int | None = None,
              token_blocks: int | None = None, promote: bool = True, warpgroups: int | None = None,
              smem_a: bool = False, resident: bool = False, image: bool = False, ahead: bool = False,
              bf16_out: bool = False, nonfinite=None, sub: int | None = None, split: bool = False):
    """Launch the W4A8 grouped GEMM on `stream` (a CuPy stream, None for the current one) and
    return `out` (allocated on that stream when None). `tokens` forces the token tile (one of
    TOKEN_TILES); by default token_tile's (the one that issues least over the experts' blocks).
    `token_blocks` sets the grid's height (default: one token tile per CTA for the largest
    expert); a CTA takes every token_blocks-th tile of its expert, so any height computes every
    token. promote=False runs the form without promotion (one fp8 accumulator over all of K, the
    row's scale applied at the end), for the accuracy study: it takes one scale per row, every
    column of s_x equal (checked on the host). warpgroups 2 runs the two-warpgroup CTA, 1 the
    one-warpgroup one (the same bits; 2 needs N a multiple of 128 and a token tile of WIDE_TILES);
    None picks by wide_warpgroups (1 without promotion). smem_a runs the two-warpgroup CTA with the
    decoded weights in shared memory (w4a8_gemm_ss; a tile of SS_TILES, promoted; warpgroups 2).
    resident runs the one-warpgroup CTA with the activations resident in shared memory
    (w4a8_gemm_res; a tile of RES_TILES, promoted, K a multiple of 128; the same bits); with
    warpgroups None a plan at 8 tokens runs it anyway where resident_by_default says so. image runs
    the two-warpgroup CTA fed from an activation image (w4a8_gemm_image; a tile of IMAGE_TILES, or
    of IMAGE_AHEAD_TILES with ahead; promoted, N % 128 == 0, K % 512 == 0; the same bits),
    allocating the image here; ahead, its form with the decode one group ahead (image only).
    bf16_out (image only) writes `out` as (rows, N) uint16 bf16 bits from the epilogue (the float32
    output's to_bf16 bits), adding the number of non-finite values to `nonfinite` ((1,) uint32;
    allocated, zero, when None). `sub` (image, ahead)
    issues each group's wgmmas in batches of IMAGE_SUB tokens (image_sub; tokens=192 takes that form
    only). `split` (image) runs the split-roles CTA (w4a8_gemm_split: a decoder warpgroup writes the
    weights into shared memory; a tile of SPLIT_TILES, 192 by default; the same bits)."""
    if split and (not image or ahead or sub is not None):
        raise ValueError("split: the split-roles kernel is a form of the activation-image kernel (image=True), "
                         "with its own batches (no ahead, no sub)")
    if sub is not None and not (image and ahead):
        raise ValueError("sub: the wgmma batches are a form of the decode-ahead image kernel (image=True, ahead=True)")
    if ahead and not image:
        raise ValueError("ahead: the decode one group ahead is a form of the activation-image kernel (image=True)")
    if bf16_out and not image:
        raise ValueError("bf16_out: the bf16 output is a form of the activation-image kernel (image=True)")
    offs, al = check_gemm_args(prep, x8, s_x, offsets, alpha, None if bf16_out else out)
    if image and (not promote or smem_a or resident or warpgroups == 1):
        raise ValueError("image: the activation-image kernel is the two-warpgroup CTA, promoted")
    if image and (prep.n % (2 * ROWS) or prep.k % IMAGE_K):
        raise ValueError(f"image: the activation-image kernel takes N a multiple of {2 * ROWS} and K a multiple of "
                         f"{IMAGE_K}, got N={prep.n}, K={prep.k}")
    if warpgroups == 2 and not promote:
        raise ValueError("warpgroups: the two-warpgroup CTA is promoted only (promote=False takes 1)")
    if not promote:
        warpgroups = 1
    if not promote:
        sx = _host(s_x, "s_x")
        if (sx != sx[:, :1]).any():
            bad = int(np.argmax((sx != sx[:, :1]).any(axis=1)))
            raise ValueError(f"s_x: promote=False takes one scale per row (every column equal); row {bad} "
                             f"has {sx[bad, :4].tolist()}...")
    if smem_a and (not promote or warpgroups == 1):
        raise ValueError("smem_a: the shared-memory-A kernel is the two-warpgroup CTA, promoted")
    if resident and (not promote or smem_a or warpgroups == 2):
        raise ValueError("resident: the resident-activation kernel is the one-warpgroup CTA, promoted")
    if resident and prep.k % GROUP_K:
        raise ValueError(f"resident: the resident-activation kernel takes K a multiple of {GROUP_K}, got K={prep.k}")
    if split and tokens is None:
        tokens = SPLIT_TILES[-1]
    if image and tokens is None:
        tokens = least_issue_tile(np.diff(offs), IMAGE_TILES, IMAGE_ISSUE)
    if split:
        split_expression(tokens)  # names the tile it lacks
    elif image:
        image_expression(tokens, ahead=ahead, sub=sub)  # names the tile or batch it lacks
    # (an image-only tile plans as the largest ring tile, then takes its own)
    ring_tokens = min(tokens, TOKEN_TILES[-1]) if image else tokens
    plan = replace(_plan(prep, offs, ring_tokens, token_blocks,
                         2 if smem_a or image else 1 if resident else warpgroups), promote=bool(promote))
    if image:
        blocks = (min(-(-int(np.diff(offs).max(initial=0)) // tokens), 65535) if token_blocks is None
                  else plan.token_blocks)
        plan = replace(plan, tokens=int(tokens), token_blocks=blocks if plan.token_blocks else 0, image=True,
                       ahead=bool(ahead), bf16_out=bool(bf16_out), sub=0 if split else image_sub(tokens, sub),
                       split=bool(split))
    if smem_a:
        ss_expression(plan.tokens)  # names the tile it lacks
        plan = replace(plan, smem_a=True)
    if resident:
        res_expression(plan.tokens)
        plan = replace(plan, resident=True)
    import cupy as cp

    stream = stream if stream is not None else cp.cuda.get_current_stream()
    with stream:
        if out is None:
            out = cp.empty((x8.shape[0], prep.n), cp.uint16 if bf16_out else cp.float32)
        if bf16_out and nonfinite is None:
            nonfinite = cp.zeros(1, cp.uint32)
        if plan.token_blocks == 0:
            return out
        work = image_workspace(plan, prep, x8.shape[0], stream) if plan.image else None
        launch_w4a8_gemm(plan, prep, x8, s_x, cp.asarray(offs.astype(np.int32)), cp.asarray(al), out, stream, work,
                         nonfinite)
    return out


# ---------------------------------------------------------------------------------------------
# the activation quantizer
# ---------------------------------------------------------------------------------------------


def check_quantize_args(x, x8, s_x, nonfinite) -> tuple[int, int]:
    """Shapes, dtypes and contiguity of quantize_act_gpu's arguments; returns (rows, K)."""
    from lab.gpu import require_gpu

    cp = require_gpu("the W4A8 activation quantizer")
    if not isinstance(x, cp.ndarray) or x.ndim != 2 or x.dtype not in (np.float32, np.uint16):
        raise ValueError(f"x: expected a (rows, K) float32 or uint16 (bf16 bits) CuPy array, got "
                         f"{getattr(x, 'shape', type(x))} {getattr(x, 'dtype', '')}")
    rows, k = x.shape
    if k % 4 or k == 0:
        raise ValueError(f"x: K={k} must be a positive multiple of 4")
    if not x.flags.c_contiguous:
        raise ValueError("x: must be C-contiguous")
    if x.data.ptr % (16 if x.dtype == np.float32 else 8):
        raise ValueError("x: must start on a 16-byte (float32) or 8-byte (bf16) boundary")
    _check_device_array(cp, "x8", x8, (rows, k), np.uint8)
    _check_device_array(cp, "s_x", s_x, (rows, -(-k // GROUP_K)), np.float32)
    _check_device_array(cp, "nonfinite", nonfinite, (1,), np.uint32)
    if rows * -(-k // GROUP_K) >= 2**31 * ACT_WARPS:
        raise ValueError(f"x: {rows} rows are more than one launch's grid")
    return rows, k


def quantize_act_gpu(x, x8=None, s_x=None, nonfinite=None, stream=None):
    """lab/w4a8.py quantize_act on the GPU, bit for bit: x (rows, K) float32 or uint16 bf16 bits
    -> (x8 (rows, K) uint8, s_x (rows, ceil(K/128)) float32, nonfinite (1,) uint32). Outputs are
    allocated on `stream` when None; the kernel adds the number of non-finite inputs to
    `nonfinite` (zeroed here when allocated), whose codes are NaN (w4a8_act.cu)."""
    from lab.gpu import require_gpu

    cp = require_gpu("the W4A8 activation quantizer")
    stream = stream if stream is not None else cp.cuda.get_current_stream()
    with stream:
        if x8 is None and isinstance(x, cp.ndarray) and x.ndim == 2:
            x8 = cp.empty(x.shape, cp.uint8)
        if s_x is None and isinstance(x, cp.ndarray) and x.ndim == 2:
            s_x = cp.empty((x.shape[0], -(-x.shape[1] // GROUP_K)), cp.float32)
        if nonfinite is None:
            nonfinite = cp.zeros(1, cp.uint32)
    rows, k = check_quantize_args(x, x8, s_x, nonfinite)
    units = rows * -(-k // GROUP_K)
    if units == 0:
        return x8, s_x, nonfinite
    expr = ACT_EXPRESSIONS[0] if x.dtype == np.float32 else ACT_EXPRESSIONS[1]
    fn = _kernel(ACT_SOURCE, ACT_EXPRESSIONS, expr)
    with stream:
        fn((-(-units // ACT_WARPS),), (32 * ACT_WARPS,), (x, np.int32(rows), np.int32(k), x8, s_x, nonfinite))
    return x8, s_x, nonfinite


# ---------------------------------------------------------------------------------------------
# SwiGLU + quantize
# ---------------------------------------------------------------------------------------------


def check_swiglu_args(h, offsets, gate_global, up_global, a8, s_a, nonfinite, a_out=None) -> tuple[int, int, int]:
    """Shapes, dtypes and contiguity of swiglu_quant_gpu's arguments (no device reads); returns
    (rows, I, E)."""
    from lab.gpu import require_gpu

    cp = require_gpu("the W4A8 SwiGLU quantizer")
    if not isinstance(h, cp.ndarray) or h.ndim != 2 or h.dtype != np.float32:
        raise ValueError(f"h: expected a (rows, 2I) float32 CuPy array, got {getattr(h, 'shape', type(h))} "
                         f"{getattr(h, 'dtype', '')}")
    rows, two_i = h.shape
    if two_i % 8 or two_i == 0:
        raise ValueError(f"h: 2I={two_i} must be a positive multiple of 8 (I a multiple of 4)")
    i = two_i // 2
    _check_device_array(cp, "h", h, (rows, two_i), np.float32)
    if h.data.ptr % 16:
        raise ValueError("h: must start on a 16-byte boundary (the kernel loads 16-byte pieces)")
    if not isinstance(offsets, cp.ndarray) or offsets.ndim != 1 or offsets.shape[0] < 2:
        raise ValueError(f"offsets: expected an (E+1,) int32 CuPy array with E >= 1, got "
                         f"{getattr(offsets, 'shape', type(offsets))}")
    e = offsets.shape[0] - 1
    _check_device_array(cp, "offsets", offsets, (e + 1,), np.int32)
    _check_device_array(cp, "gate_global", gate_global, (e,), np.float32)
    _check_device_array(cp, "up_global", up_global, (e,), np.float32)
    _check_device_array(cp, "a8", a8, (rows, i), np.uint8)
    _check_device_array(cp, "s_a", s_a, (rows, -(-i // GROUP_K)), np.float32)
    _check_device_array(cp, "nonfinite", nonfinite, (1,), np.uint32)
    if a_out is not None:
        _check_device_array(cp, "a_out", a_out, (rows, i), np.float32)
    if rows * -(-i // GROUP_K) >= 2**31 * ACT_WARPS:
        raise ValueError(f"h: {rows} rows are more than one launch's grid")
    return rows, i, e


def swiglu_quant_gpu(h, offsets, gate_global, up_global, a8=None, s_a=None, nonfinite=None, a_out=None,
                     stream=None):
    """lab/w4a8.py swiglu_quant on the GPU, bit for bit: h (rows, 2I) float32 grouped by offsets
    (E+1,) int32 (on the device; they must rise from 0 to rows, which the caller checked on the
    host: they are not read back here), gate/up globals (E,) float32 -> (a8 (rows, I) uint8, s_a
    (rows, ceil(I/128)) float32, nonfinite (1,) uint32). Outputs are allocated on `stream` when
    None (nonfinite zeroed then); the kernel adds the number of columns with NaN or Inf in h or a
    to `nonfinite`. `a_out` (rows, I) float32, when given, receives the SwiGLU values."""
    from lab.gpu import require_gpu

    cp = require_gpu("the W4A8 SwiGLU quantizer")
    stream = stream if stream is not None else cp.cuda.get_current_stream()
    with stream:
        if isinstance(h, cp.ndarray) and h.ndim == 2:
            if a8 is None:
                a8 = cp.empty((h.shape[0], h.shape[1] // 2), cp.uint8)
            if s_a is None:
                s_a = cp.empty((h.shape[0], -(-(h.shape[1] // 2) // GROUP_K)), cp.float32)
        if nonfinite is None:
            nonfinite = cp.zeros(1, cp.uint32)
    check_swiglu_args(h, offsets, gate_global, up_global, a8, s_a, nonfinite, a_out)
    launch_swiglu_quant(h, offsets, gate_global, up_global, a8, s_a, nonfinite, stream, a_out)
    return a8, s_a, nonfinite


def launch_swiglu_quant(h, offsets, gate_global, up_global, a8, s_a, nonfinite, stream, a_out=None) -> None:
    """One launch on `stream` with no checks, host reads or allocation, for arguments that
    check_swiglu_args accepted (a layer variant checks them once, in prepare)."""
    rows, i = h.shape[0], h.shape[1] // 2
    units = rows * -(-i // GROUP_K)
    if units == 0:
        return
    fn = _kernel(ACT_SOURCE, ACT_EXPRESSIONS, SWIGLU_EXPRESSION)
    with stream:
        fn((-(-units // ACT_WARPS),), (32 * ACT_WARPS,),
           (h, offsets, np.int32(offsets.shape[0] - 1), np.int32(rows), np.int32(i), gate_global, up_global, a8,
            s_a, a_out if a_out is not None else np.uint64(0), nonfinite))


# ---------------------------------------------------------------------------------------------
# w13 with the SwiGLU + quantize epilogue
# ---------------------------------------------------------------------------------------------


def plan_w4a8_gemm_swiglu(prep: W4A8Weights, x8, s_x, offsets, alpha, gate_global, up_global, a8, s_a,
                          nonfinite, tokens: int | None = None, token_blocks: int | None = None,
                          warpgroups: int | None = None, image: bool = False, ahead: bool = False) -> GemmPlan:
    """Every check of a fused launch (the GEMM's, with no fp32 output, and the act stage's
    shapes), on w13 prepared from paired_rows: ValueError naming the first bad argument. Returns
    the plan launch_w4a8_gemm_swiglu takes (warpgroups as plan_w4a8_gemm's). `image` asks for the
    activation-image kernel with the fused epilogue (w4a8_gemm_image_swiglu; a tile of IMAGE_TILES,
    by default image_by_default's; K % 512 == 0), `ahead` for its decode-ahead form."""
    offs, _ = check_gemm_args(prep, x8, s_x, offsets, alpha)
    if prep.n % (2 * GROUP_K):
        raise ValueError(f"prep: N=2I={prep.n}; the fused epilogue needs I a multiple of {GROUP_K}")
    from lab.gpu import require_gpu

    cp = require_gpu("the fused W4A8 w13")
    rows, i, e = x8.shape[0], prep.n // 2, prep.experts
    _check_device_array(cp, "gate_global", gate_global, (e,), np.float32)
    _check_device_array(cp, "up_global", up_global, (e,), np.float32)
    _check_device_array(cp, "a8", a8, (rows, i), np.uint8)
    _check_device_array(cp, "s_a", s_a, (rows, i // GROUP_K), np.float32)
    _check_device_array(cp, "nonfinite", nonfinite, (1,), np.uint32)
    if image:
        if prep.k % IMAGE_K:
            raise ValueError(f"image: the activation-image kernel takes K a multiple of {IMAGE_K}, got K={prep.k}")
        if tokens is None:
            tokens = least_issue_tile(np.diff(offs), IMAGE_TILES, IMAGE_ISSUE) if ahead else IMAGE_TILES[0]
        image_swiglu_expression(tokens, ahead)
        plan = _plan(prep, offs, tokens, token_blocks, 2)
        return replace(plan, image=True, ahead=bool(ahead))
    if ahead:
        raise ValueError("ahead: the decode one group ahead is a form of the activation-image kernel (image=True)")
    plan = _plan(prep, offs, tokens, token_blocks, warpgroups, image=False)  # (image forms on request only)
    if plan.warpgroups == 2:
        swiglu_wide_expression(plan.tokens)  # names the tile the fused two-warpgroup CTA lacks
    return plan


def launch_w4a8_gemm_swiglu(plan: GemmPlan, prep: W4A8Weights, x8, s_x, offsets, alpha, gate_global, up_global,
                            a8, s_a, nonfinite, stream, image: W4A8Image | None = None,
                            write_image: bool = True) -> None:
    """One fused launch on `stream`, no host reads or allocation, for arguments
    plan_w4a8_gemm_swiglu accepted: a8, s_a as swiglu_quant writes them from the h that
    w4a8_gemm would write with the same weights in original row order; non-finite h or a counted
    into `nonfinite`. An image plan takes its workspace and writes it first as launch_w4a8_gemm
    does (unless `write_image` is False)."""
    if plan.image:
        _check_image(plan, prep, x8, image)
    if plan.token_blocks == 0:
        return
    if plan.image:
        fn = _kernel(GEMM_SOURCE, FUSED_IMAGE_EXPRESSIONS, image_swiglu_expression(plan.tokens, plan.ahead))
        _launch_image(fn, plan, prep, x8, s_x, offsets, image, stream, write_image,
                      (prep.words, prep.scales, prep.tables, prep.table_of, prep.p, alpha, image.x, image.sx, offsets,
                       np.int32(prep.n), np.int32(prep.k), gate_global, up_global, a8, s_a, nonfinite))
        return
    w = plan.warpgroups
    fn = (_kernel(GEMM_SOURCE, FUSED_EXPRESSIONS, swiglu_expression(plan.tokens)) if w == 1 else
          _kernel(GEMM_SOURCE, FUSED_WIDE_EXPRESSIONS, swiglu_wide_expression(plan.tokens)))
    with stream:
        fn((prep.n // (w * ROWS), plan.token_blocks, prep.experts), (w * THREADS,),
           (prep.words, prep.scales, prep.tables, prep.table_of, prep.p, alpha, x8, s_x, offsets,
            np.int32(prep.n), np.int32(prep.k), gate_global, up_global, a8, s_a, nonfinite))


# ---------------------------------------------------------------------------------------------
# the layer in one launch (w4a8-layer)
# ---------------------------------------------------------------------------------------------

LAYER_TILES = (8, 16, 32)  # w4a8_layer's token tiles
LAYER_STAGES = 4  # its ring (w4a8_gemm.cu LayerStages), in dynamic shared memory
LAYER_MAX_EXPERTS = 1024  # its prefix of token blocks sits in 4 KiB of static shared memory
LAYER_CTAS_PER_SM = 2  # __launch_bounds__(256, 2): 128 registers at most


def layer_expression(tokens: int) -> str:
    """The whole layer as one persistent launch (w4a8_gemm.cu w4a8_layer) for a token tile."""
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens not in LAYER_TILES:
        raise ValueError(f"tokens: the layer kernel takes a token tile of {LAYER_TILES}, got {tokens!r}")
    return f"lab_w4a8::w4a8_layer<{tokens}>"


LAYER_EXPRESSIONS = tuple(layer_expression(t) for t in LAYER_TILES)


def layer_tile(counts) -> int:
    """The layer kernel's token tile for the experts' token `counts`: token_tile's choice among
    LAYER_TILES, the tile whose token blocks issue the fewest group-loop instructions by
    GROUP_ISSUE (ties to the larger tile); LAYER_TILES[0] when every count is zero.
    GROUP_ISSUE is the separate kernels' loop, not the layer kernel's own (214 / 206 / 228
    instructions a warp a group at 8 / 16 / 32 tokens), because it ranks the layer's tiles as they
    measure: on an H100 (results/studies/w4a8_layer_tiles_h100.json) at mean 1 (every expert one
    block) 8 tokens are 3% faster than 16, which the layer loop's counts would take, and at mean 8
    (largest expert 18 tokens) 16 tokens are 10% faster than 32, the smallest tile holding it, and
    20% faster than 8."""
    return least_issue_tile(counts, LAYER_TILES)


def layer_ring_bytes(tokens: int) -> int:
    """The dynamic shared memory a layer launch passes: its ring of LAYER_STAGES two-warpgroup stages."""
    return LAYER_STAGES * wide_stage_bytes(tokens)


def layer_units(offsets, tokens: int, hidden: int, intermediate: int) -> tuple[int, int]:
    """(w13 units, w2 units) of a layer launch for host offsets: each expert's token blocks times
    I / 128 groups of I (w13: 256 paired rows each), and times H / 128 row blocks (w2)."""
    counts = np.diff(np.asarray(offsets, np.int64))
    blocks = int((-(-counts // tokens)).sum())
    return blocks * (intermediate // GROUP_K), blocks * (hidden // (2 * ROWS))


@dataclass(frozen=True)
class LayerPlan:
    """One layer launch's shape: the token tile and the persistent grid (0: no expert has rows)."""

    tokens: int
    ctas: int


def plan_w4a8_layer(w13: W4A8Weights, w2: W4A8Weights, x8, s_x, offsets, alpha13, alpha2, gate_global, up_global,
                    a8, s_a, out, nonfinite, sync, tokens: int | None = None) -> LayerPlan:
    """Every check of a layer launch (w13 prepared from paired_rows, w2 as plan_w4a8_gemm takes
    it; both GEMMs' arguments, the act stage's, the bf16 output (rows, H) uint16 and sync (E + 2,)
    int32, which must be zero before the first launch: each launch leaves it zero), before any
    work on the device: ValueError naming the first bad argument. `tokens` forces the tile (one of
    LAYER_TILES; default layer_tile of the experts' counts). The grid is every CTA that fits on the
    device at once, at most one a unit."""
    offs, _ = check_gemm_args(w13, x8, s_x, offsets, alpha13)
    i, h, e = w13.n // 2, w13.k, w13.experts
    if w13.n % (2 * GROUP_K) or h % (2 * ROWS):
        raise ValueError(f"w13: N=2I={w13.n}, K=H={h}; the layer kernel needs I and H multiples of {GROUP_K}")
    if (w2.n, w2.k, w2.experts) != (h, i, e):
        raise ValueError(f"w2: expected N=H={h}, K=I={i} over {e} experts (w13's), got N={w2.n}, K={w2.k} "
                         f"over {w2.experts}")
    if e > LAYER_MAX_EXPERTS:
        raise ValueError(f"w13: {e} experts; the layer kernel takes at most {LAYER_MAX_EXPERTS}")
    from lab.gpu import require_gpu

    cp = require_gpu("the W4A8 layer")
    rows = x8.shape[0]
    _check_device_array(cp, "a8", a8, (rows, i), np.uint8)
    if a8.data.ptr % 16:
        raise ValueError("a8: must start on a 16-byte boundary (w2 copies 16-byte pieces)")
    _check_device_array(cp, "s_a", s_a, (rows, i // GROUP_K), np.float32)
    check_gemm_args(w2, a8, s_a, offs, alpha2)
    _check_device_array(cp, "gate_global", gate_global, (e,), np.float32)
    _check_device_array(cp, "up_global", up_global, (e,), np.float32)
    _check_device_array(cp, "out", out, (rows, h), np.uint16)
    _check_device_array(cp, "nonfinite", nonfinite, (1,), np.uint32)
    _check_device_array(cp, "sync", sync, (e + 2,), np.int32)
    max_count = int(np.diff(offs).max(initial=0))
    t = layer_tile(np.diff(offs)) if tokens is None else tokens
    layer_expression(t)  # names the argument when it is not a tile
    if max_count == 0:
        return LayerPlan(t, 0)
    from lab.kernels.gemm_config import SM_REGS, SM_SMEM, SM_THREADS, SMEM_PER_CTA_RESERVED

    fn = _layer_kernel(t)
    smem = fn.shared_size_bytes + layer_ring_bytes(t)
    by_regs = SM_REGS // (256 * -(-fn.num_regs * 32 // 256) * (2 * THREADS // 32))
    fit = max(1, min(by_regs, SM_SMEM // (smem + SMEM_PER_CTA_RESERVED), SM_THREADS // (2 * THREADS),
                     LAYER_CTAS_PER_SM))
    return LayerPlan(t, min(jit.sm_count() * fit, sum(layer_units(offs, t, h, i))))


def _layer_kernel(tokens: int):
    fn = _kernel(GEMM_SOURCE, LAYER_EXPRESSIONS, layer_expression(tokens))
    smem = layer_ring_bytes(tokens)
    if fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    return fn


def launch_w4a8_layer(plan: LayerPlan, w13: W4A8Weights, w2: W4A8Weights, x8, s_x, offsets, alpha13, alpha2,
                      gate_global, up_global, a8, s_a, out, nonfinite, sync, stream) -> None:
    """One layer launch on `stream`, no host reads or allocation, for arguments plan_w4a8_layer
    accepted (offsets and the alphas on the device): a8 and s_a as w4a8-fused writes them, out the
    bf16 bits of the fp32 output w4a8_gemm would write on them; non-finite h, a or output counted
    into `nonfinite`; sync left zero."""
    if plan.ctas == 0:
        return
    fn = _layer_kernel(plan.tokens)
    e = w13.experts
    with stream:
        fn((plan.ctas,), (2 * THREADS,),
           (w13.words, w13.scales, w13.tables, w13.table_of, w13.p, alpha13,
            w2.words, w2.scales, w2.tables, w2.table_of, w2.p, alpha2,
            x8, s_x, offsets, np.int32(e), np.int32(w13.k), np.int32(w13.n // 2), gate_global, up_global,
            a8, s_a, out, nonfinite, sync), shared_mem=layer_ring_bytes(plan.tokens))
