"""Probe: where the time of the small-token GEMM goes. Each variant edits the kernel source in
memory to remove or double one part of the work (outputs meaningless, timing only) and times
the heuristic tile against the shipped kernel at the same means."""
import sys

from lab.gemm_bench import study_parser
from lab.kernels import grouped_gemm as gg
from probe_common import edit_kernel, start

SWITCH = "    switch (frags) {\n"
MMA_LOOP = "for (int f = 0; f < F; ++f) mma16816("
DEC_LOOP = "item < frags * 8 * C::KSTEPS; item += 32 * C::DW)"
CALL = "stage_math<W, R, BK, FMAX, F>(acc, wst, xf, warp, lane);"
VARIANTS = {
    "shipped": [],
    # every stage's consumers do one fragment's work (decoder still decodes all)
    "consumer-F1": [(SWITCH, "    switch (frags > 1 ? 1 : frags) {\n")],
    # one MMA per tile and step whatever F (decode and B loads of fragment 0 kept)
    "mma-once": [(MMA_LOOP, "for (int f = 0; f < 1; ++f) mma16816(")],
    # decoder warps skip the decode (B fragments stale)
    "no-decoder": [(DEC_LOOP, "item < 0 * frags; item += 32 * C::DW)")],
    # consumers do half of each stage's math (the first k atom only)
    "consumer-half": [("for (int ka = 0; ka < KATOMS; ++ka) {\n    uint4 code[R];",
                       "for (int ka = 0; ka < (KATOMS + 1) / 2; ++ka) {\n    uint4 code[R];")],
    # the epilogue's stores skipped (accumulators still zeroed per pass)
    "no-store": [("if (out != nullptr) {", "if (out != nullptr && count < 0) {")],
    # the output stores with the streaming hint (st.global.cs: evict first from L1 and L2)
    "store-cs": [("                  out[at] = v0;\n                  out[at + 8] = v1;\n",
                  "                  __stcs(out + at, v0);\n                  __stcs(out + at + 8, v1);\n")],
    # the output stores written through (st.global.wt)
    "store-wt": [("                  out[at] = v0;\n                  out[at + 8] = v1;\n",
                  "                  __stwt(out + at, v0);\n                  __stwt(out + at + 8, v1);\n")],
    # consumers run every stage's math twice
    "consumer-x2": [(CALL, CALL + " " + CALL)],
}


def main():
    ap = study_parser(__doc__, [2, 8], 10)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = ap.parse_args()
    roof, bench = start(args)
    for name in args.variants:
        edit_kernel(dict(VARIANTS[name]))
        for mean in args.mean_tokens:
            for gemm in ("w13", "w2"):
                case = bench.case(gemm, mean)
                cfg = gg.heuristic(case.n, case.k, case.counts)
                row = bench.measure(case, cfg, roof, args.iterations, read_pattern=False)
                print(f"{name:12s} {gemm} @{mean:g} {cfg.warps},{cfg.row_tiles},{cfg.k_step},{cfg.stages} "
                      f"F{cfg.max_frags}: {row['ms']:.3f} ms {row['roof_pct']:.1f}%", flush=True)


if __name__ == "__main__":
    sys.exit(main())
