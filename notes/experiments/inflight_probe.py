"""Probe: weight bytes in flight per SM (stages x CTAs per SM) against the GEMM and its READ_ONLY
pattern. CTAs per SM are capped through GemmConfig.ctas_per_sm."""
import sys

from lab.gemm_bench import study_parser
from lab.kernels import grouped_gemm as gg
from probe_common import measure_tile, start

# (warps, row tiles, k step, stages[, mma]), CTAs per SM
CASES = [((4, 4, 128, 4), 2), ((4, 4, 128, 3), 3), ((4, 4, 128, 3), 2), ((4, 4, 128, 2), 3), ((4, 4, 128, 3, 1), 3)]


def main():
    ap = study_parser(__doc__, [2, 8, 32], 10)
    args = ap.parse_args()
    roof, bench = start(args)
    for mean in args.mean_tokens:
        for gemm in ("w13", "w2"):
            case = bench.case(gemm, mean)
            base = gg.heuristic(case.n, case.k, case.counts)
            for tile, ctas in CASES:
                w, r, bk, st, *mma = tile
                cfg = gg.GemmConfig(w, r, bk, st, base.max_frags, mma=mma[0] if mma else 0, ctas_per_sm=ctas)
                row = measure_tile(bench, case, cfg, roof, args.iterations, read_pattern=True)
                if row is None:
                    continue
                inflight = cfg.bytes_in_flight * ctas // 1024
                print(f"{gemm} @{mean:g} {tile} F{cfg.max_frags} x{ctas} CTA/SM ({inflight} KB/SM): gemm {row['ms']:.3f} ms "
                      f"{row['roof_pct']:.1f}%  pattern {row['read_pattern_ms']:.3f} ms {row['read_pattern_roof_pct']:.1f}%",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
