"""Correctness checks of a layer run against lab.reference, shared by run_layer.py and the tests.

    check_separate(runner, layer, experts)      separate's stages one by one, each against the
                                                reference fed the device's own input to that stage:
        x_q   bitwise  nvfp4.quantize(x[row_token], w13_input_scale)                  all rows
        h     rel      reference.w13(x_q)                                              sampled experts
        a     rel      reference.swiglu(h as computed)  (the kernel's fp32 SwiGLU)     sampled experts
        a_q   bitwise  nvfp4.quantize(the kernel's fp32 SwiGLU, w2_input_scale)        all rows
        out   rel      reference.w2(a_q as computed)                                   sampled experts
        bf16  bitwise  ml_dtypes bf16 of out                                           all rows
        layer rel      the reference layer on x end to end (reported, not a pass/fail) sampled experts
    compare_bits(got, want)                     bitwise equality with the first differing index

The host memory of a check is bounded whatever the batch: the float64 work holds only the sampled
experts' rows (the references run on those rows alone, with offsets that give every other expert
none), and the all-rows comparisons copy CHECK_CHUNK_ROWS rows at a time (lab/memory.py,
check_host_parts, counts both).

Relative errors are Frobenius norms in float64 (rel_error): against an all-zero reference a
relative error is undefined, and is None (JSON null, "undefined" in tables), never 0.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from . import nvfp4, reference
from .kernels import swiglu_quant as sq

H_TOL = 1e-5  # fp32 accumulation of exact products over K (bench_gemm uses the same bound)
A_TOL = 1e-6  # fp32 SwiGLU: a few ulp
OUT_TOL = 1e-5


UNDEFINED = "undefined (zero reference)"
CHECK_CHUNK_ROWS = 4096  # rows per copy in check_separate's all-rows comparisons
CHECK_WORKERS = max(1, min(8, os.cpu_count() or 1))  # threads that compute those chunks' references


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


def compact_offsets(offsets, experts) -> np.ndarray:
    """Offsets (E+1,) of the rows of `experts` alone, in expert order (every other expert holds
    none): the reference functions then run on expert_rows(offsets, sorted(experts)) and nothing
    else."""
    offsets = np.asarray(offsets, dtype=np.int64)
    counts = np.zeros(len(offsets) - 1, np.int64)
    sel = np.asarray(sorted(experts), dtype=np.int64)
    counts[sel] = offsets[sel + 1] - offsets[sel]
    return np.concatenate([[0], np.cumsum(counts)])


def _host_rows(dev, offsets, experts) -> np.ndarray:
    """The rows of `experts` (increasing) of a device array, copied to the host one expert's
    slice at a time."""
    parts = [dev[int(offsets[e]):int(offsets[e + 1])].get() for e in experts]
    return np.concatenate(parts) if parts else np.zeros((0, *dev.shape[1:]), dev.dtype)


def _compare_chunks(rows: int, fetch, pairs) -> list[tuple[bool, str]]:
    """compare_bits over rows [0, rows) in chunks of CHECK_CHUNK_ROWS. fetch(r0, r1) copies what
    those rows need from the device (on this thread: every device copy stays on it); pairs(fetched)
    gives a list of (got, want), one per compared array, on CHECK_WORKERS threads (the host
    quantizations dominate at large batches: ~30 M elements a second each; NumPy lets threads run
    them side by side). At most CHECK_WORKERS + 1 chunks are held at once. Returns (equal,
    message) per array; a message counts every differing element and names the first."""
    def summary(r0, r1, fetched):
        out = []
        for got, want in pairs(fetched):
            if got.shape != want.shape:
                out.append((0, 0, None, f"shapes differ at rows {r0}..{r1}: {got.shape} vs {want.shape}"))
                continue
            diff = got != want
            n = int(diff.sum())
            first = None
            if n:
                at = tuple(int(i) for i in np.argwhere(diff)[0])
                first = f"({', '.join(str(i) for i in (r0 + at[0], *at[1:]))}): {got[at]!r} vs {want[at]!r}"
            out.append((n, diff.size, first, None))
        return out

    chunks = [(r0, min(rows, r0 + CHECK_CHUNK_ROWS)) for r0 in range(0, rows, CHECK_CHUNK_ROWS)] or [(0, 0)]
    results = []
    with ThreadPoolExecutor(max_workers=CHECK_WORKERS) as pool:
        pending: deque = deque()
        for r0, r1 in chunks:
            if len(pending) >= CHECK_WORKERS:
                results.append(pending.popleft().result())
            pending.append(pool.submit(summary, r0, r1, fetch(r0, r1)))
        results.extend(f.result() for f in pending)
    out = []
    for per_array in zip(*results):
        shape = next((m for _, _, _, m in per_array if m is not None), None)
        differ = sum(n for n, _, _, _ in per_array)
        if shape is not None:
            out.append((False, shape))
        elif differ == 0:
            out.append((True, "bitwise equal"))
        else:
            first = next(f for _, _, f, _ in per_array if f is not None)
            out.append((False, f"{differ} of {sum(t for _, t, _, _ in per_array)} differ, first at {first}"))
    return out


def check_separate(runner, layer, experts) -> dict:
    """Check the buffers a checked run of `separate` left in `layer`, stage by stage.

    Returns a dict with one entry per stage ({"ok", "value", "detail"}), "experts", "ok" (all
    stage checks passed), "layer_rel" / "layer_rel_bf16" (end to end vs float64) and "reference":
    the float64 layer's x_q, h, a, a_q and out on "rows" (the sampled experts' grouped rows, in
    order), one row each.
    """
    w = layer.weights.host
    routing = layer.routing
    offsets = layer.offsets_host
    experts = sorted(int(e) for e in experts)
    rows_sel = expert_rows(offsets, experts)
    offs_c = compact_offsets(offsets, experts)
    rows, I = layer.rows, layer.problem.intermediate
    x = _host_x(layer)
    res: dict = {"experts": experts}

    def host_rows(dev):
        return _host_rows(dev, offsets, experts)

    # x_q on every row, a chunk at a time (the quantization is row by row, its global static)
    def x_q_pairs(fetched):
        packed, scales, row_token = fetched
        want = reference.quantize_activations(x[row_token], w.w13_input_scale)
        return [(packed, want.packed), (scales, want.scales)]

    (ok_p, msg_p), (ok_s, msg_s) = _compare_chunks(rows, lambda r0, r1: (
        layer.x_packed[r0:r1].get(), layer.x_scales[r0:r1].get(), routing.row_token[r0:r1]), x_q_pairs)
    res["x_q"] = {"ok": ok_p and ok_s, "detail": f"codes {msg_p}; scales {msg_s}"}

    # the float64 layer on the sampled rows alone (what reference.layer computes there)
    ref = reference.layer_rows(x[routing.row_token[rows_sel]], offs_c, w, experts)
    h = host_rows(layer.h)
    res["h"] = _rel("h", h, ref["h"], H_TOL)

    # the kernel's fp32 SwiGLU values, by a second launch that also writes them out
    a32 = runner.buffer("check/a32", (rows, I), np.float32)
    ap = runner.buffer("check/a_packed", (rows, I // 2), np.uint8)
    as_ = runner.buffer("check/a_scales", (rows, I // 16), np.uint8)
    with runner.stream:
        runner.counter.fill(0)
        sq.swiglu_quant(layer.h, layer.offsets, layer.weights.gate_global, layer.weights.up_global,
                        layer.weights.w2_input_scale, ap, as_, runner.counter, a_out=a32, stream=runner.stream)
    bad = runner.read_counter()
    a = host_rows(a32)
    a_ref = reference.swiglu(h, offs_c, w.gate_global, w.up_global, experts)
    res["a"] = _rel("a", a, a_ref, A_TOL)
    del a_ref
    if bad:
        res["a"] = {"ok": False, "value": None, "detail": f"{bad} non-finite values in h or a"}
        res["a_q"] = {"ok": False, "detail": "skipped: non-finite a"}
    else:
        def a_q_pairs(fetched):
            a_chunk, packed, scales = fetched
            want = nvfp4.quantize(a_chunk, w.w2_input_scale)
            return [(packed, want.packed), (scales, want.scales)]

        (ok_p, msg_p), (ok_s, msg_s) = _compare_chunks(rows, lambda r0, r1: (
            a32[r0:r1].get(), layer.a_packed[r0:r1].get(), layer.a_scales[r0:r1].get()), a_q_pairs)
        same = bool((ap == layer.a_packed).all()) and bool((as_ == layer.a_scales).all())
        res["a_q"] = {"ok": ok_p and ok_s and same,
                      "detail": f"codes {msg_p}; scales {msg_s}; a_out launch identical: {same}"}

    a_p, a_s = host_rows(layer.a_packed), host_rows(layer.a_scales)
    out = host_rows(layer.out)
    out_ref = reference.w2(nvfp4.NVFP4Tensor(a_p, a_s, np.float32(w.w2_input_scale)), offs_c, w, experts)
    res["out"] = _rel("out", out, out_ref, OUT_TOL)
    del out_ref

    ((ok, msg),) = _compare_chunks(rows, lambda r0, r1: (layer.out_bf16[r0:r1].get(), layer.out[r0:r1].get()),
                                   lambda f: [(f[0], f[1].astype(ml_dtypes.bfloat16).view(np.uint16))])
    res["bf16"] = {"ok": ok, "detail": msg}

    stages = ("x_q", "h", "a", "a_q", "out", "bf16")
    res["ok"] = all(res[s]["ok"] for s in stages)
    res["layer_rel"] = rel_error(out, ref["out"])
    bf16 = host_rows(layer.out_bf16)
    res["layer_rel_bf16"] = rel_error(bf16.view(ml_dtypes.bfloat16).astype(np.float64), ref["out"])
    res["a_q_codes_differing_from_float64"] = int((nvfp4.unpack_nibbles(a_p) !=
                                                   nvfp4.unpack_nibbles(ref["a_q"].packed)).sum())
    res["reference"] = {"rows": rows_sel, **ref}
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


def approx_error(layer, reference_out, experts) -> float | None:
    """Relative Frobenius error of the layer's fp32 output on the rows of `experts` against
    float64, `reference_out` holding those rows in order (check_separate's "reference"; None:
    undefined, the reference is zero or there are no rows)."""
    return rel_error(_host_rows(layer.out, layer.offsets_host, sorted(int(e) for e in experts)), reference_out)
