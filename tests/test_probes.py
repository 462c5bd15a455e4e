"""The probes under scripts/probes/ stay runnable against the lab as it is: each imports without a
GPU, answers --help, uses the lab's public names only (no edits of kernel source, no compiler
internals), and is named by a note as the way to re-measure what it measured."""

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBES = sorted((ROOT / "scripts/probes").glob("*.py"))
NOTES = "\n".join(p.read_text() for p in sorted((ROOT / "notes").glob("*.md")))  # designs and version logs


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"probe_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_there_are_probes():
    assert PROBES, "scripts/probes/ holds no probe: drop this test file with the folder"


@pytest.mark.parametrize("path", PROBES, ids=[p.stem for p in PROBES])
def test_probe_imports_without_a_gpu_and_says_what_it_measures(path):
    mod = load(path)  # a probe that measured at import time would fail here, on a machine without a GPU
    assert callable(mod.main)
    doc = (mod.__doc__ or "").strip()
    assert doc.startswith("Probe: ") and "\n" not in doc, doc


@pytest.mark.parametrize("path", PROBES, ids=[p.stem for p in PROBES])
def test_probe_help_needs_no_gpu(path):
    r = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, cwd=ROOT,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


@pytest.mark.parametrize("path", PROBES, ids=[p.stem for p in PROBES])
def test_probe_uses_public_names_only(path):
    """Kernel sources are split and renamed over time: a probe that rewrites their text, applies a
    patch or swaps the compiler's hooks measures something else, or nothing, after the next change."""
    text = path.read_text()
    assert not re.search(r"\bjit\b", text), "reaches into lab/kernels/jit.py"
    assert not re.search(r"\.patch\b|git apply|edit_kernel|probe_common", text)
    assert not re.search(r"\b(gg|grouped_gemm)\.[A-Z_]+\s*=", text), "assigns a kernel module's constant"
    assert not re.search(r"\blab\.[\w.]*\._\w", text), "imports a private name"


@pytest.mark.parametrize("path", PROBES, ids=[p.stem for p in PROBES])
def test_probe_is_named_by_a_note(path):
    assert f"scripts/probes/{path.name}" in NOTES, f"no note names {path.name}: it belongs in git history"


def _cubin(tmp_path, source: str) -> subprocess.CompletedProcess:
    cu = tmp_path / "probe.cu"
    cu.write_text(source)
    return subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-o", str(tmp_path / "probe.cubin"),
                           str(cu)], capture_output=True, text=True, check=False)


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@needs_nvcc
@pytest.mark.parametrize("case", [
    dict(n=40, chains=2, rs=True, kind="wgmma"),
    dict(n=8, chains=2, rs=False, kind="wgmma", alu=2, alu_op="lop3v", split=True),
    dict(n=8, chains=2, rs=True, kind="mma", alu=1),
    dict(n=64, chains=1, rs=False, kind="wgmma", alu=4, alu_op="stsv", split=True),
], ids=["wgmma-rs", "wgmma-ss-split", "mma-sync", "wgmma-ss-beside-stores"])
def test_wgmma_rate_probe_kernels_compile_for_sm90a(tmp_path, case):
    mod = load(ROOT / "scripts/probes/wgmma_rate_probe.py")
    r = _cubin(tmp_path, mod.source(**case))
    assert r.returncode == 0, r.stderr[-2000:]


@needs_nvcc
def test_warp_slot_probe_kernel_compiles_for_sm90a(tmp_path):
    mod = load(ROOT / "scripts/probes/warp_slot_probe.py")
    r = _cubin(tmp_path, mod.SRC)
    assert r.returncode == 0, r.stderr[-2000:]


def test_coresident_probe_narrow_tiles_fit_beside_the_small_tile():
    """The 64-row large-class tiles validate on the study's GEMMs and fit one CTA per SM beside the
    small tile: shared memory (two small CTAs beside the k_step-64 one, one beside the other)."""
    from lab.kernels import gemm_config as gc
    from lab.kernels.gemm_config import SM_SMEM, SMEM_PER_CTA_RESERVED
    from lab.problem import MoEProblem, make_routing

    mod = load(ROOT / "scripts/probes/coresident_probe.py")
    p = MoEProblem()
    counts = make_routing(8 * p.experts // p.top_k, p.experts, p.top_k, skew=1.2, seed=0).counts
    for n, k in ((2 * p.intermediate, p.hidden), (p.hidden, p.intermediate)):
        (cold, _), (hot, _) = gc.gemm_plan(n, k, counts)
        narrow = mod.narrow_tiles(hot)
        assert len(narrow) == 2
        for cfg in narrow.values():
            cfg.validate(n, k)
            assert cfg.block_rows == 64 and cfg.token_tile == hot.token_tile and cfg.image and cfg.ctas_per_sm == 1
            small = 2 if cfg.k_step == 64 else 1
            used = small * (cold.launch_smem(p.experts) + SMEM_PER_CTA_RESERVED) + cfg.launch_smem(p.experts) \
                + SMEM_PER_CTA_RESERVED
            assert used <= SM_SMEM, (cfg, used)



@needs_nvcc
def test_green_ctx_probe_resource_struct_matches_cuda_h(tmp_path):
    """green_ctx_probe passes CUdevResource by pointer through ctypes: its size and the SM fields'
    offsets must be those of the installed cuda.h."""
    import ctypes

    mod = load(ROOT / "scripts/probes/green_ctx_probe.py")
    include = Path(shutil.which("nvcc")).resolve().parent.parent / "include"
    if not (include / "cuda.h").exists():
        include = next((p for p in Path("/usr/local").glob("cuda*/include") if (p / "cuda.h").exists()), None)
    if include is None:
        pytest.skip("no cuda.h beside nvcc")
    src = tmp_path / "layout.c"
    src.write_text("#include <stddef.h>\n#include <stdio.h>\n#include <cuda.h>\n"
                   "int main(void) { printf(\"%zu %zu %zu %zu\", sizeof(CUdevResource), offsetof(CUdevResource, sm),"
                   " offsetof(CUdevSmResource, minSmPartitionSize), offsetof(CUdevSmResource, smCoscheduledAlignment));"
                   " return 0; }\n")
    exe = tmp_path / "layout"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    subprocess.run([cc, f"-I{include}", str(src), "-o", str(exe)], check=True, capture_output=True)
    got = [int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    assert got == [ctypes.sizeof(mod.DevResource), mod.DevResource.sm.offset,
                   mod.SmResource.minSmPartitionSize.offset, mod.SmResource.smCoscheduledAlignment.offset]
