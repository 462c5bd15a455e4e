"""Probe: would activations decoded once per expert (fp16 B fragments in global memory, copied
by the producer with the weights) beat the decoder warp that redoes them for every unit?

Timing only, values meaningless. `emulated`: the decoder warps skip the decode, the producer
skips the raw NVFP4 activation copies and instead copies, with cp.async from L2, the bytes a
pre-decoded stage would take (ntok rows x BK fp16 = 256 B per token row at BK 128) into the
stage's fragment buffer, reading them from the output array (resident, the same size class as
a T x K fp16 array). `no-decoder`: the decode skipped and nothing copied in its place, the
upper bound. Against the shipped kernel, alternating."""
import sys

from lab.gemm_bench import study_parser, write_json
from lab.kernels import grouped_gemm as gg
from probe_common import edit_kernel, start

NO_DECODE = {"item < frags * 8 * C::KSTEPS; item += 32 * C::DW)": "item < 0 * frags; item += 32 * C::DW)"}
EMULATED = {
    **NO_DECODE,
    "cp_async<16>(smem_addr(qdst + tr * (BK / 2) + q * 16), src);": "(void)src;",
    "cp_async<BK / 16>(smem_addr(sdst + tr * (BK / 16)), src);": "(void)src;",
    "        cp_async_arrive_noinc(raw0 + 8 * s);\n": """        {
          const uint8_t* fsrc = reinterpret_cast<const uint8_t*>(LAB_P(out)) + (size_t)row0 * (K * 2) + kc * (BK * 2);
          uint8_t* fdst = smem + C::OFF_XF + s * C::XF;
          for (int i = lane; i < ntok * (BK / 8); i += 32) {
            const int tr = i / (BK / 8), q = i - tr * (BK / 8);
            cp_async<16>(smem_addr(fdst + (tr * (BK / 8) + q) * 16), fsrc + (size_t)(tok0 + tr) * (K * 2) + q * 16);
          }
        }
        cp_async_arrive_noinc(raw0 + 8 * s);
""",
}
VARIANTS = {"shipped": None, "emulated": EMULATED, "no-decoder": NO_DECODE}


def main():
    ap = study_parser(__doc__, [8, 2], 10)
    ap.add_argument("--variants", nargs="+", default=["shipped", "emulated", "no-decoder", "shipped", "emulated"],
                    choices=list(VARIANTS))
    args = ap.parse_args()
    roof, bench = start(args)
    rows = []
    for name in args.variants:
        edit_kernel(VARIANTS[name])
        for mean in args.mean_tokens:
            for gemm in ("w13", "w2"):
                case = bench.case(gemm, mean)
                cfg = gg.heuristic(case.n, case.k, case.counts)
                row = bench.measure(case, cfg, roof, args.iterations, read_pattern=False)
                row["variant"] = name
                rows.append(row)
                print(f"{name:10s} {gemm} @{mean:g}: {row['ms']:.3f} ms {row['roof_pct']:.1f}%", flush=True)
    write_json(args.json, "notes/experiments/predecode_probe.py", read_roofline_gbps=roof, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
