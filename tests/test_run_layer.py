"""scripts/run_layer.py without a GPU: argument checks, checkpoint checks, the bytes table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lab.checkpoint import save_checkpoint
from lab.gpu import gpu_available
from lab.problem import MoEProblem, random_weights
from lab.variants import ON_REQUEST

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "run_layer.py"
SMALL = ["--experts", "8", "--hidden", "128", "--intermediate", "64"]


@pytest.fixture(scope="module")
def run_layer():
    spec = importlib.util.spec_from_file_location("run_layer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "small.safetensors"
    save_checkpoint(path, random_weights(MoEProblem(4, 128, 64, 2), seed=2), layer=3)
    return path


def layer_rows(out: str) -> list[str]:
    """The bytes table's rows for the whole layer (second column "layer")."""
    return [line for line in out.splitlines() if line.split()[1:2] == ["layer"]]


no_gpu = pytest.mark.skipif(gpu_available(), reason="checks the path taken without a GPU")


@no_gpu
def test_without_a_gpu_prints_the_bytes_table_and_fails(run_layer, capsys, tmp_path):
    out_json = tmp_path / "r.json"
    assert run_layer.main([*SMALL, "--mean-tokens", "8", "32", "--json", str(out_json)]) == 1
    cap = capsys.readouterr()
    assert "roofline ms" in cap.out and "nominal H200" in cap.out
    assert len(layer_rows(cap.out)) == 2  # one layer row per mean
    assert "needs a CUDA GPU" in cap.err and "bytes table only" in cap.err
    data = json.loads(out_json.read_text())
    assert data["error"] == "no CUDA GPU" and data["problem"]["experts"] == 8
    assert {r["stage"] for r in data["bytes"]} == {"w13", "act", "w2", "layer"}


@no_gpu
def test_default_problem_bytes_match_the_study(run_layer, capsys):
    assert run_layer.main(["--mean-tokens", "8"]) == 1
    out = capsys.readouterr().out
    assert "4.077" in layer_rows(out)[0]  # weights GB at 288 x 4096 x 2048


@pytest.mark.parametrize("argv, word", [
    (["--variants", "fused"], "unknown fused; known: separate"),
    (["--mean-tokens", "0"], "--mean-tokens"),
    (["--mean-tokens", "nan"], "--mean-tokens"),
    (["--iterations", "0"], "--iterations"),
    (["--warmup", "-1"], "--warmup"),
    (["--rounds", "0"], "--rounds"),
    (["--settle-ms", "-1"], "--settle-ms"),
    (["--settle-ms", "nan"], "--settle-ms"),
    (["--iterations", "3", "--rounds", "4"], "--rounds: at most --iterations (3)"),
    (["--skew", "-0.5"], "--skew"),
    (["--check-experts", "4"], "--check-experts"),
    (["--hidden", "100"], "--hidden must be a multiple of 64"),
    (["--experts", "4", "--top-k", "8"], "--top-k=8 must be <= --experts=4"),
    (["--experts", "4"], "the study model's top_k=8 must be <= --experts=4"),
    (["--experts", "0"], "--experts"),
    (["--layer", "2"], "--layer: needs --checkpoint"),
    (["--checkpoint", "/nonexistent/c.safetensors"], "no such file"),
    (["--iterations", "x"], "invalid int"),
])
def test_bad_arguments_exit_2_naming_the_flag(run_layer, capsys, argv, word):
    with pytest.raises(SystemExit) as exc:
        run_layer.main(argv)
    assert exc.value.code == 2
    assert word in capsys.readouterr().err


def test_rounds_default_to_four_or_fewer_with_few_iterations(run_layer):
    assert run_layer.parse_args([]).rounds == 4
    assert run_layer.parse_args(["--iterations", "2"]).rounds == 2
    assert run_layer.parse_args(["--iterations", "9", "--rounds", "3"]).rounds == 3


def test_variants_are_deduplicated_in_order(run_layer):
    args = run_layer.parse_args(["--variants", "cuda-graph", "separate", "cuda-graph"])
    assert args.variants == ["cuda-graph", "separate"]
    default = run_layer.parse_args([]).variants
    assert default == [n for n in run_layer.NAMES if n not in ON_REQUEST]
    assert "separate" in default and "torch-fp8" in default and "w4a16" in default


def test_checkpoint_that_does_not_match_the_flags_is_refused(run_layer, capsys, small_checkpoint):
    assert run_layer.main(["--checkpoint", str(small_checkpoint), "--hidden", "256"]) == 2
    assert "--hidden 256 does not match the checkpoint's hidden=128" in capsys.readouterr().err
    assert run_layer.main(["--checkpoint", str(small_checkpoint), *SMALL]) == 2  # all three given
    assert "experts=4, the problem expects 8" in capsys.readouterr().err
    assert run_layer.main(["--checkpoint", str(small_checkpoint), "--layer", "0"]) == 2
    assert "layer 0 missing" in capsys.readouterr().err


def test_a_single_file_checkpoint_gives_its_top_k_or_says_it_has_none(run_layer, capsys, tmp_path):
    weights = random_weights(MoEProblem(8, 128, 64, 2), seed=2)
    save_checkpoint(tmp_path / "k.safetensors", weights, top_k=2)
    problem, _ = run_layer.resolve_problem(run_layer.parse_args(["--checkpoint", str(tmp_path / "k.safetensors")]))
    assert problem.top_k == 2 and "no top-k stored" not in capsys.readouterr().err
    save_checkpoint(tmp_path / "old.safetensors", weights)
    problem, _ = run_layer.resolve_problem(run_layer.parse_args(["--checkpoint", str(tmp_path / "old.safetensors")]))
    assert problem.top_k == 8 and "no top-k stored" in capsys.readouterr().err
    assert run_layer.main(["--checkpoint", str(tmp_path / "k.safetensors"), "--top-k", "9"]) == 2
    assert "--top-k=9 must be <= the checkpoint's experts=8" in capsys.readouterr().err


def test_malformed_checkpoint_is_refused(run_layer, capsys, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{not}")
    assert run_layer.main(["--checkpoint", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


@no_gpu
def test_checkpoint_shape_is_used(run_layer, capsys, small_checkpoint):
    assert run_layer.main(["--checkpoint", str(small_checkpoint), "--top-k", "2", "--mean-tokens", "4"]) == 1
    out = capsys.readouterr().out
    layer_row = layer_rows(out)[0]
    weights_gb = 4 * 3 * 128 * 64 * (0.5 + 1 / 16) / 1e9  # E x (w13 + w2) x (codes + scales)
    assert f"{weights_gb:.4g}" in layer_row


def test_correct_column_labels(run_layer):
    label = run_layer.correct_label
    base = {"skipped": None, "errors": [], "checks": []}
    assert label({**base, "expect": "baseline", "checks": [{"ok": True}]}) == "baseline"
    assert label({**base, "expect": "baseline", "checks": [{"ok": False}]}).startswith("baseline, FAILED")
    assert label({**base, "expect": "match", "checks": [{"ok": True}, {"ok": True}]}) == "match"
    assert label({**base, "expect": "match", "checks": [{"ok": True}, {"ok": False}]}) == "MISMATCH"
    assert label({**base, "expect": "ceiling"}) == "invalid, ceiling"
    assert label({**base, "expect": "approx", "checks": [{"rel": 1e-3}, {"rel": 3e-3}]}) == "approx (3.0e-03)"
    assert label({**base, "expect": "match"}) == "unchecked"
    assert label({**base, "expect": "match", "skipped": "needs x"}) == "skipped: needs x"
    assert label({**base, "expect": "match", "errors": ["boom"]}) == "ERROR: boom"


def test_gpu_state_line_parses_and_a_wrong_line_is_refused():
    from lab.device_info import parse_gpu_state

    st = parse_gpu_state("41, 612.35, 700.00, 1785, Active")
    assert st == {"temp_c": 41.0, "power_w": 612.35, "power_limit_w": 700.0, "sm_clock_mhz": 1785.0,
                  "sw_power_cap": "Active"}
    with pytest.raises(ValueError, match="expected 5 fields"):
        parse_gpu_state("41, 612.35")


@pytest.mark.parametrize("smi, want", [
    ("41, 612.35, 700.00, 1785, Active\n", {"temp_c": 41.0, "power_w": 612.35, "power_limit_w": 700.0,
                                            "sm_clock_mhz": 1785.0, "sw_power_cap": "Active"}),
    (FileNotFoundError(2, "No such file or directory", "nvidia-smi"), {}),  # no driver tools
    ("", {}),  # nothing printed
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", {}),
])
def test_gpu_state_reads_nvidia_smi_and_is_empty_without_it(monkeypatch, smi, want):
    import subprocess

    from lab import device_info

    asked = []

    def fake_run(argv, **kw):
        asked.append(argv)
        if isinstance(smi, Exception):
            raise smi
        return subprocess.CompletedProcess(argv, 0, smi, "")

    monkeypatch.setattr(device_info.subprocess, "run", fake_run)
    assert device_info.gpu_state() == want
    fields = "temperature.gpu,power.draw,power.limit,clocks.sm,clocks_event_reasons.sw_power_cap"
    assert asked == [["nvidia-smi", "--query-gpu=" + fields, "--format=csv,noheader,nounits"]]


def test_gpu_state_line_prints_fields_nvidia_smi_left_as_text():
    from lab.device_info import describe_gpu_state, parse_gpu_state

    assert describe_gpu_state(parse_gpu_state("41, 612.35, 700.00, 1785, Active")) == \
        "41 C, 612.35 of 700 W, SM 1785 MHz, power cap Active"
    assert describe_gpu_state(parse_gpu_state("[N/A], [N/A], 700.00, 1980, Not Active")) == \
        "[N/A] C, [N/A] of 700 W, SM 1980 MHz, power cap Not Active"
