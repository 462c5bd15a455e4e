"""One place that compiles, caches and inspects the lab's CUDA C kernels.

Kernel sources are `.cu` files beside this module, read as text. At run time CuPy compiles them
with NVRTC for sm_90a (wgmma, setmaxnreg and the e4m3 conversions need the `a` target); template
instantiations are named by `name_expressions`, never built by string formatting. Without a GPU,
`ptxas_report` compiles the same instantiations with `nvcc -cubin -Xptxas -v` so CPU tests can
check registers, stack and spills.
"""

from __future__ import annotations

import functools
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


_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.M)


def source(name: str, _seen: frozenset = frozenset()) -> str:
    """The text of `lab/kernels/<name>`, with `#include "x.cuh"` of files beside it inlined (once
    each): NVRTC gets one string, and CuPy's cache key (the string) changes when a header does."""
    if name in _seen:
        return ""
    seen = _seen | {name}
    text = (KERNEL_DIR / name).read_text()
    return _INCLUDE.sub(lambda m: source(m.group(1), seen).replace("#pragma once", ""), text)


@functools.lru_cache(maxsize=None)
def _module(name: str, name_expressions: tuple[str, ...]):
    import cupy as cp

    return cp.RawModule(code=source(name), options=ARCH_OPTIONS, name_expressions=name_expressions)


def kernel(name: str, expression: str, smem_bytes: int = 0):
    """The compiled kernel `expression` (a template instantiation) from source file `name`."""
    require_gpu(f"compiling {expression}")
    fn = _module(name, (expression,)).get_function(expression)
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
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("ptxas_report needs nvcc (CUDA toolkit) on PATH or in CUDA_PATH")
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "inst.cu"
        # Taking the kernel's address instantiates it.
        unit.write_text(f'#include "{KERNEL_DIR / name}"\nvoid* lab_keep = (void*)&{expression};\n')
        proc = subprocess.run(
            [nvcc, "-cubin", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
             "-o", str(Path(tmp) / "inst.cubin"), str(unit)],
            capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {expression}:\n{proc.stderr[-4000:]}")
    return _parse_ptxas(proc.stderr, expression)


def _parse_ptxas(text: str, expression: str) -> PtxasInfo:
    regs = re.search(r"Used (\d+) registers", text)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    smem = re.search(r"(\d+) bytes smem", text)
    if not (regs and frame):
        raise RuntimeError(f"could not parse ptxas output for {expression}:\n{text[:2000]}")
    return PtxasInfo(expression, int(regs.group(1)), int(frame.group(1)), int(frame.group(2)),
                     int(frame.group(3)), int(smem.group(1)) if smem else 0,
                     bool(re.search(r"wgmma\S* instructions are serialized", text)))
