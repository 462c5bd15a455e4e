"""The grouped GEMM over its tile space, like the study's tile table (tile, gemm, tokens, ms,
GB/s, roof%): does a token tile below 128, impossible in CUTLASS, recover anything on the H200?

By default one factor at a time around the heuristic's tile (token tile 8..128, block_rows 64..256,
K step 64..256, pipeline depth); `--full` takes the whole grid. A token tile smaller than an
expert's tokens makes the kernel take several passes over that expert's weights: that cost is
part of what the sweep measures. Tiles that cannot be built or launched are reported with the
reason, never dropped.

    python scripts/tile_sweep.py --json results/tile_sweep.json
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace

from tabulate import tabulate

from lab.device_info import setup_info
from lab.gpu import require_gpu, run_script
from lab.gemm_bench import GemmBench, log, problem_of, study_parser, write_json
from lab.kernels import gemm_config as gc
from lab.kernels.stream_read import measure_read_roofline
from lab.models import resolve_shape

TAG = "tile_sweep"
TOKEN_TILES = (8, 16, 32, 64, 128)
BLOCK_ROWS = {64: (4, 1), 128: (2, 4), 256: (4, 4)}  # rows per CTA -> (consumer warps, 16-row tiles per warp)
K_STEPS = (64, 128, 256)
STAGES = (2, 3, 4, 6)


def candidates(base: gc.GemmConfig, full: bool) -> list[tuple[dict, object]]:
    """(tile description, GemmConfig or the reason it cannot exist) for the sweep."""
    def make(tokens, block_rows, k_step, stages):
        # the heuristic's own warp split for its block_rows, the table's for the others
        w, r = (base.warps, base.row_tiles) if block_rows == base.block_rows else BLOCK_ROWS[block_rows]
        desc = {"token_tile": tokens, "block_rows": block_rows, "k_step": k_step, "stages": stages}
        frags = tokens // 8
        # token tiles past 64 exist on wgmma tiles only (gc.LARGE_FRAGS): the 128-token point is
        # built as the kernel builds it, not reported missing
        large = {"mma": 1} if frags in gc.LARGE_FRAGS and frags not in gc.MAX_FRAGS_CHOICES else {}
        if frags not in gc.MAX_FRAGS_CHOICES and not large:
            return desc, (f"token tile {tokens} not built (8 to {8 * gc.MAX_FRAGS_CHOICES[-1]}, or "
                          f"{', '.join(str(8 * f) for f in gc.LARGE_FRAGS)} on wgmma)")
        try:
            return desc, replace(base, warps=w, row_tiles=r, k_step=k_step, stages=stages,
                                 max_frags=frags, **large).validate()
        except ValueError as exc:
            return desc, str(exc)

    base_n = base.block_rows
    if full:
        grid = itertools.product(TOKEN_TILES, BLOCK_ROWS, K_STEPS, STAGES)
    else:
        pts = {(base.token_tile, base_n, base.k_step, base.stages)}
        pts |= {(t, base_n, base.k_step, base.stages) for t in TOKEN_TILES}
        pts |= {(base.token_tile, n, base.k_step, base.stages) for n in BLOCK_ROWS}
        pts |= {(base.token_tile, base_n, k, base.stages) for k in K_STEPS}
        pts |= {(base.token_tile, base_n, base.k_step, s) for s in STAGES}
        grid = pts
    # grouped by weight layout (block_rows, k_step): each layout is prepared once
    return [make(*p) for p in sorted(grid, key=lambda t: (t[1], t[2], t[0], t[3]))]


def main(argv=None) -> int:
    ap = study_parser(__doc__, [2, 4, 8, 32], 5)
    ap.add_argument("--gemms", nargs="+", default=["w13", "w2"], choices=["w13", "w2"], help="the GEMMs to sweep")
    ap.add_argument("--full", action="store_true", help="the whole grid, not one factor at a time")
    args = ap.parse_args(argv)
    resolve_shape(args, ap)
    require_gpu(TAG)  # before any output: without a GPU the script says so in one line

    problem = problem_of(args)
    setup = setup_info()
    roof = measure_read_roofline(iterations=max(5, args.iterations))
    bw = roof["gbps"]
    log(TAG, f"read roofline {bw:.0f} GB/s")
    bench = GemmBench(problem, args.seed, TAG)
    rows = []
    for mean in args.mean_tokens:
        for gemm in args.gemms:
            case = bench.case(gemm, mean)
            base = gc.heuristic(case.n, case.k, case.counts)
            cands = candidates(base, args.full)
            for i, (desc, cfg) in enumerate(cands):
                row = {"gemm": gemm, "mean_tokens": mean, **desc}
                if not isinstance(cfg, gc.GemmConfig):
                    row["error"] = cfg
                else:
                    log(TAG, f"{gemm} mean {mean}: {i + 1}/{len(cands)} {cfg}")
                    try:
                        row.update(bench.measure(case, cfg.validate(case.n, case.k), bw, args.iterations,
                                                 read_pattern=False))
                    except Exception as exc:  # compile or launch failure: reported in the table
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                if "error" in row:
                    log(TAG, f"{gemm} mean {mean}: {desc}: {row['error']}")
                rows.append(row)
    table = [[r["gemm"], r["mean_tokens"], r["token_tile"], r["block_rows"], r["k_step"], r["stages"],
              f"{r['ms']:.3f}" if "ms" in r else "-", f"{r['gbps']:.0f}" if "gbps" in r else "-",
              f"{r['roof_pct']:.1f}" if "roof_pct" in r else r.get("error", "")[:60]] for r in rows]
    print(f"read roofline: {bw:.0f} GB/s")
    print(tabulate(table, headers=["gemm", "tokens/expert", "token tile", "block_rows", "k_step", "stages", "ms",
                                   "GB/s", "roof% (or why not)"]))
    write_json(args.json, "scripts/tile_sweep.py", setup=setup,
               read_roofline=roof, rows=rows)
    return 1 if any(r.get("unwritten") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(run_script(main, TAG))
