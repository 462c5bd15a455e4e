"""Bytes the MoE layer must move and the flops it must do, per stage, and the roofline they imply.

    stage   reads                                   writes
    w13     w13 weights (packed + scales), x NVFP4   h fp32 (rows, 2I)
    act     h fp32                                  a NVFP4 (rows, I)
    w2      w2 weights (packed + scales), a NVFP4    out bf16 (rows, H)

An NVFP4 matrix of (n, K) is n*K/2 code bytes + n*K/16 scale bytes; per-tensor globals and
routing metadata (a few KB) are left out. ``active=True`` counts weights only for experts
with at least one row, as a grouped GEMM reads nothing of an expert with no rows. At the
default shape, w13 is 2.718 GB and w2 1.359 GB (4.077 GB, decimal): the study's table.

Useful flops count real rows only (no padding to a tile): 2 * rows * H * 2I for w13 and
2 * rows * I * H for w2 (SwiGLU's few flops per element are left out). The roofline of a run
is the larger of its bytes over the read bandwidth and its flops over the dense tensor peak,
both measured in the same run (`binding`); the one that gives the larger time binds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .nvfp4 import BLOCK
from .problem import MoEProblem

# Read bandwidths in GB/s (decimal). H200: measured read bandwidth (MISSION.md); GB10: the
# study's platform, whose roofline for the default layer was 17.13 ms.
H200_GBPS = 4450.0
GB10_GBPS = 238.0

FP32_BYTES = 4
BF16_BYTES = 2


def nvfp4_bytes(n: int, k: int) -> int:
    """Codes plus e4m3 block scales of an (n, k) NVFP4 matrix."""
    return n * k // 2 + n * k // BLOCK


@dataclass(frozen=True)
class StageBytes:
    """Bytes one stage moves: weights read, activations read and written."""

    weights: int
    act_in: int
    act_out: int

    @property
    def activations(self) -> int:
        return self.act_in + self.act_out

    @property
    def total(self) -> int:
        return self.weights + self.act_in + self.act_out


@dataclass(frozen=True)
class LayerBytes:
    w13: StageBytes
    act: StageBytes
    w2: StageBytes
    rows: int
    active_experts: int

    @property
    def stages(self) -> dict[str, StageBytes]:
        return {"w13": self.w13, "act": self.act, "w2": self.w2}

    @property
    def weights(self) -> int:
        return self.w13.weights + self.w2.weights

    @property
    def h_round_trip(self) -> int:
        """h written by w13 and read back by the activation stage."""
        return self.w13.act_out + self.act.act_in

    @property
    def total(self) -> int:
        return sum(s.total for s in self.stages.values())

    def as_dict(self) -> dict:
        d = {name: {"weights": s.weights, "act_in": s.act_in, "act_out": s.act_out, "total": s.total}
             for name, s in self.stages.items()}
        d.update(rows=self.rows, active_experts=self.active_experts, weights=self.weights,
                 h_round_trip=self.h_round_trip, total=self.total)
        return d


def layer_bytes(problem: MoEProblem, counts, active: bool = False) -> LayerBytes:
    """Bytes per stage for per-expert row counts `counts` (E,) (e.g. Routing.counts).

    ``active``: count weights only for experts with counts > 0.
    """
    counts = np.asarray(counts, dtype=np.int64)
    E, H, I = problem.experts, problem.hidden, problem.intermediate
    if counts.shape != (E,) or (counts < 0).any():
        raise ValueError(f"counts must be ({E},) non-negative ints, got shape {counts.shape}")
    rows = int(counts.sum())
    n_w = int((counts > 0).sum()) if active else E
    w13 = StageBytes(n_w * nvfp4_bytes(2 * I, H), nvfp4_bytes(rows, H), rows * 2 * I * FP32_BYTES)
    act = StageBytes(0, rows * 2 * I * FP32_BYTES, nvfp4_bytes(rows, I))
    w2 = StageBytes(n_w * nvfp4_bytes(H, I), nvfp4_bytes(rows, I), rows * H * BF16_BYTES)
    return LayerBytes(w13, act, w2, rows, int((counts > 0).sum()))


def uniform_counts(problem: MoEProblem, mean_tokens_per_expert: int) -> np.ndarray:
    """(E,) int64 counts with every expert at the same mean: the study's idealised token load."""
    return np.full(problem.experts, int(mean_tokens_per_expert), dtype=np.int64)


def roofline_ms(nbytes: float, gbps: float) -> float:
    """Milliseconds to move `nbytes` at `gbps` decimal GB/s."""
    if gbps <= 0:
        raise ValueError(f"gbps must be > 0, got {gbps}")
    return nbytes / (gbps * 1e9) * 1e3


def bytes_table(problem: MoEProblem, counts, gbps: float = H200_GBPS, active: bool = False) -> list[dict]:
    """Rows {stage, weights_GB, act_GB, total_GB, roofline_ms} for each stage and the layer."""
    lb = layer_bytes(problem, counts, active)
    out = []
    for name, s in [*lb.stages.items(), ("layer", None)]:
        w = lb.weights if s is None else s.weights
        t = lb.total if s is None else s.total
        out.append({"stage": name, "weights_GB": w / 1e9, "act_GB": (t - w) / 1e9,
                    "total_GB": t / 1e9, "roofline_ms": roofline_ms(t, gbps)})
    return out


def gemm_flops(n: int, k: int, counts) -> int:
    """Useful flops of a grouped GEMM of (N, K) weights on experts with `counts` rows each."""
    return 2 * int(np.asarray(counts, dtype=np.int64).sum()) * n * k


def layer_flops(problem: MoEProblem, counts) -> dict[str, int]:
    """{"w13", "w2", "layer"}: useful flops of the layer's two GEMMs for per-expert `counts`."""
    H, I = problem.hidden, problem.intermediate
    w13, w2 = gemm_flops(2 * I, H, counts), gemm_flops(H, I, counts)
    return {"w13": w13, "w2": w2, "layer": w13 + w2}


def binding(nbytes: float, flops: float, read_gbps: float, tensor_tflops: float) -> dict:
    """The roofline of `nbytes` and `flops` against both ceilings: {"ms", "binds" ("read" or
    "tensor"), "read_ms", "tensor_ms"}. Ties go to the read, the lab's usual ceiling."""
    if read_gbps <= 0 or tensor_tflops <= 0:
        raise ValueError(f"ceilings must be > 0, got read {read_gbps} GB/s, tensor {tensor_tflops} TFLOP/s")
    read_ms = roofline_ms(nbytes, read_gbps)
    tensor_ms = flops / (tensor_tflops * 1e12) * 1e3
    binds = "tensor" if tensor_ms > read_ms else "read"
    return {"ms": max(read_ms, tensor_ms), "binds": binds, "read_ms": read_ms, "tensor_ms": tensor_ms}
