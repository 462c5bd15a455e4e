"""Probe: activation-decoder warps per CTA (DW) of the plain kernel against the GEMM, by token
tile. `--rules` lists (DW for 8-16-token tiles, DW for 64-token tiles) pairs, timed in the order
given (repeat one to alternate: `--rules 1,3 2,3 1,3 2,3`); the fused kernels keep their rule."""
import sys

from lab.gemm_bench import study_parser
from lab.kernels import grouped_gemm as gg
from probe_common import edit_kernel, start

BASE = "static constexpr int DW = FMAX >= 8 && FUSE == 0 ? 3 : FMAX >= 4 || FUSE != 0 ? 2 : 1;"
SHIPPED_MIRROR = gg.GemmConfig.decoder_warps


def main():
    ap = study_parser(__doc__, [8, 2], 10)
    ap.add_argument("--rules", nargs="+", default=["1,3", "2,3", "1,3", "2,3"])
    ap.add_argument("--gemms", nargs="+", default=["w13", "w2"])
    args = ap.parse_args()
    roof, bench = start(args)
    rows = []
    for spec in args.rules:
        small, big = (int(v) for v in spec.split(","))
        edit_kernel({BASE: f"static constexpr int DW = FMAX >= 8 && FUSE == 0 ? {big} : "
                           f"FMAX >= 4 || FUSE != 0 ? 2 : {small};"})

        def mirror(self, small=small, big=big):
            if self.fuse:
                return SHIPPED_MIRROR.fget(self)
            return big if self.max_frags >= 8 else 2 if self.max_frags >= 4 else small
        gg.GemmConfig.decoder_warps = property(mirror)
        for mean in args.mean_tokens:
            for gemm in args.gemms:
                case = bench.case(gemm, mean)
                cfg = gg.heuristic(case.n, case.k, case.counts)
                row = bench.measure(case, cfg, roof, args.iterations, read_pattern=False)
                rows.append({"dw_small": small, "dw_big": big, "gemm": gemm, "mean_tokens": mean,
                             "config": str(cfg), "ms": row["ms"], "roof_pct": row["roof_pct"]})
                print(f"DW {small},{big} {gemm} @{mean:g} {cfg}: {row['ms']:.4f} ms {row['roof_pct']:.1f}%",
                      flush=True)
    if args.json:
        from lab.gemm_bench import write_json
        write_json(args.json, "notes/experiments/dw_probe.py", roofline_gbps=roof, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
