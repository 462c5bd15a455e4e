"""Relative error against an all-zero reference is undefined: None (JSON null, "undefined" in
tables), never 0, wherever the lab reports one."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lab import checks, scale_fold
from lab.problem import MoEProblem, make_routing, random_activations, random_weights

ROOT = Path(__file__).resolve().parent.parent
finite = st.floats(-1e6, 1e6, allow_nan=False)
arrays = hnp.arrays(np.float64, hnp.array_shapes(max_dims=3, max_side=6), elements=finite)


@given(arrays)
def test_against_a_zero_reference_it_is_undefined_never_zero(got):
    assert checks.rel_error(got, np.zeros_like(got)) is None
    assert checks.format_rel(checks.rel_error(got, np.zeros_like(got))) == checks.UNDEFINED


@given(arrays, arrays)
def test_against_a_non_zero_reference_it_is_the_frobenius_ratio(got, want):
    if got.shape != want.shape:
        with pytest.raises(ValueError, match="shapes differ"):
            checks.rel_error(got, want)
        return
    err = checks.rel_error(got, want)
    if not np.any(want):
        assert err is None
    else:
        num, den = np.linalg.norm(got - want), np.linalg.norm(want)
        if den > 1e-150 and (num > 1e-150 or not np.any(got - want)):  # the plain formula does not underflow
            assert err == pytest.approx(num / den, rel=1e-12, abs=0)
        assert err >= 0  # (inf only where the ratio itself passes float64's range)
        assert (err == 0) == np.array_equal(got, want)


def test_non_finite_values_are_refused():
    with pytest.raises(ValueError, match="got contains NaN"):
        checks.rel_error(np.array([np.nan]), np.ones(1))
    with pytest.raises(ValueError, match="reference"):
        checks.rel_error(np.ones(1), np.array([np.inf]))


@given(arrays)
def test_a_stage_check_against_zero_passes_only_an_all_zero_result(got):
    res = checks._rel("h", got, np.zeros_like(got), 1e-5)
    assert res["value"] is None and checks.UNDEFINED in res["detail"] or got.size == 0
    assert res["ok"] == (not np.any(got))


def test_layer_effect_with_a_zero_reference_reports_undefined():
    # up_global tiny: a = silu(g) * u falls below the w2 input's smallest NVFP4 value, out is zero
    w = random_weights(MoEProblem(4, 128, 64, 2))
    w.up_global[:] = w.gate_global * np.float32(1e-9)
    routing = make_routing(8, 4, 2, seed=1)
    x = random_activations(routing.tokens, 128, seed=1)
    for into in scale_fold.INTO:
        eff = scale_fold.layer_effect(w, x, routing, range(4), into)
        assert eff["ref_zero"]
        assert eff["out_b"] is None and eff["out_a_bf16"] is None and eff["out_b_bf16"] is None
        assert all(e["out_b"] is None for e in eff["per_expert"])
        json.dumps(eff, allow_nan=False)


def test_probe_at_a_ratio_that_saturates_everything_says_so_and_writes_valid_json(tmp_path):
    out = tmp_path / "fold.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts/scale_fold_probe.py"), "--ratio", "1e9", "--experts", "4",
                          "--hidden", "128", "--intermediate", "64", "--sample-experts", "2", "--json", str(out)],
                         capture_output=True, text=True, check=True)
    assert "saturates every one of the 126 codes" in res.stdout
    assert "the fold saturated every one of these scales" in res.stdout
    assert "undefined" in res.stdout and "0.000e+00" not in res.stdout.split("Layer output")[1].splitlines()[3]
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert data["layer"]["out_b"] is None and data["smaller"]["layer"]["out_b"] is None
    assert data["rows"][0]["saturated"] == 126 and data["rows"][0]["max_rel_err_unsaturated"] is None


def test_run_layer_json_has_no_bare_nan(tmp_path):
    spec = importlib.util.spec_from_file_location("run_layer_rel", ROOT / "scripts" / "run_layer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "r.json"
    mod.write_json(str(path), {"rel": float("nan"), "rels": np.array([1.0, np.inf]), "ok": np.float32(0.5),
                               "undefined": None})
    data = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert data == {"rel": None, "rels": [1.0, None], "ok": 0.5, "undefined": None}
    assert mod.correct_label({"skipped": None, "errors": [], "expect": "approx", "checks": [{"rel": None}]}) == \
        f"approx ({checks.UNDEFINED})"
