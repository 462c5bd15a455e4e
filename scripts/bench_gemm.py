"""Grouped GEMM benchmark: the lab's GEMM against the read roofline measured in the same run.

For w13 and w2 of the study's problem at each mean tokens per expert it times
  - the flat streaming read (the read roofline) and dense fp16 cuBLAS GEMM (the tensor ceiling),
    once per run,
  - `read-pattern`: the GEMM's own grid, pipeline and copies with no decode or MMA (the
    achievable read rate of exactly this access pattern),
  - the GEMM itself,
and prints one table (gemm, tokens, ms, GB/s, % of the read roofline, TFLOP/s, % of the tensor
peak, % of same-pattern read). Past ~64 tokens per expert the tensor ceiling binds. On the 64-
and 96-token tiles that read the activation image, the GEMM's time includes its pre-pass
(act_image: the activations decoded to fp16 once per launch); the 128- and 160-token tiles write
the image inside the launch (GemmConfig.builders), and their rows also time the same launch with
the pre-pass instead (bits compared). The pre-pass is also timed alone, as its share of the GEMM
with it and its rate against the read roofline for the activations it reads and the image it writes.
Every figure is a burst (the --iterations runs after 3 untimed ones, between host-side checks). With `--sustain-ms` the flat read
and each GEMM are also timed after that long of back-to-back runs: held load trips the H200's
700 W power cap, which slows the GEMM by ~10% and the flat read not at all (notes/gemm-log.md v15).
The GEMMs a user would run instead (torch's grouped GEMMs on bf16 and fp8 weights) are timed
stage by stage, beside the lab's, by scripts/token_axis.py.
"Bytes" are what the GEMM must move: weights of experts with tokens, activations in, fp32 out.
`--act fp8` adds the W4A8 GEMM (the same NVFP4 weights on the fp8 tensor cores, its own token
tile and CTA width): its % tensor peak is of the fp8 peak (cuBLASLt, measured in the same run),
and its check is against the W4A8 contract (lab/w4a8.py gemm), held to the contract's
accumulation bound.

    python scripts/bench_gemm.py --json results/bench_gemm.json
    python scripts/bench_gemm.py --sustain-ms 1000 --json results/bench_gemm_sustained.json
    python scripts/bench_gemm.py --mean-tokens 8 --config 4,4,128,4 --config 8,2,128,4,1 --config 4,4,128,3,0,2
    python scripts/bench_gemm.py --model qwen3-235b-a22b       (--model list: the presets)
    python scripts/bench_gemm.py --act nvfp4 fp8 --mean-tokens 8 32 128
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from tabulate import tabulate

from lab.ceilings import measure_fp8_peak, measure_tensor_peak
from lab.checks import format_rel
from lab.device_info import setup_info
from lab.gemm_bench import CONFIG_HELP, GemmBench, config_of, log, parse_config, problem_of, study_parser, write_json
from lab.gpu import require_gpu, run_script
from lab.kernels import gemm_config as gc
from lab.kernels import grouped_gemm as gg
from lab.kernels.stream_read import measure_read_roofline
from lab.kernels.stream_read import stream_read
from lab.models import resolve_shape
from lab.timing import time_cuda, time_sustained
from lab.w4a8 import ACCUMULATION_C as W4A8_C

TAG = "bench_gemm"


def parse_bounds(text: str) -> tuple[int, ...]:
    """--split's value: increasing token counts >= 1, comma-separated."""
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        vals = ()
    if not vals or vals[0] < 1 or any(a >= b for a, b in zip(vals, vals[1:])):
        raise argparse.ArgumentTypeError(f"expected increasing token counts >= 1 (e.g. 16 or 16,96), got {text!r}")
    return vals


def main(argv=None) -> int:
    ap = study_parser(__doc__, [2, 4, 8, 32], 20)
    ap.add_argument("--skew", type=float, default=0.0, help="routing skew: 0 uniform, else p ~ 1/rank**skew")
    ap.add_argument("--check-experts", type=int, default=16, help="experts checked against float64 (0: none)")
    ap.add_argument("--config", type=parse_config, action="append", default=[],
                    help=CONFIG_HELP + "; repeat to time several tiles in one run")
    ap.add_argument("--act", nargs="+", choices=["nvfp4", "bf16", "fp8"], default=["nvfp4", "bf16"],
                    help="activations: nvfp4 (W4A4) and/or bf16 (W4A16, the same weights and kernel), and/or fp8 "
                         "(W4A8: the same weights on the fp8 tensor cores, lab/kernels/w4a8_gemm.py, checked against "
                         "its contract and timed against the fp8 peak); default nvfp4 and bf16")
    ap.add_argument("--split", type=parse_bounds, nargs="+", default=[], metavar="B[,B...]",
                    help="also time each GEMM as launches by expert size: experts of at most B tokens on their "
                         "tile, the rest on theirs (several bounds: one class between each two; "
                         "gemm_config.split_configs); one row per value, and "
                         "one more with both on mma.sync tiles (as gemm_plan splits) where they differ")
    ap.add_argument("--split-streams", action="store_true",
                    help="run each split's smallest class on a second stream beside the other classes (in order on the "
                         "first), as the layer's graph variants run a split of two (default: one after the other, "
                         "as separate does)")
    ap.add_argument("--sustain-ms", type=float, default=0.0,
                    help="also time the flat read and each GEMM after this many ms of back-to-back runs (0: off)")
    args = ap.parse_args(argv)
    if not (np.isfinite(args.sustain_ms) and 0 <= args.sustain_ms <= 60_000):
        ap.error(f"--sustain-ms: must be in 0..60000, got {args.sustain_ms}")

    resolve_shape(args, ap)
    require_gpu(TAG)  # before any output: without a GPU the script says so in one line

    problem = problem_of(args)
    setup = setup_info()
    log(TAG, f"setup: {setup}")
    log(TAG, "read roofline (flat streaming read of 4.077 GB)")
    roof = measure_read_roofline(iterations=args.iterations)
    bw = roof["gbps"]
    log(TAG, f"read roofline {bw:.0f} GB/s")
    tensor = measure_tensor_peak(iterations=max(3, args.iterations // 2))
    log(TAG, f"tensor peak {tensor['tflops']:.0f} TFLOP/s (dense fp16 cuBLAS)")
    tensor_fp8 = None
    if "fp8" in args.act:
        tensor_fp8 = measure_fp8_peak(iterations=max(3, args.iterations // 2))
        log(TAG, f"fp8 tensor peak {tensor_fp8['tflops']:.0f} TFLOP/s (dense e4m3 cuBLASLt)")
    bench = GemmBench(problem, args.seed, TAG)
    cp = bench.cp
    if args.sustain_ms:
        roof["sustained"] = sustained_read(cp, args)
        cp.get_default_memory_pool().free_all_blocks()
        log(TAG, f"flat read after {args.sustain_ms:g} ms of back-to-back reads: {roof['sustained']['gbps']:.0f} GB/s")

    rows_out, checks, skipped = [], [], []
    rng = np.random.default_rng(args.seed + 17)
    for mean in args.mean_tokens:
        # one case per GEMM and mean, shared by every config and activation form: measure() poisons
        # the output before each config's first run, so no run can pass on another's output
        cases = {g: bench.case(g, mean, args.skew) for g in ("w13", "w2")}
        for n_override, override in enumerate(args.config or [None]):
            for gemm, act in [(g, a) for g in ("w13", "w2") for a in args.act]:
                case = cases[gemm]
                if act == "fp8":  # the W4A8 kernel's own plan: once per GEMM and mean, whatever --config says
                    if n_override == 0:
                        rows_out.append(measure_fp8_row(bench, case, bw, tensor_fp8, args, rng, checks))
                    continue
                cfg = gc.heuristic(case.n, case.k, case.counts, act=act)
                if override:
                    try:
                        cfg = config_of(override, cfg).validate(case.n, case.k)
                    except ValueError as e:  # e.g. a tile whose bf16 stages do not fit shared memory
                        skipped.append({"gemm": gemm, "act": act, "mean": mean, "config": list(override), "why": str(e)})
                        log(TAG, f"{gemm} mean {mean} ({act}): --config {override} skipped: {e}")
                        continue
                log(TAG, f"{gemm} mean {mean}: {case.rows} rows, max count {case.counts.max()}, {cfg}")
                row = bench.measure(case, cfg, bw, args.iterations)
                row["tflops"] = 2.0 * case.rows * case.n * case.k / (row["ms"] * 1e-3) / 1e12
                row["tensor_pct"] = 100 * row["tflops"] / tensor["tflops"]
                if args.sustain_ms:
                    prep = bench.prepared(gemm, (cfg.block_rows, cfg.k_step))
                    xs = (case.d_xb, None, case.d_alpha_bf16) if act == "bf16" else (case.d_xp, case.d_xs, case.d_alpha)
                    t = time_sustained(lambda: gg.grouped_gemm(prep, xs[0], xs[1], case.d_off, xs[2], case.out, cfg),
                                       row["ms"], args.sustain_ms, args.iterations)
                    row.update({"sustained_ms": t.median_ms, "sustained_roof_pct": row["roof_pct"] * row["ms"] / t.median_ms})
                if args.check_experts:
                    pool = np.flatnonzero(case.counts)
                    sample = rng.choice(pool, size=min(args.check_experts, pool.size), replace=False)
                    err = bench.check(case, sample, act)
                    checks.append({"gemm": gemm, "act": act, "mean": mean, "config": cfg.__dict__,
                                   "experts": sample.tolist(), "rel_frobenius": err})
                    log(TAG, f"  check vs float64 on {sample.size} experts: rel Frobenius {format_rel(err)}")
                if row["unwritten"]:
                    log(TAG, f"  ERROR: {row['unwritten']} output elements not written")
                rows_out.append(row)
                log(TAG, f"  gemm {row['ms']:.3f} ms ({row['roof_pct']:.1f}% of roofline), read pattern "
                         f"{row['read_pattern_ms']:.3f} ms")

        for hot_from, wgmma in [(t, w) for t in args.split for w in (True, False)]:
            for gemm, act in [(g, a) for g in ("w13", "w2") for a in args.act if a != "fp8"]:  # (no W4A8 split)
                case = cases[gemm]
                if not wgmma and (gc.split_configs(case.n, case.k, case.counts, hot_from, act=act)
                                  == gc.split_configs(case.n, case.k, case.counts, hot_from, act=act, wgmma=False)):
                    continue  # (no wgmma tile in the split: the row above is the mma.sync one)
                row = bench.measure_split(case, hot_from, bw, args.iterations, act, wgmma,
                                          streams=2 if args.split_streams else 1)
                row["tflops"] = 2.0 * case.rows * case.n * case.k / (row["ms"] * 1e-3) / 1e12
                row["tensor_pct"] = 100 * row["tflops"] / tensor["tflops"]
                row.update({"read_pattern_ms": None, "pattern_pct": None})  # (two grids: no one pattern)
                log(TAG, f"{gemm} mean {mean} ({act}) split at {','.join(map(str, hot_from))}{'' if wgmma else ', mma.sync'}"
                         f"{', two streams' if row['streams'] == 2 else ''}: {row['ms']:.3f} ms "
                         f"({row['roof_pct']:.1f}% of roofline), " + " + ".join(
                             f"{p['config']['max_frags'] * 8}-token tile on {p['counts_in']}" for p in row["plan"]))
                if args.check_experts:
                    pool = np.flatnonzero(case.counts)
                    sample = np.unique(np.r_[rng.choice(pool, size=min(args.check_experts, pool.size), replace=False),
                                             np.argsort(case.counts)[-2:]])  # (the hottest two: the second launch)
                    err = bench.check(case, sample, act)
                    checks.append({"gemm": gemm, "act": act, "mean": mean, "config": row["config"], "split": list(hot_from),
                                   "experts": sample.tolist(), "rel_frobenius": err})
                    log(TAG, f"  check vs float64 on {sample.size} experts: rel Frobenius {format_rel(err)}")
                if row["unwritten"]:
                    log(TAG, f"  ERROR: {row['unwritten']} output elements not written")
                rows_out.append(row)

    def tile(c: dict) -> str:
        if c.get("kernel") == "w4a8":
            return f"w4a8: {c['tokens']}-token tile, {c['warpgroups']} warpgroup{'s' if c['warpgroups'] > 1 else ''}"
        return ("{warps},{row_tiles},{k_step},{stages},{max_frags},{mma},{ctas_per_sm}".format(**c)
                + (",image" if c.get("image") else "") + (",build_image" if c.get("build_image") else ""))

    def fmt(v, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    table = [[r["gemm"], r["act"], r["mean_tokens"],
              tile(r["config"]) if "plan" not in r else f"split at {','.join(map(str, r['split']))}{'' if r['wgmma'] else ', mma.sync'}{', two streams' if r.get('streams') == 2 else ''}: " + " + ".join(
                  f"{tile(p['config'])} on {p['counts_in'][0]}..{p['counts_in'][1]}" for p in r["plan"]),
              f"{r['ms']:.3f}", f"{r['gbps']:.0f}", f"{r['roof_pct']:.1f}", f"{r['tflops']:.0f}",
              f"{r['tensor_pct']:.1f}", fmt(r["pattern_pct"], ".1f"), fmt(r["read_pattern_ms"], ".3f"),
              fmt(r.get("prepass_ms"), ".3f"),
              fmt(r.get("image_ms"), ".3f"), fmt(r.get("image_pct_of_gemm"), ".1f"), fmt(r.get("image_roof_pct"), ".1f")]
             + ([fmt(r.get("sustained_ms"), ".3f"), fmt(r.get("sustained_roof_pct"), ".1f")] if args.sustain_ms else [])
             for r in rows_out]
    print(f"tensor peak: {tensor['tflops']:.0f} TFLOP/s (dense fp16 x fp16 -> fp32, cuBLAS)"
          + (f"; fp8 {tensor_fp8['tflops']:.0f} TFLOP/s (e4m3, cuBLASLt), the fp8 rows' % tensor peak"
             if tensor_fp8 else ""))
    print(f"read roofline: {bw:.0f} GB/s (flat streaming read, {roof['bytes'] / 1e9:.3f} GB)"
          + (f"; {roof['sustained']['gbps']:.0f} GB/s after {args.sustain_ms:g} ms of back-to-back reads"
             if args.sustain_ms else ""))
    print(tabulate(table, headers=["gemm", "activations", "tokens/expert", "tile warps,row_tiles,k_step,stages,max_frags,mma,ctas_per_sm", "ms", "GB/s", "% roofline",
                                   "TFLOP/s", "% tensor peak", "% same-pattern read", "read-pattern ms",
                                   "ms with the pre-pass (in-kernel image tiles)",
                                   "image pre-pass ms", "pre-pass % of its ms", "pre-pass % roofline"]
                   + (["sustained ms", "sustained % roofline"] if args.sustain_ms else [])))
    for c in checks:
        print(f"check {c['gemm']} ({c['act']}) mean {c['mean']}: rel Frobenius {format_rel(c['rel_frobenius'])} on "
              f"{len(c['experts'])} experts" + (f" against the W4A8 contract; accumulation c {c['bound_c']:.3g} "
                                                 f"(bound {W4A8_C:g})" if c["act"] == "fp8" else ""))
    for s in skipped:
        print(f"skipped {s['gemm']} ({s['act']}) mean {s['mean']} --config {s['config']}: {s['why']}")
    write_json(args.json, "scripts/bench_gemm.py", setup=setup, read_roofline=roof, tensor_peak=tensor,
               tensor_peak_fp8=tensor_fp8, rows=rows_out, checks=checks, skipped=skipped)
    # an undefined error (a zero reference, which random inputs never give) is a failed check too;
    # W4A8 is held to its contract's accumulation bound instead of 1e-5
    bad = any(c["rel_frobenius"] is None or (c["bound_c"] is None or c["bound_c"] > W4A8_C if c["act"] == "fp8"
                                             else c["rel_frobenius"] > 1e-5) for c in checks) or \
        any(r["unwritten"] or r.get("prepass_same_bits") is False for r in rows_out)
    return 1 if bad else 0


def measure_fp8_row(bench: GemmBench, case, bw: float, tensor_fp8: dict, args, rng, checks: list) -> dict:
    """One W4A8 row: the planned launch timed (and after --sustain-ms of back-to-back runs), its
    TFLOP/s against the fp8 peak, and its output on --check-experts experts against the contract."""
    row = bench.measure_fp8(case, bw, args.iterations)
    row["tflops"] = 2.0 * case.rows * case.n * case.k / (row["ms"] * 1e-3) / 1e12
    row["tensor_pct"] = 100 * row["tflops"] / tensor_fp8["tflops"]
    log(TAG, f"{case.gemm} mean {case.mean_tokens} (fp8): {case.rows} rows, max count {case.counts.max()}, "
             f"{row['config']}")
    if args.sustain_ms:
        run, stream, _ = bench.fp8_launch(case)
        t = time_sustained(run, row["ms"], args.sustain_ms, args.iterations, stream=stream)
        row.update({"sustained_ms": t.median_ms, "sustained_roof_pct": row["roof_pct"] * row["ms"] / t.median_ms})
    if args.check_experts:
        pool = np.flatnonzero(case.counts)
        sample = rng.choice(pool, size=min(args.check_experts, pool.size), replace=False)
        got = bench.check_fp8(case, sample)
        checks.append({"gemm": case.gemm, "act": "fp8", "mean": case.mean_tokens, "config": row["config"],
                       "experts": sample.tolist(), **got})
        log(TAG, f"  check vs the W4A8 contract on {sample.size} experts: rel Frobenius "
                 f"{format_rel(got['rel_frobenius'])}, accumulation c {got['bound_c']}")
    if row["unwritten"]:
        log(TAG, f"  ERROR: {row['unwritten']} output elements not written")
    log(TAG, f"  gemm {row['ms']:.3f} ms ({row['roof_pct']:.1f}% of roofline, {row['tensor_pct']:.1f}% of the fp8 peak)")
    return row


def sustained_read(cp, args, nbytes: int = 4_077_000_000) -> dict:
    """The flat read timed after `args.sustain_ms` of back-to-back reads."""
    buf = cp.random.default_rng(args.seed).integers(0, 2**31 - 1, size=-(-nbytes // 16) * 4, dtype=cp.int32)
    sink = cp.zeros(1, dtype=cp.uint32)
    first = time_cuda(lambda: stream_read(buf, sink), iterations=3, warmup=1)
    t = time_sustained(lambda: stream_read(buf, sink), first.median_ms, args.sustain_ms, args.iterations)
    return {"ms": t.median_ms, "gbps": buf.nbytes / (t.median_ms * 1e-3) / 1e9, "sustain_ms": args.sustain_ms}


if __name__ == "__main__":
    sys.exit(run_script(main, TAG))
