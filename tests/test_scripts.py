"""Every script under scripts/ (and scripts/probes/) on a machine without a GPU: --help exits 0,
and a run with default arguments either works (CPU scripts) or ends with status != 0 and one
line saying what is missing, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lab import gpu

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(ROOT.glob("scripts/*.py")) + sorted(ROOT.glob("scripts/probes/*.py"))
# CPU scripts and the arguments of their run here: a tmp path and a small size where the
# defaults would write gigabytes, None where the script is only asked for --help (report.py
# rewrites the committed findings page by default; its own tests run it).
CPU_RUNS = {
    "make_checkpoint": lambda tmp: [str(tmp / "c.safetensors"), "--experts", "2", "--hidden", "64",
                                    "--intermediate", "64"],
    "scale_fold_probe": lambda tmp: [],
    "w4a8_error_study": lambda tmp: ["--hidden", "128", "--intermediate", "64", "--tokens", "32",
                                     "--json", str(tmp / "w4a8.json")],
    "report": None,
    "sass_mix": None,  # needs nvcc and nvdisasm: run by tests/test_sass.py
    "check_gpu_verdict": None,  # reads a check_gpu.sh run: tests/test_check_gpu.py
    "same_sass": None,  # needs nvcc and two trees: run by tests/test_sass.py
}
# scripts that print something useful before saying they need a GPU (run_layer: the bytes table)
PRINTS_FIRST = {"run_layer"}


def ids(paths):
    return [str(p.relative_to(ROOT / "scripts")) for p in paths]


def run(script: Path, args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_the_scripts_are_found():
    names = {p.stem for p in SCRIPTS}
    assert {"run_layer", "bench_gemm", "make_checkpoint", "scale_fold_probe"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=ids(SCRIPTS))
def test_help_exits_0(script, tmp_path):
    res = run(script, ["--help"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout and "Traceback" not in res.stderr


GPU_SCRIPTS = [p for p in SCRIPTS if p.stem not in CPU_RUNS]


@pytest.mark.skipif(gpu.gpu_available(), reason="checks the path taken without a GPU")
@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=ids(GPU_SCRIPTS))
def test_gpu_script_without_a_gpu_says_so_in_one_line(script, tmp_path):
    res = run(script, [], tmp_path)
    reason = gpu._cached_probe()[1]  # what lab.gpu found: no driver, no device, an old driver
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    said = [ln for ln in lines if "needs a CUDA GPU" in ln]
    assert len(said) == 1, res.stderr[-2000:]
    assert reason in said[0]
    if script.stem not in PRINTS_FIRST:
        assert lines == said, res.stderr[-2000:]


@pytest.mark.parametrize("name", [n for n, f in CPU_RUNS.items() if f is not None])
def test_cpu_script_runs_with_defaults(name, tmp_path):
    res = run(ROOT / "scripts" / f"{name}.py", CPU_RUNS[name](tmp_path), tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_no_gpu_reason_names_the_missing_driver_or_device():
    if gpu.gpu_available():
        pytest.skip("a GPU is present")
    reason = gpu._cached_probe()[1]
    assert any(w in reason for w in ("no NVIDIA driver found", "no CUDA device found", "the NVIDIA driver supports",
                                     "import cupy failed")), reason


@pytest.mark.parametrize("value", ["16,16", "32,16", "0", "a", "16,"])
def test_bench_gemm_split_names_a_bad_bound(value, tmp_path):
    res = run(ROOT / "scripts" / "bench_gemm.py", ["--split", value], tmp_path)
    assert res.returncode == 2 and "--split" in res.stderr and value in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("script, argv, word", [
    ("scale_fold_probe", ["--hidden", "100"], "--hidden must be a multiple of 64, got 100"),
    ("scale_fold_probe", ["--experts", "0"], "--experts must be a positive int, got 0"),
    ("make_checkpoint", ["c.safetensors", "--ratio", "nan"], "--ratio must be a finite positive number, got nan"),
    ("make_checkpoint", ["c.safetensors", "--experts", "4", "--top-k", "8"], "--top-k=8 must be <= --experts=4"),
])
def test_shape_errors_name_the_flag(script, argv, word, tmp_path):
    res = run(ROOT / "scripts" / f"{script}.py", argv, tmp_path)
    assert res.returncode == 2 and res.stderr.splitlines()[-1].endswith(f"error: {word}"), res.stderr[-2000:]
