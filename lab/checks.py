"""Correctness checks of a layer run against lab.reference, shared by run_layer.py and the tests.

    check_separate(runner, layer, x, experts)   separate's stages one by one, each against the
                                                reference fed the device's own input to that stage:
        x_q   bitwise  nvfp4.quantize(x[row_token], w13_input_scale)                  all rows
        h     rel      reference.w13(x_q)                                              sampled experts
        a     rel      reference.swiglu(h as computed)  (the kernel's fp32 SwiGLU)     sampled experts
        a_q   bitwise  nvfp4.quantize(the kernel's fp32 SwiGLU, w2_input_scale)        all rows
        out   rel      reference.w2(a_q as computed)                                   sampled experts
        bf16  bitwise  ml_dtypes bf16 of out                                           all rows
        layer rel      reference.layer(x) end to end (reported, not a pass/fail)       sampled experts
    compare_bits(got, want)                     bitwise equality with the first differing index

Relative errors are Frobenius norms in float64 (rel_error): against an all-zero reference a
relative error is undefined, and is None (JSON null, "undefined" in tables), never 0.
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

from . import nvfp4, reference
from .kernels import swiglu_quant as sq

H_TOL = 1e-5  # fp32 accumulation of exact products over K (bench_gemm uses the same bound)
A_TOL = 1e-6  # fp32 SwiGLU: a few ulp
OUT_TOL = 1e-5


UNDEFINED = "undefined (zero reference)"


def rel_error(got, want) -> float | None:
    """||got - want||_F / ||want||_F in float64, or None when want is all zero (or empty): the
    ratio is then 0/0 or x/0, and no number would say what it means. Raises ValueError on
    different shapes or non-finite values. (A ratio past the float64 range, which no layer comes
    near, is inf.) The lab's one relative error: every check and table uses it."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} vs {want.shape}")
    if not np.isfinite(got).all():
        raise ValueError("got contains NaN or Inf")
    if not np.isfinite(want).all():
        raise ValueError("want (the reference) contains NaN or Inf")
    den = _norm(want)
    if den == 0.0:
        return None
    return _norm(got - want) / den


def _norm(a: np.ndarray) -> float:
    """Frobenius norm, each array divided by its largest |entry| first, so that the sum of
    squares neither underflows (a 1e-200 difference is not 0) nor overflows."""
    m = float(np.abs(a).max()) if a.size else 0.0
    return 0.0 if m == 0.0 else m * float(np.linalg.norm((a / m).ravel()))


def format_rel(value: float | None, spec: str = ".2e") -> str:
    """A relative error for a table or a log line; None reads as undefined."""
    return UNDEFINED if value is None else format(value, spec)


def sample_experts(counts, n: int, seed: int = 0) -> list[int]:
    """Experts with rows: all of them if there are at most n, else a seeded sample of n."""
    active = np.flatnonzero(np.asarray(counts) > 0)
    if active.size <= n:
        return active.tolist()
    return sorted(np.random.default_rng([seed, 11]).choice(active, n, replace=False).tolist())


def expert_rows(offsets, experts) -> np.ndarray:
    """Grouped row indices of `experts`."""
    offsets = np.asarray(offsets)
    parts = [np.arange(offsets[e], offsets[e + 1]) for e in experts]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def checksum(a) -> str:
    """Short hex digest of an array's bytes (for tables: equal outputs, equal checksums)."""
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()[:12]


def compare_bits(got, want) -> tuple[bool, str]:
    """(equal, message naming the first differing index and how many differ)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False, f"shapes differ: {got.shape} vs {want.shape}"
    diff = got != want
    if not diff.any():
        return True, "bitwise equal"
    first = tuple(int(i) for i in np.argwhere(diff)[0])
    return False, f"{int(diff.sum())} of {diff.size} differ, first at {first}: {got[first]!r} vs {want[first]!r}"


def _host_x(layer) -> np.ndarray:
    x = layer.x.get()
    return x.view(ml_dtypes.bfloat16) if x.dtype == np.uint16 else x


def check_separate(runner, layer, experts) -> dict:
    """Check the buffers a checked run of `separate` left in `layer`, stage by stage.

    Returns a dict with one entry per stage ({"ok", "value", "detail"}), "experts", "ok" (all
    stage checks passed) and "layer_rel" / "layer_rel_bf16" (end to end vs float64).
    """
    w = layer.weights.host
    routing = layer.routing
    offsets = layer.offsets_host
    rows_sel = expert_rows(offsets, experts)
    x = _host_x(layer)
    res: dict = {"experts": [int(e) for e in experts]}

    ref = reference.layer(x, routing, w, experts=experts)
    got_p, got_s = layer.x_packed.get(), layer.x_scales.get()
    ok_p, msg_p = compare_bits(got_p, ref["x_q"].packed)
    ok_s, msg_s = compare_bits(got_s, ref["x_q"].scales)
    res["x_q"] = {"ok": ok_p and ok_s, "detail": f"codes {msg_p}; scales {msg_s}"}

    h = layer.h.get()
    res["h"] = _rel("h", h[rows_sel], ref["h"][rows_sel], H_TOL)

    # the kernel's fp32 SwiGLU values, by a second launch that also writes them out
    rows, I = layer.rows, layer.problem.intermediate
    a32 = runner.buffer("check/a32", (rows, I), np.float32)
    ap = runner.buffer("check/a_packed", (rows, I // 2), np.uint8)
    as_ = runner.buffer("check/a_scales", (rows, I // 16), np.uint8)
    with runner.stream:
        runner.counter.fill(0)
        sq.swiglu_quant(layer.h, layer.offsets, layer.weights.gate_global, layer.weights.up_global,
                        layer.weights.w2_input_scale, ap, as_, runner.counter, a_out=a32, stream=runner.stream)
    bad = runner.read_counter()
    a = a32.get()
    a_ref = reference.swiglu(h.astype(np.float64), offsets, w.gate_global, w.up_global, experts=experts)
    res["a"] = _rel("a", a[rows_sel], a_ref[rows_sel], A_TOL)
    if bad:
        res["a"] = {"ok": False, "value": None, "detail": f"{bad} non-finite values in h or a"}
    a_p, a_s = layer.a_packed.get(), layer.a_scales.get()
    want = nvfp4.quantize(a, w.w2_input_scale) if not bad else None
    if want is None:
        res["a_q"] = {"ok": False, "detail": "skipped: non-finite a"}
    else:
        ok_p, msg_p = compare_bits(a_p, want.packed)
        ok_s, msg_s = compare_bits(a_s, want.scales)
        same_p, _ = compare_bits(ap.get(), a_p)
        same_s, _ = compare_bits(as_.get(), a_s)
        res["a_q"] = {"ok": ok_p and ok_s and same_p and same_s,
                      "detail": f"codes {msg_p}; scales {msg_s}; a_out launch identical: {same_p and same_s}"}

    out = layer.out.get()
    a_q_dev = nvfp4.NVFP4Tensor(a_p, a_s, np.float32(w.w2_input_scale))
    out_ref = reference.w2(a_q_dev, offsets, w, experts=experts)
    res["out"] = _rel("out", out[rows_sel], out_ref[rows_sel], OUT_TOL)

    bf16 = layer.out_bf16.get()
    ok, msg = compare_bits(bf16, out.astype(ml_dtypes.bfloat16).view(np.uint16))
    res["bf16"] = {"ok": ok, "detail": msg}

    stages = ("x_q", "h", "a", "a_q", "out", "bf16")
    res["ok"] = all(res[s]["ok"] for s in stages)
    res["layer_rel"] = rel_error(out[rows_sel], ref["out"][rows_sel])
    res["layer_rel_bf16"] = rel_error(bf16.view(ml_dtypes.bfloat16)[rows_sel].astype(np.float64), ref["out"][rows_sel])
    codes_ref = nvfp4.unpack_nibbles(ref["a_q"].packed[rows_sel])
    res["a_q_codes_differing_from_float64"] = int((nvfp4.unpack_nibbles(a_p[rows_sel]) != codes_ref).sum())
    res["reference"] = ref
    return res


def _rel(name, got, want, tol) -> dict:
    if got.size == 0:
        return {"ok": True, "value": None, "detail": f"{name}: no rows to compare"}
    if not np.isfinite(got).all():
        n = int((~np.isfinite(got)).sum())
        return {"ok": False, "value": None, "detail": f"{name}: {n} non-finite values (rows not written?)"}
    err = rel_error(got, want)
    if err is None:  # a zero reference: only an all-zero result matches it
        ok = not np.any(got)
        return {"ok": ok, "value": None, "detail": f"{name}: rel Frobenius {UNDEFINED}; the result is "
                                                   f"{'all zero too' if ok else 'not zero'}"}
    return {"ok": err <= tol, "value": err, "detail": f"{name}: rel Frobenius {err:.2e} (bound {tol:.0e})"}


def approx_error(layer, reference_out, rows_sel) -> float | None:
    """Relative Frobenius error of the layer's fp32 output on `rows_sel` against float64 (None:
    undefined, the reference is zero or there are no rows)."""
    out = layer.out.get()
    return rel_error(out[rows_sel], reference_out[rows_sel])
