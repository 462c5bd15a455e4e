"""Sharded checkpoints (lab/checkpoint.py): written by save_sharded_checkpoint / make_checkpoint
--shards, read back bit for bit from the directory, the index or a lone file; only the chosen
layer's routed experts read; config files checked; every malformed case a CheckpointError
naming the file and the tensor, raised from the headers alone (before any data is read)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab.checkpoint import (
    INDEX_NAME,
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
from oracles import assert_same_weights

ROOT = Path(__file__).resolve().parent.parent
SMALL = MoEProblem(experts=4, hidden=128, intermediate=64, top_k=2)


@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 6), st.sampled_from([64, 128]), st.sampled_from([64, 192]), st.integers(0, 60),
       st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_sharded_round_trip_is_bit_for_bit(tmp_path_factory, experts, hidden, intermediate, layer, shards, seed):
    shards = min(shards, experts)
    w = random_weights(MoEProblem(experts, hidden, intermediate, 1), seed=seed)
    d = tmp_path_factory.mktemp("sharded")
    paths = save_sharded_checkpoint(d, w, layer=layer, shards=shards, top_k=1)
    assert [p.name for p in paths] == [shard_name(k + 1, shards) for k in range(shards)]
    for where in (d, d / INDEX_NAME):
        got, rep = load_checkpoint(where, layer=layer)
        assert_same_weights(w, got)
        assert rep.layer == layer and rep.experts == experts and rep.files == paths and rep.top_k == 1
        assert rep.quant == {"quant_algo": "NVFP4", "group_size": 16, "source": "hf_quant_config.json + config.json"}
    # a layer that spans the shards: every shard holds some of its experts
    for p in paths:
        header, _ = read_header(p)
        assert any(n.startswith(f"model.layers.{layer}.mlp.experts.") for n in header)


def test_make_checkpoint_shards_read_back_by_run_layer_and_the_probe(tmp_path):
    d = tmp_path / "ckpt"
    res = subprocess.run([sys.executable, str(ROOT / "scripts/make_checkpoint.py"), str(d), "--experts", "6",
                          "--hidden", "128", "--intermediate", "64", "--shards", "3", "--seed", "4", "--check"],
                         capture_output=True, text=True, check=True)
    assert "wrote" in res.stdout and "read from 3 shards" in res.stdout
    assert res.stderr.count("writing model-0000") == 3  # a progress line per shard
    got, rep = load_checkpoint(d)
    assert_same_weights(random_weights(MoEProblem(6, 128, 64, 6), seed=4), got)
    res = subprocess.run([sys.executable, str(ROOT / "scripts/scale_fold_probe.py"), "--checkpoint", str(d),
                          "--sample-experts", "2"], capture_output=True, text=True, check=True)
    first = res.stdout.splitlines()[0]
    assert first.startswith(f"checkpoint {d} layer 0: 6 experts, H=128, I=64")


def test_run_layer_reads_a_directory_and_refuses_a_lone_shard(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("run_layer_sharded", ROOT / "scripts" / "run_layer.py")
    run_layer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_layer)
    d = tmp_path / "ckpt"
    save_sharded_checkpoint(d, random_weights(SMALL, seed=1), layer=2, shards=2, top_k=2)
    problem, plan = run_layer.resolve_problem(run_layer.parse_args(["--checkpoint", str(d)]))
    assert (problem.experts, problem.hidden, problem.intermediate, problem.top_k) == (4, 128, 64, 2)
    assert plan.layer == 2 and len(plan.files) == 2
    assert run_layer.main(["--checkpoint", str(d / shard_name(1, 2))]) == 2
    err = capsys.readouterr().err
    assert "is shard 1 of 2 and layer 2 continues in model-00002-of-00002.safetensors" in err


# ---------------------------------------------------------------------------------------------
# only the chosen layer's routed experts are read; the rest is reported as skipped
# ---------------------------------------------------------------------------------------------


def model_like(tmp_path, shards=3):
    """A directory like a real model's: two MoE layers with a shared expert each, a dense
    first layer, attention and embeddings (1 MB of it, never to be read)."""
    w = random_weights(SMALL, seed=3)
    big = np.ones((512, 512), np.float32)
    extra = {
        "model.embed_tokens.weight": ("F32", big),
        "model.layers.0.mlp.gate_proj.weight": ("U8", np.ones((64, 64), np.uint8)),
        "model.layers.0.mlp.down_proj.weight": ("U8", np.ones((64, 32), np.uint8)),
        "model.layers.1.self_attn.q_proj.weight": ("F32", big),
        "model.layers.1.mlp.shared_experts.gate_proj.weight": ("U8", np.ones((64, 64), np.uint8)),
        "model.layers.1.mlp.shared_experts.up_proj.weight": ("U8", np.ones((64, 64), np.uint8)),
        "model.layers.2.mlp.shared_experts.gate_proj.weight": ("U8", np.ones((64, 64), np.uint8)),
        **expert_tensors(random_weights(SMALL, seed=9), layer=2),
    }
    save_sharded_checkpoint(tmp_path, w, layer=1, shards=shards, extra=extra)
    return w


def test_only_the_layers_routed_experts_are_read_and_the_rest_reported(tmp_path):
    w = model_like(tmp_path)
    with pytest.raises(CheckpointError, match=r"holds layers \[1, 2\]; pass layer="):
        load_checkpoint(tmp_path)
    tracemalloc.start()
    got, rep = load_checkpoint(tmp_path, layer=1)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert_same_weights(w, got)
    assert peak < 1.5 * w.nbytes() + 200_000, peak  # not the 2 MB of embeddings and attention
    assert rep.skipped == {"layer 1 shared-expert tensors": 2, "dense MLP layers": "0", "other MoE layers": "2",
                           "their routed-expert tensors": 48, "other layers' shared-expert tensors": 1,
                           "other tensors (attention, norms, embeddings, ...)": 2}
    assert "skipped layer 1 shared-expert tensors: 2, dense MLP layers: 0" in rep.summary()
    json.dumps(rep.as_dict())


# ---------------------------------------------------------------------------------------------
# malformed: each raises CheckpointError naming the file and the tensor, from headers alone
# ---------------------------------------------------------------------------------------------

SHARD1, SHARD2 = shard_name(1, 2), shard_name(2, 2)


def two_shards(tmp_path, layer=0):
    save_sharded_checkpoint(tmp_path, random_weights(SMALL, seed=5), layer=layer, shards=2, top_k=2)
    return tmp_path


def rewrite_shard(d, name, change):
    """Rewrite shard `name` with change(tensors) applied (tensors: name -> (dtype, array))."""
    path = d / name
    header, start = read_header(path)
    raw = path.read_bytes()
    tensors = {}
    for n, info in header.items():
        a, b = info["data_offsets"]
        dtype = {"U8": np.uint8, "F8_E4M3": np.uint8, "F32": np.float32}[info["dtype"]]
        tensors[n] = (info["dtype"], np.frombuffer(raw[start + a:start + b], dtype).reshape(info["shape"]))
    change(tensors)
    write_safetensors(path, tensors)


def case_truncated(d):
    path = d / SHARD2
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-100])
    _, start = read_header(path)
    return path, ["tensor model.layers.0.mlp.experts.3.down_proj.", "data_offsets", f"the file is {size - 100} bytes",
                  f"its data section {size - 100 - start} bytes", "truncated"]


def case_wrong_shape(d):
    n = tensor_name(0, 2, "up_proj", "weight")
    rewrite_shard(d, SHARD2, lambda t: t.__setitem__(n, ("U8", t[n][1][:-1])))
    return d / SHARD2, [n, "has shape [63, 64], expected [64, 64]"]


def case_wrong_dtype(d):
    n = tensor_name(0, 1, "gate_proj", "weight_scale_2")
    rewrite_shard(d, SHARD1, lambda t: t.__setitem__(n, ("F16", t[n][1].astype(np.float16))))
    return d / SHARD1, [n, "has dtype F16, expected F32"]


def case_missing_expert(d):
    """Expert 3's tensors gone from the index and its shard: config.json says 4 experts."""
    index = json.loads((d / INDEX_NAME).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".experts.3." not in k}
    (d / INDEX_NAME).write_text(json.dumps(index))
    return d / INDEX_NAME, [tensor_name(0, 3, "gate_proj", "weight"), "missing"]


def case_tensor_not_where_the_index_says(d):
    n = tensor_name(0, 3, "down_proj", "weight_scale")
    rewrite_shard(d, SHARD2, lambda t: t.pop(n))
    return d / SHARD2, [n, "missing", f"the index {d / INDEX_NAME} places it here"]


def case_missing_shard(d):
    (d / SHARD2).unlink()
    return d / INDEX_NAME, [tensor_name(0, 2, "gate_proj", "weight"), f"is in shard {SHARD2}, which does not exist"]


def case_shard_alone_with_index(d):
    return d / SHARD1, [f"is shard 1 of 2 and layer 0 continues in {SHARD2}", tensor_name(0, 2, "gate_proj", "weight"),
                        "pass the directory"]


def case_shard_alone_with_config(d):
    (d / INDEX_NAME).unlink()
    return d / SHARD1, [tensor_name(0, 2, "gate_proj", "weight"), "missing"]


def case_shard_alone_with_nothing(d):
    for f in (INDEX_NAME, "config.json"):
        (d / f).unlink()
    return d / SHARD1, ["is shard 1 of 2, read alone", "pass the checkpoint's directory"]


def case_more_experts_than_config(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_experts"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    return d / INDEX_NAME, [tensor_name(0, 3, "gate_proj", "weight"), "num_experts = 3"]


def case_fp8_checkpoint(d):
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8", "group_size": None}}))
    return d / "hf_quant_config.json", ["quant_algo is 'FP8'; this lab reads NVFP4 only"]


def case_block_32(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 32
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "hf_quant_config.json").unlink()
    return d / "config.json", ["group_size is 32; NVFP4 here has 16-element blocks"]


def case_compressed_tensors(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (d / "config.json").write_text(json.dumps(cfg))
    return d / "config.json", ["quant_method is 'compressed-tensors'", "nvfp4-pack-quantized"]


def case_mixed_precision_fp8_experts(d):
    layers = {f"model.layers.0.mlp.experts.{e}.{p}": {"quant_algo": "NVFP4", "group_size": 16}
              for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    layers["model.layers.0.mlp.experts.2.down_proj"] = {"quant_algo": "FP8"}
    (d / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}))
    return d / "hf_quant_config.json", ["model.layers.0.mlp.experts.2.down_proj", "quant_algo is 'FP8'"]


def case_bad_index(d):
    (d / INDEX_NAME).write_text('{"metadata": {}}')
    return d / INDEX_NAME, ["no weight_map"]


CASES = [case_truncated, case_wrong_shape, case_wrong_dtype, case_missing_expert, case_tensor_not_where_the_index_says,
         case_missing_shard, case_shard_alone_with_index, case_shard_alone_with_config, case_shard_alone_with_nothing,
         case_more_experts_than_config, case_fp8_checkpoint, case_block_32, case_compressed_tensors,
         case_mixed_precision_fp8_experts, case_bad_index]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__[5:] for c in CASES])
def test_malformed_sharded_checkpoints_raise_naming_file_and_tensor(tmp_path, case):
    d = two_shards(tmp_path)
    where, words = case(d)
    target = where if where.name.endswith(".safetensors") and "alone" in case.__name__ else d
    for fn in (inspect_checkpoint, load_checkpoint):  # the headers alone already tell
        with pytest.raises(CheckpointError) as info:
            fn(target)
        msg = str(info.value)
        assert msg.startswith(str(where)), msg
        for w in words:
            assert w in msg, (w, msg)


def test_mixed_precision_with_nvfp4_experts_is_read(tmp_path):
    d = two_shards(tmp_path)
    layers = {f"model.layers.0.mlp.experts.{e}.{p}": {"quant_algo": "NVFP4", "group_size": 16}
              for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    (d / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}}))
    _, rep = load_checkpoint(d)
    assert rep.quant["quant_algo"] == "NVFP4"


def test_a_single_file_beside_a_config_is_checked_against_its_expert_count(tmp_path):
    w = random_weights(SMALL, seed=6)
    save_checkpoint(tmp_path / "model.safetensors", w)
    (tmp_path / "config.json").write_text(json.dumps({"n_routed_experts": 5}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.experts\.4\."
                                              r"gate_proj\.weight missing"):
        load_checkpoint(tmp_path)  # a directory with a lone model.safetensors
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_local_experts": 4,
                                                                      "num_experts_per_tok": 1}}))
    got, rep = load_checkpoint(tmp_path)
    assert_same_weights(w, got) and rep.top_k == 1


def test_paths_that_are_not_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_checkpoint(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=f"a directory without {INDEX_NAME} or model.safetensors"):
        load_checkpoint(tmp_path)


def test_shards_argument_is_checked(tmp_path):
    w = random_weights(SMALL, seed=7)
    for bad in (0, 5, 1.5):
        with pytest.raises(ValueError, match="shards must be an int in 1..4"):
            save_sharded_checkpoint(tmp_path, w, shards=bad)
