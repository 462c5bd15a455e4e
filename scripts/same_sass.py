"""Whether two kernel trees compile to the same machine code, instantiation by instantiation.

A refactor of grouped_gemm.cu is checked on the cubins, not on the source: the same code moved
into a function can compile to the same PTX up to the numbering of virtual registers, and that
numbering alone changes ptxas's schedule (notes/gemm.md v19). For every instantiation the CPU
tests compile (the no-spill checks' set: shipped, read-only, counts-in, bf16-out, builders, fused,
the heuristic's and the splits' tiles, the activation image kernel) this script builds one cubin
per tree with `jit.compile_cubin` (nvcc for sm_90a) and compares the kernel's `.text` section byte
for byte; the kernel's other sections (`.nv.info`, `.nv.shared`, `.nv.constant0`) are reported
beside it. Line tables and debug sections are not compared: they move with the source lines.

    python scripts/same_sass.py --tree A=.dev/trees/before/lab/kernels --tree B=lab/kernels
    python scripts/same_sass.py --tree A=... --tree B=... --only 'Act::bf16' --jobs 2 --json same.json

Exit status 0 when every instantiation's `.text` is identical in every tree, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from lab.cli import HelpFormatter, output_path  # noqa: E402
from lab.kernels import gemm_config as gc  # noqa: E402
from lab.kernels import jit  # noqa: E402

SOURCE = "grouped_gemm.cu"
KERNEL_SECTIONS = (".text.", ".nv.info.", ".nv.shared.", ".nv.constant0.")


def _heuristic_tiles() -> list:
    """tests/test_grouped_gemm.py, _heuristic_tiles."""
    return [gc.heuristic(n, k, np.full(8, count))
            for n in (64, 128, 192, 256, 384, 512, 4096) for k in (64, 128, 320, 4096) for count in (1, 9, 17, 40, 70, 300)]


def _split_tiles() -> list:
    """tests/test_grouped_gemm.py, _split_tiles."""
    from lab.problem import make_routing

    counts = np.array([0, 1, 3, 9, 12, 16, 5, 2, 40, 150, 270, 7] * 8)
    plans = [gc.gemm_plan(n, k, counts) for n, k in ((4096, 4096), (4096, 2048))]
    plans += [gc.split_configs(4096, 4096, counts, 16)]
    for skew in (0.4, 0.8, 1.2):
        c = make_routing(288, 288, 8, skew=skew, seed=0).counts
        plans += [gc.gemm_plan(n, k, c) for n, k in ((4096, 4096), (4096, 2048))]
    return [cfg for plan in plans for cfg, _ in plan]


def _split_fused_tiles() -> list:
    """tests/test_fused.py, _split_fused_tiles."""
    from lab.problem import MoEProblem, make_routing
    from lab.variants import fused_layer
    from lab.variants.one_launch_2g import pair_config

    p = MoEProblem()
    cfgs = []
    for skew in (0.4, 0.8, 1.2):
        counts = make_routing(8 * p.experts // p.top_k, p.experts, p.top_k, skew=skew, seed=0).counts
        w13_plan = gc.gemm_plan(2 * p.intermediate, p.hidden, counts)
        layer = type("Layer", (), dict(problem=p, counts=counts, w13_plan=w13_plan,
                                       w2_plan=gc.gemm_plan(p.hidden, p.intermediate, counts)))
        one = pair_config(gc.heuristic(2 * p.intermediate, p.hidden, counts),
                          gc.heuristic(p.hidden, p.intermediate, counts))
        cfgs += [gc.fused_config(c, "swiglu") for c, _ in w13_plan]
        cfgs += [gc.fused_config(c, "layer") for c, _ in fused_layer.launches(layer, one)]
    return cfgs


def instantiations() -> list[str]:
    """Every instantiation of grouped_gemm.cu that the CPU tests' no-spill checks compile, once each."""
    exprs = []
    for cfg in gc.SHIPPED_CONFIGS:  # test_grouped_gemm
        exprs += [cfg.expression_for(False), cfg.expression_for(True)]
    exprs += [cfg.expression for cfg in _heuristic_tiles()]
    exprs += [cfg.expression_for(False, counts_in=True) for cfg in _split_tiles()]
    for cfg in gc.SHIPPED_FUSED:  # test_fused
        exprs += [cfg.expression, replace(cfg, mode="plain").expression]
    exprs += [cfg.expression_for(False, counts_in=True) for cfg in _split_fused_tiles()]
    for cfg in gc.SHIPPED_IMAGE:  # test_gemm_image
        exprs += [cfg.expression_for(False, bf16_out=b) for b in (False, True)]
    built = [replace(c, build_image=True) for c in gc.SHIPPED_IMAGE if c.mma == 1 and c.warps == 8 and not c.wide]
    for cfg in [c for c in gc.SHIPPED_IMAGE if c.builders] + built:
        exprs += [cfg.expression_for(ro, ci, bf16_out=bo, builders=True)
                  for ro, ci, bo in ((False, False, False), (False, False, True), (False, True, False), (True, False, False))]
        if cfg.act == "nvfp4" and cfg.wide:
            exprs.append(gc.fused_config(cfg, "swiglu").expression_for(False, builders=True))
    exprs += [f"lab_gemm::act_image<lab_gemm::Act::{act}>" for act in gc.ACTS]
    exprs += [cfg.expression_for(False) for cfg in gc.SHIPPED_LARGE]  # test_gemm_large_tiles
    for cfg in gc.SHIPPED_SS:  # test_gemm_ss
        exprs += [cfg.expression_for(False, ci) for ci in (False, True)]
    exprs += [cfg.expression_for(False) for cfg in gc.SHIPPED_W4A16 + gc.SHIPPED_FUSED_W4A16]  # test_gemm_w4a16
    return sorted(set(exprs))


def elf_sections(data: bytes) -> dict[str, bytes]:
    """Section name -> contents of a little-endian ELF64 file (a cubin); NOBITS sections (.nv.shared.*)
    as their size in 8 bytes, so that a change of size still shows."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx]
    names = data[strtab[4]:strtab[4] + strtab[5]]
    out = {}
    for name_off, sh_type, _flags, _addr, off, size, *_ in headers:
        name = names[name_off:names.index(b"\0", name_off)].decode()
        out[name] = struct.pack("<Q", size) if sh_type == 8 else data[off:off + size]
    return out


def kernel_sections(cubin: Path, report: str, expression: str) -> dict[str, bytes]:
    """The instantiated kernel's sections, keyed by prefix (".text." ...), from compile_cubin's cubin."""
    mangled = jit.entry_name(report, expression)
    sections = elf_sections(cubin.read_bytes())
    return {prefix: sections[prefix + mangled] for prefix in KERNEL_SECTIONS if prefix + mangled in sections}


def compile_sections(tree: Path, expression: str, cache: Path | None) -> dict[str, bytes]:
    """kernel_sections of `expression` compiled from `tree`; with `cache`, kept under the hash of the
    tree's source (headers inlined) and the expression, so an unchanged tree compiles once."""
    key = None
    if cache is not None:
        key = hashlib.sha256((jit.source(SOURCE, tree) + "\0" + expression).encode()).hexdigest()[:32]
        hit = cache / f"{key}.json"
        if hit.is_file():
            return {k: bytes.fromhex(v) for k, v in json.loads(hit.read_text()).items()}
    with tempfile.TemporaryDirectory() as tmp:
        cubin, report = jit.compile_cubin(SOURCE, expression, Path(tmp), tree)
        got = kernel_sections(cubin, report, expression)
    if key is not None:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"{key}.json").write_text(json.dumps({k: v.hex() for k, v in got.items()}))
    return got


def compare(trees: list[tuple[str, Path]], expressions: list[str], jobs: int = 1, cache: Path | None = None,
            progress=None) -> list[dict]:
    """One row per expression: whether its .text (and each other kernel section) is the same in every tree."""
    def one(expression: str) -> dict:
        got = {name: compile_sections(tree, expression, cache) for name, tree in trees}
        first = got[trees[0][0]]
        row = {"expression": expression,
               "text_bytes": {name: len(s.get(".text.", b"")) for name, s in got.items()},
               "text_identical": all(s.get(".text.") == first.get(".text.") for s in got.values()),
               "other_sections_differ": sorted({prefix for s in got.values() for prefix in KERNEL_SECTIONS[1:]
                                                if s.get(prefix) != first.get(prefix)})}
        if progress is not None:
            progress(row)
        return row

    with ThreadPoolExecutor(max(1, jobs)) as pool:  # (each job waits on its own nvcc)
        return list(pool.map(one, expressions))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--tree", type=jit.parse_tree, action="append", required=True,
                    help="NAME=DIR: a kernel tree laid out as lab/kernels (two or more)")
    ap.add_argument("--only", action="append", default=[],
                    help="compare only the instantiations whose expression contains this text (repeatable: any)")
    ap.add_argument("--expression", action="append", default=[],
                    help="compare this instantiation instead of the tests' set (repeatable)")
    ap.add_argument("--jobs", type=int, default=1, help="nvcc processes at once")
    ap.add_argument("--cache", type=Path, help="keep each compile's sections here, by source hash and expression")
    ap.add_argument("--json", type=output_path, help="write the rows here")
    args = ap.parse_args(argv)
    if len(args.tree) < 2:
        ap.error("--tree: give two or more trees to compare")
    if jit.nvcc_path() is None:
        ap.error("needs nvcc (CUDA toolkit) on PATH or in CUDA_PATH")
    exprs = args.expression or instantiations()
    if args.only:
        exprs = [e for e in exprs if any(o in e for o in args.only)]
    start = time.time()

    def progress(row):
        mark = "identical" if row["text_identical"] else "DIFFERENT"
        extra = f"  (other sections differ: {', '.join(row['other_sections_differ'])})" if row["other_sections_differ"] else ""
        print(f"{mark:9}  {row['expression']}{extra}", flush=True)

    rows = compare(args.tree, exprs, args.jobs, args.cache, progress)
    same = sum(r["text_identical"] for r in rows)
    print(f"\n.text identical in {same} of {len(rows)} instantiations across trees "
          f"{', '.join(n for n, _ in args.tree)} ({time.time() - start:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"trees": {n: str(t) for n, t in args.tree}, "rows": rows}, indent=1))
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
