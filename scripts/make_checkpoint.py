"""Write a synthetic ModelOpt-style NVFP4 MoE checkpoint (safetensors) of any size.

    python scripts/make_checkpoint.py out.safetensors                      # the study's shape, 4.08 GB
    python scripts/make_checkpoint.py small.safetensors --experts 8 --hidden 512 --intermediate 256
    python scripts/make_checkpoint.py ckpt_dir --shards 4 --model qwen3-30b-a3b     # a sharded directory

With --shards N the output is a directory laid out as Hugging Face does a model: N shards of
consecutive experts (so the layer spans all of them), model.safetensors.index.json,
hf_quant_config.json and a config.json with the expert count and top-k; run_layer.py and
scale_fold_probe.py read it with --checkpoint DIR. A single file keeps the top-k in its
safetensors metadata (files written before it did read back with run_layer's default, 8).
Each step prints a line as it starts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.checkpoint import load_checkpoint, save_checkpoint, save_sharded_checkpoint  # noqa: E402
from lab.cli import HelpFormatter, output_problem  # noqa: E402
from lab.models import add_shape_arguments, resolve_shape  # noqa: E402
from lab.problem import MoEProblem, random_weights  # noqa: E402

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[make_checkpoint {time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    d = MoEProblem()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("out", type=Path, help="the .safetensors file to write (with --shards: the directory)")
    add_shape_arguments(p)
    p.add_argument("--ratio", type=float, default=d.gate_up_ratio, help="gate/up weight global ratio")
    p.add_argument("--layer", type=int, default=0, help="the layer index in the tensor names")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    p.add_argument("--shards", type=int, metavar="N",
                   help="write a directory of N shards with model.safetensors.index.json (default: one file)")
    p.add_argument("--check", action="store_true", help="read the checkpoint back and print its report")
    args = p.parse_args(argv)
    shape = resolve_shape(args, p, clamp_top_k=True)
    if args.layer < 0:
        p.error(f"--layer: must be >= 0, got {args.layer}")
    if args.shards is not None and not 1 <= args.shards <= shape.experts:
        p.error(f"--shards: must be in 1..{shape.experts} (at least one expert per shard), got {args.shards}")
    problem = MoEProblem(shape.experts, shape.hidden, shape.intermediate, shape.top_k, args.ratio)
    try:
        problem.validate({"gate_up_ratio": "--ratio"})  # the shape flags were checked by resolve_shape
    except ValueError as exc:
        p.error(str(exc))
    wrong = output_problem(args.out, folder=args.shards is not None)
    if wrong:
        hint = "; pass a file name, or --shards N to write a sharded folder" if args.shards is None and args.out.is_dir() else ""
        p.error(f"out: {wrong}{hint}")

    t0 = time.perf_counter()
    log(f"drawing synthetic weights: {problem.experts} experts, H={problem.hidden}, I={problem.intermediate}")
    weights = random_weights(problem, seed=args.seed)
    t1 = time.perf_counter()
    if args.shards is None:
        log(f"writing {args.out} ({weights.nbytes() / 1e9:.3f} GB)")
        save_checkpoint(args.out, weights, layer=args.layer, top_k=problem.top_k)
        size = args.out.stat().st_size
    else:
        paths = save_sharded_checkpoint(args.out, weights, layer=args.layer, shards=args.shards,
                                        top_k=problem.top_k, progress=log)
        size = sum(f.stat().st_size for f in paths)
    t2 = time.perf_counter()
    what = f"{args.shards} shards, " if args.shards is not None else ""
    print(f"wrote {args.out}: {what}{size / 1e9:.3f} GB, {problem.experts} experts, H={problem.hidden}, "
          f"I={problem.intermediate}, layer {args.layer} (generate {t1 - t0:.1f} s, write {t2 - t1:.1f} s)")
    if args.check:
        log(f"reading {args.out} back")
        _, report = load_checkpoint(args.out, layer=args.layer)
        print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
