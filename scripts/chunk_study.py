"""chunked-k for k = 1..32: does chunking lose time through tail effect or through launch and
scheduling?

For each k it reports the layer time (the captured graph, as run_layer times it), each chunk's
w13 units against the CTAs resident on the SMs (wave quantisation: how full the last wave is),
and, from one directly launched run with events around every stage, the idle time of the w13
weight stream between chunks and the time no stage was running at all. k = 1 is the unchunked
layer: `cuda-graph` for the time, `separate` for the timeline.

    python scripts/chunk_study.py --json results/chunk_study.json
"""

from __future__ import annotations

import sys

import numpy as np
from tabulate import tabulate

from lab.device_info import setup_info
from lab.gpu import require_gpu, run_script
from lab.gemm_bench import log, problem_of, study_parser, write_json
from lab.kernels import gemm_config as gc
from lab.kernels import grouped_gemm as gg
from lab.kernels import jit
from lab.kernels.stream_read import measure_read_roofline
from lab.models import resolve_shape
from lab.problem import make_routing, random_activations, random_weights, tokens_for_mean
from lab.roofline import layer_bytes, roofline_ms

TAG = "chunk_study"


def waves(counts: np.ndarray, bounds, cfg: gc.GemmConfig, n: int, ctas: int) -> list[float]:
    """w13 units of each chunk over the resident CTAs (1.25 = one full wave and a quarter)."""
    return [float((counts[e0:e1] > 0).sum() * (n // cfg.block_rows) / ctas) for e0, e1 in bounds]


def timeline(spans: list[dict]) -> dict:
    """Idle time between consecutive chunks' w13 (the weight stream waiting), and time with no
    stage running, from one run's stage spans (four per chunk, in launch order)."""
    w13 = [s for s in spans if s["stage"] == "w13"]
    gaps = [max(0.0, b["start_ms"] - a["stop_ms"]) for a, b in zip(w13, w13[1:])]
    ivs = sorted((s["start_ms"], s["stop_ms"]) for s in spans)
    busy, cur0, cur1 = 0.0, None, None
    for a, b in ivs:
        if cur1 is None or a > cur1:
            busy += 0.0 if cur1 is None else cur1 - cur0
            cur0, cur1 = a, b
        else:
            cur1 = max(cur1, b)
    busy += 0.0 if cur1 is None else cur1 - cur0
    total = max(s["stop_ms"] for s in spans) if spans else 0.0
    return {"w13_gap_ms": float(sum(gaps)), "w13_gaps": gaps, "idle_ms": total - busy, "span_ms": total}


def main(argv=None) -> int:
    ap = study_parser(__doc__, [8, 32], 10)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                    help="chunk counts to time (1: the unchunked layer)")
    args = ap.parse_args(argv)
    if any(k < 1 for k in args.k):
        ap.error("--k: every k must be >= 1")
    resolve_shape(args, ap)
    cp = require_gpu(TAG)  # before any output: without a GPU the script says so in one line

    from lab.layer import load_layer, upload_weights
    from lab.runner import Runner
    from lab.variants import make
    from lab.variants.chunked import Chunked, chunk_bounds

    problem = problem_of(args)
    setup = setup_info()
    log(TAG, "weights")
    dweights = upload_weights(random_weights(problem, seed=args.seed))
    roof = measure_read_roofline(iterations=args.iterations)
    cp.get_default_memory_pool().free_all_blocks()
    gbps = roof["gbps"]
    log(TAG, f"read roofline {gbps:.0f} GB/s")
    sms = jit.sm_count()
    rows = []
    for i, mean in enumerate(args.mean_tokens):
        routing = make_routing(tokens_for_mean(mean, problem.experts, problem.top_k), problem.experts,
                               problem.top_k, seed=args.seed)
        runner = Runner()
        layer = load_layer(runner, dweights, routing, random_activations(routing.tokens, problem.hidden,
                                                                          seed=args.seed + i))
        cfg = layer.w13_cfg
        fn = jit.kernel(gg.SOURCE, cfg.expression, cfg.launch_smem(problem.experts))
        roof_ms = roofline_ms(layer_bytes(problem, routing.counts, active=True).total, gbps)
        for k in args.k:
            # k = 1: the unchunked layer, captured like chunked-k is (cuda-graph), launched directly (separate)
            graphed, direct = (make("cuda-graph"), make("separate")) if k == 1 else (Chunked(k), Chunked(k, graph=False))
            runner.prepare(graphed, layer)
            t = runner.time(graphed, layer, iterations=args.iterations, warmup=3)
            runner.prepare(direct, layer)
            runner.run(direct, layer)  # warm
            tl = timeline(runner.stage_spans(direct, layer))
            bounds = chunk_bounds(problem.experts, k)
            ctas = sms * gc.resident_ctas(cfg, max(e1 - e0 for e0, e1 in bounds), fn.num_regs)
            wv = waves(routing.counts, bounds, cfg, 2 * problem.intermediate, ctas)
            row = {"mean_tokens": mean, "k": k, "ms": t.median_ms, "ms_min": t.min_ms, "ms_max": t.max_ms,
                   "roof_pct": 100 * roof_ms / t.median_ms, "w13_waves": wv,
                   "last_wave_fill": [w - np.floor(w) if w % 1 else 1.0 for w in wv], **tl}
            rows.append(row)
            log(TAG, f"mean {mean} k={k}: {t.median_ms:.3f} ms, w13 gaps {tl['w13_gap_ms']:.3f} ms, "
                     f"idle {tl['idle_ms']:.3f} ms")
    table = [[r["mean_tokens"], r["k"], f"{r['ms']:.3f}", f"{r['roof_pct']:.1f}",
              f"{np.mean(r['w13_waves']):.2f}", f"{np.mean(r['last_wave_fill']):.2f}",
              f"{r['w13_gap_ms']:.3f}", f"{r['idle_ms']:.3f}", f"{r['span_ms']:.3f}"] for r in rows]
    print(f"read roofline: {gbps:.0f} GB/s")
    print(tabulate(table, headers=["tokens/expert", "k", "ms (graph)", "roof%", "w13 waves/chunk",
                                   "last-wave fill", "w13 gaps ms (direct)", "idle ms (direct)",
                                   "span ms (direct)"]))
    write_json(args.json, "scripts/chunk_study.py", setup=setup,
               read_roofline=roof, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main, TAG))
