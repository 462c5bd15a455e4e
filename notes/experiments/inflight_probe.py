"""Probe: weight bytes in flight per SM (stages x CTAs per SM) against the GEMM and its READ_ONLY
pattern. CTAs per SM are forced by sizing the persistent grid."""
import sys
from lab.gemm_bench import GemmBench, problem_of, study_parser
from lab.kernels import grouped_gemm as gg
from lab.kernels.stream_read import measure_read_roofline

orig = gg.resident_ctas
CASES = [((4, 4, 128, 4), 2), ((4, 4, 128, 3), 3), ((4, 4, 128, 3), 2), ((4, 4, 128, 2), 3), ((4, 4, 128, 3, 1), 3)]


def main():
    ap = study_parser(__doc__, [2, 8, 32], 10)
    args = ap.parse_args()
    roof = measure_read_roofline(iterations=args.iterations)["gbps"]
    print(f"roofline {roof:.0f} GB/s")
    bench = GemmBench(problem_of(args), args.seed, "probe")
    for mean in args.mean_tokens:
        for gemm in ("w13", "w2"):
            case = bench.case(gemm, mean)
            base = gg.heuristic(case.n, case.k, case.counts)
            for tile, ctas in CASES:
                cfg = gg.GemmConfig(*tile, base.max_frags)
                try:
                    cfg.validate(case.n, case.k)
                except ValueError as e:
                    print(f"skip {tile} F{base.max_frags}: {e}")
                    continue
                seen = []
                gg.resident_ctas = lambda c, e, r, n=ctas, seen=seen: seen.append(min(n, orig(c, e, r))) or seen[-1]
                row = bench.measure(case, cfg, roof, args.iterations)
                ctas = seen[0]
                inflight = cfg.bytes_in_flight * ctas // 1024
                print(f"{gemm} @{mean:g} {tile} F{cfg.max_frags} x{ctas} CTA/SM ({inflight} KB/SM): gemm {row['ms']:.3f} ms "
                      f"{row['roof_pct']:.1f}%  pattern {row['read_pattern_ms']:.3f} ms {row['read_pattern_roof_pct']:.1f}%",
                      flush=True)
            gg.resident_ctas = orig


if __name__ == "__main__":
    sys.exit(main())
