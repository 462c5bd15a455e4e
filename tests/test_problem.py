import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab import nvfp4
from lab.problem import (
    W13_INPUT_SCALE,
    MoEProblem,
    expert_probabilities,
    make_routing,
    random_activations,
    random_weights,
    tokens_for_mean,
)

SMALL = MoEProblem(experts=6, hidden=128, intermediate=64, top_k=2)


# ---------------------------------------------------------------------------------------------
# the problem
# ---------------------------------------------------------------------------------------------


def test_default_problem_is_the_studys():
    p = MoEProblem().validate()
    assert p.w13_shape == (288, 4096, 4096) and p.w2_shape == (288, 4096, 2048)
    assert p.top_k == 8 and p.gate_up_ratio == 1.2308


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"experts": 0}, "experts"),
        ({"hidden": 4000}, "hidden"),  # not a multiple of 64
        ({"intermediate": -64}, "intermediate"),
        ({"top_k": 9, "experts": 8}, "top_k"),
        ({"gate_up_ratio": 0.0}, "gate_up_ratio"),
        ({"gate_up_ratio": float("nan")}, "gate_up_ratio"),
        ({"experts": 2.5}, "experts"),
    ],
)
def test_validate_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MoEProblem(**kwargs).validate()


def test_validate_calls_a_field_what_the_caller_names_it():
    flags = {"experts": "--experts", "hidden": "--hidden", "top_k": "--top-k", "gate_up_ratio": "--ratio"}
    with pytest.raises(ValueError, match="^--hidden must be a multiple of 64, got 100$"):
        MoEProblem(hidden=100).validate(flags)
    with pytest.raises(ValueError, match="^--top-k=9 must be <= --experts=8$"):
        MoEProblem(experts=8, top_k=9).validate(flags)
    with pytest.raises(ValueError, match="^--ratio must be a finite positive number"):
        MoEProblem(gate_up_ratio=0.0).validate(flags)
    with pytest.raises(ValueError, match="^top_k=9 must be <= experts=8$"):  # the API's own words
        MoEProblem(experts=8, top_k=9).validate()


def test_tokens_for_mean_matches_the_studys_points():
    # mean tokens per expert 2, 4, 8, 32 with 288 experts, top 8
    assert [tokens_for_mean(m, 288, 8) for m in (2, 4, 8, 32)] == [72, 144, 288, 1152]
    assert tokens_for_mean(0.001, 288, 8) == 1


# ---------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------


def check_routing(r, tokens, experts, top_k):
    T, E, k = tokens, experts, top_k
    assert r.offsets.dtype == np.int32 and r.counts.dtype == np.int32
    assert r.row_token.dtype == np.int32 and r.token_experts.dtype == np.int32
    assert r.offsets.shape == (E + 1,) and r.counts.shape == (E,) and r.token_experts.shape == (T, k)
    assert r.offsets[0] == 0 and r.offsets[E] == T * k == r.rows
    np.testing.assert_array_equal(np.diff(r.offsets), r.counts)
    np.testing.assert_array_equal(np.bincount(r.token_experts.ravel(), minlength=E), r.counts)
    # no token picks an expert twice
    srt = np.sort(r.token_experts, axis=1)
    assert (np.diff(srt, axis=1) > 0).all()
    # the grouped rows are exactly the (token, expert) pairs, each once, token-sorted per expert
    row_expert = np.repeat(np.arange(E), r.counts)
    pairs = set(zip(r.row_token.tolist(), row_expert.tolist()))
    want = {(t, int(e)) for t in range(T) for e in r.token_experts[t]}
    assert len(pairs) == T * k and pairs == want
    for e in range(E):
        seg = r.row_token[r.offsets[e] : r.offsets[e + 1]]
        assert (np.diff(seg) > 0).all()
    # token_rows inverts the grouping: a bijection between (token, slot) and grouped rows
    tr = r.token_rows
    assert sorted(tr.ravel().tolist()) == list(range(T * k))
    np.testing.assert_array_equal(r.row_token[tr], np.repeat(np.arange(T), k).reshape(T, k))
    np.testing.assert_array_equal(row_expert[tr], r.token_experts)


@settings(deadline=None)
@given(
    st.integers(1, 200),
    st.integers(1, 40),
    st.integers(1, 8),
    st.sampled_from([0.0, 0.5, 1.2, 3.0]),
    st.integers(0, 2**31 - 1),
)
def test_routing_invariants(tokens, experts, top_k, skew, seed):
    top_k = min(top_k, experts)
    r = make_routing(tokens, experts, top_k, skew=skew, seed=seed)
    check_routing(r, tokens, experts, top_k)


def test_routing_edge_cases():
    check_routing(make_routing(1, 288, 8), 1, 288, 8)  # one token
    r = make_routing(5, 4, 4)  # every token takes every expert
    check_routing(r, 5, 4, 4)
    assert r.counts.tolist() == [5, 5, 5, 5]
    r = make_routing(7, 1, 1)  # all tokens to one expert
    assert r.offsets.tolist() == [0, 7] and r.row_token.tolist() == list(range(7))
    with pytest.raises(ValueError):
        make_routing(4, 3, 4)
    with pytest.raises(ValueError):
        make_routing(0, 3, 1)
    with pytest.raises(ValueError, match="skew"):
        make_routing(4, 3, 1, skew=-1)


def test_routing_is_seeded():
    a, b, c = make_routing(50, 16, 4, 1.0, 3), make_routing(50, 16, 4, 1.0, 3), make_routing(50, 16, 4, 1.0, 4)
    np.testing.assert_array_equal(a.token_experts, b.token_experts)
    assert not np.array_equal(a.token_experts, c.token_experts)


@pytest.mark.parametrize("skew", [0.0, 1.0, 2.0])
def test_first_choice_frequencies_follow_the_probabilities(skew):
    # with top_k = 1 each token's expert is one draw from p; 40k draws pin p to ~1e-2 absolute
    E, T = 12, 40_000
    p = expert_probabilities(E, skew, seed=5)
    r = make_routing(T, E, 1, skew=skew, seed=5)
    freq = r.counts / T
    tol = 4.5 * np.sqrt(p * (1 - p) / T) + 1e-4  # 4.5 binomial sigmas
    assert (np.abs(freq - p) <= tol).all(), (freq, p)


def test_skew_makes_hot_experts():
    uniform = make_routing(2000, 64, 8, skew=0.0, seed=1).counts
    skewed = make_routing(2000, 64, 8, skew=1.5, seed=1).counts
    assert skewed.max() > 3 * uniform.max()
    assert (skewed == 0).sum() > (uniform == 0).sum() or skewed.min() < uniform.min()
    # the hot expert is not simply expert 0: ranks are a seeded permutation
    hot = [int(np.argmax(expert_probabilities(64, 1.5, s))) for s in range(5)]
    assert len(set(hot)) > 1


def python_calls(fn):
    """(fn(), number of Python and C function calls made while it ran): work that a loop over
    tokens or rows would multiply, where wall-clock time depends on the machine's load."""
    calls = [0]

    def count(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1

    sys.setprofile(count)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, calls[0]


def peak_bytes(fn):
    """(fn(), peak bytes traced while it ran; NumPy's buffers included)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_routing_is_vectorised():
    """Work per chunk of 8192 tokens, not per token, and the score matrices of one chunk at a
    time: three chunks' tokens take a few dozen calls more than one token, in the memory of a
    few (chunk, E) float64 matrices."""
    from lab.problem import _ROUTING_CHUNK

    make_routing(4, 288, 8, seed=1)  # first-call imports out of the count
    tokens = 3 * _ROUTING_CHUNK
    _, one = python_calls(lambda: make_routing(1, 288, 8, skew=1.0, seed=0))
    r, many = python_calls(lambda: make_routing(tokens, 288, 8, skew=1.0, seed=0))
    assert r.offsets[-1] == tokens * 8
    assert many - one <= 3 * 30, (one, many)
    _, peak = peak_bytes(lambda: make_routing(tokens, 288, 8, skew=1.0, seed=0))
    matrix = _ROUTING_CHUNK * 288 * 8
    assert peak < 5 * matrix, f"{peak / matrix:.1f} (chunk, E) float64 matrices"


# ---------------------------------------------------------------------------------------------
# weights and activations
# ---------------------------------------------------------------------------------------------


def test_random_weights_shapes_and_dtypes():
    w = random_weights(SMALL, seed=2)
    E, H, I = 6, 128, 64
    assert w.w13_packed.shape == (E, 2 * I, H // 2) and w.w13_scales.shape == (E, 2 * I, H // 16)
    assert w.w2_packed.shape == (E, H, I // 2) and w.w2_scales.shape == (E, H, I // 16)
    for a in (w.w13_packed, w.w13_scales, w.w2_packed, w.w2_scales):
        assert a.dtype == np.uint8 and a.flags.c_contiguous
    for a in (w.gate_global, w.up_global, w.w2_global):
        assert a.dtype == np.float32 and a.shape == (E,) and (a > 0).all()
    assert (w.experts, w.hidden, w.intermediate) == (E, H, I)


def test_random_weights_cover_all_codes():
    w = random_weights(SMALL, seed=3)
    for packed in (w.w13_packed, w.w2_packed):
        assert set(np.unique(nvfp4.unpack_nibbles(packed)).tolist()) == set(range(16))
    for sc in (w.w13_scales, w.w2_scales):
        codes = np.unique(sc)
        assert codes.min() >= 0x01 and codes.max() <= 0x7E  # finite, positive, never zero
        assert len(codes) == 126  # every finite positive e4m3 code occurs
        v = nvfp4.decode_e4m3(sc)
        assert v.min() < 2.0**-6 and v.max() == 448  # subnormals up to the largest code
        band = ((v >= 8) & (v <= 120)).mean()
        assert 0.5 < band < 0.7  # half in the band, plus the wide half's share of it


def test_random_weights_globals_and_ratio():
    p = MoEProblem(experts=64, hidden=64, intermediate=64, top_k=2, gate_up_ratio=1.2308)
    w = random_weights(p, seed=4)
    ratio = w.gate_global.astype(np.float64) / w.up_global
    assert np.all(np.abs(ratio / 1.2308 - 1) < 0.006)
    assert 0.0005 < ratio.std() / ratio.mean()  # gate and up globals really differ per expert
    assert 2e-5 < np.median(w.gate_global) < 1e-4 and len(np.unique(w.gate_global)) == 64
    assert abs(w.problem().gate_up_ratio / 1.2308 - 1) < 0.003


def test_random_weights_are_seeded():
    a, b, c = random_weights(SMALL, 1), random_weights(SMALL, 1), random_weights(SMALL, 2)
    np.testing.assert_array_equal(a.w13_packed, b.w13_packed)
    np.testing.assert_array_equal(a.w2_scales, b.w2_scales)
    np.testing.assert_array_equal(a.up_global, b.up_global)
    assert not np.array_equal(a.w13_packed, c.w13_packed)


def test_random_weights_work_per_expert_and_memory_of_the_output():
    """Codes are drawn whole arrays at a time: the calls grow with the experts, not with H or
    I, and memory is the output plus one expert's temporaries (the full problem is 4.08 GB)."""
    random_weights(MoEProblem(experts=1, hidden=64, intermediate=64, top_k=1))  # first-call imports
    tiny, full = MoEProblem(experts=4, hidden=64, intermediate=64, top_k=1), MoEProblem(experts=4, top_k=1)
    _, calls_tiny = python_calls(lambda: random_weights(tiny))
    _, calls_full = python_calls(lambda: random_weights(full))
    _, calls_double = python_calls(lambda: random_weights(MoEProblem(experts=8, top_k=1)))
    assert calls_full == calls_tiny and calls_double - calls_full <= 4 * 60, (calls_tiny, calls_full, calls_double)
    w, peak = peak_bytes(lambda: random_weights(full))
    assert w.nbytes() == 4 * 4096 * 6144 * 9 // 16 + 3 * 4 * 4
    one_expert = 4096 * 6144 * 9 // 16
    assert peak - w.nbytes() < one_expert, f"{(peak - w.nbytes()) / 2**20:.1f} MiB beyond the output"
    w8, peak8 = peak_bytes(lambda: random_weights(MoEProblem(experts=8, top_k=1)))
    assert abs((peak8 - w8.nbytes()) - (peak - w.nbytes())) < 2**20  # temporaries do not grow with experts


def test_random_activations_fit_the_static_input_scale():
    x = random_activations(512, 1024, seed=0)
    assert x.dtype == np.float32 and x.shape == (512, 1024)
    assert 0.9 < np.std(x[np.abs(x) < 6]) < 1.1 and np.abs(x).max() > 8  # bulk N(0,1) + outliers
    block_amax = np.abs(x.reshape(512, 64, 16)).max(axis=-1)
    assert (block_amax / (6 * W13_INPUT_SCALE) <= 448).all()  # no block saturates
    np.testing.assert_array_equal(x, random_activations(512, 1024, seed=0))


def test_heavy_tailed_weights_are_seeded_heavy_tailed_nvfp4():
    from lab.problem import heavy_tailed_weights

    p = MoEProblem(2, 128, 64, 2)
    a, b = heavy_tailed_weights(p, df=4.0, seed=1), heavy_tailed_weights(p, df=4.0, seed=1)
    assert a.w13_packed.shape == (2, 128, 64) and a.w13_scales.shape == (2, 128, 8)
    assert a.w2_packed.shape == (2, 128, 32) and a.w2_scales.shape == (2, 128, 4)
    assert np.array_equal(a.w13_packed, b.w13_packed) and np.array_equal(a.w2_scales, b.w2_scales)
    assert not np.array_equal(a.w13_packed, heavy_tailed_weights(p, df=4.0, seed=2).w13_packed)
    # the dequantized weights keep the t draw's tails: excess kurtosis well above the uniform
    # codes' (random_weights: negative within a block) and above a normal's 0
    w = nvfp4.dequantize_blocks(a.w2_packed[0], a.w2_scales[0]).ravel()
    kurt = np.mean((w - w.mean()) ** 4) / np.var(w) ** 2 - 3
    assert kurt > 1.0, kurt
    assert np.all(np.isfinite(a.gate_global)) and np.all(a.gate_global > 0)
    with pytest.raises(ValueError, match="df: expected degrees of freedom > 0"):
        heavy_tailed_weights(p, df=0.0)
