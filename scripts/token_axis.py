"""The layer and each of its GEMMs over tokens per expert, from decode to prefill, against the
peers a user would pick instead, all measured in one process against both ceilings.

    python scripts/token_axis.py --json results/token_axis.json
    python scripts/token_axis.py --mean-tokens 8 128 512 --no-peers
    python scripts/token_axis.py --model qwen3-30b-a3b --skew 0.4
    mkdir -p /tmp/base && git archive HEAD lab/kernels | tar -x -C /tmp/base
    python scripts/token_axis.py --mean-tokens 128 512 --no-peers --tree base=/tmp/base/lab/kernels \
        --variants w4a8 w4a8@base w4a8-fused w4a8-fused@base

First the ceilings: the flat streaming read (GB/s) and the dense tensor peaks, fp16 through
cuBLAS and fp8 through cuBLASLt (TFLOP/s; lab/ceilings.py). Then, for each mean tokens per
expert: the lab's variants (--variants; default separate, cuda-graph, fused-swiglu,
fused-layer, fused-out and the W4A16 ones, w4a16, w4a16-fused, w4a16-layer: NVFP4 weights with
bf16 activations), each W4A4 one checked bitwise against separate, and the peers (torch-bf16 and
torch-fp8 with their activation stage compiled, and their eager forms; reported as skipped,
with the way to get them, when torch is missing). All are timed in interleaved rounds after an
idle pause, as run_layer times. Each time is compared with its roofline, the larger of bytes /
read and useful flops / the tensor ceiling its arithmetic can use (fp16 for the lab's exact
NVFP4 path and for bf16, fp8 for fp8 peers; the table names which binds), and with the fastest
peer; each output with a float64 layer on unquantized activations (the error a user pays), on a
seeded sample of experts. The GEMM rows are separate's and the peers' w13 and w2 stages. A peer
that runs out of device memory beside the others (large means on an 80 GB board) is timed alone
after them, once the lab's arrays are dropped, and named as such ("alone") in the tables.

--tree LABEL=DIR names a kernel source tree (a directory laid out as lab/kernels, as in the last
example above); a variant given as NAME@LABEL then runs with every kernel compiled from DIR, beside
NAME in the same rounds (lab/variants/from_tree.py): the layer-level A/B of a kernel edit. Its
output is checked bit for bit against NAME's where NAME runs before it (an edit that keeps the
sums keeps the bits). Only the kernels come from DIR; the launches are this checkout's.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import peers  # noqa: E402  (after the path line above)
from lab import checks, memory, models, reference, roofline  # noqa: E402
from lab.device_info import setup_info  # noqa: E402
from lab.gemm_bench import log, study_parser, write_json  # noqa: E402
from lab.gpu import require_gpu, run_script  # noqa: E402
from lab.kernels import jit  # noqa: E402
from lab.problem import (heavy_tailed_weights, make_routing, random_activations,  # noqa: E402
                         random_weights, tokens_for_mean)
from lab.timing import Timing  # noqa: E402
from lab.variants import NAMES as LAB_NAMES  # noqa: E402
from lab.variants import from_tree  # noqa: E402
from lab.variants import make as make_variant  # noqa: E402

TAG = "token_axis"
MEANS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
LAB_DEFAULT = ["separate", "cuda-graph", "fused-swiglu", "fused-layer", "fused-out", "w4a16", "w4a16-fused", "w4a16-layer"]
W4A8_FORMS = ("w4a8-fused", "w4a8-layer")  # checked bitwise against w4a8 where it ran before them
VALID = ("baseline", "match")  # a lab variant counts for "best" only if its output is separate's


def build_parser():
    ap = study_parser(__doc__, MEANS, 10)
    ap.add_argument("--variants", nargs="+", default=LAB_DEFAULT, metavar="NAME",
                    help=f"the lab's variants (separate always runs: the others are checked against it); "
                         f"known: {' '.join(LAB_NAMES)}")
    ap.add_argument("--no-peers", action="store_true", help="leave out torch-bf16 and torch-fp8")
    ap.add_argument("--skew", type=float, default=0.0, help="routing skew (lab.problem.make_routing; 0 = uniform)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds per mean")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs before each timed burst")
    ap.add_argument("--settle-ms", type=float, default=300.0,
                    help="idle pause before each timed burst, so every burst starts below the power cap")
    ap.add_argument("--weights", choices=("synthetic", "student-t"), default="synthetic",
                    help="the layer's NVFP4 weights: lab/problem.py random_weights (uniform codes; the default), or "
                         "heavy_tailed_weights (quantized from Student-t matrices, --df; ~2 s of CPU an expert: "
                         "pair it with a few --experts), the shape the fp8 recipes' error depends on")
    ap.add_argument("--df", type=float, default=4.0, help="degrees of freedom of --weights student-t")
    ap.add_argument("--check-experts", type=int, default=4,
                    help="experts (seeded sample) whose rows are compared with the float64 layer")
    ap.add_argument("--tree", type=jit.parse_tree, action="append", default=[], metavar="LABEL=DIR",
                    help="a kernel source tree (a directory laid out as lab/kernels, e.g. another commit's from "
                         "`git archive`): --variants NAME@LABEL then runs NAME with its kernels from DIR, in the "
                         "same process, its output checked bitwise against NAME's where NAME runs before it")
    return ap



def bf16_rows(layer, rows) -> np.ndarray:
    """Rows of the layer's bf16 output as float64."""
    import cupy as cp

    if not len(rows):
        return np.zeros((0, layer.problem.hidden))
    return layer.out_bf16[cp.asarray(rows)].get().view(ml_dtypes.bfloat16).astype(np.float64)


def rates(ms: float | None, nbytes: int, flops: int, roof: dict) -> dict:
    """ms -> GB/s, TFLOP/s and % of the binding roofline (None where ms is None)."""
    if ms is None:
        return {"ms": None, "gbps": None, "tflops": None, "roof_pct": None}
    return {"ms": ms, "gbps": nbytes / (ms * 1e-3) / 1e9, "tflops": flops / (ms * 1e-3) / 1e12,
            "roof_pct": 100.0 * roof["ms"] / ms}


def rooflines(nbytes: int, flops: int, ceilings: dict) -> dict:
    """{tensor kind: binding roofline} for each tensor ceiling the run measured (lab/ceilings.py
    TENSOR_KINDS); a kind whose ceiling is missing has none, and rows on it get no roof%."""
    from lab.ceilings import TENSOR_KINDS, tensor_ceiling

    read = ceilings["read"]["gbps"]
    out = {}
    for kind in TENSOR_KINDS:
        peak = tensor_ceiling(ceilings, kind)
        if peak:
            out[kind] = {**roofline.binding(nbytes, flops, read, peak), "tensor": kind}
    return out


OUT_OF_MEMORY = "out of memory"  # _prepare_and_check's answer for a peer that did not fit beside the others
APART = "timed alone, after the others: out of device memory beside them"


def _is_out_of_memory(exc: BaseException) -> bool:
    """CuPy's and torch's out-of-memory errors (their classes share the name, not a base)."""
    return type(exc).__name__ == "OutOfMemoryError"


def _free_device_memory(runner) -> None:
    gc.collect()
    peers.torch_grouped.free_cached_memory()
    runner.cp.get_default_memory_pool().free_all_blocks()


def _prepare_and_check(runner, layer, point, name, is_peer, ref_rows, ref_out, base, alone=False, trees=None,
                       keep=()):
    """Prepare one implementation, run it once and check it (bitwise against separate for the
    lab's variants, against the float64 layer for all); its entry in point["impls"]. Returns the
    prepared implementation, None where it was skipped or failed, or OUT_OF_MEMORY for a peer
    whose preparation ran out of device memory beside the others (timed alone later)."""
    v = peers.make(name) if is_peer else make_variant(name, trees)
    entry = point["impls"][name] = {"expect": v.expect, "peer": is_peer, "check": None, "skipped": None,
                                    "error": None, "e2e_rel": None, "tensor": getattr(v, "tensor", "fp16")}
    try:
        runner.prepare(v, layer)
    except NotImplementedError as exc:
        entry["skipped"] = str(exc)
        log(TAG, f"  {name}: skipped ({exc})")
        return None
    except Exception as exc:  # reported in the table; the other implementations go on
        entry["error"] = f"prepare: {type(exc).__name__}: {exc}"
        if hasattr(v, "release"):
            v.release()
        if is_peer and not alone and _is_out_of_memory(exc):
            log(TAG, f"  {name}: out of memory beside the others; timed alone after them")
            return OUT_OF_MEMORY
        log(TAG, f"  {name}: {entry['error']}" + (" (alone)" if alone else ""))
        return None
    if is_peer:
        entry.update(label=v.label, stand_in=v.stand_in, vs_eager=v.vs_eager)
        if v.stand_in:
            log(TAG, f"  {name}: {v.stand_in}")
    try:
        if is_peer:
            runner.run(v, layer)
            runner.synchronize()
            got = v.result(layer)[ref_rows].astype(np.float64)
        else:
            runner.checked_run(v, layer)
            got = bf16_rows(layer, ref_rows)
    except Exception as exc:
        entry["error"] = f"run: {type(exc).__name__}: {exc}"
        log(TAG, f"  {name}: {entry['error']}")
        if hasattr(v, "release"):
            v.release()
        return None
    entry["e2e_rel"] = checks.rel_error(got, ref_out)
    if not is_peer:
        if name == "separate":
            base["out"] = layer.out_bf16.copy()
            entry["check"] = {"ok": True, "detail": "baseline"}
        elif v.expect == "match":
            same = bool(runner.cp.array_equal(layer.out_bf16, base["out"]))
            entry["check"] = {"ok": same, "detail": "bitwise equal to separate" if same else "MISMATCH"}
        elif name == "w4a8":  # the W4A8 forms share their arithmetic: w4a8's bits are theirs
            base["w4a8"] = layer.out_bf16.copy()
            entry["check"] = {"ok": None, "detail": "approx (the W4A8 forms' baseline)"}
        elif name in W4A8_FORMS and "w4a8" in base:
            same = bool(runner.cp.array_equal(layer.out_bf16, base["w4a8"]))
            entry["check"] = {"ok": same, "detail": "approx; bitwise equal to w4a8" if same else "MISMATCH with w4a8"}
        elif isinstance(v, from_tree.FromTree) and v.inner.name in base:  # its own bits from lab/kernels
            same = bool(runner.cp.array_equal(layer.out_bf16, base[v.inner.name]))
            entry["check"] = {"ok": same, "detail": f"{v.expect}; bitwise equal to {v.inner.name}" if same
                              else f"MISMATCH with {v.inner.name}"}
        else:
            entry["check"] = {"ok": None, "detail": v.expect}
        if name in keep:  # its output, for the same variant from another tree
            base[name] = layer.out_bf16.copy()
    log(TAG, f"  {name}: {entry['check']['detail'] if entry['check'] else 'peer'}"
             f"{' (alone)' if alone else ''}; vs float64 (unquantized activations) {checks.format_rel(entry['e2e_rel'])}")
    return v


def _time(args, runner, layer, point, timed, lb, fl, roofs, roof, ceilings) -> None:
    """Time `timed` in interleaved rounds after an idle pause each (see run_layer: the power cap
    otherwise slows later bursts, and a drift of the machine falls on every implementation
    alike), then separate's and the peers' stages; into their entries and point["gemm"]."""
    per_round = -(-args.iterations // args.rounds)
    samples = {name: [] for name in timed}
    for _ in range(args.rounds):
        for name, v in timed.items():
            runner.synchronize()
            time.sleep(args.settle_ms / 1000)
            samples[name].append(runner.time_samples(v, layer, per_round, args.warmup))
    for name, v in timed.items():
        t = Timing.of(np.concatenate(samples[name]))
        entry = point["impls"][name]
        entry["timing"] = t.as_dict()
        own = roofs.get(entry["tensor"])  # None where that tensor ceiling could not be measured
        entry.update(rates(t.median_ms, lb.total, fl["layer"], own) if own else
                     {**rates(t.median_ms, lb.total, fl["layer"], roof), "roof_pct": None})
        entry["binds"] = own and f"{own['binds']}" + ("" if own["binds"] == "read" else f" {own['tensor']}")
        if name == "separate" or point["impls"][name]["peer"]:
            runner.synchronize()
            time.sleep(args.settle_ms / 1000)
            st = runner.time_stages(v, layer, per_round, args.warmup)
            for gemm in ("w13", "w2"):
                if gemm in st:
                    nb = getattr(lb, gemm).total
                    g_roofs = rooflines(nb, fl[gemm], ceilings)
                    g_own = g_roofs.get(entry["tensor"])
                    row = rates(st[gemm].median_ms, nb, fl[gemm], g_own or g_roofs["fp16"])
                    row["tensor"] = entry["tensor"]
                    if g_own is None:
                        row["roof_pct"] = None
                    point["gemm"].setdefault(gemm, {"roofline": g_roofs["fp16"], "rooflines": g_roofs, "bytes": nb,
                                                    "flops": fl[gemm]})[name] = row


def measure_mean(args, problem, dweights, mean: float, ceilings: dict, seed: int) -> dict:
    """Everything measured at one mean: routing, roofline, each implementation's check and time."""
    from lab.layer import load_layer
    from lab.runner import Runner

    E, k = problem.experts, problem.top_k
    routing = make_routing(tokens_for_mean(mean, E, k), E, k, skew=args.skew, seed=seed)
    counts = routing.counts
    x = random_activations(routing.tokens, problem.hidden, seed=seed)
    lb = roofline.layer_bytes(problem, counts, active=True)
    fl = roofline.layer_flops(problem, counts)
    roofs = rooflines(lb.total, fl["layer"], ceilings)
    roof = roofs["fp16"]  # the lab's exact NVFP4 path decodes to fp16: the point's own roofline
    point = {"mean": mean, "tokens": routing.tokens, "rows": routing.rows, "max_count": int(counts.max()),
             "empty_experts": int((counts == 0).sum()), "bytes": lb.total, "flops": fl["layer"], "roofline": roof,
             "rooflines": roofs, "impls": {}, "gemm": {}}
    log(TAG, f"mean {mean:g}: {routing.tokens} tokens, {routing.rows} rows, max {counts.max()} on one expert; "
             f"roofline {roof['ms']:.3f} ms ({roof['binds']} binds)")

    runner = Runner()
    layer = load_layer(runner, dweights, routing, x)
    experts = checks.sample_experts(counts, args.check_experts, seed=seed)
    ref_rows, ref_out = reference.layer_unquantized(x, routing, dweights.host, experts)

    lab_names = ["separate"] + [n for n in args.variants if n != "separate"]
    peer_names = [] if args.no_peers else list(peers.NAMES)
    timed, apart, base = {}, [], {}
    keep = {from_tree.split(n)[0] for n in lab_names if from_tree.split(n)[1]}  # variants run from another tree too
    for name in lab_names + peer_names:
        v = _prepare_and_check(runner, layer, point, name, name in peer_names, ref_rows, ref_out, base,
                               trees=args.trees, keep=keep)
        if v is OUT_OF_MEMORY:
            apart.append(name)
        elif v is not None:
            timed[name] = v
    _time(args, runner, layer, point, timed, lb, fl, roofs, roof, ceilings)
    for v in timed.values():  # the peers' tensors go before the next mean's buffers are drawn
        if hasattr(v, "release"):
            v.release()
    del v
    timed.clear()
    # A peer that ran out of memory beside the others is timed alone once they are gone, one at a
    # time, with only its own weights cached (large means on an 80 GB board: the lab's buffers,
    # torch's weights in two formats and four peers' activations do not fit together). The lab's
    # own arrays go first: at 2048 tokens per expert on the H100 they held 55 GB, and no peer fit
    # beside them even alone (2c011a0). Its time is then not interleaved with the rest; the entry
    # and the page say so.
    if apart:
        runner.drop_buffers()
        layer.drop_lab_arrays()
        base.clear()
    for name in sorted(apart, key=lambda n: peers.make(n).kind):
        _free_device_memory(runner)
        kind = peers.make(name).kind
        for key in [k for k in layer.weights.cache if k[0] == "torch" and k[1] != kind]:
            del layer.weights.cache[key]
        v = _prepare_and_check(runner, layer, point, name, True, ref_rows, ref_out, base, alone=True)
        if v is not None and v is not OUT_OF_MEMORY:
            point["impls"][name]["apart"] = APART
            _time(args, runner, layer, point, {name: v}, lb, fl, roofs, roof, ceilings)
            v.release()
    if apart:  # the next mean's buffers before torch's weights, which it dequantizes again
        for key in [k for k in layer.weights.cache if k[0] == "torch"]:
            del layer.weights.cache[key]

    valid = {n: e for n, e in point["impls"].items()
             if not e["peer"] and e.get("ms") is not None and e["check"] and e["check"]["ok"] and e["expect"] in VALID}
    peer_ms = {n: e["ms"] for n, e in point["impls"].items() if e["peer"] and e.get("ms") is not None}
    point["best_lab"] = min(valid, key=lambda n: valid[n]["ms"]) if valid else None
    point["fastest_peer"] = min(peer_ms, key=peer_ms.get) if peer_ms else None
    for e in point["impls"].values():  # > 1: faster than the fastest peer
        e["x_fastest_peer"] = (peer_ms[point["fastest_peer"]] / e["ms"]
                               if point["fastest_peer"] and e.get("ms") else None)
    return point


def peer_support() -> dict:
    """What this torch offers the peers: its version, and whether a blockwise fp8 grouped GEMM
    runs here (peers/torch_grouped.py blockwise_support); {} without torch."""
    if not peers.available():
        return {}
    import torch

    from peers.torch_grouped import blockwise_support

    block = blockwise_support(torch, torch.device("cuda")) if torch.cuda.is_available() else "no CUDA device"
    log(TAG, f"torch {torch.__version__}; blockwise fp8 grouped GEMM: {block or 'runs'}")
    return {"torch": torch.__version__, "blockwise_fp8": block or "runs"}


def print_point(point: dict) -> None:
    roof = point["roofline"]
    print(f"\nmean {point['mean']:g} tokens/expert ({point['tokens']} tokens, {point['rows']} rows): roofline "
          f"{roof['ms']:.3f} ms, {roof['binds']} binds (read {roof['read_ms']:.3f}, tensor {roof['tensor_ms']:.3f})")
    rows = []
    for name, e in point["impls"].items():
        best = " (best lab)" if name == point["best_lab"] else ""
        if e.get("ms") is None:
            rows.append([name + best, "-", "-", "-", "-", "-", e["skipped"] or e["error"]])
            continue
        check = e["check"]["detail"] if e["check"] else "peer"
        pct = "-" if e["roof_pct"] is None else f"{e['roof_pct']:.1f} ({e.get('binds')})"
        rows.append([e.get("label", name) + best, f"{e['ms']:.3f}", f"{e['gbps']:.0f}", f"{e['tflops']:.0f}", pct,
                     "-" if e["x_fastest_peer"] is None else f"{e['x_fastest_peer']:.2f}",
                     f"{check}; e2e {checks.format_rel(e['e2e_rel'])}"])
    print(tabulate(rows, headers=["implementation", "ms", "GB/s", "TFLOP/s", "roof% (binds)",
                                  "x fastest peer", "check"]))


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    problem = models.resolve_shape(args, ap)
    args.trees = dict(args.tree)
    if len(args.trees) < len(args.tree):
        ap.error("--tree: each LABEL once")
    for name in args.variants:
        try:
            base, label = from_tree.split(name)
        except ValueError as exc:
            ap.error(f"--variants: {exc}")
        if base not in LAB_NAMES:
            ap.error(f"--variants: unknown {base!r}; known: {' '.join(LAB_NAMES)}")
        if label is not None and label not in args.trees:
            ap.error(f"--variants {name}: no --tree labelled {label!r}")
    if not (np.isfinite(args.df) and args.df > 0):
        ap.error(f"--df: expected degrees of freedom > 0, got {args.df:g}")
    for m in args.mean_tokens:
        if not (m > 0 and np.isfinite(m)):
            ap.error(f"--mean-tokens: each mean must be a positive number, got {m:g}")
        memory.rows_fit_int32(problem, m)
    cp = require_gpu(TAG)  # before any output: without a GPU the script says so in one line

    from lab.ceilings import measure_ceilings
    from lab.layer import upload_weights

    setup = setup_info()
    if args.weights == "student-t":
        log(TAG, f"weights: quantizing Student-t (df {args.df:g}) matrices, {problem.experts} experts")
        weights = heavy_tailed_weights(problem, df=args.df, seed=args.seed)
    else:
        weights = random_weights(problem, seed=args.seed)
    dweights = upload_weights(weights)
    log(TAG, "ceilings: flat streaming read, dense fp16 cuBLAS GEMM")
    ceilings = measure_ceilings(iterations=args.iterations)
    fp8 = ceilings["tensor_fp8"]
    log(TAG, f"read {ceilings['read']['gbps']:.0f} GB/s, tensor fp16 {ceilings['tensor']['tflops']:.0f} TFLOP/s, "
             f"fp8 {fp8['error'] if fp8['tflops'] is None else format(fp8['tflops'], '.0f') + ' TFLOP/s'}")
    peer_info = {} if args.no_peers else peer_support()
    points = []
    for i, mean in enumerate(args.mean_tokens):
        log(TAG, f"[{i + 1}/{len(args.mean_tokens)}] mean {mean:g}")
        points.append(measure_mean(args, problem, dweights, mean, ceilings, seed=args.seed + i))
        print_point(points[-1])
        gc.collect()  # the mean's layer, runner and peers, before the next mean allocates
        peers.torch_grouped.free_cached_memory()
        cp.get_default_memory_pool().free_all_blocks()
        # rewritten after every mean, "complete" false until the last: a run cut short keeps its means
        write_json(args.json, "scripts/token_axis.py", setup=setup, problem=problem.__dict__, skew=args.skew,
                   weights={"kind": args.weights, **({"df": args.df} if args.weights == "student-t" else {})},
                   ceilings=ceilings, peers=peer_info, points=points, complete=i + 1 == len(args.mean_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main, TAG))
