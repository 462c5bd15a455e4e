"""TMA tensor maps over prepared weights, for the grouped GEMM's weight stream.

The producer copies each pipeline stage (one contiguous run of `stage_bytes`) with one
`cp.async.bulk.tensor.3d`: the map views the weights as [stage][row][element], a box is one
whole stage, and the kernel names it by its stage index alone. The bytes and their order in
shared memory are those of a 1-D `cp.async.bulk` of the same run; the tensor path streams
faster (notes/gemm-log.md v13).

CuPy has no binding for the driver's cuTensorMapEncodeTiled, so it is called through ctypes.
The 128-byte map lives in device memory (the kernel takes its address), one per weight array,
made once (at preparation) and cached by what it encodes: address, size and stage length.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

MAP_BYTES = 128
MAX_BOX = 256  # elements per box dimension
# CUtensorMapDataType for unsigned elements of 1, 2, 4 and 8 bytes
_DTYPE = {1: 0, 2: 1, 4: 2, 8: 4}


@dataclass(frozen=True)
class StageGeometry:
    """One stage as a box of `rows` rows of `elems` elements of `elem_bytes` each."""

    elem_bytes: int
    elems: int
    rows: int

    @property
    def row_bytes(self) -> int:
        return self.elem_bytes * self.elems


def stage_geometry(stage_bytes: int) -> StageGeometry:
    """Rows of 256 bytes where they divide the stage (64 or 128 otherwise: every stage is whole
    576-byte atoms), widened to 2-8 byte elements while the stage would need more than 256 rows."""
    if stage_bytes <= 0 or stage_bytes % 64:
        raise ValueError(f"stage_bytes must be a positive multiple of 64, got {stage_bytes}")
    row = next(r for r in (256, 128, 64) if stage_bytes % r == 0)
    while stage_bytes // row > MAX_BOX:
        if row >= 8 * MAX_BOX or stage_bytes % (2 * row):
            raise ValueError(f"a stage of {stage_bytes} bytes does not fit one tensor-map box "
                             f"(at most {MAX_BOX} rows of up to {8 * MAX_BOX} bytes)")
        row *= 2
    elem = max(1, row // MAX_BOX)
    return StageGeometry(elem, row // elem, stage_bytes // row)


def encode_args(ptr: int, nbytes: int, stage_bytes: int) -> dict:
    """cuTensorMapEncodeTiled's arguments (besides the output) for weights at `ptr`."""
    if ptr % 16:
        raise ValueError(f"tensor-map base address must be 16-byte aligned, got {ptr:#x}")
    if nbytes <= 0 or nbytes % stage_bytes:
        raise ValueError(f"weights of {nbytes} bytes are not whole stages of {stage_bytes}")
    geo = stage_geometry(stage_bytes)
    return {"dtype": _DTYPE[geo.elem_bytes], "rank": 3, "address": ptr,
            "dims": (geo.elems, geo.rows, nbytes // stage_bytes),
            "strides": (geo.row_bytes, stage_bytes),  # bytes, for dims 1 and 2
            "box": (geo.elems, geo.rows, 1), "element_strides": (1, 1, 1)}


def _encode(args: dict) -> bytes:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"tensor maps need the CUDA driver (libcuda.so.1): {e}") from None
    buf = ctypes.create_string_buffer(MAP_BYTES + 64)
    addr = (ctypes.addressof(buf) + 63) & ~63  # CUtensorMap is 64-byte aligned
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = cuda.cuTensorMapEncodeTiled(
        ctypes.c_void_p(addr), ctypes.c_int(args["dtype"]), u32(args["rank"]), ctypes.c_void_p(args["address"]),
        (u64 * 3)(*args["dims"]), (u64 * 2)(*args["strides"]), (u32 * 3)(*args["box"]),
        (u32 * 3)(*args["element_strides"]),
        ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0))  # interleave, swizzle, L2 promotion, OOB fill: none
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for {args}")
    return ctypes.string_at(addr, MAP_BYTES)


_MAPS: dict = {}


def device_map(data, stage_bytes: int):
    """The device-resident tensor map of the CuPy array `data` (prepared weights), made once per
    (address, size, stage length). Not during stream capture: a launch captured into a graph must
    find its map made (preparation makes it)."""
    import cupy as cp
    import numpy as np

    if not data.flags.c_contiguous:
        raise ValueError("prepared weights must be one contiguous array to take a tensor map")
    key = (data.data.ptr, data.nbytes, stage_bytes)
    found = _MAPS.get(key)
    if found is None:
        if cp.cuda.runtime.streamIsCapturing(cp.cuda.get_current_stream().ptr):
            raise RuntimeError("tensor map of these weights not made before stream capture: prepare the "
                               "weights (or slice their experts) before capturing")
        found = cp.asarray(np.frombuffer(_encode(encode_args(*key)), np.uint8))
        _MAPS[key] = found
    return found
