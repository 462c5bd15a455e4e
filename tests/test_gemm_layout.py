"""Weight layouts two GEMMs of one launch can share (gemm_weights.shared_layout), and every
variant on a shape whose w13 and w2 prefer different layouts (H = 576, I = 192)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab import checks
from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.problem import MoEProblem, make_routing, random_activations, random_weights
from lab.variants import NAMES, make

ODD = MoEProblem(experts=8, hidden=576, intermediate=192, top_k=2)


def test_the_odd_shape_needs_a_shared_layout():
    p = ODD
    w13, w2 = gw.default_layout(2 * p.intermediate, p.hidden), gw.default_layout(p.hidden, p.intermediate)
    assert w13 == (128, 64) and w2 == (64, 64)  # what made the fused layer refuse this shape
    assert gw.shared_layout([(2 * p.intermediate, p.hidden), (p.hidden, p.intermediate)]) == (64, 64)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 96), st.integers(1, 96)), min_size=1, max_size=3))
def test_shared_layout_divides_every_shape_and_is_the_widest(units):
    shapes = [(64 * a, 64 * b) for a, b in units]
    block_rows, k_step = gw.shared_layout(shapes)
    assert all(n % block_rows == 0 and k % k_step == 0 for n, k in shapes)
    wider = [b for b in (256, 128) if b > block_rows]
    assert not any(all(n % b == 0 for n, _ in shapes) for b in wider)
    if all(k % 128 == 0 for _, k in shapes):
        assert k_step == 128
    for n, k in shapes:  # the tile the heuristic picks in that layout can run the shape
        gc.heuristic(n, k, np.full(4, 9), (block_rows, k_step)).validate(n, k)


def test_shared_layout_refuses_shapes_no_layout_serves():
    with pytest.raises(ValueError, match="multiples of 64"):
        gw.shared_layout([(96, 128)])
    with pytest.raises(ValueError, match="multiples of 64"):
        gw.shared_layout([(128, 64), (128, 96)])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, skew", [(24, 0.0), (150, 1.0)])
def test_every_variant_runs_the_odd_shape_and_matching_ones_equal_separate(tokens, skew):
    from lab.layer import load_layer, upload_weights
    from lab.runner import Runner

    seed = int(np.random.default_rng().integers(2**31))
    weights = random_weights(ODD, seed=seed)
    routing = make_routing(tokens, ODD.experts, ODD.top_k, skew=skew, seed=seed)
    runner = Runner()
    layer = load_layer(runner, upload_weights(weights), routing, random_activations(tokens, ODD.hidden, seed=seed))
    sep = make("separate")
    runner.prepare(sep, layer)
    runner.checked_run(sep, layer)
    want = layer.out_bf16.get()
    res = checks.check_separate(runner, layer, checks.sample_experts(routing.counts, ODD.experts))
    assert res["ok"], f"seed {seed}: {[res[s]['detail'] for s in ('h', 'a_q', 'out') if not res[s]['ok']]}"
    for name in NAMES:
        v = make(name)
        runner.prepare(v, layer)  # no variant refuses the shape
        if v.expect == "match":
            runner.checked_run(v, layer)
            ok, msg = checks.compare_bits(layer.out_bf16.get(), want)
            assert ok, f"seed {seed}, {name}: {msg}"
