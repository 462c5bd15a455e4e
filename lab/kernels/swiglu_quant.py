"""Activation kernels (source: swiglu_quant.cu): input quantize, SwiGLU + quantize, fp32 -> bf16.

    quantize_input  x (T, K) float32 | uint16 (bf16 bits)  [gathered by row_token (rows,) int32]
                    -> packed (rows, K/2) uint8, scales (rows, K/16) uint8      global: w13 input scale
    swiglu_quant    h (rows, 2I) float32, offsets (E+1,) int32, gate/up globals (E,) float32
                    -> packed (rows, I/2) uint8, scales (rows, I/16) uint8      global: w2 input scale
                    [a_out (rows, I) float32: the SwiGLU values before quantization, for checks]
    to_bf16         x (rows, N) float32 -> (rows, N) uint16 bf16 bits, round to nearest even

Codes and scales equal ``lab.nvfp4.quantize(values, global_scale)`` bit for bit given the same
float32 values (the kernel repeats the docstring's float32 operations in order). SwiGLU is
computed in float32 as ``(g * sigmoid(g)) * u``, sigmoid from ``t = expf(-|g|)`` as
lab.reference writes it, with CUDA's expf (within 2 ulp), so its values match the float64
reference to a few ulp (times the conditioning of silu at g), not bitwise.

Every kernel adds the number of non-finite values it met (inputs, a, or bf16 outputs) to
``counter`` (1,) uint32: the caller zeroes it, runs, and reads it after a checked run. Launches
neither allocate nor synchronize, so they can be captured in a CUDA graph.
"""

from __future__ import annotations


import numpy as np

from lab.kernels import jit
from lab.kernels.gemm_config import counts_range

SOURCE = "swiglu_quant.cu"
THREADS = 128  # per block; a thread handles 4 elements, so a block covers 512 elements of a row
BF16_BLOCKS_PER_SM = 8
BLOCK = 16
_NULL = np.uint64(0)  # a null pointer argument (8 bytes)


def _expr_quantize(dtype) -> str:
    return "lab_act::quantize_rows<float>" if dtype == np.float32 else "lab_act::quantize_rows<lab_act::uint16_t>"


EXPRESSIONS = (
    "lab_act::quantize_rows<float>",
    "lab_act::quantize_rows<lab_act::uint16_t>",
    "lab_act::swiglu_quant",
    "lab_act::to_bf16",
    "lab_act::div_check",
    "lab_act::gather_bf16<float>",
    "lab_act::gather_bf16<lab_act::uint16_t>",
    "lab_act::swiglu_bf16",
)


# ---------------------------------------------------------------------------------------------
# checks (plain Python on shapes and dtypes: no device reads)
# ---------------------------------------------------------------------------------------------


def check_global(name: str, value) -> np.float32:
    """A static global scale as the kernels take it: float32, finite and > 0."""
    with np.errstate(over="ignore"):
        g = np.float32(value)
    if not np.isfinite(g) or g <= 0:
        raise ValueError(f"{name}: must be finite and > 0 as float32, got {value!r}")
    return g


def _check_array(name, a, shape, dtypes) -> None:
    dtypes = tuple(np.dtype(d) for d in dtypes)
    if tuple(a.shape) != tuple(shape) or np.dtype(a.dtype) not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected {tuple(shape)} {want}, got {tuple(a.shape)} {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")


def _check_counter(counter) -> None:
    _check_array("counter", counter, (1,), (np.uint32,))


def check_quantize_input(x, out_packed, out_scales, counter, row_token=None) -> tuple[int, int]:
    """Validate quantize_input's arguments; returns (rows, K)."""
    if x.ndim != 2:
        raise ValueError(f"x: expected (T, K) float32 or uint16 (bf16 bits), got shape {tuple(x.shape)}")
    t, k = x.shape
    if k % BLOCK or k == 0:
        raise ValueError(f"x: K={k} must be a positive multiple of {BLOCK}")
    _check_array("x", x, (t, k), (np.float32, np.uint16))
    rows = t
    if row_token is not None:
        if row_token.ndim != 1:
            raise ValueError(f"row_token: expected (rows,) int32, got shape {tuple(row_token.shape)}")
        rows = row_token.shape[0]
        _check_array("row_token", row_token, (rows,), (np.int32,))
    _check_array("out_packed", out_packed, (rows, k // 2), (np.uint8,))
    _check_array("out_scales", out_scales, (rows, k // BLOCK), (np.uint8,))
    _check_counter(counter)
    return rows, k


def check_swiglu_quant(h, offsets, gate_global, up_global, out_packed, out_scales, counter, a_out=None) -> tuple[int, int, int]:
    """Validate swiglu_quant's arguments; returns (rows, I, E)."""
    if h.ndim != 2 or h.shape[1] % (2 * BLOCK) or h.shape[1] == 0:
        raise ValueError(f"h: expected (rows, 2I) float32 with I a positive multiple of {BLOCK}, got {tuple(h.shape)}")
    rows, two_i = h.shape
    i = two_i // 2
    _check_array("h", h, (rows, two_i), (np.float32,))
    if offsets.ndim != 1 or offsets.shape[0] < 2:
        raise ValueError(f"offsets: expected (E+1,) int32 with E >= 1, got shape {tuple(offsets.shape)}")
    e = offsets.shape[0] - 1
    _check_array("offsets", offsets, (e + 1,), (np.int32,))
    _check_array("gate_global", gate_global, (e,), (np.float32,))
    _check_array("up_global", up_global, (e,), (np.float32,))
    _check_array("out_packed", out_packed, (rows, i // 2), (np.uint8,))
    _check_array("out_scales", out_scales, (rows, i // BLOCK), (np.uint8,))
    if a_out is not None:
        _check_array("a_out", a_out, (rows, i), (np.float32,))
    _check_counter(counter)
    return rows, i, e


# ---------------------------------------------------------------------------------------------
# launches
# ---------------------------------------------------------------------------------------------


def _grid(rows: int, k: int) -> tuple[int, int]:
    """(rows, column blocks): one 4-element step per thread."""
    blocks = -(-(k // 4) // THREADS)
    if blocks > 65535:
        raise ValueError(f"K={k} needs {blocks} column blocks, more than a grid's y dimension allows")
    return (rows, blocks)


def _stream(stream):
    import cupy as cp

    return stream if stream is not None else cp.cuda.get_current_stream()


def _require_device(**arrays) -> None:
    import cupy as cp

    for name, a in arrays.items():
        if a is not None and not isinstance(a, cp.ndarray):
            raise ValueError(f"{name}: must be a CuPy array on the device, got {type(a).__name__}")


def quantize_input(x, global_scale, out_packed, out_scales, counter, row_token=None, stream=None) -> None:
    """NVFP4-quantize rows of x with a static global: row r of the output is x[row_token[r]]
    (or x[r] without row_token). x (T, K) float32 or uint16 holding bf16 bits.

    row_token values must lie in [0, T): the caller checks them on the host (layer.check_routing);
    they are not read back here so the launch stays capturable.
    """
    rows, k = check_quantize_input(x, out_packed, out_scales, counter, row_token)
    g = check_global("global_scale", global_scale)
    _require_device(x=x, out_packed=out_packed, out_scales=out_scales, counter=counter, row_token=row_token)
    if rows == 0:
        return
    fn = jit.kernel(SOURCE, _expr_quantize(x.dtype))
    with _stream(stream):
        fn(_grid(rows, k), (THREADS,), (x, row_token if row_token is not None else _NULL, np.int32(k), g,
                                 out_packed, out_scales, counter))


def swiglu_quant(h, offsets, gate_global, up_global, input_scale, out_packed, out_scales, counter,
                 a_out=None, stream=None, counts_in: tuple[int, int] | None = None) -> None:
    """SwiGLU with per-expert gate/up globals, then NVFP4 with the static global `input_scale`.

    offsets (E+1,) int32 on the device must rise from 0 to rows (checked on the host when the
    routing is loaded; not read back here). `counts_in` as for grouped_gemm: only the rows of
    experts with that many tokens are read and written (default: every row).
    """
    rows, i, e = check_swiglu_quant(h, offsets, gate_global, up_global, out_packed, out_scales, counter, a_out)
    g = check_global("input_scale", input_scale)
    lo, hi = counts_range(counts_in)
    _require_device(h=h, offsets=offsets, gate_global=gate_global, up_global=up_global, out_packed=out_packed,
                    out_scales=out_scales, counter=counter, a_out=a_out)
    if rows == 0:
        return
    fn = jit.kernel(SOURCE, "lab_act::swiglu_quant")
    with _stream(stream):
        fn(_grid(rows, i), (THREADS,), (h, offsets, np.int32(e), np.int32(i), gate_global, up_global, g,
                                 out_packed, out_scales, a_out if a_out is not None else _NULL, counter,
                                 np.int32(lo), np.int32(hi)))


def gather_bf16(x, row_token, out, counter, stream=None) -> None:
    """The W4A16 layer's input: out row r = bf16 bits of x[row_token[r]] (x (T, K) float32,
    rounded to nearest even, or uint16 bf16 bits, copied); counts into `counter` the values the
    fp16 conversion of the W4A16 GEMM cannot hold (|v| >= 65536, Inf, NaN)."""
    if x.ndim != 2 or x.dtype not in (np.float32, np.uint16):
        raise ValueError(f"x: expected (T, K) float32 or uint16 (bf16 bits), got {x.shape} {x.dtype}")
    if row_token is None or row_token.ndim != 1:
        raise ValueError("row_token: expected the (rows,) int32 token of each grouped row")
    rows, k = row_token.shape[0], x.shape[1]
    _check_array("row_token", row_token, (rows,), (np.int32,))
    _check_array("out", out, (rows, k), (np.uint16,))
    _check_counter(counter)
    if k % 16:
        raise ValueError(f"x: K={k} must be a multiple of 16")
    _require_device(x=x, row_token=row_token, out=out, counter=counter)
    if rows == 0:
        return
    fn = jit.kernel(SOURCE, "lab_act::gather_bf16<float>" if x.dtype == np.float32 else
                    "lab_act::gather_bf16<lab_act::uint16_t>")
    with _stream(stream):
        fn(_grid(rows, k), (THREADS,), (x, row_token, np.int32(k), out, counter))


def swiglu_bf16(h, offsets, gate_global, up_global, out, counter, stream=None) -> None:
    """The W4A16 layer's SwiGLU: out (rows, I) uint16 = bf16 bits of silu(h_gate * gate_global[e])
    * (h_up * up_global[e]); counts into `counter` the values the w2 GEMM's fp16 conversion cannot
    hold (|a| >= 65536, Inf, NaN). offsets as for swiglu_quant."""
    rows = h.shape[0] if h.ndim == 2 else -1
    i = h.shape[1] // 2 if h.ndim == 2 else -1
    e = offsets.shape[0] - 1 if offsets.ndim == 1 else -1
    _check_array("h", h, (rows, 2 * i), (np.float32,))
    _check_array("offsets", offsets, (e + 1,), (np.int32,))
    _check_array("gate_global", gate_global, (e,), (np.float32,))
    _check_array("up_global", up_global, (e,), (np.float32,))
    _check_array("out", out, (rows, i), (np.uint16,))
    _check_counter(counter)
    if i % 16:
        raise ValueError(f"h: I={i} must be a multiple of 16")
    _require_device(h=h, offsets=offsets, gate_global=gate_global, up_global=up_global, out=out, counter=counter)
    if rows == 0:
        return
    fn = jit.kernel(SOURCE, "lab_act::swiglu_bf16")
    with _stream(stream):
        fn(_grid(rows, i), (THREADS,), (h, offsets, np.int32(e), np.int32(i), gate_global, up_global, out, counter))


def to_bf16(x, out, counter, stream=None) -> None:
    """out (uint16 bf16 bits) = x (float32) rounded to nearest even; same shape, size % 4 == 0."""
    _check_array("x", x, x.shape, (np.float32,))
    _check_array("out", out, x.shape, (np.uint16,))
    _check_counter(counter)
    if x.size % 4:
        raise ValueError(f"x: size {x.size} must be a multiple of 4")
    if x.size == 0:
        return
    _require_device(x=x, out=out, counter=counter)
    fn = jit.kernel(SOURCE, "lab_act::to_bf16")
    n4 = x.size // 4
    blocks = max(1, min(jit.sm_count() * BF16_BLOCKS_PER_SM, -(-n4 // 256)))
    with _stream(stream):
        fn((blocks,), (256,), (x, out, np.uint64(n4), counter))
