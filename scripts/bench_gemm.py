"""Grouped GEMM benchmark: the lab's GEMM against the read roofline measured in the same run.

For w13 and w2 of the study's problem at each mean tokens per expert it times
  - the flat streaming read (the roofline; once per run),
  - `read-pattern`: the GEMM's own grid, pipeline and copies with no decode or MMA (the
    achievable read rate of exactly this access pattern),
  - the GEMM itself,
  - cuBLAS on fp16 weights dequantized at load (e2m1 x e4m3 is exact in fp16), strided-batched
    over experts padded to the largest count: the row a user would pick instead,
and prints one table (gemm, tokens, ms, GB/s, % of roofline, % of same-pattern read).
"Bytes" are what the GEMM must move: weights of experts with tokens, activations in, fp32 out.

    python scripts/bench_gemm.py --json results/bench_gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from tabulate import tabulate

from lab import nvfp4, reference
from lab.device_info import setup_info
from lab.kernels import grouped_gemm as gg
from lab.kernels.stream_read import measure_read_roofline
from lab.problem import (W2_INPUT_SCALE, W13_INPUT_SCALE, MoEProblem, make_routing, random_activations,
                         random_weights, tokens_for_mean)
from lab.timing import time_cuda


def log(msg: str) -> None:
    print(f"[bench_gemm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def dequant_fp16(cp, packed, scales, chunk: int = 16):
    """(E, N, K) fp16 of e2m1 x e4m3 (no global): exact in fp16."""
    e, n, k2 = packed.shape
    out = cp.empty((e, n, 2 * k2), dtype=cp.float16)
    lut = cp.asarray(nvfp4.E2M1_VALUES.astype(np.float16))
    slut = cp.asarray(nvfp4.decode_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float16))
    for e0 in range(0, e, chunk):
        p = cp.asarray(packed[e0:e0 + chunk])
        codes = cp.stack([lut[p & 0xF], lut[p >> 4]], axis=-1).reshape(p.shape[0], n, 2 * k2)
        s = slut[cp.asarray(scales[e0:e0 + chunk])]
        out[e0:e0 + chunk] = (codes.reshape(p.shape[0], n, -1, 16) * s[..., None]).reshape(codes.shape)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mean-tokens", type=float, nargs="+", default=[2, 4, 8, 32])
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--skew", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--check-experts", type=int, default=16, help="experts checked against float64 (0: none)")
    ap.add_argument("--no-cublas", action="store_true")
    ap.add_argument("--config", action="append", default=[],
                    help="override the tile: warps,row_tiles,k_step,stages[,mma] (token tile from the heuristic; "
                         "mma 0 = mma.sync, 1 = wgmma); "
                         "repeat to time several tiles in one run")
    ap.add_argument("--json", help="write everything here")
    args = ap.parse_args(argv)

    problem = MoEProblem(args.experts, args.hidden, args.intermediate, args.top_k).validate()
    from lab.gpu import require_gpu

    cp = require_gpu("bench_gemm")
    setup = setup_info()
    log(f"setup: {setup}")

    log("read roofline (flat streaming read of 4.077 GB)")
    roof = measure_read_roofline(iterations=args.iterations)
    bw = roof["gbps"]
    log(f"read roofline {bw:.0f} GB/s")

    log("weights: generating on the host")
    w = random_weights(problem, seed=args.seed)
    gemms = {
        "w13": dict(packed=w.w13_packed, scales=w.w13_scales, n=2 * problem.intermediate, k=problem.hidden,
                    input_scale=W13_INPUT_SCALE, alpha=lambda g: np.full(problem.experts, g, np.float32)),
        "w2": dict(packed=w.w2_packed, scales=w.w2_scales, n=problem.hidden, k=problem.intermediate,
                   input_scale=W2_INPUT_SCALE, alpha=lambda g: (np.float32(g) * w.w2_global).astype(np.float32)),
    }
    overrides = [tuple(int(v) for v in c.split(",")) for c in args.config] or [None]
    preps = {}

    def prepared(gm, override):
        layout = (override[0] * override[1] * gg.ATOM_ROWS, override[2]) if override else gg.default_layout(gm["n"], gm["k"])
        key = (id(gm), layout)
        if key not in preps:
            for old in [k for k in preps if k[0] == id(gm)]:
                del preps[old]  # one layout per GEMM on the device at a time
            log(f"preparing the kernel layout {layout} on the GPU")
            preps[key] = gg.prepare_weights(gm["packed"], gm["scales"], xp=cp, layout=layout)
        return preps[key]
    cp.cuda.Device().synchronize()

    rows_out, checks = [], []
    rng = np.random.default_rng(args.seed + 17)
    for mean in args.mean_tokens:
        tokens = tokens_for_mean(mean, problem.experts, problem.top_k)
        routing = make_routing(tokens, problem.experts, problem.top_k, skew=args.skew, seed=args.seed)
        counts, offsets = routing.counts, routing.offsets
        d_off = cp.asarray(offsets.astype(np.int32))
        active = counts > 0
        for (name, gm), override in [(item, o) for o in overrides for item in gemms.items()]:
            n, k = gm["n"], gm["k"]
            gm["prep"] = prepared(gm, override)
            x = random_activations(routing.rows, k, seed=args.seed + int(mean * 10) + len(name))
            xq = nvfp4.quantize(x, gm["input_scale"])
            alpha = gm["alpha"](xq.global_scale)
            d_xp, d_xs = cp.asarray(xq.packed), cp.asarray(xq.scales)
            d_alpha = cp.asarray(alpha)
            out = cp.full((routing.rows, n), cp.nan, dtype=cp.float32)
            cfg = gg.heuristic(n, k, counts, layout=(gm["prep"].block_rows, gm["prep"].k_step))
            if override:
                cfg = gg.GemmConfig(*override[:4], cfg.max_frags, *override[4:]).validate(n, k)
            log(f"{name} mean {mean}: {routing.rows} rows, max count {counts.max()}, {cfg}")

            def run(read_only=False):
                gg.grouped_gemm(gm["prep"], d_xp, d_xs, d_off, d_alpha, out, cfg, read_only=read_only)

            run()
            cp.cuda.Device().synchronize()
            got = out.get()
            # correctness on a sample of experts with tokens (poisoned output: NaN if unwritten)
            if args.check_experts:
                pool = np.flatnonzero(active)
                sample = rng.choice(pool, size=min(args.check_experts, pool.size), replace=False)
                ref = reference.grouped_gemm(xq.packed, xq.scales, offsets, gm["packed"], gm["scales"],
                                             alpha, experts=sample)
                rows_sel = np.concatenate([np.arange(offsets[e], offsets[e + 1]) for e in sample])
                err = reference.rel_frobenius(got[rows_sel], ref[rows_sel])
                checks.append({"gemm": name, "mean": mean, "experts": sample.tolist(), "rel_frobenius": err})
                log(f"  check vs float64 on {sample.size} experts: rel Frobenius {err:.2e}")
            unwritten = int(np.isnan(got).sum())
            if unwritten:
                log(f"  ERROR: {unwritten} output elements not written")
            t_gemm = time_cuda(run, iterations=args.iterations)
            t_read = time_cuda(lambda: run(True), iterations=args.iterations)
            wbytes = int(active.sum()) * n * k * 9 // 16
            nbytes = wbytes + xq.packed.nbytes + xq.scales.nbytes + routing.rows * n * 4
            t_roof = nbytes / (bw * 1e9) * 1e3
            row = {"gemm": name, "mean_tokens": mean, "rows": routing.rows, "max_count": int(counts.max()),
                   "config": cfg.__dict__, "bytes": nbytes, "weight_bytes": wbytes,
                   "ms": t_gemm.median_ms, "ms_min": t_gemm.min_ms, "ms_max": t_gemm.max_ms,
                   "read_pattern_ms": t_read.median_ms, "gbps": nbytes / t_gemm.median_ms / 1e6,
                   "roof_pct": 100 * t_roof / t_gemm.median_ms,
                   "pattern_pct": 100 * t_read.median_ms / t_gemm.median_ms,
                   "read_pattern_roof_pct": 100 * t_roof / t_read.median_ms,
                   "unwritten": unwritten}
            if not args.no_cublas:
                row.update(bench_cublas(cp, gm, counts, offsets, d_xp, d_xs, n, k, args.iterations))
            rows_out.append(row)
            log(f"  gemm {row['ms']:.3f} ms ({row['roof_pct']:.1f}% of roofline), read pattern "
                f"{t_read.median_ms:.3f} ms, cublas-fp16 {row.get('cublas_ms', float('nan')):.3f} ms")
            del out

    table = [[r["gemm"], r["mean_tokens"], "{warps},{row_tiles},{k_step},{stages},{max_frags}".format(**r["config"]), f"{r['ms']:.3f}", f"{r['gbps']:.0f}", f"{r['roof_pct']:.1f}",
              f"{r['pattern_pct']:.1f}", f"{r['read_pattern_ms']:.3f}", f"{r.get('cublas_ms', float('nan')):.3f}"]
             for r in rows_out]
    print(f"read roofline: {bw:.0f} GB/s (flat streaming read, {roof['bytes'] / 1e9:.3f} GB)")
    print(tabulate(table, headers=["gemm", "tokens/expert", "tile W,R,BK,S,F", "ms", "GB/s", "% roofline", "% same-pattern read",
                                   "read-pattern ms", "cublas-fp16 ms"]))
    for c in checks:
        print(f"check {c['gemm']} mean {c['mean']}: rel Frobenius {c['rel_frobenius']:.2e} on {len(c['experts'])} experts")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"script": "scripts/bench_gemm.py", "argv": sys.argv[1:], "setup": setup,
                       "read_roofline": roof, "rows": rows_out, "checks": checks}, f, indent=1)
    bad = any(c["rel_frobenius"] > 1e-5 for c in checks) or any(r["unwritten"] for r in rows_out)
    return 1 if bad else 0


def bench_cublas(cp, gm, counts, offsets, d_xp, d_xs, n, k, iterations) -> dict:
    """fp16 weights (exact e2m1 x e4m3) through cuBLAS strided-batched GEMM over padded experts."""
    if "fp16" not in gm:
        gm["fp16"] = dequant_fp16(cp, gm["packed"], gm["scales"])  # (E, N, K)
    wt = gm["fp16"]
    e = wt.shape[0]
    m = int(counts.max())
    lut = cp.asarray(nvfp4.E2M1_VALUES.astype(np.float16))
    slut = cp.asarray(nvfp4.decode_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float16))
    codes = cp.stack([lut[d_xp & 0xF], lut[d_xp >> 4]], axis=-1).reshape(d_xp.shape[0], k)
    xdec = (codes.reshape(-1, k // 16, 16) * slut[d_xs][..., None]).reshape(-1, k)
    xpad = cp.zeros((e, m, k), dtype=cp.float16)
    for ex in np.flatnonzero(counts):
        xpad[ex, :counts[ex]] = xdec[offsets[ex]:offsets[ex + 1]]
    wT = wt.transpose(0, 2, 1)
    out = cp.empty((e, m, n), dtype=cp.float16)

    def run():
        cp.matmul(xpad, wT, out=out)

    t = time_cuda(run, iterations=max(3, iterations // 2))
    return {"cublas_ms": t.median_ms, "cublas_padded_m": m}


if __name__ == "__main__":
    sys.exit(main())
