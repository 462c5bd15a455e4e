"""One dense fp8 GEMM through cuBLASLt, for the fp8 tensor ceiling (lab/ceilings.py).

CuPy binds cuBLAS's gemmEx, which has no fp8 types; fp8 products on Hopper go through cuBLASLt's
matmul, bound here with ctypes (no torch, no extra package). The layout is the one cuBLASLt
requires for e4m3 inputs, "TN" in its column-major terms:

    a   (M, K) uint8 e4m3 codes, row-major  = column-major K x M, used transposed (op(A) = A^T)
    b   (N, K) uint8 e4m3 codes, row-major  = column-major K x N
    d   (N, M) bf16 bits (uint16), row-major = column-major M x N:  d[n, m] = sum_k a[m, k] b[n, k]

fp32 compute with fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM), as torch's
`_scaled_grouped_mm(..., use_fast_accum=True)` runs the fp8 peer; bf16 output as that peer's.
The enumerations below are fixed by the CUDA ABI (cublasLt.h, library_types.h of CUDA 13).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_CUDA_R_16BF = 14
_CUDA_R_32F = 0
_CUDA_R_8F_E4M3 = 28
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_OP_N = 0
_CUBLAS_OP_T = 1
_DESC_TRANSA = 3
_DESC_TRANSB = 4
_DESC_FAST_ACCUM = 25
_PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20  # what cuBLASLt's Hopper fp8 kernels ask for at most (its docs advise 32 MiB)
LIB_NAMES = ("libcublasLt.so.13", "libcublasLt.so")


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _candidates() -> list[str]:
    """Where libcublasLt may be: the loader's path, beside the libcublas this process already
    mapped (CuPy's), the toolkit's, and the nvidia-cublas wheel's folder."""
    out = list(LIB_NAMES)
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if "/libcublas.so" in path:
                out += [str(Path(path).parent / n) for n in LIB_NAMES]
    except OSError:
        pass
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            out += [str(Path(root) / "lib64" / n) for n in LIB_NAMES]
    try:
        import nvidia  # the nvidia-cublas wheel's namespace package, where installed

        for base in nvidia.__path__:
            out += [str(Path(base) / "cu13" / "lib" / n) for n in LIB_NAMES]
    except ImportError:
        pass
    return list(dict.fromkeys(out))


_vp, _i32, _u64, _i64, _sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
_P = ctypes.POINTER
# Each entry's argument types: without them ctypes passes Python ints as C ints, and a size_t or
# 64-bit argument would get whatever the register's upper half held.
_SIGNATURES = {
    "cublasLtCreate": [_P(_vp)],
    "cublasLtDestroy": [_vp],
    "cublasLtMatmulDescCreate": [_P(_vp), _i32, _i32],
    "cublasLtMatmulDescDestroy": [_vp],
    "cublasLtMatmulDescSetAttribute": [_vp, _i32, _vp, _sz],
    "cublasLtMatrixLayoutCreate": [_P(_vp), _i32, _u64, _u64, _i64],
    "cublasLtMatrixLayoutDestroy": [_vp],
    "cublasLtMatmulPreferenceCreate": [_P(_vp)],
    "cublasLtMatmulPreferenceDestroy": [_vp],
    "cublasLtMatmulPreferenceSetAttribute": [_vp, _i32, _vp, _sz],
    "cublasLtMatmulAlgoGetHeuristic": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _i32, _vp, _P(_i32)],
    "cublasLtMatmul": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _sz, _vp],
}


def load() -> ctypes.CDLL:
    """libcublasLt with its entries typed, or RuntimeError naming every place tried."""
    tried = []
    for c in _candidates():
        try:
            lib = ctypes.CDLL(c)
        except OSError as exc:
            tried.append(f"{c} ({exc})")
            continue
        for fn, args in _SIGNATURES.items():
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = _i32
        return lib
    raise RuntimeError("cuBLASLt not found: tried " + "; ".join(tried))


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} returned status {status}")


class Fp8Gemm:
    """A planned e4m3 x e4m3 -> bf16 GEMM of one shape (M, N, K): `run(a, b, d, stream)`."""

    def __init__(self, m: int, n: int, k: int):
        import cupy as cp

        if min(m, n, k) <= 0 or m % 16 or n % 16 or k % 16:
            raise ValueError(f"(m, n, k): cuBLASLt's fp8 matmul needs positive multiples of 16, got {(m, n, k)}")
        lt = self.lt = load()
        vp = ctypes.c_void_p
        self.m, self.n, self.k = m, n, k
        self.handle = vp()
        _check(lt.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.desc = vp()
        _check(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F), "desc")
        for attr, value in ((_DESC_TRANSA, _CUBLAS_OP_T), (_DESC_TRANSB, _CUBLAS_OP_N)):
            v = ctypes.c_int32(value)
            _check(lt.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "transpose")
        fast = ctypes.c_int8(1)
        _check(lt.cublasLtMatmulDescSetAttribute(self.desc, _DESC_FAST_ACCUM, ctypes.byref(fast), 1), "fast accum")
        self.layouts = []
        for dtype, rows, cols in ((_CUDA_R_8F_E4M3, k, m), (_CUDA_R_8F_E4M3, k, n), (_CUDA_R_16BF, m, n)):
            lay = vp()
            _check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, ctypes.c_uint64(rows),
                                                 ctypes.c_uint64(cols), ctypes.c_int64(rows)), "layout")
            self.layouts.append(lay)
        a_l, b_l, d_l = self.layouts
        pref = vp()
        _check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lt.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
               "workspace preference")
        self.heur = _Heuristic()
        found = ctypes.c_int(0)
        _check(lt.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a_l, b_l, d_l, d_l, pref, 1,
                                                 ctypes.byref(self.heur), ctypes.byref(found)), "heuristic")
        lt.cublasLtMatmulPreferenceDestroy(pref)
        if found.value < 1:
            raise RuntimeError(f"cuBLASLt has no fp8 algorithm for {(m, n, k)} on this device")
        self.workspace = cp.empty(max(1, self.heur.workspace_size), dtype=cp.uint8)
        self.alpha = ctypes.c_float(1.0)
        self.beta = ctypes.c_float(0.0)

    def run(self, a, b, d, stream) -> None:
        m, n, k = self.m, self.n, self.k
        for name, arr, shape in (("a", a, (m, k)), ("b", b, (n, k)), ("d", d, (n, m))):
            if tuple(arr.shape) != shape or arr.itemsize != (2 if name == "d" else 1) or not arr.flags.c_contiguous:
                raise ValueError(f"{name}: expected a C-contiguous {shape} array of "
                                 f"{'uint16 (bf16 bits)' if name == 'd' else 'uint8 (e4m3 codes)'}, "
                                 f"got {tuple(arr.shape)} {arr.dtype}")
        a_l, b_l, d_l = self.layouts
        vp = ctypes.c_void_p
        _check(self.lt.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), vp(a.data.ptr), a_l,
                                      vp(b.data.ptr), b_l, ctypes.byref(self.beta), vp(d.data.ptr), d_l,
                                      vp(d.data.ptr), d_l, ctypes.byref(self.heur.algo), vp(self.workspace.data.ptr),
                                      ctypes.c_size_t(self.workspace.nbytes), vp(stream.ptr)), "matmul")

    def close(self) -> None:
        lt = self.lt
        for lay in self.layouts:
            lt.cublasLtMatrixLayoutDestroy(lay)
        lt.cublasLtMatmulDescDestroy(self.desc)
        lt.cublasLtDestroy(self.handle)
        self.layouts = []
