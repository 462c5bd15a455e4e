"""One place that compiles, caches and inspects the lab's CUDA C kernels.

Kernel sources are `.cu` files beside this module, read as text. At run time CuPy compiles them
with NVRTC for sm_90a (wgmma, setmaxnreg and the e4m3 conversions need the `a` target); template
instantiations are named by `name_expressions`, never built by string formatting. Without a GPU,
`ptxas_report` compiles the same instantiations with `nvcc -cubin -Xptxas -v` (`compile_cubin`) so CPU
tests can check registers, stack and spills, and `sass.py` can read the machine code.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lab.gpu import require_gpu

KERNEL_DIR = Path(__file__).resolve().parent
ARCH_OPTIONS = ("-arch=sm_90a", "-std=c++17")


_INCLUDE = re.compile(r'^#include "([\w./]+)"\s*$', re.M)


def source(name: str, tree: Path | None = None) -> str:
    """The text of `lab/kernels/<name>` (or `<tree>/<name>`) with every `#include "path"` inlined
    once, a fragment of a body (.inc) at each place it is named (paths relative to the including
    file, as nvcc resolves them): NVRTC gets one string, and CuPy's cache key (the string)
    changes when any header does."""
    root = (Path(tree) if tree is not None else KERNEL_DIR).joinpath(name).resolve()
    seen = {root}

    def expand(path: Path) -> str:
        def include(m: re.Match) -> str:
            header = (path.parent / m.group(1)).resolve()
            if header.suffix != ".inc" and header in seen:  # a fragment (.inc) goes in wherever it is named
                return ""
            seen.add(header)
            return expand(header).replace("#pragma once", "")

        return _INCLUDE.sub(include, path.read_text())

    return expand(root)


# The source tree kernel() compiles from: this directory, or the one use_tree names.
_TREES = [KERNEL_DIR]


def parse_tree(text: str) -> tuple[str, Path]:
    """A script's --tree value, NAME=DIR: (NAME, DIR resolved), DIR laid out as lab/kernels (it
    holds grouped_gemm.cu) and NAME of letters, digits, - or _; argparse's error otherwise."""
    name, sep, path = text.partition("=")
    if (not sep or not name or not path or not name.replace("-", "").replace("_", "").isalnum()
            or not (Path(path) / "grouped_gemm.cu").is_file()):
        raise argparse.ArgumentTypeError(f"--tree: expected NAME=DIR (NAME of letters, digits, - or _; DIR laid out as "
                                         f"lab/kernels, holding grouped_gemm.cu), got {text!r}")
    return name, Path(path).resolve()


@contextlib.contextmanager
def use_tree(path):
    """Within the block, kernel() compiles every kernel from `path`, a directory laid out as
    lab/kernels (e.g. another commit's, from `git archive`), one module per tree: two versions of a
    kernel side by side in one process, for a same-process A/B (scripts/ab_kernels.py)."""
    tree = Path(path).resolve()
    if not (tree / "grouped_gemm.cu").is_file():
        raise ValueError(f"tree: expected a directory laid out as lab/kernels (holding grouped_gemm.cu), got {path}")
    _TREES.append(tree)
    try:
        yield tree
    finally:
        _TREES.pop()


def current_tree() -> Path:
    """The tree kernels compile from now: lab/kernels, or the innermost use_tree's."""
    return _TREES[-1]


def current_tree_key() -> str:
    """"" in lab/kernels, else "@" and 8 hex digits of the current tree's path: a suffix for buffers
    a tree's kernels lay out (an activation image written in prepare and read in run), so that a
    variant from another tree, whose layout may differ, never shares them with this checkout's."""
    tree = current_tree()
    return "" if tree == KERNEL_DIR.resolve() else "@" + hashlib.sha1(str(tree).encode()).hexdigest()[:8]


@functools.lru_cache(maxsize=None)
def _module(name: str, name_expressions: tuple[str, ...], tree: Path = KERNEL_DIR):
    import cupy as cp

    return cp.RawModule(code=source(name, tree), options=ARCH_OPTIONS, name_expressions=name_expressions)


def kernel(name: str, expression: str, smem_bytes: int = 0):
    """The compiled kernel `expression` (a template instantiation) from source file `name`."""
    require_gpu(f"compiling {expression}")
    fn = _module(name, (expression,), _TREES[-1]).get_function(expression)
    if smem_bytes > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem_bytes
    return fn


def sm_count() -> int:
    """Multiprocessors of the current device, looked up once per device (launchers size
    persistent grids with it on every launch; CuPy's `attributes` queries them all each time)."""
    import cupy as cp

    return _sm_count(cp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy as cp

    return int(cp.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


@dataclass(frozen=True)
class PtxasInfo:
    expression: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    smem_static: int
    wgmma_serialized: bool  # ptxas's "Potential Performance Loss: wgmma ... serialized"
    # ptxas's C7507, "'setmaxnreg' ignored to maintain minimum register requirements": the
    # consumers would run on the entry budget. The message names no function; ptxas_report's unit
    # compiles one kernel that could carry it (the marker has none)
    setmaxnreg_ignored: bool = False


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return None


def ptxas_report(name: str, expression: str) -> PtxasInfo:
    """Compile one instantiation with nvcc for sm_90a and parse its `-Xptxas -v` report."""
    with tempfile.TemporaryDirectory() as tmp:
        _, report = compile_cubin(name, expression, Path(tmp))
    return _parse_ptxas(report, expression)


def compile_cubin(name: str, expression: str, out_dir: Path, tree: Path | None = None) -> tuple[Path, str]:
    """nvcc -cubin of source file `name` (from `tree`, default this directory) for sm_90a with the
    instantiation `expression`, into `out_dir`: the cubin's path and ptxas's `-v` report."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("compiling a cubin needs nvcc (CUDA toolkit) on PATH or in CUDA_PATH")
    src = (Path(tree) if tree is not None else KERNEL_DIR) / name
    if not src.is_file():
        raise ValueError(f"name: no kernel source {src}")
    unit = Path(out_dir) / "inst.cu"
    cubin = Path(out_dir) / "inst.cubin"
    # Naming the kernel in a marker kernel's template argument instantiates it, and the
    # marker's entry in the report carries the kernel's mangled name as the compiler spells
    # it, whatever the expression's template arguments or typedefs. (Taking the kernel's
    # address in device code instead would change how ptxas compiles it.)
    unit.write_text(f'#include "{src.resolve()}"\n'
                    f"template <auto F> __global__ void {_MARKER}() {{}}\n"
                    f"void* lab_keep = (void*)&{_MARKER}<&{expression}>;\n")
    proc = subprocess.run(
        [nvcc, "-cubin", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
         "-o", str(cubin), str(unit)],
        capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {expression}:\n{proc.stderr[-4000:]}")
    return cubin, proc.stderr


def entry_name(report: str, expression: str) -> str:
    """The mangled name of the kernel compile_cubin's unit instantiated, read from its ptxas report
    through the marker's entry."""
    marked = [m for m in (_MARKED.fullmatch(e) for e in _ENTRY.findall(report)) if m]
    if len(marked) != 1:
        raise RuntimeError(f"ptxas output for {expression} names {len(marked)} marker entries, expected 1:\n"
                           f"{report[:2000]}")
    return _unshift_substitutions(marked[0].group(1))


_MARKER = "lab_ptxas_which"
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_MARKED = re.compile(rf"_Z{len(_MARKER)}{_MARKER}IXadL(_Z\w+)EEEvv")
_B36 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _unshift_substitutions(mangled: str) -> str:
    """`mangled` with every substitution reference S<seq-id>_ one lower.

    Inside the marker's name the kernel's mangled name follows one substitution candidate of
    its own (the marker's template name), so each of the kernel's back-references counts one
    more than in the kernel's own name. A small reader of the grammar the kernels use: source
    names are skipped by their length prefix and a literal's value up to its E, so neither is
    read as a reference, while a literal's type (an enum's nested name) is read like any name."""
    out: list[str] = []

    def token(i: int) -> int:
        c = mangled[i]
        if c.isdigit():  # <source-name>: length, identifier
            j = i
            while mangled[j].isdigit():
                j += 1
            j += int(mangled[i:j])
            out.append(mangled[i:j])
            return j
        if c == "S" and (m := re.match(r"S([0-9A-Z]*)_", mangled[i:])):
            if not m.group(1):
                raise ValueError(f"{mangled}: S_ refers to the marker, not to the kernel's name")
            seq = int(m.group(1), 36)  # S_ is candidate 0, S<seq>_ candidate seq + 1
            out.append("S_" if seq == 0 else "S" + _base36(seq - 1) + "_")
            return i + m.end()
        if c in "TA" and (m := re.match(r"[TA][0-9]*_", mangled[i:])):  # template parameter, array bound
            out.append(m.group(0))
            return i + m.end()
        if c == "L" and not mangled.startswith("L_Z", i):  # literal: L <type> <value> E
            out.append(c)
            if mangled[i + 1] in "NS0123456789":  # a named type (an enum): read as a name
                j = token(i + 1)
            else:  # a builtin type: one letter, or D and one
                j = i + (3 if mangled[i + 1] == "D" else 2)
                out.append(mangled[i + 1:j])
            k = mangled.index("E", j)
            out.append(mangled[j:k + 1])
            return k + 1
        if c in "NIXL":  # nested name, template arguments, expression, external name: up to their E
            out.append(c)
            i += 1
            while mangled[i] != "E":
                i = token(i)
            out.append("E")
            return i + 1
        out.append(c)
        return i + 1

    i = 0
    while i < len(mangled):
        i = token(i)
    return "".join(out)


def _base36(v: int) -> str:
    digits = ""
    while True:
        v, r = divmod(v, 36)
        digits = _B36[r] + digits
        if v == 0:
            return digits


def _parse_ptxas(text: str, expression: str) -> PtxasInfo:
    """The figures of `expression`'s entry in a `-Xptxas -v` report of ptxas_report's unit.

    The unit compiles every kernel of the source file, in an order ptxas chooses; the marker
    kernel's entry names the one asked about, and only that entry's block counts."""
    starts = list(_ENTRY.finditer(text))
    mangled = entry_name(text, expression)
    block = next((text[m.start():(starts[i + 1].start() if i + 1 < len(starts) else len(text))]
                  for i, m in enumerate(starts) if m.group(1) == mangled), None)
    if block is None:
        raise RuntimeError(f"ptxas output has no entry {mangled} ({expression}); entries: "
                           f"{[m.group(1) for m in starts]}")
    regs = re.search(r"Used (\d+) registers[^\n]*", block)
    frame = re.search(r"Function properties for " + re.escape(mangled) + r"\s*\n\s*(\d+) bytes stack frame, "
                      r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
    if not (regs and frame):
        raise RuntimeError(f"could not parse ptxas output for {expression}:\n{block[:2000]}")
    smem = re.search(r"(\d+) bytes smem", regs.group(0))
    # The message names the function it is about (the entry, or a device function the entry's
    # block compiles), and the report may print it apart from that entry's block: C7515 (a
    # pipeline stage's accumulators) "in the function", C7512 (register resources, printed before
    # the entry's block) "for the function".
    serialized = (re.search(r"wgmma\S* instructions are serialized", block) or
                  re.search(r"wgmma\S* instructions are serialized[^\n]*(?:in|for) the function '"
                            + re.escape(mangled) + "'", text))
    return PtxasInfo(expression, int(regs.group(1)), int(frame.group(1)), int(frame.group(2)),
                     int(frame.group(3)), int(smem.group(1)) if smem else 0, serialized is not None,
                     "'setmaxnreg' ignored" in text)
