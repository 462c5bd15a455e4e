"""Probe: whether the layer's slow state follows the process, the buffers, the variant or the bandwidth."""
# Some processes time the layer 10-13% slower than others, for every variant or for some only.
# Interleaved rounds of the variants, then a rebuild of the layer (runner, buffers, graphs), a few
# times in one process with the flat read before each, separate those causes (notes/layer-log.md v15:
# it is the power cap).
import sys

import numpy as np

from lab.gemm_bench import problem_of, study_parser, write_json
from lab.gpu import require_gpu, run_script
from lab.kernels.stream_read import measure_read_roofline, stream_read
from lab.layer import load_layer, upload_weights
from lab.problem import make_routing, random_activations, random_weights, tokens_for_mean
from lab.runner import Runner
from lab.timing import time_cuda_samples
from lab.variants import make


def main(argv=None):
    ap = study_parser(__doc__, [8], 5)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", nargs="+", default=["separate", "cuda-graph", "fused-swiglu", "fused-layer"])
    ap.add_argument("--flat-in-rounds", action="store_true",
                    help="time the flat read as one more entry of every round (4 GB buffer kept)")
    args = ap.parse_args(argv)
    cp = require_gpu("slow_state_probe")  # before any output: without a GPU, one line
    problem = problem_of(args)
    dweights = upload_weights(random_weights(problem, seed=args.seed))
    mean = args.mean_tokens[0]
    routing = make_routing(tokens_for_mean(mean, problem.experts, problem.top_k), problem.experts,
                           problem.top_k, seed=args.seed)
    x = random_activations(routing.tokens, problem.hidden, seed=args.seed)
    rows = []
    for trial in range(args.trials):
        gbps = measure_read_roofline(iterations=5)["gbps"]
        cp.get_default_memory_pool().free_all_blocks()
        runner = Runner()
        layer = load_layer(runner, dweights, routing, x)
        vs = {name: make(name) for name in args.variants}
        for v in vs.values():
            runner.prepare(v, layer)
        med = {name: [] for name in vs}
        flat = None
        if args.flat_in_rounds:
            flat = cp.random.default_rng(trial).integers(0, 2**31 - 1, size=4_077_000_000 // 4, dtype=cp.int32)
            sink = cp.zeros(1, dtype=cp.uint32)
            med["flat-read"] = []
        for _ in range(args.rounds):
            for name, v in vs.items():
                med[name].append(float(np.median(runner.time_samples(v, layer, args.iterations, 2))))
            if flat is not None:
                ms = time_cuda_samples(lambda f=flat, st=runner.stream: stream_read(f, sink, st), args.iterations, 2,
                                       runner.stream)
                med["flat-read"].append(float(np.median(ms)))
        rows.append({"trial": trial, "flat_gbps": gbps, "round_medians_ms": med})
        print(f"trial {trial}: flat {gbps:.0f} GB/s  " + "  ".join(
            f"{n} " + "/".join(f"{m:.3f}" for m in ms) for n, ms in med.items()), flush=True)
        del runner, layer, vs, flat
        cp.get_default_memory_pool().free_all_blocks()
    write_json(args.json, "scripts/probes/slow_state_probe.py", rows=rows)


if __name__ == "__main__":
    sys.exit(run_script(main, "slow_state_probe"))
