"""Probe: the plain GEMM with its fp32 epilogue moved to epilogue warps (fuse=FUSE_STORE: the
consumers hand each pass to a store warp through the shared h tile, as the fused layer does with
its w2 passes) against the shipped plain kernel, alternating in one process on one machine.
Each pair's outputs are compared bit for bit after a poisoned run. FUSE_STORE is not shipped
(results/probes_gemm_v17.json: level at @8, 1-2 points worse at @2 / @4 / @32): run this in a
copy of the tree with notes/experiments/store_warps.patch applied,

    git apply --exclude='notes/*' notes/experiments/store_warps.patch
    python notes/experiments/store_warps_probe.py --mean-tokens 8 2 4 32 --rounds 3 --json probe.json
"""
import sys
from dataclasses import replace

import numpy as np

from lab.gemm_bench import study_parser, write_json
from lab.kernels import grouped_gemm as gg
from probe_common import start


def main():
    ap = study_parser(__doc__, [8], 20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    roof, bench = start(args)
    rows, same = [], True
    for mean in args.mean_tokens:
        for gemm in ("w13", "w2"):
            case = bench.case(gemm, mean)
            base = gg.heuristic(case.n, case.k, case.counts)
            outs = {}
            for rnd in range(args.rounds):
                for fuse in (0, gg.FUSE_STORE):
                    cfg = replace(base, fuse=fuse)
                    row = bench.measure(case, cfg, roof, args.iterations, read_pattern=False)
                    if rnd == 0:
                        outs[fuse] = case.out.get()
                    row.update(round=rnd, store_warps=bool(fuse))
                    rows.append(row)
                    print(f"{gemm} @{mean:g} {'store-warps' if fuse else 'shipped    '}: {row['ms']:.4f} ms "
                          f"{row['roof_pct']:.1f}%  unwritten {row['unwritten']}", flush=True)
            eq = bool(np.array_equal(outs[0].view(np.uint32), outs[gg.FUSE_STORE].view(np.uint32)))
            same &= eq
            print(f"{gemm} @{mean:g}: outputs {'bitwise equal' if eq else 'DIFFER'}", flush=True)
    write_json(args.json, "notes/experiments/store_warps_probe.py", roofline_gbps=roof, rows=rows)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
