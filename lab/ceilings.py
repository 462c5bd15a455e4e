"""The ceilings every figure is a ratio to, measured in the same run as the figure:

    read         a flat streaming read of ~4 GB (lab/kernels/stream_read.py): GB/s
    tensor       dense fp16 x fp16 -> fp32 GEMM throughput through cuBLAS (cublasGemmEx, CuPy's
                 own binding), the best of a few large shapes: TFLOP/s
    tensor_fp8   dense e4m3 x e4m3 -> bf16 (fp32 compute, fast accumulation) through cuBLASLt
                 (lab/cublaslt.py), the same shapes: TFLOP/s

A run's roofline is the larger of bytes / read and useful flops / a tensor ceiling
(roofline.binding). Which tensor ceiling is the one the arithmetic can use: fp16 for the lab's
exact NVFP4 path (its decoded operands are fp16) and for bf16 peers, fp8 for fp8 peers and any
path on the fp8 tensor cores (TENSOR_KINDS). cuBLAS is the reference because it is what the
dense rates are usually quoted with; no kernel in the lab is faster at either.
"""

from __future__ import annotations

import numpy as np

from lab.gpu import require_gpu
from lab.timing import time_cuda

# (M, N, K) of the dense GEMMs tried; the best is the ceiling. Large and square-ish, so that
# tile quantization and the tail wave cost a percent or less.
TENSOR_SHAPES = ((8192, 8192, 8192), (16384, 8192, 8192), (8192, 16384, 8192))

# cuda_runtime / cublas_api enumerations (fixed by the CUDA ABI); CuPy exposes most of them
# under these names, the literal values cover its versions that do not.
_CUDA_R_16F = 2
_CUDA_R_32F = 0
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_OP_N = 0


def dense_gemm(a, b, c, stream) -> None:
    """One cuBLAS GEMM on `stream`: the row-major arrays a (K, M) f16, b (N, K) f16 and c (N, M)
    f32 are column-major A (M x K), B (K x N) and C (M x N) to cuBLAS, and C = A @ B with fp32
    accumulation."""
    from cupy_backends.cuda.libs import cublas

    import cupy as cp

    k, m = a.shape
    n = b.shape[0]
    one = np.array(1.0, dtype=np.float32)
    zero = np.array(0.0, dtype=np.float32)
    with stream:
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, stream.ptr)
        cublas.gemmEx(handle, _CUBLAS_OP_N, _CUBLAS_OP_N, m, n, k, one.ctypes.data, a.data.ptr, _CUDA_R_16F, m,
                      b.data.ptr, _CUDA_R_16F, k, zero.ctypes.data, c.data.ptr, _CUDA_R_32F, m,
                      _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)


def measure_tensor_peak(shapes=TENSOR_SHAPES, iterations: int = 10, seed: int = 0) -> dict:
    """Dense fp16 x fp16 -> fp32 GEMM throughput: {"tflops": best, "shapes": [{m, n, k, ms,
    tflops}]}. Inputs are random (never zeros: a GPU draws less power on zeros), and a few
    outputs of each shape are checked against float64 dot products, so that a GEMM that did not
    run cannot pass for a fast one."""
    cp = require_gpu("measure_tensor_peak")
    rng = cp.random.default_rng(seed)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for m, n, k in shapes:
        with stream:
            a = rng.standard_normal((k, m), dtype=cp.float32).astype(cp.float16)
            b = rng.standard_normal((n, k), dtype=cp.float32).astype(cp.float16)
            c = cp.full((n, m), cp.nan, dtype=cp.float32)
        stream.synchronize()
        t = time_cuda(lambda a=a, b=b, c=c: dense_gemm(a, b, c, stream), iterations=iterations, warmup=3,
                      stream=stream)
        for j, i in ((0, 0), (n - 1, m - 1), (n // 3, m // 2)):
            want = float(cp.asnumpy(a[:, i]).astype(np.float64) @ cp.asnumpy(b[j]).astype(np.float64))
            got = float(c[j, i].get())
            if not abs(got - want) <= 1e-3 * (1.0 + abs(want)):
                raise RuntimeError(f"measure_tensor_peak: the {m}x{n}x{k} cuBLAS GEMM gave C[{i},{j}] = {got}, "
                                   f"float64 says {want}")
        rows.append({"m": m, "n": n, "k": k, "ms": t.median_ms, "tflops": 2.0 * m * n * k / (t.median_ms * 1e-3) / 1e12})
    cp.get_default_memory_pool().free_all_blocks()
    return {"tflops": max(r["tflops"] for r in rows), "shapes": rows}


# The tensor ceilings by the operand type that reaches the tensor cores: the key each one has
# in measure_ceilings' dict.
TENSOR_KINDS = {"fp16": "tensor", "fp8": "tensor_fp8"}


def _e4m3_codes(rng, shape):
    """Random e4m3 codes of either sign with magnitudes up to 30 (exponent field <= 11): never
    NaN, never all zeros, and a range whose products the float64 check can bound tightly."""
    import cupy as cp

    v = rng.integers(0, 2 * 0x60, size=shape, dtype=cp.int32)
    return ((v % 0x60) | ((v >= 0x60).astype(cp.int32) << 7)).astype(cp.uint8)


def measure_fp8_peak(shapes=TENSOR_SHAPES, iterations: int = 10, seed: int = 0) -> dict:
    """Dense e4m3 x e4m3 GEMM throughput (fp32 compute, fast accumulation, bf16 out) through
    cuBLASLt: {"tflops": best, "shapes": [{m, n, k, ms, tflops}]}; the same shapes as the fp16
    peak, random codes, and a few outputs checked against float64 sums of the decoded codes
    (bf16 rounding plus the accumulator's few lost bits), so a GEMM that did not run or read its
    operands in the wrong order cannot pass."""
    from lab import cublaslt
    from lab.nvfp4 import decode_e4m3

    cp = require_gpu("measure_fp8_peak")
    import ml_dtypes

    rng = cp.random.default_rng(seed)
    stream = cp.cuda.Stream(non_blocking=True)
    e4m3 = decode_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float64)
    rows = []
    for m, n, k in shapes:
        gemm = cublaslt.Fp8Gemm(m, n, k)
        try:
            with stream:
                a = _e4m3_codes(rng, (m, k))
                b = _e4m3_codes(rng, (n, k))
                d = cp.full((n, m), 0x7FC0, dtype=cp.uint16)  # bf16 NaN: an unwritten output shows
            stream.synchronize()
            t = time_cuda(lambda a=a, b=b, d=d: gemm.run(a, b, d, stream), iterations=iterations, warmup=3,
                          stream=stream)
            for j, i in ((0, 0), (n - 1, m - 1), (n // 3, m // 2)):
                terms = e4m3[cp.asnumpy(a[i])] * e4m3[cp.asnumpy(b[j])]
                want = float(terms.sum())
                got = float(np.array([int(d[j, i].get())], dtype=np.uint16).view(ml_dtypes.bfloat16)[0])
                if not abs(got - want) <= 2.0**-7 * abs(want) + 2.0**-12 * float(np.abs(terms).sum()):
                    raise RuntimeError(f"measure_fp8_peak: the {m}x{n}x{k} cuBLASLt fp8 GEMM gave D[{i},{j}] = "
                                       f"{got}, float64 says {want}")
        finally:
            gemm.close()
        rows.append({"m": m, "n": n, "k": k, "ms": t.median_ms, "tflops": 2.0 * m * n * k / (t.median_ms * 1e-3) / 1e12})
    cp.get_default_memory_pool().free_all_blocks()
    return {"tflops": max(r["tflops"] for r in rows), "shapes": rows}


def measure_ceilings(read_bytes: int = 4_077_000_000, iterations: int = 20) -> dict:
    """Every ceiling: {"read": measure_read_roofline(...), "tensor": measure_tensor_peak(...),
    "tensor_fp8": measure_fp8_peak(...)}. Where cuBLASLt cannot run, "tensor_fp8" is
    {"tflops": None, "error": why}: no figure is compared with it, and none is reported as 0."""
    from lab.kernels.stream_read import measure_read_roofline

    read = measure_read_roofline(read_bytes, iterations=iterations)
    require_gpu("measure_ceilings").get_default_memory_pool().free_all_blocks()
    out = {"read": read, "tensor": measure_tensor_peak(iterations=max(3, iterations // 2))}
    try:
        out["tensor_fp8"] = measure_fp8_peak(iterations=max(3, iterations // 2))
    except (RuntimeError, OSError) as exc:
        out["tensor_fp8"] = {"tflops": None, "error": f"{type(exc).__name__}: {exc}"}
    return out


def tensor_ceiling(ceilings: dict, kind: str) -> float | None:
    """The TFLOP/s of the tensor ceiling for operands of `kind` ('fp16' or 'fp8'); None where that
    ceiling was not measured (an older run's JSON has no fp8 one) or could not be."""
    if kind not in TENSOR_KINDS:
        raise ValueError(f"kind: expected one of {', '.join(TENSOR_KINDS)}, got {kind!r}")
    return (ceilings.get(TENSOR_KINDS[kind]) or {}).get("tflops")


def validate(ceilings: dict) -> None:
    """ValueError naming the first key that breaks the schema measure_ceilings writes: read
    {gbps > 0, ...}, tensor {tflops > 0, shapes [{m, n, k, ms, tflops}]}, and, in runs that
    measured it, tensor_fp8 the same, or {tflops: None, error: why}. A reader that compares a
    figure with a ceiling calls this first, so that a ceiling of 0 or a missing one is an error
    rather than an infinite or empty ratio."""
    def positive(where: str, v) -> None:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or v != v:
            raise ValueError(f"ceilings: {where} must be a positive number, got {v!r}")

    if not isinstance(ceilings, dict):
        raise ValueError(f"ceilings: expected a dict, got {type(ceilings).__name__}")
    for key in ("read", "tensor"):
        if not isinstance(ceilings.get(key), dict):
            raise ValueError(f"ceilings: '{key}' is missing or not a dict")
    positive("read.gbps", ceilings["read"].get("gbps"))
    for key in TENSOR_KINDS.values():
        c = ceilings.get(key)
        if c is None and key != "tensor":
            continue  # a run before the fp8 ceiling existed
        if not isinstance(c, dict):
            raise ValueError(f"ceilings: '{key}' is not a dict")
        if c.get("tflops") is None and key != "tensor":
            if not isinstance(c.get("error"), str) or not c["error"]:
                raise ValueError(f"ceilings: {key}.tflops is None without an 'error' saying why")
            continue
        positive(f"{key}.tflops", c.get("tflops"))
        shapes = c.get("shapes")
        if not isinstance(shapes, list) or not shapes:
            raise ValueError(f"ceilings: {key}.shapes must be a non-empty list of the GEMMs timed")
        for i, s in enumerate(shapes):
            for f in ("m", "n", "k", "ms", "tflops"):
                positive(f"{key}.shapes[{i}].{f}", s.get(f) if isinstance(s, dict) else None)
        if abs(max(s["tflops"] for s in shapes) - c["tflops"]) > 1e-9 * c["tflops"]:
            raise ValueError(f"ceilings: {key}.tflops is not the best of its shapes")
