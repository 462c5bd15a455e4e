"""The one place that asks whether a CUDA GPU is usable.

Nothing here imports CuPy at module import time, so the package loads on machines without
a GPU, without a driver, or without CuPy.

    gpu_available()            True / False, never raises
    require_gpu(what)          the cupy module, or GPUUnavailable (a RuntimeError) saying why
    run_script(main, name)     what every script's __main__ calls: a missing GPU ends the script
                               with one line and status 1 instead of a traceback
"""

from __future__ import annotations

import ctypes
import functools
import sys

NO_GPU_STATUS = 1  # the exit status of a script that needs a GPU and found none

# The runtime's own codes (driver_types.h): it reports a missing driver as "insufficient",
# which on a machine with no NVIDIA driver at all misleads; _diagnose tells the cases apart.
_CUDA_ERROR_INSUFFICIENT_DRIVER = 35
_CUDA_ERROR_NO_DEVICE = 100
_CU_ERROR_NO_DEVICE = 100  # the driver API's code for the same condition (cuda.h)
_DRIVER_LIBS = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")


class GPUUnavailable(RuntimeError):
    """No usable CUDA GPU. The message names what needed one and why there is none."""


def _load_driver():
    """The NVIDIA driver library (ctypes handle), or None when none of its names loads."""
    for name in _DRIVER_LIBS:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _diagnose(cupy_detail: str, status: int | None, runtime_version: int | None, driver=None) -> str:
    """Why CuPy sees no device, in words, with CuPy's own text kept as the detail.

    ``driver``: the driver library's handle (None: not loadable); passed in so the words can
    be checked on any machine.
    """
    if driver is None:
        return f"no NVIDIA driver found ({_DRIVER_LIBS[0]} does not load); CuPy: {cupy_detail}"
    if status == _CUDA_ERROR_NO_DEVICE:
        return f"no CUDA device found (the NVIDIA driver loads but reports none); CuPy: {cupy_detail}"
    if status == _CUDA_ERROR_INSUFFICIENT_DRIVER:
        version = ctypes.c_int(0)
        try:
            ok = driver.cuDriverGetVersion(ctypes.byref(version)) == 0
        except Exception:  # a driver library without the symbol: report what CuPy said
            ok = False
        if ok and runtime_version:
            return (f"the NVIDIA driver supports CUDA {_version(version.value)}, CuPy's runtime needs "
                    f"{_version(runtime_version)}; CuPy: {cupy_detail}")
    return cupy_detail


def _probe() -> tuple[object | None, str]:
    """Return (cupy module, "") when a device is usable, else (None, reason)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA library underneath
        return None, f"import cupy failed: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, driver too old, no device node
        try:
            runtime_version = cupy.cuda.runtime.runtimeGetVersion()
        except Exception:
            runtime_version = None
        return None, _diagnose(f"{type(exc).__name__}: {exc}", getattr(exc, "status", None), runtime_version,
                               _load_driver())
    if count < 1:
        return None, "no CUDA device found (0 devices)"
    return cupy, ""


@functools.lru_cache(maxsize=1)
def _cached_probe() -> tuple[object | None, str]:
    return _probe()


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device. Never raises."""
    try:
        return _cached_probe()[0] is not None
    except Exception:
        return False


def require_gpu(what: str):
    """Return the cupy module, or raise GPUUnavailable naming `what` and why no GPU is usable."""
    cupy, reason = _cached_probe()
    if cupy is None:
        raise GPUUnavailable(f"{what} needs a CUDA GPU (CuPy found none: {reason})")
    return cupy


def run_script(main, name: str, argv=None) -> int:
    """Run a script's ``main(argv)``; a missing GPU prints one line on stderr (the reason, led by
    `name`) and returns NO_GPU_STATUS. Every other exception propagates: only this condition is
    expected."""
    try:
        return main(argv)
    except GPUUnavailable as exc:
        msg = str(exc)
        print(msg if msg.startswith(name) else f"{name}: {msg}", file=sys.stderr, flush=True)
        return NO_GPU_STATUS
