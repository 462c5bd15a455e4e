from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from oracles import E4M3_FINITE, e4m3_from_bits, e4m3_round, fold_e4m3

from lab.problem import MoEProblem, make_routing, random_activations, random_weights
from lab.scale_fold import (
    FINITE_POSITIVE_CODES,
    fold_scales,
    fold_stats,
    fold_weights,
    gate_scale_stats,
    gate_up_ratio,
    layer_effect,
    probe,
)

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


ALL_CODES = np.arange(0x7F, dtype=np.uint8)  # 0 and the 126 finite positive codes


@settings(deadline=None)
@given(st.floats(2.0**-14, 2.0**14, width=32))
def test_fold_equals_the_float32_oracle_bit_for_bit_on_every_code(r):
    folded, sat = fold_scales(ALL_CODES, r)
    want, want_sat = fold_e4m3(ALL_CODES, r)
    bad = np.flatnonzero(folded != want)
    assert bad.size == 0, f"code {bad[0]:#x} at r={r!r}: {folded[bad[0]]:#x}, oracle {want[bad[0]]:#x}"
    np.testing.assert_array_equal(sat, want_sat)


def double_rounding_cases() -> tuple[np.ndarray, np.ndarray]:
    """(codes, float32 ratios) whose float32 product s * r lands exactly on an e4m3 midpoint
    while the exact product does not: rounding once from float64 and rounding the float32
    product (a tie, to even) differ on about half of them."""
    codes = np.arange(1, 0x7F, dtype=np.uint8)
    s = e4m3_from_bits(codes)[:, None, None]
    mids = ((E4M3_FINITE[:-1] + E4M3_FINITE[1:]) / 2)[None, :, None]
    r0 = (mids / s).astype(np.float32)
    steps = np.arange(-4, 5)[None, None, :]
    r = (r0.view(np.int32) + steps).view(np.float32)  # r0 moved k float32 ulps
    exact = s * r.astype(np.float64)
    hit = (exact.astype(np.float32) == mids) & (exact != mids) & (r > 0)
    c, _, _ = np.nonzero(hit)
    return codes[c], r[hit]


def test_fold_rounds_the_float32_product_not_the_exact_one():
    """On products that float32 rounds onto an e4m3 midpoint, the fold keeps the documented
    double rounding (float32, then e4m3 ties to even); a fold formed in float64 differs here."""
    codes, r = double_rounding_cases()
    want, _ = fold_e4m3(codes, r)
    once = e4m3_round(np.minimum(e4m3_from_bits(codes) * r.astype(np.float64), 448.0))
    assert (once != want).sum() > 100  # the cases do tell the two roundings apart
    folded, _ = fold_scales(codes, r)
    bad = np.flatnonzero(folded != want)
    assert bad.size == 0, (f"{bad.size} of {codes.size} differ; first: code {codes[bad[0]]:#x}, r={r[bad[0]]!r}: "
                           f"{folded[bad[0]]:#x}, oracle {want[bad[0]]:#x}")


def test_e4m3_round_oracle_agrees_with_ml_dtypes_around_every_midpoint():
    v = np.concatenate([E4M3_FINITE, (E4M3_FINITE[:-1] + E4M3_FINITE[1:]) / 2]).astype(np.float32)
    near = np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(0))])
    near = near[(near >= 0) & (near <= 448)]
    np.testing.assert_array_equal(e4m3_round(near), near.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def test_probe_at_the_studys_ratio():
    out = probe(1.2308)
    a = out["all_codes"]
    assert a["codes"] == 126 and out["scales"] is None
    # codes 0x7C, 0x7D, 0x7E (384, 416, 448) exceed 448 once multiplied by 1.2308; 0x7B (352) does not
    assert a["saturated"] == 3
    want = oracle_stats(FINITE_POSITIVE_CODES, 1.2308)
    for key in ("mean_rel_err", "max_rel_err", "max_rel_err_unsaturated"):
        assert a[key] == pytest.approx(want[key], rel=1e-12), key
    assert (a["inexact"], a["flushed_to_zero"]) == (want["inexact"], want["flushed_to_zero"])
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
    _folded, sat = fold_scales(scales, np.array([1.0, 2.0])[:, None, None])
    assert sat[1].all() and not sat[0].any()


def test_flush_to_zero_is_counted():
    # 0.2 and 0.4 times 2**-9 lie below 2**-10, half the smallest subnormal: both round to 0;
    # 3 * 2**-9 * 0.2 = 0.6 * 2**-9 rounds up to 2**-9
    s = fold_stats(np.array([0x01, 0x02, 0x03], np.uint8), 0.2)
    assert (s["flushed_to_zero"], s["codes"]) == (2, 3)
    np.testing.assert_array_equal(fold_scales(np.array([0x01, 0x02, 0x03], np.uint8), 0.2)[0], [0, 0, 1])


def oracle_stats(bits, ratio) -> dict:
    """fold_stats' figures over non-zero codes, from oracles.fold_e4m3 (ratio: a float, or per
    leading index of bits)."""
    bits = np.asarray(bits)
    r = np.asarray(ratio, np.float32).reshape(np.shape(ratio) + (1,) * (bits.ndim - np.ndim(ratio)))
    folded, sat = fold_e4m3(bits, r)
    exact = e4m3_from_bits(bits) * r.astype(np.float64)
    nz = bits > 0
    rel = np.abs(e4m3_from_bits(folded) - exact)[nz] / exact[nz]
    return {"mean_rel_err": rel.mean(), "max_rel_err": rel.max(), "max_rel_err_unsaturated": rel[~sat[nz]].max(),
            "inexact": int((rel > 0).sum()), "saturated": int(sat[nz].sum()),
            "flushed_to_zero": int((folded[nz] == 0).sum())}


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
    assert "mean_rel_err" in res.stdout and "checkpoint gate" in res.stdout and "synthetic" not in res.stdout
    data = json.loads(out.read_text())
    assert data["script"] == "scripts/scale_fold_probe.py" and data["setup"]["lab_commit"] and "--json" in data["argv"]
    assert data["ratio"] == 1.2308 and len(data["rows"]) == 6
    assert data["rows"][0]["saturated"] == 3 and data["checkpoint"]["experts"] == 3
    # the checkpoint's own gate scales, each expert at its own ratio, and the layer on its experts
    assert data["gate_scales"]["codes"] == 3 * 64 * 128 // 16 and data["layer"]["rows"] > 0
    assert [e["expert"] for e in data["experts"]] == data["layer"]["experts"]
    assert 0 < data["layer"]["out_b"] < 1 and data["layer"]["out_a_bf16"] < 1e-2


def test_probe_script_without_a_checkpoint_says_synthetic(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "fold.json"
    res = subprocess.run([sys.executable, str(root / "scripts/scale_fold_probe.py"), "--experts", "4", "--hidden",
                          "256", "--intermediate", "128", "--sample-experts", "2", "--json", str(out)],
                         check=True, capture_output=True, text=True)
    assert "no --checkpoint: synthetic weights" in res.stdout and "synthetic gate" in res.stdout
    data = json.loads(out.read_text())
    assert data["checkpoint"] is None and data["source"]["kind"] == "synthetic"
    assert len(data["layer"]["experts"]) == 2 and len(data["experts"]) == 2
    res = subprocess.run([sys.executable, str(root / "scripts/scale_fold_probe.py"), "--experts", "4", "--hidden",
                          "256", "--intermediate", "128", "--sample-experts", "0"],
                         check=True, capture_output=True, text=True)
    assert "Layer output" not in res.stdout  # --sample-experts 0 skips the layer


# ---------------------------------------------------------------------------------------------
# a whole layer: option (b) against option (a)
# ---------------------------------------------------------------------------------------------

SMALL = MoEProblem(4, 256, 128, 4)


def weights_with_ratio(ratio, max_code=0x7E, seed=0):
    """Synthetic weights whose every expert has up_global = gate_global / ratio exactly (ratio a
    power of two, or 1) and block scales capped at code max_code."""
    w = random_weights(SMALL, seed=seed)
    up = (w.gate_global / np.float32(ratio)).astype(np.float32)
    return replace(w, up_global=up, w13_scales=np.minimum(w.w13_scales, np.uint8(max_code)))


def batch(w, seed=0):
    routing = make_routing(16, w.experts, SMALL.top_k, seed=seed)
    return random_activations(routing.tokens, w.hidden, seed=seed), routing


def test_fold_weights_is_option_b():
    w = random_weights(SMALL)
    wb, sat = fold_weights(w)
    i = w.intermediate
    r = gate_up_ratio(w)
    np.testing.assert_array_equal(r, w.gate_global.astype(np.float32) / w.up_global.astype(np.float32))
    np.testing.assert_array_equal(wb.gate_global, w.up_global)  # one global per expert for w13
    np.testing.assert_array_equal(wb.w13_scales[:, i:], w.w13_scales[:, i:])  # the up half is untouched
    folded, s = fold_scales(w.w13_scales[:, :i], r[:, None, None])
    np.testing.assert_array_equal(wb.w13_scales[:, :i], folded)
    np.testing.assert_array_equal(sat, s)
    assert w.w13_scales is not wb.w13_scales and w.w13_packed is wb.w13_packed  # scales copied, codes shared


def test_ratio_one_gives_exactly_zero_error():
    w = weights_with_ratio(1.0)
    total, _per = gate_scale_stats(w)
    assert total["mean_rel_err"] == 0 and total["inexact"] == 0 and total["saturated"] == 0
    x, routing = batch(w)
    eff = layer_effect(w, x, routing, range(w.experts))
    assert eff["out_b"] == 0 and eff["a_b"] == 0 and eff["a_q_codes_changed"] == 0
    assert eff["out_b_bf16"] == eff["out_a_bf16"] > 0  # the bf16 output rounds both the same
    assert all(e["gate_rel"] == 0 for e in eff["per_expert"])


@settings(deadline=None)
@given(valid_codes, st.sampled_from([1.0, 2.0, 4.0, 8.0, 64.0]))
def test_power_of_two_ratio_is_exact_unless_saturating(bits, r):
    """s * 2**n is an e4m3 value whenever it is at most 448 (subnormals move up into the normals
    without losing a bit), so only saturated codes carry an error."""
    folded, sat = fold_scales(bits, r)
    exact = e4m3_from_bits(bits) * r
    np.testing.assert_array_equal(e4m3_from_bits(folded)[~sat], exact[~sat])
    st_ = fold_stats(bits, r)
    assert st_["inexact"] == st_["saturated"] == int(sat[bits > 0].sum())


def test_power_of_two_below_one_loses_subnormal_bits():
    """The other direction is not exact: 2**-9 / 2 flushes to zero, 3 * 2**-9 / 2 rounds."""
    s = fold_stats(np.array([0x01, 0x03, 0x38], np.uint8), 0.5)
    assert s["flushed_to_zero"] == 1 and s["inexact"] == 2 and s["saturated"] == 0


def test_power_of_two_ratio_layer_error_only_from_saturation():
    w = weights_with_ratio(2.0, max_code=0x6F)  # scales <= 120: x2 never reaches 448
    x, routing = batch(w)
    eff = layer_effect(w, x, routing, range(w.experts))
    assert eff["out_b"] == 0 and all(e["gate_rel"] == 0 for e in eff["per_expert"])
    w = weights_with_ratio(2.0)  # all codes: the top ones saturate
    eff = layer_effect(w, x, routing, range(w.experts))
    assert eff["out_b"] > 0
    for e in eff["per_expert"]:
        assert e["gate_rel"] > 0 and e["gate_rel_unsaturated"] == 0 and 0 < e["saturated_energy"] < 1


def test_non_trivial_ratio_error_grows_from_zero():
    """At the study's 1.2308 every scale re-rounds: scale errors within half an e4m3 step (6.25%)
    except at saturation, and an output error that ratio 1 does not have."""
    w = random_weights(MoEProblem(4, 256, 128, 4, gate_up_ratio=1.2308))
    x, routing = batch(w)
    total, per = gate_scale_stats(w)
    want = oracle_stats(w.w13_scales[:, :w.intermediate], gate_up_ratio(w))
    assert (total["inexact"], total["saturated"], total["flushed_to_zero"]) == \
        (want["inexact"], want["saturated"], want["flushed_to_zero"])
    for key in ("mean_rel_err", "max_rel_err", "max_rel_err_unsaturated"):
        assert total[key] == pytest.approx(want[key], rel=1e-12), key
    assert total["inexact"] > 0.9 * total["codes"]
    assert sum(p["codes"] for p in per) == total["codes"]
    assert sum(p["saturated"] for p in per) == total["saturated"] > 0
    eff = layer_effect(w, x, routing, [0, 1])
    assert eff["rows"] == int(routing.counts[:2].sum())
    assert eff["out_b"] > eff["out_a_bf16"] > 0  # the fold costs more than the bf16 output rounding
    for e in eff["per_expert"]:
        assert 0 < e["gate_rel_unsaturated"] < 0.0625 * 1.01 and e["gate_rel"] > e["gate_rel_unsaturated"]
    eff1 = layer_effect(weights_with_ratio(1.0), x, routing, [0, 1])
    assert eff1["out_b"] == 0 < eff["out_b"]


def test_sample_experts_takes_experts_with_rows():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "probe", Path(__file__).resolve().parents[1] / "scripts/scale_fold_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    counts = np.array([0, 3, 0, 1, 5, 2])
    assert mod.sample_experts(counts, 8, 0) == [1, 3, 4, 5]
    picked = mod.sample_experts(counts, 2, 0)
    assert len(picked) == 2 and picked == sorted(picked) and all(counts[e] > 0 for e in picked)
    assert picked == mod.sample_experts(counts, 2, 0)  # seeded
