"""lab/checks.check_separate on the host: a layer whose device buffers are NumPy arrays holding
what a correct run leaves, so that the check's logic (the sampled float64 layer, the all-rows
comparisons a chunk at a time) and its host memory are tested without a GPU. The GPU tests
(test_variants, test_gemm_layout) run the same check on the kernels' own buffers."""

from __future__ import annotations

import contextlib
import tracemalloc
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from lab import checks, memory, nvfp4, reference
from lab.problem import MoEProblem, make_routing, random_activations, random_weights


class Dev(np.ndarray):
    """A host array standing in for a device one: .get() copies it out, as CuPy's does."""

    def get(self):
        return np.array(self, copy=True)


def dev(a) -> Dev:
    return np.ascontiguousarray(a).view(Dev)


def fake_swiglu_quant(h, offsets, gate_global, up_global, input_scale, a_packed, a_scales, counter, a_out, stream):
    """The SwiGLU + quantize kernel on the host: the fp32 a and its NVFP4 that a correct launch
    writes, computed once by correct_layer (so that a host-memory measurement of the check sees
    none of what the device would hold)."""
    a32, packed, scales = h.kernel_result
    np.copyto(a_out, a32)
    np.copyto(a_packed, packed)
    np.copyto(a_scales, scales)


def correct_layer(problem: MoEProblem, mean: int, seed: int = 0):
    """A layer object with the buffers a correct checked run of separate leaves, and its runner."""
    w = random_weights(problem, seed=seed)
    routing = make_routing(mean * problem.experts // problem.top_k, problem.experts, problem.top_k, seed=seed)
    x = random_activations(routing.tokens, problem.hidden, seed=seed)
    offs = routing.offsets.astype(np.int64)
    x_q = nvfp4.quantize(x[routing.row_token], w.w13_input_scale)
    h = reference.w13(x_q, offs, w).astype(np.float32)
    a = reference.swiglu(h, offs, w.gate_global, w.up_global).astype(np.float32)
    a_q = nvfp4.quantize(a, w.w2_input_scale)
    out = reference.w2(a_q, offs, w).astype(np.float32)
    layer = SimpleNamespace(
        problem=problem, routing=routing, offsets_host=offs, offsets=dev(offs.astype(np.int32)), rows=routing.rows,
        weights=SimpleNamespace(host=w, gate_global=dev(w.gate_global), up_global=dev(w.up_global),
                                w2_input_scale=w.w2_input_scale),
        x=dev(x), x_packed=dev(x_q.packed), x_scales=dev(x_q.scales), h=dev(h), a_packed=dev(a_q.packed),
        a_scales=dev(a_q.scales), out=dev(out), out_bf16=dev(out.astype(ml_dtypes.bfloat16).view(np.uint16)))
    layer.h.kernel_result = (a, a_q.packed.copy(), a_q.scales.copy())
    rows, i = routing.rows, problem.intermediate
    buffers = {"check/a32": dev(np.full((rows, i), np.nan, np.float32)),
               "check/a_packed": dev(np.full((rows, i // 2), 0xFF, np.uint8)),
               "check/a_scales": dev(np.full((rows, i // 16), 0xFF, np.uint8))}

    def buffer(name, shape, dtype):  # (allocated up front: on a GPU these are device memory)
        assert buffers[name].shape == shape and buffers[name].dtype == dtype
        return buffers[name]

    runner = SimpleNamespace(buffer=buffer, stream=contextlib.nullcontext(), counter=dev(np.zeros(1, np.int32)),
                             read_counter=lambda: 0)
    return layer, runner


SMALL = MoEProblem(experts=8, hidden=128, intermediate=64, top_k=2)


@pytest.fixture
def fake_kernel(monkeypatch):
    monkeypatch.setattr(checks.sq, "swiglu_quant", fake_swiglu_quant)
    monkeypatch.setattr(checks, "CHECK_CHUNK_ROWS", 37)  # chunks that split experts and end short


def test_a_correct_layer_passes_every_stage_on_a_sample(fake_kernel):
    layer, runner = correct_layer(SMALL, mean=40)
    experts = [1, 4, 6]
    res = checks.check_separate(runner, layer, experts)
    for stage in ("x_q", "h", "a", "a_q", "out", "bf16"):
        assert res[stage]["ok"], f"{stage}: {res[stage]['detail']}"
    rows = checks.expert_rows(layer.offsets_host, experts)
    assert np.array_equal(res["reference"]["rows"], rows)
    assert res["reference"]["out"].shape == (rows.size, SMALL.hidden)
    # the sampled float64 layer is reference.layer's on those rows
    full = reference.layer(np.asarray(layer.x), layer.routing, layer.weights.host, experts=experts)
    assert np.array_equal(res["reference"]["out"], full["out"][rows])
    assert np.array_equal(res["reference"]["h"], full["h"][rows])
    assert res["layer_rel"] is not None and res["layer_rel"] < 1e-2


@pytest.mark.parametrize("buffer", ["x_packed", "x_scales", "a_packed", "a_scales", "out_bf16"])
def test_a_wrong_bit_outside_the_sample_fails_the_all_rows_stage(fake_kernel, buffer):
    layer, runner = correct_layer(SMALL, mean=40)
    experts = [2]
    outside = np.setdiff1d(np.arange(layer.rows), checks.expert_rows(layer.offsets_host, experts))
    row = int(outside[-1])  # in the last, short chunk
    getattr(layer, buffer)[row, 3] ^= 1
    stage = {"x_packed": "x_q", "x_scales": "x_q", "a_packed": "a_q", "a_scales": "a_q", "out_bf16": "bf16"}[buffer]
    res = checks.check_separate(runner, layer, experts)
    assert not res[stage]["ok"]
    assert f"1 of " in res[stage]["detail"] and f"({row}, 3)" in res[stage]["detail"], res[stage]["detail"]
    assert not res["ok"]


@pytest.mark.parametrize("buffer,stage", [("h", "h"), ("out", "out")])
def test_a_wrong_value_inside_the_sample_fails_its_float64_stage(fake_kernel, buffer, stage):
    layer, runner = correct_layer(SMALL, mean=40)
    experts = [3, 5]
    row = int(checks.expert_rows(layer.offsets_host, experts)[-1])
    getattr(layer, buffer)[row, 0] += 1000.0
    res = checks.check_separate(runner, layer, experts)
    assert not res[stage]["ok"], res[stage]["detail"]


@pytest.mark.parametrize("hidden,intermediate", [(512, 256), (256, 1024)])
def test_the_host_memory_of_a_check_stays_under_its_estimate(fake_kernel, hidden, intermediate):
    problem = MoEProblem(experts=16, hidden=hidden, intermediate=intermediate, top_k=2)
    layer, runner = correct_layer(problem, mean=160)
    experts = checks.sample_experts(layer.routing.counts, 4, seed=1)
    sample_rows = int(layer.routing.counts[experts].sum())
    assert sample_rows < layer.rows / 2  # a sample, so that a check holding every row would show
    tracemalloc.start()
    try:
        checks.check_separate(runner, layer, experts)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    parts = memory.check_host_parts(problem, layer.rows, layer.routing.tokens, sample_rows)
    own = sum(v for k, v in parts.items() if k.startswith("check:"))
    assert peak <= own, (peak, parts)


def test_approx_error_reads_the_sampled_rows_against_the_reference_of_the_check(fake_kernel):
    layer, runner = correct_layer(SMALL, mean=40)
    experts = [0, 5]
    res = checks.check_separate(runner, layer, experts)
    assert checks.approx_error(layer, res["reference"]["out"], experts) == res["layer_rel"]
    rows = checks.expert_rows(layer.offsets_host, experts)
    layer.out[rows[0], 0] += 1.0
    assert checks.approx_error(layer, res["reference"]["out"], experts) > res["layer_rel"]
