"""Run, check and time the MoE layer variants on one GPU, and print the study's tables.

    python scripts/run_layer.py                              the study's problem, mean 8 and 32
    python scripts/run_layer.py --variants separate cuda-graph --mean-tokens 8 --json out.json
    python scripts/run_layer.py --experts 16 --hidden 512 --intermediate 256 --iterations 5
    python scripts/run_layer.py --model deepseek-v3 --mean-tokens 8   (--model list: the presets)
    python scripts/run_layer.py --checkpoint path/to/model-dir --layer 3

Prints a setup table, the bytes table with its roofline, the read bandwidth measured in the
same run (a flat streaming read), the layer table (ms and % of roofline at each mean, and
whether the output is right: baseline / match / MISMATCH / invalid, ceiling / approx with its
error against float64) and separate's stage table at --stage-mean. --json writes all of it.

Correctness (unless --no-check): `separate` stage by stage against the float64 reference (all
experts on small problems, a seeded sample of --check-experts on large ones), every other
valid variant bitwise equal to separate, the layer's relative error against float64 reported.
Before anything is allocated the host and device memory the run needs is estimated, and a
run that cannot fit is refused (status 2) with both figures. Without a GPU it prints the bytes
table and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from tabulate import tabulate

from lab import memory, models, reference, roofline
from lab.cli import HelpFormatter, output_path
from lab.checkpoint import CheckpointError, describe_skipped, inspect_checkpoint, load_checkpoint
from lab.checks import format_rel, sample_experts
from lab.kernels import gemm_config as gc
from lab.timing import Timing
from lab.problem import MoEProblem, make_routing, random_activations, random_weights, tokens_for_mean
from lab.variants import DEFAULT as LAB_DEFAULT, NAMES as LAB_NAMES

import peers

NAMES = (*LAB_NAMES, *peers.NAMES)  # the lab's variants, then the peers a user would run instead

DEFAULTS = MoEProblem()
SMALL_WEIGHT_BYTES = 256 << 20  # at most this much weight: check every expert against float64
STAGE_BYTES_KEYS = {"w13": "w13", "act": "act", "w2": "w2"}


def log(msg: str) -> None:
    print(f"[run_layer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--variants", nargs="+", default=[*LAB_DEFAULT, *peers.NAMES], metavar="NAME",
                    help=f"variants to run (known: {' '.join(NAMES)}; default all"
                         + (f" but the ones taken on request (not yet run on the H200, or kept for an A/B): {' '.join(n for n in LAB_NAMES if n not in LAB_DEFAULT)}"
                            if len(LAB_DEFAULT) < len(LAB_NAMES) else "") + ")")
    ap.add_argument("--mean-tokens", nargs="+", type=float, default=[8.0, 32.0], metavar="M",
                    help="mean tokens per expert, one run each (default 8 32)")
    models.add_shape_arguments(ap, default_from=", or the checkpoint's")
    ap.add_argument("--iterations", type=int, default=20, help="timed iterations per variant (median, min, max)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs before each round's timed ones")
    ap.add_argument("--rounds", type=int,
                    help="the iterations are split over this many rounds that visit every variant in turn "
                         "(default 4, or --iterations if fewer)")
    ap.add_argument("--settle-ms", type=float, default=500.0,
                    help="idle pause before each variant's burst of a round (0: sustained, power-capped load)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the synthetic weights, the routing, the activations and the checked experts")
    ap.add_argument("--skew", type=float, default=0.0, help="routing skew: 0 uniform, else p ~ 1/rank**skew")
    ap.add_argument("--checkpoint", metavar="PATH",
                    help="ModelOpt NVFP4 checkpoint: a .safetensors file, or a directory with "
                         "model.safetensors.index.json and its shards (default: synthetic weights)")
    ap.add_argument("--layer", type=int, help="MoE layer index in the checkpoint (default: its only one)")
    ap.add_argument("--check-experts", type=int, default=16,
                    help="experts checked against float64 on large problems (>= 16)")
    ap.add_argument("--stage-mean", type=float, default=8.0, help="mean whose stage table is printed")
    ap.add_argument("--no-check", action="store_true", help="skip every correctness check")
    ap.add_argument("--json", type=output_path, metavar="PATH", help="write every table and check here")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if v not in NAMES]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(NAMES)}")
    args.variants = list(dict.fromkeys(args.variants))
    bad = [m for m in args.mean_tokens if not (np.isfinite(m) and m > 0)]
    if bad:
        ap.error(f"--mean-tokens: must be positive, got {bad}")
    for name in ("experts", "hidden", "intermediate", "top_k", "iterations", "rounds"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {v}")
    if args.rounds is None:
        args.rounds = min(4, args.iterations)
    elif args.rounds > args.iterations:
        ap.error(f"--rounds: at most --iterations ({args.iterations}), got {args.rounds}")
    if not (np.isfinite(args.settle_ms) and 0 <= args.settle_ms <= 10_000):
        ap.error(f"--settle-ms: must be in 0..10000, got {args.settle_ms}")
    if args.warmup < 0:
        ap.error(f"--warmup: must be >= 0, got {args.warmup}")
    if not (np.isfinite(args.skew) and args.skew >= 0):
        ap.error(f"--skew: must be finite and >= 0, got {args.skew}")
    if args.check_experts < 16:
        ap.error(f"--check-experts: must be >= 16 (use --no-check to skip checks), got {args.check_experts}")
    if args.checkpoint and not Path(args.checkpoint).exists():
        ap.error(f"--checkpoint: no such file or directory: {args.checkpoint}")
    if args.checkpoint is None and args.layer is not None:
        ap.error("--layer: needs --checkpoint")
    if args.model == "list":
        print(models.table())
        ap.exit(0)
    if args.model is not None:
        try:
            models.model(args.model)
        except ValueError as exc:
            ap.error(str(exc))
    if args.checkpoint is None:
        models.resolve_shape(args, ap)  # the preset, flags over it; the checkpoint's shape otherwise
    return args


def flags_problem(args) -> MoEProblem:
    """The problem the shape flags ask for (after parse_args, without --checkpoint)."""
    return MoEProblem(args.experts, args.hidden, args.intermediate, args.top_k)


def resolve_problem(args):
    """(problem, checkpoint plan or None). A checkpoint's headers are read and checked now (its
    data later, once the memory estimate has passed); its shape must match every shape flag
    given, and --model's preset when given."""
    if not args.checkpoint:
        return flags_problem(args).validate(), None
    given = {k: getattr(args, k) for k in ("experts", "hidden", "intermediate") if getattr(args, k) is not None}
    preset = models.model(args.model) if args.model else None
    problem = MoEProblem(given["experts"], given["hidden"], given["intermediate"]) if len(given) == 3 else None
    log(f"reading the headers of checkpoint {args.checkpoint}")
    plan = inspect_checkpoint(args.checkpoint, layer=args.layer, problem=problem)
    found = {"experts": plan.experts, "hidden": plan.hidden, "intermediate": plan.intermediate}
    for k, v in given.items():
        if found[k] != v:
            raise CheckpointError(f"{args.checkpoint}: --{k} {v} does not match the checkpoint's {k}={found[k]}")
    for k in found:
        if preset is not None and k not in given and getattr(preset, k) != found[k]:
            raise CheckpointError(f"{args.checkpoint}: --model {preset.name} has {k}={getattr(preset, k)}, the "
                                  f"checkpoint's layer {plan.layer} has {k}={found[k]}")
    top_k = args.top_k or (preset.top_k if preset else None) or plan.quant.top_k or DEFAULTS.top_k
    if not (args.top_k or preset or plan.quant.top_k):
        log(f"checkpoint: no top-k stored (config.json's num_experts_per_tok, or the files' top_k metadata): "
            f"top-k {DEFAULTS.top_k}, the default (--top-k sets it)")
    if plan.skipped:
        log(f"checkpoint: skipped {describe_skipped(plan.skipped)}")
    log(f"checkpoint: layer {plan.layer}, {plan.experts} experts in {len(plan.files)} file(s); quantization from "
        f"{plan.quant.source}")
    names = {"experts": "the checkpoint's experts", "top_k": "--top-k" if args.top_k else "top_k"}
    return MoEProblem(plan.experts, plan.hidden, plan.intermediate, top_k).validate(names), plan


def load_weights(args, plan):
    """(MoEWeights, report) of the checkpoint whose plan resolve_problem made."""
    log(f"reading checkpoint {args.checkpoint}: layer {plan.layer}")
    weights, report = load_checkpoint(args.checkpoint, plan=plan)
    log(report.summary())
    return weights, report


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------


def routing_for(problem: MoEProblem, mean: float, args):
    tokens = tokens_for_mean(mean, problem.experts, problem.top_k)
    return make_routing(tokens, problem.experts, problem.top_k, skew=args.skew, seed=args.seed)


def bytes_rows(problem: MoEProblem, routings: dict, gbps: float) -> list[dict]:
    rows = []
    for mean, routing in routings.items():
        for r in roofline.bytes_table(problem, routing.counts, gbps, active=True):
            rows.append({"mean_tokens": mean, "rows": routing.rows,
                         "active_experts": int((routing.counts > 0).sum()), **r})
    return rows


def print_bytes(rows: list[dict], gbps: float, measured: bool) -> None:
    what = "measured" if measured else "nominal H200, not measured"
    print(f"\nBytes the layer moves (experts with tokens) and their roofline at {gbps:.0f} GB/s ({what})")
    print(tabulate([[f"{r['mean_tokens']:g}", r["stage"], f"{r['weights_GB']:.4g}", f"{r['act_GB']:.4g}",
                     f"{r['total_GB']:.4g}", f"{r['roofline_ms']:.4g}"] for r in rows],
                   headers=["tokens/expert", "stage", "weights GB", "activations GB", "total GB", "roofline ms"],
                   disable_numparse=True))


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


# ---------------------------------------------------------------------------------------------
# the GPU run
# ---------------------------------------------------------------------------------------------


def correct_label(entry: dict) -> str:
    """The layer table's `correct` column for one variant across means."""
    if entry.get("skipped"):
        return f"skipped: {entry['skipped'].split(' (')[0]}"
    if entry.get("errors"):
        return "ERROR: " + "; ".join(entry["errors"])
    expect = entry["expect"]
    if expect == "ceiling":
        return "invalid, ceiling"
    checks = entry["checks"]
    if not checks:
        return "unchecked"
    if expect == "baseline":
        return "baseline" if all(c["ok"] for c in checks) else "baseline, FAILED stage checks"
    if expect == "match":
        return "match" if all(c["ok"] for c in checks) else "MISMATCH"
    rels = [c["rel"] for c in checks if c.get("rel") is not None]
    return f"approx ({max(rels):.1e})" if rels else f"approx ({format_rel(None)})"


def run_gpu(args, problem, weights, routings, cp) -> dict:
    from lab import checks
    from lab.device_info import describe_gpu_state, gpu_state, setup_info
    from lab.kernels.stream_read import measure_read_roofline
    from lab.layer import load_layer, upload_weights
    from lab.runner import Runner
    from lab.variants import make as make_lab

    def make(name):
        return peers.make(name) if name in peers.NAMES else make_lab(name)

    setup = setup_info()
    log(f"device: {setup.get('gpu')}")
    if weights is None:
        log(f"weights: drawing synthetic NVFP4 weights for {problem}")
        weights = random_weights(problem, seed=args.seed)
    log("weights: preparing the GEMM layout on the device")
    dweights = upload_weights(weights)
    cp.cuda.Device().synchronize()

    from lab.ceilings import measure_tensor_peak

    log("ceilings: flat streaming read, dense fp16 cuBLAS GEMM")
    roof = measure_read_roofline(iterations=args.iterations)
    cp.get_default_memory_pool().free_all_blocks()
    gbps = roof["gbps"]
    tensor = measure_tensor_peak(iterations=max(3, args.iterations // 2))
    log(f"read roofline {gbps:.0f} GB/s, dense fp16 tensor peak {tensor['tflops']:.0f} TFLOP/s")

    small = weights.nbytes() <= SMALL_WEIGHT_BYTES
    order = list(args.variants)
    if not args.no_check and "separate" not in order:
        order.insert(0, "separate")  # the baseline every other variant is compared with
    table = {name: {"variant": name, "expect": make(name).expect, "ms": {}, "timing": {}, "checks": [],
                    "errors": [], "skipped": None, "checksum": {}, "stages": {}} for name in order}
    separate_checks, stages, gpu_states, plans = {}, None, {}, {}
    stage_mean = args.stage_mean if args.stage_mean in routings else next(iter(routings))

    for i, (mean, routing) in enumerate(routings.items()):
        log(f"mean {mean}: {routing.tokens} tokens, {routing.rows} rows, max count {routing.counts.max()}, "
            f"{int((routing.counts == 0).sum())} experts without tokens")
        x = random_activations(routing.tokens, problem.hidden, seed=args.seed + i)
        runner = Runner()
        layer = load_layer(runner, dweights, routing, x)
        plans[f"{mean:g}"] = {"w13": gc.plan_record(layer.w13_plan), "w2": gc.plan_record(layer.w2_plan)}
        if len(layer.w13_plan) > 1 or len(layer.w2_plan) > 1:
            log("  GEMM plans by expert size: " + "; ".join(
                f"{g} " + " + ".join(f"{c.max_frags * 8}-token {'image' if c.image else 'mma.sync' if not c.mma else 'wgmma'} "
                                     f"tile on {lo}..{'' if hi == gc.ALL_COUNTS[1] else hi}" for c, (lo, hi) in plan)
                for g, plan in (("w13", layer.w13_plan), ("w2", layer.w2_plan))))
        n_check = problem.experts if small else args.check_experts
        experts = checks.sample_experts(routing.counts, n_check, seed=args.seed + i)
        rows_sel = checks.expert_rows(layer.offsets_host, experts)
        if not args.no_check:  # the float64 layer on unquantized activations: the error a user pays
            e2e_rows, e2e_ref = reference.layer_unquantized(x, routing, dweights.host, experts)
        baseline, ref_out = None, None
        timed: dict = {}
        for name in order:
            entry = table[name]
            v = make(name)
            try:
                log(f"  {name}: prepare")
                runner.prepare(v, layer)
            except NotImplementedError as exc:
                entry["skipped"] = str(exc)
                log(f"  {name}: skipped ({exc})")
                continue
            except Exception as exc:  # a variant that cannot run is reported, the others go on
                entry["errors"].append(f"mean {mean}: prepare: {type(exc).__name__}: {exc}")
                log(f"  {name}: prepare failed: {exc}")
                continue
            if not args.no_check and v.expect != "ceiling":
                try:
                    runner.checked_run(v, layer)
                except Exception as exc:  # NonFiniteError, or a failed launch: reported, the others go on
                    entry["errors"].append(f"mean {mean}: {type(exc).__name__}: {exc}")
                    log(f"  {name}: {type(exc).__name__}: {exc}")
                    continue
                out_peer = v.result(layer) if hasattr(v, "result") else None  # a peer keeps its output
                bits = layer.out_bf16.get() if out_peer is None else None
                if bits is not None:
                    entry["checksum"][mean] = checks.checksum(bits)
                got = out_peer[e2e_rows] if out_peer is not None else \
                    bits[e2e_rows].view(ml_dtypes.bfloat16).astype(np.float64)
                entry.setdefault("e2e_rel", {})[mean] = checks.rel_error(got, e2e_ref)
                if name == "separate":
                    log(f"  separate: checking stage by stage on {len(experts)} experts against float64")
                    res = checks.check_separate(runner, layer, experts)
                    ref_out = res.pop("reference")["out"]
                    separate_checks[mean] = res
                    baseline = bits
                    entry["checks"].append({"mean": mean, "ok": res["ok"], "layer_rel": res["layer_rel"]})
                    for stage in ("x_q", "h", "a", "a_q", "out", "bf16"):
                        log(f"    {stage}: {'ok' if res[stage]['ok'] else 'FAILED'}: {res[stage]['detail']}")
                    log(f"    layer vs float64: rel {format_rel(res['layer_rel'])} "
                        f"(bf16 {format_rel(res['layer_rel_bf16'])})")
                elif baseline is None:
                    entry["errors"].append(f"mean {mean}: no baseline to compare with (separate failed)")
                elif v.expect == "match":
                    ok, msg = checks.compare_bits(bits, baseline)
                    entry["checks"].append({"mean": mean, "ok": ok, "detail": msg})
                    log(f"  {name}: {'match' if ok else 'MISMATCH'} ({msg})")
                elif v.expect == "approx":
                    if out_peer is not None:
                        rel = entry["e2e_rel"][mean]
                    elif getattr(v, "fp32_out", True):
                        rel = checks.approx_error(layer, ref_out, experts)
                    else:  # a one-launch variant writes bf16 only: its error includes that rounding
                        rel = checks.rel_error(bits[rows_sel].view(ml_dtypes.bfloat16).astype(np.float64),
                                               ref_out)
                    entry["checks"].append({"mean": mean, "ok": True, "rel": rel})
                    log(f"  {name}: rel error vs float64 {format_rel(rel)}")
                log(f"  {name}: vs float64 on unquantized activations {format_rel(entry['e2e_rel'][mean])}")
            if name in args.variants:
                timed[name] = v  # prepared and checked; timed below, with the others
        # Interleaved rounds: every variant runs a share of the iterations in each round, so a
        # drift of the machine's speed during the run falls on all of them alike. Each burst
        # follows an idle pause: under back-to-back load the layer draws ~750 W, the 700 W power
        # cap lowers the SM clock and every variant slows by 5-10% (the flat read does not:
        # notes/layer.md); --settle-ms 0 measures that sustained state instead.
        per_round = -(-args.iterations // args.rounds)
        samples: dict[str, list] = {name: [] for name in timed}
        gpu_states[mean] = {"before_timing": gpu_state()}
        for r in range(args.rounds):
            log(f"  timing round {r + 1}/{args.rounds}: {per_round} iterations of {len(timed)} variants")
            for name, v in timed.items():
                runner.synchronize()
                time.sleep(args.settle_ms / 1000)  # every burst starts from the same power state
                samples[name].append(runner.time_samples(v, layer, per_round, args.warmup))
        gpu_states[mean]["after_timing"] = gpu_state()
        for when, st in gpu_states[mean].items():
            if st:
                log(f"  gpu {when.replace('_', ' ')}: {describe_gpu_state(st)}")
        for name, v in timed.items():
            entry = table[name]
            t = Timing.of(np.concatenate(samples[name]))
            entry["ms"][mean] = t.median_ms
            entry["timing"][mean] = t.as_dict()
            if mean == stage_mean:
                runner.synchronize()
                time.sleep(args.settle_ms / 1000)
                st = runner.time_stages(v, layer, args.iterations, args.warmup)
                entry["stages"] = {k: s.median_ms for k, s in st.items()}
                if name == "separate":
                    stages = {"mean_tokens": mean, "layer_ms": t.median_ms,
                              "stages": {k: s.as_dict() for k, s in st.items()}}
            log(f"  {name}: {t.median_ms:.3f} ms (min {t.min_ms:.3f}, max {t.max_ms:.3f})")
        del layer, runner, timed
        cp.get_default_memory_pool().free_all_blocks()

    return {"setup": setup, "read_roofline": roof, "table": table, "separate_checks": separate_checks,
            "stages": stages, "gbps": gbps, "tensor_peak": tensor, "gpu_states": gpu_states, "gemm_plans": plans}


def layer_rows(result: dict, problem, routings, variants) -> list[dict]:
    """One row per variant: ms, % of the binding roofline (the larger of bytes / read and useful
    flops / tensor peak, both measured in this run), its time against the fastest peer's, and
    its error against float64 on unquantized activations."""
    gbps, tflops = result["gbps"], result["tensor_peak"]["tflops"]
    peer_ms = {m: [result["table"][n]["ms"][m] for n in variants if n in peers.NAMES and m in result["table"][n]["ms"]]
               for m in routings}
    rows = []
    for name in variants:
        entry = result["table"][name]
        row = {"variant": name, "expect": entry["expect"], "peer": name in peers.NAMES, "correct": correct_label(entry),
               "checks": entry["checks"], "checksum": entry["checksum"], "timing": entry["timing"],
               "stage_ms": entry["stages"], "e2e_rel": {f"{m:g}": v for m, v in entry.get("e2e_rel", {}).items()}}
        for mean, routing in routings.items():
            ms = entry["ms"].get(mean)
            roof = roofline.binding(roofline.layer_bytes(problem, routing.counts, active=True).total,
                                    roofline.layer_flops(problem, routing.counts)["layer"], gbps, tflops)
            row[f"ms@{mean:g}"] = ms
            row[f"roof%@{mean:g}"] = None if ms is None else 100 * roof["ms"] / ms
            row[f"roofline_ms@{mean:g}"] = roof["ms"]
            row[f"binds@{mean:g}"] = roof["binds"]
            fastest = min(peer_ms[mean]) if peer_ms[mean] else None
            row[f"x_fastest_peer@{mean:g}"] = None if ms is None or fastest is None else fastest / ms
        rows.append(row)
    return rows


def stage_rows(stages: dict, problem, routing, gbps) -> list[dict]:
    lb = roofline.layer_bytes(problem, routing.counts, active=True)
    out = []
    total = 0.0
    for name, t in stages["stages"].items():
        total += t["median_ms"]
        if name in STAGE_BYTES_KEYS:
            nbytes = lb.stages[STAGE_BYTES_KEYS[name]].total
        elif name == "out":  # fp32 read + bf16 written; the roofline counts only the bf16 (in w2)
            nbytes = routing.rows * problem.hidden * (roofline.FP32_BYTES + roofline.BF16_BYTES)
        else:
            nbytes = None
        roof_ms = None if nbytes is None else roofline.roofline_ms(nbytes, gbps)
        out.append({"stage": name, "ms": t["median_ms"], "ms_min": t["min_ms"], "ms_max": t["max_ms"],
                    "pct_of_layer": 100 * t["median_ms"] / stages["layer_ms"], "GB": None if nbytes is None else nbytes / 1e9,
                    "roofline_ms": roof_ms, "roof_pct": None if roof_ms is None else 100 * roof_ms / t["median_ms"]})
    out.append({"stage": "sum of stages", "ms": total, "pct_of_layer": 100 * total / stages["layer_ms"]})
    out.append({"stage": "separate (one run)", "ms": stages["layer_ms"], "pct_of_layer": 100.0})
    return out


def print_results(result, problem, routings, brows, lrows, srows, args) -> None:
    setup = result["setup"]
    print(tabulate(sorted((k, str(v)) for k, v in setup.items()), headers=["setup", ""]))
    print(f"\nproblem: E={problem.experts} H={problem.hidden} I={problem.intermediate} top_k={problem.top_k} "
          f"gate/up global ratio {problem.gate_up_ratio:.4f}; skew {args.skew}; seed {args.seed}; "
          f"{args.iterations} iterations in {args.rounds} interleaved rounds, {args.warmup} warm-up runs each, "
          f"{args.settle_ms:g} ms idle before each burst")
    print_bytes(brows, result["gbps"], measured=True)
    roof = result["read_roofline"]
    print(f"\nread bandwidth (flat streaming read of {roof['bytes'] / 1e9:.3f} GB, this run): {result['gbps']:.0f} GB/s")
    means = list(routings)
    binds = {m: lrows[0][f"binds@{m:g}"] for m in means} if lrows else {}
    headers = (["variant"] + [f"ms @{m:g}" for m in means] + [f"roof% @{m:g} ({binds[m]})" for m in means] +
               [f"x fastest peer @{m:g}" for m in means] + [f"vs float64 @{m:g}" for m in means] + ["correct"])
    table = [[r["variant"]] + [fmt(r[f"ms@{m:g}"], ".3f") for m in means] +
             [fmt(r[f"roof%@{m:g}"], ".1f") for m in means] + [fmt(r[f"x_fastest_peer@{m:g}"], ".2f") for m in means] +
             [format_rel(r["e2e_rel"].get(f"{m:g}")) if f"{m:g}" in r["e2e_rel"] else "-" for m in means] +
             [r["correct"]] for r in lrows]
    print(f"\nDense fp16 tensor peak (cuBLAS, this run): {result['tensor_peak']['tflops']:.0f} TFLOP/s")
    print("\nLayer (median ms; roof% = the binding roofline of this run / ms, the binding ceiling in the header: "
          "read = active bytes at the measured read bandwidth, tensor = useful flops at the measured tensor peak; "
          "x fastest peer = the fastest peer's ms / ms; vs float64 = error against the layer on unquantized "
          "activations, the error a user pays)")
    print(tabulate(table, headers=headers, disable_numparse=True))
    for r in lrows:
        entry = result["table"][r["variant"]]
        if entry.get("skipped"):
            print(f"{r['variant']}: skipped: {entry['skipped']}")
    for mean, res in result["separate_checks"].items():
        print(f"check at mean {mean:g}: separate stage by stage on {len(res['experts'])} experts: "
              f"{'ok' if res['ok'] else 'FAILED'}; layer vs float64 rel {format_rel(res['layer_rel'])} "
              f"(bf16 output {format_rel(res['layer_rel_bf16'])})")
        for stage in ("x_q", "h", "a", "a_q", "out", "bf16"):
            if not res[stage]["ok"]:
                print(f"  {stage}: FAILED: {res[stage]['detail']}")
    others = [r for r in lrows if len(r["stage_ms"]) > 1 and r["variant"] != "separate"]
    if others:  # variants launched stage by stage (a replayed graph is a single stage)
        names = list(dict.fromkeys(k for r in others for k in r["stage_ms"]))
        print("\nStage ms of the other variants launched stage by stage, at the stage mean")
        print(tabulate([[r["variant"]] + [fmt(r["stage_ms"].get(k), ".3f") for k in names] for r in others],
                       headers=["variant", *names], disable_numparse=True))
    if srows:
        print(f"\nStages of separate at mean {result['stages']['mean_tokens']:g} (CUDA events around each stage)")
        print(tabulate([[r["stage"], fmt(r["ms"], ".3f"), fmt(r.get("pct_of_layer"), ".1f"), fmt(r.get("GB"), ".4f"),
                         fmt(r.get("roofline_ms"), ".3f"), fmt(r.get("roof_pct"), ".1f")] for r in srows],
                       headers=["stage", "ms", "% of layer", "GB", "roofline ms", "roof%"], disable_numparse=True))


def main(argv=None) -> int:
    argv_list = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv_list)
    try:
        problem, plan = resolve_problem(args)
        host_limit, host_source = memory.host_limit()
        memory.require_fits(memory.routing_host(problem, args.mean_tokens), host_limit, host_source,
                            f"drawing the routings of --mean-tokens {' '.join(f'{m:g}' for m in args.mean_tokens)}")
        for m in args.mean_tokens:
            memory.rows_fit_int32(problem, m)
    except (CheckpointError, ValueError) as exc:  # MemoryLimitError is a ValueError
        print(f"run_layer: {exc}", file=sys.stderr)
        return 2
    log(f"problem {problem}")
    routings = {m: routing_for(problem, m, args) for m in args.mean_tokens}

    from lab.gpu import gpu_available, require_gpu

    if not gpu_available():
        brows = bytes_rows(problem, routings, roofline.H200_GBPS)
        print_bytes(brows, roofline.H200_GBPS, measured=False)
        try:
            require_gpu("run_layer")
        except RuntimeError as exc:
            print(f"\n{exc}; printed the bytes table only.", file=sys.stderr)
        if args.json:
            write_json(args.json, {"script": "scripts/run_layer.py", "argv": argv_list, "problem": vars(problem), "bytes": brows,
                                   "error": "no CUDA GPU"})
        return 1
    cp = require_gpu("run_layer")
    try:
        # the rows each mean's check will sample (run_gpu draws the same experts; a problem near
        # the small-weights line counts as checking every expert)
        n_check = problem.experts if memory.weight_bytes(problem) <= 2 * SMALL_WEIGHT_BYTES else args.check_experts
        check_rows = {m: int(np.asarray(r.counts)[sample_experts(r.counts, n_check, seed=args.seed + i)].sum())
                      for i, (m, r) in enumerate(routings.items())}
        need = memory.run_layer_memory(problem, args.mean_tokens, [*args.variants, "separate"],
                                       check=not args.no_check, skew=args.skew, check_rows=check_rows)
        memory.require_fits(need.host, host_limit, host_source)
        memory.require_fits(need.device, *memory.device_limit(cp))
        log(f"memory: about {need.host.total / 1e9:.3g} GB host, {need.device.total / 1e9:.3g} GB device")
        weights, report = load_weights(args, plan) if plan else (None, None)
    except (CheckpointError, ValueError) as exc:
        print(f"run_layer: {exc}", file=sys.stderr)
        return 2
    if weights is not None:
        problem = weights.problem(problem.top_k).validate()

    result = run_gpu(args, problem, weights, routings, cp)
    brows = bytes_rows(problem, routings, result["gbps"])
    lrows = layer_rows(result, problem, routings, args.variants)
    srows = stage_rows(result["stages"], problem, routings[result["stages"]["mean_tokens"]], result["gbps"]) \
        if result["stages"] else []
    print_results(result, problem, routings, brows, lrows, srows, args)
    if args.json:
        write_json(args.json, {
            "script": "scripts/run_layer.py", "argv": argv_list,
            "setup": result["setup"], "problem": vars(problem),
            "checkpoint": report.as_dict() if report else None,
            "read_roofline": result["read_roofline"], "tensor_peak": result["tensor_peak"], "bytes": brows, "layer": lrows, "stages": srows,
            "separate_checks": result["separate_checks"], "gpu_states": result["gpu_states"],
            "gemm_plans": result["gemm_plans"]})
        log(f"wrote {args.json}")
    failed = [r["variant"] for r in lrows if r["correct"].startswith(("MISMATCH", "ERROR", "baseline, FAILED"))]
    failed += [f"separate checks at mean {m:g}" for m, r in result["separate_checks"].items() if not r["ok"]]
    if failed:
        print(f"\nrun_layer: FAILED: {', '.join(dict.fromkeys(failed))}", file=sys.stderr)
        return 1
    return 0


def _jsonable(o):
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, np.ndarray):
        return _jsonable(o.tolist())
    if isinstance(o, np.generic):
        o = o.item()
    if isinstance(o, float) and not np.isfinite(o):
        return None  # JSON has no NaN: null, as an undefined relative error is
    return o


def write_json(path: str, data: dict) -> None:
    Path(path).write_text(json.dumps(_jsonable(data), indent=1, allow_nan=False))


if __name__ == "__main__":
    sys.exit(main())
