"""Probe: each stage's weights as SPLIT bulk copies (same bytes, same barrier) instead of one.

Written for the kernel before its weight copies became TMA tensor copies (commit 4b1b07e, with
`git checkout 4b1b07e -- lab/kernels`): its anchor, the 1-D `bulk_copy` of a stage, is gone."""
import sys

from lab.gemm_bench import study_parser
from lab.kernels import grouped_gemm as gg
from probe_common import edit_kernel, start

ONE = """            bulk_copy(smem_addr(smem + C::OFF_W + s * C::STAGE_W), wblock + (size_t)kc * C::STAGE_W, C::STAGE_W,
                      full0 + 8 * s, pol);"""
SPLIT = """            for (int c = 0; c < {n}; ++c)
              bulk_copy(smem_addr(smem + C::OFF_W + s * C::STAGE_W) + c * (C::STAGE_W / {n}),
                        wblock + (size_t)kc * C::STAGE_W + c * (C::STAGE_W / {n}), C::STAGE_W / {n}, full0 + 8 * s, pol);"""
CASES = [((4, 4, 128, 4), 2), ((8, 4, 128, 3), 1), ((16, 2, 128, 3), 1), ((8, 4, 128, 4), 1)]


def main():
    ap = study_parser(__doc__, [2, 8], 10)
    ap.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    roof, bench = start(args)
    for n in args.splits:
        edit_kernel({ONE: SPLIT.format(n=n)})
        for mean in args.mean_tokens:
            case = bench.case("w13", mean)
            base = gg.heuristic(case.n, case.k, case.counts)
            for tile, ctas in CASES:
                cfg = gg.GemmConfig(*tile, base.max_frags, ctas_per_sm=ctas).validate(case.n, case.k)
                row = bench.measure(case, cfg, roof, args.iterations)
                print(f"split {n} w13 @{mean:g} {tile} F{cfg.max_frags} x{ctas}: gemm {row['ms']:.3f} ms "
                      f"{row['roof_pct']:.1f}%  pattern {row['read_pattern_ms']:.3f} ms {row['read_pattern_roof_pct']:.1f}%",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
