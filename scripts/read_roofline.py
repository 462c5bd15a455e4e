"""Flat streaming read against a raw read of exactly the GEMM's bytes in its own tile order
(the GEMM's grid and pipeline with no decode or MMA), at each mean: is the gap between the GEMM
and the roofline the mainloop or the access pattern?

    python scripts/read_roofline.py --json results/read_roofline.json
"""

from __future__ import annotations

import sys

from tabulate import tabulate

from lab.device_info import setup_info
from lab.gpu import require_gpu, run_script
from lab.gemm_bench import GemmBench, log, problem_of, study_parser, write_json
from lab.kernels import gemm_config as gc
from lab.kernels.stream_read import measure_read_roofline
from lab.models import resolve_shape

TAG = "read_roofline"


def main(argv=None) -> int:
    ap = study_parser(__doc__, [2, 4, 8, 32], 10)
    args = ap.parse_args(argv)
    resolve_shape(args, ap)
    require_gpu(TAG)  # before any output: without a GPU the script says so in one line

    problem = problem_of(args)
    setup = setup_info()
    roof = measure_read_roofline(iterations=args.iterations)
    bw = roof["gbps"]
    log(TAG, f"flat read {bw:.0f} GB/s")
    bench = GemmBench(problem, args.seed, TAG)
    rows = []
    for mean in args.mean_tokens:
        for gemm in ("w13", "w2"):
            case = bench.case(gemm, mean)
            cfg = gc.heuristic(case.n, case.k, case.counts)
            rows.append(bench.measure(case, cfg, bw, args.iterations, read_pattern=True))
    table = [[r["gemm"], r["mean_tokens"], f"{r['read_pattern_ms']:.3f}", f"{r['read_pattern_roof_pct']:.1f}",
              f"{r['ms']:.3f}", f"{r['roof_pct']:.1f}"] for r in rows]
    print(f"flat streaming read: {bw:.0f} GB/s")
    print(tabulate(table, headers=["gemm", "tokens/expert", "pattern read ms", "pattern % of flat", "GEMM ms",
                                   "GEMM % of flat"]))
    write_json(args.json, "scripts/read_roofline.py", setup=setup,
               read_roofline=roof, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main, TAG))
