"""Write a synthetic ModelOpt-style NVFP4 MoE checkpoint (safetensors) of any size.

    python scripts/make_checkpoint.py out.safetensors                      # the study's shape, 4.08 GB
    python scripts/make_checkpoint.py small.safetensors --experts 8 --hidden 512 --intermediate 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from lab.problem import MoEProblem, random_weights  # noqa: E402


def main(argv=None) -> int:
    d = MoEProblem()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="path of the .safetensors file to write")
    p.add_argument("--experts", type=int, default=d.experts)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--ratio", type=float, default=d.gate_up_ratio, help="gate/up weight global ratio")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="read the file back and print its report")
    args = p.parse_args(argv)

    problem = MoEProblem(args.experts, args.hidden, args.intermediate, min(d.top_k, args.experts), args.ratio)
    try:
        problem.validate()
    except ValueError as exc:
        p.error(str(exc))
    t0 = time.perf_counter()
    weights = random_weights(problem, seed=args.seed)
    t1 = time.perf_counter()
    save_checkpoint(args.out, weights, layer=args.layer)
    t2 = time.perf_counter()
    size = args.out.stat().st_size
    print(f"wrote {args.out}: {size / 1e9:.3f} GB, {problem.experts} experts, H={problem.hidden}, "
          f"I={problem.intermediate}, layer {args.layer} (generate {t1 - t0:.1f} s, write {t2 - t1:.1f} s)")
    if args.check:
        _, report = load_checkpoint(args.out, layer=args.layer)
        print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
