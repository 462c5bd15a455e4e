"""Probe: is it the fused kernel's shape that costs fused-layer ~18 us over the one-launch-2G
ceiling at @8 (notes/layer.md v16, run D)? The fused CTA of 8-16-token tiles differs from the
plain one in four ways besides its epilogue code: two activation-decoder warps (plain: one), a
SwiGLU warp that idles through every w2 unit (8 warps, plain 6), the h tile in shared memory
(~111 KB per CTA with four stages against ~71 KB: less L1 beside it), and four stages (plain:
three). Each `--shapes` entry gives the plain kernel some of these, in the source and in
GemmConfig's mirror alike, and times one-launch-2G (plain kernels only) with fused-layer as the
control, which none of the edits touch. Timing only for the plain kernels' edits that change
nothing numerically either: the results stay exact, the probe just does not check them.

    python notes/experiments/shape_probe.py --shapes as-is all dw2 idle hsmem stages4 as-is
"""
import sys
from dataclasses import replace

from lab.gemm_bench import study_parser, write_json
from lab.kernels import grouped_gemm as gg
from lab.variants import make
from probe_common import edit_kernel, settled_ms, start_layer, study_layer

SRC = {
    "dw2": {"static constexpr int DW = FMAX >= 8 && FUSE == 0 ? 3 : FMAX >= 4 || FUSE != 0 ? 2 : 1;":
            "static constexpr int DW = FMAX >= 8 && FUSE == 0 ? 3 : 2;"},
    # one more warp that leaves at once (it waits at the final __syncthreads like every warp)
    "idle": {"static constexpr int THREADS = (W + 1 + DW + EW) * 32;":
             "static constexpr int THREADS = (W + 1 + DW + (EW ? EW : 1)) * 32;",
             "  if (warp > W) {\n    // ---------------- activation decoder warps":
             "  if (C::EW == 0 && warp > W + C::DW) goto finish;\n"
             "  if (warp > W) {\n    // ---------------- activation decoder warps"},
    "hsmem": {"static constexpr int SMEM = OFF_H + (EW ? TOKENS * H_STRIDE * 4 : 0);":
              "static constexpr int SMEM = OFF_H + TOKENS * H_STRIDE * 4;"},
}
SHAPES = {"as-is": (), "dw2": ("dw2",), "idle": ("idle",), "hsmem": ("hsmem",), "stages4": ("stages4",),
          "all": ("dw2", "idle", "hsmem", "stages4")}

_props = {name: getattr(gg.GemmConfig, name) for name in ("decoder_warps", "threads", "smem_bytes")}
SHIPPED_HEURISTIC = gg.heuristic


def apply(parts) -> None:
    subs = {}
    for p in parts:
        subs.update(SRC.get(p, {}))
    edit_kernel(subs)
    G = gg.GemmConfig
    for name, prop in _props.items():
        setattr(G, name, prop)
    if "dw2" in parts:
        G.decoder_warps = property(lambda c: 3 if c.max_frags >= 8 and not c.fuse else 2)
    if "idle" in parts:
        G.threads = property(lambda c: _props["threads"].fget(c) + (32 if not c.epilogue_warps else 0))
    if "hsmem" in parts:
        G.smem_bytes = property(lambda c: _props["smem_bytes"].fget(c) + (
            0 if c.epilogue_warps else c.token_tile * (c.block_n + 4) * 4))
    if "stages4" in parts:
        def heuristic(n, k, counts, layout=None):
            cfg = SHIPPED_HEURISTIC(n, k, counts, layout)
            return replace(cfg, stages=4).validate(n, k) if cfg.max_frags <= 2 else cfg
        gg.heuristic = heuristic
    else:
        gg.heuristic = SHIPPED_HEURISTIC
    gg.fused_config.cache_clear()


def main():
    ap = study_parser(__doc__, [8], 20)
    ap.add_argument("--shapes", nargs="+", default=["as-is", "all", "as-is"], choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=["one-launch-2G", "fused-layer"])
    ap.add_argument("--settle-ms", type=float, default=500.0)
    args = ap.parse_args()
    gbps, problem, dweights = start_layer(args)
    rows = []
    try:
        for shape in args.shapes:
            apply(SHAPES[shape])
            for mean in args.mean_tokens:
                runner, layer = study_layer(problem, dweights, mean, args.seed)
                for name in args.variants:
                    v = make(name)
                    ms = settled_ms(runner, v, layer, args.iterations, args.settle_ms)
                    cfg = gg.GemmConfig(4, 4, 128, 3, 2, 0)
                    rows.append({"shape": shape, "variant": name, "mean_tokens": mean, "ms": ms,
                                 "plain_threads": cfg.threads, "plain_smem": cfg.smem_bytes,
                                 "w13_cfg": str(layer.w13_cfg)})
                    print(f"{shape:8s} {name:13s} @{mean:g}: {ms:.4f} ms", flush=True)
                del runner, layer
    finally:
        apply(())
    write_json(args.json, "notes/experiments/shape_probe.py", roofline_gbps=gbps, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
