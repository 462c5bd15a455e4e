"""Probe: does a split GEMM gain from running its size classes' launches on two streams?"""
# gemm_plan's launches run one after the other on one stream, so each launch's tail (SMs idle while
# the last units finish) is paid in full. On two streams the second launch's CTAs can take the SMs
# the first one's retiring CTAs free. For skewed routings at mean 8 this times, alternating rounds
# in one process: the plan on one stream (cold class first, as separate runs it), the same
# launches hot first, both classes on two streams in either issue order, and each class alone
# (what each launch costs by itself); every output is compared bit for bit with the one-stream
# run on the rows it writes.
import argparse
import sys

import numpy as np

from lab.cli import output_path
from lab.gemm_bench import GemmBench, StreamPair, class_rows, write_json
from lab.gpu import require_gpu, run_script
from lab.kernels import grouped_gemm as gg
from lab.problem import MoEProblem

TAG = "split_streams"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--skews", type=float, nargs="+", default=[1.2, 0.8])
    ap.add_argument("--mean-tokens", type=float, default=8.0)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=output_path, metavar="PATH")
    args = ap.parse_args(argv)
    cp = require_gpu("split_streams_probe")
    bench = GemmBench(MoEProblem(), tag=TAG)
    streams = StreamPair(cp)
    main_s = streams.main
    rows = []
    for skew, gemm, case, plan in bench.split_cases(args.skews, ("w13", "w2"), args.mean_tokens):
        cold, hot = plan
        prep = bench.prepared(gemm, (cold[0].block_rows, cold[0].k_step))
        xs = (prep, case.d_xp, case.d_xs, case.d_off, case.d_alpha, case.out)

        def one(launch, stream):
            gg.grouped_gemm(*xs, launch[0], stream=stream, counts_in=launch[1])

        def serial(first, second):
            one(first, main_s)
            one(second, main_s)

        def two_streams(first, second):
            streams.both(lambda s: one(first, s), lambda s: one(second, s))

        modes = {"one stream, cold first": lambda: serial(cold, hot),
                 "one stream, hot first": lambda: serial(hot, cold),
                 "two streams, cold issued first": lambda: two_streams(cold, hot),
                 "two streams, hot issued first": lambda: two_streams(hot, cold),
                 "cold class alone": lambda: one(cold, main_s),
                 "hot class alone": lambda: one(hot, main_s)}
        # the rows each mode writes: a class alone writes its experts' rows only
        writes = {m: np.ones(case.rows, bool) for m in modes}
        writes["cold class alone"] = class_rows(case.counts, cold[1])
        writes["hot class alone"] = class_rows(case.counts, hot[1])
        got = bench.time_modes(case, modes, writes, "one stream, cold first", args.iterations, args.rounds, main_s)
        rows += bench.mode_rows(case, skew, plan, got, 32)
    write_json(args.json, "scripts/probes/split_streams_probe.py", rows=rows)
    return 1 if any(r["differ"] or r["unwritten"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(run_script(main, "split_streams_probe"))
