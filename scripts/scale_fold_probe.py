"""How much does folding the gate/up global ratio into e4m3 block scales (option (b)) cost?

Option (b) both ways (lab/scale_fold.py): into the gate half (scales x r, r = G_gate / G_up:
codes above 448 / r saturate) and into the half with the smaller global (scales x g_small /
g_large <= 1: nothing saturates, the smallest codes lose bits; an engine's way, and fold-b's).
Tables, all on the CPU:

1. codes: r and 1/r folded into every finite positive e4m3 code, then into the layer's gate and
   up scales at r, then each expert's own factor in both directions;
2. experts: per direction, each sampled expert's own factor folded into its actual block
   scales (mean and max relative error of a scale, the share of scales the fold changes,
   saturated and flushed codes), and what it does to that expert's rows of the layer output;
3. layer: option (b)'s output both ways against option (a)'s, all against the float64 option
   (a) reference (lab/reference.py), in float64 and as the bf16 the layer hands on.

The layer is a checkpoint's (--checkpoint: a file or a sharded directory) or, without one,
synthetic weights at --experts/--hidden/--intermediate/--seed with gate/up ratio --ratio:
`--weights codes` draws codes and scales directly (lab/problem.random_weights: scales spread
over all 126 codes), `--weights quantized` quantizes real-valued tensors as ModelOpt does
(lab/scale_fold.quantized_weights: scales crowd towards 448). The routed batch is random
activations at --mean-tokens per expert; --sample-experts 0 skips the layer. A relative error
against an all-zero reference is undefined: "undefined" in the tables, null in the JSON.
--json writes every table: gate_scales, experts and layer for the fold into the gate half,
`smaller` the same three for the fold into the smaller global's half. Progress goes to stderr,
a line per step.

    python scripts/scale_fold_probe.py --ratio 1.2308
    python scripts/scale_fold_probe.py --weights quantized --json fold_quantized.json
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

from tabulate import tabulate  # noqa: E402

from lab.checkpoint import CheckpointError  # noqa: E402
from lab.checks import format_rel  # noqa: E402
from lab.cli import HelpFormatter, output_path  # noqa: E402
from lab.device_info import lab_commit  # noqa: E402
from lab.models import SHAPE_FIELDS, flag  # noqa: E402
from lab.problem import (  # noqa: E402
    MoEProblem,
    make_routing,
    random_activations,
    random_weights,
    tokens_for_mean,
)
from lab.scale_fold import (  # noqa: E402
    FINITE_POSITIVE_CODES,
    fold_stats,
    folded_half_scales,
    gate_up_ratio,
    layer_effect,
    quantized_weights,
    scale_stats,
)

COLUMNS = ["scales", "fold", "codes", "mean_rel_err", "max_rel_err", "max_rel_err_unsaturated",
           "saturated", "flushed_to_zero", "inexact"]
EXPERT_COLUMNS = ["expert", "ratio", "half", "codes", "mean_rel_err", "max_rel_err", "inexact %", "saturated",
                  "flushed_to_zero", "saturated energy %", "half weights rel", "unsaturated rel", "rows",
                  "out rel (b vs a)"]
DIRECTIONS = {"gate": "into the gate half (x r)", "smaller": "into the smaller global's half (x g_small/g_large)"}
_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[scale_fold_probe {time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def load_weights(args):
    """(MoEWeights, source dict: what was probed, said in the output)."""
    if args.checkpoint is not None:
        from lab.checkpoint import load_checkpoint

        progress(f"reading checkpoint {args.checkpoint}")
        weights, rep = load_checkpoint(args.checkpoint, layer=args.layer)
        return weights, {"kind": "checkpoint", **rep.as_dict()}
    problem = MoEProblem(args.experts, args.hidden, args.intermediate, min(args.top_k, args.experts),
                         args.ratio).validate({f: flag(f) for f in SHAPE_FIELDS} | {"gate_up_ratio": "--ratio"})
    if args.weights == "quantized":
        progress(f"quantizing real-valued weights: {problem.experts} experts, H={problem.hidden}, "
                 f"I={problem.intermediate}")
        weights = quantized_weights(problem, seed=args.seed, progress=progress)
    else:
        progress(f"drawing synthetic codes: {problem.experts} experts, H={problem.hidden}, I={problem.intermediate}")
        weights = random_weights(problem, seed=args.seed)
    return weights, {"kind": "synthetic", "weights": args.weights, "experts": problem.experts,
                     "hidden": problem.hidden, "intermediate": problem.intermediate, "seed": args.seed,
                     "gate_up_ratio": args.ratio}


def code_rows(ratio: float, weights, label: str) -> list[dict]:
    """Table 1: r and 1/r over all codes and over the layer's gate and up scales, then each
    expert's own factor in both directions."""
    i = weights.intermediate
    gate, up = weights.w13_scales[:, :i], weights.w13_scales[:, i:]
    own = gate_up_ratio(weights).astype(np.float64)
    small_half, small_factor = folded_half_scales(weights, "smaller")
    return [
        {"scales": "all 126 finite codes", "fold": f"x {ratio:g}", **fold_stats(FINITE_POSITIVE_CODES, ratio)},
        {"scales": "all 126 finite codes", "fold": f"x 1/{ratio:g}", **fold_stats(FINITE_POSITIVE_CODES, 1.0 / ratio)},
        {"scales": f"{label} gate", "fold": f"x {ratio:g}", **fold_stats(gate, ratio)},
        {"scales": f"{label} up", "fold": f"x 1/{ratio:g}", **fold_stats(up, 1.0 / ratio)},
        {"scales": f"{label} gate", "fold": "x own ratio", **fold_stats(gate, own)},
        {"scales": f"{label} smaller-global half", "fold": "x own g_small/g_large",
         **fold_stats(small_half, small_factor.astype(np.float64))},
    ]


def fraction(v) -> str:
    return "-" if v is None else f"{v:.3e}"


def sample_experts(counts: np.ndarray, n: int, seed: int) -> list[int]:
    """Up to n experts with rows, drawn without replacement (seeded), in order."""
    have = np.flatnonzero(counts > 0)
    if n >= have.size:
        return have.tolist()
    return sorted(np.random.default_rng([seed, 7]).choice(have, size=n, replace=False).tolist())


def direction_scales(weights, into: str) -> tuple[dict, list[dict]]:
    total, per = scale_stats(weights, into)
    errs = np.array([e["mean_rel_err"] for e in per if e["mean_rel_err"] is not None])
    total["inexact_frac"] = total["inexact"] / total["codes"] if total["codes"] else None
    total["per_expert_mean_rel_err"] = ({"min": float(errs.min()), "median": float(np.median(errs)),
                                         "max": float(errs.max())} if errs.size else None)
    return total, per


def scales_line(weights, into: str, total: dict) -> str:
    spread = total["per_expert_mean_rel_err"]
    text = (f"{DIRECTIONS[into]}, each expert's own factor, all {weights.experts} experts: mean rel err "
            f"{format_rel(total['mean_rel_err'], '.4g')}")
    if spread:
        text += f" (per expert {spread['min']:.4g} .. median {spread['median']:.4g} .. {spread['max']:.4g})"
    frac = total["inexact_frac"]
    text += (f", max {format_rel(total['max_rel_err'], '.4g')}; {'-' if frac is None else f'{100 * frac:.1f}'}% of "
             f"{total['codes']} scales changed, {total['saturated']} saturated, {total['flushed_to_zero']} "
             f"flushed to zero")
    if total["codes"] and total["saturated"] == total["codes"]:
        text += ("\n  the fold saturated every one of these scales: each folded block is clamped to 448, and "
                 "option (b) keeps nothing of that half's block scales")
    if total["codes"] and total["flushed_to_zero"] == total["codes"]:
        text += "\n  the fold flushed every one of these scales to zero: option (b) zeroes that half"
    return text


def main(argv=None) -> int:
    d = MoEProblem()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--ratio", type=float, default=d.gate_up_ratio,
                   help="gate global / up global for the all-codes rows, and the synthetic weights' ratio "
                        "(default: the study's 1.2308)")
    p.add_argument("--checkpoint", type=Path, metavar="PATH",
                   help="probe this NVFP4 checkpoint's layer: a .safetensors file, or a directory with "
                        "model.safetensors.index.json")
    p.add_argument("--layer", type=int, help="checkpoint MoE layer (default: the only one)")
    p.add_argument("--weights", choices=["codes", "quantized"], default="codes",
                   help="synthetic weights: codes drawn directly (scales over all 126 codes), or real-valued "
                        "tensors quantized as ModelOpt does (scales crowd towards 448; ~1 s per expert at the "
                        "study's H and I)")
    p.add_argument("--experts", type=int, default=16,
                   help="synthetic weights: experts (each expert's statistics are its own; a few suffice)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="synthetic weights: hidden size H, a multiple of 64")
    p.add_argument("--intermediate", type=int, default=d.intermediate,
                   help="synthetic weights: intermediate size I, a multiple of 64")
    p.add_argument("--seed", type=int, default=0, help="synthetic weights, activations, routing and the sample")
    p.add_argument("--top-k", type=int, default=d.top_k,
                   help="experts each token of the routed batch goes to (at most the experts)")
    p.add_argument("--mean-tokens", type=float, default=8.0, help="routed batch: mean tokens per expert")
    p.add_argument("--sample-experts", type=int, default=8,
                   help="experts whose layer output is computed in float64 (0: skip the layer)")
    p.add_argument("--json", type=output_path, metavar="PATH", help="write every table here as JSON")
    args = p.parse_args(argv)
    if not (np.isfinite(args.ratio) and args.ratio > 0):
        p.error(f"--ratio: must be finite and > 0, got {args.ratio}")
    if args.sample_experts < 0:
        p.error(f"--sample-experts: must be >= 0, got {args.sample_experts}")
    if not (np.isfinite(args.mean_tokens) and args.mean_tokens > 0):
        p.error(f"--mean-tokens: must be > 0, got {args.mean_tokens}")
    if args.top_k < 1:
        p.error(f"--top-k: must be >= 1, got {args.top_k}")
    if args.checkpoint is not None and not args.checkpoint.exists():
        print(f"scale_fold_probe: --checkpoint: no such file or directory: {args.checkpoint}", file=sys.stderr)
        return 2
    try:
        weights, source = load_weights(args)
    except CheckpointError as exc:
        print(f"scale_fold_probe: --checkpoint: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a bad synthetic size
        p.error(str(exc))

    label = source["kind"]
    if label == "checkpoint":
        print(f"checkpoint {source['path']} layer {source['layer']}: {source['experts']} experts, "
              f"H={source['hidden']}, I={source['intermediate']}; gate/up ratio min {source['ratio_min']:.4f} "
              f"mean {source['ratio_mean']:.4f} max {source['ratio_max']:.4f}")
    else:
        how = ("codes drawn directly (lab/problem.random_weights)" if args.weights == "codes" else
               "real-valued tensors quantized (lab/scale_fold.quantized_weights)")
        own = gate_up_ratio(weights)
        print(f"no --checkpoint: synthetic weights, {how}, seed {args.seed}: {source['experts']} experts, "
              f"H={source['hidden']}, I={source['intermediate']}, gate/up ratio {args.ratio:g} (per expert "
              f"{own.min():.4g} .. {own.max():.4g})")
    progress("folding every code and the layer's scales")
    rows = code_rows(args.ratio, weights, label)
    print("\nFolding into e4m3 codes (relative error of a scale):")
    print(tabulate([[r[c] for c in COLUMNS] for r in rows], headers=COLUMNS, floatfmt=".4g", missingval="undefined"))
    if rows[0]["saturated"] == rows[0]["codes"]:
        print(f"x {args.ratio:g} saturates every one of the 126 codes: folded into the gate half, every block "
              f"scale becomes 448")
    if rows[1]["flushed_to_zero"] == rows[1]["codes"]:
        print(f"x 1/{args.ratio:g} flushes every one of the 126 codes to zero")

    scales = {}
    for into in DIRECTIONS:
        progress(f"per-expert scale statistics, {DIRECTIONS[into]}")
        scales[into] = direction_scales(weights, into)
    print()
    for into in DIRECTIONS:
        print(scales_line(weights, into, scales[into][0]))

    effects = {into: None for into in DIRECTIONS}
    if args.sample_experts:
        top_k = min(args.top_k, weights.experts)
        routing = make_routing(tokens_for_mean(args.mean_tokens, weights.experts, top_k), weights.experts, top_k,
                               seed=args.seed)
        x = random_activations(routing.tokens, weights.hidden, seed=args.seed)
        experts = sample_experts(routing.counts, args.sample_experts, args.seed)
        for into in DIRECTIONS:
            progress(f"layer in float64 on {len(experts)} experts, options (a) and (b) {DIRECTIONS[into]}")
            effect = layer_effect(weights, x, routing, experts, into)
            effect.update({"tokens": routing.tokens, "mean_tokens": args.mean_tokens, "top_k": routing.top_k})
            effects[into] = effect
        for into, effect in effects.items():
            per = scales[into][1]
            by_e = {r["expert"]: r for r in effect["per_expert"]}
            table = []
            for e in experts:
                s, b = per[e], by_e[e]
                table.append([e, s["ratio"], s["half"], s["codes"], s["mean_rel_err"], s["max_rel_err"],
                              100 * s["inexact"] / max(1, s["codes"]), s["saturated"], s["flushed_to_zero"],
                              None if b["saturated_energy"] is None else 100 * b["saturated_energy"],
                              b["weights_rel"], b["weights_rel_unsaturated"], b["rows"], b["out_b"]])
            print(f"\nSampled experts, {DIRECTIONS[into]} ({len(experts)} of {weights.experts}, routed batch of "
                  f"{routing.tokens} tokens, mean {args.mean_tokens:g} per expert):")
            print(tabulate(table, headers=EXPERT_COLUMNS, floatfmt=".4g", missingval="undefined"))
        gate, small = effects["gate"], effects["smaller"]
        print(f"\nLayer output on those experts' {gate['rows']} rows, against float64 option (a):")
        print(tabulate([
            ["option (a), bf16 output", format_rel(gate["out_a_bf16"], ".3e"), format_rel(small["out_a_bf16"], ".3e")],
            ["option (b), float64 (the fold alone)", format_rel(gate["out_b"], ".3e"),
             format_rel(small["out_b"], ".3e")],
            ["option (b), bf16 output", format_rel(gate["out_b_bf16"], ".3e"), format_rel(small["out_b_bf16"], ".3e")],
            ["SwiGLU output a, option (b)", format_rel(gate["a_b"], ".3e"), format_rel(small["a_b"], ".3e")],
            ["w2 input codes flipped by the fold (fraction)", fraction(gate["a_q_codes_changed"]),
             fraction(small["a_q_codes_changed"])],
        ], headers=["rel Frobenius", "into the gate half", "into the smaller global"], disable_numparse=True))
        if gate["ref_zero"]:
            print("option (a)'s float64 output is all zero on these rows, so every relative error against it is "
                  "undefined (at this ratio the SwiGLU output falls below the w2 input's smallest NVFP4 value)")
        print("(run_layer's fold-b row measures option (b) into the smaller global against float64 on the GPU, "
              "fp32 output.)")
    print(f"\n({time.perf_counter() - _T0:.1f} s)")
    if args.json:
        gate_total, gate_per = scales["gate"]
        small_total, small_per = scales["smaller"]

        def sampled(per, effect):
            return [per[e] for e in (effect["experts"] if effect else [])]

        doc = {"script": "scripts/scale_fold_probe.py", "argv": list(sys.argv[1:] if argv is None else argv),
               "setup": {"lab_commit": lab_commit()},
               "ratio": args.ratio, "source": source,
               "checkpoint": source if label == "checkpoint" else None,
               "rows": rows, "gate_scales": gate_total, "experts": sampled(gate_per, effects["gate"]),
               "layer": effects["gate"],
               "smaller": {"scales": small_total, "experts": sampled(small_per, effects["smaller"]),
                           "layer": effects["smaller"]}}
        # allow_nan=False: an undefined figure is null, never a bare NaN that JSON readers reject
        Path(args.json).write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
