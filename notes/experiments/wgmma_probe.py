"""Probe: the wgmma consumers at large token tiles. Each commit group holds GS k16 steps (the
kernel's Config::GS, edited in memory); tiles, means and GS values from the command line. Every
row is checked against float64 on a sample of experts and for unwritten outputs, except the
removal variants (one part of the work edited out of the source: timing only)."""
import sys

import numpy as np

from lab.gemm_bench import study_parser, write_json
from lab.kernels import grouped_gemm as gg
from probe_common import check_sample, edit_kernel, measure_tile, start

BASE = "static constexpr int GS = R >= 4 ? 1 : (FUSE & 2) ? 2 : 4;"
DW_BASE = "static constexpr int DW = FMAX >= 8 && FUSE == 0 ? 3 : FMAX >= 4 || FUSE != 0 ? 2 : 1;"
SHIPPED_DW = gg.GemmConfig.decoder_warps
SCALE = ("a[0] = hmul2_lo(p0, s2);\n  a[1] = hmul2_hi(p1, s2);\n  a[2] = hmul2_lo(p2, s2);\n"
         "  a[3] = hmul2_hi(p3, s2);")
VARIANTS = {
    "as-is": {},
    # decoder warps skip the activation decode (B stale)
    "no-decoder": {"item < frags * 8 * C::KSTEPS; item += 32 * C::DW)": "item < 0 * frags; item += 32 * C::DW)"},
    # A registers straight from the loaded codes, no bit decode or scale multiply
    "no-a-decode": {"for (int r = 0; r < R; ++r) decode_tile(code[r], scl[r], jg * GS + q, a[r][q]);":
                    "for (int r = 0; r < R; ++r) { a[r][q][0] = code[r].x; a[r][q][1] = code[r].y; "
                    "a[r][q][2] = code[r].z ^ q; a[r][q][3] = scl[r].x ^ jg; }"},
    # every stage as one 8-token fragment (wgmma N = 8)
    "n8": {"    switch (frags) {\n": "    switch (frags > 1 ? 1 : frags) {\n"},
    # the epilogue's stores skipped
    "no-store": {"if (out != nullptr) {": "if (out != nullptr && count < 0) {"},
    # the weight decode without its scale multiply (4 HMUL2 per word on the FMA pipe)
    "no-scale": {SCALE: "a[0] = p0;\n  a[1] = p1;\n  a[2] = p2;\n  a[3] = p3;"},
    # the scale applied by one ALU-pipe PRMT per register instead of an HMUL2 (wrong values)
    "scale-prmt": {SCALE: "\n".join(f'  asm("prmt.b32 %0, %1, %2, 0x3254;" : "=r"(a[{i}]) : "r"(p{i}), "r"(s2));'
                                     for i in range(4)).lstrip()},
    # the weight decode's right shift as IMAD.HI (FMA pipe) instead of SHF (ALU pipe); same values
    "rshift-imad": {"  p3 = (w ^ (w >> 3)) & DECODE_MASK;":
                    '  uint32_t w3;\n  asm("mul.hi.u32 %0, %1, 0x20000000;" : "=r"(w3) : "r"(w));\n'
                    "  p3 = (w ^ w3) & DECODE_MASK;"},
    # every stage at the full width N = 8 * FMAX (what notes/experiments/xstage.patch implies)
    "n-full": {"    switch (frags) {\n": "    switch (FMAX) {\n"},
}


def tile(text):
    w, r, bk, st, mma, ctas = (int(v) for v in text.split(","))
    return w, r, bk, st, mma, ctas


def main():
    ap = study_parser(__doc__, [32, 8], 10)
    ap.add_argument("--gs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tile", type=tile, action="append", help="W,R,BK,stages,mma,ctas_per_sm (default: heuristic)")
    ap.add_argument("--gemms", nargs="+", default=["w13", "w2"])
    ap.add_argument("--check-experts", type=int, default=4)
    ap.add_argument("--variants", nargs="+", default=["as-is"], choices=list(VARIANTS))
    ap.add_argument("--dw", type=int, nargs="+", default=[0], help="activation-decoder warps (0: as shipped)")
    args = ap.parse_args()
    roof, bench = start(args)
    rows = []
    rng = np.random.default_rng(args.seed)
    for gs, variant, dw in [(gs, v, dw) for gs in args.gs for v in args.variants for dw in args.dw]:
        subs = {BASE: f"static constexpr int GS = {gs};", **VARIANTS[variant]}
        if dw:
            subs[DW_BASE] = f"static constexpr int DW = {dw};"
        gg.GemmConfig.decoder_warps = property(lambda self, dw=dw: dw) if dw else SHIPPED_DW
        edit_kernel(subs)
        for mean in args.mean_tokens:
            for gemm in args.gemms:
                case = bench.case(gemm, mean)
                base = gg.heuristic(case.n, case.k, case.counts)
                tiles = args.tile or [(base.warps, base.row_tiles, base.k_step, base.stages, 1, base.ctas_per_sm)]
                for w, r, bk, st, mma, ctas in tiles:
                    if mma == 0 and gs != args.gs[0]:
                        continue  # GS only shapes the wgmma path
                    cfg = gg.GemmConfig(w, r, bk, st, base.max_frags, mma, ctas_per_sm=ctas)
                    row = measure_tile(bench, case, cfg, roof, args.iterations)
                    if row is None:
                        continue
                    checked = variant in ("as-is", "rshift-imad")  # the others change the values
                    row["rel_err"] = check_sample(bench, case, rng, args.check_experts) if checked else float("nan")
                    row.update(gs=gs, variant=variant, dw=dw or cfg.decoder_warps)
                    rows.append(row)
                    print(f"{variant:11s} GS {gs} DW {dw or cfg.decoder_warps} {gemm} @{mean:g} "
                          f"{w},{r},{bk},{st} mma{mma} F{cfg.max_frags} x{ctas}: {row['ms']:.3f} ms {row['roof_pct']:.1f}% err {row['rel_err']:.1e} "
                          f"unwritten {row['unwritten']}", flush=True)
    write_json(args.json, "notes/experiments/wgmma_probe.py", read_roofline_gbps=roof, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
