import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lab.problem import MoEProblem, make_routing, tokens_for_mean
from lab.roofline import GB10_GBPS, H200_GBPS, bytes_table, layer_bytes, nvfp4_bytes, roofline_ms, uniform_counts

P = MoEProblem()


def test_weight_bytes_are_the_studys():
    lb = layer_bytes(P, uniform_counts(P, 8))
    assert lb.w13.weights == 288 * 4096 * 4096 * 9 // 16 == 2_717_908_992
    assert lb.w2.weights == 288 * 4096 * 2048 * 9 // 16 == 1_358_954_496
    assert round(lb.w13.weights / 1e9, 3) == 2.718
    assert round(lb.w2.weights / 1e9, 3) == 1.359
    assert round(lb.weights / 1e9, 3) == 4.077
    assert lb.act.weights == 0


def test_roofline_times_are_the_studys():
    w = layer_bytes(P, uniform_counts(P, 8)).weights
    assert round(roofline_ms(w, GB10_GBPS), 2) == 17.13  # the study's GB10 roofline
    assert round(roofline_ms(w, H200_GBPS), 3) == 0.916  # MISSION.md's H200 figure
    with pytest.raises(ValueError):
        roofline_ms(w, 0)


@pytest.mark.parametrize("mean, low, high", [(8, 0.55, 0.65), (32, 2.25, 2.45)])
def test_activation_share_matches_the_study(mean, low, high):
    # the study: activations (x in, out) are 0.6% of the weight bytes at mean 8, 2.3% at 32
    lb = layer_bytes(P, uniform_counts(P, mean))
    share = 100 * (lb.w13.act_in + lb.w2.act_out) / lb.weights
    assert low < share < high


def test_stage_bytes_at_mean_8():
    rows = 288 * 8
    lb = layer_bytes(P, uniform_counts(P, 8))
    assert lb.rows == rows and lb.active_experts == 288
    assert lb.w13.act_in == rows * 4096 * 9 // 16  # x NVFP4
    assert lb.w13.act_out == lb.act.act_in == rows * 4096 * 4  # h fp32 (rows, 2I)
    assert lb.h_round_trip == 2 * rows * 4096 * 4
    assert lb.act.act_out == lb.w2.act_in == rows * 2048 * 9 // 16  # a NVFP4
    assert lb.w2.act_out == rows * 4096 * 2  # out bf16
    assert lb.total == lb.w13.total + lb.act.total + lb.w2.total
    d = lb.as_dict()
    assert d["total"] == lb.total and d["w13"]["weights"] == lb.w13.weights


def test_active_counts_only_experts_with_rows():
    r = make_routing(tokens_for_mean(2, 288, 8), 288, 8, skew=1.5, seed=0)
    idle = int((r.counts == 0).sum())
    assert idle > 0
    full, active = layer_bytes(P, r.counts), layer_bytes(P, r.counts, active=True)
    assert full.weights - active.weights == idle * (nvfp4_bytes(4096, 4096) + nvfp4_bytes(4096, 2048))
    assert full.total - full.weights == active.total - active.weights  # activations unchanged
    assert active.active_experts == 288 - idle


@settings(deadline=None)
@given(hnp.arrays(np.int64, 6, elements=st.integers(0, 1000)))
def test_bytes_are_additive_and_linear_in_rows(counts):
    p = MoEProblem(experts=6, hidden=256, intermediate=128, top_k=2)
    lb = layer_bytes(p, counts)
    zero = layer_bytes(p, np.zeros(6, np.int64))
    per_row = (256 * 9 // 16) + 2 * (256 * 4) + 2 * (128 * 9 // 16) + 256 * 2
    assert lb.total - zero.total == int(counts.sum()) * per_row
    assert zero.total == zero.weights == 6 * (nvfp4_bytes(256, 256) + nvfp4_bytes(256, 128))


def test_bytes_table_rows():
    rows = bytes_table(P, uniform_counts(P, 8), gbps=GB10_GBPS)
    assert [r["stage"] for r in rows] == ["w13", "act", "w2", "layer"]
    layer = rows[-1]
    assert layer["total_GB"] == pytest.approx(sum(r["total_GB"] for r in rows[:3]))
    assert round(layer["weights_GB"], 3) == 4.077
    with pytest.raises(ValueError):
        layer_bytes(P, np.ones(5))
