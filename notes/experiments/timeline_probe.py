"""Probe: a per-CTA timeline of one GEMM launch (where the ~22 us of fixed cost per launch goes;
notes/gemm.md, v10). The kernel source is edited in memory to stamp %globaltimer (ns) into a
__device__ array at: entry, end of the expert compaction, the producer's first bulk copy, the
consumers' first ready stage, the consumers' last stage (the stop marker), and the exit
barrier; plus the units each CTA's producer claimed. Timing only: the stamps cost a few
instructions per CTA. Written and compiled for sm_90a without a GPU; to be run on the H200:

    python notes/experiments/timeline_probe.py --mean-tokens 8 2 --json results/timeline_gemm.json
"""
import sys

import numpy as np

from lab.gemm_bench import study_parser, write_json
from lab.kernels import grouped_gemm as gg, jit
from probe_common import edit_kernel, start

SLOTS = 12  # per CTA: entry, compacted, first copy, first stage, consumers done, exit, units, last claim,
# and for the fused layer (layer_timeline_probe.py): first w2 claim, ns waited on ready[], last w13 claim
MAX_CTAS = 1024
EVENTS = ("entry", "compacted", "first_copy", "first_stage", "consumers_done", "exit")
# extern "C": an unmangled symbol that RawModule.get_global finds by its plain name
STAMP = ("__device__ __forceinline__ unsigned long long lab_now() {\n"
         "  unsigned long long t;\n  asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t));\n  return t;\n}\n"
         f"extern \"C\" {{ __device__ unsigned long long lab_timeline[{MAX_CTAS * SLOTS}]; }}\n"
         f"#define LAB_SET(i, v) (lab_timeline[blockIdx.x * {SLOTS} + (i)] = (v))\n"
         "#define LAB_STAMP(i) LAB_SET(i, lab_now())\n")
EDITS = {
    "namespace lab_gemm {\n": STAMP + "namespace lab_gemm {\n",
    "  extern __shared__ __align__(128) uint8_t smem[];\n":
        "  extern __shared__ __align__(128) uint8_t smem[];\n  if (threadIdx.x == 0) LAB_STAMP(0);\n",
    "  if (warp == W) {\n    // ---------------- producer warp":
        "  if (threadIdx.x == 0) LAB_STAMP(1);\n  if (warp == W) {\n    // ---------------- producer warp",
    "          if (done) {\n            mbar_arrive(full0 + 8 * s);\n          } else {\n":
        "          if (done) {\n            mbar_arrive(full0 + 8 * s);\n          } else {\n"
        "            if (it == 0) LAB_STAMP(2);\n",
    "      if (done) break;\n":
        "      if (done) {\n        if (lane == 0) {\n          LAB_SET(6, useq);\n"
        "          LAB_STAMP(7);\n        }\n        break;\n      }\n",
    "    mbar_wait(full0 + 8 * s, phase);\n    if (kc == 0 && pass == 0) {\n":
        "    mbar_wait(full0 + 8 * s, phase);\n    if (warp == 0 && lane == 0 && useq == 0 && kc == 0 && pass == 0) LAB_STAMP(3);\n"
        "    if (kc == 0 && pass == 0) {\n",
    "      if (ent.x < 0) {\n        if constexpr (C::EW != 0) {  // stop the epilogue warps":
        "      if (ent.x < 0) {\n        if (warp == 0 && lane == 0) LAB_STAMP(4);\n"
        "        if constexpr (C::EW != 0) {  // stop the epilogue warps",
    "finish:\n  // The last CTA to finish leaves the unit counter":
        "finish:\n  if (threadIdx.x == 0) LAB_STAMP(5);\n  // The last CTA to finish leaves the unit counter",
}


def summary(stamps: np.ndarray) -> dict:
    """stamps (CTAs, SLOTS) uint64 -> microseconds from the earliest entry, percentiles."""
    t0 = stamps[:, 0].min()
    rel = {name: (stamps[:, i].astype(np.int64) - int(t0)) / 1e3 for i, name in enumerate(EVENTS)}
    out = {name: {q: float(np.percentile(v, q)) for q in (0, 50, 100)} for name, v in rel.items()}
    out["units_per_cta"] = {q: float(np.percentile(stamps[:, 6], q)) for q in (0, 50, 100)}
    out["last_claim_us"] = {q: float(np.percentile((stamps[:, 7].astype(np.int64) - int(t0)) / 1e3, q))
                            for q in (0, 50, 100)}
    return out


def main():
    ap = study_parser(__doc__, [8, 2], 5)
    args = ap.parse_args()
    edit_kernel(EDITS)
    roof, bench = start(args, "timeline")
    cp = bench.cp
    report = []
    for mean in args.mean_tokens:
        for gemm in ("w13", "w2"):
            case = bench.case(gemm, mean)
            cfg = gg.heuristic(case.n, case.k, case.counts)
            row = bench.measure(case, cfg, roof, args.iterations, read_pattern=False)  # warm-up and timing
            prep = bench.prepared(case.gemm, (cfg.block_n, cfg.k_step))
            stamps = cp.ndarray((MAX_CTAS, SLOTS), cp.uint64,
                                jit._module(gg.SOURCE, (cfg.expression,)).get_global("lab_timeline"))
            stamps.fill(0)
            gg.grouped_gemm(prep, case.d_xp, case.d_xs, case.d_off, case.d_alpha, case.out, cfg)
            cp.cuda.Device().synchronize()
            raw = stamps.get()
            used = raw[raw[:, 0] > 0]  # the CTAs of this launch
            s = summary(used)
            print(f"{gemm} @{mean:g} {cfg}: {used.shape[0]} CTAs, median {row['ms']:.3f} ms", flush=True)
            for name, v in s.items():
                print(f"  {name:15s} min {v[0]:9.1f}  median {v[50]:9.1f}  max {v[100]:9.1f}", flush=True)
            report.append({"gemm": gemm, "mean_tokens": mean, "config": cfg.__dict__, "ctas": int(used.shape[0]),
                           "timed_ms": row["ms"], "us_from_first_entry": s})
    write_json(args.json, "notes/experiments/timeline_probe.py", runs=report)


if __name__ == "__main__":
    sys.exit(main())
