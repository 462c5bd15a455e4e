"""Same-process A/B of kernel source trees: the grouped GEMM compiled from each tree (a directory
laid out as lab/kernels: another commit's, or the working tree's with an edit), run on the same
inputs and buffers, outputs compared bit for bit with the first tree's, and timed in rounds that
alternate the trees' order. A kernel's time moves with ptxas's schedule and with the machine from
one process to the next; only a comparison inside one process counts (notes/gemm-log.md v24).

    mkdir -p /tmp/base && git archive HEAD lab/kernels | tar -x -C /tmp/base
    python scripts/ab_kernels.py --tree base=/tmp/base/lab/kernels --tree work=lab/kernels \\
        --gemm w2 --mean-tokens 512 2048 --out fp32 bf16 --json results/studies/<question>.json

--json is rewritten after every row ("complete": false until the last one), so a run that a
timeout stops keeps the rows it finished. Each row's rounds follow --hold-ms (default 1000) of
back-to-back runs of the base, so that they all run at the clocks the power cap leaves under
held load, as the layer's GEMMs do.

With no --tree the working tree runs against itself: the method's noise floor. The first tree is
the base: the table gives each tree's time as a ratio to it (of the fastest rounds and of the
median ones, marked ~ where the two trees' rounds overlap), and the script exits 1 when a tree's
output differs from the base's (kernel edits here keep the bits) or leaves a poisoned element.
--out bf16 asks for the image tiles' bf16 output (fused-out's w2), fp32 the plain one; the base's fp32
rows are also checked against float64 on the busiest experts. --out swiglu (w13 only) times the
w13 GEMM with its SwiGLU + quantize epilogue (fused-swiglu's launch, on gate/up-paired weights:
in the consumers' registers on the 128- and 160-token tiles) and compares its NVFP4 codes and
scales; a scale byte left at its poison (0xFF, an e4m3 NaN no block scale takes) is unwritten.
--skew routes with that skew; --plan then times the GEMM as the layer launches it, gemm_plan's
launches (a split's size classes on two streams, the small class issued first, as
separate.run_plan does), and each size class's launch alone (out "class LO-HI", its rows only).

Only the kernels come from the trees: launches are sized by this checkout's Python (GemmConfig:
shared memory, threads, grid). A tree whose Config<> lays out more shared memory than this
checkout's GemmConfig.smem_bytes says would run past its allocation, so run the script from the
checkout whose layout is the largest (a kernel given more than it uses runs as it would).
The instantiation names come from this checkout too: --out bf16 names the kernel's BF16_OUT
argument (31d8ca5), which a tree from before it lacks; add `bool BF16_OUT = false` to that tree's
kernel template (ignored there: its run-time branch still picks the bf16 epilogue) to time it.
Likewise the 128- and 160-token tiles launch with BUILDERS (the activation image written inside
the launch, 864ef50); a tree from before it lacks that argument: name it in --prepass, which
launches it with the pre-pass kernel as it ran then. A tree not named there runs BUILDERS on every
launch of those tiles, a split's larger size class included, which the layer gives the pre-pass
(grouped_gemm.prepass_by_default): where --plan splits the experts, the layer runs the --prepass
tree's form.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import numpy as np
from tabulate import tabulate

from lab.ceilings import measure_tensor_peak
from lab.checks import format_rel
from lab.device_info import setup_info
from lab.gemm_bench import (CONFIG_HELP, GemmBench, StreamPair, class_rows, config_of, log, parse_config, problem_of,
                            study_parser, write_json)
from lab.gpu import require_gpu, run_script
from lab.kernels import gemm_config as gc
from lab.kernels import grouped_gemm as gg
from lab.kernels import jit
from lab.problem import W2_INPUT_SCALE
from lab.timing import time_cuda, time_sustained

TAG = "ab_kernels"
BF16_POISON = 0xFFFF  # a NaN's bits: no finite product of finite inputs rounds to it
SCALE_POISON = 0xFF  # an e4m3 NaN: no block scale takes it (the largest is 448, 0x7E)


def compare_rounds(ms: dict[str, list[float]], base: str) -> dict[str, dict]:
    """Each tree's rounds against the base's: the fastest round and its ratio ("ms", "x_base"), the
    median round and its ratio, and whether the two trees' rounds overlap (then the difference is
    within what the machine moves from round to round: the first rounds after an idle pause run
    at higher clocks, and held compute-bound load hits the power cap)."""
    lo, hi, med = min(ms[base]), max(ms[base]), float(np.median(ms[base]))
    out = {}
    for name, rounds in ms.items():
        m = float(np.median(rounds))
        out[name] = {"round_ms": list(rounds), "ms": min(rounds), "x_base": min(rounds) / lo, "median_ms": m,
                     "x_base_median": m / med, "overlaps_base": min(rounds) <= hi and max(rounds) >= lo}
    return out


def use(trees: dict, name: str, args):
    """Launches as tree `name` makes them: its kernels, and the image pre-pass where --prepass names it."""
    stack = contextlib.ExitStack()
    stack.enter_context(jit.use_tree(trees[name]))
    stack.enter_context(gg.use_prepass(name in (getattr(args, "prepass", None) or ())))
    return stack


def time_trees(run, trees: dict, args, stream=None) -> dict[str, list[float]]:
    """{tree: its rounds' median ms}: `run` (launching on `stream`) under each tree in turn,
    args.rounds rounds after args.warmup_rounds untimed ones, the trees' order alternating, all
    after args.hold_ms of back-to-back runs of the first tree."""
    names = list(trees)
    ms = {n: [] for n in names}
    if getattr(args, "hold_ms", 0) > 0:
        # Held load first, so that every round runs at the clocks the power cap leaves: from an idle
        # start the first rounds run 5-15% fast, and the fastest-round ratio then rewards whichever
        # tree the alternation put first (notes/gemm-log.md v33)
        with use(trees, names[0], args):
            once = time_cuda(run, iterations=3, stream=stream).median_ms
            time_sustained(run, once, args.hold_ms, iterations=1, stream=stream)
    for r in range(-args.warmup_rounds, args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            with use(trees, name, args):
                round_ms = time_cuda(run, iterations=args.iterations, stream=stream).median_ms
            if r >= 0:
                ms[name].append(round_ms)
    return ms


def plan_rows(bench: GemmBench, case, names: list[str], trees: dict, args, bad: list[str]) -> list[dict]:
    """--plan: gemm_plan's launches of one GEMM as the layer runs them ("plan": a split's classes on
    two streams) and each size class alone ("class LO-HI"), for every tree: the written rows bit
    for bit against the base tree's (the plan's also against float64 on the busiest experts), then
    timed in rounds that alternate the trees' order."""
    cp = bench.cp
    plan = gc.gemm_plan(case.n, case.k, case.counts)
    prep = bench.prepared(case.gemm, (plan[0][0].block_rows, plan[0][0].k_step))
    streams = StreamPair(cp)
    # (the pair's streams do not wait on the legacy stream that prepared the weights and poisons
    # the output: every run below starts after a device-wide synchronize)
    cp.cuda.Device().synchronize()

    def launch(cfg, counts_in, stream):
        gg.grouped_gemm(prep, case.d_xp, case.d_xs, case.d_off, case.d_alpha, case.out, cfg, stream=stream,
                        counts_in=counts_in)

    if len(plan) == 2:
        forms = {"plan": (lambda: streams.both(lambda s: launch(*plan[0], s), lambda s: launch(*plan[1], s)),
                          np.ones(case.rows, bool))}
    else:
        forms = {"plan": (lambda: launch(*plan[0], streams.main), np.ones(case.rows, bool))}
    for cfg, counts_in in plan:
        if counts_in is not None:
            lo, hi = counts_in
            forms[f"class {lo}-{hi if hi < 1 << 30 else 'max'}"] = (
                lambda cfg=cfg, counts_in=counts_in: launch(cfg, counts_in, streams.main),
                class_rows(case.counts, counts_in))
    flops = 2.0 * case.rows * case.n * case.k
    rows = []
    for form, (run, written) in forms.items():
        row = {"gemm": case.gemm, "mean_tokens": case.mean_tokens, "skew": args.skew, "out": form, "act": "nvfp4",
               "rows": case.rows, "rows_written": int(written.sum()), "max_count": int(case.counts.max()),
               "plan": gc.plan_record(plan), "config": plan[-1][0].__dict__, "trees": {}}
        first = None
        for name in names:
            with use(trees, name, args):
                case.out.fill(cp.nan)
                cp.cuda.Device().synchronize()
                run()
                cp.cuda.Device().synchronize()
            bits = case.out.view(cp.uint32)[cp.asarray(written)]
            t = {"unwritten": int(cp.isnan(bits.view(cp.float32)).sum()), "nonfinite": None}
            if first is None:
                first, t["equal_base"] = bits.copy(), True
            else:
                t["equal_base"] = bool(cp.array_equal(first, bits))
            if name == names[0] and form == "plan":
                t["rel_frobenius"] = bench.check(case, np.argsort(case.counts)[-4:])
            rel = t.get("rel_frobenius", 0.0)
            if t["unwritten"] or not t["equal_base"] or rel is None or rel > 1e-5:
                bad.append(f"{case.gemm} mean {case.mean_tokens:g} skew {args.skew:g} {form} tree {name}: {t}")
            row["trees"][name] = t
        ms = time_trees(run, trees, args, streams.main)
        for name, c in compare_rounds(ms, names[0]).items():
            row["trees"][name].update(c, tensor_pct=100 * flops / (c["ms"] * 1e-3) / 1e12 / args.tensor_tflops)
        rows.append(row)
        log(TAG, f"{case.gemm} mean {case.mean_tokens:g} skew {args.skew:g} {form}: " + ", ".join(
            f"{n} {row['trees'][n]['ms']:.4f} ms (x{row['trees'][n]['x_base']:.4f})" for n in names))
    return rows


def trees_of(given: list[tuple[str, Path]]) -> dict[str, Path]:
    """The trees to compare, the base first: the working tree twice when none is given."""
    if not given:
        return {"work": jit.KERNEL_DIR, "work-again": jit.KERNEL_DIR}
    if len(given) < 2:
        raise ValueError(f"--tree: give two or more trees (the first is the base), got {len(given)}")
    names = [n for n, _ in given]
    if len(set(names)) != len(names):
        raise ValueError(f"--tree: names must differ, got {names}")
    return dict(given)


def main(argv=None) -> int:
    ap = study_parser(__doc__, [512], 20)
    ap.add_argument("--tree", type=jit.parse_tree, action="append", default=[],
                    help="NAME=DIR, a kernel tree laid out as lab/kernels; repeat (the first is the base)")
    ap.add_argument("--prepass", action="append", default=[], metavar="NAME",
                    help="the tree NAME writes the activation image with the pre-pass kernel even on the tiles that "
                         "write it themselves (GemmConfig.builders); repeat for several trees")
    ap.add_argument("--gemm", nargs="+", choices=["w13", "w2"], default=["w13", "w2"], help="which GEMMs")
    ap.add_argument("--out", nargs="+", choices=["fp32", "bf16", "swiglu"], default=["fp32"],
                    help="the output: fp32, and/or bf16 bits (image tiles only: past 64 tokens per expert), "
                         "and/or (w13) the SwiGLU epilogue's NVFP4 a")
    ap.add_argument("--act", choices=["nvfp4", "bf16"], default="nvfp4",
                    help="activations: NVFP4 (W4A4) or bf16 (W4A16); the W4A8 GEMM's same-process A/B of kernel "
                         "trees is w4a8_stage_study.py --baseline DIR")
    ap.add_argument("--config", type=parse_config, help=CONFIG_HELP)
    ap.add_argument("--skew", type=float, default=0.0, help="routing skew: 0 uniform, else p ~ 1/rank**skew")
    ap.add_argument("--plan", action="store_true",
                    help="time gemm_plan's launches (a split's size classes on two streams) and each class alone, "
                         "instead of one launch of the heuristic's tile (fp32 output, NVFP4 activations)")
    ap.add_argument("--rounds", type=int, default=4, help="timing rounds; each times every tree once, order alternating")
    ap.add_argument("--hold-ms", type=float, default=1000.0,
                    help="back-to-back runs of the base before each row's rounds, so that every round runs at the "
                         "clocks held load leaves (0: none; the first rounds after idle host work run fast)")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="rounds run first and not kept (the first timing after the checks runs fast: clocks up "
                         "after the idle host work)")
    args = ap.parse_args(argv)
    try:
        trees = trees_of(args.tree)
    except ValueError as e:
        ap.error(str(e))
    unknown = [n for n in args.prepass if n not in trees]
    if unknown:
        ap.error(f"--prepass: {unknown} name no --tree (trees: {list(trees)})")
    if not (np.isfinite(args.hold_ms) and 0 <= args.hold_ms <= 60_000):
        ap.error(f"--hold-ms: expected 0..60000 ms, got {args.hold_ms:g}")
    if args.rounds < 1 or args.iterations < 1 or args.warmup_rounds < 0:
        ap.error(f"--rounds and --iterations must be >= 1 and --warmup-rounds >= 0, got {args.rounds}, "
                 f"{args.iterations} and {args.warmup_rounds}")
    if ("bf16" in args.out or "swiglu" in args.out) and args.act == "bf16":
        ap.error("--out bf16 and swiglu: NVFP4-activation (W4A4) epilogues here; use --act nvfp4")
    if args.plan and (args.out != ["fp32"] or args.act != "nvfp4" or args.config):
        ap.error("--plan: the plan's fp32 output with NVFP4 activations only (no --out bf16/swiglu, --act bf16 "
                 "or --config)")
    if not (np.isfinite(args.skew) and args.skew >= 0):
        ap.error(f"--skew: expected a finite value >= 0, got {args.skew}")
    problem = problem_of(args)
    cp = require_gpu(TAG)
    setup = setup_info()
    log(TAG, f"setup: {setup}")
    tensor = measure_tensor_peak(iterations=max(3, args.iterations // 2))
    log(TAG, f"tensor peak {tensor['tflops']:.0f} TFLOP/s (dense fp16 cuBLAS)")
    args.tensor_tflops = tensor["tflops"]
    bench = GemmBench(problem, args.seed, TAG)
    names = list(trees)
    base = names[0]
    rows, bad = [], []

    def save(complete: bool) -> None:
        # after every row too: a run that its caller's timeout stops keeps the rows it finished
        write_json(args.json, "scripts/ab_kernels.py", setup=setup, tensor_peak=tensor,
                   trees={n: str(p) for n, p in trees.items()}, prepass=args.prepass, rows=rows, failed=bad,
                   complete=complete)

    for mean in args.mean_tokens:
        for gemm in args.gemm:
            case = bench.case(gemm, mean, args.skew)
            if args.plan:
                rows += plan_rows(bench, case, names, trees, args, bad)
                save(complete=False)
                continue
            cfg = gc.heuristic(case.n, case.k, case.counts, act=args.act)
            if args.config:
                cfg = config_of(args.config, cfg)
            try:
                cfg = cfg.validate(case.n, case.k)
            except ValueError as e:
                ap.error(f"--config: {e}")
            prep = bench.prepared(gemm, (cfg.block_rows, cfg.k_step))
            xs = (case.d_xb, None, case.d_alpha_bf16) if args.act == "bf16" else (case.d_xp, case.d_xs, case.d_alpha)
            for out in args.out:
                if out == "bf16" and not cfg.image:
                    log(TAG, f"{gemm} mean {mean:g}: --out bf16 skipped: {cfg} is not an image tile")
                    continue
                if out == "swiglu" and gemm != "w13":
                    log(TAG, f"{gemm} mean {mean:g}: --out swiglu skipped: the SwiGLU epilogue is w13's")
                    continue
                run_cfg = gc.fused_config(cfg, "swiglu") if out == "swiglu" else cfg
                if out == "swiglu":
                    # the SwiGLU's a (rows, I) as NVFP4: codes then scales, one buffer so one comparison
                    i = case.n // 2
                    buf = cp.empty(case.rows * (i // 2 + i // 16), dtype=cp.uint8)
                    a_packed = buf[:case.rows * (i // 2)].reshape(case.rows, i // 2)
                    a_scales = buf[case.rows * (i // 2):].reshape(case.rows, i // 16)
                    paired = bench.paired_w13((cfg.block_rows, cfg.k_step))
                    counter = cp.zeros(1, dtype=cp.uint32)
                    fusion = gg.Fusion(cp.asarray(bench.w.gate_global), cp.asarray(bench.w.up_global),
                                       W2_INPUT_SCALE, a_packed, a_scales, counter)
                else:
                    buf = case.out if out == "fp32" else cp.empty(case.out.shape, dtype=cp.uint16)
                    counter = cp.zeros(1, dtype=cp.uint32) if out == "bf16" else None

                def run():
                    if out == "swiglu":
                        gg.swiglu_gemm(paired, xs[0], xs[1], case.d_off, xs[2], fusion, run_cfg)
                    else:
                        gg.grouped_gemm(prep, xs[0], xs[1], case.d_off, xs[2], buf, cfg, nonfinite=counter)

                row = {"gemm": gemm, "mean_tokens": mean, "skew": args.skew, "out": out, "act": args.act, "rows": case.rows,
                       "max_count": int(case.counts.max()), "config": run_cfg.__dict__, "trees": {}}
                first = None
                for name in names:
                    with use(trees, name, args):
                        buf.fill(cp.nan if out == "fp32" else BF16_POISON if out == "bf16" else SCALE_POISON)
                        if counter is not None:
                            counter.fill(0)
                        run()
                        cp.cuda.Device().synchronize()
                    bits = buf.view(cp.uint32) if out == "fp32" else buf
                    poison = (int(cp.isnan(buf).sum()) if out == "fp32" else int((buf == BF16_POISON).sum())
                              if out == "bf16" else int((a_scales == SCALE_POISON).sum()))
                    t = {"unwritten": poison, "nonfinite": int(counter.get()[0]) if counter is not None else None}
                    if first is None:
                        first = (bits.copy(), t["nonfinite"])
                        t["equal_base"] = True
                    else:
                        t["equal_base"] = bool(cp.array_equal(first[0], bits)) and first[1] == t["nonfinite"]
                    if name == base and out == "fp32" and args.act == "nvfp4":
                        # (the other trees are held to the base's bits; W4A16's float64 check is bench_gemm's)
                        t["rel_frobenius"] = bench.check(case, np.argsort(case.counts)[-4:])
                    rel = t.get("rel_frobenius", 0.0)  # (None: undefined, a zero reference: a failed check too)
                    if poison or not t["equal_base"] or rel is None or rel > 1e-5:
                        bad.append(f"{gemm} mean {mean:g} {out} tree {name}: {t}")
                    row["trees"][name] = t
                del first
                ms = time_trees(run, trees, args)
                flops = 2.0 * case.rows * case.n * case.k
                for name, c in compare_rounds(ms, base).items():
                    row["trees"][name].update(c, tensor_pct=100 * flops / (c["ms"] * 1e-3) / 1e12 / tensor["tflops"])
                rows.append(row)
                save(complete=False)
                log(TAG, f"{gemm} mean {mean:g} {out}: " + ", ".join(
                    f"{n} {row['trees'][n]['ms']:.4f} ms (x{row['trees'][n]['x_base']:.4f} / "
                    f"x{row['trees'][n]['x_base_median']:.4f})" for n in names))
    print(f"tensor peak: {tensor['tflops']:.0f} TFLOP/s (dense fp16 x fp16 -> fp32, cuBLAS); trees: "
          + ", ".join(f"{n} = {p}" for n, p in trees.items()))
    table = [[r["gemm"], r["mean_tokens"], r["out"], f"{r['config']['max_frags'] * 8}"]
             + [f"{t['ms']:.4f} ({t['tensor_pct']:.1f}%) x{t['x_base']:.4f} / x{t['x_base_median']:.4f}"
                + ("" if n == base or not t["overlaps_base"] else " ~") for n, t in ((n, r["trees"][n]) for n in names)]
             + [format_rel(r["trees"][base]["rel_frobenius"]) if "rel_frobenius" in r["trees"][base] else "-"]
             for r in rows]
    print(tabulate(table, headers=["gemm", "tokens/expert", "out", "token tile"]
                   + [f"{n} ms (% tensor) x base: fastest / median round" for n in names] + ["rel vs float64"]))
    print("~: the tree's rounds overlap the base's (a difference within round-to-round noise)")
    for b in bad:
        print(f"FAILED: {b}")
    save(complete=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(run_script(main, TAG))
