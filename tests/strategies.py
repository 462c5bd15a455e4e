"""Hypothesis strategies that draw the data itself (not a seed), aimed at the format's edges, so
that a failure shrinks to a small input: values on and one ulp beside rounding midpoints, zero
blocks and -0.0, block scales that round to zero, to e4m3 subnormals or saturate at 448, and
ragged expert counts with empty and hot experts."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from oracles import GRID, e4m3_from_bits

f32 = np.float32
MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
ON_GRID_OR_MIDPOINT = np.concatenate([GRID, MIDPOINTS])  # element magnitudes / (s * g)

KINDS = ("midpoints", "grid", "spread", "zero", "tiny", "saturating")

globals_f32 = st.floats(1e-7, 1e3).map(f32)


@st.composite
def nvfp4_blocks(draw, max_rows=4, max_blocks=4, static_global=None):
    """(x (rows, 16 * blocks) float32, global_scale float32 or None), each block one of KINDS.

    midpoints: |x| = m * s * g for m on an e2m1 value or rounding midpoint (or one ulp beside
      it), with one element at 6 * s * g so that the block scale is exactly s;
    grid: the same on grid values, with elements at -0.1 * s * g that round to -0 (nibble 8);
    spread: [-1, 1] * 2^e * g for e in -12..12;
    zero: +0.0 and -0.0 only;
    tiny: amax 6 * g * 2^e for e in -12..-5: scales that round to 0 or to e4m3 subnormals;
    saturating: amax past 448 * 6 * g.
    ``static_global`` True draws a global, False passes None (computed from amax), None draws
    which."""
    rows = draw(st.integers(1, max_rows))
    blocks = draw(st.integers(1, max_blocks))
    shape = (rows, blocks)
    use_static = draw(st.booleans()) if static_global is None else static_global
    g = draw(globals_f32) if use_static else None
    gg = g if g is not None else f32(1.0)  # blocks are built around the global they expect

    kind = draw(hnp.arrays(np.int8, shape, elements=st.integers(0, len(KINDS) - 1)))
    code = draw(hnp.arrays(np.uint8, shape, elements=st.integers(1, 0x7E)))
    pick = draw(hnp.arrays(np.int8, shape + (16,), elements=st.integers(0, len(ON_GRID_OR_MIDPOINT) - 1)))
    neg = draw(hnp.arrays(np.bool_, shape + (16,)))
    ulps = draw(hnp.arrays(np.int8, shape + (16,), elements=st.integers(-1, 1)))
    unit = draw(hnp.arrays(np.float32, shape + (16,), elements=st.floats(-1, 1, width=32)))
    exp = draw(hnp.arrays(np.int8, shape, elements=st.integers(-12, 12)))

    denom = (e4m3_from_bits(code).astype(f32) * gg).astype(f32)[..., None]
    on = (ON_GRID_OR_MIDPOINT[pick] * denom).astype(f32)
    on = np.where(ulps == 0, on, np.nextafter(on, np.where(ulps > 0, f32(np.inf), f32(-np.inf)))).astype(f32)
    on[..., 0] = (f32(6) * denom[..., 0]).astype(f32)
    grid = (GRID[pick % len(GRID)] * denom).astype(f32)
    grid = np.where(ulps < 0, (f32(-0.1) * denom).astype(f32), grid)
    grid[..., 0] = (f32(6) * denom[..., 0]).astype(f32)
    spread = (unit * np.ldexp(f32(1), exp)[..., None] * gg).astype(f32)
    tiny_amax = (f32(6) * gg * np.ldexp(f32(1), -5 - np.abs(exp) % 8)).astype(f32)[..., None]
    tiny = (unit * tiny_amax).astype(f32)
    tiny[..., 0] = tiny_amax[..., 0]
    sat = (unit * f32(448 * 6) * gg * np.ldexp(f32(1), 1 + np.abs(exp) % 8)[..., None]).astype(f32)
    sat[..., 0] = np.abs(sat[..., 0]) + f32(449 * 6) * gg
    zero = np.where(neg, f32(-0.0), f32(0.0))
    x = np.select([kind[..., None] == k for k in range(len(KINDS))],
                  [np.where(neg, -on, on), np.where(neg, -grid, grid), spread, zero, tiny, sat])
    return x.astype(f32).reshape(rows, blocks * 16), g


@st.composite
def ragged_counts(draw, min_experts=1, max_experts=12, hot=(120, 200)):
    """Tokens per expert: empty experts, small counts and, at times, a hot expert past one tile."""
    n = draw(st.integers(min_experts, max_experts))
    counts = draw(st.lists(st.one_of(st.just(0), st.integers(1, 20), st.integers(*hot)), min_size=n, max_size=n))
    return np.array(counts, np.int64)


@st.composite
def routings(draw, experts: int, top_k: int, max_tokens: int = 150):
    """A Routing drawn token by token: each token's top_k distinct experts, where a drawn hot
    expert may take a drawn share of the tokens (past one 64-token tile when the tokens are
    many), from a single token up; experts nobody picks stay empty."""
    from lab.problem import Routing

    t = draw(st.integers(1, max_tokens), label="tokens")
    hot = draw(st.one_of(st.none(), st.integers(0, experts - 1)), label="hot")
    token_experts = np.empty((t, top_k), np.int32)
    for i in range(t):
        picks = draw(st.lists(st.integers(0, experts - 1), min_size=top_k, max_size=top_k, unique=True))
        if hot is not None and hot not in picks and draw(st.booleans()):
            picks[-1] = hot
        token_experts[i] = picks
    token = np.repeat(np.arange(t), top_k)
    order = np.lexsort((token, token_experts.reshape(-1)))  # by expert, then token
    counts = np.bincount(token_experts.reshape(-1), minlength=experts).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return Routing(offsets, counts, (order // top_k).astype(np.int32), token_experts, t, top_k)
