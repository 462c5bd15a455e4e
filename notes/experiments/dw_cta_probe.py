"""Probe: one CTA per SM (one weight stream per SM, the pattern the READ_ONLY probe likes) with
more activation-decoder warps, so that a single CTA's decoders keep up with the whole SM's
stages. DW is forced for every token tile; tiles and CTAs per SM from the command line."""
import sys

from lab.gemm_bench import study_parser
from lab.kernels import grouped_gemm as gg
from probe_common import edit_kernel, measure_tile, start

BASE = "static constexpr int DW = FMAX >= 8 && FUSE == 0 ? 3 : FMAX >= 4 || FUSE != 0 ? 2 : 1;"


def tile(text):
    w, r, bk, st, ctas = (int(v) for v in text.split(","))
    return (w, r, bk, st), ctas


def main():
    ap = study_parser(__doc__, [2, 8], 10)
    ap.add_argument("--dw", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--tile", type=tile, action="append", required=True, help="W,R,BK,stages,ctas_per_sm")
    args = ap.parse_args()
    roof, bench = start(args)
    for dw in args.dw:
        edit_kernel({BASE: f"static constexpr int DW = {dw};"})
        gg.GemmConfig.decoder_warps = property(lambda self, dw=dw: dw)
        for mean in args.mean_tokens:
            for gemm in ("w13", "w2"):
                case = bench.case(gemm, mean)
                base = gg.heuristic(case.n, case.k, case.counts)
                for (w, r, bk, st), ctas in args.tile:
                    cfg = gg.GemmConfig(w, r, bk, st, base.max_frags, ctas_per_sm=ctas)
                    row = measure_tile(bench, case, cfg, roof, args.iterations)
                    if row is None:
                        continue
                    print(f"DW {dw} {gemm} @{mean:g} {w},{r},{bk},{st} F{cfg.max_frags} x{ctas}: "
                          f"{row['ms']:.3f} ms {row['roof_pct']:.1f}%", flush=True)


if __name__ == "__main__":
    sys.exit(main())
