"""NVFP4 x NVFP4 block-scaled grouped GEMM (source: grouped_gemm.cu).

    out[r, n] = alpha[e] * sum_k (e2m1 x e4m3)(x)[r, k] * (e2m1 x e4m3)(w)[e, n, k]
                for offsets[e] <= r < offsets[e+1]

Shapes and dtypes (all CuPy arrays on the launch's device):
    x_packed   (T, K/2)  uint8   activation codes, even element in the low nibble
    x_scales   (T, K/16) uint8   activation e4m3 block scales (raw bits)
               or, with GemmConfig.act "bf16" (W4A16): x (T, K) uint16 bf16 bits, x_scales None
    offsets    (E+1,)    int32   rows of expert e are offsets[e]:offsets[e+1]; offsets[E] == T
    alpha      (E,)      float32 per-expert factor (activation global x weight global, or what
                                 the caller wants; the globals are not applied otherwise)
    weights    PreparedWeights   from `prepare_weights` (E, N, K) NVFP4 in the kernel's layout
    out        (T, N)    float32 every row of every expert with tokens is written

This module holds the checked launches and the activation image's sizes; the weight format
(`prepare_weights`, `PreparedWeights`) lives in `gemm_weights`, the tile configuration, its sizing
and heuristic (`GemmConfig`, `heuristic`, `gemm_plan`, the shipped tiles) in `gemm_config`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import numpy as np

from lab.kernels import jit, tensor_map
from lab.kernels.gemm_config import ALL_COUNTS, GemmConfig, counts_range, fused_config, resident_ctas
from lab.kernels.gemm_weights import PreparedWeights

SOURCE = "grouped_gemm.cu"


def _check_activation(x_packed, x_scales, offsets, alpha, out, prep: PreparedWeights, optional_out=False,
                      act: str = "nvfp4", bf16_out: bool = False):
    import cupy as cp

    t = x_packed.shape[0] if x_packed.ndim == 2 else -1
    if act == "bf16":  # W4A16: the rows as bf16 bits, no scales
        if x_packed.ndim != 2 or x_packed.dtype != cp.uint16 or x_packed.shape[1] != prep.k:
            raise ValueError(f"x: expected (T, {prep.k}) uint16 (bf16 bits), got {x_packed.shape} {x_packed.dtype}")
        if x_scales is not None:
            raise ValueError("x_scales: bf16 activations have no block scales; pass None")
    else:
        if x_packed.ndim != 2 or x_packed.dtype != cp.uint8 or x_packed.shape[1] * 2 != prep.k:
            raise ValueError(f"x_packed: expected (T, {prep.k // 2}) uint8, got {x_packed.shape} {x_packed.dtype}")
        if x_scales is None or x_scales.shape != (t, prep.k // 16) or x_scales.dtype != cp.uint8:
            got = None if x_scales is None else (x_scales.shape, x_scales.dtype)
            raise ValueError(f"x_scales: expected ({t}, {prep.k // 16}) uint8, got {got}")
    if offsets.shape != (prep.experts + 1,) or offsets.dtype != cp.int32:
        raise ValueError(f"offsets: expected ({prep.experts + 1},) int32, got {offsets.shape} {offsets.dtype}")
    if alpha.shape != (prep.experts,) or alpha.dtype != cp.float32:
        raise ValueError(f"alpha: expected ({prep.experts},) float32, got {alpha.shape} {alpha.dtype}")
    if out is None and optional_out:
        out = x_packed  # nothing to check: the fused epilogue writes elsewhere
    elif out is None or out.shape != (t, prep.n) or out.dtype != (cp.uint16 if bf16_out else cp.float32):
        got = None if out is None else (out.shape, out.dtype)
        want = "uint16 (bf16 bits)" if bf16_out else "float32"
        raise ValueError(f"out: expected ({t}, {prep.n}) {want}, got {got}")
    for name, a in (("x_packed", x_packed), ("x_scales", x_scales), ("out", out)):
        if a is not None and not a.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous")


def grouped_gemm(prep: PreparedWeights, x_packed, x_scales, offsets, alpha, out,
                 cfg: GemmConfig, stream=None, read_only: bool = False, nonfinite=None,
                 counts_in: tuple[int, int] | None = None, sms: int | None = None, prepass: bool | None = None) -> None:
    """Launch the grouped GEMM on `stream` (CuPy stream or None for the current one).

    `cfg` comes from `heuristic` (it needs the host-side token counts, which the caller has when
    it plans a run); offsets are not read back here, so the launch can be graph-captured.
    `read_only` launches the same pipeline without decode, MMA or stores (the achievable rate of
    this access pattern).

    With ``cfg.act == "bf16"`` (W4A16) `x_packed` is the activation rows as bf16 bits, (T, K)
    uint16, and `x_scales` None: the decoders convert them to fp16 as they are (exact for
    magnitudes in [2^-14, 65504] and zeros; the caller keeps |x| below 65504, where fp16
    overflows), and out = alpha[e] * x @ dec(w[e]).T as for NVFP4 activations.

    On an image tile (``cfg.image``) `out` may be (T, N) uint16 instead: the same values as bf16
    bits, rounded as `swiglu_quant.to_bf16` rounds the fp32 ones (bit for bit), and `nonfinite`,
    a (1,) uint32 counter, counts the outputs that are not finite (as to_bf16's counter does).

    `counts_in` = (lo, hi), 1 <= lo <= hi: only the experts with lo..hi tokens are computed (their
    rows of `out`; the others' rows keep what they hold), so that the experts of another size class
    can run another tile in a second launch (split_configs).

    `sms`: launch as many CTAs as fit on that many SMs (None: on every SM). The units are handed
    out by a counter, so any grid computes every unit; a launch on part of the SMs leaves the
    rest to a launch on another stream.

    On the tiles that can (``cfg.builders``: the 128- and 160-token image tiles) the activation
    image is written inside the launch by the producer warpgroup's idle warps, piece by piece as
    the units need it; `prepass` = True writes it with the pre-pass kernel before the launch
    instead, as on the other image tiles (the same bits); None takes `use_prepass`'s setting, and
    where no caller set one, `prepass_by_default` (the pre-pass for a split's larger size class).
    """
    import cupy as cp

    bf16_out = getattr(out, "dtype", None) == cp.uint16
    if bf16_out and not cfg.image:
        raise ValueError(f"out: a bf16 (uint16) output needs an image tile (cfg.image); {cfg} writes float32")
    if bf16_out and read_only:
        raise ValueError("out: the read-only pattern writes nothing; pass the float32 out")
    if bf16_out != (nonfinite is not None):
        raise ValueError("nonfinite: a (1,) uint32 counter exactly when out is bf16 (uint16), "
                         f"got out {getattr(out, 'dtype', None)} and nonfinite {nonfinite!r:.40}")
    if bf16_out and (nonfinite.shape != (1,) or nonfinite.dtype != cp.uint32):
        raise ValueError(f"nonfinite: expected (1,) uint32, got {nonfinite.shape} {nonfinite.dtype}")
    if sms is not None and not (isinstance(sms, (int, np.integer)) and 1 <= sms <= jit.sm_count()):
        raise ValueError(f"sms: expected an int from 1 to the device's SM count, got {sms!r}")
    _launch([(prep, x_packed, x_scales, offsets, alpha, out)], cfg, stream, read_only, nonfinite=nonfinite,
            counts_in=counts_range(counts_in), sms=sms, prepass=prepass)


def grouped_gemm_plan(prep: PreparedWeights, x_packed, x_scales, offsets, alpha, out, plan,
                      stream=None) -> None:
    """The launches of `plan` (gemm_plan's (config, counts_in) pairs) on `stream`: one grouped GEMM
    whose experts are split by size between tiles; each launch writes its experts' rows."""
    if not plan:
        raise ValueError("plan: expected one or more (config, counts_in) pairs, got none")
    for cfg, counts_in in plan:
        grouped_gemm(prep, x_packed, x_scales, offsets, alpha, out, cfg, stream=stream, counts_in=counts_in)


def grouped_gemm_pair(first: tuple, second: tuple, cfg: GemmConfig, stream=None) -> None:
    """Two grouped GEMMs in one launch: `first` and `second` are each (prep, x_packed, x_scales,
    offsets, alpha, out) as for `grouped_gemm`, sharing `cfg` (its block and k_step must divide
    both). The launch does not order them: if `second` reads what `first` writes, it reads a
    stale buffer (that is what the one-launch-2G ceiling measures)."""
    _launch([first, second], cfg, stream, False)


@dataclass
class Fusion:
    """What the fused modes add to a launch (see grouped_gemm.cu, Mode).

    swiglu (problem 0 is w13 prepared with pair_gate_up=True): per-expert gate/up globals (E,)
    float32, the w2 input global, and the NVFP4 output a_packed (T, I/2) / a_scales (T, I/16).
    layer: problem 1 is w2 on a_packed / a_scales and waits per expert; out_bf16 (T, H) uint16
    receives its output (its fp32 `out` may be None). counter (1,) uint32 counts non-finite
    SwiGLU values and bf16 outputs.
    With bf16 activations (GemmConfig.act "bf16", W4A16) a_packed is the bf16 a (T, I) uint16,
    a_scales None and act_global unused; the counter also counts SwiGLU values fp16 cannot hold."""

    gate_global: object
    up_global: object
    act_global: float
    a_packed: object
    a_scales: object
    counter: object
    out_bf16: object = None  # layer only

    @property
    def mode(self) -> str:
        return "layer" if self.out_bf16 is not None else "swiglu"


def _check_fusion(fz: Fusion, w13: PreparedWeights, rows: int, cfg: GemmConfig, w2=None) -> None:
    import cupy as cp

    from lab.kernels import swiglu_quant as sq

    if not w13.pair_gate_up:
        raise ValueError("w13: the fused SwiGLU epilogue needs weights prepared with pair_gate_up=True")
    i = w13.n // 2
    e = w13.experts
    bf16 = cfg.act == "bf16"
    if bf16 and fz.a_scales is not None:
        raise ValueError("a_scales: the bf16 SwiGLU output has no block scales; pass None")
    for name, a, shape, dtype in (("gate_global", fz.gate_global, (e,), cp.float32),
                                  ("up_global", fz.up_global, (e,), cp.float32),
                                  ("a_packed", fz.a_packed, (rows, i) if bf16 else (rows, i // 2),
                                   cp.uint16 if bf16 else cp.uint8),
                                  ("a_scales", None if bf16 else fz.a_scales, (rows, i // 16), cp.uint8),
                                  ("counter", fz.counter, (1,), cp.uint32)):
        if bf16 and name == "a_scales":
            continue
        if tuple(a.shape) != shape or a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected C-contiguous {shape} {cp.dtype(dtype).name}, got {tuple(a.shape)} {a.dtype}")
    if not bf16:
        sq.check_global("act_global", fz.act_global)
    if w2 is not None:
        if (w2.experts, w2.k) != (e, i):
            raise ValueError(f"w2: expected {e} experts with K = I = {i} to follow w13, got {w2.experts} and K={w2.k}")
        if fz.out_bf16 is None or tuple(fz.out_bf16.shape) != (rows, w2.n) or fz.out_bf16.dtype != cp.uint16:
            got = None if fz.out_bf16 is None else (tuple(fz.out_bf16.shape), fz.out_bf16.dtype)
            raise ValueError(f"out_bf16: expected ({rows}, {w2.n}) uint16, got {got}")
        if not fz.out_bf16.flags.c_contiguous or fz.out_bf16.data.ptr % 4:
            # the epilogue warps store two adjacent bf16 values as one 4-byte word
            raise ValueError(f"out_bf16: expected a C-contiguous array at a 4-byte aligned address, got "
                             f"strides {fz.out_bf16.strides} at {fz.out_bf16.data.ptr:#x}")
        # ready[e] counts (w13 block, pass, warp) triples; the largest count must fit an int32
        most = (w13.n // cfg.block_rows) * cfg.warps * -(-rows // cfg.token_tile)
        if most >= 2 ** 31:
            raise ValueError(f"fused layer: {most} readiness signals per expert do not fit the int32 counters")


def swiglu_gemm(w13: PreparedWeights, x_packed, x_scales, offsets, alpha, fusion: Fusion, cfg: GemmConfig,
                stream=None, counts_in: tuple[int, int] | None = None) -> None:
    """The w13 grouped GEMM with SwiGLU + NVFP4 quantize as its epilogue: h never reaches memory;
    writes fusion.a_packed / a_scales exactly as swiglu_quant.swiglu_quant would from h.
    `counts_in` as for grouped_gemm: only those experts' rows of a_q are written."""
    _check_fusion(fusion, w13, x_packed.shape[0] if x_packed.ndim == 2 else -1, cfg)
    if fusion.out_bf16 is not None:
        raise ValueError("swiglu_gemm: out_bf16 belongs to fused_layer")
    _launch([(w13, x_packed, x_scales, offsets, alpha, None)], cfg, stream, False, fusion,
            counts_in=counts_range(counts_in))


def fused_layer(w13: PreparedWeights, x_packed, x_scales, offsets, w13_alpha, w2: PreparedWeights, w2_alpha,
                fusion: Fusion, cfg: GemmConfig, stream=None, counts_in: tuple[int, int] | None = None) -> None:
    """The whole layer in one persistent launch: w13 units with the SwiGLU epilogue, then w2
    units on its a_q, each w2 expert starting once its w13 units are written (per-expert
    counters, release/acquire). Output: fusion.out_bf16 only (no fp32 copy: the w2 passes go
    to the epilogue warps, which write bf16). `counts_in` as for grouped_gemm, for both GEMMs:
    the launch is the layer of those experts."""
    rows = x_packed.shape[0] if x_packed.ndim == 2 else -1
    _check_fusion(fusion, w13, rows, cfg, w2)
    _launch([(w13, x_packed, x_scales, offsets, w13_alpha, None),
             (w2, fusion.a_packed, fusion.a_scales, offsets, w2_alpha, None)], cfg, stream, False, fusion,
            counts_in=counts_range(counts_in))


def _launch(problems: list, cfg: GemmConfig, stream, read_only: bool, fusion: Fusion | None = None,
            nonfinite=None, counts_in: tuple[int, int] = ALL_COUNTS, sms: int | None = None,
            prepass: bool | None = None) -> None:
    import cupy as cp

    if fusion is not None:
        cfg = fused_config(cfg, fusion.mode)
    elif cfg.mode != "plain":
        cfg = replace(cfg, mode="plain")
    for pi, (prep, x_packed, x_scales, offsets, alpha, out) in enumerate(problems):
        fused_out = fusion is not None and (pi == 0 or fusion.mode == "layer")
        _check_activation(x_packed, x_scales, offsets, alpha, out, prep, optional_out=fused_out, act=cfg.act,
                          bf16_out=nonfinite is not None)
        cfg.validate(prep.n, prep.k)
        if (cfg.block_rows, cfg.k_step) != (prep.block_rows, prep.k_step):
            raise ValueError(f"cfg: block {cfg.block_rows} x k_step {cfg.k_step} does not match the weights' "
                             f"layout ({prep.block_rows}, {prep.k_step}); prepare with layout=(block_rows, k_step)")
    if fusion is not None and fusion.mode == "layer" and problems[0][3] is not problems[1][3]:
        raise ValueError("fused layer: w13 and w2 must share one offsets array")
    keep = [pr for pr in problems if pr[1].shape[0] and pr[0].experts]
    if not keep:
        return
    if fusion is not None and len(keep) != len(problems):
        return  # no rows: nothing to compute, and the fused problems come as a whole
    problems = keep
    if len(problems) == 1:  # problem 1 of the kernel: no experts
        prep, x_packed, x_scales, offsets, alpha, out = problems[0]
        problems.append((PreparedWeights(prep.data, 0, prep.n, prep.k, prep.block_rows, prep.k_step),
                         x_packed, x_scales, offsets, alpha, out))
    stream = stream if stream is not None else cp.cuda.get_current_stream()
    if prepass is None:
        prepass = _PREPASS[-1] if _PREPASS[-1] is not None else prepass_by_default(counts_in)
    builders = cfg.builders and not prepass
    if cfg.build_image and not builders:  # (the pre-pass: the 64- or 96-token tile as it ships)
        cfg = replace(cfg, build_image=False)
    images = [_NULL, _NULL]
    if cfg.image:  # the activations as their fp16 image, decoded once for every row block
        sizes = [image_bytes(pr[1].shape[0], pr[0].experts, pr[0].k) if pr[0].experts else 0 for pr in problems]
        with stream:
            space = image_workspace(sum(sizes), stream)  # (both problems' images live at once)
            at = np.cumsum([0] + sizes)
            if builders:  # written by the launch itself (gemm/act_image.cuh, image_builders)
                images = [space[at[i]:at[i + 1]] if sizes[i] else _NULL for i in range(2)]
            else:
                problems = [(prep, activation_image(prep, x_packed, x_scales, offsets, cfg.act, space[at[i]:], counts_in),
                             None, offsets, alpha, out) if prep.experts else (prep, x_packed, x_scales, offsets, alpha, out)
                            for i, (prep, x_packed, x_scales, offsets, alpha, out) in enumerate(problems)]
    experts = sum(pr[0].experts for pr in problems)
    smem = cfg.launch_smem(experts)
    fn = jit.kernel(SOURCE, cfg.expression_for(read_only, counts_in != ALL_COUNTS, bf16_out=nonfinite is not None,
                                               builders=builders), smem)
    units = sum(pr[0].experts * (pr[0].n // cfg.block_rows) for pr in problems)
    grid = (min(units, (sms or jit.sm_count()) * resident_ctas(cfg, experts, fn.num_regs)),)
    args = []
    # problem 1 of a single-problem launch has no experts: problem 0's map stands in for its own
    maps = [tensor_map.device_map(pr[0].data, pr[0].stage_bytes) for pr in problems if pr[0].experts]
    maps += maps[:1] * (2 - len(maps))
    for (prep, x_packed, x_scales, offsets, alpha, out), wmap in zip(problems, maps):
        out = None if nonfinite is not None else out  # (a bf16 out goes in out_bf16)
        args += [wmap, x_packed, _NULL if x_scales is None else x_scales, offsets, alpha, _NULL if out is None else out,
                 np.int32(prep.n), np.int32(prep.k), np.int32(prep.experts)]
    first_out = problems[0][5] if fusion is None else fusion.a_packed
    second_out = problems[1][5] if problems[1][5] is not None else fusion.out_bf16
    with stream:
        sched, ready = _scheduler_state(cp, first_out, problems[0][3], second_out, problems[0][0].experts, counts_in)
        args.append(sched)
        if fusion is None and nonfinite is not None:  # one problem's bf16 output (an image tile)
            args += [_NULL, _NULL, np.float32(1.0), _NULL, _NULL, _NULL, problems[0][5], nonfinite]
        elif fusion is None:
            args += [_NULL, _NULL, np.float32(1.0), _NULL, _NULL, _NULL, _NULL, _NULL]
        else:
            args += [fusion.gate_global, fusion.up_global, np.float32(fusion.act_global), fusion.a_packed,
                     _NULL if fusion.a_scales is None else fusion.a_scales, ready if cfg.mode == "layer" else _NULL,
                     _NULL if fusion.out_bf16 is None else fusion.out_bf16, fusion.counter]
        args += [np.int32(counts_in[0]), np.int32(counts_in[1])]
        if builders:
            pieces = sum(image_pieces(pr[1].shape[0], pr[0].experts, pr[0].k, cfg) for pr in problems if pr[0].experts)
            args += images + [_image_ready(cp, sched, pieces)]
        else:
            args += [_NULL, _NULL, _NULL]
        fn(grid, (cfg.threads,), tuple(args), shared_mem=smem)


_PREPASS: list = [None]  # None: prepass_by_default decides


def prepass_by_default(counts_in: tuple[int, int]) -> bool:
    """Whether a builder tile's launch takes the pre-pass when neither the caller nor `use_prepass`
    says: yes for a split's larger size class (counts_in from above 1), no for a launch over every
    expert. The larger class runs beside the smaller one on a second stream, where the pre-pass is
    out of the way and the launch starts with its image ready; inside the launch its first units
    wait for their pieces, and at mean 8, skew 1.2 (classes 1-16 / 17-max) the plan took 0.615 /
    0.325 ms (w13 / w2) with the pre-pass against 0.630 / 0.335 with builders (ab_kernels --plan, one
    process; notes/gemm-log.md v35). Over every expert the builders win: x0.95 at 128 and 256 tokens
    per expert, x0.97-0.99 at 512, against x1.00 / x1.03 for the pre-pass."""
    return counts_in[0] > 1


@contextlib.contextmanager
def use_prepass(on: bool = True):
    """Launches inside (and graphs captured inside) write the activation image with the pre-pass
    kernel (on) or, on the tiles that can (`GemmConfig.builders`), inside the launch (off), whatever
    `prepass_by_default` would pick: the same bits, for same-process comparisons of the two forms
    (scripts/ab_kernels.py --prepass)."""
    _PREPASS.append(bool(on))
    try:
        yield
    finally:
        _PREPASS.pop()


IMAGE_QB, IMAGE_THREADS = 4, 128  # gemm/act_image.cuh: k16 blocks per thread, threads per block
_WORKSPACES: dict = {}


def image_groups(rows: int, experts: int) -> int:
    """8-token groups per k16 block of the activation image for `rows` >= offsets[E] token rows
    (gemm/act_image.cuh: each expert's groups start at offsets[e] // 8 + e)."""
    return rows // 8 + experts + 1


def image_bytes(rows: int, experts: int, k: int) -> int:
    """Bytes of one problem's activation image: (K/16, groups, 2, 8, 8) fp16."""
    return (k // 16) * image_groups(rows, experts) * 256


def image_pieces(rows: int, experts: int, k: int, cfg: GemmConfig) -> int:
    """At most this many pieces of one problem's image (one per expert, token block and k chunk,
    gemm/act_image.cuh) for `rows` routed rows: the in-kernel image's readiness flags."""
    return (rows // cfg.token_tile + experts) * (k // cfg.k_step)


def image_workspace(nbytes: int, stream=None):
    """A uint8 device buffer of at least `nbytes` for the activation images of launches on
    `stream` (the current one by default). One per (device, stream): launches on one stream run
    in order, so each may overwrite the last one's images; launches on two streams (chunks) get
    two. A larger request allocates a new buffer of twice the size and keeps the old one alive, so
    a graph captured over an earlier launch still finds its bytes (at most twice the largest
    request stays allocated per stream). Allocated on first use, which the runner does before any
    capture."""
    import cupy as cp

    stream = stream if stream is not None else cp.cuda.get_current_stream()
    key = (cp.cuda.Device().id, stream.ptr)
    kept = _WORKSPACES.setdefault(key, [])
    if not kept or kept[-1].size < nbytes:
        size = max(nbytes, 2 * kept[-1].size if kept else 0)
        kept.append(cp.empty(size, dtype=cp.uint8))
    return kept[-1]


def activation_image(prep: PreparedWeights, x_packed, x_scales, offsets, act: str = "nvfp4", out=None,
                     counts_in: tuple[int, int] = ALL_COUNTS):
    """The GEMM's B operand as fp16 core matrices (gemm/act_image.cuh), written on the current
    stream into `out` (uint8, at least image_bytes(rows, E, K); default the stream's workspace):
    (K/16, groups, 2, 8, 8) fp16 as bytes; returns that many bytes of `out`. The kernel reads the
    counts from offsets on the device, so the launch can be graph-captured. Only the experts of
    `counts_in` tokens are written (the groups of the others keep what they hold)."""
    import cupy as cp

    rows, k = x_packed.shape[0], prep.k
    groups = image_groups(rows, prep.experts)
    nbytes = image_bytes(rows, prep.experts, k)
    if out is None:
        out = image_workspace(nbytes)
    if out.dtype != cp.uint8 or out.ndim != 1 or out.size < nbytes:
        raise ValueError(f"out: expected a 1-D uint8 buffer of at least {nbytes} bytes, got {out.shape} {out.dtype}")
    image = out[:nbytes]
    fn = jit.kernel(SOURCE, f"lab_gemm::act_image<lab_gemm::Act::{act}>")
    grid = (-(-groups * 8 // IMAGE_THREADS), k // (16 * IMAGE_QB))
    fn(grid, (IMAGE_THREADS,), (x_packed, _NULL if x_scales is None else x_scales, offsets,
                                np.int32(prep.experts), np.int32(k), image, np.int32(counts_in[0]),
                                np.int32(counts_in[1])))
    return image


_NULL = np.uint64(0)  # a null pointer argument
_SCHED: dict = {}


def _scheduler_state(cp, out, offsets, out1, experts0: int, counts_in: tuple[int, int] = ALL_COUNTS):
    """The kernel's unit counter and per-expert readiness counters, one set per (output, offsets,
    size class): launches that may run at the same time (chunks on two streams, a split's size
    classes on two streams) write different outputs or different classes' rows, so they never
    share counters. The kernel leaves them at zero, so graph replays need no reset. Allocated on
    first use, which the runner does before any capture."""
    key = (cp.cuda.Device().id, out.data.ptr, offsets.data.ptr, None if out1 is None else out1.data.ptr, experts0,
           tuple(counts_in))
    state = _SCHED.get(key)
    if state is None:  # [next unit, CTAs done, next image piece, -]
        state = _SCHED[key] = (cp.zeros(4, dtype=cp.int32), cp.zeros(max(1, experts0), dtype=cp.int32))
    return state


_IMAGE_READY: dict = {}


def _image_ready(cp, sched, pieces: int):
    """The in-kernel image's per-piece flags beside `sched` (the same launches share them, one at a
    time): at least `pieces` int32 zeros; the kernel leaves them at zero. A larger request allocates
    anew and keeps the old buffer alive for graphs captured over it. Allocated on first use, which
    the runner does before any capture."""
    kept = _IMAGE_READY.setdefault(sched.data.ptr, [])
    if not kept or kept[-1].size < pieces:
        kept.append(cp.zeros(max(pieces, 2 * kept[-1].size if kept else 0, 1), dtype=cp.int32))
    return kept[-1]
