"""CUDA-event timing shared by the runner and the benchmarks: warm up, then per-iteration
events on one stream, reported as median / min / max milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, asdict

import numpy as np


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    iterations: int

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, ms) -> "Timing":
        """Median / min / max of per-iteration milliseconds."""
        ms = np.asarray(ms, dtype=np.float64)
        if ms.size == 0:
            raise ValueError("Timing.of: no samples")
        return cls(float(np.median(ms)), float(ms.min()), float(ms.max()), int(ms.size))


def time_cuda(fn, iterations: int = 20, warmup: int = 3, stream=None) -> Timing:
    """Time `fn()` (which launches on `stream`) with a pair of events per iteration."""
    return Timing.of(time_cuda_samples(fn, iterations, warmup, stream))


def time_cuda_samples(fn, iterations: int = 20, warmup: int = 3, stream=None) -> np.ndarray:
    """The milliseconds of each of `iterations` runs of `fn()` after `warmup` untimed ones."""
    import cupy as cp

    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    stream = stream if stream is not None else cp.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    stream.synchronize()
    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(iterations)]
    for start, stop in events:
        start.record(stream)
        fn()
        stop.record(stream)
    stream.synchronize()
    return np.array([cp.cuda.get_elapsed_time(a, b) for a, b in events])


def time_sustained(fn, run_ms: float, sustain_ms: float, iterations: int = 20, stream=None) -> Timing:
    """Time `fn()` after about `sustain_ms` of back-to-back runs (each about `run_ms`): the state
    a GPU reaches under held load, where the power cap may have lowered its clocks."""
    if not (run_ms > 0 and sustain_ms >= 0):
        raise ValueError(f"run_ms must be > 0 and sustain_ms >= 0, got {run_ms}, {sustain_ms}")
    warm = max(1, int(np.ceil(sustain_ms / run_ms)))
    return time_cuda(fn, iterations=iterations, warmup=warm, stream=stream)
