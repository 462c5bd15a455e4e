"""The one place that asks whether a CUDA GPU is usable.

Nothing here imports CuPy at module import time, so the package loads on machines without
a GPU, without a driver, or without CuPy.
"""

from __future__ import annotations

import functools


def _probe() -> tuple[object | None, str]:
    """Return (cupy module, "") when a device is usable, else (None, reason)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA library underneath
        return None, f"import cupy failed: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, driver too old, no device node
        return None, f"{type(exc).__name__}: {exc}"
    if count < 1:
        return None, "0 devices"
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
    """Return the cupy module, or raise RuntimeError naming `what` and why no GPU is usable."""
    cupy, reason = _cached_probe()
    if cupy is None:
        raise RuntimeError(f"{what} needs a CUDA GPU (CuPy found none: {reason})")
    return cupy
