"""How much does folding the gate/up global ratio into e4m3 block scales (option (b)) cost?

Three tables, all on the CPU:

1. codes: a ratio r folded into every finite positive e4m3 code (gate scales x r, which can
   saturate at 448) and 1/r (up scales / r, which loses precision at small codes instead), then
   the same over a layer's actual gate and up scales, at r and at each expert's own ratio;
2. experts: each sampled expert's own ratio folded into its actual gate block scales (mean and
   max relative error of a scale, the share of scales the fold changes, saturated and flushed
   codes), and what it does to that expert's rows of the layer output;
3. layer: option (b)'s output against option (a)'s on the sampled experts, both against the
   float64 option (a) reference (lab/reference.py), in float64 and as the bf16 the layer hands on.

The layer is a checkpoint's (--checkpoint) or, without one, synthetic weights from
lab/problem.py at --experts/--hidden/--intermediate/--seed with gate/up ratio --ratio. The
routed batch is random activations at --mean-tokens per expert; --sample-experts 0 skips the
layer. --json writes every table.

    python scripts/scale_fold_probe.py --ratio 1.2308
    python scripts/scale_fold_probe.py --checkpoint model.safetensors --json fold.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate

from lab.problem import (
    MoEProblem,
    make_routing,
    random_activations,
    random_weights,
    tokens_for_mean,
)
from lab.scale_fold import (
    FINITE_POSITIVE_CODES,
    fold_stats,
    gate_scale_stats,
    gate_up_ratio,
    layer_effect,
)

COLUMNS = ["scales", "fold", "codes", "mean_rel_err", "max_rel_err", "max_rel_err_unsaturated",
           "saturated", "flushed_to_zero", "inexact"]
EXPERT_COLUMNS = ["expert", "ratio", "codes", "mean_rel_err", "max_rel_err", "inexact %", "saturated",
                  "flushed_to_zero", "saturated energy %", "gate weights rel", "unsaturated rel", "rows",
                  "out rel (b vs a)"]


def load_weights(args):
    """(MoEWeights, source dict: what was probed, said in the output)."""
    if args.checkpoint is not None:
        from lab.checkpoint import load_checkpoint

        weights, rep = load_checkpoint(args.checkpoint, layer=args.layer)
        return weights, {"kind": "checkpoint", **rep.as_dict()}
    problem = MoEProblem(args.experts, args.hidden, args.intermediate, min(args.top_k, args.experts),
                         args.ratio).validate()
    weights = random_weights(problem, seed=args.seed)
    return weights, {"kind": "synthetic", "experts": problem.experts, "hidden": problem.hidden,
                     "intermediate": problem.intermediate, "seed": args.seed, "gate_up_ratio": args.ratio}


def code_rows(ratio: float, weights, label: str) -> list[dict]:
    """Table 1: r and 1/r over all codes, then over the layer's gate and up scales."""
    i = weights.intermediate
    gate, up = weights.w13_scales[:, :i], weights.w13_scales[:, i:]
    own = gate_up_ratio(weights).astype(np.float64)
    return [
        {"scales": "all 126 finite codes", "fold": f"x {ratio:g}", **fold_stats(FINITE_POSITIVE_CODES, ratio)},
        {"scales": "all 126 finite codes", "fold": f"x 1/{ratio:g}", **fold_stats(FINITE_POSITIVE_CODES, 1.0 / ratio)},
        {"scales": f"{label} gate", "fold": f"x {ratio:g}", **fold_stats(gate, ratio)},
        {"scales": f"{label} up", "fold": f"x 1/{ratio:g}", **fold_stats(up, 1.0 / ratio)},
        {"scales": f"{label} gate", "fold": "x own ratio", **fold_stats(gate, own)},
        {"scales": f"{label} up", "fold": "x 1/own ratio", **fold_stats(up, 1.0 / own)},
    ]


def sample_experts(counts: np.ndarray, n: int, seed: int) -> list[int]:
    """Up to n experts with rows, drawn without replacement (seeded), in order."""
    have = np.flatnonzero(counts > 0)
    if n >= have.size:
        return have.tolist()
    return sorted(np.random.default_rng([seed, 7]).choice(have, size=n, replace=False).tolist())


def main(argv=None) -> int:
    d = MoEProblem()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratio", type=float, default=d.gate_up_ratio,
                   help="gate global / up global for the all-codes rows, and the synthetic weights' ratio "
                        "(default: the study's 1.2308)")
    p.add_argument("--checkpoint", type=Path, help="probe this NVFP4 checkpoint's layer")
    p.add_argument("--layer", type=int, help="checkpoint layer (default: the only one)")
    p.add_argument("--experts", type=int, default=16,
                   help="synthetic weights: experts (each expert's statistics are its own; a few suffice)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="synthetic weights: hidden size")
    p.add_argument("--intermediate", type=int, default=d.intermediate, help="synthetic weights: intermediate size")
    p.add_argument("--seed", type=int, default=0, help="synthetic weights, activations, routing and the sample")
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--mean-tokens", type=float, default=8.0, help="routed batch: mean tokens per expert")
    p.add_argument("--sample-experts", type=int, default=8,
                   help="experts whose layer output is computed in float64 (0: skip the layer)")
    p.add_argument("--json", type=Path, help="write every table here as JSON")
    args = p.parse_args(argv)
    if not args.ratio > 0:
        p.error(f"--ratio must be > 0, got {args.ratio}")
    if args.sample_experts < 0 or args.mean_tokens <= 0:
        p.error("--sample-experts must be >= 0 and --mean-tokens > 0")
    t0 = time.perf_counter()
    try:
        weights, source = load_weights(args)
    except ValueError as exc:  # a bad synthetic size, or a malformed checkpoint (CheckpointError)
        p.error(str(exc))

    label = source["kind"]
    if label == "checkpoint":
        print(f"checkpoint {source['path']} layer {source['layer']}: {source['experts']} experts, "
              f"H={source['hidden']}, I={source['intermediate']}; gate/up ratio min {source['ratio_min']:.4f} "
              f"mean {source['ratio_mean']:.4f} max {source['ratio_max']:.4f}")
    else:
        print(f"no --checkpoint: synthetic weights (lab/problem.random_weights, seed {args.seed}): "
              f"{source['experts']} experts, H={source['hidden']}, I={source['intermediate']}, "
              f"gate/up ratio {args.ratio:g} (x 1 +- 0.5% per expert)")
    rows = code_rows(args.ratio, weights, label)
    print("\nFolding into e4m3 codes (relative error of a scale):")
    print(tabulate([[r[c] for c in COLUMNS] for r in rows], headers=COLUMNS, floatfmt=".4g"))

    total, per = gate_scale_stats(weights)
    errs = np.array([e["mean_rel_err"] for e in per])
    total["inexact_frac"] = total["inexact"] / total["codes"] if total["codes"] else 0.0
    total["per_expert_mean_rel_err"] = {"min": float(errs.min()), "median": float(np.median(errs)),
                                        "max": float(errs.max())}
    print(f"\nEach expert's own ratio into its gate scales, all {weights.experts} experts: mean rel err "
          f"{total['mean_rel_err']:.4g} (per expert {errs.min():.4g} .. median {np.median(errs):.4g} .. "
          f"{errs.max():.4g}), max {total['max_rel_err']:.4g}; {100 * total['inexact_frac']:.1f}% of "
          f"{total['codes']} scales changed, {total['saturated']} saturated, {total['flushed_to_zero']} "
          f"flushed to zero")

    effect = None
    if args.sample_experts:
        routing = make_routing(tokens_for_mean(args.mean_tokens, weights.experts, min(args.top_k, weights.experts)),
                               weights.experts, min(args.top_k, weights.experts), seed=args.seed)
        x = random_activations(routing.tokens, weights.hidden, seed=args.seed)
        experts = sample_experts(routing.counts, args.sample_experts, args.seed)
        effect = layer_effect(weights, x, routing, experts)
        effect.update({"tokens": routing.tokens, "mean_tokens": args.mean_tokens, "top_k": routing.top_k})
        by_e = {r["expert"]: r for r in effect["per_expert"]}
        table = []
        for e in experts:
            s = per[e]
            table.append([e, s["ratio"], s["codes"], s["mean_rel_err"], s["max_rel_err"],
                          100 * s["inexact"] / max(1, s["codes"]), s["saturated"], s["flushed_to_zero"],
                          100 * by_e[e]["saturated_energy"], by_e[e]["gate_rel"], by_e[e]["gate_rel_unsaturated"],
                          by_e[e]["rows"], by_e[e]["out_b"]])
        print(f"\nSampled experts ({len(experts)} of {weights.experts}, routed batch of {routing.tokens} tokens, "
              f"mean {args.mean_tokens:g} per expert):")
        print(tabulate(table, headers=EXPERT_COLUMNS, floatfmt=".4g"))
        print(f"\nLayer output on those experts' {effect['rows']} rows, against float64 option (a):")
        print(tabulate([
            ["option (b), float64 (the fold alone)", effect["out_b"]],
            ["option (a), bf16 output", effect["out_a_bf16"]],
            ["option (b), bf16 output", effect["out_b_bf16"]],
            ["SwiGLU output a, option (b)", effect["a_b"]],
            ["w2 input codes flipped by the fold (fraction)", effect["a_q_codes_changed"]],
        ], headers=["", "rel Frobenius"], floatfmt=".3e"))
        print("(run_layer's fold-b row measures the first against float64 on the GPU, fp32 output.)")
    print(f"\n({time.perf_counter() - t0:.1f} s)")
    if args.json:
        doc = {"ratio": args.ratio, "source": source,
               "checkpoint": source if label == "checkpoint" else None,
               "rows": rows, "gate_scales": total,
               "experts": [per[e] for e in (effect["experts"] if effect else [])], "layer": effect}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
