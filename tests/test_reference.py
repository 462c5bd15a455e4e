"""The reference against a direct dense float64 computation written from the formats' bits."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab import checks, nvfp4, reference
from lab.problem import MoEProblem, make_routing, random_activations, random_weights
import oracles
from oracles import decode_blocks


def dense_grouped_gemm(x_packed, x_scales, offsets, w_packed, w_scales, alpha):
    """Row by row: out[r] = alpha[e(r)] * sum_k x[r, k] * w[e(r), n, k], with e(r) from offsets."""
    rows = x_packed.shape[0]
    expert_of_row = np.searchsorted(offsets, np.arange(rows), side="right") - 1
    x = decode_blocks(x_packed, x_scales)  # (rows, K)
    w = decode_blocks(w_packed, w_scales)  # (E, N, K)
    return np.asarray(alpha, np.float64)[expert_of_row, None] * np.einsum("rk,rnk->rn", x, w[expert_of_row])


def dense_layer(x, routing, w):
    """The layer in one pass, each stage on the previous dense stage's output; quantized by the
    oracle's recipe (oracles.quantize), not by lab.nvfp4."""
    E, I = w.experts, w.intermediate
    e_of_row = np.repeat(np.arange(E), routing.counts)
    x_q = oracles.quantize(x[routing.row_token], w.w13_input_scale)
    h = dense_grouped_gemm(*x_q, routing.offsets, w.w13_packed, w.w13_scales,
                           np.full(E, float(np.float32(w.w13_input_scale))))
    g = h[:, :I] * w.gate_global.astype(np.float64)[e_of_row, None]
    u = h[:, I:] * w.up_global.astype(np.float64)[e_of_row, None]
    a = g / (1 + np.exp(-g)) * u
    return x_q, h, a


@st.composite
def small_layers(draw):
    E = draw(st.integers(1, 5))
    top_k = draw(st.integers(1, E))
    p = MoEProblem(experts=E, hidden=draw(st.sampled_from([64, 128])), intermediate=draw(st.sampled_from([64, 128])),
                   top_k=top_k, gate_up_ratio=draw(st.floats(0.5, 2.0)))
    seed = draw(st.integers(0, 2**31 - 1))
    T = draw(st.integers(1, 12))
    return p, random_weights(p, seed), make_routing(T, E, top_k, skew=draw(st.sampled_from([0.0, 2.0])), seed=seed), \
        random_activations(T, p.hidden, seed)


@settings(deadline=None, max_examples=25)
@given(small_layers())
def test_layer_stages_match_dense_float64(case):
    p, w, routing, x = case
    ref = reference.layer(x, routing, w)
    x_q, h, a = dense_layer(x, routing, w)
    np.testing.assert_array_equal(ref["x_q"].scales, x_q[1])
    np.testing.assert_array_equal(ref["x_q"].packed, x_q[0])
    np.testing.assert_allclose(ref["h"], h, rtol=1e-12, atol=1e-12 * np.abs(h).max())
    np.testing.assert_allclose(ref["a"], a, rtol=1e-11, atol=1e-12 * np.abs(a).max())
    # w2 on the reference's own quantized a (quantization is discontinuous: stage-wise check)
    a_q = ref["a_q"]
    want_packed, want_scales = oracles.quantize(ref["a"], w.w2_input_scale)
    np.testing.assert_array_equal(a_q.scales, want_scales)
    np.testing.assert_array_equal(a_q.packed, want_packed)
    alpha = np.float32(a_q.global_scale) * w.w2_global
    out = dense_grouped_gemm(a_q.packed, a_q.scales, routing.offsets, w.w2_packed, w.w2_scales, alpha)
    np.testing.assert_allclose(ref["out"], out, rtol=1e-12, atol=1e-12 * np.abs(out).max())
    assert ref["out"].shape == (routing.rows, p.hidden) and np.isfinite(ref["out"]).all()
    assert ref["out_bf16"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(ref["out_bf16"], ref["out"].astype(ml_dtypes.bfloat16))


def test_layer_on_default_width_is_not_degenerate():
    """At the real H and I the synthetic layer produces O(1) signals: no stage is flat or zero."""
    p = MoEProblem(experts=3, top_k=2)
    w = random_weights(p, 0)
    r = make_routing(12, 3, 2, seed=0)
    ref = reference.layer(random_activations(12, p.hidden, 0), r, w)
    g = ref["h"][:, : p.intermediate] * w.gate_global[0]
    assert 0.1 < np.std(g) < 10  # SwiGLU's input spans its non-linear range
    assert 0.01 < np.std(ref["a"]) < 10 and np.abs(ref["a"]).max() < 2688 * w.w2_input_scale
    assert 0.01 < np.std(ref["out"]) < 10
    assert checks.rel_error(nvfp4.dequantize(ref["a_q"]), ref["a"]) < 0.15


def test_grouped_gemm_contract_with_empty_experts():
    rng = np.random.default_rng(0)
    E, N, K, rows = 4, 32, 64, 7
    offsets = np.array([0, 3, 3, 7, 7])  # experts 1 and 3 get no rows
    xp = rng.integers(0, 256, (rows, K // 2), dtype=np.uint8)
    xs = rng.integers(1, 0x7F, (rows, K // 16), dtype=np.uint8)
    wp = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    ws = rng.integers(1, 0x7F, (E, N, K // 16), dtype=np.uint8)
    alpha = rng.uniform(0.5, 2, E).astype(np.float32)
    out = reference.grouped_gemm(xp, xs, offsets, wp, ws, alpha)
    np.testing.assert_allclose(out, dense_grouped_gemm(xp, xs, offsets, wp, ws, alpha), rtol=1e-12)
    # a direct spot check of one entry: row 4 belongs to expert 2
    x4 = decode_blocks(xp[4], xs[4])
    assert out[4, 5] == pytest.approx(float(alpha[2]) * (x4 @ decode_blocks(wp[2, 5], ws[2, 5])), rel=1e-12)


def test_experts_subset_leaves_other_rows_nan():
    p = MoEProblem(experts=4, hidden=64, intermediate=64, top_k=2)
    w = random_weights(p, 1)
    r = make_routing(10, 4, 2, seed=1)
    x = random_activations(10, 64, 1)
    full = reference.layer(x, r, w)
    part = reference.layer(x, r, w, experts=[1, 3])
    sel = np.zeros(r.rows, bool)
    for e in (1, 3):
        sel[r.offsets[e] : r.offsets[e + 1]] = True
    assert sel.any() and (~sel).any()
    for k in ("h", "a", "out"):
        np.testing.assert_array_equal(part[k][sel], full[k][sel])
        assert np.isnan(part[k][~sel]).all()
    assert (part["a_q"].packed[~sel] == 0).all() and (part["a_q"].scales[~sel] == 0).all()
    with pytest.raises(ValueError, match="experts"):
        reference.w13(full["x_q"], r.offsets, w, experts=[4])


def test_weight_globals_enter_only_through_swiglu_and_w2():
    """Option (a): h ignores the weight globals; gate and up globals scale their own halves."""
    p = MoEProblem(experts=2, hidden=64, intermediate=64, top_k=1)
    w = random_weights(p, 2)
    r = make_routing(6, 2, 1, seed=2)
    x = random_activations(6, 64, 2)
    base = reference.layer(x, r, w)
    w.gate_global = w.gate_global * 2
    changed = reference.layer(x, r, w)
    np.testing.assert_array_equal(base["h"], changed["h"])
    assert not np.allclose(base["a"], changed["a"])
    # swapping which global goes with which half changes the answer when they differ
    swapped = reference.swiglu(base["h"], r.offsets, w.up_global, w.gate_global)
    assert not np.allclose(swapped, reference.swiglu(base["h"], r.offsets, w.gate_global, w.up_global))


def test_swiglu_is_stable_for_large_inputs():
    h = np.array([[-800.0, 0.0, 800.0, 2.0, 1.0, 1.0, 1.0, -3.0]])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        a = reference.swiglu(h, [0, 1], np.ones(1), np.ones(1))
    silu = lambda g: g / (1 + np.exp(-g))  # noqa: E731
    np.testing.assert_allclose(a[0], [0.0, 0.0, 800.0, silu(2.0) * -3.0], rtol=1e-15, atol=1e-300)


def test_layer_input_checks():
    p = MoEProblem(experts=2, hidden=64, intermediate=64, top_k=1)
    w = random_weights(p)
    r = make_routing(4, 2, 1)
    with pytest.raises(ValueError, match="x must be"):
        reference.layer(np.zeros((5, 64)), r, w)
    with pytest.raises(ValueError, match="offsets"):
        reference.swiglu(np.zeros((4, 128)), [0, 2, 3], w.gate_global, w.up_global)


def test_w4a16_contract_on_decoded_activations_equals_the_nvfp4_one():
    """reference.grouped_gemm_w4a16 on the float64 decode of NVFP4 activations is
    reference.grouped_gemm on the codes; experts not asked for stay NaN; bad shapes raise."""
    rng = np.random.default_rng(3)
    e, n, k = 3, 16, 64
    counts = np.array([2, 0, 5])
    offsets = np.r_[0, np.cumsum(counts)]
    wp = rng.integers(0, 256, (e, n, k // 2), np.uint8)
    ws = rng.integers(1, 127, (e, n, k // 16)).astype(np.uint8)
    xp = rng.integers(0, 256, (7, k // 2), np.uint8)
    xs = rng.integers(1, 127, (7, k // 16)).astype(np.uint8)
    alpha = rng.uniform(0.5, 2, e)
    xf = nvfp4.dequantize_blocks(xp, xs)
    got = reference.grouped_gemm_w4a16(xf, offsets, wp, ws, alpha)
    np.testing.assert_array_equal(got, reference.grouped_gemm(xp, xs, offsets, wp, ws, alpha))
    assert np.isnan(reference.grouped_gemm_w4a16(xf, offsets, wp, ws, alpha, experts=[0])[2:]).all()
    with pytest.raises(ValueError, match="one K"):
        reference.grouped_gemm_w4a16(xf[:, :32], offsets, wp, ws, alpha)
