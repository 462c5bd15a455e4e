"""ModelOpt-style NVFP4 expert weights in safetensors files, stacked into MoEWeights.

Per expert e of layer L, for proj in gate_proj, up_proj (w13 halves) and down_proj (w2):

    model.layers.{L}.mlp.experts.{e}.{proj}.weight          U8       (rows, K/2)   packed e2m1
    model.layers.{L}.mlp.experts.{e}.{proj}.weight_scale    F8_E4M3  (rows, K/16)  block scales
    model.layers.{L}.mlp.experts.{e}.{proj}.weight_scale_2  F32      ()            weight global
    model.layers.{L}.mlp.experts.{e}.{proj}.input_scale     F32      ()            activation global

gate/up: rows = I, K = H; down: rows = H, K = I. safetensors' NumPy backend has no float8
dtype, so this module reads and writes the format itself (8-byte little-endian header length,
JSON header, raw little-endian data); it accepts U8 as well as F8_E4M3 for weight_scale, and
shape (1,) as well as () for scalars.

A checkpoint is one .safetensors file, or a directory as Hugging Face lays a model out:
``model.safetensors.index.json`` (its weight_map names each tensor's shard) beside
``model-0000k-of-0000n.safetensors`` shards, or a lone ``model.safetensors``; the index file's
own path stands for its directory. Only the chosen layer's routed-expert tensors are read,
streamed from each shard straight into preallocated stacked arrays (memory is about that
layer's size); shared experts, dense MLP layers and everything else are skipped, and the
report says what was. ``hf_quant_config.json`` and ``config.json`` beside the checkpoint, when
present, must describe NVFP4 with 16-element blocks (else CheckpointError naming what they
say), and config.json's routed-expert count is checked against the experts found, so a shard
read alone never passes for a whole layer. Every check runs before any data is read: a
malformed checkpoint raises CheckpointError naming the file and the tensor, and nothing is
returned half-loaded.

Top-k: config.json's num_experts_per_tok, else the ``top_k`` of the safetensors files' metadata,
which this module's writers store when given one (so a single file keeps it too); a checkpoint
that says neither leaves it to the caller (CheckpointPlan.problem: 8, at most the experts), as
files written before the metadata key existed do.

Activation globals: a checkpoint holds one input_scale per expert and projection; the lab's
layer uses one per GEMM, the largest over experts (what engines do), and the report says how
much they varied.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .nvfp4 import BLOCK
from .problem import MoEProblem, MoEWeights

PROJS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
QUANT_CONFIG = "hf_quant_config.json"
MODEL_CONFIG = "config.json"
_NAME = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale|weight_scale_2|input_scale)"
)
# DeepSeek's mlp.shared_experts.*, Qwen2-MoE's mlp.shared_expert.* (and its shared_expert_gate)
_SHARED = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_experts?(_gate)?\..*")
_DENSE = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\..*")
_SHARD = re.compile(r".*-(\d+)-of-(\d+)\.safetensors")
_DTYPES = {"U8": np.uint8, "F8_E4M3": np.uint8, "F32": np.float32}  # F8 is read as raw bytes
_MAX_HEADER = 100 << 20
# config.json's routed-expert count: DeepSeek-V3, Qwen3-MoE, Llama-4 / Mixtral
_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


class CheckpointError(ValueError):
    """A checkpoint that does not hold the expected tensors; the message names the file and tensor."""


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


def expert_tensors(weights: MoEWeights, layer: int = 0, experts: range | None = None) -> dict:
    """{name: (dtype, array view)} for every expert tensor of `weights` (or of `experts`), ModelOpt names."""
    I = weights.intermediate
    out = {}
    for e in experts if experts is not None else range(weights.experts):
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


_METADATA = {"format": "pt", "quant_algo": "NVFP4", "writer": "lab.checkpoint"}
TOP_K_KEY = "top_k"  # the metadata key of the routing's top-k (a single file has no config.json)


def _metadata(top_k: int | None) -> dict:
    return _METADATA if top_k is None else {**_METADATA, TOP_K_KEY: int(top_k)}


def save_checkpoint(path, weights: MoEWeights, layer: int = 0, top_k: int | None = None) -> None:
    """Write `weights` as layer `layer` of a ModelOpt-style NVFP4 safetensors checkpoint, with
    `top_k` (when given) in its metadata, which the reader takes as the routing's top-k."""
    write_safetensors(path, expert_tensors(weights, layer), _metadata(top_k))


def shard_name(k: int, n: int) -> str:
    """Hugging Face's name for shard k (1-based) of n."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def save_sharded_checkpoint(directory, weights: MoEWeights, layer: int = 0, shards: int = 2, top_k: int | None = None,
                            extra: dict | None = None, progress=None) -> list[Path]:
    """Write `weights` as layer `layer` of a sharded checkpoint in `directory` (created): `shards`
    files of consecutive experts, so the layer spans them all, plus model.safetensors.index.json,
    hf_quant_config.json and a config.json with the routed-expert count (and top_k when given,
    also in each shard's metadata, as save_checkpoint stores it).

    ``extra``: more {name: (dtype, array)} for the last shard (shared experts, dense layers).
    ``progress``: called with a line per shard written. Returns the shard paths.
    """
    if not isinstance(shards, (int, np.integer)) or not 1 <= shards <= weights.experts:
        raise ValueError(f"shards must be an int in 1..{weights.experts} (one expert at least per shard), got {shards!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, weights.experts, shards + 1).round().astype(int)
    weight_map, paths, total = {}, [], 0
    for k in range(shards):
        tensors = expert_tensors(weights, layer, range(bounds[k], bounds[k + 1]))
        if k == shards - 1 and extra:
            tensors.update(extra)
        path = directory / shard_name(k + 1, shards)
        if progress:
            progress(f"writing {path.name}: experts {bounds[k]}..{bounds[k + 1] - 1}")
        write_safetensors(path, tensors, _metadata(top_k))
        weight_map.update({n: path.name for n in tensors})
        total += sum(np.asarray(a).nbytes for _, a in tensors.values())
        paths.append(path)
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2))
    quant = {"quant_algo": "NVFP4", "group_size": BLOCK}
    (directory / QUANT_CONFIG).write_text(json.dumps(
        {"producer": {"name": "lab.checkpoint"}, "quantization": {**quant, "exclude_modules": []}}, indent=2))
    config = {"num_experts": weights.experts, "hidden_size": weights.hidden,
              "moe_intermediate_size": weights.intermediate, "quantization_config": {"quant_method": "modelopt", **quant}}
    if top_k is not None:
        config["num_experts_per_tok"] = int(top_k)
    (directory / MODEL_CONFIG).write_text(json.dumps(config, indent=2))
    return paths


# ---------------------------------------------------------------------------------------------
# reading: one file's header
# ---------------------------------------------------------------------------------------------


def _read_header(path) -> tuple[dict, dict, int, int]:
    """(header without __metadata__, metadata, data section start, file size)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    with f:
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
    meta = header.pop("__metadata__", None)
    return header, meta if isinstance(meta, dict) else {}, 8 + n, size


def read_header(path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset of the data section). Raises CheckpointError."""
    header, _meta, start, _size = _read_header(path)
    return header, start


# ---------------------------------------------------------------------------------------------
# reading: where a checkpoint's tensors are, and what its config files say
# ---------------------------------------------------------------------------------------------


@dataclass
class _Files:
    """A checkpoint's tensor names and the file holding each, before any shard is opened."""

    path: Path  # as given
    directory: Path  # where config files are looked for
    index: Path | None  # model.safetensors.index.json, when sharded
    where: dict[str, Path]  # tensor name -> file
    source: Path  # what messages about the whole layer name: the index, or the one file
    headers: dict = field(default_factory=dict)  # file -> (header, metadata, data start, size), read lazily

    def header(self, path: Path):
        if path not in self.headers:
            self.headers[path] = _read_header(path)
        return self.headers[path]


def _locate(path) -> _Files:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            return _from_index(path, path / INDEX_NAME)
        if (path / SINGLE_NAME).is_file():
            return _from_file(path, path / SINGLE_NAME)
        raise CheckpointError(f"{path}: a directory without {INDEX_NAME} or {SINGLE_NAME}")
    if path.name.endswith(".index.json"):
        return _from_index(path, path)
    return _from_file(path, path)


def _from_file(given: Path, file: Path) -> _Files:
    header, _meta, _start, _size = _read_header(file)
    files = _Files(given, file.parent, None, {n: file for n in header}, file)
    files.headers[file] = (header, _meta, _start, _size)
    return files


def _from_index(given: Path, index: Path) -> _Files:
    try:
        doc = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index}: not a readable JSON index ({exc})") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise CheckpointError(f"{index}: no weight_map of tensor name -> shard file")
    return _Files(given, index.parent, index, {n: index.parent / v for n, v in wmap.items()}, index)


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from None
    return doc if isinstance(doc, dict) else None


@dataclass
class QuantConfig:
    """What the config files beside a checkpoint say about it (None: not said)."""

    quant_algo: str | None = None
    group_size: int | None = None
    source: str = "none"  # the file(s) the settings came from
    experts: int | None = None  # config.json's routed-expert count
    experts_key: str | None = None
    top_k: int | None = None  # config.json's num_experts_per_tok, else the files' top_k metadata


def _layer_module(name: str) -> str:
    return name.rsplit(".", 1)[0]


def read_quant_config(directory, layer: int | None = None, modules=()) -> QuantConfig:
    """hf_quant_config.json (ModelOpt) and config.json's quantization_config in `directory`.

    Raises CheckpointError when they describe anything but NVFP4 with 16-element blocks,
    naming the file and what it says. ModelOpt's MIXED_PRECISION lists each quantized
    module: then every one of `modules` (the layer's expert projections) is checked.
    """
    directory = Path(directory)
    q = QuantConfig()
    found = []
    hf = _read_json(directory / QUANT_CONFIG)
    if hf is not None:
        quant = hf.get("quantization", hf)
        if isinstance(quant, dict):
            algo = quant.get("quant_algo")
            if algo == "MIXED_PRECISION":
                layers = quant.get("quantized_layers") or {}
                for m in modules:
                    entry = layers.get(m)
                    if not isinstance(entry, dict):
                        raise CheckpointError(f"{directory / QUANT_CONFIG}: quant_algo MIXED_PRECISION does not list "
                                              f"{m}; expected NVFP4 with group_size 16")
                    _check_quant(directory / QUANT_CONFIG, entry.get("quant_algo"), entry.get("group_size"), m)
                algo = "NVFP4"
                q.group_size = BLOCK
            else:
                _check_quant(directory / QUANT_CONFIG, algo, quant.get("group_size"))
                q.group_size = quant.get("group_size")
            q.quant_algo = algo
            found.append(QUANT_CONFIG)
    cfg = _read_json(directory / MODEL_CONFIG)
    if cfg is not None:
        for c in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
            for key in _EXPERT_KEYS:
                if isinstance(c.get(key), int) and q.experts is None:
                    q.experts, q.experts_key = c[key], key
            if isinstance(c.get("num_experts_per_tok"), int) and q.top_k is None:
                q.top_k = c["num_experts_per_tok"]
        qc = cfg.get("quantization_config")
        if isinstance(qc, dict):
            method = qc.get("quant_method")
            if method not in (None, "modelopt"):
                raise CheckpointError(f"{directory / MODEL_CONFIG}: quantization_config.quant_method is {method!r} "
                                      f"(format {qc.get('format')!r}); expected ModelOpt's NVFP4 (quant_method "
                                      f"'modelopt'), whose tensor names this reader takes")
            algo = qc.get("quant_algo")
            group = qc.get("group_size")
            for g in (qc.get("config_groups") or {}).values():
                if isinstance(g, dict) and isinstance(g.get("weights"), dict) and group is None:
                    group = g["weights"].get("group_size")
            if algo != "MIXED_PRECISION":
                _check_quant(directory / MODEL_CONFIG, algo, group)
                q.quant_algo = q.quant_algo or algo
                q.group_size = q.group_size or group
            found.append(MODEL_CONFIG)
    q.source = " + ".join(found) or "none"
    return q


def _check_quant(path, algo, group, module: str | None = None) -> None:
    where = f"{path}" + (f" ({module})" if module else "")
    if algo is not None and str(algo).upper() != "NVFP4":
        raise CheckpointError(f"{where}: quant_algo is {algo!r}; this lab reads NVFP4 only")
    if group is not None and group != BLOCK:
        raise CheckpointError(f"{where}: group_size is {group!r}; NVFP4 here has {BLOCK}-element blocks")


# ---------------------------------------------------------------------------------------------
# reading: one layer
# ---------------------------------------------------------------------------------------------


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
    files: list = field(default_factory=list)  # the files read, in order
    skipped: dict = field(default_factory=dict)  # what was not read: {what: count or layers}
    quant: dict = field(default_factory=dict)  # quant_algo, group_size, source (the config files)
    top_k: int | None = None  # config.json's num_experts_per_tok, else the files' top_k metadata, when present

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
            "files": [str(f) for f in self.files], "skipped": self.skipped, "quant": self.quant, "top_k": self.top_k,
        }

    def summary(self) -> str:
        text = (
            f"layer {self.layer}: {self.experts} experts, H={self.hidden}, I={self.intermediate}; "
            f"gate/up global ratio min {self.ratio_min:.4f} mean {self.ratio_mean:.4f} "
            f"max {self.ratio_max:.4f} (spread {100 * self.ratio_spread:.2f}%)"
        )
        if self.top_k is not None:
            text += f"; top-k {self.top_k}"
        if len(self.files) > 1:
            text += f"; read from {len(self.files)} shards"
        if self.skipped:
            text += "; skipped " + describe_skipped(self.skipped)
        return text


def describe_skipped(skipped: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in skipped.items())


def _ranges(values) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    v = sorted(values)
    out, i = [], 0
    while i < len(v):
        j = i
        while j + 1 < len(v) and v[j + 1] == v[j] + 1:
            j += 1
        out.append(str(v[i]) if i == j else f"{v[i]}-{v[j]}")
        i = j + 1
    return ", ".join(out)


@dataclass
class CheckpointPlan:
    """One layer of a checkpoint, checked and ready to read: shapes, the byte range of every
    tensor, the config files' word. Built from headers only (inspect_checkpoint)."""

    path: Path
    layer: int
    experts: int
    hidden: int
    intermediate: int
    reads: list  # (file, file offset, nbytes, (proj, part, expert))
    scale_dtypes: set
    files: list
    skipped: dict
    quant: QuantConfig

    def problem(self, top_k: int | None = None) -> MoEProblem:
        k = top_k or self.quant.top_k or min(8, self.experts)
        return MoEProblem(self.experts, self.hidden, self.intermediate, min(k, self.experts))


def _classify(names, layer_of=None) -> tuple[dict, dict]:
    """({layer: {name: (expert, proj, part)}} of routed-expert tensors, what else there is)."""
    found: dict[int, dict] = {}
    shared: dict[int, int] = {}
    dense: set[int] = set()
    other = 0
    for name in names:
        m = _NAME.fullmatch(name)
        if m:
            found.setdefault(int(m.group(1)), {})[name] = (int(m.group(2)), m.group(3), m.group(4))
            continue
        m = _SHARED.fullmatch(name)
        if m:
            shared[int(m.group(1))] = shared.get(int(m.group(1)), 0) + 1
            continue
        m = _DENSE.fullmatch(name)
        if m:
            dense.add(int(m.group(1)))
            continue
        other += 1
    return found, {"shared": shared, "dense": dense, "other": other}


def _pick_layer(path, found: dict, layer: int | None) -> int:
    if not found:
        raise CheckpointError(f"{path}: no tensor named model.layers.{{L}}.mlp.experts.{{e}}.{{proj}}.{{part}}")
    layers = sorted(found)
    listed = str(layers) if len(layers) <= 8 else f"[{_ranges(layers)}]"
    if layer is None:
        if len(found) > 1:
            raise CheckpointError(f"{path}: holds layers {listed}; pass layer=")
        layer = layers[0]
    if layer not in found:
        raise CheckpointError(f"{path}: layer {layer} missing (file holds layers {listed})")
    return layer


def _expect(path, header: dict, name: str, dtypes: tuple[str, ...], shapes: tuple[tuple, ...], data_start: int,
            size: int) -> tuple[int, int, str]:
    """Check one tensor's entry; return (start, end, dtype) relative to the data section."""
    if name not in header:
        raise CheckpointError(f"{path}: tensor {name} missing")
    info = header[name]
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: tensor {name} has no dtype / shape / data_offsets entry")
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in dtypes:
        raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}, expected {' or '.join(dtypes)}")
    if not isinstance(shape, list) or tuple(shape) not in shapes:
        raise CheckpointError(f"{path}: tensor {name} has shape {shape}, expected {list(shapes[0])}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
    if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
            and 0 <= offs[0] and offs[1] - offs[0] == nbytes):
        raise CheckpointError(f"{path}: tensor {name} has data_offsets {offs}, expected a range of {nbytes} bytes "
                              f"({dtype} {shape})")
    data = size - data_start
    if offs[1] > data:
        raise CheckpointError(f"{path}: tensor {name} has data_offsets {offs}, past the end of the data section: "
                              f"the file is {size} bytes, its data section {data} bytes (after the {data_start}-byte "
                              f"header); the file is truncated")
    return offs[0], offs[1], dtype


def _check_single_shard(files: _Files, layer: int, quant: QuantConfig) -> None:
    """A file read alone that names itself shard k of n (n > 1) may hold part of a layer: refuse
    unless config.json's expert count (checked later) or an index beside it vouches for it."""
    m = _SHARD.fullmatch(files.path.name)
    if files.index is not None or not m or int(m.group(2)) <= 1:
        return
    index = files.path.parent / INDEX_NAME
    if index.is_file():
        other = _from_index(index, index)
        for name, shard in other.where.items():
            mm = _NAME.fullmatch(name)
            if mm and int(mm.group(1)) == layer and shard.name != files.path.name:
                raise CheckpointError(f"{files.path}: is shard {int(m.group(1))} of {int(m.group(2))} and layer {layer} "
                                      f"continues in {shard.name} (tensor {name}, per {index}); pass the directory "
                                      f"{files.path.parent}")
        return
    if quant.experts is None:
        raise CheckpointError(f"{files.path}: is shard {int(m.group(1))} of {int(m.group(2))}, read alone, with no "
                              f"{INDEX_NAME} or {MODEL_CONFIG} beside it to say whether layer {layer} continues in "
                              f"another shard; pass the checkpoint's directory")


def _metadata_top_k(used: list, files: _Files) -> int | None:
    """The top-k the files' metadata store (None: none does); CheckpointError when it is not a
    positive integer or the files disagree."""
    found = {}
    for f in used:
        text = files.header(f)[1].get(TOP_K_KEY)
        if text is None:
            continue
        try:
            k = int(text)
        except (TypeError, ValueError):
            k = 0
        if k < 1:
            raise CheckpointError(f"{f}: metadata {TOP_K_KEY} is {text!r}, expected a positive integer")
        found[f] = k
    if len(set(found.values())) > 1:
        raise CheckpointError(f"{files.source}: the files' metadata disagree on {TOP_K_KEY}: "
                              + ", ".join(f"{f.name}: {k}" for f, k in found.items()))
    return next(iter(found.values()), None)


def inspect_checkpoint(path, layer: int | None = None, problem: MoEProblem | None = None) -> CheckpointPlan:
    """Check one layer of a checkpoint from its headers and config files alone (no tensor data
    is read): which layer, its shape, every tensor's dtype, shape and byte range. Raises
    CheckpointError naming the file and the tensor for anything malformed or missing."""
    files = _locate(path)
    found, rest = _classify(files.where)
    layer = _pick_layer(files.source, found, layer)
    names = found[layer]
    E = max(e for e, _, _ in names.values()) + 1
    modules = sorted({_layer_module(n) for n in names})
    quant = read_quant_config(files.directory, layer, modules)
    _check_single_shard(files, layer, quant)
    where = files.source

    def name(e, proj, part):
        return tensor_name(layer, e, proj, part)

    if quant.experts is not None:
        if E > quant.experts:
            raise CheckpointError(f"{where}: layer {layer} has tensor {name(E - 1, 'gate_proj', 'weight')}, but "
                                  f"{files.directory / MODEL_CONFIG} says {quant.experts_key} = {quant.experts}")
        E = quant.experts

    exists: dict = {}

    def file_of(n):
        if n not in files.where:
            raise CheckpointError(f"{where}: tensor {n} missing")
        f = files.where[n]
        if f not in exists:
            exists[f] = f.is_file()
        if not exists[f]:
            raise CheckpointError(f"{files.index}: tensor {n} is in shard {f.name}, which does not exist in {f.parent}")
        return f

    # shapes from expert 0's gate and down weights
    for n in (name(0, "gate_proj", "weight"), name(0, "down_proj", "weight")):
        f = file_of(n)
        header = files.header(f)[0]
        if n not in header:
            raise CheckpointError(f"{f}: tensor {n} missing" + (f" (the index {files.index} places it here)"
                                                                 if files.index else ""))
        if not isinstance(header[n], dict) or not isinstance(header[n].get("shape"), list) or len(header[n]["shape"]) != 2:
            raise CheckpointError(f"{f}: tensor {n} is not 2-D")
    f0 = file_of(name(0, "gate_proj", "weight"))
    I, half_h = files.header(f0)[0][name(0, "gate_proj", "weight")]["shape"]
    H = 2 * half_h
    if H % 64 or I % 64 or I <= 0 or H <= 0:
        raise CheckpointError(f"{f0}: tensor {name(0, 'gate_proj', 'weight')} has shape {[I, half_h]}; hidden and "
                              f"intermediate must be positive multiples of 64")
    if problem is not None:
        for fld, want, got in (("experts", problem.experts, E), ("hidden", problem.hidden, H),
                               ("intermediate", problem.intermediate, I)):
            if want != got:
                raise CheckpointError(f"{where}: layer {layer} has {fld}={got}, the problem expects {want}")

    reads, scale_dtypes, used = [], set(), []
    for e in range(E):
        for proj, (rows, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            specs = (("weight", ("U8",), ((rows, k // 2),)),
                     ("weight_scale", ("F8_E4M3", "U8"), ((rows, k // BLOCK),)),
                     ("weight_scale_2", ("F32",), ((), (1,))),
                     ("input_scale", ("F32",), ((), (1,))))
            for part, dtypes, shapes in specs:
                n = name(e, proj, part)
                f = file_of(n)
                header, _meta, start, size = files.header(f)
                if n not in header and files.index is not None:
                    raise CheckpointError(f"{f}: tensor {n} missing (the index {files.index} places it here)")
                s, t, dt = _expect(f, header, n, dtypes, shapes, start, size)
                reads.append((f, start + s, t - s, (proj, part, e)))
                if part == "weight_scale":
                    scale_dtypes.add(dt)
                if f not in used:
                    used.append(f)
    for f in used:  # our own files (and ModelOpt's) say what they hold
        algo = files.header(f)[1].get("quant_algo")
        if algo is not None:
            _check_quant(f, algo, None)
    if quant.top_k is None:
        quant.top_k = _metadata_top_k(used, files)

    skipped = {}
    if rest["shared"].get(layer):
        skipped[f"layer {layer} shared-expert tensors"] = rest["shared"][layer]
    if rest["dense"]:
        skipped["dense MLP layers"] = _ranges(rest["dense"])
    others = sorted(set(found) - {layer})
    if others:
        skipped["other MoE layers"] = _ranges(others)
        skipped["their routed-expert tensors"] = sum(len(found[x]) for x in others)
    shared_other = sum(v for k, v in rest["shared"].items() if k != layer)
    if shared_other:
        skipped["other layers' shared-expert tensors"] = shared_other
    if rest["other"]:
        skipped["other tensors (attention, norms, embeddings, ...)"] = rest["other"]
    return CheckpointPlan(files.path, layer, E, H, I, reads, scale_dtypes, used, skipped, quant)


def load_checkpoint(path, layer: int | None = None, problem: MoEProblem | None = None,
                    plan: CheckpointPlan | None = None) -> tuple[MoEWeights, CheckpointReport]:
    """Read one layer's NVFP4 routed experts into MoEWeights, plus a CheckpointReport.

    ``path``: a .safetensors file, a directory (sharded with its index, or model.safetensors)
    or the index file. ``layer`` None takes the only MoE layer there is. ``problem``
    (optional) must match the layer's experts, hidden and intermediate sizes. ``plan``: an
    inspect_checkpoint result for the same arguments, so the headers are not read twice.
    Malformed checkpoints raise CheckpointError naming the file and the tensor; nothing is read
    before every tensor has been checked.
    """
    plan = plan or inspect_checkpoint(path, layer, problem)
    E, H, I = plan.experts, plan.hidden, plan.intermediate
    w13_packed = np.empty((E, 2 * I, H // 2), np.uint8)
    w13_scales = np.empty((E, 2 * I, H // BLOCK), np.uint8)
    w2_packed = np.empty((E, H, I // 2), np.uint8)
    w2_scales = np.empty((E, H, I // BLOCK), np.uint8)
    scalars = {(p, part): np.empty(E, np.float32) for p in PROJS for part in ("weight_scale_2", "input_scale")}

    def dest(proj, part, e):
        if part in ("weight_scale_2", "input_scale"):
            return scalars[(proj, part)][e:e + 1]
        rows = {"gate_proj": slice(0, I), "up_proj": slice(I, 2 * I), "down_proj": slice(None)}[proj]
        if proj == "down_proj":
            return w2_packed[e] if part == "weight" else w2_scales[e]
        return (w13_packed if part == "weight" else w13_scales)[e, rows]

    by_file: dict = {}
    for f, offset, nbytes, key in plan.reads:
        by_file.setdefault(f, []).append((offset, nbytes, key))
    for f, reads in by_file.items():
        reads.sort(key=lambda r: r[0])
        try:
            fh = open(f, "rb")
        except OSError as exc:
            raise CheckpointError(f"{f}: cannot be read ({exc.strerror or exc})") from None
        with fh:
            for offset, nbytes, (proj, part, e) in reads:
                fh.seek(offset)
                view = memoryview(dest(proj, part, e)).cast("B")
                if fh.readinto(view) != nbytes:
                    raise CheckpointError(f"{f}: file ends inside tensor {tensor_name(plan.layer, e, proj, part)} "
                                          f"(at byte {offset}); it changed after its header was checked")
    if np.dtype(np.float32).byteorder == ">":  # safetensors data is little-endian
        for a in scalars.values():
            a.byteswap(inplace=True)

    for (proj, part), a in scalars.items():
        bad = np.flatnonzero(~np.isfinite(a) | (a <= 0))
        if bad.size:
            n = tensor_name(plan.layer, int(bad[0]), proj, part)
            f = next(r[0] for r in plan.reads if r[3] == (proj, part, int(bad[0])))
            raise CheckpointError(f"{f}: tensor {n} is {a[bad[0]]}, expected a finite positive scale")

    gate_g, up_g = scalars[("gate_proj", "weight_scale_2")], scalars[("up_proj", "weight_scale_2")]
    w13_in = np.maximum(scalars[("gate_proj", "input_scale")], scalars[("up_proj", "input_scale")])
    w2_in = scalars[("down_proj", "input_scale")]
    weights = MoEWeights(
        w13_packed, w13_scales, gate_g, up_g, w2_packed, w2_scales, scalars[("down_proj", "weight_scale_2")],
        float(w13_in.max()), float(w2_in.max()),
    )
    q = plan.quant
    report = CheckpointReport(
        str(plan.path), plan.layer, E, H, I, gate_g.astype(np.float64) / up_g.astype(np.float64),
        w13_in, w2_in.copy(), "+".join(sorted(plan.scale_dtypes)), files=list(plan.files), skipped=dict(plan.skipped),
        quant={"quant_algo": q.quant_algo, "group_size": q.group_size, "source": q.source}, top_k=q.top_k,
    )
    return weights, report
