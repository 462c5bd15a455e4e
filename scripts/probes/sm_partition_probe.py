"""Probe: does a skewed GEMM's split run faster with its large class on a fixed share of the SMs, issued first, and the small class on the rest?"""
# At mean 8, skew 1.2 the two launches of the split w13 barely overlap on two streams (0.612 ms
# against 0.480 + 0.144-0.165 alone, studies/skew_split_classes_on_sms.json coresident_probe):
# whichever is issued first takes every SM, the other runs in its tail. The small class is read
# bound, the large one tensor and decode bound, so a partition could pay: the large class on S SMs
# from the start (its CTAs take a whole SM each), the small class's CTAs on the other SMs at the
# read rate, both ending together. This times, alternating rounds in one process, the shipped split
# on two streams against the large class issued first on S SMs (grouped_gemm's `sms`) beside the
# small class on the rest, and each capped launch alone, and compares every output bit for bit.
import argparse
import sys

import numpy as np

from lab.cli import output_path
from lab.gemm_bench import GemmBench, StreamPair, class_rows, write_json
from lab.gpu import require_gpu, run_script
from lab.kernels import grouped_gemm as gg
from lab.problem import MoEProblem

TAG = "sm-partition"
# (one warp that spins on the global timer: holds a stream back without a host sleep)
SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--skews", type=float, nargs="+", default=[1.2, 0.8])
    ap.add_argument("--gemms", nargs="+", choices=["w13", "w2"], default=["w13", "w2"])
    ap.add_argument("--mean-tokens", type=float, default=8.0)
    ap.add_argument("--hot-sms", type=int, nargs="+", default=[16, 24, 32, 44],
                    help="SMs the large class's launch may take")
    ap.add_argument("--cold-delay-us", type=float, nargs="*", default=[20.0],
                    help="also time the partition with the small class held back this long on its stream (a spin "
                         "kernel), so that the large class's activation image pass is done and its CTAs placed first")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=output_path, metavar="PATH")
    args = ap.parse_args(argv)
    cp = require_gpu("sm_partition_probe")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    if not all(1 <= s < sms for s in args.hot_sms):
        raise SystemExit(f"--hot-sms: expected values in 1..{sms - 1}, got {args.hot_sms}")
    spin = cp.RawKernel(SPIN, "spin")
    bench = GemmBench(MoEProblem(), tag=TAG)
    streams = StreamPair(cp)
    main_s = streams.main
    rows = []
    for skew, gemm, case, plan in bench.split_cases(args.skews, args.gemms, args.mean_tokens):
        cold, hot = plan
        prep = bench.prepared(gemm, (cold[0].block_rows, cold[0].k_step))

        def one(launch, stream, on=None):
            cfg, counts_in = launch
            gg.grouped_gemm(prep, case.d_xp, case.d_xs, case.d_off, case.d_alpha, case.out, cfg, stream=stream,
                            counts_in=counts_in, sms=on)

        modes = {"shipped, two streams (cold issued first)":
                 lambda: streams.both(lambda s: one(cold, s), lambda s: one(hot, s)),
                 "hot issued first, every SM each":
                 lambda: streams.both(lambda s: one(hot, s), lambda s: one(cold, s)),
                 "cold class alone": lambda: one(cold, main_s),
                 "hot class alone": lambda: one(hot, main_s)}
        for s_hot in args.hot_sms:
            modes[f"hot on {s_hot} SMs first, cold on {sms - s_hot}"] = lambda s_hot=s_hot: streams.both(
                lambda s: one(hot, s, s_hot), lambda s: one(cold, s, sms - s_hot))
            modes[f"cold on {sms - s_hot} SMs first, hot on {s_hot}"] = lambda s_hot=s_hot: streams.both(
                lambda s: one(cold, s, sms - s_hot), lambda s: one(hot, s, s_hot))
            for d in args.cold_delay_us:
                modes[f"hot on {s_hot} SMs first, cold on {sms - s_hot} after {d:g} us"] = \
                    lambda s_hot=s_hot, d=d: streams.both(
                        lambda s: one(hot, s, s_hot),
                        lambda s: (spin((1,), (32,), (np.uint64(d * 1000),), stream=s), one(cold, s, sms - s_hot)))
            modes[f"hot alone on {s_hot} SMs"] = lambda s_hot=s_hot: one(hot, main_s, s_hot)
            modes[f"cold alone on {sms - s_hot} SMs"] = lambda s_hot=s_hot: one(cold, main_s, sms - s_hot)
        writes = {m: (class_rows(case.counts, cold[1]) if m.startswith(("cold alone", "cold class alone")) else
                      class_rows(case.counts, hot[1]) if m.startswith(("hot class alone", "hot alone")) else
                      np.ones(case.rows, bool)) for m in modes}
        got = bench.time_modes(case, modes, writes, "shipped, two streams (cold issued first)", args.iterations,
                               args.rounds, main_s)
        rows += bench.mode_rows(case, skew, plan, got, 52, sms=sms)
    write_json(args.json, "scripts/probes/sm_partition_probe.py", rows=rows)
    return 1 if any(r["differ"] or r["unwritten"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(run_script(main, "sm_partition_probe"))
