"""The one stream/graph runner every layer variant runs on.

    runner = Runner()                        two streams: `stream` (main) and `side`
    layer = load_layer(runner, weights, routing, x)      buffers come from runner.buffer()
    runner.prepare(variant, layer)           the variant allocates, compiles, captures graphs
    runner.checked_run(variant, layer)       poisoned outputs, counter zeroed, run, sync, counter read
    runner.time(variant, layer, 20, 3)       -> Timing: warm-up, then CUDA events per iteration
    runner.time_samples(variant, layer, 5, 3) -> the per-iteration ms (rounds across variants)
    runner.time_stages(variant, layer, 20, 3) -> {stage: Timing} from events around each stage

A variant is an object with ``name``, ``expect`` (baseline / match / ceiling / approx),
``prepare(runner, layer)`` and ``run(runner, layer)``. ``run`` launches on ``runner.stream``
(and ``runner.side`` between ``runner.fork()`` and ``runner.join()``), wraps each stage in
``with runner.stage("w13", stream):`` and never synchronizes or allocates: every buffer is
allocated in ``prepare``, before any capture, through ``runner.buffer``.

NVTX: every run is a range ``<variant>`` and every stage a range ``<variant>/<stage>`` in the
domain ``moe-lab`` (the ``nvtx`` package; without it the ranges are no-ops).
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from .gpu import require_gpu
from .timing import Timing, time_cuda, time_cuda_samples

DOMAIN = "moe-lab"
EXPECTS = ("baseline", "match", "ceiling", "approx")


class NonFiniteError(RuntimeError):
    """A checked run met NaN or Inf in h, a or the output (the kernels' counter was not 0)."""


# ---------------------------------------------------------------------------------------------
# NVTX, imported lazily
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _nvtx():
    try:
        import nvtx

        return nvtx
    except Exception:  # not installed, or no libnvToolsExt: ranges become no-ops
        return None


@contextlib.contextmanager
def nvtx_range(label: str):
    """An NVTX push/pop range named `label` in the lab's domain (no-op without nvtx)."""
    nv = _nvtx()
    if nv is None:
        yield
        return
    nv.push_range(label, domain=DOMAIN)
    try:
        yield
    finally:
        nv.pop_range(domain=DOMAIN)


def check_variant(variant) -> None:
    """A variant declares a name and what its output is expected to be."""
    for attr in ("name", "expect", "prepare", "run"):
        if not hasattr(variant, attr):
            raise TypeError(f"variant {variant!r} lacks `{attr}`")
    if variant.expect not in EXPECTS:
        raise ValueError(f"variant {variant.name}: expect must be one of {EXPECTS}, got {variant.expect!r}")


# ---------------------------------------------------------------------------------------------
# the runner
# ---------------------------------------------------------------------------------------------


class Runner:
    """Streams, buffers, graphs, NVTX and event timing for layer variants."""

    def __init__(self):
        cp = require_gpu("Runner")
        self.cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.side = cp.cuda.Stream(non_blocking=True)
        self._buffers: dict[str, object] = {}
        self._capturing = False
        self._variant = "-"
        self._stage_log: list | None = None  # (stage, start event, stop event) while timing stages
        self._fork_event = cp.cuda.Event(disable_timing=True)
        self._join_event = cp.cuda.Event(disable_timing=True)
        self.counter = self.buffer("nonfinite", (1,), np.uint32)  # (1,) uint32: every kernel adds to it

    # ---------------------------------------------------------------- buffers

    def buffer(self, name: str, shape, dtype):
        """The device array `name`, allocated on first request; later requests must agree."""
        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        have = self._buffers.get(name)
        if have is not None:
            if have.shape != shape or have.dtype != dtype:
                raise ValueError(f"buffer {name!r} exists as {have.shape} {have.dtype}, requested {shape} {dtype}")
            return have
        if self._capturing:
            raise RuntimeError(f"buffer {name!r}: allocate buffers in prepare(), not during capture")
        arr = self.cp.empty(shape, dtype)
        self._buffers[name] = arr
        return arr

    def drop_buffers(self) -> None:
        """Forget every buffer but the non-finite counter (their memory returns to the pool once no
        variant holds them): for a pass that needs the device memory the lab's variants took."""
        self._buffers = {"nonfinite": self.counter}

    @property
    def buffer_bytes(self) -> int:
        return sum(a.nbytes for a in self._buffers.values())

    # ---------------------------------------------------------------- ranges and stages

    @contextlib.contextmanager
    def stage(self, stage: str, stream=None):
        """NVTX range `<variant>/<stage>`; while timing stages, events around it on `stream`."""
        stream = stream if stream is not None else self.stream
        with nvtx_range(f"{self._variant}/{stage}"):
            if self._stage_log is None or self._capturing:
                yield
                return
            start, stop = self.cp.cuda.Event(), self.cp.cuda.Event()
            start.record(stream)
            yield
            stop.record(stream)
            self._stage_log.append((stage, start, stop))

    # ---------------------------------------------------------------- streams

    def fork(self) -> None:
        """`side` waits for everything enqueued so far on `stream`."""
        self._fork_event.record(self.stream)
        self.side.wait_event(self._fork_event)

    def join(self) -> None:
        """`stream` waits for everything enqueued so far on `side`."""
        self._join_event.record(self.side)
        self.stream.wait_event(self._join_event)

    def event(self):
        """A fresh event without timing (for dependencies a variant records in run())."""
        return self.cp.cuda.Event(disable_timing=True)

    # ---------------------------------------------------------------- graphs

    def capture(self, fn):
        """Capture what `fn()` enqueues on `stream` (and streams forked from it) as a CUDA graph."""
        if self._capturing:
            raise RuntimeError("capture: already capturing")
        self.stream.synchronize()
        self._capturing = True
        try:
            with self.stream:
                self.stream.begin_capture()
                try:
                    fn()
                finally:
                    graph = self.stream.end_capture()
        finally:
            self._capturing = False
        return graph

    def replay(self, graph) -> None:
        graph.launch(self.stream)

    @property
    def capturing(self) -> bool:
        return self._capturing

    @property
    def timing_stages(self) -> bool:
        """True inside time_stages / stage_spans: a graph variant may launch directly then, so
        that its stages get their own events."""
        return self._stage_log is not None and not self._capturing

    # ---------------------------------------------------------------- running

    @contextlib.contextmanager
    def _as(self, variant):
        outer, self._variant = self._variant, variant.name
        try:
            with nvtx_range(variant.name), self.stream:
                yield
        finally:
            self._variant = outer

    def prepare(self, variant, layer) -> None:
        """Let the variant allocate, compile and capture; waits until that work is done."""
        check_variant(variant)
        with self._as(variant), nvtx_range(f"{variant.name}/prepare"):
            variant.prepare(self, layer)
        self.synchronize()

    def run(self, variant, layer) -> None:
        """Enqueue one run of the variant (no synchronization)."""
        with self._as(variant):
            variant.run(self, layer)

    def synchronize(self) -> None:
        self.side.synchronize()
        self.stream.synchronize()

    def read_counter(self) -> int:
        """Wait for the streams, return the non-finite count."""
        self.synchronize()
        return int(self.counter.get(stream=self.stream)[0])

    def checked_run(self, variant, layer) -> None:
        """One run on poisoned outputs with the counter zeroed; raises NonFiniteError if any
        kernel met NaN or Inf."""
        with self.stream:
            layer.poison(self.stream)
            self.counter.fill(0)
        self.run(variant, layer)
        bad = self.read_counter()
        if bad:
            raise NonFiniteError(f"{variant.name}: {bad} non-finite values in h, a or the output")

    def time(self, variant, layer, iterations: int = 20, warmup: int = 3) -> Timing:
        """Median / min / max ms of one run, CUDA events on `stream` around each iteration
        (multi-stream variants join back to `stream` inside run)."""
        return time_cuda(lambda: self.run(variant, layer), iterations=iterations, warmup=warmup,
                         stream=self.stream)

    def time_samples(self, variant, layer, iterations: int = 20, warmup: int = 3):
        """The per-iteration milliseconds behind `time` (for timing variants in interleaved
        rounds, so that a drift of the machine's speed falls on all of them alike)."""
        return time_cuda_samples(lambda: self.run(variant, layer), iterations=iterations, warmup=warmup,
                                 stream=self.stream)

    def stage_spans(self, variant, layer) -> list[dict]:
        """One run with events around every stage: [{stage, start_ms, stop_ms}] in launch order,
        times relative to the earliest start (for timelines: gaps between chunks, overlap)."""
        self._stage_log = []
        try:
            self.run(variant, layer)
        finally:
            log, self._stage_log = self._stage_log, None
        self.synchronize()
        if not log:
            return []
        t0 = min((self.cp.cuda.get_elapsed_time(log[0][1], start) for _, start, _ in log), default=0.0)
        return [{"stage": stage, "start_ms": self.cp.cuda.get_elapsed_time(log[0][1], start) - t0,
                 "stop_ms": self.cp.cuda.get_elapsed_time(log[0][1], stop) - t0} for stage, start, stop in log]

    def time_stages(self, variant, layer, iterations: int = 20, warmup: int = 3) -> dict[str, Timing]:
        """Per stage: median / min / max over iterations of the summed event spans of that
        stage (one span per stage for single-stream variants)."""
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        for _ in range(warmup):
            self.run(variant, layer)
        per_iter: list[list] = []
        for _ in range(iterations):
            self._stage_log = []
            try:
                self.run(variant, layer)
            finally:
                per_iter.append(self._stage_log)
                self._stage_log = None
        self.synchronize()
        names: list[str] = []
        sums = []
        for log in per_iter:
            acc: dict[str, float] = {}
            for stage, start, stop in log:
                if stage not in names:
                    names.append(stage)
                acc[stage] = acc.get(stage, 0.0) + self.cp.cuda.get_elapsed_time(start, stop)
            sums.append(acc)
        out = {}
        for stage in names:
            ms = np.array([acc.get(stage, 0.0) for acc in sums])
            out[stage] = Timing(float(np.median(ms)), float(ms.min()), float(ms.max()), iterations)
        return out
