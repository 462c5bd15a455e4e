"""ModelOpt-style NVFP4 expert weights in safetensors files, stacked into MoEWeights.

Per expert e of layer L, for proj in gate_proj, up_proj (w13 halves) and down_proj (w2):

    model.layers.{L}.mlp.experts.{e}.{proj}.weight          U8       (rows, K/2)   packed e2m1
    model.layers.{L}.mlp.experts.{e}.{proj}.weight_scale    F8_E4M3  (rows, K/16)  block scales
    model.layers.{L}.mlp.experts.{e}.{proj}.weight_scale_2  F32      ()            weight global
    model.layers.{L}.mlp.experts.{e}.{proj}.input_scale     F32      ()            activation global

gate/up: rows = I, K = H; down: rows = H, K = I. safetensors' NumPy backend has no float8
dtype, so this module reads and writes the format itself (8-byte little-endian header length,
JSON header, raw little-endian data); it accepts U8 as well as F8_E4M3 for weight_scale, and
shape (1,) as well as () for scalars. Loading streams each tensor from the file straight into
preallocated stacked arrays, so memory is about the checkpoint's size.

Activation globals: a checkpoint holds one input_scale per expert and projection; the lab's
layer uses one per GEMM, the largest over experts (what engines do), and the report says how
much they varied.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .nvfp4 import BLOCK
from .problem import MoEProblem, MoEWeights

PROJS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_NAME = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale|weight_scale_2|input_scale)"
)
_DTYPES = {"U8": np.uint8, "F8_E4M3": np.uint8, "F32": np.float32}  # F8 is read as raw bytes
_MAX_HEADER = 100 << 20


class CheckpointError(ValueError):
    """A checkpoint file that does not hold the expected tensors; the message names the tensor."""


def tensor_name(layer: int, expert: int, proj: str, part: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.{part}"


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write {name: (dtype, array)} to `path` in safetensors format, in the given order.

    dtype is a safetensors dtype string ("U8", "F8_E4M3", "F32", ...); the array's raw
    bytes are written as they are (pass uint8 bits for F8_E4M3).
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name, (dtype, arr) in tensors.items():
        arr = np.asarray(arr)
        if not arr.flags.c_contiguous:
            arr = arr.copy()  # (np.ascontiguousarray would turn a 0-d scalar into shape (1,))
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in arrays:
            f.write(memoryview(arr.reshape(-1)).cast("B"))


def expert_tensors(weights: MoEWeights, layer: int = 0) -> dict:
    """{name: (dtype, array view)} for every expert tensor of `weights`, ModelOpt names."""
    I = weights.intermediate
    out = {}
    for e in range(weights.experts):
        halves = {
            "gate_proj": (weights.w13_packed[e, :I], weights.w13_scales[e, :I], weights.gate_global[e], weights.w13_input_scale),
            "up_proj": (weights.w13_packed[e, I:], weights.w13_scales[e, I:], weights.up_global[e], weights.w13_input_scale),
            "down_proj": (weights.w2_packed[e], weights.w2_scales[e], weights.w2_global[e], weights.w2_input_scale),
        }
        for proj, (packed, scales, wglobal, iscale) in halves.items():
            out[tensor_name(layer, e, proj, "weight")] = ("U8", packed)
            out[tensor_name(layer, e, proj, "weight_scale")] = ("F8_E4M3", scales)
            out[tensor_name(layer, e, proj, "weight_scale_2")] = ("F32", np.asarray(wglobal, np.float32).reshape(()))
            out[tensor_name(layer, e, proj, "input_scale")] = ("F32", np.asarray(iscale, np.float32).reshape(()))
    return out


def save_checkpoint(path, weights: MoEWeights, layer: int = 0) -> None:
    """Write `weights` as layer `layer` of a ModelOpt-style NVFP4 safetensors checkpoint."""
    write_safetensors(path, expert_tensors(weights, layer), {"quant_algo": "NVFP4", "writer": "lab.checkpoint"})


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def read_header(path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset of the data section). Raises CheckpointError."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n


@dataclass
class CheckpointReport:
    """What load_checkpoint found: shape, and the gate/up global ratio per expert."""

    path: str
    layer: int
    experts: int
    hidden: int
    intermediate: int
    gate_up_ratio: np.ndarray  # (E,) float64: gate weight_scale_2 / up weight_scale_2
    w13_input_scales: np.ndarray  # (E,) float32, the larger of gate's and up's per expert
    w2_input_scales: np.ndarray  # (E,) float32
    scale_dtype: str  # weight_scale dtype as stored: "F8_E4M3", "U8" (or "F8_E4M3+U8")

    @property
    def ratio_min(self) -> float:
        return float(self.gate_up_ratio.min())

    @property
    def ratio_mean(self) -> float:
        return float(self.gate_up_ratio.mean())

    @property
    def ratio_max(self) -> float:
        return float(self.gate_up_ratio.max())

    @property
    def ratio_spread(self) -> float:
        """(max - min) / mean of the per-expert gate/up ratio."""
        return (self.ratio_max - self.ratio_min) / self.ratio_mean

    def as_dict(self) -> dict:
        return {
            "path": self.path, "layer": self.layer, "experts": self.experts, "hidden": self.hidden,
            "intermediate": self.intermediate, "scale_dtype": self.scale_dtype,
            "ratio_min": self.ratio_min, "ratio_mean": self.ratio_mean, "ratio_max": self.ratio_max,
            "ratio_spread": self.ratio_spread,
            "w13_input_scale_min": float(self.w13_input_scales.min()),
            "w13_input_scale_max": float(self.w13_input_scales.max()),
            "w2_input_scale_min": float(self.w2_input_scales.min()),
            "w2_input_scale_max": float(self.w2_input_scales.max()),
        }

    def summary(self) -> str:
        return (
            f"layer {self.layer}: {self.experts} experts, H={self.hidden}, I={self.intermediate}; "
            f"gate/up global ratio min {self.ratio_min:.4f} mean {self.ratio_mean:.4f} "
            f"max {self.ratio_max:.4f} (spread {100 * self.ratio_spread:.2f}%)"
        )


def _pick_layer(path, header: dict, layer: int | None) -> tuple[int, dict]:
    found: dict[int, dict] = {}
    for name in header:
        m = _NAME.fullmatch(name)
        if m:
            found.setdefault(int(m.group(1)), {})[name] = (int(m.group(2)), m.group(3), m.group(4))
    if not found:
        raise CheckpointError(f"{path}: no tensor named model.layers.{{L}}.mlp.experts.{{e}}.{{proj}}.{{part}}")
    if layer is None:
        if len(found) > 1:
            raise CheckpointError(f"{path}: holds layers {sorted(found)}; pass layer=")
        layer = next(iter(found))
    if layer not in found:
        raise CheckpointError(f"{path}: layer {layer} missing (file holds layers {sorted(found)})")
    return layer, found[layer]


def _expect(path, header: dict, name: str, dtypes: tuple[str, ...], shapes: tuple[tuple, ...], data_end: int) -> tuple[int, int, str]:
    """Check one tensor's entry; return (start, end, dtype) relative to the data section."""
    if name not in header:
        raise CheckpointError(f"{path}: tensor {name} missing")
    info = header[name]
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in dtypes:
        raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}, expected {' or '.join(dtypes)}")
    if not isinstance(shape, list) or tuple(shape) not in shapes:
        raise CheckpointError(f"{path}: tensor {name} has shape {shape}, expected {list(shapes[0])}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
    if not (isinstance(offs, list) and len(offs) == 2 and offs[1] - offs[0] == nbytes and 0 <= offs[0] and offs[1] <= data_end):
        raise CheckpointError(f"{path}: tensor {name} has data_offsets {offs}, expected {nbytes} bytes inside the file's {data_end}")
    return offs[0], offs[1], dtype


def load_checkpoint(path, layer: int | None = None, problem: MoEProblem | None = None) -> tuple[MoEWeights, CheckpointReport]:
    """Read one layer's NVFP4 experts into MoEWeights, plus a CheckpointReport.

    ``layer`` None takes the only layer in the file. ``problem`` (optional) must match the
    file's experts, hidden and intermediate sizes. Malformed files raise CheckpointError
    naming the tensor and what was expected.
    """
    path = Path(path)
    header, data_start = read_header(path)
    data_end = path.stat().st_size - data_start
    layer, names = _pick_layer(path, header, layer)
    experts = {e for e, _, _ in names.values()}
    E = max(experts) + 1

    def name(e, proj, part):
        return tensor_name(layer, e, proj, part)

    # shapes from expert 0's gate and down weights
    for n in (name(0, "gate_proj", "weight"), name(0, "down_proj", "weight")):
        if n not in header or not isinstance(header[n].get("shape"), list) or len(header[n]["shape"]) != 2:
            raise CheckpointError(f"{path}: tensor {n} missing or not 2-D")
    I, half_h = header[name(0, "gate_proj", "weight")]["shape"]
    H = 2 * half_h
    if H % 64 or I % 64 or I <= 0 or H <= 0:
        raise CheckpointError(f"{path}: tensor {name(0, 'gate_proj', 'weight')} has shape {[I, half_h]}; hidden and intermediate must be positive multiples of 64")
    if problem is not None:
        for field, want, got in (("experts", problem.experts, E), ("hidden", problem.hidden, H), ("intermediate", problem.intermediate, I)):
            if want != got:
                raise CheckpointError(f"{path}: layer {layer} has {field}={got}, the problem expects {want}")

    w13_packed = np.empty((E, 2 * I, H // 2), np.uint8)
    w13_scales = np.empty((E, 2 * I, H // BLOCK), np.uint8)
    w2_packed = np.empty((E, H, I // 2), np.uint8)
    w2_scales = np.empty((E, H, I // BLOCK), np.uint8)
    scalars = {(p, part): np.empty(E, np.float32) for p in PROJS for part in ("weight_scale_2", "input_scale")}

    reads = []  # (file offset, end, destination)
    scale_dtypes = set()
    for e in range(E):
        dest = {
            "gate_proj": (w13_packed[e, :I], w13_scales[e, :I], (I, H)),
            "up_proj": (w13_packed[e, I:], w13_scales[e, I:], (I, H)),
            "down_proj": (w2_packed[e], w2_scales[e], (H, I)),
        }
        for proj, (packed, scales, (rows, k)) in dest.items():
            s, t, _ = _expect(path, header, name(e, proj, "weight"), ("U8",), ((rows, k // 2),), data_end)
            reads.append((s, t, packed))
            s, t, dt = _expect(path, header, name(e, proj, "weight_scale"), ("F8_E4M3", "U8"), ((rows, k // BLOCK),), data_end)
            reads.append((s, t, scales))
            scale_dtypes.add(dt)
            for part in ("weight_scale_2", "input_scale"):
                s, t, _ = _expect(path, header, name(e, proj, part), ("F32",), ((), (1,)), data_end)
                reads.append((s, t, scalars[(proj, part)][e : e + 1]))

    reads.sort(key=lambda r: r[0])
    with open(path, "rb") as f:
        for start, end, dst in reads:
            f.seek(data_start + start)
            view = memoryview(dst).cast("B")
            if f.readinto(view) != end - start:
                raise CheckpointError(f"{path}: file ends inside a tensor's data at offset {start}")
    if np.dtype(np.float32).byteorder == ">":  # safetensors data is little-endian
        for a in scalars.values():
            a.byteswap(inplace=True)

    for (proj, part), a in scalars.items():
        bad = np.flatnonzero(~np.isfinite(a) | (a <= 0))
        if bad.size:
            n = name(int(bad[0]), proj, part)
            raise CheckpointError(f"{path}: tensor {n} is {a[bad[0]]}, expected a finite positive scale")

    gate_g, up_g = scalars[("gate_proj", "weight_scale_2")], scalars[("up_proj", "weight_scale_2")]
    w13_in = np.maximum(scalars[("gate_proj", "input_scale")], scalars[("up_proj", "input_scale")])
    w2_in = scalars[("down_proj", "input_scale")]
    weights = MoEWeights(
        w13_packed, w13_scales, gate_g, up_g, w2_packed, w2_scales, scalars[("down_proj", "weight_scale_2")],
        float(w13_in.max()), float(w2_in.max()),
    )
    report = CheckpointReport(
        str(path), layer, E, H, I, gate_g.astype(np.float64) / up_g.astype(np.float64),
        w13_in, w2_in.copy(), "+".join(sorted(scale_dtypes)),
    )
    return weights, report
