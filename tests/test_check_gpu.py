"""scripts/check_gpu.sh and its verdict (scripts/check_gpu_verdict.py) without a GPU: the script
refuses to run where no GPU is visible, answers --help and bad arguments without running, and
(with a stand-in nvidia-smi, Python and compute-sanitizer) fails a run whose suite or sanitizer
sections ran nothing, failed or reported sanitizer errors; the verdict reads each section."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.gpu import gpu_available

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_gpu.sh"
TOOLS = ("memcheck", "racecheck", "synccheck")
NAMES = ("grouped_gemm", "fused", "w4a16", "large_tiles", "image", "w4a8")
SECTIONS = [f"{t} {n}" for t in TOOLS for n in NAMES] + ["memcheck swiglu_quant"]
no_gpu = pytest.mark.skipif(gpu_available(), reason="checks the path taken without a GPU")


@pytest.fixture(scope="module")
def verdict():
    spec = importlib.util.spec_from_file_location("check_gpu_verdict", ROOT / "scripts" / "check_gpu_verdict.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sh(args, cwd, path_prefix: Path | None = None, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **env}
    if path_prefix is not None:
        full["PATH"] = f"{path_prefix}{os.pathsep}{full['PATH']}"
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=600)


def stderr_lines(res) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if ln.strip()]


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


# ---------------------------------------------------------------------------------------------
# arguments and the missing GPU: nothing runs, nothing is written
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_usage_and_creates_nothing(flag, tmp_path):
    res = sh([flag], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Usage: bash scripts/check_gpu.sh [OUTDIR]") and res.stderr == ""
    assert list(tmp_path.iterdir()) == []  # no folder named after the flag


@pytest.mark.parametrize("args, word", [(["-x"], "unknown option '-x'"), (["--out", "d"], "unknown option '--out'"),
                                        (["a", "b"], "at most one argument")])
def test_bad_arguments_exit_2_in_one_line(args, word, tmp_path):
    res = sh(args, tmp_path)
    assert res.returncode == 2
    lines = stderr_lines(res)
    assert len(lines) == 1 and word in lines[0] and lines[0].startswith("check_gpu.sh: "), res.stderr
    assert list(tmp_path.iterdir()) == []


@no_gpu
def test_without_a_gpu_fails_in_one_line_before_running_anything(tmp_path):
    res = sh([str(tmp_path / "out")], ROOT)
    assert res.returncode == 1
    lines = stderr_lines(res)
    assert len(lines) == 1 and lines[0].startswith("check_gpu.sh: no GPU visible"), res.stderr
    assert res.stdout == "" and not (tmp_path / "out").exists()


@no_gpu
def test_a_driver_tool_that_answers_does_not_stand_for_a_gpu(tmp_path):
    """nvidia-smi present, CuPy with no device: the CuPy probe refuses, naming its reason."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'NVIDIA H200'\n")
    res = sh([str(tmp_path / "out")], ROOT, path_prefix=bin_dir)
    assert res.returncode == 1
    lines = stderr_lines(res)
    assert len(lines) == 1 and lines[0].startswith("check_gpu.sh: no GPU visible to CuPy: "), res.stderr
    assert "needs a CUDA GPU" in lines[0]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# a whole run with stand-ins: the verdict decides the exit status
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def stand_ins(tmp_path):
    """A bin folder with nvidia-smi, compute-sanitizer and a Python whose `-m pytest` prints
    $FAKE_PYTEST (exit status $FAKE_STATUS) and whose other uses are the real interpreter. The
    sanitizer runs its command and adds its summary with $FAKE_ERRORS errors, or, with
    FAKE_BROKEN set, prints nothing, as one that cannot start."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'NVIDIA H200'\n")
    executable(bin_dir / "compute-sanitizer",
               '#!/bin/bash\n[ -n "${FAKE_BROKEN-}" ] && exit 1\nshift 2\n"$@"\nrc=$?\n'
               'echo "========= ERROR SUMMARY: ${FAKE_ERRORS:-0} errors"\nexit $rc\n')
    python = executable(bin_dir / "fake-python",
                        '#!/bin/bash\nif [ "$1" = "-" ]; then cat >/dev/null; exit 0; fi\n'
                        'if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then echo "$FAKE_PYTEST"; exit "${FAKE_STATUS:-0}"; fi\n'
                        f'exec "{sys.executable}" "$@"\n')
    return bin_dir, python


def fake_run(stand_ins, out: Path, **env) -> subprocess.CompletedProcess:
    bin_dir, python = stand_ins
    return sh([str(out)], ROOT, path_prefix=bin_dir, PYTHON=str(python), **env)


def test_a_clean_run_exits_0_and_keeps_its_files(stand_ins, tmp_path):
    res = fake_run(stand_ins, tmp_path / "out", FAKE_PYTEST="12 passed, 3 deselected in 1.00s")
    assert res.returncode == 0, res.stderr
    assert "check_gpu: clean" in res.stdout
    text = (tmp_path / "out" / "sanitizer.txt").read_text()
    assert [ln[3:] for ln in text.splitlines() if ln.startswith("== ")] == SECTIONS
    assert (tmp_path / "out" / "pytest_gpu.log").read_text().strip() == "12 passed, 3 deselected in 1.00s"


@pytest.mark.parametrize("env, word", [
    ({"FAKE_PYTEST": "12 skipped, 3 deselected in 0.50s"}, "ran no test"),
    ({"FAKE_PYTEST": "no tests ran in 0.01s", "FAKE_STATUS": "5"}, "ran no test"),
    ({"FAKE_PYTEST": "1 failed, 11 passed in 1.00s", "FAKE_STATUS": "1"}, "1 failed"),
    ({"FAKE_PYTEST": "12 passed in 1.00s", "FAKE_ERRORS": "3"}, "compute-sanitizer reports 3 error(s)"),
    ({"FAKE_PYTEST": "12 passed in 1.00s", "FAKE_BROKEN": "1"}, "empty: no pytest summary line"),
])
def test_a_run_that_checked_nothing_or_failed_exits_1_naming_each_section(stand_ins, tmp_path, env, word):
    res = fake_run(stand_ins, tmp_path / "out", **env)
    assert res.returncode != 0
    failed = [ln for ln in res.stderr.splitlines() if ln.startswith("check_gpu: FAILED: ")]
    for name in SECTIONS:
        assert any(f"sanitizer section '{name}'" in ln and word in ln for ln in failed), (name, res.stderr)
    assert (tmp_path / "out" / "sanitizer.txt").is_file() and (tmp_path / "out" / "pytest_gpu.log").is_file()


# ---------------------------------------------------------------------------------------------
# the verdict on sanitizer.txt and pytest_gpu.log as written
# ---------------------------------------------------------------------------------------------

# a clean run's files as check_gpu.sh wrote them on the H200 (009879f, three of its sections)
CLEAN_SANITIZER = """compute-sanitizer on NVIDIA H200, kernels of 7005778:
  grouped_gemm: tests/test_grouped_gemm.py -k 'one_expert or subnormal or two_problems'
  swiglu_quant: tests/test_swiglu_quant.py
== memcheck grouped_gemm
3 passed, 110 deselected in 1.47s
========= ERROR SUMMARY: 0 errors
== racecheck grouped_gemm
3 passed, 110 deselected in 2.98s
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
== memcheck swiglu_quant
44 passed, 1 warning in 6.83s
========= ERROR SUMMARY: 0 errors
GPU suite in the same call: 101 passed, 367 deselected, 1 warning in 60.67s (0:01:00)
"""
CLEAN_SUITE = """-- Docs: https://docs.pytest.org/en/stable/how-to/capture-warnings.html
101 passed, 367 deselected, 1 warning in 60.67s (0:01:00)
"""


def write(folder: Path, sanitizer: str = CLEAN_SANITIZER, suite: str = CLEAN_SUITE) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "sanitizer.txt").write_text(sanitizer)
    (folder / "pytest_gpu.log").write_text(suite)
    return folder


def test_the_recorded_clean_run_passes(verdict, tmp_path, capsys):
    assert verdict.verdict(write(tmp_path)) == []
    assert verdict.main([str(tmp_path)]) == 0
    assert "3 sanitizer sections" in capsys.readouterr().out


@pytest.mark.parametrize("old, new, word", [
    # the section of a sanitizer that never started: its header alone
    ("3 passed, 110 deselected in 2.98s\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n",
     "", "'racecheck grouped_gemm': empty: no pytest summary line"),
    # the last section's pytest line lost: the suite's line after it is not taken for it
    ("44 passed, 1 warning in 6.83s\n", "", "'memcheck swiglu_quant': no pytest summary line"),
    ("3 passed, 110 deselected in 1.47s", "3 skipped, 110 deselected in 0.47s",
     "'memcheck grouped_gemm': ran no test (3 skipped, 110 deselected)"),
    ("3 passed, 110 deselected in 1.47s", "113 deselected in 0.40s", "'memcheck grouped_gemm': ran no test"),
    ("44 passed, 1 warning in 6.83s", "1 failed, 43 passed, 1 warning in 6.83s", "'memcheck swiglu_quant': 1 failed"),
    ("44 passed, 1 warning in 6.83s", "43 passed, 2 errors in 6.83s", "'memcheck swiglu_quant': 2 error"),
    ("ERROR SUMMARY: 0 errors\n== racecheck", "ERROR SUMMARY: 5 errors\n== racecheck",
     "'memcheck grouped_gemm': compute-sanitizer reports 5 error(s)"),
    ("(0 errors, 0 warnings)", "(1 error, 0 warnings)", "'racecheck grouped_gemm': compute-sanitizer reports 1 error(s)"),
    ("========= ERROR SUMMARY: 0 errors\n== racecheck", "== racecheck",
     "'memcheck grouped_gemm': no compute-sanitizer SUMMARY line"),
])
def test_each_bad_section_is_named(verdict, tmp_path, capsys, old, new, word):
    assert old in CLEAN_SANITIZER
    folder = write(tmp_path, sanitizer=CLEAN_SANITIZER.replace(old, new, 1))
    assert verdict.main([str(folder)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("check_gpu: FAILED: sanitizer section ") and word in err[0], err


@pytest.mark.parametrize("suite, word", [
    ("", "GPU suite (pytest_gpu.log): no pytest summary line"),
    ("468 skipped in 9.10s\n", "GPU suite (pytest_gpu.log): ran no test (468 skipped)"),
    ("2 failed, 99 passed, 367 deselected in 60.67s\n", "GPU suite (pytest_gpu.log): 2 failed"),
])
def test_a_gpu_suite_that_ran_nothing_or_failed_is_named(verdict, tmp_path, capsys, suite, word):
    assert verdict.main([str(write(tmp_path, suite=suite))]) == 1
    err = capsys.readouterr().err
    assert word in err, err


def test_missing_files_and_no_sections_fail(verdict, tmp_path):
    assert verdict.verdict(tmp_path) == [f"{tmp_path / 'pytest_gpu.log'}: missing", f"{tmp_path / 'sanitizer.txt'}: missing"]
    assert verdict.verdict(write(tmp_path, sanitizer="compute-sanitizer on ?\n")) == [
        f"{tmp_path / 'sanitizer.txt'}: no '== TOOL NAME' section"]
