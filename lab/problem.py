"""The MoE layer the lab measures: its shape, a token routing, and synthetic weights.

    x (T, H) --gather by row_token--> (rows, H), rows = T * top_k, grouped by expert
      --quantize (w13_input_scale)--> w13 grouped GEMM (E, 2I, H) --> h (rows, 2I)
      --SwiGLU with per-expert gate/up globals, quantize (w2_input_scale)--> a (rows, I)
      --> w2 grouped GEMM (E, H, I) --> out (rows, H) bf16

Everything here is NumPy, seeded and deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .nvfp4 import BLOCK

# ---------------------------------------------------------------------------------------------
# the problem
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEProblem:
    """Shape of the MoE layer. Defaults are the study's: w13 (288, 4096, 4096), w2 (288, 4096, 2048)."""

    experts: int = 288
    hidden: int = 4096  # H: K of w13, N of w2
    intermediate: int = 2048  # I: w13 has 2I rows (gate then up), w2 has K = I
    top_k: int = 8
    gate_up_ratio: float = 1.2308  # gate global / up global, as in a real checkpoint (layer 10)

    @property
    def w13_shape(self) -> tuple[int, int, int]:
        return (self.experts, 2 * self.intermediate, self.hidden)

    @property
    def w2_shape(self) -> tuple[int, int, int]:
        return (self.experts, self.hidden, self.intermediate)

    def validate(self, names: dict[str, str] | None = None) -> "MoEProblem":
        """Raise ValueError naming the first bad field; return self. ``names``: what to call a
        field in the message instead of its own name (a script passes the flag it came from,
        e.g. {"hidden": "--hidden"}, so that its user reads what to change)."""
        def name(f):
            return (names or {}).get(f, f)

        for f in ("experts", "hidden", "intermediate", "top_k"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name(f)} must be a positive int, got {v!r}")
        # 64 = 4 e4m3 scale columns: keeps K/16 a multiple of the swizzled layout's atom width
        for f in ("hidden", "intermediate"):
            if getattr(self, f) % 64:
                raise ValueError(f"{name(f)} must be a multiple of 64, got {getattr(self, f)}")
        if self.top_k > self.experts:
            raise ValueError(f"{name('top_k')}={self.top_k} must be <= {name('experts')}={self.experts}")
        r = self.gate_up_ratio
        if not isinstance(r, (int, float, np.floating)) or not np.isfinite(r) or r <= 0:
            raise ValueError(f"{name('gate_up_ratio')} must be a finite positive number, got {r!r}")
        return self


# ---------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------


@dataclass
class Routing:
    """Which expert sees which token, as the grouped GEMMs consume it."""

    offsets: np.ndarray  # (E+1,) int32: expert e owns grouped rows offsets[e]:offsets[e+1]
    counts: np.ndarray  # (E,) int32: rows per expert, == np.diff(offsets)
    row_token: np.ndarray  # (T*top_k,) int32: grouped row r holds token row_token[r]
    token_experts: np.ndarray  # (T, top_k) int32: each token's experts, highest score first
    tokens: int
    top_k: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def experts(self) -> int:
        return len(self.counts)

    @property
    def token_rows(self) -> np.ndarray:
        """(T, top_k) int32: the grouped row of (token t, slot j); the inverse of the grouping."""
        order = _group_order(self.token_experts)
        inv = np.empty_like(order)
        inv[order] = np.arange(order.size, dtype=order.dtype)
        return inv.reshape(self.token_experts.shape).astype(np.int32)


def _group_order(token_experts: np.ndarray) -> np.ndarray:
    """Flat (token, slot) indices sorted by expert, then token (unique: no repeated expert)."""
    t, k = token_experts.shape
    token = np.repeat(np.arange(t, dtype=np.int64), k)
    return np.lexsort((token, token_experts.reshape(-1).astype(np.int64)))


def tokens_for_mean(mean_tokens_per_expert: float, experts: int, top_k: int) -> int:
    """T such that T * top_k / E is the requested mean (rounded, at least 1)."""
    return max(1, int(round(mean_tokens_per_expert * experts / top_k)))


def expert_probabilities(experts: int, skew: float, seed: int = 0) -> np.ndarray:
    """(E,) float64 routing probabilities: uniform at skew 0, else p ∝ 1/(rank+1)**skew.

    Ranks are a seeded permutation of the experts, so the hot experts are not always 0, 1, ...
    """
    if skew < 0 or not np.isfinite(skew):
        raise ValueError(f"skew must be finite and >= 0, got {skew}")
    rank = np.random.default_rng([seed, 1]).permutation(experts)
    p = 1.0 / (rank + 1.0) ** skew
    return p / p.sum()


_ROUTING_CHUNK = 8192  # tokens per Gumbel draw: bounds the (chunk, E) score matrix to ~19 MB


def make_routing(tokens: int, experts: int, top_k: int, skew: float = 0.0, seed: int = 0) -> Routing:
    """Draw top_k distinct experts per token and group the (token, expert) pairs by expert.

    Gumbel-top-k: the k largest of log p_e + Gumbel noise are a draw of k experts without
    replacement with probabilities p (sequential sampling, Plackett-Luce), vectorised.
    Rows are sorted by expert, then by token, so each expert's rows are in token order.
    """
    if tokens < 1 or experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"need tokens >= 1 and 1 <= top_k <= experts, got {tokens}, {top_k}, {experts}")
    logp = np.log(expert_probabilities(experts, skew, seed))
    rng = np.random.default_rng([seed, 2])
    token_experts = np.empty((tokens, top_k), dtype=np.int32)
    for t0 in range(0, tokens, _ROUTING_CHUNK):
        n = min(_ROUTING_CHUNK, tokens - t0)
        score = logp + rng.gumbel(size=(n, experts))
        top = np.argpartition(-score, top_k - 1, axis=1)[:, :top_k]
        by_score = np.argsort(-np.take_along_axis(score, top, axis=1), axis=1, kind="stable")
        token_experts[t0 : t0 + n] = np.take_along_axis(top, by_score, axis=1)

    order = _group_order(token_experts)
    row_token = (order // top_k).astype(np.int32)
    counts = np.bincount(token_experts.reshape(-1), minlength=experts).astype(np.int32)
    offsets = np.zeros(experts + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    return Routing(offsets, counts, row_token, token_experts, tokens, top_k)


# ---------------------------------------------------------------------------------------------
# synthetic weights and activations
# ---------------------------------------------------------------------------------------------


@dataclass
class MoEWeights:
    """NVFP4 expert weights stacked over experts (ModelOpt layout per expert)."""

    w13_packed: np.ndarray  # (E, 2I, H//2) uint8: rows 0..I-1 gate_proj, I..2I-1 up_proj
    w13_scales: np.ndarray  # (E, 2I, H//16) uint8 e4m3 bits
    gate_global: np.ndarray  # (E,) float32: gate_proj weight_scale_2
    up_global: np.ndarray  # (E,) float32: up_proj weight_scale_2
    w2_packed: np.ndarray  # (E, H, I//2) uint8: down_proj
    w2_scales: np.ndarray  # (E, H, I//16) uint8 e4m3 bits
    w2_global: np.ndarray  # (E,) float32: down_proj weight_scale_2
    w13_input_scale: float  # static activation global for the w13 input
    w2_input_scale: float  # static activation global for the w2 input

    @property
    def experts(self) -> int:
        return self.w13_packed.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13_packed.shape[2] * 2

    @property
    def intermediate(self) -> int:
        return self.w13_packed.shape[1] // 2

    def problem(self, top_k: int = 8) -> MoEProblem:
        """The MoEProblem these weights fit (gate_up_ratio is the median of the experts')."""
        ratio = float(np.median(self.gate_global.astype(np.float64) / self.up_global))
        return MoEProblem(self.experts, self.hidden, self.intermediate, top_k, ratio)

    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self) if isinstance(getattr(self, f.name), np.ndarray))


# Static activation globals. random_activations draws N(0, 1) with outliers of magnitude at
# most 24, so with 32 / 2688 every block's scale input stays below 448: no block saturates.
W13_INPUT_SCALE = float(np.float32(32.0 / 2688.0))  # float32-exact, as checkpoints store it
# SwiGLU outputs of random_weights x random_activations at the default H and I have rms ~0.3
# and amax ~7 over a thousand rows; 16 / 2688 keeps blocks up to amax 16 unsaturated.
W2_INPUT_SCALE = float(np.float32(16.0 / 2688.0))

# Weight globals: the study's checkpoint has gate weight_scale_2 4.650e-05 (layer 10).
WEIGHT_GLOBAL = 4.65e-5

# Block scale codes: half of them spread over all 126 finite positive e4m3 codes
# (0x01..0x7E, 2**-9..448), half in the band 0x50..0x6F (8..120). With global = amax / 2688
# a real tensor's largest block scale is 448 and typical blocks sit one to two decades below,
# which is that band.
_SCALE_BAND_LO = 0x50  # 2**3; the band is 32 codes wide


def _random_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Uniform random uint8 array (uint64 draws viewed as bytes: ~8x faster than Generator.bytes)."""
    n = int(np.prod(shape))
    words = rng.integers(0, np.iinfo(np.uint64).max, size=-(-n // 8), dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:n].reshape(shape)


# random byte -> e4m3 scale code. The top bit picks the half: low 7 bits spread over
# 0x01..0x7E (two codes twice as likely), or the band 0x50 + low 5 bits.
_SCALE_LUT = np.concatenate(
    [1 + (np.arange(128) * 126) // 128, _SCALE_BAND_LO + (np.arange(128) & 0x1F)]
).astype(np.uint8)


def random_weights(problem: MoEProblem | None = None, seed: int = 0) -> MoEWeights:
    """Synthetic NVFP4 weights for `problem`, drawn directly as codes (no float weights).

    e2m1 codes are uniform bytes (all 16 nibbles, -0 included); e4m3 block scales mix all
    126 finite positive codes with a realistic band (see _SCALE_LUT). Globals are near the
    study's checkpoint: gate ~ 4.65e-5 x lognormal(0.1), up = gate / gate_up_ratio x
    (1 +- 0.5%), w2 ~ 4.65e-5 x lognormal(0.1). Packed codes are drawn straight into the
    result and scales one expert at a time, so memory is the output's size plus one expert's
    temporaries (4.08 GB at the default shape, a few seconds).
    """
    problem = (problem or MoEProblem()).validate()
    E, H, I = problem.experts, problem.hidden, problem.intermediate
    rng = np.random.default_rng([seed, 3])
    w13_packed = _random_bytes(rng, (E, 2 * I, H // 2))
    w2_packed = _random_bytes(rng, (E, H, I // 2))
    w13_scales = np.empty((E, 2 * I, H // BLOCK), dtype=np.uint8)
    w2_scales = np.empty((E, H, I // BLOCK), dtype=np.uint8)
    for e in range(E):
        np.take(_SCALE_LUT, _random_bytes(rng, w13_scales.shape[1:]), out=w13_scales[e])
        np.take(_SCALE_LUT, _random_bytes(rng, w2_scales.shape[1:]), out=w2_scales[e])
    grng = np.random.default_rng([seed, 4])
    gate_global = (WEIGHT_GLOBAL * np.exp(0.1 * grng.standard_normal(E))).astype(np.float32)
    jitter = 1.0 + grng.uniform(-0.005, 0.005, E)
    up_global = (gate_global / problem.gate_up_ratio * jitter).astype(np.float32)
    w2_global = (WEIGHT_GLOBAL * np.exp(0.1 * grng.standard_normal(E))).astype(np.float32)
    return MoEWeights(
        w13_packed, w13_scales, gate_global, up_global, w2_packed, w2_scales, w2_global,
        W13_INPUT_SCALE, W2_INPUT_SCALE,
    )


HEAVY_TAILED_STD = 0.02  # the scale of heavy_tailed_weights' t draws (relative errors do not depend on it)
HEAVY_TAILED_ROW_SPREAD = 0.3  # lognormal sigma of a row's scale there


def heavy_tailed_weights(problem: MoEProblem | None = None, df: float = 4.0, seed: int = 0) -> MoEWeights:
    """NVFP4 weights quantized (nvfp4.quantize, gate, up and down each a matrix with its own
    global from its amax) from real-valued Student-t matrices with `df` degrees of freedom and a
    lognormal spread per output row, gate drawn gate_up_ratio larger than up: weights shaped like
    a trained layer's, unlike random_weights' uniform codes (which the error of fp8 recipes
    depends on: notes/w4a8.md). About 2 s of CPU per expert at the study's H and I, so meant for
    a few experts. Input scales 1.0 (no static calibration for this layer's activations)."""
    from . import nvfp4

    problem = (problem or MoEProblem()).validate()
    if not (np.isfinite(df) and df > 0):
        raise ValueError(f"df: expected degrees of freedom > 0, got {df!r}")
    E, H, I = problem.experts, problem.hidden, problem.intermediate
    rng = np.random.default_rng([seed, 21])

    def draw(rows, k, scale=1.0):
        row = np.exp(HEAVY_TAILED_ROW_SPREAD * rng.standard_normal((rows, 1)))
        return (rng.standard_t(df, (rows, k)) * (HEAVY_TAILED_STD * scale) * row).astype(np.float32)

    w13_packed = np.empty((E, 2 * I, H // 2), np.uint8)
    w13_scales = np.empty((E, 2 * I, H // BLOCK), np.uint8)
    w2_packed = np.empty((E, H, I // 2), np.uint8)
    w2_scales = np.empty((E, H, I // BLOCK), np.uint8)
    gate_g, up_g, w2_g = (np.empty(E, np.float32) for _ in range(3))
    for e in range(E):
        for rows, scale, glob in ((slice(0, I), problem.gate_up_ratio, gate_g), (slice(I, 2 * I), 1.0, up_g)):
            q = nvfp4.quantize(draw(I, H, scale))
            w13_packed[e, rows], w13_scales[e, rows], glob[e] = q.packed, q.scales, q.global_scale
        q = nvfp4.quantize(draw(H, I))
        w2_packed[e], w2_scales[e], w2_g[e] = q.packed, q.scales, q.global_scale
    return MoEWeights(w13_packed, w13_scales, gate_g, up_g, w2_packed, w2_scales, w2_g, 1.0, 1.0)


OUTLIER_FRACTION = 1e-3  # of activation entries
OUTLIER_RANGE = (8.0, 24.0)  # |outlier|, a few channels far past the N(0, 1) bulk


def random_activations(rows: int, hidden: int, seed: int = 0) -> np.ndarray:
    """(rows, hidden) float32: N(0, 1) with ~0.1% outliers of magnitude 8..24, random sign."""
    rng = np.random.default_rng([seed, 5])
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    mask = rng.random((rows, hidden)) < OUTLIER_FRACTION
    n = int(mask.sum())
    x[mask] = rng.uniform(*OUTLIER_RANGE, n).astype(np.float32) * rng.choice([-1, 1], n)
    return x
