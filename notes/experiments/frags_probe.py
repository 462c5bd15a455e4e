"""Probe: the token tile at @8. The heuristic sizes the tile for the 99th percentile of the
expert counts (two fragments, 16 tokens, at mean 8), so the few experts with 17-24 tokens take
a second pass that streams their weights again (0.7% more weight bytes at @8). A three-fragment
tile covers them in one pass at the price of 16 more accumulator registers per consumer thread.
Each (gemm, mean) times the tiles alternating in one process; outputs are compared bit for bit
(the second pass adds the same k steps in the same order) and checked against float64.

    python notes/experiments/frags_probe.py --mean-tokens 8 12 --rounds 3 --json probe.json
    python notes/experiments/frags_probe.py --layer --mean-tokens 8 --frags 2 3 --json probe.json

With --layer, the layer's variants instead (fused-layer and cuda-graph by default), their bf16
outputs compared bit for bit across the tiles, each timed in a settled burst.
"""
import sys
from dataclasses import replace

import numpy as np

from lab.gemm_bench import study_parser, write_json
from lab.kernels import grouped_gemm as gg
from probe_common import check_sample, settled_ms, start, start_layer, study_layer

FRAGS = (2, 3, 4)


def main():
    ap = study_parser(__doc__, [8], 20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frags", type=int, nargs="+", default=list(FRAGS))
    ap.add_argument("--layer", action="store_true")
    ap.add_argument("--variants", nargs="+", default=["fused-layer", "cuda-graph"])
    ap.add_argument("--settle-ms", type=float, default=500.0)
    args = ap.parse_args()
    if 3 not in gg.MAX_FRAGS_CHOICES:  # the tree under test may not ship the 3-fragment tile yet
        gg.MAX_FRAGS_CHOICES = tuple(sorted(set(gg.MAX_FRAGS_CHOICES) | {3}))
    if args.layer:
        return layer_main(args)
    roof, bench = start(args)
    rng = np.random.default_rng(1)
    rows, same = [], True
    for mean in args.mean_tokens:
        for gemm in ("w13", "w2"):
            case = bench.case(gemm, mean)
            base = gg.heuristic(case.n, case.k, case.counts)
            print(f"{gemm} @{mean:g}: heuristic {base}; max count {case.counts.max()}", flush=True)
            outs = {}
            for rnd in range(args.rounds):
                for f in args.frags:
                    cfg = replace(base, max_frags=f)
                    row = bench.measure(case, cfg, roof, args.iterations, read_pattern=False)
                    if rnd == 0:
                        outs[f] = case.out.get()
                        row["rel_err_sample"] = check_sample(bench, case, rng, 16)
                    row.update(round=rnd, frags=f)
                    rows.append(row)
                    print(f"{gemm} @{mean:g} frags {f}: {row['ms']:.4f} ms {row['roof_pct']:.1f}%  "
                          f"unwritten {row['unwritten']}" + (f"  err {row['rel_err_sample']:.2e}" if rnd == 0 else ""),
                          flush=True)
            ref = outs[args.frags[0]].view(np.uint32)
            for f in args.frags[1:]:
                eq = bool(np.array_equal(ref, outs[f].view(np.uint32)))
                same &= eq
                print(f"{gemm} @{mean:g}: frags {f} vs {args.frags[0]} {'bitwise equal' if eq else 'DIFFER'}",
                      flush=True)
    write_json(args.json, "notes/experiments/frags_probe.py", roofline_gbps=roof, rows=rows)
    return 0 if same else 1


def layer_main(args):
    from lab.variants import make

    gbps, problem, dweights = start_layer(args)
    rows, same = [], True
    for mean in args.mean_tokens:
        runner, layer = study_layer(problem, dweights, mean, args.seed)
        base = (layer.w13_cfg, layer.w2_cfg)
        print(f"@{mean:g}: heuristic {base[0]} / {base[1]}", flush=True)
        reference = {}
        for rnd in range(args.rounds):
            for f in args.frags:
                object.__setattr__(layer, "w13_cfg", replace(base[0], max_frags=f))
                object.__setattr__(layer, "w2_cfg", replace(base[1], max_frags=f))
                for name in args.variants:
                    v = make(name)
                    runner.prepare(v, layer)
                    runner.checked_run(v, layer)
                    bits = layer.out_bf16.get()
                    eq = bool(np.array_equal(bits, reference.setdefault(name, bits)))
                    same &= eq
                    ms = settled_ms(runner, v, layer, args.iterations, args.settle_ms, prepare=False)
                    rows.append({"variant": name, "mean_tokens": mean, "frags": f, "round": rnd, "ms": ms,
                                 "bits_equal_first": eq})
                    print(f"{name:13s} @{mean:g} frags {f}: {ms:.4f} ms  bits {'equal' if eq else 'DIFFER'}",
                          flush=True)
        object.__setattr__(layer, "w13_cfg", base[0])
        object.__setattr__(layer, "w2_cfg", base[1])
        del runner, layer
    write_json(args.json, "notes/experiments/frags_probe.py --layer", roofline_gbps=gbps, rows=rows)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
