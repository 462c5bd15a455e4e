"""The MoE layer on the device, and the checks that run before anything is launched.

    host: MoEWeights, Routing, x (T, H)
      --check_weights / check_routing / check_activations-->    ValueError naming what is wrong
      --upload_weights (once)-->  DeviceWeights: w13 (E, 2I, H), w2 (E, H, I) as PreparedWeights,
                                  globals and GEMM alphas (E,) float32
      --load_layer (per batch)->  Layer: offsets (E+1,) int32, x quantized and grouped,
                                  buffers h, a, out, out_bf16 (allocated by the runner)
      layer.part(e0, e1)      ->  Part: views of experts e0..e1-1 and their rows, offsets relative
                                  to the part's first row: what one chunk's launches take

    Layer buffers (rows = T * top_k, grouped by expert):
      x_packed (rows, H/2) u8, x_scales (rows, H/16) u8      input, NVFP4 with w13_input_scale
      h        (rows, 2I) f32                                 w13 output (no weight globals)
      a_packed (rows, I/2) u8, a_scales (rows, I/16) u8      SwiGLU + quantize output
      out      (rows, H) f32                                  w2 output
      out_bf16 (rows, H) u16                                  the layer's output, bf16 bits

Quantizing the input sits outside the timed layer, as in the study.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from .kernels import gemm_config as gc
from .kernels import gemm_weights as gw
from .kernels import swiglu_quant as sq
from .problem import MoEProblem, MoEWeights, Routing

# ---------------------------------------------------------------------------------------------
# host checks: plain NumPy, no device
# ---------------------------------------------------------------------------------------------


def _positive_globals(name: str, a, experts: int) -> None:
    a = np.asarray(a)
    if a.shape != (experts,) or a.dtype != np.float32:
        raise ValueError(f"{name}: expected ({experts},) float32, got {a.shape} {a.dtype}")
    bad = np.flatnonzero(~np.isfinite(a) | (a <= 0))
    if bad.size:
        raise ValueError(f"{name}: must be finite and > 0, expert {bad[0]} has {a[bad[0]]}")


def check_weights(weights: MoEWeights) -> MoEProblem:
    """Shapes, dtypes and globals of `weights`; returns the problem they define (top_k 8)."""
    for name in ("w13_packed", "w13_scales", "w2_packed", "w2_scales"):
        a = getattr(weights, name)
        if not isinstance(a, np.ndarray) or a.ndim != 3 or a.dtype != np.uint8:
            raise ValueError(f"{name}: expected a 3-D uint8 array, got {getattr(a, 'shape', None)} "
                             f"{getattr(a, 'dtype', type(a).__name__)}")
    e, two_i, half_h = weights.w13_packed.shape
    h, i = 2 * half_h, two_i // 2
    if two_i % 2 or h % 64 or i % 64 or e == 0 or i == 0 or h == 0:
        raise ValueError(f"w13_packed: shape {weights.w13_packed.shape} needs (E, 2I, H/2) with H and I "
                         "positive multiples of 64")
    want = {"w13_scales": (e, 2 * i, h // 16), "w2_packed": (e, h, i // 2), "w2_scales": (e, h, i // 16)}
    for name, shape in want.items():
        if getattr(weights, name).shape != shape:
            raise ValueError(f"{name}: expected {shape} for E={e}, H={h}, I={i}, got {getattr(weights, name).shape}")
    for name in ("w13_scales", "w2_scales"):
        codes = getattr(weights, name)
        nan = np.flatnonzero((codes.reshape(-1) & 0x7F) == 0x7F)
        if nan.size:
            where = np.unravel_index(nan[0], codes.shape)
            raise ValueError(f"{name}: {nan.size} e4m3 block scales are NaN (0x7F/0xFF), first at {tuple(map(int, where))}")
    for name in ("gate_global", "up_global", "w2_global"):
        _positive_globals(name, getattr(weights, name), e)
    for name in ("w13_input_scale", "w2_input_scale"):
        sq.check_global(name, getattr(weights, name))
    return MoEProblem(e, h, i)


def check_routing(routing: Routing, experts: int) -> None:
    """offsets rise from 0 to T * top_k, counts are their differences, row_token is in range."""
    off = np.asarray(routing.offsets)
    rows = routing.tokens * routing.top_k
    if off.shape != (experts + 1,) or not np.issubdtype(off.dtype, np.integer):
        raise ValueError(f"offsets: expected ({experts + 1},) integers for {experts} experts, got {off.shape} {off.dtype}")
    if off[0] != 0 or (np.diff(off) < 0).any():
        raise ValueError(f"offsets: must start at 0 and never decrease, got {off[:4].tolist()}...")
    if off[-1] != rows:
        raise ValueError(f"offsets: end at {off[-1]}, but tokens * top_k = {routing.tokens} * {routing.top_k} = {rows}")
    if off[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"offsets: {off[-1]} rows do not fit int32")
    counts = np.asarray(routing.counts)
    if counts.shape != (experts,) or (counts != np.diff(off)).any():
        raise ValueError("counts: must equal np.diff(offsets)")
    rt = np.asarray(routing.row_token)
    if rt.shape != (rows,) or not np.issubdtype(rt.dtype, np.integer):
        raise ValueError(f"row_token: expected ({rows},) integers, got {rt.shape} {rt.dtype}")
    if rows and (rt.min() < 0 or rt.max() >= routing.tokens):
        raise ValueError(f"row_token: values must lie in [0, {routing.tokens}), got {rt.min()}..{rt.max()}")


def check_activations(x, tokens: int, hidden: int) -> np.ndarray:
    """x (T, H) float32 or bfloat16 (ml_dtypes), finite. Returns what the device gets:
    float32, or uint16 holding the bf16 bits."""
    x = np.asarray(x)
    if x.shape != (tokens, hidden):
        raise ValueError(f"x: expected shape (T, H) = ({tokens}, {hidden}), got {x.shape}")
    if x.dtype == ml_dtypes.bfloat16:
        xf, dev = x.astype(np.float32), np.ascontiguousarray(x).view(np.uint16)
    elif x.dtype == np.float32:
        xf = dev = np.ascontiguousarray(x)
    else:
        raise ValueError(f"x: expected float32 or bfloat16, got {x.dtype}")
    bad = np.argwhere(~np.isfinite(xf))
    if bad.size:
        r, c = bad[0]
        raise ValueError(f"x: {len(bad)} non-finite values (first at token {r}, column {c}: {xf[r, c]})")
    return dev


# ---------------------------------------------------------------------------------------------
# device weights
# ---------------------------------------------------------------------------------------------


@dataclass
class DeviceWeights:
    """Weights on the device, in the GEMM's layout. Built once per script; shared by batches."""

    problem: MoEProblem
    host: MoEWeights
    w13: gw.PreparedWeights  # (E, 2I, H)
    w2: gw.PreparedWeights  # (E, H, I)
    gate_global: object  # (E,) float32
    up_global: object  # (E,) float32
    w13_alpha: object  # (E,) float32: the w13 input global for every expert (no weight global)
    w2_alpha: object  # (E,) float32: float32(w2_input_scale * w2_global[e]), as reference.w2_alpha
    w13_input_scale: float
    w2_input_scale: float
    cache: dict = field(default_factory=dict)  # other layouts variants derive once (fp16 weights)


def upload_weights(weights: MoEWeights) -> DeviceWeights:
    """Check `weights` and lay them out on the device (prepare_weights runs on the GPU)."""
    from .gpu import require_gpu

    problem = check_weights(weights)
    cp = require_gpu("upload_weights")
    e = problem.experts
    w13 = gw.prepare_weights(weights.w13_packed, weights.w13_scales, xp=cp)
    w2 = gw.prepare_weights(weights.w2_packed, weights.w2_scales, xp=cp)
    g1 = np.float32(weights.w13_input_scale)
    g2 = np.float32(weights.w2_input_scale)
    w2_alpha = (g2 * weights.w2_global.astype(np.float32)).astype(np.float32)
    dw = DeviceWeights(
        problem, weights, w13, w2, cp.asarray(weights.gate_global), cp.asarray(weights.up_global),
        cp.asarray(np.full(e, g1, np.float32)), cp.asarray(w2_alpha), float(g1), float(g2))
    cp.cuda.Device().synchronize()  # the runners' non-blocking streams do not wait for this one
    return dw


# ---------------------------------------------------------------------------------------------
# a batch on the device
# ---------------------------------------------------------------------------------------------


@dataclass
class Part:
    """Experts e0..e1-1 and their rows r0..r1-1: every array a view, offsets relative to r0."""

    e0: int
    e1: int
    r0: int
    r1: int
    offsets: object  # (e1-e0+1,) int32, offsets[e0:e1+1] - r0
    w13: gw.PreparedWeights
    w2: gw.PreparedWeights
    w13_alpha: object
    w2_alpha: object
    gate_global: object
    up_global: object
    x_packed: object
    x_scales: object
    h: object
    a_packed: object
    a_scales: object
    out: object
    out_bf16: object

    @property
    def rows(self) -> int:
        return self.r1 - self.r0


@dataclass
class Layer:
    """One batch of the layer on the device: what every variant reads and writes."""

    weights: DeviceWeights
    routing: Routing
    offsets_host: np.ndarray  # (E+1,) int32
    counts: np.ndarray  # (E,) int64
    offsets: object  # (E+1,) int32 device
    row_token: object  # (rows,) int32 device
    x: object  # (T, H) float32 or uint16 (bf16 bits), device
    x_packed: object
    x_scales: object
    h: object
    a_packed: object
    a_scales: object
    out: object
    out_bf16: object
    w13_cfg: gc.GemmConfig  # the heuristic's tile for one launch over every expert (fused kernels)
    w2_cfg: gc.GemmConfig
    full: Part = None
    # The launches of each unfused GEMM (gc.gemm_plan): w13_cfg's alone, or, under skewed routing,
    # two by expert size on tiles whose bits equal its own
    w13_plan: tuple = ()
    w2_plan: tuple = ()

    @property
    def problem(self) -> MoEProblem:
        return self.weights.problem

    @property
    def rows(self) -> int:
        return int(self.offsets_host[-1])

    def drop_lab_arrays(self) -> None:
        """Drop the arrays only the lab's kernels use (quantized x, h, a, out and their views),
        keeping x, the routing and the weights: what a peer needs once the lab's variants are
        done with a batch that fills the device."""
        for name in ("x_packed", "x_scales", "h", "a_packed", "a_scales", "out", "out_bf16"):
            setattr(self, name, None)
        self.full, self.w13_plan, self.w2_plan = None, (), ()

    def part(self, runner, e0: int, e1: int, name: str) -> Part:
        """Views of experts e0..e1-1; its relative offsets are a runner buffer called `name`."""
        E = self.problem.experts
        if not 0 <= e0 < e1 <= E:
            raise ValueError(f"part: need 0 <= e0 < e1 <= {E}, got {e0}, {e1}")
        r0, r1 = int(self.offsets_host[e0]), int(self.offsets_host[e1])
        off = runner.buffer(name, (e1 - e0 + 1,), np.int32)
        off.set((self.offsets_host[e0:e1 + 1] - r0).astype(np.int32), stream=runner.stream)
        w = self.weights
        return Part(e0, e1, r0, r1, off, w.w13.experts_slice(e0, e1), w.w2.experts_slice(e0, e1),
                    w.w13_alpha[e0:e1], w.w2_alpha[e0:e1], w.gate_global[e0:e1], w.up_global[e0:e1],
                    self.x_packed[r0:r1], self.x_scales[r0:r1], self.h[r0:r1], self.a_packed[r0:r1],
                    self.a_scales[r0:r1], self.out[r0:r1], self.out_bf16[r0:r1])

    def poison(self, stream) -> None:
        """Fill h and out with NaN, out_bf16 with 0xFFFF and a_q's scales with 0xFF (an e4m3 NaN,
        so w2 turns any a_q block nobody wrote into NaN), so a row nobody writes shows up."""
        with stream:
            self.h.fill(np.nan)
            self.a_packed.fill(0xFF)
            self.a_scales.fill(0xFF)
            self.out.fill(np.nan)
            self.out_bf16.fill(0xFFFF)


def load_layer(runner, weights: DeviceWeights, routing: Routing, x) -> Layer:
    """Check the batch, upload it, quantize (and group) its input on the runner's stream.

    Raises ValueError naming the bad input before any launch; RuntimeError if the device
    quantizer met non-finite values all the same.
    """
    problem = weights.problem
    E, H, I = problem.experts, problem.hidden, problem.intermediate
    check_routing(routing, E)
    x_dev_host = check_activations(x, routing.tokens, H)
    rows = routing.rows
    offsets_host = np.asarray(routing.offsets, dtype=np.int32)
    counts = np.diff(offsets_host).astype(np.int64)

    buf = runner.buffer
    with runner.stream:
        offsets = buf("offsets", (E + 1,), np.int32)
        offsets.set(offsets_host)
        row_token = buf("row_token", (rows,), np.int32)
        row_token.set(np.asarray(routing.row_token, dtype=np.int32))
        xd = buf("x", x_dev_host.shape, x_dev_host.dtype)
        xd.set(x_dev_host)
        layer = Layer(
            weights, routing, offsets_host, counts, offsets, row_token, xd,
            buf("x_packed", (rows, H // 2), np.uint8), buf("x_scales", (rows, H // 16), np.uint8),
            buf("h", (rows, 2 * I), np.float32),
            buf("a_packed", (rows, I // 2), np.uint8), buf("a_scales", (rows, I // 16), np.uint8),
            buf("out", (rows, H), np.float32), buf("out_bf16", (rows, H), np.uint16),
            gc.heuristic(2 * I, H, counts), gc.heuristic(H, I, counts),
            w13_plan=gc.gemm_plan(2 * I, H, counts), w2_plan=gc.gemm_plan(H, I, counts))
        layer.full = layer.part(runner, 0, E, "offsets/full")
        runner.counter.fill(0)
        sq.quantize_input(xd, weights.w13_input_scale, layer.x_packed, layer.x_scales, runner.counter,
                          row_token=row_token, stream=runner.stream)
    bad = runner.read_counter()
    if bad:
        raise RuntimeError(f"quantize_input: {bad} non-finite values in x")
    return layer
