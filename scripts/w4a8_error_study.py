"""What does W4A8 (NVFP4 weights as e4m3, fp8 activations, lab/w4a8.py) cost in accuracy, next
to the other ways of running NVFP4 weights? A float64 simulation on the CPU.

Real-valued heavy-tailed weights (Student-t with --df degrees of freedom, a lognormal spread per
output row) are quantized to NVFP4 with lab's quantizer (nvfp4.quantize: gate, up and down each
a matrix with its own global). Tokens are lab/problem.random_activations (N(0, 1) with rare
outliers), routed to --experts experts (top --top-k). Every variant is compared with the float64
layer on unquantized activations with those NVFP4 weights (reference.layer_unquantized's
arithmetic), the error its user pays, as checks.rel_error ||out - ref|| / ||ref||:

    w4a16        activations (x and the SwiGLU output) rounded to bf16, weights exact
    w4a8         lab/w4a8.py layer_rows: 1x128 fp8 activations, weights e4m3 with a p per expert
    w4a8-row     the same with a p per weight row
    a8-only      1x128 fp8 activations, NVFP4 weights exact (the activations' share of w4a8)
    w8-only      w4a8's e4m3 weights (p per expert), activations exact (the weights' share of w4a8)
    fp8-rowwise  a torch fp8 peer: the dequantized NVFP4 weights (globals applied) re-quantized
                 to e4m3 with one amax/448 scale per row, activations with one per token
    rowwise-w-only  fp8-rowwise's weights, activations exact (the weights' share of fp8-rowwise)
    w4a4         the lab's NVFP4 activations (reference.layer_rows), static input scales
                 calibrated on this batch (amax / 2688 of x and of the unquantized SwiGLU output)

--weights synthetic draws the weights as the GPU scripts do instead (lab/problem.py
random_weights: random codes, half the block scales over all of e4m3, half in a band of real
tensors' scales), the layer the token axis judges W4A8's error on.

A second table counts the weights the e4m3 conversion changes (rounded), those below e4m3's
normal range (subnormal) and those it zeroes (flushed), per matrix and in all, for both p rules.
--json writes both tables and the configuration.

    python scripts/w4a8_error_study.py
    python scripts/w4a8_error_study.py --df 3 --experts 4 --top-k 2 --json w4a8_error.json
    python scripts/w4a8_error_study.py --weights synthetic --experts 4 --top-k 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate  # noqa: E402

from lab import nvfp4, reference, w4a8  # noqa: E402
from lab.cli import HelpFormatter, output_path  # noqa: E402
from lab.checks import format_rel, rel_error  # noqa: E402
from lab.problem import (HEAVY_TAILED_ROW_SPREAD, HEAVY_TAILED_STD, MoEProblem, MoEWeights,  # noqa: E402
                         heavy_tailed_weights, make_routing, random_activations, random_weights)

def _silu(g):
    return g / (1.0 + np.exp(-g))


def dequantized(w: MoEWeights, e: int) -> tuple[np.ndarray, np.ndarray]:
    """(w13 (2I, H), w2 (H, I)) float64 of expert e with every global applied."""
    I = w.intermediate
    w13 = nvfp4.dequantize_blocks(w.w13_packed[e], w.w13_scales[e])
    w13[:I] *= float(w.gate_global[e])
    w13[I:] *= float(w.up_global[e])
    return w13, nvfp4.dequantize_blocks(w.w2_packed[e], w.w2_scales[e]) * float(w.w2_global[e])


def w4a8_dequantized(w: MoEWeights, e: int) -> tuple[np.ndarray, np.ndarray]:
    """dequantized()'s matrices as W4A8 runs them: e4m3 codes (p per expert) times 2^p and the globals."""
    I = w.intermediate
    mats = []
    for packed, scales in ((w.w13_packed[e], w.w13_scales[e]), (w.w2_packed[e], w.w2_scales[e])):
        c = w4a8.convert_weights(packed, scales)
        mats.append(np.ldexp(w4a8.decode_e4m3(c.codes), int(c.p)))
    mats[0][:I] *= float(w.gate_global[e])
    mats[0][I:] *= float(w.up_global[e])
    return mats[0], mats[1] * float(w.w2_global[e])


def run_layer(x_rows, offsets, w: MoEWeights, act, weight=None, matrices=dequantized) -> tuple[np.ndarray, np.ndarray]:
    """The layer in float64 with act() applied to x and to the SwiGLU output (the identity for the
    reference) and weight() to each of matrices()'s (dequantized by default): (out (rows, H),
    SwiGLU output (rows, I))."""
    I = w.intermediate
    out = np.zeros((x_rows.shape[0], w.hidden))
    a_all = np.zeros((x_rows.shape[0], I))
    for e in range(w.experts):
        r0, r1 = offsets[e], offsets[e + 1]
        if r1 == r0:
            continue
        w13, w2 = matrices(w, e)
        if weight is not None:
            w13, w2 = weight(w13), weight(w2)
        h = act(x_rows[r0:r1]) @ w13.T
        a = _silu(h[:, :I]) * h[:, I:]
        a_all[r0:r1] = a
        out[r0:r1] = act(a) @ w2.T
    return out, a_all


def bf16(v):
    return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def fp8_1x128(v):
    x8, s = w4a8.quantize_act(v)
    return w4a8.decode_e4m3(x8) * np.repeat(s.astype(np.float64), w4a8.FP8_GROUP, axis=1)[:, : v.shape[1]]


def fp8_rowwise(v):
    """One amax/448 scale per row (lab/w4a8.py's recipe with the whole row as one group)."""
    x8, s = w4a8.quantize_act(v, group=v.shape[1])
    return w4a8.decode_e4m3(x8) * s.astype(np.float64)


def weight_stats(w: MoEWeights, per_row: bool) -> list[dict]:
    rows, total = [], dict(size=0, rounded=0, subnormal=0, flushed=0, nonzero=0)
    for name, packed, scales in (("w13", w.w13_packed, w.w13_scales), ("w2", w.w2_packed, w.w2_scales)):
        c = w4a8.convert_weights(packed, scales, per_row=per_row)
        d = dict(size=c.size, rounded=c.rounded, subnormal=c.subnormal, flushed=c.flushed, nonzero=c.nonzero)
        for k in total:
            total[k] += d[k]
        rows.append(dict(matrix=name, p_rule="row" if per_row else "expert", p_min=int(c.p.min()),
                         p_max=int(c.p.max()), **d))
    rows.append(dict(matrix="all", p_rule="row" if per_row else "expert", p_min=None, p_max=None, **total))
    for r in rows:
        for k in ("rounded", "subnormal", "flushed", "nonzero"):
            r[f"{k}_fraction"] = r[k] / r["size"]
    return rows


def study(args) -> dict:
    problem = MoEProblem(args.experts, args.hidden, args.intermediate, args.top_k).validate()
    w = (heavy_tailed_weights(problem, args.df, args.seed) if args.weights == "student-t"
         else random_weights(problem, args.seed))
    routing = make_routing(args.tokens, problem.experts, problem.top_k, seed=args.seed)
    x_rows = random_activations(args.tokens, problem.hidden, args.seed)[routing.row_token].astype(np.float64)
    offsets = routing.offsets.astype(np.int64)

    ref, a_ref = run_layer(x_rows, offsets, w, lambda v: v)
    # static NVFP4 input scales, calibrated on this batch as a checkpoint's would be on its own
    w.w13_input_scale = float(np.float32(np.abs(x_rows).max() / 2688.0))
    w.w2_input_scale = float(np.float32(np.abs(a_ref).max() / 2688.0))

    outs = {
        "w4a16": run_layer(x_rows, offsets, w, bf16)[0],
        "w4a8": w4a8.layer_rows(x_rows, offsets, w)["out"],
        "w4a8-row": w4a8.layer_rows(x_rows, offsets, w, per_row=True)["out"],
        "a8-only": run_layer(x_rows, offsets, w, fp8_1x128)[0],
        "w8-only": run_layer(x_rows, offsets, w, lambda v: v, matrices=w4a8_dequantized)[0],
        "fp8-rowwise": run_layer(x_rows, offsets, w, fp8_rowwise, fp8_rowwise)[0],
        "rowwise-w-only": run_layer(x_rows, offsets, w, lambda v: v, fp8_rowwise)[0],
        "w4a4": reference.layer_rows(x_rows, offsets, w)["out"],
    }
    errors = [dict(variant=k, rel_error=rel_error(v, ref)) for k, v in outs.items()]
    return dict(
        config=dict(experts=problem.experts, hidden=problem.hidden, intermediate=problem.intermediate,
                    tokens=args.tokens, top_k=problem.top_k, weights=args.weights, df=args.df, seed=args.seed,
                    weight_std=HEAVY_TAILED_STD, row_spread=HEAVY_TAILED_ROW_SPREAD),
        errors=errors,
        weights=weight_stats(w, False) + weight_stats(w, True),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--experts", type=int, default=1, help="experts of the layer (default 1: one dense FFN)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H, a multiple of 64")
    p.add_argument("--intermediate", type=int, default=512, help="intermediate size I, a multiple of 64")
    p.add_argument("--tokens", type=int, default=512, help="tokens of the batch")
    p.add_argument("--top-k", type=int, default=1, help="experts per token (at most --experts)")
    p.add_argument("--weights", choices=("student-t", "synthetic"), default="student-t",
                   help="NVFP4 quantized from Student-t matrices, or lab/problem.py random_weights (the GPU scripts' layer)")
    p.add_argument("--df", type=float, default=4.0, help="Student-t degrees of freedom of the real weights")
    p.add_argument("--seed", type=int, default=0, help="weights, tokens and routing")
    p.add_argument("--json", type=output_path, metavar="PATH", help="write the tables here as JSON")
    args = p.parse_args(argv)
    if args.tokens < 1:
        p.error(f"--tokens: must be >= 1, got {args.tokens}")
    if not (np.isfinite(args.df) and args.df > 0):
        p.error(f"--df: must be finite and > 0, got {args.df}")
    try:
        res = study(args)
    except ValueError as exc:  # a bad size
        p.error(str(exc))
    c = res["config"]
    print(f"E={c['experts']} H={c['hidden']} I={c['intermediate']} tokens={c['tokens']} top_k={c['top_k']} "
          + (f"Student-t df={c['df']}" if c["weights"] == "student-t" else "synthetic weights") + f" seed={c['seed']}")
    print(tabulate([[r["variant"], format_rel(r["rel_error"])] for r in res["errors"]],
                   headers=["variant", "rel error vs float64 layer (unquantized activations)"]))
    print()
    print(tabulate([[r["matrix"], r["p_rule"], "" if r["p_min"] is None else f"{r['p_min']}..{r['p_max']}",
                     f"{r['rounded_fraction']:.4f}", f"{r['subnormal_fraction']:.2e}", f"{r['flushed_fraction']:.2e}",
                     f"{r['nonzero_fraction']:.4f}"] for r in res["weights"]],
                   headers=["matrix", "p per", "p", "rounded", "subnormal", "flushed", "nonzero"]))
    if args.json:
        from lab.device_info import lab_commit

        run = {"script": "scripts/w4a8_error_study.py", "argv": sys.argv[1:] if argv is None else list(argv),
               "setup": {"lab_commit": lab_commit(), "device": "CPU (float64 NumPy)"}, **res}
        Path(args.json).write_text(json.dumps(run, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
