"""Probe: does the weight stream gain from L2 prefetches ahead of the shared-memory ring?

The ring holds STAGES stages per CTA (shared memory caps it); `cp.async.bulk.prefetch.L2`
puts further chunks of the unit on their way to L2 without taking shared memory, so the bytes
in flight per SM grow while the consumers' pacing stays as it is. Variant `pfD` (edited in
memory): at a unit's first stage the producer prefetches chunks 1..D of the pass, and at chunk
kc the chunk kc + D, so D chunks beyond the one being copied are always asked for. The values
do not change, so every row is checked against float64 on a sample of experts.

Written for the kernel before its weight copies became TMA tensor copies (commit 4b1b07e, with
`git checkout 4b1b07e -- lab/kernels`): its anchor, the 1-D `bulk_copy` of a stage, is gone."""
import sys

import numpy as np

from lab.gemm_bench import study_parser, write_json
from lab.kernels import grouped_gemm as gg
from probe_common import check_sample, edit_kernel, measure_tile, start

COPY = ("            bulk_copy(smem_addr(smem + C::OFF_W + s * C::STAGE_W), wblock + (size_t)kc * C::STAGE_W, "
        "C::STAGE_W,\n                      full0 + 8 * s, pol);\n")


def prefetch_edit(dist: int, hint: bool) -> dict:
    pf = ("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" if hint
          else "cp.async.bulk.prefetch.L2.global [%0], %1;")
    ops = '"l"(wblock + (size_t)j * C::STAGE_W), "r"((uint32_t)C::STAGE_W)' + (', "l"(pol)' if hint else "")
    body = (f"            for (int j = kc == 0 ? 1 : kc + {dist}; j <= kc + {dist} && j < kcs; ++j)\n"
            f'              asm volatile("{pf}" :: {ops} : "memory");\n')
    return {COPY: COPY + body}


def main():
    ap = study_parser(__doc__, [8, 2, 32], 10)
    ap.add_argument("--distances", type=int, nargs="+", default=[0, 2, 4], help="0: as shipped")
    ap.add_argument("--hint", action="store_true", help="prefetch with the copies' evict-first policy")
    ap.add_argument("--gemms", nargs="+", default=["w13", "w2"])
    ap.add_argument("--check-experts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the whole sweep (drift check)")
    args = ap.parse_args()
    roof, bench = start(args)
    rows = []
    rng = np.random.default_rng(args.seed)
    for rnd in range(args.rounds):
        for dist in args.distances:
            edit_kernel(prefetch_edit(dist, args.hint) if dist else None)
            for mean in args.mean_tokens:
                for gemm in args.gemms:
                    case = bench.case(gemm, mean)
                    cfg = gg.heuristic(case.n, case.k, case.counts)
                    row = measure_tile(bench, case, cfg, roof, args.iterations)
                    if row is None:
                        continue
                    row["rel_err"] = check_sample(bench, case, rng, args.check_experts)
                    row.update(distance=dist, hint=args.hint, round=rnd)
                    rows.append(row)
                    print(f"r{rnd} pf{dist}{'h' if args.hint else ''} {gemm} @{mean:g}: {row['ms']:.3f} ms "
                          f"{row['roof_pct']:.1f}% err {row['rel_err']:.1e} unwritten {row['unwritten']}", flush=True)
    write_json(args.json, "notes/experiments/l2_prefetch_probe.py", read_roofline_gbps=roof, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
