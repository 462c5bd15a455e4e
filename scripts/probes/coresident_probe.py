"""Probe: can a skewed GEMM's large experts run on the same SMs as its small ones, hiding their tensor work under the stream?"""
# At mean 8, skew 1.2 the split w13 is a small-expert launch that streams at ~90% of DRAM with ~38%
# of its issue slots and ~78% of its tensor pipe idle, and a large-expert launch that is tensor and
# decode bound (ncu, results/studies/skew_split_classes_on_sms.json ncu_skew1.2_w13_classes). On two
# streams they overlap only in each other's tail: the shipped large tile (256 rows x 160 tokens,
# 137 KB of shared memory per stage ring and all of the register file) cannot sit beside the small
# tile's two CTAs. A large-class tile of one consumer warpgroup (64 rows x 160 tokens, 151 or 137
# registers, 137 or 68 KB) can, one CTA per SM: beside the small tile's two CTAs (k_step 64) or one
# (k_step 128, the small tile at one CTA per SM). This times, alternating rounds in one process, the
# shipped split on two streams against those pairings (and each launch alone), and compares every
# output bit for bit with the shipped split's on the rows it writes. The 64-row tile needs the
# weights in its own layout (a second copy, for the probe only).
import argparse
import sys
from dataclasses import replace

import numpy as np

from lab.cli import output_path
from lab.gemm_bench import GemmBench, StreamPair, class_rows, log, write_json
from lab.gpu import require_gpu, run_script
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import grouped_gemm as gg
from lab.problem import MoEProblem

TAG = "coresident"


def narrow_tiles(hot: gc.GemmConfig) -> dict[str, gc.GemmConfig]:
    """The large class on one consumer warpgroup (64 rows, the shipped tile's token tile), one CTA
    per SM, at k_step 64 and 128."""
    return {f"64-row tile, k_step {k}": replace(hot, warps=4, row_tiles=1, k_step=k, stages=3, ctas_per_sm=1)
            for k in (64, 128)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--skews", type=float, nargs="+", default=[1.2, 0.8])
    ap.add_argument("--gemms", nargs="+", choices=["w13", "w2"], default=["w13", "w2"])
    ap.add_argument("--mean-tokens", type=float, default=8.0)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=output_path, metavar="PATH")
    args = ap.parse_args(argv)
    cp = require_gpu("coresident_probe")
    bench = GemmBench(MoEProblem(), tag=TAG)
    streams = StreamPair(cp)
    main_s = streams.main
    rows = []
    for skew, gemm, case, plan in bench.split_cases(args.skews, args.gemms, args.mean_tokens):
        cold, hot = plan
        layout = (cold[0].block_rows, cold[0].k_step)
        preps = {layout: bench.prepared(gemm, layout)}
        narrow = {name: cfg.validate(case.n, case.k) for name, cfg in narrow_tiles(hot[0]).items()}
        g = bench.gemms[gemm]
        for cfg in narrow.values():  # (the probe's own copies of the weights, one per narrow layout)
            key = (cfg.block_rows, cfg.k_step)
            if key not in preps:
                log(TAG, f"{gemm}: weights in the layout {key}")
                preps[key] = gw.prepare_weights(g["packed"], g["scales"], xp=cp, layout=key)

        def one(cfg, counts_in, stream):
            gg.grouped_gemm(preps[(cfg.block_rows, cfg.k_step)], case.d_xp, case.d_xs, case.d_off, case.d_alpha,
                            case.out, cfg, stream=stream, counts_in=counts_in)

        def two_streams(first, second):
            streams.both(lambda s: one(*first, s), lambda s: one(*second, s))

        cold_one = (replace(cold[0], ctas_per_sm=1), cold[1])
        modes = {"shipped, two streams (cold issued first)": lambda: two_streams(cold, hot),
                 "cold class alone": lambda: one(*cold, main_s),
                 "cold class alone, 1 CTA/SM": lambda: one(*cold_one, main_s),
                 "hot class alone (shipped tile)": lambda: one(*hot, main_s)}
        for name, cfg in narrow.items():
            n_hot = (cfg, hot[1])
            modes[f"hot class alone ({name})"] = lambda n_hot=n_hot: one(*n_hot, main_s)
            modes[f"cold + hot on the {name}, two streams"] = lambda n_hot=n_hot: two_streams(cold, n_hot)
            modes[f"cold at 1 CTA/SM + hot on the {name}, two streams"] = \
                lambda n_hot=n_hot: two_streams(cold_one, n_hot)
        writes = {m: (class_rows(case.counts, cold[1]) if m.startswith("cold class alone") else
                      class_rows(case.counts, hot[1]) if m.startswith("hot class alone") else np.ones(case.rows, bool))
                  for m in modes}
        got = bench.time_modes(case, modes, writes, "shipped, two streams (cold issued first)", args.iterations,
                               args.rounds, main_s)
        rows += bench.mode_rows(case, skew, plan, got, 58, narrow_tiles={k: v.__dict__ for k, v in narrow.items()})
        for key in list(preps):
            if key != layout:
                del preps[key]
    write_json(args.json, "scripts/probes/coresident_probe.py", rows=rows)
    return 1 if any(r["differ"] or r["unwritten"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(run_script(main, "coresident_probe"))
