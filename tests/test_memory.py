"""lab/memory.py: estimates that stay above what is allocated, and refusals before allocating."""

from __future__ import annotations

import importlib.util
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab import memory
from lab.problem import MoEProblem, make_routing, random_activations, tokens_for_mean
from lab.variants import NAMES

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "run_layer.py"


@pytest.fixture(scope="module")
def run_layer():
    spec = importlib.util.spec_from_file_location("run_layer_mem", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def peak_of(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


problems = st.builds(
    lambda e, k, h, i: MoEProblem(e, 64 * h, 64 * i, min(k, e)),
    st.integers(1, 300), st.integers(1, 8), st.integers(1, 16), st.integers(1, 16))


@settings(deadline=None, max_examples=25)
@given(problems, st.floats(0.5, 200.0))
def test_routing_estimate_is_above_what_make_routing_allocates(problem, mean):
    peak, kept = memory.routing_bytes(problem, mean)
    tokens = tokens_for_mean(mean, problem.experts, problem.top_k)
    measured = peak_of(lambda: make_routing(tokens, problem.experts, problem.top_k, seed=1))
    assert measured <= peak and kept <= peak


@settings(deadline=None, max_examples=10)
@given(st.integers(1, 2000), st.sampled_from([64, 512, 4096]))
def test_activation_estimate_is_above_what_random_activations_allocates(tokens, hidden):
    measured = peak_of(lambda: random_activations(tokens, hidden, seed=2))
    assert measured <= tokens * hidden * memory.ACT_PEAK_PER_ELEMENT + 4096


@settings(deadline=None, max_examples=40)
@given(problems, st.floats(0.5, 1e6), st.integers(0, 1 << 44))
def test_require_fits_refuses_exactly_what_exceeds_the_limit(problem, mean, limit):
    need = memory.run_layer_memory(problem, [mean], NAMES)
    for est in (need.host, need.device):
        if est.total > limit:
            with pytest.raises(memory.MemoryLimitError) as exc:
                memory.require_fits(est, limit, "the test's limit")
            msg = str(exc.value)
            assert f"{est.total / 1e9:.3g} GB of {est.kind} memory" in msg
            assert f"more than the {limit / 1e9:.3g} GB available (the test's limit)" in msg
        else:
            memory.require_fits(est, limit, "the test's limit")
    memory.require_fits(need.host, None, "unknown")  # an unknown limit refuses nothing


@settings(deadline=None, max_examples=30)
@given(problems, st.floats(0.5, 1e4), st.floats(1.01, 100.0))
def test_estimates_grow_with_the_mean_and_cover_the_weights(problem, mean, factor):
    small = memory.run_layer_memory(problem, [mean], NAMES)
    big = memory.run_layer_memory(problem, [mean * factor], NAMES)
    assert big.host.total >= small.host.total and big.device.total >= small.device.total
    assert small.host.total >= memory.weight_bytes(problem) and small.device.total >= memory.weight_bytes(problem)
    plain = memory.run_layer_memory(problem, [mean], ["separate"]).device.total
    assert memory.run_layer_memory(problem, [mean], ["separate", "torch-bf16"]).device.total >= plain


def test_weight_bytes_of_the_study_and_the_layouts_variants_add():
    p = MoEProblem()
    assert memory.weight_bytes(p) == pytest.approx(4.077e9, rel=1e-3)
    bf16 = memory.run_layer_memory(p, [8], ["separate", "torch-bf16"]).device
    assert bf16.parts["bf16 weights (torch-bf16)"] == 288 * 3 * 4096 * 2048 * 2  # (E, 3 I H) bf16
    assert bf16.total > memory.weight_bytes(p) + bf16.parts["bf16 weights (torch-bf16)"]
    fp8 = memory.run_layer_memory(p, [8], ["separate", "torch-fp8"]).device
    assert fp8.parts["fp8 weights and row scales (torch-fp8)"] == 288 * 3 * 4096 * 2048 + 288 * (2 * 2048 + 4096) * 4
    w4a8 = memory.run_layer_memory(p, [8], ["separate", "w4a8"])
    assert w4a8.device.parts["W4A8 weights (w4a8)"] == memory.weight_bytes(p)  # words and scales: the packed bytes
    assert w4a8.host.parts["W4A8 w13 prepared on the host (w4a8)"] == 288 * 2 * 2048 * 4096 * (0.5 + 1 / 16)
    assert w4a8.host.total > memory.run_layer_memory(p, [8], ["separate"]).host.total
    # the W4A8 variants' activation images at 512 tokens per expert: w13's and w2's at 192, the fused w13's at 128
    rows = 512 * 288
    want = (rows + 288 * 192) * (4096 + 128 + 2048 + 64) + (rows + 288 * 128) * (4096 + 128)
    assert memory.w4a8_image_bytes({"w4a8", "w4a8-fused"}, rows, 288, 4096, 2048) == want
    assert memory.w4a8_image_bytes({"separate"}, rows, 288, 4096, 2048) == 0
    batch = (lambda vs: memory.run_layer_memory(p, [512], vs).device.parts["one mean's batch"])
    assert batch(["separate", "w4a8"]) - batch(["separate"]) > (rows + 288 * 192) * (4096 + 2048)


@settings(deadline=None, max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.floats(1e5, 1e9), st.sampled_from([1 << 30, 4 << 30, 16 << 30]))
def test_run_layer_refuses_before_drawing_a_routing_that_cannot_fit(run_layer, monkeypatch, capsys, mean, limit):
    def no_routing(*a, **k):
        raise AssertionError("make_routing called for a size the estimate refuses")

    monkeypatch.setattr(run_layer, "make_routing", no_routing)
    monkeypatch.setattr(memory, "host_limit", lambda: (limit, "the test's limit"))
    need = memory.routing_host(MoEProblem(), [mean]).total
    if need <= limit:
        return  # fits: the refusal is not this test's case
    assert run_layer.main(["--mean-tokens", str(mean)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run_layer: drawing the routings of --mean-tokens") and "Traceback" not in err
    assert f"{need / 1e9:.3g} GB of host memory" in err and f"{limit / 1e9:.3g} GB available" in err


def test_run_layer_refuses_a_billion_tokens_per_expert(run_layer, capsys):
    assert run_layer.main(["--mean-tokens", "1e9"]) == 2
    err = capsys.readouterr().err
    assert "GB of host memory" in err and "GB available" in err and len(err.strip().splitlines()) == 1


def test_rows_past_int32_are_refused_with_the_count():
    with pytest.raises(memory.MemoryLimitError, match=r"--mean-tokens 1e\+07: 2880000000 rows exceed"):
        memory.rows_fit_int32(MoEProblem(), 1e7)
    memory.rows_fit_int32(MoEProblem(), 1e5)
