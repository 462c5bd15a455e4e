"""Probe: do mma.sync and wgmma tiles write the same bits (NVFP4 activations)?"""
# For skewed routings at mean 8 it runs one grouped GEMM three ways on the same inputs: one launch
# of the heuristic's tile (mma.sync at these skews), the split by expert size at 16 with the hot
# experts on mma.sync tiles, and the same split with them on the wgmma image tile; it counts the
# output elements whose bits differ from the one launch, in the hot and the cold experts' rows.
# gemm_plan relies on the answer (each k16 step's products sum exactly in fp32: gemm_config.gemm_plan).
import argparse
import sys

import numpy as np

from lab.cli import output_path
from lab.gemm_bench import write_json
from lab.gpu import require_gpu, run_script
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg
from lab.problem import make_routing

# (N, K, experts, skew, activation scale codes [lo, hi)); weights' scale codes 1..126
CASES = ((4096, 2048, 288, 1.2, (1, 127)), (4096, 4096, 288, 0.8, (1, 127)),
         (2048, 2048, 128, 1.2, (1, 255)), (1024, 1024, 64, 1.2, (100, 127)))


def random_nvfp4(rng, shape, scale_codes):
    packed = rng.integers(0, 256, shape[:-1] + (shape[-1] // 2,), dtype=np.uint8)
    scales = rng.integers(*scale_codes, shape[:-1] + (shape[-1] // 16,), dtype=np.uint8)
    return packed, np.minimum(scales, 126).astype(np.uint8)  # (127: the e4m3 NaN; above: negative)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=output_path, metavar="PATH", help="write the counts here")
    args = ap.parse_args(argv)
    cp = require_gpu("tile_families_probe")  # before any output: without a GPU, one line
    rows = []
    for seed, (n, k, e, skew, scodes) in enumerate(CASES):
        rng = np.random.default_rng(seed)
        counts = make_routing(e, e, 8, skew=skew, seed=seed).counts  # mean 8 tokens per expert
        off = np.r_[0, np.cumsum(counts)].astype(np.int32)
        rows_t = int(off[-1])
        packed, scales = random_nvfp4(rng, (e, n, k), (1, 127))
        xq, xs = random_nvfp4(rng, (rows_t, k), scodes)
        alpha = rng.uniform(0.5, 2, e).astype(np.float32)
        one = gc.heuristic(n, k, counts)
        plans = {"one": ((one, gc.ALL_COUNTS),), "sync-split": gc.split_configs(n, k, counts, 16, wgmma=False),
                 "wgmma-split": gc.split_configs(n, k, counts, 16)}
        prep = gw.prepare_weights(packed, scales, xp=cp, layout=(one.block_rows, one.k_step))
        dev = (cp.asarray(xq), cp.asarray(xs), cp.asarray(off), cp.asarray(alpha))
        outs = {}
        for name, plan in plans.items():
            o = cp.full((rows_t, n), cp.nan, cp.float32)
            gg.grouped_gemm_plan(prep, *dev, o, plan)
            outs[name] = o.get().view(np.uint32)
        hot = np.repeat(counts > 16, counts)
        for name in ("sync-split", "wgmma-split"):
            d = outs[name] != outs["one"]
            row = {"case": seed, "n": n, "k": k, "experts": e, "skew": skew, "act_scale_codes": list(scodes),
                   "plan": name, "tiles": [f"{c.max_frags * 8}{'w' if c.mma else 's'}" for c, _ in plans[name]],
                   "elements": int(d.size), "differ": int(d.sum()), "differ_hot": int(d[hot].sum()),
                   "differ_cold": int(d[~hot].sum()), "unwritten": int(np.isnan(outs[name].view(np.float32)).sum())}
            rows.append(row)
            print(f"case {seed} n={n} k={k} skew={skew}: {name} vs one launch: {row['differ']} of {row['elements']} "
                  f"differ ({row['differ_hot']} in hot rows, {row['differ_cold']} in cold); tiles "
                  + " + ".join(row["tiles"]), flush=True)
    write_json(args.json, "scripts/probes/tile_families_probe.py", rows=rows)
    return 1 if any(r["differ"] or r["unwritten"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(run_script(main, "tile_families_probe"))
