"""Probe: one CTA per SM (one weight stream per SM, the pattern the READ_ONLY probe likes) with
more activation-decoder warps, so that a single CTA's decoders keep up with the whole SM's
stages. DW is forced for every token tile; tiles and CTAs per SM from the command line."""
import sys
from lab.gemm_bench import GemmBench, problem_of, study_parser
from lab.kernels import grouped_gemm as gg, jit
from lab.kernels.stream_read import measure_read_roofline

BASE = "static constexpr int DW = FMAX >= 8 && FUSE == 0 ? 3 : FMAX >= 4 ? 2 : 1;"
orig_source = jit.source
orig_res = gg.resident_ctas


def tile(text):
    w, r, bk, st, ctas = (int(v) for v in text.split(","))
    return (w, r, bk, st), ctas


def main():
    ap = study_parser(__doc__, [2, 8], 10)
    ap.add_argument("--dw", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--tile", type=tile, action="append", required=True, help="W,R,BK,stages,ctas_per_sm")
    args = ap.parse_args()
    roof = measure_read_roofline(iterations=args.iterations)["gbps"]
    print(f"roofline {roof:.0f} GB/s")
    bench = GemmBench(problem_of(args), args.seed, "probe")
    for dw in args.dw:
        def src(name, _seen=frozenset(), dw=dw):
            t = orig_source(name, _seen)
            if name != gg.SOURCE:
                return t
            assert BASE in t
            return t.replace(BASE, f"static constexpr int DW = {dw};")
        jit.source = src
        jit._module.cache_clear()
        gg.GemmConfig.decoder_warps = property(lambda self, dw=dw: dw)
        for mean in args.mean_tokens:
            for gemm in ("w13", "w2"):
                case = bench.case(gemm, mean)
                base = gg.heuristic(case.n, case.k, case.counts)
                for (w, r, bk, st), ctas in args.tile:
                    cfg = gg.GemmConfig(w, r, bk, st, base.max_frags, ctas_per_sm=ctas)
                    try:
                        cfg.validate(case.n, case.k)
                    except ValueError as e:
                        print(f"skip {cfg}: {e}")
                        continue
                    row = bench.measure(case, cfg, roof, args.iterations, read_pattern=False)
                    print(f"DW {dw} {gemm} @{mean:g} {w},{r},{bk},{st} F{cfg.max_frags} x{ctas}: "
                          f"{row['ms']:.3f} ms {row['roof_pct']:.1f}%", flush=True)


if __name__ == "__main__":
    sys.exit(main())
