"""fold-b: option (b) for comparison with fused-swiglu's option (a). The gate/up global ratio of
each expert is folded at load into the block scales of the half with the smaller global, which
absorbs g_small / g_large <= 1 (lab/scale_fold.fold_w13_scales, into="smaller": re-rounded,
never saturating; an engine's way), so w13 runs with one alpha per expert,
alpha = float32(w13_input_scale * g_large), and the SwiGLU epilogue applies no per-half global.
Same kernels and launches as fused-swiglu; its output is approximate (the re-rounded scales),
so its row shows its error against the float64 reference.
"""

from __future__ import annotations

import numpy as np

from lab import scale_fold
from lab.kernels import gemm_weights as gw

from .fused_swiglu import FusedSwiglu

name = "fold-b"
expect = "approx"
INTO = "smaller"  # the fold direction: see lab/scale_fold.py


def folded_w13(weights) -> tuple[gw.PreparedWeights, object, object]:
    """(w13 with the smaller-global half's scales folded, paired for the epilogue; alpha (E,);
    ones (E,)), cached."""
    import cupy as cp

    key = "w13_fold_b"
    if key not in weights.cache:
        h = weights.host
        scales, one_global, _ = scale_fold.fold_w13_scales(h, INTO)
        prep = gw.prepare_weights(h.w13_packed, scales, xp=cp, pair_gate_up=True)
        alpha = (np.float32(weights.w13_input_scale) * one_global).astype(np.float32)
        ones = cp.ones(weights.problem.experts, dtype=cp.float32)
        weights.cache[key] = (prep, cp.asarray(alpha), ones)
    return weights.cache[key]


class FoldB(FusedSwiglu):
    name = name
    expect = expect

    def weights(self, runner, layer):
        prep, alpha, ones = folded_w13(layer.weights)
        return prep, alpha, ones, ones
