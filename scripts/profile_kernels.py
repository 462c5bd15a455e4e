"""Launch each kernel of the w13 stage once, for a profiler to attach to: the plain grouped
GEMM, the GEMM with the fused SwiGLU epilogue, the GEMM's access pattern with no math
(READ_ONLY) and the flat streaming read of as many bytes. Nothing is timed here; Nsight Compute
does that:

    ncu --clock-control none -k regex:"grouped_gemm|stream_read" \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \\
        --metrics smsp__inst_executed.sum,lts__t_requests.sum,lts__t_sectors.sum \\
        python scripts/profile_kernels.py --mean-tokens 8

Each kernel is launched once (its first launch compiles it), in the order above. With
`--skew` the routing is skewed and, where gemm_plan splits w13 by expert size, each of its
launches follows (the small experts' class, then the large one: one kernel each, and an
`act_image` pre-pass before an image tile). With
`--w4a16` the two GEMMs are the W4A16 ones (bf16 activations, the w4a16 and w4a16-fused
variants' w13 launches), after the NVFP4 ones, so one profile compares the two forms; each
`--config` (as bench_gemm takes it) is one more plain w13 launch with that tile.

`--w4a8` launches the W4A8 layer's kernels instead, each once, as its variants launch them: w13
(w4a8), the act stage, w2, the fused w13 (w4a8-fused), the one-launch layer (w4a8-layer, where
the largest expert fits its tiles), then the flat read of w13's weight bytes. With `--split`, w13
runs a second time on the split-roles kernel (its image plan's tile), so one profile compares the
two (shared-memory wavefronts: `l1tex__data_pipe_lsu_wavefronts_mem_shared.sum`). Their weights are
drawn at random in the kernel's layout (w4a8_gemm.random_prepared), so no layer is converted:

    ncu --clock-control none -k regex:"w4a8|swiglu_quant|stream_read" --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section InstructionStats \
        python scripts/profile_kernels.py --w4a8 --mean-tokens 1

From 64 tokens an expert the W4A8 GEMMs are the activation-image kernels (w4a8_gemm_image, and
w4a8_gemm_image_swiglu for the fused w13); the fp8 wgmma pipe and the stall reasons by name (this
ncu takes no regular expression for metrics):

    ncu --clock-control none -k regex:"w4a8_gemm_image" --section SpeedOfLight --section WarpStateStats \
        --metrics sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active,\
smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio \
        python scripts/profile_kernels.py --w4a8 --mean-tokens 512
"""

from __future__ import annotations

import argparse
import sys

from lab.cli import HelpFormatter
from lab.gemm_bench import CONFIG_HELP, config_of, log, parse_config
from lab.gpu import require_gpu, run_script
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg
from lab.kernels.stream_read import stream_read
from lab.layer import load_layer, upload_weights
from lab.models import add_shape_arguments, resolve_shape
from lab.problem import make_routing, random_activations, random_weights, tokens_for_mean
from lab.runner import Runner
from lab.variants.fused_swiglu import fusion_for, paired_w13

TAG = "profile_kernels"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--mean-tokens", type=float, default=8, help="mean tokens per expert of the routed batch")
    add_shape_arguments(ap)
    ap.add_argument("--config", type=parse_config, action="append", default=[],
                    help=CONFIG_HELP + "; each a plain w13 launch after the others (repeat for several)")
    ap.add_argument("--w4a16", action="store_true",
                    help="then the W4A16 w13 kernels (bf16 activations): plain and with the SwiGLU epilogue")
    ap.add_argument("--w4a8", action="store_true",
                    help="the W4A8 kernels instead (w13, act, w2, fused w13, the one-launch layer; random "
                         "prepared weights), then the flat read")
    ap.add_argument("--split", action="store_true",
                    help="with --w4a8: w13 once more on the split-roles kernel (w4a8_gemm_split), where its plan "
                         "is an image plan of a tile that kernel has, right after the default w13")
    ap.add_argument("--skew", type=float, default=0.0, help="routing skew: 0 uniform, else p ~ 1/rank**skew")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights, routing and activations")
    args = ap.parse_args(argv)
    if args.split and not args.w4a8:
        ap.error("--split: a form of the W4A8 w13 (give --w4a8 too)")
    if not args.mean_tokens > 0:
        ap.error(f"--mean-tokens: must be > 0, got {args.mean_tokens}")
    if not args.skew >= 0:
        ap.error(f"--skew: must be >= 0, got {args.skew}")
    problem = resolve_shape(args, ap)

    cp = require_gpu("profile_kernels.py")
    if args.w4a8:
        return profile_w4a8(cp, problem, args)
    log(TAG, "weights")
    weights = upload_weights(random_weights(problem, seed=args.seed))
    routing = make_routing(tokens_for_mean(args.mean_tokens, problem.experts, problem.top_k), problem.experts,
                           problem.top_k, skew=args.skew, seed=args.seed)
    runner = Runner()
    layer = load_layer(runner, weights, routing, random_activations(routing.tokens, problem.hidden, seed=args.seed))
    part, cfg = layer.full, layer.w13_cfg
    fusion = fusion_for(runner, layer, part.gate_global, part.up_global)
    w13_paired = paired_w13(weights)
    cp.cuda.Device().synchronize()
    log(TAG, f"w13 tile {cfg}; fused {gc.fused_config(cfg, 'swiglu')}")
    gg.grouped_gemm(part.w13, part.x_packed, part.x_scales, part.offsets, part.w13_alpha, part.h, cfg)
    gg.swiglu_gemm(w13_paired, part.x_packed, part.x_scales, part.offsets, part.w13_alpha, fusion, cfg)
    gg.grouped_gemm(part.w13, part.x_packed, part.x_scales, part.offsets, part.w13_alpha, part.h, cfg,
                    read_only=True)
    if len(layer.w13_plan) > 1:
        for tile, counts_in in layer.w13_plan:
            log(TAG, f"w13 plan: {tile} on experts of {counts_in[0]}..{counts_in[1]} tokens")
            gg.grouped_gemm(part.w13, part.x_packed, part.x_scales, part.offsets, part.w13_alpha, part.h, tile,
                            counts_in=counts_in)
    if args.w4a16:
        from lab.variants.w4a16 import bf16_operands

        x, a, ones, _, cfg16, _ = bf16_operands(runner, layer)
        fusion16 = gg.Fusion(weights.gate_global, weights.up_global, 1.0, a, None, runner.counter)
        cp.cuda.Device().synchronize()
        log(TAG, f"W4A16 w13 tile {cfg16}; fused {gc.fused_config(cfg16, 'swiglu')}")
        gg.grouped_gemm(part.w13, x, None, part.offsets, ones, part.h, cfg16)
        gg.swiglu_gemm(w13_paired, x, None, part.offsets, ones, fusion16, cfg16)
    for values in args.config:
        tile = config_of(values, cfg).validate(part.w13.n, part.w13.k)
        prep = gw.prepare_weights(weights.host.w13_packed, weights.host.w13_scales, xp=cp,
                                  layout=(tile.block_rows, tile.k_step))
        log(TAG, f"--config {values}: {tile}")
        gg.grouped_gemm(prep, part.x_packed, part.x_scales, part.offsets, part.w13_alpha, part.h, tile)
        del prep
    flat = cp.empty(part.w13.data.nbytes // 16 * 16, dtype=cp.uint8)
    stream_read(flat, cp.zeros(1, dtype=cp.uint32))
    cp.cuda.Device().synchronize()
    log(TAG, "done")
    return 0


def profile_w4a8(cp, problem, args) -> int:
    """The W4A8 kernels once each, on random prepared weights and activations (module docstring)."""
    from dataclasses import replace

    import numpy as np

    from lab.kernels import w4a8_gemm as wg

    e, h, i = problem.experts, problem.hidden, problem.intermediate
    if h % (2 * wg.ROWS) or i % wg.GROUP_K:
        raise ValueError(f"--w4a8: H and I must be multiples of {wg.GROUP_K} (the fused and layer kernels), "
                         f"got H={h}, I={i}")
    routing = make_routing(tokens_for_mean(args.mean_tokens, e, problem.top_k), e, problem.top_k,
                           skew=args.skew, seed=args.seed)
    offs = routing.offsets.astype(np.int32)
    rows = int(offs[-1])
    rng = np.random.default_rng(args.seed)
    log(TAG, "W4A8 weights (random, in the kernel's layout)")
    w13, w2 = wg.random_prepared(cp, rng, e, 2 * i, h), wg.random_prepared(cp, rng, e, h, i)
    x8, s_x = wg.random_act(cp, rng, rows, h)
    d_offs = cp.asarray(offs)
    ones = cp.ones(e, cp.float32)
    glob = cp.asarray(rng.uniform(0.5, 2.0, e).astype(np.float32))
    h32, out = cp.empty((rows, 2 * i), cp.float32), cp.empty((rows, h), cp.float32)
    a8, s_a = cp.empty((rows, i), cp.uint8), cp.empty((rows, i // wg.GROUP_K), cp.float32)
    out16, count = cp.empty((rows, h), cp.uint16), cp.zeros(1, cp.uint32)
    sync = cp.zeros(e + 2, cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    plan13 = wg.plan_w4a8_gemm(w13, x8, s_x, offs, ones, h32)
    plan2 = wg.plan_w4a8_gemm(w2, a8, s_a, offs, glob, out)
    # the fused w13 as w4a8-fused plans it: its image form where the plain w13 takes the image kernel
    fused = wg.plan_w4a8_gemm_swiglu(w13, x8, s_x, offs, ones, glob, glob, a8, s_a, count,
                                     **(dict(tokens=min(plan13.tokens, wg.IMAGE_TILES[-1]), image=True, ahead=True)
                                        if plan13.image else {}))
    log(TAG, f"largest expert {int(np.diff(offs).max(initial=0))} tokens; w13 {plan13}; w2 {plan2}; fused {fused}")
    image13 = wg.image_workspace(plan13, w13, rows)
    wg.launch_w4a8_gemm(plan13, w13, x8, s_x, d_offs, ones, h32, stream, image13)
    if args.split:
        if not (plan13.image and plan13.tokens in wg.SPLIT_TILES):
            raise ValueError(f"--split: w13's plan at this mean is not an image plan of a split-roles tile "
                             f"{wg.SPLIT_TILES}: {plan13}")
        split = replace(plan13, split=True, ahead=False, sub=0)
        log(TAG, f"w13 split {split}")
        wg.launch_w4a8_gemm(split, w13, x8, s_x, d_offs, ones, h32, stream, image13)
    wg.launch_swiglu_quant(h32, d_offs, glob, glob, a8, s_a, count, stream)
    wg.launch_w4a8_gemm(plan2, w2, a8, s_a, d_offs, glob, out, stream, wg.image_workspace(plan2, w2, rows))
    wg.launch_w4a8_gemm_swiglu(fused, w13, x8, s_x, d_offs, ones, glob, glob, a8, s_a, count, stream,
                               wg.image_workspace(fused, w13, rows))
    if int(np.diff(offs).max(initial=0)) <= wg.LAYER_TILES[-1]:
        layer = wg.plan_w4a8_layer(w13, w2, x8, s_x, offs, np.ones(e, np.float32),
                                   cp.asnumpy(glob), glob, glob, a8, s_a, out16, count, sync)
        log(TAG, f"layer {layer}")
        wg.launch_w4a8_layer(layer, w13, w2, x8, s_x, d_offs, ones, glob, glob, glob, a8, s_a, out16, count,
                             sync, stream)
    flat = cp.empty(w13.words.nbytes // 16 * 16, dtype=cp.uint8)
    stream_read(flat, cp.zeros(1, dtype=cp.uint32), stream=stream)
    stream.synchronize()
    log(TAG, "done")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main, TAG))
