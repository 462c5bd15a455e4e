"""The runner: NVTX ranges, the variant contract, buffers, capture, streams and timing."""

from __future__ import annotations

import numpy as np
import pytest

from lab import runner as runner_mod
from lab.gpu import gpu_available
from lab.runner import EXPECTS, NonFiniteError, Runner, check_variant, nvtx_range

# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------


def _recording_nvtx(monkeypatch):
    """The installed nvtx package, its push_range / pop_range recorded (and still called)."""
    nvtx = pytest.importorskip("nvtx")
    calls = []
    push, pop = nvtx.push_range, nvtx.pop_range

    def record_push(label, domain=None, **kw):
        calls.append(("push", label, domain))
        return push(label, domain=domain, **kw)

    def record_pop(domain=None, **kw):
        calls.append(("pop", domain))
        return pop(domain=domain, **kw)

    monkeypatch.setattr(nvtx, "push_range", record_push)
    monkeypatch.setattr(nvtx, "pop_range", record_pop)
    return nvtx, calls


def test_nvtx_ranges_nest_with_the_nvtx_package(monkeypatch):
    nvtx, calls = _recording_nvtx(monkeypatch)
    assert runner_mod._nvtx() is nvtx
    with nvtx_range("separate"):
        with nvtx_range("separate/w13"):
            calls.append("body")
    d = runner_mod.DOMAIN
    assert calls == [("push", "separate", d), ("push", "separate/w13", d), "body", ("pop", d), ("pop", d)]


def test_nvtx_ranges_are_no_ops_without_the_package(monkeypatch):
    _nvtx, calls = _recording_nvtx(monkeypatch)
    monkeypatch.setattr(runner_mod, "_nvtx", lambda: None)
    with nvtx_range("x/y"):
        calls.append("body")
    with pytest.raises(KeyError):  # and exceptions pass through untouched
        with nvtx_range("x/z"):
            raise KeyError
    assert calls == ["body"]


def test_nvtx_range_pops_on_exceptions():
    class Fake:
        def __init__(self):
            self.depth = 0

        def push_range(self, label, domain=None):
            assert domain == runner_mod.DOMAIN
            self.depth += 1

        def pop_range(self, domain=None):
            self.depth -= 1

    fake = Fake()
    mp = pytest.MonkeyPatch()
    mp.setattr(runner_mod, "_nvtx", lambda: fake)
    try:
        with pytest.raises(KeyError):
            with nvtx_range("v/s"):
                raise KeyError
        assert fake.depth == 0
    finally:
        mp.undo()


class Toy:
    """A variant by the contract, with a settable expect."""

    def __init__(self, name="toy", expect="match"):
        self.name, self.expect = name, expect

    def prepare(self, runner, layer):
        pass

    def run(self, runner, layer):
        pass


def test_check_variant_accepts_every_declared_expectation():
    for e in EXPECTS:
        check_variant(Toy(expect=e))


def test_check_variant_rejects_bad_declarations():
    with pytest.raises(ValueError, match="expect"):
        check_variant(Toy(expect="close enough"))
    t = Toy()
    del t.name  # instance attribute
    with pytest.raises(TypeError, match="name"):
        check_variant(t)


@pytest.mark.skipif(gpu_available(), reason="checks the message shown without a GPU")
def test_runner_needs_a_gpu():
    with pytest.raises(RuntimeError, match="Runner needs a CUDA GPU"):
        Runner()


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


class NoLayer:
    """Stands in for lab.layer.Layer where only poison() is called."""

    def poison(self, stream):
        pass


class AddOne:
    """Adds 1 to a buffer in two stages; optionally on the side stream and into the counter."""

    expect = "match"

    def __init__(self, name="add-one", side=False, bad=0):
        self.name, self.side, self.bad = name, side, bad

    def prepare(self, runner, layer):
        self.x = runner.buffer("x", (1024,), np.float32)
        self.x.fill(0)

    def run(self, runner, layer):
        if self.side:
            runner.fork()
        stream = runner.side if self.side else runner.stream
        with stream:
            with runner.stage("first", stream):
                self.x += 0.5
            with runner.stage("second", stream):
                self.x += 0.5
                if self.bad:
                    runner.counter += self.bad
        if self.side:
            runner.join()


@pytest.mark.gpu
def test_buffers_are_allocated_once_and_must_agree():
    r = Runner()
    a = r.buffer("a", (4, 8), np.float32)
    assert r.buffer("a", (4, 8), np.float32) is a
    with pytest.raises(ValueError, match="'a' exists"):
        r.buffer("a", (4, 9), np.float32)
    with pytest.raises(ValueError, match="'a' exists"):
        r.buffer("a", (4, 8), np.float16)
    assert r.counter.shape == (1,) and r.counter.dtype == np.uint32


@pytest.mark.gpu
def test_no_allocation_during_capture():
    r = Runner()
    with pytest.raises(RuntimeError, match="prepare"):
        r.capture(lambda: (r.counter.fill(0), r.buffer("late", (4,), np.float32)))
    assert not r.capturing


@pytest.mark.gpu
def test_run_time_and_stage_times():
    r = Runner()
    v = AddOne()
    r.prepare(v, NoLayer())
    r.run(v, NoLayer())
    r.synchronize()
    assert float(v.x.get()[0]) == 1.0
    t = r.time(v, NoLayer(), iterations=5, warmup=2)
    assert t.iterations == 5 and 0 <= t.min_ms <= t.median_ms <= t.max_ms
    assert float(v.x.get()[0]) == 1.0 + 7
    ms = r.time_samples(v, NoLayer(), iterations=3, warmup=1)
    assert ms.shape == (3,) and (ms >= 0).all()
    assert float(v.x.get()[0]) == 1.0 + 7 + 4
    st = r.time_stages(v, NoLayer(), iterations=4, warmup=1)
    assert list(st) == ["first", "second"]
    assert all(s.iterations == 4 and s.median_ms >= 0 for s in st.values())


@pytest.mark.gpu
def test_side_stream_work_joins_back_before_the_end():
    """Work forked to the side stream is complete when the main stream is."""
    r = Runner()
    v = AddOne(side=True)
    r.prepare(v, NoLayer())
    for _ in range(50):
        r.run(v, NoLayer())
    r.stream.synchronize()  # only the main stream: the join makes it wait for the side stream
    assert float(v.x.get(stream=r.stream)[0]) == 50.0


@pytest.mark.gpu
def test_capture_and_replay():
    r = Runner()
    v = AddOne()
    r.prepare(v, NoLayer())
    r.run(v, NoLayer())  # compiles the elementwise kernel before capture
    graph = r.capture(lambda: v.run(r, NoLayer()))
    assert float(v.x.get()[0]) == 1.0  # capturing runs nothing
    for _ in range(3):
        r.replay(graph)
    r.synchronize()
    assert float(v.x.get()[0]) == 4.0


@pytest.mark.gpu
def test_checked_run_reports_non_finite_counts():
    r = Runner()
    ok, bad = AddOne(), AddOne(name="bad", bad=3)
    r.prepare(ok, NoLayer())
    r.checked_run(ok, NoLayer())
    r.prepare(bad, NoLayer())
    with pytest.raises(NonFiniteError, match="bad: 3 non-finite"):
        r.checked_run(bad, NoLayer())
    r.checked_run(ok, NoLayer())  # the counter is zeroed before each checked run


def test_timing_of_per_iteration_samples():
    from lab.timing import Timing

    t = Timing.of([1.5, 0.5, 1.0, 4.0])
    assert (t.median_ms, t.min_ms, t.max_ms, t.iterations) == (1.25, 0.5, 4.0, 4)
    with pytest.raises(ValueError, match="no samples"):
        Timing.of([])
