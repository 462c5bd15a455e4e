"""How deep must the W4A8 GEMM's ring be? At decode sizes the kernel reads weights and nothing
else binds, so its rate is the bytes each SM keeps in flight over the memory latency; every
stage of the ring (w4a8_gemm.cu gemm_body) adds one 128-column group of weights (4.5 KiB per
CTA) to them. This study times w4a8_gemm<T, true, S> for every depth S its token tile T fits,
on the study layer's w13 and w2 shapes and routing at each mean tokens per expert, in interleaved
rounds, against the flat read measured in the same process. Every depth computes the same sums
in the same order, so the outputs must be equal bit for bit (checked on outputs poisoned with
NaN before each first run).

The prepared weights are drawn at random in the kernel's layout (w4a8_gemm.random_prepared:
random codes and signs, block scale codes 0x28..0x48, p = 0) rather than converted from NVFP4:
the time does not depend on the values, and the conversion would cost minutes of CPU here.

--baseline DIR [DIR ...] times other versions of the kernel beside the depths, on the same data
and in the same rounds (each DIR laid out as lab/kernels, e.g. `git archive <commit> lab/kernels |
tar -x -C /tmp/base` then /tmp/base/lab/kernels; its w4a8_gemm<T> must take the same arguments and
prepared layout), labelled base1, base2, ... in the order given; whether their outputs equal the
depths' bits is reported, not required (a version may order the fp8 accumulation differently, and
one with another prepared layout computes other sums from the same random words: then only its
time compares).

--wide times the two-warpgroup CTA (w4a8_gemm_wide: 128 weight rows over one activation tile, so
each expert's activations are read from L2 half as often) beside them, labelled W2; its bits must
equal the depths' too (with --tiles, each tile also on it: T<t>W2). --wide-stages S ... times it at
other ring depths as well (labelled W2S<s>; a ring deeper than the shipped one is dynamic shared
memory), and those bits must equal too.

Needs a GPU. --resident also times the one-warpgroup CTA with its token block's activations resident in shared
memory and the weights' ring filled by bulk copies (w4a8_gemm_res; labelled R at the plan's tile,
T<t>R at a --tiles tile) where the tile is one of w4a8_gemm.RES_TILES and K a multiple of 128;
at the plan's tile its bits must equal the depths', at a --tiles tile the same tile's ring kernel's.

--image also times the two-warpgroup CTA fed by bulk copies from an activation image
(w4a8_gemm_image, its pre-pass included in the time; labelled I at the plan's tile, T<t>I at a --tiles
tile) where the tile is one of w4a8_gemm.IMAGE_TILES, N a multiple of 128 and K of 512, and its form
with the decode one group ahead (IA, T<t>IA); their bits must equal the depths' (the plan's tile) or
the same tile's ring kernel's (T<t>).

--layer also times the whole layer as one launch (w4a8_gemm.w4a8_layer, what w4a8-layer runs at
these sizes) at each of its token tiles, on the same random w13 and w2 (rows labelled "layer",
L<t>; the shipped one is layer_tile's), where the largest expert fits its largest tile; every tile
sums in the same order, so their bf16 outputs must be equal bit for bit.

--json writes the table, the configuration and the setup (GPU, commit).

    python scripts/w4a8_stage_study.py
    python scripts/w4a8_stage_study.py --mean-tokens 1 8 --json stages.json
    python scripts/w4a8_stage_study.py --baseline /tmp/base/lab/kernels
    python scripts/w4a8_stage_study.py --mean-tokens 1 8 16 --layer
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate  # noqa: E402

from lab.cli import HelpFormatter, output_path  # noqa: E402
from lab.kernels import w4a8_gemm as wg  # noqa: E402
from lab.problem import make_routing, tokens_for_mean  # noqa: E402


def tree_ring_bytes(tree: Path, tokens: int) -> int:
    """The dynamic shared memory `tree`'s kernel takes at its shipped depth: its launcher's
    ring_bytes(tokens) where it has one (a ring in dynamic shared memory), else 0 (a static ring)."""
    import importlib.util

    name = f"baseline_w4a8_gemm_{abs(hash(str(tree)))}"
    spec = importlib.util.spec_from_file_location(name, tree / "w4a8_gemm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # (its dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return int(mod.ring_bytes(tokens)) if hasattr(mod, "ring_bytes") else 0


def baseline_launcher(cp, tree: Path, tokens: int):
    """launch(prep, x8, s_x, offsets, alpha, out, token_blocks, stream) of `tree`'s w4a8_gemm<tokens>."""
    from lab.kernels import jit

    expr = f"lab_w4a8::w4a8_gemm<{tokens}>"
    code = jit.source(wg.GEMM_SOURCE, tree).replace("#include <cstdint>\n", "")
    fn = cp.RawModule(code=code, options=jit.ARCH_OPTIONS, name_expressions=(expr,)).get_function(expr)
    smem = tree_ring_bytes(tree, tokens)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem

    def launch(prep, x8, s_x, offsets, alpha, out, token_blocks, stream):
        with stream:
            fn((prep.n // wg.ROWS, token_blocks, prep.experts), (wg.THREADS,),
               (prep.words, prep.scales, prep.tables, prep.table_of, prep.p, alpha, x8, s_x, offsets, out,
                np.int32(prep.n), np.int32(prep.k)), shared_mem=smem)
    return launch


def write_rows(args, setup, read, rows) -> None:
    config = {**vars(args), "baseline": [str(t) for t in args.baseline]}
    Path(args.json).write_text(json.dumps({"setup": setup, "read_roofline": read, "config": config, "rows": rows},
                                          indent=1) + "\n")


def time_layer(cp, rng, mats, routing, mean, read, stream, args) -> list[dict]:
    """The one-launch layer at each of LAYER_TILES on mats' w13 and w2 (module docstring, --layer):
    rows of the stage table, matrix "layer", with whether its bf16 output equals the others'."""
    from lab.timing import time_cuda

    w13, w2 = mats["w13"], mats["w2"]
    e, i = w13.experts, w13.n // 2
    largest = int(routing.counts.max(initial=0))
    if w13.n % (2 * wg.GROUP_K) or w13.k % (2 * wg.ROWS) or not 0 < largest <= wg.LAYER_TILES[-1]:
        print(f"layer: not timed (largest expert {largest} tokens; the one launch takes up to "
              f"{wg.LAYER_TILES[-1]}, with H and I multiples of {wg.GROUP_K})")
        return []
    offs = routing.offsets.astype(np.int32)
    rows_in = int(offs[-1])
    x8, s_x = wg.random_act(cp, rng, rows_in, w13.k)
    d_offs, ones = cp.asarray(offs), cp.ones(e, cp.float32)
    glob_host = rng.uniform(0.5, 2.0, e).astype(np.float32)
    glob = cp.asarray(glob_host)
    a8, s_a = cp.empty((rows_in, i), cp.uint8), cp.empty((rows_in, i // wg.GROUP_K), cp.float32)
    count, sync = cp.zeros(1, cp.uint32), cp.zeros(e + 2, cp.int32)
    cp.cuda.Device().synchronize()
    runs, outs = {}, {}
    for t in wg.LAYER_TILES:
        outs[t] = cp.full((rows_in, w13.k), 0xFFFF, cp.uint16)  # poison: a bf16 NaN
        plan = wg.plan_w4a8_layer(w13, w2, x8, s_x, offs, np.ones(e, np.float32), glob_host, glob, glob, a8, s_a,
                                  outs[t], count, sync, tokens=t)
        runs[t] = (lambda plan=plan, out=outs[t]:
                   wg.launch_w4a8_layer(plan, w13, w2, x8, s_x, d_offs, ones, glob, glob, glob, a8, s_a, out,
                                        count, sync, stream))
    cp.cuda.Device().synchronize()  # the poison (current stream) lands before the study's stream writes
    for t in runs:
        runs[t]()
    stream.synchronize()
    shipped = wg.layer_tile(routing.counts)
    ref = outs[shipped]
    bf16_nan = ((ref & 0x7F80) == 0x7F80) & ((ref & 0x7F) != 0)
    same = {t: bool(cp.array_equal(outs[t], ref)) for t in runs}
    finite = not bool(bf16_nan.any()) and int(count.get()[0]) == 0
    times = {t: [] for t in runs}
    for _ in range(args.rounds):
        for t in runs:
            times[t].append(time_cuda(runs[t], iterations=args.iterations, warmup=2, stream=stream).median_ms)
    touched = np.count_nonzero(routing.counts)
    nbytes = sum((m.words.nbytes + m.scales.nbytes) * touched // e for m in (w13, w2)) + x8.nbytes + s_x.nbytes
    nbytes += rows_in * w13.k * 2  # the bf16 output
    rows = []
    for t in runs:
        ms = float(np.median(times[t]))
        gbps = nbytes / (ms * 1e-3) / 1e9
        tflops = 2.0 * rows_in * (w13.n + w2.n) * w13.k / (ms * 1e-3) / 1e12
        rows.append({"mean_tokens": mean, "matrix": "layer", "tokens": t,
                     "stages": f"L{t}", "shipped": t == shipped, "ms": ms, "gbps": gbps, "of_read": gbps / read["gbps"],
                     "tflops": tflops, "bytes": int(nbytes), "equal_bits": all(same.values()),
                     "same_bits_as_shipped": same[t], "finite": finite})
    print(tabulate([[f"{r['mean_tokens']:g}", "layer", r["tokens"], r["stages"] + ("*" if r["shipped"] else ""),
                     f"{1e3 * r['ms']:.1f}", f"{r['gbps']:.0f}", f"{100 * r['of_read']:.1f}%", f"{r['tflops']:.0f}",
                     r["same_bits_as_shipped"]] for r in rows],
                   headers=["mean", "matrix", "T", "tile", "us", "GB/s", "of read", "TFLOP/s", "same bits"]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--mean-tokens", type=float, nargs="+", default=[1, 8, 32, 128],
                    help="mean tokens per expert, one measurement each")
    ap.add_argument("--experts", type=int, default=288, help="experts (the study layer's)")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size H: w13 is (2I, H), w2 (H, I)")
    ap.add_argument("--intermediate", type=int, default=2048, help="intermediate size I")
    ap.add_argument("--top-k", type=int, default=8, help="experts per token")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--iterations", type=int, default=10, help="timed launches per variant per round")
    ap.add_argument("--seed", type=int, default=0, help="routing and data seed")
    ap.add_argument("--wide", action="store_true",
                    help="also time the two-warpgroup CTA (128 weight rows over one activation tile; labelled W2) "
                         "at the plan's tile, where it has one; it must give the same bits")
    ap.add_argument("--wide-stages", type=int, nargs="+", default=[], metavar="S",
                    help="with --wide, also time the two-warpgroup CTA with a ring of S stages (labelled W2S<s>; "
                         "2 .. w4a8_gemm.max_wide_stages(T)); it must give the same bits")
    ap.add_argument("--tiles", type=int, nargs="+", default=[], metavar="T",
                    help="other token tiles to time beside the plan's, each at its shipped depth (labelled T<t>; "
                         "their bits are reported, not required equal: another tile may round differently)")
    ap.add_argument("--smem-a", action="store_true",
                    help="with --wide, also time the two-warpgroup CTA with the decoded weights in shared memory "
                         "(w4a8_gemm_ss; labelled SS, or T<t>SS at a --tiles tile) where the tile is one of "
                         "w4a8_gemm.SS_TILES; at the plan's tile it must give the same bits")
    ap.add_argument("--resident", action="store_true",
                    help="also time the resident-activation kernel (w4a8_gemm_res; labelled R, or T<t>R at a --tiles "
                         "tile) where the tile is one of w4a8_gemm.RES_TILES; it must give the same bits")
    ap.add_argument("--image", action="store_true",
                    help="also time the activation-image kernel (w4a8_gemm_image with its pre-pass; labelled I, or "
                         "T<t>I at a --tiles tile) where the tile is one of w4a8_gemm.IMAGE_TILES; same bits required")
    ap.add_argument("--image-sub", action="store_true",
                    help="with --image, also time the decode-ahead form whose wgmmas run in batches of "
                         "w4a8_gemm.IMAGE_SUB tokens (labelled IAS, or T<t>IAS; a --tiles tile of 192 has only "
                         "that form); same bits as the whole-tile form required")
    ap.add_argument("--image-stages", type=int, nargs="+", default=[], metavar="S",
                    help="with --image-sub, also time each batched image run (IAS, T<t>IAS) with a ring of S "
                         "stages (labelled <label>S<s>; 2 .. 8, as shared memory allows); same bits required")
    ap.add_argument("--layer", action="store_true",
                    help="also time the one-launch layer (w4a8_layer) at each of its token tiles (labelled L<t>); "
                         "their bf16 outputs must be equal bit for bit")
    ap.add_argument("--baseline", type=Path, metavar="DIR", nargs="+", default=[],
                    help="other versions' lab/kernels directories, their w4a8_gemm<T> timed beside the depths")
    ap.add_argument("--json", type=output_path, metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)

    for flag, v in (("--experts", args.experts), ("--hidden", args.hidden), ("--intermediate", args.intermediate),
                    ("--top-k", args.top_k), ("--rounds", args.rounds), ("--iterations", args.iterations)):
        if v < 1:
            ap.error(f"{flag}: expected a positive int, got {v}")
    if args.hidden % 64 or args.intermediate % 64:
        ap.error(f"--hidden and --intermediate: the kernel's N and K need multiples of 64, got {args.hidden} and "
                 f"{args.intermediate}")
    if args.smem_a and not args.wide:
        ap.error("--smem-a: times a two-warpgroup CTA beside the register-A one, so it needs --wide")
    if args.wide_stages and not args.wide:
        ap.error("--wide-stages: times the two-warpgroup CTA, so it needs --wide")
    if args.image_sub and not args.image:
        ap.error("--image-sub: a form of the activation-image kernel, so it needs --image")
    if args.image_stages and not args.image_sub:
        ap.error("--image-stages: times the batched image runs at other depths, so it needs --image-sub")
    for flag, depths in (("--wide-stages", args.wide_stages), ("--image-stages", args.image_stages)):
        for st in depths:
            if not 2 <= st <= 8:
                ap.error(f"{flag}: expected depths from 2 to 8, got {st}")
    for t in args.tiles:
        if t not in wg.TOKEN_TILES and not (args.image_sub and t in wg.IMAGE_AHEAD_TILES):
            ap.error(f"--tiles: expected tiles from {wg.TOKEN_TILES} (with --image-sub also "
                     f"{wg.IMAGE_AHEAD_TILES}), got {t}")
    for tree in args.baseline:
        if not (tree / wg.GEMM_SOURCE).is_file():
            ap.error(f"--baseline: expected a directory holding {wg.GEMM_SOURCE} (laid out as lab/kernels), "
                     f"got {tree}")
    from lab.gpu import GPUUnavailable, require_gpu

    try:
        cp = require_gpu("the W4A8 stage study")
    except GPUUnavailable as exc:
        print(f"w4a8_stage_study: {exc}", file=sys.stderr)
        return 1
    from lab.device_info import setup_info
    from lab.kernels.stream_read import measure_read_roofline
    from lab.timing import time_cuda

    setup = setup_info()
    read = measure_read_roofline()
    print(f"{setup.get('gpu')}: flat read {read['gbps']:.0f} GB/s")
    rng = np.random.default_rng(args.seed)
    e, h, i = args.experts, args.hidden, args.intermediate
    mats = {"w13": wg.random_prepared(cp, rng, e, 2 * i, h), "w2": wg.random_prepared(cp, rng, e, h, i)}
    alpha = cp.asarray(rng.uniform(0.5, 2.0, e).astype(np.float32))
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for mean in args.mean_tokens:
        routing = make_routing(tokens_for_mean(mean, e, args.top_k), e, args.top_k, seed=args.seed)
        offs = routing.offsets.astype(np.int32)
        d_offs = cp.asarray(offs)
        for name, prep in mats.items():
            x8, s_x = wg.random_act(cp, rng, int(offs[-1]), prep.k)
            cp.cuda.Device().synchronize()  # the uploads (current stream) land before the study's stream reads them
            base = wg.gemm_plan(offs)
            runs = {s: (lambda out, plan=replace(base, stages=s):
                        wg.launch_w4a8_gemm(plan, prep, x8, s_x, d_offs, alpha, out, stream))
                    for s in range(2, wg.max_stages(base.tokens) + 1)}
            for n_base, tree in enumerate(args.baseline, 1):
                old = baseline_launcher(cp, tree, base.tokens)
                runs[f"base{n_base}"] = (lambda out, old=old:
                                         old(prep, x8, s_x, d_offs, alpha, out, base.token_blocks, stream))
            if args.resident and base.tokens in wg.RES_TILES and prep.k % wg.GROUP_K == 0:
                runs["R"] = (lambda out, plan=replace(base, warpgroups=1, resident=True):
                             wg.launch_w4a8_gemm(plan, prep, x8, s_x, d_offs, alpha, out, stream))
            def image_run(plan):
                work = wg.image_workspace(plan, prep, x8.shape[0], stream)

                def run(out):
                    wg.launch_w4a8_gemm(plan, prep, x8, s_x, d_offs, alpha, out, stream, work)

                run.plan = plan
                return run

            image_ok = args.image and prep.n % (2 * wg.ROWS) == 0 and prep.k % wg.IMAGE_K == 0
            if image_ok and base.tokens in wg.IMAGE_TILES:
                runs["I"] = image_run(replace(base, warpgroups=2, image=True))
                runs["IA"] = image_run(replace(base, warpgroups=2, image=True, ahead=True))
                if args.image_sub and base.tokens > wg.IMAGE_SUB:
                    runs["IAS"] = image_run(replace(base, warpgroups=2, image=True, ahead=True, sub=wg.IMAGE_SUB))
            if args.wide and base.tokens in wg.WIDE_TILES and prep.n % (2 * wg.ROWS) == 0:
                runs["W2"] = (lambda out, plan=replace(base, warpgroups=2):
                              wg.launch_w4a8_gemm(plan, prep, x8, s_x, d_offs, alpha, out, stream))
                if args.smem_a and base.tokens in wg.SS_TILES:
                    runs["SS"] = (lambda out, plan=replace(base, warpgroups=2, smem_a=True):
                                  wg.launch_w4a8_gemm(plan, prep, x8, s_x, d_offs, alpha, out, stream))
                for st in args.wide_stages:
                    if st != wg.wide_stages(base.tokens) and st <= wg.max_wide_stages(base.tokens):
                        runs[f"W2S{st}"] = (lambda out, plan=replace(base, warpgroups=2, stages=st):
                                            wg.launch_w4a8_gemm(plan, prep, x8, s_x, d_offs, alpha, out, stream))
            for t in args.tiles:
                if t not in wg.TOKEN_TILES and image_ok:  # an image-only tile: its one form
                    tile_plan = wg.GemmPlan(t, -(-int(routing.counts.max()) // t))
                    runs[f"T{t}IAS"] = image_run(replace(tile_plan, warpgroups=2, image=True, ahead=True,
                                                         sub=wg.IMAGE_SUB))
                elif t != base.tokens and t in wg.TOKEN_TILES:
                    tile_plan = wg.GemmPlan(t, -(-int(routing.counts.max()) // t))
                    runs[f"T{t}"] = (lambda out, plan=tile_plan:
                                     wg.launch_w4a8_gemm(plan, prep, x8, s_x, d_offs, alpha, out, stream))
                    if args.wide and t in wg.WIDE_TILES and prep.n % (2 * wg.ROWS) == 0:
                        runs[f"T{t}W2"] = (lambda out, plan=replace(tile_plan, warpgroups=2):
                                           wg.launch_w4a8_gemm(plan, prep, x8, s_x, d_offs, alpha, out, stream))
                    if args.resident and t in wg.RES_TILES and prep.k % wg.GROUP_K == 0:
                        runs[f"T{t}R"] = (lambda out, plan=replace(tile_plan, resident=True):
                                          wg.launch_w4a8_gemm(plan, prep, x8, s_x, d_offs, alpha, out, stream))
                    if image_ok and t in wg.IMAGE_TILES:
                        runs[f"T{t}I"] = image_run(replace(tile_plan, warpgroups=2, image=True))
                        runs[f"T{t}IA"] = image_run(replace(tile_plan, warpgroups=2, image=True, ahead=True))
                        if args.image_sub and t > wg.IMAGE_SUB:
                            runs[f"T{t}IAS"] = image_run(replace(tile_plan, warpgroups=2, image=True, ahead=True,
                                                                 sub=wg.IMAGE_SUB))
                    if args.smem_a and t in wg.SS_TILES and prep.n % (2 * wg.ROWS) == 0:
                        runs[f"T{t}SS"] = (lambda out, plan=replace(tile_plan, warpgroups=2, smem_a=True):
                                           wg.launch_w4a8_gemm(plan, prep, x8, s_x, d_offs, alpha, out, stream))
            for label in [k for k in runs if str(k).endswith("IAS")]:  # the batched runs at other depths
                plan = runs[label].plan
                for st in args.image_stages:
                    if st != wg.IMAGE_STAGES and wg.image_smem_bytes(plan.tokens, st) <= wg.RES_MAX_SMEM:
                        runs[f"{label}S{st}"] = image_run(replace(plan, stages=st))
            depths = list(runs)
            outs, times = {}, {s: [] for s in depths}
            with stream:  # poisoned on the launches' stream, so no fill lands after a launch's writes
                for s in depths:
                    outs[s] = cp.full((x8.shape[0], prep.n), np.nan, cp.float32)
                    runs[s](outs[s])
            stream.synchronize()
            ref_key = wg.max_stages(base.tokens)
            ref = outs[ref_key]
            same = {s: bool(cp.array_equal(outs[s], ref)) for s in depths}
            for s in depths:  # a --tiles tile's shared-memory-A run against the same tile's register-A one
                if str(s).startswith("T") and str(s).endswith("SS"):
                    same[s] = bool(cp.array_equal(outs[s], outs[s[:-2] + "W2"]))
                if re.fullmatch(r"T\d+(R|I|IA)", str(s)):  # a resident or image run against its tile's ring kernel
                    same[s] = bool(cp.array_equal(outs[s], outs[re.match(r"T\d+", s).group(0)]))
                if re.fullmatch(r"(T\d+)?IASS\d", str(s)):  # another depth against the shipped one
                    same[s] = bool(cp.array_equal(outs[s], outs[re.sub(r"S\d$", "", s)]))
                if re.fullmatch(r"T\d+IAS", str(s)):  # batches against the tile's whole form (192: 128's)
                    whole = next((k for k in (s[:-1], f"T{wg.IMAGE_TILES[-1]}IA", "IA") if k in outs), ref_key)
                    same[s] = bool(cp.array_equal(outs[s], outs[whole]))
            equal = (all(v for s, v in same.items()
                         if not str(s).startswith(("T", "base")) or re.fullmatch(r"T\d+(R|I|IA|IAS|IASS\d)", s))
                     and bool(cp.isfinite(ref).all()))
            for _ in range(args.rounds):
                for s in depths:
                    t = time_cuda(lambda: runs[s](outs[s]), iterations=args.iterations, warmup=2, stream=stream)
                    times[s].append(t.median_ms)
            nbytes = (prep.words.nbytes * np.count_nonzero(routing.counts) // e
                      + prep.scales.nbytes * np.count_nonzero(routing.counts) // e
                      + x8.nbytes + s_x.nbytes + ref.nbytes)
            for s in depths:
                ms = float(np.median(times[s]))
                gbps = nbytes / (ms * 1e-3) / 1e9
                tflops = 2.0 * x8.shape[0] * prep.n * prep.k / (ms * 1e-3) / 1e12
                tile = int(re.match(r"T(\d+)", s).group(1)) if str(s).startswith("T") else base.tokens
                rows.append({"mean_tokens": mean, "matrix": name, "tokens": tile, "stages": s,
                             "shipped": s == wg.max_stages(base.tokens) or str(s).startswith("T"), "ms": ms, "gbps": gbps,
                             "of_read": gbps / read["gbps"], "tflops": tflops, "bytes": int(nbytes), "equal_bits": equal,
                             "same_bits_as_shipped": same[s], "finite": bool(cp.isfinite(outs[s]).all())})
            print(tabulate([[r["mean_tokens"], r["matrix"], r["tokens"], r["stages"], f"{1e3 * r['ms']:.1f}",
                             f"{r['gbps']:.0f}", f"{100 * r['of_read']:.1f}%", f"{r['tflops']:.0f}", r["same_bits_as_shipped"]]
                            for r in rows[-len(depths):]],
                           headers=["mean", "matrix", "T", "stages", "us", "GB/s", "of read", "TFLOP/s", "same bits"]),
                  flush=True)
            if args.json:
                write_rows(args, setup, read, rows)
        if args.layer:
            rows += time_layer(cp, rng, mats, routing, mean, read, stream, args)
            if args.json:
                write_rows(args, setup, read, rows)
    bad = [r for r in rows if not (r["equal_bits"] and r["finite"])]
    if bad:
        print(f"depths disagree (or an output is not finite) at {sorted({(r['mean_tokens'], r['matrix']) for r in bad})}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
