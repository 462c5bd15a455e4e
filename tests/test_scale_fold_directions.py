"""Option (b) both ways (lab/scale_fold.py): into the gate half (x r) and into the half with the
smaller global (x g_small / g_large), which never saturates; over codes, ratios, a layer's own
scales and weights quantized from real-valued tensors."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from oracles import e4m3_from_bits

from lab import nvfp4, reference
from lab.problem import MoEProblem, make_routing, random_activations, random_weights
from lab.scale_fold import (
    FINITE_POSITIVE_CODES,
    INTO,
    fold_plan,
    fold_stats,
    fold_w13_scales,
    fold_weights,
    layer_effect,
    quantized_weights,
    scale_stats,
)

ROOT = Path(__file__).resolve().parent.parent
SMALL = MoEProblem(4, 128, 64, 2)
globals_ = st.floats(1e-8, 1e-2, allow_nan=False).map(np.float32)
codes = hnp.arrays(np.uint8, st.tuples(st.integers(1, 8), st.integers(1, 4)), elements=st.integers(0, 0x7E))


def with_globals(gate, up, scales=None, seed=0):
    w = random_weights(SMALL, seed=seed)
    e = w.experts
    w = replace(w, gate_global=np.asarray(gate, np.float32).reshape(e), up_global=np.asarray(up, np.float32).reshape(e))
    if scales is not None:
        w = replace(w, w13_scales=scales)
    return w


@settings(deadline=None, max_examples=80)
@given(st.lists(globals_, min_size=4, max_size=4), st.lists(globals_, min_size=4, max_size=4),
       st.sampled_from(["all codes", "random"]), st.integers(0, 2**31 - 1))
def test_folding_into_the_smaller_global_never_saturates(gate, up, which, seed):
    w = with_globals(gate, up, seed=seed)
    if which == "all codes":  # every finite positive code in every expert's both halves
        s = np.resize(FINITE_POSITIVE_CODES, w.w13_scales.size).reshape(w.w13_scales.shape)
        w = replace(w, w13_scales=s)
    scales, one, sat = fold_w13_scales(w, "smaller")
    assert not sat.any()
    np.testing.assert_array_equal(one, np.maximum(w.gate_global, w.up_global))
    v_old, v_new = e4m3_from_bits(w.w13_scales), e4m3_from_bits(scales)
    assert np.isfinite(v_new).all() and (v_new <= v_old).all()  # scales only shrink: never past 448
    total, per = scale_stats(w, "smaller")
    assert total["saturated"] == 0 and all(p["saturated"] == 0 and p["factor"] <= 1 for p in per)
    # the half left alone is bit for bit the original; the folded one is the smaller global's
    i = w.intermediate
    for e in range(w.experts):
        gate_small = w.gate_global[e] < w.up_global[e]
        kept = slice(i, 2 * i) if gate_small else slice(0, i)
        np.testing.assert_array_equal(scales[e, kept], w.w13_scales[e, kept])
        assert per[e]["half"] == ("gate" if gate_small else "up")


@settings(deadline=None, max_examples=80)
@given(codes, st.floats(1e-6, 1.0, exclude_min=True))
def test_a_factor_at_most_one_never_saturates_any_code(bits, f):
    st_ = fold_stats(bits, f)
    assert st_["saturated"] == 0 and st_["max_rel_err_unsaturated"] == st_["max_rel_err"]
    assert fold_stats(FINITE_POSITIVE_CODES, f)["saturated"] == 0


@settings(deadline=None, max_examples=40)
@given(st.lists(globals_, min_size=4, max_size=4), st.lists(globals_, min_size=4, max_size=4))
def test_the_folded_value_stays_within_half_an_e4m3_step_of_the_exact_one(gate, up):
    """value = e2m1 * s * g: option (b)'s s' * g_large is s * g_small rounded once, in e4m3."""
    w = with_globals(gate, up)
    into_gate, factor, one = fold_plan(w, "smaller")
    scales, _, _ = fold_w13_scales(w, "smaller")
    i = w.intermediate
    for e in range(w.experts):
        half = slice(0, i) if into_gate[e] else slice(i, 2 * i)
        exact = e4m3_from_bits(w.w13_scales[e, half]) * float(factor[e])
        got = e4m3_from_bits(scales[e, half])
        step = 2.0 ** (np.floor(np.log2(np.maximum(exact, 2.0**-6))) - 3)  # e4m3 spacing (2**-9 below 2**-6)
        assert (np.abs(got - exact) <= step / 2 * (1 + 1e-6)).all()


def test_the_gate_direction_is_the_fold_as_before():
    w = random_weights(MoEProblem(4, 128, 64, 2, gate_up_ratio=1.2308))
    into_gate, factor, one = fold_plan(w, "gate")
    assert into_gate.all() and np.array_equal(one, w.up_global)
    assert (factor > 1).all()  # random_weights: gate global = up global x ~1.23
    _, sat = fold_weights(w, "gate")
    assert sat.any()  # the synthetic scales include 448: x 1.23 saturates them
    with pytest.raises(ValueError, match="into must be one of gate, smaller"):
        fold_plan(w, "up")


def test_equal_globals_change_nothing_either_way():
    w = random_weights(SMALL)
    w = replace(w, up_global=w.gate_global.copy())
    for into in INTO:
        wb, sat = fold_weights(w, into)
        np.testing.assert_array_equal(wb.w13_scales, w.w13_scales)
        assert not sat.any()


def test_both_directions_compute_option_b_in_float64():
    """The layer on folded weights equals the float64 layer with each half's scales and globals
    replaced as the fold says: gate and up both carry the one global."""
    w = random_weights(SMALL, seed=2)
    routing = make_routing(16, w.experts, SMALL.top_k, seed=2)
    x = random_activations(routing.tokens, w.hidden, seed=2)
    for into in INTO:
        wb, _ = fold_weights(w, into)
        np.testing.assert_array_equal(wb.gate_global, wb.up_global)
        eff = layer_effect(w, x, routing, range(w.experts), into)
        ra = reference.layer(x, routing, w)
        rb = reference.layer(x, routing, wb)
        want = np.linalg.norm(rb["out"] - ra["out"]) / np.linalg.norm(ra["out"])
        assert eff["into"] == into and eff["out_b"] == pytest.approx(want, rel=1e-9)
        assert eff["out_b"] > eff["out_a_bf16"] > 0
        for e in eff["per_expert"]:
            assert e["folded_half"] == ("gate" if into == "gate" else "up")  # random_weights: gate global larger
            if into == "smaller":
                assert e["saturated_energy"] == 0
                assert e["weights_rel"] == pytest.approx(e["weights_rel_unsaturated"], rel=1e-12)
                assert "gate_rel" not in e


def test_quantized_weights_are_real_valued_tensors_quantized():
    p = MoEProblem(3, 256, 128, 2, gate_up_ratio=1.25)
    w = quantized_weights(p, seed=1)
    i = p.intermediate
    for e in range(p.experts):
        for rows in (slice(0, i), slice(i, 2 * i)):  # each half's largest block scale is 448 (amax / 2688 global)
            assert w.w13_scales[e, rows].max() == 0x7E
        assert w.w2_scales[e].max() == 0x7E
    ratio = w.gate_global / w.up_global
    assert ((ratio > 1.25 / 1.6) & (ratio < 1.25 * 1.6)).all()  # amax of each half: the drawn ratio, noisy
    dec = nvfp4.dequantize_blocks(w.w13_packed[:, i:], w.w13_scales[:, i:]) * w.up_global[:, None, None]
    assert 0.5 * 0.02 < dec.std() < 2 * 0.02  # N(0, WEIGHT_STD) with a lognormal row scale
    # their scales crowd towards the top codes, where random_weights' spread over all of them
    top = (w.w13_scales[:, :i] >= 0x70).mean()
    assert top > 2 * (random_weights(p).w13_scales[:, :i] >= 0x70).mean()
    np.testing.assert_array_equal(quantized_weights(p, seed=1).w13_packed, w.w13_packed)  # seeded


def test_probe_reports_both_directions_on_quantized_weights(tmp_path):
    out = tmp_path / "fold.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts/scale_fold_probe.py"), "--weights", "quantized",
                          "--experts", "4", "--hidden", "256", "--intermediate", "128", "--sample-experts", "2",
                          "--json", str(out)], capture_output=True, text=True, check=True)
    assert "real-valued tensors quantized" in res.stdout
    assert "into the gate half (x r)" in res.stdout and "into the smaller global's half" in res.stdout
    assert "quantizing real-valued weights: expert 1 of 4" in res.stderr  # progress lines
    data = json.loads(out.read_text())
    assert data["source"]["weights"] == "quantized" and data["rows"][5]["saturated"] == 0
    assert data["smaller"]["scales"]["saturated"] == 0 and data["gate_scales"]["saturated"] > 0
    assert data["layer"]["into"] == "gate" and data["smaller"]["layer"]["into"] == "smaller"
    assert all(e["saturated"] == 0 for e in data["smaller"]["experts"])
    assert 0 < data["smaller"]["layer"]["out_b"] < 1
