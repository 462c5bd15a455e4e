"""What does promoting each 128-column group into fp32 buy the W4A8 GEMM? Hopper's fp8 wgmma
adds up its products with fewer mantissa bits than fp32, so a sum over all of K kept in the
tensor core's accumulator loses more as K grows; the shipped kernel (w4a8_gemm<T>) moves each
group's partial sum into an fp32 accumulator with its activation scale (DeepSeek-V3's
promotion). This study runs it beside the form without promotion (w4a8_gemm<T, false>: one
accumulator over K, the row's scale at the end) on the same inputs.

Both forms compute the same contract only where a row has one activation scale, so here the
activations are quantized with one scale per row (lab/w4a8.py quantize_act with group = K, the
scale repeated over the groups); the weights are NVFP4 quantized from Student-t matrices (df 4,
a lognormal spread per row), so p = 3. Two kinds of activations: signed (lab/problem.py
random_activations: N(0, 1) with rare outliers) against the signed weights, and the magnitudes
of both (the weights' sign bits cleared), where every product is positive and no cancellation
hides the accumulator's rounding: the sum only grows along K. Per K and kind,
against the float64 contract (lab/w4a8.py gemm):

    c      |got - gemm| / (2^-12 gemm_abs), its maximum and 99th percentile over the outputs:
           the constant of the tests' bound (tests/test_w4a8_gemm.py C)
    c_step |got - gemm| / (2^-12 step_max), step_max = 2^p sum_g s_x sum over the group's k32 steps
           of the step's largest |x8 w8|: the scale a truncating accumulator's error follows (each
           k32 step aligned to its largest product), measured beside c to find the bound's form
    rel    ||got - gemm|| / ||gemm||

Needs a GPU. --json writes the table, the configuration and the setup (GPU, commit).

    python scripts/w4a8_promotion_study.py
    python scripts/w4a8_promotion_study.py --k 1024 4096 --tokens 64 --json promotion.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate  # noqa: E402

from lab import nvfp4, w4a8  # noqa: E402
from lab.cli import HelpFormatter, output_path  # noqa: E402
from lab.problem import random_activations  # noqa: E402

KINDS = ("signed", "positive")


def nvfp4_weights(rng, n: int, k: int):
    """(1, n, k) NVFP4 weights from Student-t (df 4) rows with a lognormal spread."""
    row = np.exp(0.3 * rng.standard_normal((1, n, 1)))
    t = nvfp4.quantize((rng.standard_t(4, (1, n, k)) * 0.02 * row).astype(np.float32))
    return t.packed, t.scales


def row_scaled(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x8 with one scale per row, and that scale repeated over the row's 128-column groups (the
    kernel's s_x layout)."""
    k = x.shape[1]
    x8, s_row = w4a8.quantize_act(x, group=k)
    return x8, np.ascontiguousarray(np.repeat(s_row, -(-k // w4a8.FP8_GROUP), axis=1))


def step_max(x8: np.ndarray, s_x: np.ndarray, w8: np.ndarray, p: int) -> np.ndarray:
    """(tokens, n) float64: 2^p sum over k32 steps of s_x[t, step's group] max_{k in step} |x8 w8|
    for one expert's e4m3 codes w8 (n, K); a few rows at a time (the products are tokens x n x K)."""
    xd, wd = np.abs(w4a8.decode_e4m3(x8)), np.abs(w4a8.decode_e4m3(w8))
    k = xd.shape[1]
    step_scale = np.repeat(s_x.astype(np.float64), w4a8.FP8_GROUP // 32, axis=1)[:, : k // 32]
    out = np.empty((xd.shape[0], wd.shape[0]))
    for r in range(0, xd.shape[0], 4):
        prod = xd[r:r + 4, None, :] * wd[None, :, :]
        top = prod.reshape(prod.shape[0], wd.shape[0], k // 32, 32).max(axis=-1)
        out[r:r + 4] = (top * step_scale[r:r + 4, None, :]).sum(axis=-1)
    return np.ldexp(out, p)


def measure(cp, wg, k: int, n: int, tokens: int, seed: int) -> list[dict]:
    rng = np.random.default_rng([seed, k])
    signed_w, scales = nvfp4_weights(rng, n, k)
    offsets = np.array([0, tokens], np.int32)
    alpha = np.ones(1, np.float32)
    signed = np.asarray(random_activations(tokens, k, seed=seed + k), np.float32)
    rows = []
    for kind in KINDS:
        x = signed if kind == "signed" else np.abs(signed)
        packed = signed_w if kind == "signed" else signed_w & np.uint8(0x77)  # e2m1's sign is bit 3
        prep = wg.prepare_w4a8_weights(packed, scales)
        prep_d = prep.to_device()
        w8 = w4a8.convert_weights(packed, scales, prep.p).codes
        x8, s_x = row_scaled(x)
        ref = w4a8.gemm(x8, s_x, offsets, w8, prep.p, alpha)
        mag = w4a8.gemm_abs(x8, s_x, offsets, w8, prep.p, alpha)
        top = step_max(x8, s_x, w8[0], int(prep.p[0]))
        row = {"k": k, "kind": kind}
        for promote in (True, False):
            out = cp.full((tokens, n), np.nan, cp.float32)
            wg.w4a8_gemm(prep_d, cp.asarray(x8), cp.asarray(s_x), offsets, alpha, out=out, promote=promote)
            got = out.get().astype(np.float64)
            if not np.isfinite(got).all():
                raise RuntimeError(f"k={k} {kind} promote={promote}: {np.count_nonzero(~np.isfinite(got))} "
                                   "non-finite outputs")
            c = np.abs(got - ref) / (w4a8.ACCUMULATION_REL * mag)
            tag = "promoted" if promote else "unpromoted"
            row[f"{tag}_c_max"] = float(c.max())
            row[f"{tag}_c_p99"] = float(np.percentile(c, 99))
            row[f"{tag}_c_step_max"] = float((np.abs(got - ref) / (w4a8.ACCUMULATION_REL * top)).max())
            row[f"{tag}_rel"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--k", type=int, nargs="+", default=[512, 1024, 2048, 4096, 7168],
                   help="reduction lengths, multiples of 128")
    p.add_argument("--n", type=int, default=256, help="weight rows, a multiple of 64")
    p.add_argument("--tokens", type=int, default=64, help="rows of activations (one expert)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and activations")
    p.add_argument("--json", type=output_path, metavar="PATH", help="write the table here as JSON")
    args = p.parse_args(argv)
    bad = [k for k in args.k if k < 128 or k % 128]
    if bad:
        p.error(f"--k: expected multiples of 128, got {bad}")
    if args.n < 64 or args.n % 64:
        p.error(f"--n: expected a positive multiple of 64, got {args.n}")
    if not 1 <= args.tokens <= 4096:
        p.error(f"--tokens: expected 1 to 4096, got {args.tokens}")

    from lab.gpu import GPUUnavailable, require_gpu

    try:
        cp = require_gpu("the promotion study")
    except GPUUnavailable as exc:
        print(f"w4a8_promotion_study: {exc}", file=sys.stderr)
        return 1
    from lab.device_info import setup_info
    from lab.kernels import w4a8_gemm as wg

    rows = [r for k in args.k for r in measure(cp, wg, k, args.n, args.tokens, args.seed)]
    head = ["K", "activations", "c max promoted", "c max unpromoted", "c p99 promoted", "c p99 unpromoted",
            "c_step max promoted", "c_step max unpromoted", "rel promoted", "rel unpromoted"]
    print(tabulate([[r["k"], r["kind"], f"{r['promoted_c_max']:.3f}", f"{r['unpromoted_c_max']:.3f}",
                     f"{r['promoted_c_p99']:.3f}", f"{r['unpromoted_c_p99']:.3f}", f"{r['promoted_c_step_max']:.3f}",
                     f"{r['unpromoted_c_step_max']:.3f}", f"{r['promoted_rel']:.2e}",
                     f"{r['unpromoted_rel']:.2e}"] for r in rows], head, tablefmt="github"))
    if args.json:
        run = {"question": "the W4A8 GEMM's accumulation error with and without per-group promotion",
               "command": "python scripts/w4a8_promotion_study.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "config": {"k": args.k, "n": args.n, "tokens": args.tokens, "seed": args.seed},
               "setup": setup_info(), "rows": rows}
        Path(args.json).write_text(json.dumps(run, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
