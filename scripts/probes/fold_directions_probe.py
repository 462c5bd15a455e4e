"""Probe: fold-b's layer error against float64, folding the gate/up ratio into the gate half or into the half with the smaller global."""
# Option (b) folds each expert's gate/up global ratio into one half's e4m3 block scales at load.
# Into the gate half (x r) the largest scales saturate; into the half with the smaller global
# (x g_small / g_large <= 1) nothing saturates. Both run through the fold-b variant on the
# device and are compared with the float64 layer of option (a) (the lab's reference) and with
# the float64 layer on unquantized activations (lab/scale_fold.py, notes/layer.md).
import sys

import ml_dtypes
import numpy as np
from tabulate import tabulate

from lab import checks, reference, scale_fold
from lab.gemm_bench import log, problem_of, study_parser, write_json
from lab.gpu import require_gpu, run_script
from lab.problem import make_routing, random_activations, random_weights, tokens_for_mean

TAG = "fold_directions_probe"


def main(argv=None):
    ap = study_parser(__doc__, [8], 1)
    ap.add_argument("--weights", choices=["synthetic", "quantized"], default="synthetic",
                    help="synthetic codes, or real-valued tensors quantized as ModelOpt does (scale_fold)")
    ap.add_argument("--check-experts", type=int, default=16, help="experts (seeded sample) compared with float64")
    args = ap.parse_args(argv)
    require_gpu(TAG)  # before any output: without a GPU, one line
    from lab.layer import load_layer, upload_weights
    from lab.runner import Runner
    from lab.variants import fold_b

    problem = problem_of(args)
    weights = (random_weights(problem, seed=args.seed) if args.weights == "synthetic"
               else scale_fold.quantized_weights(problem, seed=args.seed))
    rows_out = []
    for mean in args.mean_tokens:
        routing = make_routing(tokens_for_mean(mean, problem.experts, problem.top_k), problem.experts,
                               problem.top_k, seed=args.seed)
        x = random_activations(routing.tokens, problem.hidden, seed=args.seed)
        experts = checks.sample_experts(routing.counts, args.check_experts, seed=args.seed)
        sel = checks.expert_rows(routing.offsets, experts)
        ref_a = reference.layer(x, routing, weights, experts=experts)["out"][sel]
        e2e_rows, ref_e2e = reference.layer_unquantized(x, routing, weights, experts)
        for into in ("gate", "smaller"):
            fold_b.INTO = into
            dweights = upload_weights(weights)  # a fresh cache: the folded w13 is built for this direction
            runner = Runner()
            layer = load_layer(runner, dweights, routing, x)
            v = fold_b.FoldB()
            runner.prepare(v, layer)
            runner.checked_run(v, layer)
            bf16 = layer.out_bf16.get().view(ml_dtypes.bfloat16).astype(np.float64)
            _, _, saturated = scale_fold.fold_w13_scales(weights, into)
            row = {"mean": mean, "into": into, "saturated_scales": int(saturated.sum()),
                   "vs_option_a": checks.rel_error(layer.out.get()[sel].astype(np.float64), ref_a),
                   "vs_unquantized": checks.rel_error(bf16[e2e_rows], ref_e2e)}
            rows_out.append(row)
            log(TAG, f"mean {mean:g}, into {into}: {row}")
    print(tabulate([[r["mean"], r["into"], r["saturated_scales"], checks.format_rel(r["vs_option_a"]),
                     checks.format_rel(r["vs_unquantized"])] for r in rows_out],
                   headers=["tokens/expert", "fold into", "saturated scales", "vs float64, option (a)",
                            "vs float64, unquantized activations"]))
    write_json(args.json, "scripts/probes/fold_directions_probe.py", weights=args.weights, rows=rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main, TAG))
