"""Probe: activation-decoder warps per CTA (DW) against the GEMM, by token tile."""
import sys
from lab.gemm_bench import GemmBench, problem_of, study_parser
from lab.kernels import grouped_gemm as gg, jit
from lab.kernels.stream_read import measure_read_roofline

BASE = "static constexpr int DW = FMAX >= 4 ? 2 : 1;"
orig_source = jit.source
orig_dw = gg.GemmConfig.decoder_warps
orig_res = gg.resident_ctas


def dw_rule(small, big):
    return lambda f: big if f >= 8 else (2 if f >= 4 else small)


def main():
    ap = study_parser(__doc__, [8, 32], 10)
    args = ap.parse_args()
    roof = measure_read_roofline(iterations=args.iterations)["gbps"]
    print(f"roofline {roof:.0f} GB/s")
    bench = GemmBench(problem_of(args), args.seed, "probe")
    for small, big in ((1, 2), (2, 3), (2, 4), (3, 6)):
        rule = dw_rule(small, big)

        def src(name, _seen=frozenset(), small=small, big=big):
            t = orig_source(name, _seen)
            if name != gg.SOURCE:
                return t
            assert BASE in t
            return t.replace(BASE, f"static constexpr int DW = FMAX >= 8 ? {big} : FMAX >= 4 ? 2 : {small};")
        jit.source = src
        jit._module.cache_clear()
        gg.GemmConfig.decoder_warps = property(lambda self, rule=rule: rule(self.max_frags))
        for mean in args.mean_tokens:
            for gemm in ("w13", "w2"):
                case = bench.case(gemm, mean)
                base = gg.heuristic(case.n, case.k, case.counts)
                tiles = [(base, 0)] + ([(gg.GemmConfig(4, 4, 128, 3, base.max_frags), 2)] if base.max_frags <= 2 else [])
                for cfg, cap in tiles:
                    seen = []
                    gg.resident_ctas = lambda c, e, r, m=cap, seen=seen: seen.append(
                        min(m, orig_res(c, e, r)) if m else orig_res(c, e, r)) or seen[-1]
                    row = bench.measure(case, cfg, roof, args.iterations, read_pattern=False)
                    gg.resident_ctas = orig_res
                    print(f"DW {rule(cfg.max_frags)} {gemm} @{mean:g} {cfg.warps},{cfg.row_tiles},{cfg.k_step},{cfg.stages} "
                          f"F{cfg.max_frags} x{seen[0]}: gemm {row['ms']:.3f} ms {row['roof_pct']:.1f}%", flush=True)


if __name__ == "__main__":
    sys.exit(main())
