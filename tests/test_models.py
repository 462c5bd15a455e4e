"""lab/models.py: the presets, --model in the scripts, explicit flags over a preset."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from lab import models
from lab.checkpoint import save_checkpoint
from lab.gemm_bench import study_parser
from lab.gpu import gpu_available
from lab.problem import MoEProblem, random_weights

ROOT = Path(__file__).resolve().parent.parent


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the published config.json values (lab/models.py names the fields): experts, hidden, intermediate, top-k
PUBLISHED = {
    "study": (288, 4096, 2048, 8),
    "deepseek-v3": (256, 7168, 2048, 8),
    "qwen3-235b-a22b": (128, 4096, 1536, 8),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "llama-4-maverick": (128, 5120, 8192, 1),
}


def test_presets_are_the_published_shapes():
    assert set(models.MODELS) == set(PUBLISHED)
    for name, shape in PUBLISHED.items():
        m = models.model(name)
        assert (m.experts, m.hidden, m.intermediate, m.top_k) == shape
        assert m.problem().validate() == MoEProblem(*shape)
        assert "config.json" in m.source or name == "study"
    assert models.model("DeepSeek-R1") is models.model("deepseek-v3")
    assert models.MODELS[models.DEFAULT_MODEL].problem() == MoEProblem()  # the study's default shape


def test_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match=r"--model: unknown 'gpt'; known: study, deepseek-v3.*\(or 'list'\)"):
        models.model("gpt")


def parser():
    ap = argparse.ArgumentParser()
    models.add_shape_arguments(ap)
    return ap


@pytest.mark.parametrize("argv, want", [
    ([], (288, 4096, 2048, 8)),
    (["--model", "qwen3-30b-a3b"], (128, 2048, 768, 8)),
    (["--model", "qwen3-30b-a3b", "--top-k", "4"], (128, 2048, 768, 4)),
    (["--model", "deepseek-v3", "--experts", "64", "--intermediate", "1024"], (64, 7168, 1024, 8)),
    (["--hidden", "512"], (288, 512, 2048, 8)),
])
def test_explicit_flags_override_the_preset(argv, want):
    ap = parser()
    args = ap.parse_args(argv)
    p = models.resolve_shape(args, ap)
    assert (p.experts, p.hidden, p.intermediate, p.top_k) == want
    assert (args.experts, args.hidden, args.intermediate, args.top_k) == want


@pytest.mark.parametrize("argv, word", [
    (["--model", "nope"], "--model: unknown 'nope'"),
    (["--model", "llama-4-maverick", "--hidden", "100"], "--hidden must be a multiple of 64"),
    (["--model", "qwen3-30b-a3b", "--experts", "4"], "the qwen3-30b-a3b model's top_k=8 must be <= --experts=4"),
    (["--model", "qwen3-30b-a3b", "--top-k", "200"], "--top-k=200 must be <= the qwen3-30b-a3b model's experts=128"),
    (["--experts", "0"], "--experts: must be >= 1"),
])
def test_bad_shapes_exit_2_naming_the_flag(argv, word, capsys):
    ap = parser()
    with pytest.raises(SystemExit) as exc:
        models.resolve_shape(ap.parse_args(argv), ap)
    assert exc.value.code == 2 and word in capsys.readouterr().err


def test_clamped_top_k_follows_few_experts_unless_given():
    ap = parser()
    assert models.resolve_shape(ap.parse_args(["--experts", "3"]), ap, clamp_top_k=True).top_k == 3
    with pytest.raises(SystemExit):
        models.resolve_shape(ap.parse_args(["--experts", "3", "--top-k", "8"]), ap, clamp_top_k=True)


def test_study_parser_flags_get_help_and_the_preset():
    ap = study_parser("doc", [8], 3)  # the shape flags come with it
    text = ap.format_help()
    assert text.count("a multiple of 64") == 2 and "--model NAME" in text and "experts each token" in text
    args = ap.parse_args(["--model", "qwen3-235b-a22b"])
    assert models.resolve_shape(args, ap) == MoEProblem(128, 4096, 1536, 8)


@pytest.mark.parametrize("script", ["run_layer", "bench_gemm", "tile_sweep", "read_roofline", "chunk_study",
                                    "profile_kernels", "make_checkpoint"])
def test_model_list_prints_every_preset(script, capsys):
    mod = load(script)
    argv = ["x.safetensors", "--model", "list"] if script == "make_checkpoint" else ["--model", "list"]
    with pytest.raises(SystemExit) as exc:
        mod.main(argv)
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    for name, (e, h, i, k) in PUBLISHED.items():
        line = next(ln for ln in out.splitlines() if ln.startswith(name))
        assert [t for t in line.split() if t.isdigit()][:4] == [str(e), str(h), str(i), str(k)]


@pytest.mark.skipif(gpu_available(), reason="checks the path taken without a GPU")
def test_run_layer_with_a_model_prints_its_bytes(capsys):
    assert load("run_layer").main(["--model", "deepseek-v3", "--mean-tokens", "8"]) == 1
    out = capsys.readouterr().out
    weights_gb = 256 * 3 * 7168 * 2048 * (0.5 + 1 / 16) / 1e9
    layer = [ln for ln in out.splitlines() if ln.split()[1:2] == ["layer"]]
    assert f"{weights_gb:.4g}" in layer[0]


def test_run_layer_refuses_a_model_its_checkpoint_does_not_match(tmp_path, capsys):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, random_weights(MoEProblem(4, 128, 64, 2), seed=1))
    assert load("run_layer").main(["--checkpoint", str(path), "--model", "qwen3-30b-a3b"]) == 2
    assert "--model qwen3-30b-a3b has experts=128, the checkpoint's layer 0 has experts=4" in capsys.readouterr().err
