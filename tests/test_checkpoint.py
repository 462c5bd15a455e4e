import importlib.util
import json
import struct
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.checkpoint import (
    CheckpointError,
    expert_tensors,
    inspect_checkpoint,
    load_checkpoint,
    read_header,
    save_checkpoint,
    save_sharded_checkpoint,
    shard_name,
    tensor_name,
    write_safetensors,
)
from lab.problem import MoEProblem, random_weights
from oracles import assert_same_weights, e4m3_from_bits

SMALL = MoEProblem(experts=4, hidden=128, intermediate=64, top_k=2)


@settings(deadline=None, max_examples=15)
@given(st.integers(1, 5), st.sampled_from([64, 128]), st.sampled_from([64, 192]), st.integers(0, 40),
       st.integers(0, 2**31 - 1))
def test_round_trip_is_lossless(tmp_path_factory, experts, hidden, intermediate, layer, seed):
    p = MoEProblem(experts=experts, hidden=hidden, intermediate=intermediate, top_k=1, gate_up_ratio=1.2308)
    w = random_weights(p, seed)
    path = tmp_path_factory.mktemp("ckpt") / "m.safetensors"
    save_checkpoint(path, w, layer=layer)
    got, report = load_checkpoint(path, problem=p)
    assert_same_weights(w, got)
    assert report.layer == layer and report.experts == experts
    assert (report.hidden, report.intermediate) == (hidden, intermediate)
    np.testing.assert_allclose(report.gate_up_ratio, w.gate_global.astype(np.float64) / w.up_global)
    assert report.scale_dtype == "F8_E4M3"


def test_report_spread_and_names(tmp_path):
    w = random_weights(SMALL, 0)
    w.up_global[2] = w.gate_global[2] / 1.5  # one expert far from the others
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, w, layer=10)
    _, rep = load_checkpoint(path, layer=10)
    assert rep.ratio_max == pytest.approx(1.5, rel=1e-6)
    assert rep.ratio_min == pytest.approx(float(np.min(w.gate_global.astype(np.float64) / w.up_global)))
    assert rep.ratio_spread == pytest.approx((rep.ratio_max - rep.ratio_min) / rep.ratio_mean)
    assert "layer 10" in rep.summary() and json.dumps(rep.as_dict())
    header, _ = read_header(path)
    assert header[tensor_name(10, 3, "down_proj", "weight")]["shape"] == [128, 32]
    assert header[tensor_name(10, 0, "gate_proj", "weight_scale")]["dtype"] == "F8_E4M3"
    assert header[tensor_name(10, 0, "up_proj", "weight_scale_2")]["shape"] == []


def read_safetensors_bytes(path) -> tuple[dict, dict]:
    """An independent reader, from the safetensors format description: an 8-byte little-endian
    header length n, n bytes of JSON, then the data section; each tensor's data_offsets are
    [begin, end) in the data section, little-endian, C order. Returns ({name: raw bytes}, header)."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", None)
    assert meta is None or all(isinstance(v, str) for v in meta.values())
    data = raw[8 + n:]
    spans = sorted(tuple(info["data_offsets"]) for info in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data), "the tensors cover the data section exactly"
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "no gap and no overlap between tensors"
    return {name: data[info["data_offsets"][0]:info["data_offsets"][1]] for name, info in header.items()}, header


def test_every_tensor_reads_back_with_an_independent_reader(tmp_path):
    """The layout save_checkpoint writes, read without lab.checkpoint: names, dtypes, shapes and
    bytes of every tensor; F8_E4M3 scales decoded from their bits (oracles) and as ml_dtypes'
    float8_e4m3fn, F32 scalars as little-endian floats."""
    w = random_weights(SMALL, int(np.random.default_rng().integers(2**31)))
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, w, layer=7)
    blobs, header = read_safetensors_bytes(path)
    i = SMALL.intermediate
    want = {}
    for e in range(SMALL.experts):
        for proj, rows, packed, scales, wg, ig in (
                ("gate_proj", slice(0, i), w.w13_packed, w.w13_scales, w.gate_global, w.w13_input_scale),
                ("up_proj", slice(i, 2 * i), w.w13_packed, w.w13_scales, w.up_global, w.w13_input_scale),
                ("down_proj", slice(None), w.w2_packed, w.w2_scales, w.w2_global, w.w2_input_scale)):
            name = f"model.layers.7.mlp.experts.{e}.{proj}."
            want[name + "weight"] = ("U8", packed[e, rows])
            want[name + "weight_scale"] = ("F8_E4M3", scales[e, rows])
            want[name + "weight_scale_2"] = ("F32", np.float32(wg[e]))
            want[name + "input_scale"] = ("F32", np.float32(ig))
    assert set(header) == set(want)
    for name, (dtype, arr) in want.items():
        assert header[name]["dtype"] == dtype and header[name]["shape"] == list(np.shape(arr)), name
        if dtype == "F32":
            (value,) = struct.unpack("<f", blobs[name])
            assert value == arr, name
            continue
        got = np.frombuffer(blobs[name], np.uint8).reshape(arr.shape)
        np.testing.assert_array_equal(got, arr, err_msg=name)
        if dtype == "F8_E4M3":
            f8 = np.frombuffer(blobs[name], ml_dtypes.float8_e4m3fn).reshape(arr.shape).astype(np.float64)
            np.testing.assert_array_equal(f8, e4m3_from_bits(arr), err_msg=name)


def test_safetensors_library_reads_our_files(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    w = random_weights(SMALL, 1)
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, w)
    with safetensors.safe_open(str(path), framework="np") as f:
        assert len(list(f.keys())) == 4 * 3 * 4
        np.testing.assert_array_equal(f.get_tensor(tensor_name(0, 2, "up_proj", "weight")), w.w13_packed[2, 64:])
        np.testing.assert_array_equal(f.get_tensor(tensor_name(0, 1, "down_proj", "weight")), w.w2_packed[1])


def test_u8_scales_and_shape_1_scalars_are_accepted(tmp_path):
    w = random_weights(SMALL, 2)
    t = expert_tensors(w)
    for name, (dtype, arr) in list(t.items()):
        if name.endswith(".weight_scale"):
            t[name] = ("U8", arr)
        elif arr.ndim == 0:
            t[name] = (dtype, arr.reshape(1))
    write_safetensors(tmp_path / "u8.safetensors", t)
    got, rep = load_checkpoint(tmp_path / "u8.safetensors")
    assert_same_weights(w, got)
    assert rep.scale_dtype == "U8"


def test_per_expert_input_scales_take_the_max(tmp_path):
    w = random_weights(SMALL, 3)
    t = expert_tensors(w)
    t[tensor_name(0, 2, "up_proj", "input_scale")] = ("F32", np.float32(0.5))
    write_safetensors(tmp_path / "m.safetensors", t)
    got, rep = load_checkpoint(tmp_path / "m.safetensors")
    assert got.w13_input_scale == 0.5 and rep.w13_input_scales[2] == 0.5
    assert got.w2_input_scale == w.w2_input_scale


def test_load_streams_into_preallocated_arrays(tmp_path):
    p = MoEProblem(experts=8, hidden=512, intermediate=256, top_k=1)
    w = random_weights(p, 4)
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, w)
    size = path.stat().st_size
    tracemalloc.start()
    got, _ = load_checkpoint(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert_same_weights(w, got)
    assert peak < 1.2 * size, f"peak {peak} bytes for a {size}-byte checkpoint"


# ---------------------------------------------------------------------------------------------
# malformed files: each raises CheckpointError naming the tensor and what was expected
# ---------------------------------------------------------------------------------------------


def mutate(t, case):
    """Apply one defect to the tensor dict; return the text the error must contain."""
    n = tensor_name(0, 1, "up_proj", "weight_scale")
    if case == "missing tensor":
        del t[n]
        return f"{n} missing"
    if case == "wrong shape":
        t[n] = ("F8_E4M3", t[n][1][:-1])
        return f"{n} has shape [63, 8], expected [64, 8]"
    if case == "wrong dtype":
        n = tensor_name(0, 2, "down_proj", "weight")
        t[n] = ("I8", t[n][1].view(np.int8))
        return f"{n} has dtype I8, expected U8"
    if case == "wrong scalar dtype":
        n = tensor_name(0, 0, "gate_proj", "weight_scale_2")
        t[n] = ("F16", t[n][1].astype(np.float16))
        return f"{n} has dtype F16, expected F32"
    if case == "expert count mismatch between projections":
        for part in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            del t[tensor_name(0, 3, "down_proj", part)]
        return f"{tensor_name(0, 3, 'down_proj', 'weight')} missing"
    if case == "gap in expert ids":
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for part in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
                del t[tensor_name(0, 2, proj, part)]
        return f"{tensor_name(0, 2, 'gate_proj', 'weight')} missing"
    if case == "zero global":
        n = tensor_name(0, 3, "up_proj", "weight_scale_2")
        t[n] = ("F32", np.float32(0))
        return f"{n} is 0.0, expected a finite positive scale"
    raise AssertionError(case)


CASES = ["missing tensor", "wrong shape", "wrong dtype", "wrong scalar dtype",
         "expert count mismatch between projections", "gap in expert ids", "zero global"]


@pytest.mark.parametrize("case", CASES)
def test_malformed_files_raise_checkpoint_error(tmp_path, case):
    t = expert_tensors(random_weights(SMALL, 5))
    expected = mutate(t, case)
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, t)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert expected in str(info.value)
    assert isinstance(info.value, ValueError)


def test_expert_count_against_problem(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, random_weights(SMALL, 6))
    with pytest.raises(CheckpointError, match="experts=4, the problem expects 5"):
        load_checkpoint(path, problem=MoEProblem(experts=5, hidden=128, intermediate=64, top_k=2))
    with pytest.raises(CheckpointError, match="hidden=128, the problem expects 256"):
        load_checkpoint(path, problem=MoEProblem(experts=4, hidden=256, intermediate=64, top_k=2))


def test_layer_selection(tmp_path):
    w = random_weights(SMALL, 7)
    t = {**expert_tensors(w, layer=3), **expert_tensors(w, layer=5)}
    path = tmp_path / "two.safetensors"
    write_safetensors(path, t)
    with pytest.raises(CheckpointError, match=r"holds layers \[3, 5\]; pass layer="):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="layer 4 missing"):
        load_checkpoint(path, layer=4)
    got, rep = load_checkpoint(path, layer=5)
    assert rep.layer == 5
    assert_same_weights(w, got)


def test_no_expert_tensors(tmp_path):
    path = tmp_path / "other.safetensors"
    write_safetensors(path, {"lm_head.weight": ("F32", np.ones((2, 2), np.float32))})
    with pytest.raises(CheckpointError, match="no tensor named"):
        load_checkpoint(path)


def test_truncated_and_garbage_files(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, random_weights(SMALL, 8))
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="data_offsets"):
        load_checkpoint(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(struct.pack("<Q", 5) + b"{nope" + b"\0" * 8)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(junk)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        load_checkpoint(huge)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="too short"):
        load_checkpoint(tiny)


# ---------------------------------------------------------------------------------------------
# top-k: config.json's, else the files' metadata, else the caller's default
# ---------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def test_a_single_file_keeps_its_top_k(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, random_weights(SMALL, 1), top_k=2)
    _, rep = load_checkpoint(path)
    assert rep.top_k == 2 and "top-k 2" in rep.summary()
    assert inspect_checkpoint(path).problem().top_k == 2


def test_a_file_without_top_k_keeps_the_default(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, random_weights(SMALL, 1))  # as files were written before the metadata key
    _, rep = load_checkpoint(path)
    assert rep.top_k is None and "top-k" not in rep.summary()
    assert inspect_checkpoint(path).problem().top_k == min(8, SMALL.experts)


def test_make_checkpoint_single_file_reads_back_its_top_k(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("make_checkpoint", ROOT / "scripts" / "make_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "f.safetensors"
    assert mod.main([str(path), "--experts", "4", "--hidden", "64", "--intermediate", "64", "--top-k", "2",
                     "--check"]) == 0
    assert "top-k 2" in capsys.readouterr().out
    assert load_checkpoint(path)[1].top_k == 2


def test_sharded_and_single_file_store_top_k_alike(tmp_path):
    w = random_weights(SMALL, 3)
    save_sharded_checkpoint(tmp_path / "d", w, shards=2, top_k=3)
    for k in (1, 2):
        raw = (tmp_path / "d" / shard_name(k, 2)).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        assert json.loads(raw[8:8 + n])["__metadata__"]["top_k"] == "3"
    (tmp_path / "d" / "config.json").unlink()  # the metadata alone still says it
    assert load_checkpoint(tmp_path / "d" / "model.safetensors.index.json")[1].top_k == 3


def test_config_json_wins_over_the_metadata(tmp_path):
    save_checkpoint(tmp_path / "model.safetensors", random_weights(SMALL, 4), top_k=2)
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 4, "num_experts_per_tok": 1}))
    assert load_checkpoint(tmp_path)[1].top_k == 1


@pytest.mark.parametrize("value, word", [("0", "metadata top_k is '0', expected a positive integer"),
                                         ("two", "metadata top_k is 'two', expected a positive integer")])
def test_a_bad_top_k_in_the_metadata_is_refused(tmp_path, value, word):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, expert_tensors(random_weights(SMALL, 5)), {"top_k": value})
    with pytest.raises(CheckpointError, match=word):
        load_checkpoint(path)


def test_shards_that_disagree_on_top_k_are_refused(tmp_path):
    d = tmp_path / "d"
    w = random_weights(SMALL, 6)
    save_sharded_checkpoint(d, w, shards=2, top_k=2)
    (d / "config.json").unlink()
    write_safetensors(d / shard_name(2, 2), expert_tensors(w, 0, range(2, 4)), {"top_k": 3})
    with pytest.raises(CheckpointError, match="disagree on top_k"):
        load_checkpoint(d)
