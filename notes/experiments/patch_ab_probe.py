"""Probe: kernel patches (notes/experiments/*.patch) against the shipped kernels, in one process
on one machine, so that the comparison does not cross boards (notes/layer.md v16: the same
kernels read 1.015-1.030 ms on three H200s). Each patch is applied to a copy of lab/kernels;
`--order` visits the trees in turn (0 = shipped, i = the i-th patch), rebuilding the variants
with that tree's kernels, checking each variant's bf16 output bit for bit against the shipped
tree's (a checked run on poisoned outputs) and timing it in a settled burst.

    python notes/experiments/patch_ab_probe.py --patches notes/experiments/unit_ring_info.patch \\
        notes/experiments/epilogue_scale_fold.patch --order 0 1 2 0 1 2 --json ab.json
"""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from lab.gemm_bench import study_parser, write_json
from lab.kernels import jit
from lab.variants import make
from probe_common import settled_ms, start_layer, study_layer

SHIPPED_DIR = jit.KERNEL_DIR


def patched_kernels(patch: Path) -> Path:
    """A copy of lab/kernels with `patch`'s hunks for it applied (git apply, which works outside a
    repository; hunks for other files, tests say, are left out)."""
    root = Path(tempfile.mkdtemp(prefix="lab_patch_"))
    shutil.copytree(SHIPPED_DIR, root / "lab" / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "apply", "--include=lab/kernels/*", str(patch.resolve())], cwd=root, check=True)
    return root / "lab" / "kernels"


def use(kernel_dir: Path) -> None:
    jit.KERNEL_DIR = kernel_dir
    jit._module.cache_clear()


def patch_trees(ap, args):
    """(visit order, kernel trees, their names) for `--patches` and `--order` (0 = shipped, the
    reference for the bits; default every tree twice in turn)."""
    order = args.order or list(range(len(args.patches) + 1)) * 2
    if order[0] != 0 or any(not 0 <= i <= len(args.patches) for i in order):
        ap.error(f"--order: start with 0 (the shipped tree, the bits' reference) and use 0..{len(args.patches)}")
    return order, [SHIPPED_DIR] + [patched_kernels(p) for p in args.patches], ["shipped"] + [p.stem for p in args.patches]


def main():
    ap = study_parser(__doc__, [8], 20)
    ap.add_argument("--patches", nargs="+", type=Path, required=True)
    ap.add_argument("--order", nargs="+", type=int, help="trees in turn: 0 shipped, i the i-th patch "
                    "(default 0 1 .. n 0 1 .. n)")
    ap.add_argument("--variants", nargs="+", default=["fused-layer", "cuda-graph"])
    ap.add_argument("--settle-ms", type=float, default=500.0)
    args = ap.parse_args()
    order, trees, names = patch_trees(ap, args)
    gbps, problem, dweights = start_layer(args)
    rows, reference = [], {}
    try:
        for mean in args.mean_tokens:
            runner, layer = study_layer(problem, dweights, mean, args.seed)
            for i in order:
                use(trees[i])
                for name in args.variants:
                    v = make(name)
                    runner.prepare(v, layer)
                    runner.checked_run(v, layer)
                    bits = layer.out_bf16.get()
                    key = (mean, name)
                    if i == 0 and key not in reference:
                        reference[key] = bits
                    same = bool(np.array_equal(bits, reference[key]))
                    ms = settled_ms(runner, v, layer, args.iterations, args.settle_ms, prepare=False)
                    rows.append({"tree": names[i], "variant": name, "mean_tokens": mean, "ms": ms,
                                 "bits_equal_shipped": same})
                    print(f"{names[i]:28s} {name:13s} @{mean:g}: {ms:.4f} ms  bits "
                          f"{'equal' if same else 'DIFFER'}", flush=True)
            del runner, layer
    finally:
        use(SHIPPED_DIR)
    write_json(args.json, "notes/experiments/patch_ab_probe.py", roofline_gbps=gbps,
               patches=[str(p) for p in args.patches], rows=rows)
    return 0 if all(r["bits_equal_shipped"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
