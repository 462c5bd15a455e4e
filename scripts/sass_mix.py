"""The grouped GEMM's consumer stage loops as ptxas compiled them, counted without a GPU.

For each tile it compiles the kernel instantiation for sm_90a (nvcc), disassembles it (nvdisasm)
and finds the innermost loops that hold tensor instructions. A register-A wgmma tile has one such
loop per fragment count (the per-pass dispatch); the table gives, per loop, the instructions a
consumer warp issues per tile-step (its 16 weight rows by one k16 step, eight codes per thread),
split by class: the decode's share is 8 integer + 4 fp16 + 1 convert (gemm/decode.cuh), the
tensor instruction 1, and the rest is the loop's loads, descriptors, barriers and bookkeeping.
`uniform` counts instructions on the uniform datapath (R2UR moves into it included). The last
column is the consumers' issue time for one k16 step of a unit (every consumer warp's tile-steps of
it, over the SM's four schedulers), a floor to set against the measured cycles per k16 step
(notes/gemm-log.md v29: ~214-240 at 32 tokens per expert on the 64-token tile).

`--act fp8` reads the W4A8 GEMM instead (lab/kernels/w4a8_gemm.cu): for each token tile (or
`--tokens`), the group loop (one trip: the loader's copies, the decode of the warpgroup's 64 rows,
the fp8 wgmmas, the promotion, for one 128-column group or, in the image kernels, as many groups
as the trip releases ring stages) of its one-warpgroup, two-warpgroup and fused ring
instantiations and, from 64 tokens, of the activation-image kernels (plain, decode-ahead, the
192-token tile in wgmma batches, the fused image kernel). A loop with branches has several paths
through a trip (sass.loop_paths); each row is one steady path, the longest of those with the same
wgmmas a group (sass.steady_paths: every group on it decodes), so at 192 tokens a group of two
batches (a block of at most 128 tokens) and one of three. Per group on that path: the
instructions a warp issues, its wgmmas' tensor cycles (sass.tensor_cycles: the warp's share of the
work at the dense fp8 rate), their ratio (issue a tensor cycle: above 1 the issue alone keeps the
tensor core below full; below 1, the share of issue slots a full tensor core asks of each
scheduler, the same for every warp it hosts), and the issue time of one group on one scheduler
(instructions times the CTA's warpgroups: each scheduler hosts one warp of each). The classes
count the whole loop, every path once.

With several `--tree NAME=DIR` (each laid out as lab/kernels) the same tiles are compiled from
each tree, side by side: whether an edit moved the hot loop, before a same-process A/B on the GPU
(scripts/ab_kernels.py) says whether it moved the time. The last example sets the committed
kernels (unpacked by its first line into /tmp/base) beside the working tree's edited ones:

    python scripts/sass_mix.py                                     # the heuristic's tiles at 8-512 tokens
    python scripts/sass_mix.py --config 8,2,128,4,1,0,8,1 --tokens 32 40
    python scripts/sass_mix.py --act fp8 --tokens 32 64
    python scripts/sass_mix.py --act fp8 --tokens 128 192          # the image kernels at large batches
    mkdir -p /tmp/base && git archive HEAD lab/kernels | tar -x -C /tmp/base
    python scripts/sass_mix.py --tree base=/tmp/base/lab/kernels --tree work=lab/kernels --json mix.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lab.cli import HelpFormatter, output_path  # noqa: E402
from lab.device_info import lab_commit  # noqa: E402
from lab.gemm_bench import CONFIG_HELP, config_of, parse_config  # noqa: E402
from lab.kernels import gemm_config as gc  # noqa: E402
from lab.kernels import grouped_gemm as gg  # noqa: E402
from lab.kernels import jit, sass  # noqa: E402
from lab.problem import make_routing, tokens_for_mean  # noqa: E402

CLASS_COLUMNS = ("tensor", "fp16", "convert", "integer", "uniform", "shared", "sync", "branch")


def heuristic_tiles(means, experts=288, top_k=8, n=4096, k=4096) -> list[gc.GemmConfig]:
    """The heuristic's w13 tile at each mean (the study's shape, seeded ragged routing)."""
    tiles = []
    for mean in means:
        r = make_routing(tokens_for_mean(mean, experts, top_k), experts, top_k, seed=0)
        tiles.append(gc.heuristic(n, k, r.counts))
    return list(dict.fromkeys(tiles))


def tile_name(cfg: gc.GemmConfig) -> str:
    form = {0: "mma.sync", 1: "wgmma", 2: "wgmma SS"}[cfg.mma] + (" image" if cfg.image else "")
    return (f"{cfg.warps}x{cfg.row_tiles} k{cfg.k_step} s{cfg.stages} {8 * cfg.max_frags} tok "
            f"{form}{' ' + cfg.act if cfg.act != 'nvfp4' else ''}")


def rows_for(cfg: gc.GemmConfig, tree_name: str, tree: Path, tokens: set[int] | None, prepass: bool) -> list[dict]:
    """One row per tensor loop of the tile's plain instantiation: the in-kernel image where the tile
    writes it (GemmConfig.builders) unless `prepass`, as a launch over every expert runs it."""
    expression = cfg.validate().expression_for(False, builders=cfg.builders and not prepass)
    rows = []
    mixes = sass.stage_mixes(gg.SOURCE, expression, tree)
    for mix in sorted(mixes, key=lambda m: m.tokens):
        register_a = cfg.mma == 1 and mix.tokens > 0
        if tokens and not (register_a and mix.tokens in tokens):
            continue
        steps = sass.tile_steps(mix) if register_a else None
        row = {"tree": tree_name, "tile": tile_name(cfg), "config": dict(cfg.__dict__), "expression": expression,
               "tokens": mix.tokens if register_a else None,
               "loop_at": hex(mix.first), "tensor_ops": list(mix.tensor_ops), "instructions": mix.instructions,
               "tile_steps": steps, "counts": mix.counts, "opcodes": mix.opcodes}
        if steps:
            row["per_tile_step"] = round(mix.instructions / steps, 3)
            # every consumer warp's tile-steps of one k16 step of a unit, over the SM's 4 schedulers
            row["issue_cycles_per_k16_step"] = round(mix.instructions / steps * cfg.block_rows / 16 / 4, 1)
            row["per_tile_step_by_class"] = {c: round(mix.counts.get(c, 0) / steps, 3) for c in
                                             (*CLASS_COLUMNS, "fp32", "global", "other")}
        rows.append(row)
    return rows


def fp8_forms(t: int) -> list[tuple[str, str, int]]:
    """The W4A8 instantiations of token tile t that sass_mix reads: (kernel, expression,
    warpgroups)."""
    from lab.kernels import w4a8_gemm as wg

    forms = []
    if t in wg.TOKEN_TILES:
        forms += [("w4a8", wg.gemm_expression(t), 1), ("w4a8 wide", wg.wide_expression(t), 2)]
    if t in wg.FUSED_WIDE_TILES:
        forms += [("w4a8-fused", wg.swiglu_expression(t), 1), ("w4a8-fused wide", wg.swiglu_wide_expression(t), 2)]
    if t in wg.IMAGE_TILES:
        forms += [("w4a8 image", wg.image_expression(t), 2)]
    if t in wg.IMAGE_AHEAD_TILES:
        forms += [("w4a8 image ahead", wg.image_expression(t, ahead=True), 2)]
    if t in wg.IMAGE_TILES:
        if t != 128:  # (the plain fused form spills at 128 and is not built)
            forms += [("w4a8-fused image", wg.image_swiglu_expression(t), 2)]
        forms += [("w4a8-fused image ahead", wg.image_swiglu_expression(t, True), 2)]
    return forms


def fp8_rows(tree_name: str, tree: Path, tokens) -> list[dict]:
    """One row per steady path of each W4A8 instantiation's group loop (fp8_forms) for each tile in
    `tokens`: per group on it, the instructions, wgmmas, tensor cycles, issue a tensor cycle and
    issue cycles on one scheduler, and the whole loop's instructions by class."""
    from lab.kernels import w4a8_gemm as wg

    rows = []
    for t in tokens:
        for kernel, expression, warpgroups in fp8_forms(t):
            code = sass.kernel_sass(wg.GEMM_SOURCE, expression, tree)
            loops = sass.tensor_loops(code)
            if len(loops) != 1:
                raise RuntimeError(f"{expression}: expected one group loop holding the wgmmas, found {len(loops)}")
            mix = sass.loop_mix(code, loops[0])
            for path in sass.steady_paths(sass.loop_paths(code, loops[0])):
                groups = path.groups
                per_group = path.instructions / groups
                rows.append({"tree": tree_name, "kernel": kernel, "expression": expression, "tokens": t,
                             "warpgroups": warpgroups, "loop_at": hex(mix.first), "tensor_ops": list(mix.tensor_ops),
                             "loop_instructions": mix.instructions, "counts": mix.counts, "opcodes": mix.opcodes,
                             "groups_a_trip": groups, "wgmma_a_group": path.tensor_ops // groups,
                             "instructions_a_group": per_group, "tensor_cycles_a_group": path.tensor_cycles / groups,
                             "issue_a_tensor_cycle": round(path.issue_per_tensor_cycle, 4),
                             "issue_cycles_per_group": per_group * warpgroups})
    return rows


def print_fp8(rows: list[dict]) -> None:
    print(tabulate([[r["kernel"], r["tree"], r["tokens"], r["wgmma_a_group"], f"{r['instructions_a_group']:g}",
                     f"{r['tensor_cycles_a_group']:g}", f"{r['issue_a_tensor_cycle']:.3f}", r["loop_instructions"],
                     *(r["counts"].get(c, 0) for c in (*CLASS_COLUMNS, "fp32", "global")),
                     f"{r['issue_cycles_per_group']:g}"]
                    for r in rows],
                   headers=["kernel", "tree", "T", "wgmma / group", "instr / group", "tensor cycles / group",
                            "issue / tensor cycle", "loop instr", *CLASS_COLUMNS, "fp32", "global",
                            "issue cycles / group / scheduler"], tablefmt="github"))
    print("\nPer group on each steady path (the longest with its wgmmas); loop instr and the classes: the "
          "whole loop, every path once.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--mean-tokens", type=float, nargs="+", default=[8, 32, 64, 128, 512],
                    help="the heuristic's w13 tile at each mean tokens per expert (the study's shape)")
    ap.add_argument("--config", type=parse_config, action="append", default=[],
                    help=CONFIG_HELP + "; given, only these tiles")
    ap.add_argument("--act", choices=(*gc.ACTS, "fp8"), default="nvfp4",
                    help="the activations of --config tiles; fp8: the W4A8 GEMM's instantiations instead (no --config)")
    ap.add_argument("--tokens", type=int, nargs="+", help="only the loops of these wgmma N (8 x fragments); with --act fp8, these W4A8 token tiles")
    ap.add_argument("--tree", type=jit.parse_tree, action="append", default=[],
                    help="NAME=DIR: compile from this kernel tree (repeatable; default: lab/kernels)")
    ap.add_argument("--prepass", action="store_true",
                    help="the 128- and 160-token tiles as they run with the pre-pass (default: the in-kernel image)")
    ap.add_argument("--json", type=output_path, metavar="PATH", help="write the rows (with every opcode's count) here")
    args = ap.parse_args(argv)

    missing = [what for what, found in (("nvcc", jit.nvcc_path()), ("nvdisasm", sass.nvdisasm_path())) if not found]
    if missing:
        print(f"sass_mix needs {' and '.join(missing)} (the CUDA toolkit; nvdisasm also from "
              f"pip install nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    trees = args.tree or [("main", jit.KERNEL_DIR)]
    if args.act == "fp8":
        from lab.kernels import w4a8_gemm as wg

        if args.config:
            ap.error("--config: the W4A4/W4A16 GEMM's tiles; --act fp8 reads the W4A8 kernel's (--tokens picks them)")
        tiles = tuple(sorted(set(wg.TOKEN_TILES) | set(wg.IMAGE_AHEAD_TILES)))
        bad = [t for t in args.tokens or [] if t not in tiles]
        if bad:
            ap.error(f"--tokens: the W4A8 tiles are {tiles}, got {bad}")
        rows = []
        for name, tree in trees:
            try:
                rows += fp8_rows(name, tree, args.tokens or tiles)
            except (ValueError, RuntimeError) as e:
                print(f"W4A8 ({name}): {str(e).splitlines()[0]}", file=sys.stderr)
                return 1
        print_fp8(rows)
        write_rows(args.json, trees, rows)
        return 0
    if args.config:
        default = gc.GemmConfig(act=args.act)
        tiles = [config_of(v, default) for v in args.config]
    else:
        tiles = heuristic_tiles(args.mean_tokens)
    rows = []
    for cfg in tiles:
        for name, tree in trees:
            try:
                rows += rows_for(cfg, name, tree, set(args.tokens) if args.tokens else None, args.prepass)
            except (ValueError, RuntimeError) as e:
                print(f"{tile_name(cfg)} ({name}): {str(e).splitlines()[0]}", file=sys.stderr)
                return 1
    table = []
    for r in rows:
        per = r.get("per_tile_step_by_class")
        table.append([r["tile"], r["tree"], r["tokens"] or f"1-{8 * r['config']['max_frags']}", r["instructions"], r["tile_steps"] or "-",
                      r.get("per_tile_step", "-"), *((per[c] for c in CLASS_COLUMNS) if per else ["-"] * len(CLASS_COLUMNS)),
                      r.get("issue_cycles_per_k16_step", "-")])
    print(tabulate(table, headers=["tile", "tree", "tokens", "instr / trip", "tile-steps", "per tile-step",
                                   *CLASS_COLUMNS, "issue cycles / k16 step"], tablefmt="github"))
    if any(r["tile_steps"] is None for r in rows):
        print("\nmma.sync tiles: one loop holds every fragment count's case (a switch per stage), so its counts are "
              "per trip of all cases together, not per tile-step.")
    write_rows(args.json, trees, rows)
    return 0


def write_rows(path, trees, rows) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"script": "scripts/sass_mix.py", "argv": sys.argv[1:], "setup": {"lab_commit": lab_commit()},
                       "trees": {n: str(t) for n, t in trees}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
