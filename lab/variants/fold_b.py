"""fold-b: option (b) for comparison with fused-swiglu's option (a). The gate/up global ratio
r = gate_global / up_global of each expert is folded into the gate half's e4m3 block scales at
load (lab/scale_fold.fold_scales: re-rounded, saturating at 448), so w13 runs with one alpha per
expert, alpha = float32(w13_input_scale * up_global), and the SwiGLU epilogue applies no
per-half global. Same kernels and launches as fused-swiglu; its output is approximate (the
re-rounded scales), so its row shows its error against the float64 reference.
"""

from __future__ import annotations

import numpy as np

from lab import scale_fold
from lab.kernels import grouped_gemm as gg

from .fused_swiglu import FusedSwiglu

name = "fold-b"
expect = "approx"


def folded_w13(weights) -> tuple[gg.PreparedWeights, object, object]:
    """(w13 with folded gate scales, paired for the epilogue; alpha (E,); ones (E,)), cached."""
    import cupy as cp

    key = "w13_fold_b"
    if key not in weights.cache:
        h = weights.host
        i = weights.problem.intermediate
        ratio = (h.gate_global.astype(np.float32) / h.up_global.astype(np.float32))[:, None, None]
        scales = h.w13_scales.copy()
        scales[:, :i], _ = scale_fold.fold_scales(h.w13_scales[:, :i], ratio)
        prep = gg.prepare_weights(h.w13_packed, scales, xp=cp, pair_gate_up=True)
        alpha = (np.float32(weights.w13_input_scale) * h.up_global.astype(np.float32)).astype(np.float32)
        ones = cp.ones(weights.problem.experts, dtype=cp.float32)
        weights.cache[key] = (prep, cp.asarray(alpha), ones)
    return weights.cache[key]


class FoldB(FusedSwiglu):
    name = name
    expect = expect

    def weights(self, runner, layer):
        prep, alpha, ones = folded_w13(layer.weights)
        return prep, alpha, ones, ones
