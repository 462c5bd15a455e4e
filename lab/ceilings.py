"""The two ceilings every figure is a ratio to, measured in the same run as the figure:

    read    a flat streaming read of ~4 GB (lab/kernels/stream_read.py): GB/s
    tensor  dense fp16 x fp16 -> fp32 GEMM throughput through cuBLAS (cublasGemmEx, CuPy's own
            binding), the best of a few large shapes: TFLOP/s

A run's roofline is the larger of bytes / read and useful flops / tensor (roofline.binding).
cuBLAS is the reference for the tensor ceiling because it is what the H200's dense fp16 rate
is usually quoted with; no kernel in the lab is faster at dense fp16.
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


def measure_ceilings(read_bytes: int = 4_077_000_000, iterations: int = 20) -> dict:
    """Both ceilings: {"read": measure_read_roofline(...), "tensor": measure_tensor_peak(...)}."""
    from lab.kernels.stream_read import measure_read_roofline

    read = measure_read_roofline(read_bytes, iterations=iterations)
    require_gpu("measure_ceilings").get_default_memory_pool().free_all_blocks()
    return {"read": read, "tensor": measure_tensor_peak(iterations=max(3, iterations // 2))}
