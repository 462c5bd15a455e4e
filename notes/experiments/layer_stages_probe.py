"""Probe: pipeline depth of the 8-16-token tiles in the whole layer. The heuristic gives them
three stages (two CTAs per SM, ~54 KB of weights in flight each); four fit beside the fused
kernel's h tile (111 KB per CTA) and were level for the plain GEMMs with tensor copies
(notes/gemm.md v14). Untested for the fused kernels, whose epilogue warp and h hand-off change
what a stage waits for. `--stages 3 4 3 4` builds the layer with each depth in turn (plain and
fused kernels alike) and times the variants in settled bursts, as run_layer.py does.
`--fused-stages 3 4 3 4` leaves the plain heuristic as shipped and sets the floor that
fused_config gives fused tiles of <= 16 tokens (FUSED_SMALL_STAGES; 3 = the kernels before it)."""
import sys
from dataclasses import replace

from lab.gemm_bench import study_parser, write_json
from lab.kernels import grouped_gemm as gg
from lab.variants import make
from probe_common import settled_ms, start_layer, study_layer

SHIPPED = gg.heuristic


def main():
    ap = study_parser(__doc__, [8], 20)
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4, 3, 4])
    ap.add_argument("--fused-stages", type=int, nargs="+",
                    help="instead of --stages: FUSED_SMALL_STAGES in turn, plain tiles as shipped")
    ap.add_argument("--variants", nargs="+", default=["cuda-graph", "fused-swiglu", "fused-layer"])
    ap.add_argument("--settle-ms", type=float, default=500.0)
    args = ap.parse_args()
    gbps, problem, dweights = start_layer(args)
    rows = []
    shipped_floor = gg.FUSED_SMALL_STAGES
    for stages in args.fused_stages or args.stages:
        if args.fused_stages:
            gg.FUSED_SMALL_STAGES = stages
            gg.fused_config.cache_clear()
        else:
            def heuristic(n, k, counts, layout=None, stages=stages):
                cfg = SHIPPED(n, k, counts, layout)
                return replace(cfg, stages=stages).validate(n, k) if cfg.max_frags <= 2 else cfg
            gg.heuristic = heuristic  # load_layer asks the module for its tiles
        for mean in args.mean_tokens:
            runner, layer = study_layer(problem, dweights, mean, args.seed)
            for name in args.variants:
                v = make(name)
                ms = settled_ms(runner, v, layer, args.iterations, args.settle_ms)
                rows.append({"stages": stages, "fused_floor": bool(args.fused_stages), "variant": name, "mean_tokens": mean, "ms": ms,
                             "config": str(layer.w13_cfg) if hasattr(layer, "w13_cfg") else None})
                print(f"stages {stages} {name:13s} @{mean:g}: {ms:.4f} ms", flush=True)
            del runner, layer
    gg.heuristic = SHIPPED
    gg.FUSED_SMALL_STAGES = shipped_floor
    gg.fused_config.cache_clear()
    write_json(args.json, "notes/experiments/layer_stages_probe.py", roofline_gbps=gbps, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
