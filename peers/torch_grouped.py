"""The layer through PyTorch's grouped GEMMs, on the lab's runner: torch-bf16 and torch-fp8 as a
torch user runs them (the activation stage compiled), and their eager forms.

Every peer takes the same NVFP4 weights as the lab, dequantized once (e2m1 x e4m3 x the
weight's global: exact in float32) into its own format, and the same routing and input:

    torch-bf16   weights bf16; x gathered to rows, bf16 (in prepare, as the lab's input quantize)
                 w13  h = _grouped_mm(x, w13ᵀ)                       (rows, 2I) bf16
                 act  a = silu(h_gate) * h_up                        (rows, I)  bf16
                 w2   out = _grouped_mm(a, w2ᵀ)                       (rows, H)  bf16
    torch-fp8    weights fp8 e4m3, one float32 scale per output row (amax / 448); x rows fp8
                 with one scale per row (in prepare)
                 w13  h = _scaled_grouped_mm(x8, w13_8ᵀ, sx, sw13)    bf16 out, fast accumulation
                 act  a = silu(h_gate) * h_up, then per row: sa = amax / 448, a8 = fp8(a / sa)
                 w2   out = _scaled_grouped_mm(a8, w2_8ᵀ, sa, sw2)

The activation stage ("act") is one `torch.compile`d function (SwiGLU, and for fp8 the rowwise
scale and cast): one generated kernel, what a torch user gets by compiling the model and what
serving engines do with a fused silu-and-quantize kernel. It is compiled in `prepare`, never
timed. Eager PyTorch runs the same stage as five or six kernels over the whole (rows, 2I) tensor;
those forms stay available as torch-bf16-eager and torch-fp8-eager so that the difference stays
visible. The compiled stage keeps its intermediates in float32 where eager rounds each op to
bf16, so its scales and codes can differ from the eager ones by one rounding step: `prepare`
compares the two on the layer's own h and keeps the count (`vs_eager`). Where compilation fails
(no Triton, no C compiler, an unsupported torch), the eager stage stands in and the peer says so
(`stand_in`, and `label` names the row as the eager form).

Blockwise fp8 (the DeepSeek-V3 recipe: activations scaled per token and 128 columns, weights per
128 x 128 block) as a grouped GEMM: `blockwise_support()` asks this torch, and token_axis records
its answer. torch 2.11 (2.11.0+cu130) names the recipe (torch.nn.functional.scaled_grouped_mm
with ScalingType.Blockwise_1x128 / Blockwise_128x128) but on sm_90 raises "No gemm
implementation was found" (an H100, results/h100/token_axis.json `peers`); 2.8-2.10 have no
blockwise grouped form either. So there is no torch-fp8-block peer: torch's dense `_scaled_mm`
has the recipe on sm_90, but one launch per expert is not a grouped GEMM a user would run for
288 experts.

The gate/up/w2 globals live in the dequantized weights, so SwiGLU is the plain one. Launches go
to the runner's stream (torch.cuda.ExternalStream over it), so NVTX ranges and CUDA events are
the runner's as for every variant; arrays cross between CuPy and torch through DLPack, without
copies. Output stays in the peer (`result`), as bf16: copying it into the layer's buffers would
add a pass over the output that the peer does not need.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

from lab import nvfp4

NAME_BF16 = "torch-bf16"
NAME_FP8 = "torch-fp8"
EAGER = "-eager"  # the suffix of the eager forms' names
ACTIVATIONS = ("compiled", "eager")
INSTALL_HINT = "torch is not installed: pip install -e '.[peers]' adds it"
FP8_MAX = 448.0
DEQUANT_CHUNK = 8  # experts per dequantization step (bounds the float32 temporaries)
TINY = 1e-12  # floor of a row's scale: an all-zero row quantizes to zeros, not NaN


def _torch():
    """The torch module, or NotImplementedError saying why the peer cannot run."""
    try:
        import torch
    except ImportError:
        raise NotImplementedError(INSTALL_HINT) from None
    for fn in ("_grouped_mm", "_scaled_grouped_mm"):
        if not hasattr(torch, fn):
            raise NotImplementedError(f"torch {torch.__version__} has no torch.{fn} (2.8 or newer has it)")
    if not torch.cuda.is_available():
        raise NotImplementedError(f"torch {torch.__version__} sees no CUDA device")
    return torch


def dequantize(torch, packed: np.ndarray, scales: np.ndarray, row_global: np.ndarray, device):
    """(e, n, k/2) codes, (e, n, k/16) e4m3 scales and (e, n) float32 globals -> (e, n, k)
    float32 on `device`: e2m1 x e4m3 x global (the first two exact, the global one rounding)."""
    e, n, half_k = packed.shape
    k = 2 * half_k
    p = torch.from_numpy(np.ascontiguousarray(packed)).to(device)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(e, n, k // nvfp4.BLOCK, nvfp4.BLOCK).long()
    e2m1 = torch.from_numpy(np.array(nvfp4.E2M1_VALUES)).to(device)
    e4m3 = torch.from_numpy(nvfp4.decode_e4m3(np.arange(256, dtype=np.uint8))).to(device)
    s = e4m3[torch.from_numpy(np.ascontiguousarray(scales)).to(device).long()]
    g = torch.from_numpy(np.ascontiguousarray(row_global, dtype=np.float32)).to(device)
    return (e2m1[codes] * s[..., None]).reshape(e, n, k) * g[..., None]


def rowwise_fp8(torch, a):
    """(rows, k) -> (fp8 e4m3 rows, (rows,) float32 scales) with a = fp8 * scale per row."""
    amax = a.abs().amax(dim=-1).float()
    scale = torch.clamp(amax, min=TINY) / FP8_MAX
    return (a.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def free_cached_memory() -> None:
    """Hand the memory torch's caching allocator holds back to the device, where torch is loaded:
    the lab's arrays come from CuPy's pool, which cannot use blocks torch keeps."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def swiglu(torch, h):
    """(rows, 2I) -> (rows, I): silu of the gate half times the up half, in h's dtype."""
    i = h.shape[-1] // 2
    return torch.nn.functional.silu(h[:, :i]) * h[:, i:]


def eager_stage(torch, kind: str, h):
    """The activation stage as eager PyTorch runs it: bf16 -> a; fp8 -> (a8, per-row scales)."""
    a = swiglu(torch, h)
    return a if kind == "bf16" else rowwise_fp8(torch, a)


_COMPILED: dict = {}


def compiled_stage(torch, kind: str):
    """The activation stage as one torch.compile'd function, built once per kind: dynamo's cache
    sits on the function's code, so the token counts of a run share it (the second count
    compiles a form with the rows dimension dynamic, as torch does by default) and the
    recompile limit is never reached. fullgraph: a graph break raises instead of running
    part of the stage eagerly under the compiled name."""
    if kind not in _COMPILED:
        def stage(h):
            return eager_stage(torch, kind, h)

        _COMPILED[kind] = torch.compile(stage, fullgraph=True)
    return _COMPILED[kind]


def pick_stage(compile_stage, eager, h, compare):
    """(stage, stand_in, vs_eager): the compiled stage, run once on `h` and compared with the eager
    one, or, where building or running it raises, the eager stage with the reason it stands in."""
    try:
        stage = compile_stage()
        got = stage(h)
    except Exception as exc:  # noqa: BLE001  (any failure of the compiler means the eager stage stands in)
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return eager, f"torch.compile failed ({type(exc).__name__}: {first}); the eager stage stands in", None
    return stage, None, compare(got, eager(h))


def _ordinal(torch, bits, sign_bit: int):
    """Sign-magnitude float bits (int) -> integers in the floats' order, one apart per step."""
    mag = bits & (sign_bit - 1)
    return torch.where((bits & sign_bit) != 0, -mag, mag)


COMPARE_CHUNK = 1 << 24  # elements per slice of compare_stages: its int32 temporaries stay ~64 MB each


def compare_stages(torch, kind: str, got, want) -> dict:
    """How the compiled stage's output differs from the eager one's on the same h: {elements,
    differ (values not bit-equal), max_step (the largest difference in representable steps),
    and for fp8 scale_max_rel (the largest relative difference of a row's scale)}. Compared a
    slice of rows at a time: whole, its int32 temporaries were ~5x the output (at 2048 tokens per
    expert on an 80 GB board, the compiled torch-bf16 ran out of memory here even alone)."""
    if kind == "bf16":
        g_all, w_all, out = got, want, {}
        bits = lambda t: _ordinal(torch, t.view(torch.int16).int() & 0xFFFF, 0x8000)  # noqa: E731
    else:
        (g_all, gs), (w_all, ws) = got, want
        out = {"scale_max_rel": float(((gs - ws).abs() / ws.abs().clamp(min=TINY)).max()) if gs.numel() else 0.0}
        bits = lambda t: _ordinal(torch, t.view(torch.uint8).int(), 0x80)  # noqa: E731
    rows = g_all.shape[0] if g_all.dim() else 1
    per = max(1, COMPARE_CHUNK // max(1, g_all.numel() // max(1, rows)))
    differ, max_step = 0, 0
    for r0 in range(0, rows, per):
        step = (bits(g_all[r0:r0 + per]) - bits(w_all[r0:r0 + per])).abs()
        if step.numel():
            differ += int((step != 0).sum())
            max_step = max(max_step, int(step.max()))
        del step
    return {"elements": int(g_all.numel()), "differ": differ, "max_step": max_step, **out}


def blockwise_support(torch, device) -> str | None:
    """None where this torch runs a grouped fp8 GEMM with 1x128 activation and 128x128 weight
    block scales on `device` (and gets a small problem right), else why not, in one line. Asks
    the public form (torch.nn.functional.scaled_grouped_mm with ScalingType, torch 2.10+)."""
    F = torch.nn.functional
    kinds = getattr(F, "ScalingType", None)
    if kinds is None:
        try:
            from torch.nn.functional import ScalingType as kinds  # noqa: N813
        except ImportError:
            kinds = None
    names = [] if kinds is None else list(kinds.__members__)
    act = next((n for n in names if "1x128" in n.lower().replace("_", "")), None)
    wgt = next((n for n in names if "128x128" in n.lower().replace("_", "")), None)
    if not hasattr(F, "scaled_grouped_mm") or act is None or wgt is None:
        return (f"torch {torch.__version__}: torch.nn.functional.scaled_grouped_mm "
                f"{'is there' if hasattr(F, 'scaled_grouped_mm') else 'is missing'}, its ScalingType has "
                f"{', '.join(names) or 'no members'}: no 1x128 / 128x128 recipe")
    act, wgt = getattr(kinds, act), getattr(kinds, wgt)
    g, m, n, k = 2, 256, 256, 256  # two experts of 128 rows each
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, generator=gen)
    b = torch.randn(g, n, k, device=device, generator=gen)
    offs = torch.tensor([m // g * (i + 1) for i in range(g)], dtype=torch.int32, device=device)
    sa = torch.rand(m, k // 128, device=device, generator=gen) + 0.5
    sb = torch.rand(g, n // 128, k // 128, device=device, generator=gen) + 0.5
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    try:
        out = F.scaled_grouped_mm(a8, b8.transpose(-2, -1), sa.t().contiguous().t(), act, sb, wgt, offs=offs,
                                  output_dtype=torch.bfloat16)
    except Exception as exc:  # noqa: BLE001  (whatever torch raises is the answer)
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"torch {torch.__version__}: scaled_grouped_mm with Blockwise_1x128 / Blockwise_128x128 raised {type(exc).__name__}: {first}"
    af = a8.float() * sa.repeat_interleave(128, 1)
    want = torch.cat([af[i * 128:(i + 1) * 128] @ (b8[i].float() * sb[i].repeat_interleave(128, 0).repeat_interleave(128, 1)).t()
                      for i in range(g)])
    err = float((out.float() - want).norm() / want.norm())
    return None if err < 2e-2 else f"torch {torch.__version__}: blockwise scaled_grouped_mm ran but is {err:.1e} off float32"


def _weights(torch, host, kind: str, device) -> dict:
    """The peer's weights from the lab's NVFP4 ones: w13 (E, 2I, H), w2 (E, H, I) in `kind`
    (bf16, or fp8 with per-row scales), built DEQUANT_CHUNK experts at a time."""
    E, I = host.experts, host.intermediate
    g13 = np.concatenate([np.repeat(host.gate_global[:, None], I, 1), np.repeat(host.up_global[:, None], I, 1)], 1)
    g2 = np.repeat(host.w2_global[:, None], host.hidden, 1)
    out = {}
    for name, packed, scales, glob in (("w13", host.w13_packed, host.w13_scales, g13),
                                       ("w2", host.w2_packed, host.w2_scales, g2)):
        parts, row_scales = [], []
        for e0 in range(0, E, DEQUANT_CHUNK):
            e1 = min(E, e0 + DEQUANT_CHUNK)
            w = dequantize(torch, packed[e0:e1], scales[e0:e1], glob[e0:e1], device)
            if kind == "bf16":
                parts.append(w.to(torch.bfloat16))
            else:
                w8, s = rowwise_fp8(torch, w)
                parts.append(w8)
                row_scales.append(s)
            del w
        out[name] = torch.cat(parts)  # (E, N, K): its transpose is the column-major (E, K, N) operand
        if row_scales:
            out[name + "_scale"] = torch.cat(row_scales).contiguous()  # (E, N) float32
    return out


class TorchGrouped:
    """A peer on the runner contract: name, expect, stages, prepare(runner, layer), run(runner,
    layer), plus result(layer) -> the fp32 output on the host (for the approx check), `tensor`
    (the tensor ceiling its GEMMs are compared with), `label` (the name a table shows) and, after
    prepare, `stand_in` and `vs_eager` (module docstring)."""

    expect = "approx"
    stages = ("w13", "act", "w2")

    def __init__(self, kind: str, activation: str = "compiled"):
        if kind not in ("bf16", "fp8"):
            raise ValueError(f"kind: expected 'bf16' or 'fp8', got {kind!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        self.kind, self.activation = kind, activation
        self.name = (NAME_BF16 if kind == "bf16" else NAME_FP8) + (EAGER if activation == "eager" else "")
        self.tensor = "fp8" if kind == "fp8" else "fp16"  # bf16 runs at the fp16 rate
        self.torch = None
        self.out = None
        self.stand_in: str | None = None
        self.vs_eager: dict | None = None

    @property
    def label(self) -> str:
        """The name a table shows: where the eager stage stands in for the compiled one, it says so."""
        return f"{self.name} (eager stand-in)" if self.stand_in else self.name

    def prepare(self, runner, layer) -> None:
        torch = self.torch = _torch()
        cp = runner.cp
        device = torch.device("cuda", cp.cuda.Device().id)
        self.stream = torch.cuda.ExternalStream(runner.stream.ptr, device=device)
        key = ("torch", self.kind)
        if key not in layer.weights.cache:  # shared by every batch of these weights
            layer.weights.cache[key] = _weights(torch, layer.weights.host, self.kind, device)
        w = layer.weights.cache[key]
        runner.synchronize()
        with torch.cuda.stream(self.stream):
            x = torch.from_dlpack(layer.x)
            if x.dtype == torch.int16 or x.dtype == torch.uint16:  # bf16 bits
                x = x.view(torch.bfloat16)
            rows = torch.from_dlpack(layer.row_token).long()
            xr = x[rows]
            self.offs = torch.from_numpy(np.asarray(layer.offsets_host[1:], dtype=np.int32)).to(device)
            self.w13_t, self.w2_t = w["w13"].transpose(-2, -1), w["w2"].transpose(-2, -1)
            if self.kind == "bf16":
                self.x = xr.to(torch.bfloat16).contiguous()
            else:
                self.x, self.x_scale = rowwise_fp8(torch, xr)
                self.w13_scale, self.w2_scale = w["w13_scale"], w["w2_scale"]
        self.intermediate = layer.problem.intermediate
        # partials, not lambdas over self: a closure kept on self is a reference cycle, and its
        # tensors (gigabytes at 1024+ tokens per expert) would outlive the peer until a GC pass
        self._act = functools.partial(eager_stage, torch, self.kind)
        if self.activation == "compiled":
            with torch.cuda.stream(self.stream):
                h = self._gemm(self.x, getattr(self, "x_scale", None), self.w13_t, getattr(self, "w13_scale", None))
                # suppress_errors off: a compiler failure raises here and the eager stand-in is named,
                # rather than dynamo running the stage eagerly under the compiled name
                with torch._dynamo.config.patch(suppress_errors=False):
                    self._act, self.stand_in, self.vs_eager = pick_stage(
                        functools.partial(compiled_stage, torch, self.kind), self._act, h,
                        functools.partial(compare_stages, torch, self.kind))
                del h
        self.run(runner, layer)  # the first call picks torch's kernels; not timed
        runner.synchronize()

    def _gemm(self, a, a_scale, w_t, w_scale):
        torch = self.torch
        if self.kind == "bf16":
            return torch._grouped_mm(a, w_t, offs=self.offs)
        return torch._scaled_grouped_mm(a, w_t, a_scale, w_scale, offs=self.offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    def run(self, runner, layer) -> None:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            with runner.stage("w13"):
                h = self._gemm(self.x, getattr(self, "x_scale", None), self.w13_t, getattr(self, "w13_scale", None))
            with runner.stage("act"):
                a, a_scale = self._act(h), None
                if self.kind == "fp8":
                    a, a_scale = a
            with runner.stage("w2"):
                self.out = self._gemm(a, a_scale, self.w2_t, getattr(self, "w2_scale", None))

    def release(self) -> None:
        """Drop the peer's device tensors (its weights stay in the layer's cache)."""
        for name in ("x", "x_scale", "out", "offs", "w13_t", "w2_t", "w13_scale", "w2_scale", "_act"):
            self.__dict__.pop(name, None)

    def result(self, layer) -> np.ndarray:
        """The last run's output (rows, H) as float32 on the host."""
        if self.out is None:
            raise RuntimeError(f"{self.name}: no output yet (run it first)")
        with self.torch.cuda.stream(self.stream):
            return self.out.float().cpu().numpy()
