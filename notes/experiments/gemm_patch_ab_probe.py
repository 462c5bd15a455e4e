"""Probe: kernel patches against the shipped kernels on the plain GEMMs (w13 and w2 at the
heuristic's tile), in one process on one machine: patch_ab_probe.py's method for the GEMM
benchmark's cases. `--order` visits the trees in turn (0 = shipped); each visit runs a poisoned
launch (unwritten elements counted), compares the output bit for bit with the shipped tree's
and times a burst.

    python notes/experiments/gemm_patch_ab_probe.py --patches notes/experiments/claim_lead0.patch \\
        notes/experiments/claim_lead2.patch --mean-tokens 8 2 --order 0 1 2 0 1 2 --json ab.json
"""
import sys
from pathlib import Path

import numpy as np

from lab.gemm_bench import study_parser, write_json
from lab.kernels import grouped_gemm as gg
from patch_ab_probe import SHIPPED_DIR, patch_trees, use
from probe_common import start


def main():
    ap = study_parser(__doc__, [8], 20)
    ap.add_argument("--patches", nargs="+", type=Path, required=True)
    ap.add_argument("--order", nargs="+", type=int)
    ap.add_argument("--gemms", nargs="+", default=["w13", "w2"])
    args = ap.parse_args()
    order, trees, names = patch_trees(ap, args)
    roof, bench = start(args)
    rows, reference = [], {}
    try:
        for mean in args.mean_tokens:
            for gemm in args.gemms:
                case = bench.case(gemm, mean)
                cfg = gg.heuristic(case.n, case.k, case.counts)
                for i in order:
                    use(trees[i])
                    row = bench.measure(case, cfg, roof, args.iterations, read_pattern=False)
                    bits = case.out.get().view(np.uint32)
                    same = bool(np.array_equal(bits, reference.setdefault((mean, gemm), bits)))
                    row.update(tree=names[i], bits_equal_shipped=same)
                    rows.append(row)
                    print(f"{names[i]:16s} {gemm:3s} @{mean:g}: {row['ms']:.4f} ms {row['roof_pct']:.1f}%  "
                          f"unwritten {row['unwritten']}  bits {'equal' if same else 'DIFFER'}", flush=True)
    finally:
        use(SHIPPED_DIR)
    write_json(args.json, "notes/experiments/gemm_patch_ab_probe.py", roofline_gbps=roof,
               patches=[str(p) for p in args.patches], rows=rows)
    return 0 if all(r["bits_equal_shipped"] and r["unwritten"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
