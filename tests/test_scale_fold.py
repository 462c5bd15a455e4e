import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lab.scale_fold import FINITE_POSITIVE_CODES, fold_scales, fold_stats, probe
from oracles import e4m3_from_bits

valid_codes = hnp.arrays(np.uint8, st.tuples(st.integers(1, 4), st.integers(1, 40)), elements=st.integers(0, 0x7E))
ratios = st.floats(0.01, 100.0)


def half_step(v):
    """Half the e4m3 spacing in v's binade (subnormal spacing 2**-9 below 2**-6)."""
    e = np.floor(np.log2(np.maximum(v, 2.0**-6)))
    return 2.0 ** (e - 3) / 2


def test_all_positive_codes_are_the_126_finite_ones():
    v = e4m3_from_bits(FINITE_POSITIVE_CODES)
    assert len(v) == 126 and np.isfinite(v).all() and (v > 0).all()
    assert v.min() == 2.0**-9 and v.max() == 448


@settings(deadline=None)
@given(valid_codes)
def test_ratio_one_is_the_identity(bits):
    folded, sat = fold_scales(bits, 1.0)
    np.testing.assert_array_equal(folded, bits)
    assert not sat.any()


@settings(deadline=None)
@given(valid_codes, ratios)
def test_fold_never_exceeds_448_and_counts_saturation(bits, r):
    folded, sat = fold_scales(bits, r)
    v = e4m3_from_bits(folded)
    assert np.isfinite(v).all() and (v <= 448).all() and (v >= 0).all()
    exact = e4m3_from_bits(bits) * float(np.float32(r))  # exact in float64
    np.testing.assert_array_equal(sat, exact > 448)
    assert (v[sat] == 448).all()
    assert fold_stats(bits, r)["saturated"] == int((exact > 448).sum())


@settings(deadline=None)
@given(valid_codes, ratios)
def test_fold_error_within_half_an_e4m3_step_except_at_saturation(bits, r):
    folded, sat = fold_scales(bits, r)
    exact = e4m3_from_bits(bits) * float(np.float32(r))
    err = np.abs(e4m3_from_bits(folded) - exact)
    ok = ~sat
    assert (err[ok] <= half_step(exact[ok]) * (1 + 1e-6)).all()


def test_probe_at_the_studys_ratio():
    out = probe(1.2308)
    a = out["all_codes"]
    assert a["codes"] == 126 and out["scales"] is None
    # codes 0x7C, 0x7D, 0x7E (384, 416, 448) exceed 448 once multiplied by 1.2308; 0x7B (352) does not
    assert a["saturated"] == 3
    assert 0.01 < a["mean_rel_err"] < 0.05  # ~3% average: half of a 6.25-12.5% step, on average
    assert a["max_rel_err"] >= a["max_rel_err_unsaturated"] > 0.0
    # the inverse direction never saturates
    assert probe(1 / 1.2308)["all_codes"]["saturated"] == 0


def test_probe_over_given_scales_weights_by_occurrence():
    scales = np.array([[0x7E] * 9 + [0x38], [0] * 10], np.uint8)  # 9 x 448, 1 x 1.0, 10 zeros
    s = probe(1.2308, scales)["scales"]
    assert s["codes"] == 10 and s["zero_codes"] == 10 and s["saturated"] == 9
    rel_448 = abs(448 - 448 * float(np.float32(1.2308))) / (448 * float(np.float32(1.2308)))
    rel_1 = abs(1.25 - float(np.float32(1.2308))) / float(np.float32(1.2308))  # 1.2308 -> 1.25
    assert s["mean_rel_err"] == pytest.approx((9 * rel_448 + rel_1) / 10)
    assert s["max_rel_err"] == pytest.approx(rel_448) and s["max_rel_err_unsaturated"] == pytest.approx(rel_1)


def test_per_expert_ratios():
    scales = np.full((2, 3, 4), 0x7E, np.uint8)
    s = fold_stats(scales, np.array([1.0, 2.0]))
    assert s["codes"] == 24 and s["saturated"] == 12
    folded, sat = fold_scales(scales, np.array([1.0, 2.0])[:, None, None])
    assert sat[1].all() and not sat[0].any()


def test_flush_to_zero_is_counted():
    s = fold_stats(np.array([0x01, 0x02], np.uint8), 0.2)  # 2**-9 * 0.2 rounds to 0
    assert s["flushed_to_zero"] >= 1


@pytest.mark.parametrize("bits, msg", [([0x7F], "NaN"), ([0xFF], "NaN"), ([0x81], "negative")])
def test_bad_codes_raise(bits, msg):
    with pytest.raises(ValueError, match=msg):
        fold_scales(np.array(bits, np.uint8), 1.2)
    with pytest.raises(ValueError, match=msg):
        fold_stats(np.array(bits, np.uint8), 1.2)


@pytest.mark.parametrize("r", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_ratio_raises(r):
    with pytest.raises(ValueError, match="ratio"):
        fold_scales(np.array([1], np.uint8), r)


def test_probe_script_writes_json(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    ckpt = tmp_path / "c.safetensors"
    subprocess.run([sys.executable, str(root / "scripts/make_checkpoint.py"), str(ckpt), "--experts", "3",
                    "--hidden", "128", "--intermediate", "64"], check=True, capture_output=True)
    out = tmp_path / "fold.json"
    res = subprocess.run([sys.executable, str(root / "scripts/scale_fold_probe.py"), "--ratio", "1.2308",
                          "--checkpoint", str(ckpt), "--json", str(out)], check=True, capture_output=True, text=True)
    assert "mean_rel_err" in res.stdout and "checkpoint gate" in res.stdout
    data = json.loads(out.read_text())
    assert data["ratio"] == 1.2308 and len(data["rows"]) == 6
    assert data["rows"][0]["saturated"] == 3 and data["checkpoint"]["experts"] == 3
