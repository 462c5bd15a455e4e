"""Probe: what does a unit of the large-token tile cost beyond its K steps?"""
# w2 (K = I = 2048) sits 4-6 points below w13 (K = H = 4096) on the same 160-token tile past 512
# tokens per expert, with the same units (4096 rows each): a cost per unit that does not scale
# with K (epilogue, the unit's first stages, the scheduler) weighs twice as much in w2. This
# probe measures it directly: one grouped GEMM of N = 4096 rows at one routing, K swept, the
# heuristic's tile for each K, rounds alternating over K; time = fixed + slope * K fitted by least
# squares per mean and output form (fp32, or bf16 bits through the image tile's bf16 epilogue).
# The fixed share at K 2048 is what an epilogue overlapped with the next unit's mainloop could
# take off w2 at most.
import argparse
import sys

import numpy as np

from lab.cli import output_path
from lab.gemm_bench import write_json
from lab.gpu import require_gpu, run_script
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg
from lab.problem import make_routing, tokens_for_mean
from lab.timing import time_cuda_samples


def random_nvfp4(rng, shape):
    """Random e2m1 code pairs and e4m3 scale codes 100..120 (finite, no overflow at these K)."""
    packed = rng.integers(0, 256, shape[:-1] + (shape[-1] // 2,), dtype=np.uint8)
    scales = rng.integers(100, 121, shape[:-1] + (shape[-1] // 16,), dtype=np.uint8)
    return packed, scales


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mean-tokens", type=float, nargs="+", default=[512.0, 2048.0])
    ap.add_argument("--k", type=int, nargs="+", default=[1024, 2048, 3072, 4096], help="K values (multiples of 256)")
    ap.add_argument("--n", type=int, default=4096, help="rows of each expert's weights")
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--out", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=output_path, metavar="PATH", help="write the rows and fits here")
    args = ap.parse_args(argv)
    for k in args.k:
        if k % 256:
            ap.error(f"--k: each K must be a multiple of 256, got {k}")
    cp = require_gpu("unit_cost_probe")
    rng = np.random.default_rng(0)
    rows, fits = [], []
    weights = {}  # K -> (packed, scales) on the host, drawn once for every mean
    for k in args.k:
        weights[k] = random_nvfp4(rng, (args.experts, args.n, k))
    for mean in args.mean_tokens:
        routing = make_routing(tokens_for_mean(mean, args.experts, args.top_k), args.experts, args.top_k, seed=0)
        counts = routing.counts
        off = cp.asarray(routing.offsets.astype(np.int32))
        t = int(routing.offsets[-1])
        alpha = cp.asarray(rng.uniform(0.5, 2, args.experts).astype(np.float32))
        cases = {}
        for k in args.k:
            cfg = gc.heuristic(args.n, k, counts)
            prep = gw.prepare_weights(*weights[k], xp=cp, layout=(cfg.block_rows, cfg.k_step))
            xq, xs = random_nvfp4(rng, (t, k))
            dev = (cp.asarray(xq), cp.asarray(xs))
            outs = {"fp32": cp.full((t, args.n), cp.nan, cp.float32),
                    "bf16": cp.full((t, args.n), 0xFFFF, cp.uint16)}
            nonfinite = cp.zeros(1, cp.uint32)
            for form in args.out:
                o = outs[form]
                fn = (lambda prep=prep, dev=dev, o=o, cfg=cfg, nf=nonfinite:
                      gg.grouped_gemm(prep, *dev, off, alpha, o, cfg, nonfinite=nf if o.dtype == cp.uint16 else None))
                fn()
                cp.cuda.Device().synchronize()
                got = o.get()
                unwritten = int(np.isnan(got).sum()) if form == "fp32" else int((got == 0xFFFF).sum())
                cases[(k, form)] = dict(fn=fn, cfg=cfg, unwritten=unwritten, prep=prep, ms=[])
        for _ in range(args.rounds):
            for key, c in cases.items():
                c["ms"].append(float(np.median(time_cuda_samples(c["fn"], args.iterations, 2))))
        for form in args.out:
            ks = np.array([k for k in args.k], np.float64)
            best = np.array([min(cases[(k, form)]["ms"]) for k in args.k])
            med = np.array([float(np.median(cases[(k, form)]["ms"])) for k in args.k])
            for k, b, m in zip(args.k, best, med):
                c = cases[(k, form)]
                flops = 2.0 * t * args.n * k
                rows.append({"mean_tokens": mean, "k": k, "n": args.n, "out": form, "config": c["cfg"].expression,
                             "round_ms": c["ms"], "ms": b, "median_ms": m, "tflops": flops / b / 1e9,
                             "unwritten": c["unwritten"]})
                print(f"mean {mean:.0f} K {k:5d} {form}: {b:.4f} ms (median {m:.4f}; rounds "
                      f"{' '.join(f'{v:.4f}' for v in c['ms'])}) {flops / b / 1e9:.1f} TFLOP/s "
                      f"unwritten {c['unwritten']}", flush=True)
            for label, y in (("fastest", best), ("median", med)) if len(set(args.k)) > 1 else ():  # (a line needs two K)
                slope, fixed = np.polyfit(ks, y, 1)
                resid = float(np.max(np.abs(y - (fixed + slope * ks))))
                at2048 = fixed / (fixed + slope * 2048)
                at4096 = fixed / (fixed + slope * 4096)
                fits.append({"mean_tokens": mean, "out": form, "rounds": label, "fixed_ms": float(fixed),
                             "ms_per_k1024": float(slope * 1024), "max_residual_ms": resid,
                             "fixed_share_k2048": float(at2048), "fixed_share_k4096": float(at4096)})
                print(f"mean {mean:.0f} {form} ({label}): fixed {fixed:.4f} ms + {slope * 1024:.4f} ms per 1024 of K "
                      f"(max residual {resid:.4f}); fixed share at K 2048 {100 * at2048:.1f}%, at 4096 "
                      f"{100 * at4096:.1f}%", flush=True)
        del cases
        cp.get_default_memory_pool().free_all_blocks()
    write_json(args.json, "scripts/probes/unit_cost_probe.py", rows=rows, fits=fits)
    return 1 if any(r["unwritten"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(run_script(main, "unit_cost_probe"))
