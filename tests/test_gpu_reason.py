"""lab.gpu: the words for why there is no GPU, and the scripts' one-line exit without one."""

from __future__ import annotations

import ctypes

import pytest

from lab import gpu

CUPY = "CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"


class FakeDriver:
    """Stands in for libcuda: cuDriverGetVersion writes `version` (CUDA 12.4 = 12040)."""

    def __init__(self, version: int):
        self.version = version

    def cuDriverGetVersion(self, ptr):
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_int))[0] = self.version
        return 0


def test_no_driver_library_says_no_driver_and_keeps_cupys_text():
    text = gpu._diagnose(CUPY, 35, 13000, driver=None)
    assert text.startswith("no NVIDIA driver found") and text.endswith(CUPY)
    assert "insufficient" not in text.split("; CuPy:")[0]


def test_driver_without_devices_says_no_device():
    text = gpu._diagnose("CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device is detected", 100, 13000,
                         driver=FakeDriver(13000))
    assert text.startswith("no CUDA device found") and "cudaErrorNoDevice" in text


def test_old_driver_says_both_versions():
    text = gpu._diagnose(CUPY, 35, 13020, driver=FakeDriver(12040))
    assert "the NVIDIA driver supports CUDA 12.4, CuPy's runtime needs 13.2" in text and text.endswith(CUPY)


def test_other_failures_pass_cupys_text_through():
    assert gpu._diagnose("CUDARuntimeError: cudaErrorUnknown", 999, 13000, driver=FakeDriver(13000)) == \
        "CUDARuntimeError: cudaErrorUnknown"


def test_require_gpu_raises_a_runtime_error_subclass(monkeypatch):
    monkeypatch.setattr(gpu, "_cached_probe", lambda: (None, "no NVIDIA driver found (x); CuPy: y"))
    with pytest.raises(gpu.GPUUnavailable, match=r"^the w13 kernel needs a CUDA GPU \(CuPy found none: no NVIDIA"):
        gpu.require_gpu("the w13 kernel")
    assert issubclass(gpu.GPUUnavailable, RuntimeError)


def test_run_script_turns_a_missing_gpu_into_one_line_and_status_1(monkeypatch, capsys):
    monkeypatch.setattr(gpu, "_cached_probe", lambda: (None, "no CUDA device found (0 devices)"))

    def main(argv):
        gpu.require_gpu("bench_gemm")
        return 0

    assert gpu.run_script(main, "bench_gemm", []) == gpu.NO_GPU_STATUS == 1
    err = capsys.readouterr().err
    assert err == "bench_gemm needs a CUDA GPU (CuPy found none: no CUDA device found (0 devices))\n"

    def main_other(argv):
        gpu.require_gpu("upload_weights")

    assert gpu.run_script(main_other, "probe", []) == 1
    assert capsys.readouterr().err.startswith("probe: upload_weights needs a CUDA GPU")


def test_run_script_lets_other_errors_through():
    def main(argv):
        raise ValueError("a bug, not a missing GPU")

    with pytest.raises(ValueError, match="a bug"):
        gpu.run_script(main, "x", [])
    assert gpu.run_script(lambda argv: 3, "x", []) == 3
