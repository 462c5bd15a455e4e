"""Probe: does the order in which concurrently running CTAs walk the weights matter?
Variants of the kernel source (addressing only; the kc-major variant reads the same bytes in a
different order, so its outputs are not meaningful): time READ_ONLY and the GEMM."""
import sys

from lab.gemm_bench import study_parser
from lab.kernels import grouped_gemm as gg
from probe_common import edit_kernel, start

BASE_W = "const int stage0 = (e * NB + nb) * kchunks;"
BASE_C = "LAB_P(wmap), stage0 + kc, full0"
VARIANTS = {
    "kc-major": {BASE_W: "const int stage0 = e * kchunks * NB + nb;",
                 BASE_C: "LAB_P(wmap), stage0 + kc * NB, full0"},
    "no-activations": {"cp_async<16>(smem_addr(qdst + tr * (BK / 2) + q * 16), src);": "(void)src;",
                       "cp_async<BK / 16>(smem_addr(sdst + tr * (BK / 16)), src);": "(void)src;"},
}


def main():
    ap = study_parser(__doc__, [2, 8, 32], 10)
    args = ap.parse_args()
    roof, bench = start(args)
    for name, subs in VARIANTS.items():
        edit_kernel(subs)
        for mean in args.mean_tokens:
            for gemm in ("w13", "w2"):
                case = bench.case(gemm, mean)
                cfg = gg.heuristic(case.n, case.k, case.counts)
                row = bench.measure(case, cfg, roof, args.iterations)
                print(f"{name:12s} {gemm} @{mean:g}: gemm {row['ms']:.3f} ms {row['roof_pct']:.1f}%  "
                      f"pattern {row['read_pattern_ms']:.3f} ms {row['read_pattern_roof_pct']:.1f}%", flush=True)


if __name__ == "__main__":
    sys.exit(main())
