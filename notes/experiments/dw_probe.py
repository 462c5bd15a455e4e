"""Probe: activation-decoder warps per CTA (DW) against the GEMM, by token tile."""
import sys

from lab.gemm_bench import study_parser
from lab.kernels import grouped_gemm as gg
from probe_common import edit_kernel, start

BASE = "static constexpr int DW = FMAX >= 8 && FUSE == 0 ? 3 : FMAX >= 4 ? 2 : 1;"


def dw_rule(small, big):
    return lambda f: big if f >= 8 else (2 if f >= 4 else small)


def main():
    ap = study_parser(__doc__, [8, 32], 10)
    args = ap.parse_args()
    roof, bench = start(args)
    for small, big in ((1, 2), (2, 3), (2, 4), (3, 6)):
        rule = dw_rule(small, big)
        edit_kernel({BASE: f"static constexpr int DW = FMAX >= 8 ? {big} : FMAX >= 4 ? 2 : {small};"})
        gg.GemmConfig.decoder_warps = property(lambda self, rule=rule: rule(self.max_frags))
        for mean in args.mean_tokens:
            for gemm in ("w13", "w2"):
                case = bench.case(gemm, mean)
                base = gg.heuristic(case.n, case.k, case.counts)
                tiles = [base] + ([gg.GemmConfig(4, 4, 128, 3, base.max_frags, ctas_per_sm=2)]
                                  if base.max_frags <= 2 else [])
                for cfg in tiles:
                    row = bench.measure(case, cfg, roof, args.iterations, read_pattern=False)
                    print(f"DW {rule(cfg.max_frags)} {gemm} @{mean:g} {cfg.warps},{cfg.row_tiles},{cfg.k_step},{cfg.stages} "
                          f"F{cfg.max_frags} x{cfg.ctas_per_sm or 'fit'}: gemm {row['ms']:.3f} ms {row['roof_pct']:.1f}%",
                          flush=True)


if __name__ == "__main__":
    sys.exit(main())
