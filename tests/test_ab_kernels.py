"""The same-process A/B's parts that need no GPU: another kernel tree's source, the tree switch,
and scripts/ab_kernels.py's arguments."""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from pathlib import Path

import pytest

from lab.kernels import jit

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ab_kernels.py"


def load_script():
    spec = importlib.util.spec_from_file_location("ab_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def edited_tree(tmp_path: Path, marker: str) -> Path:
    """A copy of lab/kernels whose innermost header carries `marker`."""
    tree = tmp_path / "kernels"
    shutil.copytree(jit.KERNEL_DIR, tree, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    ptx = tree / "gemm" / "ptx.cuh"
    ptx.write_text(ptx.read_text() + f"\n// {marker}\n")
    return tree


def test_source_reads_another_tree_with_its_headers(tmp_path):
    tree = edited_tree(tmp_path, "lab-ab-marker-1")
    text = jit.source("grouped_gemm.cu", tree)
    assert "lab-ab-marker-1" in text and '#include "' not in text
    assert "lab-ab-marker-1" not in jit.source("grouped_gemm.cu")
    # the rest is the working tree's, byte for byte
    assert text.replace("\n// lab-ab-marker-1\n", "") == jit.source("grouped_gemm.cu")


def test_use_tree_switches_and_restores(tmp_path):
    tree = edited_tree(tmp_path, "m")
    assert jit._TREES[-1] == jit.KERNEL_DIR
    with pytest.raises(RuntimeError, match="inside"):
        with jit.use_tree(tree) as t:
            assert t == tree.resolve() and jit._TREES[-1] == t
            raise RuntimeError("inside")
    assert jit._TREES == [jit.KERNEL_DIR]
    with pytest.raises(ValueError, match="laid out as lab/kernels"):
        with jit.use_tree(tmp_path):
            pass
    assert jit._TREES == [jit.KERNEL_DIR]


def test_tree_arguments(tmp_path):
    ab = load_script()
    tree = edited_tree(tmp_path, "m")
    assert jit.parse_tree(f"base={tree}") == ("base", tree.resolve())
    for bad in ("base", f"={tree}", "base=", f"b a={tree}", f"base={tmp_path}", f"a@b={tree}"):
        with pytest.raises(argparse.ArgumentTypeError, match="--tree: expected NAME=DIR"):
            jit.parse_tree(bad)
    assert ab.trees_of([]) == {"work": jit.KERNEL_DIR, "work-again": jit.KERNEL_DIR}  # the noise floor
    with pytest.raises(ValueError, match="two or more"):
        ab.trees_of([("a", tree)])
    with pytest.raises(ValueError, match="must differ"):
        ab.trees_of([("a", tree), ("a", jit.KERNEL_DIR)])
    assert list(ab.trees_of([("b", tree), ("a", jit.KERNEL_DIR)])) == ["b", "a"]  # the base first


def test_script_refuses_one_tree_before_the_gpu(tmp_path, capsys):
    ab = load_script()
    tree = edited_tree(tmp_path, "m")
    with pytest.raises(SystemExit) as e:
        ab.main(["--tree", f"base={tree}"])
    assert e.value.code == 2 and "two or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--out", "bf16", "--act", "bf16"])
    assert "--out bf16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--out", "swiglu", "--act", "bf16"])
    assert "--out bf16 and swiglu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--warmup-rounds", "-1"])
    assert "--warmup-rounds >= 0" in capsys.readouterr().err
    for bad in ("-1", "nan", "61000"):
        with pytest.raises(SystemExit):
            ab.main(["--hold-ms", bad])
        assert "--hold-ms: expected 0..60000 ms" in capsys.readouterr().err


def test_rounds_compare_fastest_and_median_and_say_when_they_overlap():
    mod = load_script()
    got = mod.compare_rounds({"base": [1.0, 1.2, 1.1], "same": [1.05, 1.15, 1.2], "slow": [1.3, 1.4, 1.35]}, "base")
    assert got["base"]["x_base"] == 1.0 and got["base"]["x_base_median"] == 1.0 and got["base"]["overlaps_base"]
    assert got["same"]["ms"] == 1.05 and abs(got["same"]["x_base"] - 1.05) < 1e-12
    assert abs(got["same"]["x_base_median"] - 1.15 / 1.1) < 1e-12 and got["same"]["overlaps_base"]
    assert not got["slow"]["overlaps_base"] and abs(got["slow"]["median_ms"] - 1.35) < 1e-12
    assert got["slow"]["round_ms"] == [1.3, 1.4, 1.35]


def test_plan_and_skew_arguments_refused_before_the_gpu(capsys):
    """--plan times the plan's fp32 output with NVFP4 activations; --skew is a finite value >= 0."""
    ab = load_script()
    for argv, what in ((["--plan", "--out", "bf16"], "--plan"), (["--plan", "--act", "bf16"], "--plan"),
                       (["--plan", "--config", "8,2,128,3,20,1"], "--plan"), (["--skew", "-1"], "--skew"),
                       (["--skew", "nan"], "--skew")):
        with pytest.raises(SystemExit) as e:
            ab.main(argv)
        assert e.value.code == 2 and what in capsys.readouterr().err, argv


def fake_timing(monkeypatch):
    """The script with its tree switch and timers recorded: events gets ("time", tree, iterations,
    stream) per timing (its median is the event's number) and ("hold", tree, run_ms, sustain_ms)."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    ab = load_script()
    events, active = [], []

    @contextmanager
    def use_tree(path):
        active.append(path)
        yield path
        active.pop()

    def time_cuda(run, iterations, stream=None):
        events.append(("time", active[-1], iterations, stream))
        return SimpleNamespace(median_ms=float(len(events)))

    def time_sustained(run, run_ms, sustain_ms, iterations, stream=None):
        events.append(("hold", active[-1], run_ms, sustain_ms))

    monkeypatch.setattr(ab.jit, "use_tree", use_tree)
    monkeypatch.setattr(ab, "time_cuda", time_cuda)
    monkeypatch.setattr(ab, "time_sustained", time_sustained)
    return ab, events


def test_time_trees_alternates_the_order_and_drops_the_warmup_rounds(monkeypatch):
    from types import SimpleNamespace

    ab, order = fake_timing(monkeypatch)
    args = SimpleNamespace(rounds=3, warmup_rounds=1, iterations=7)
    ms = ab.time_trees(lambda: None, {"a": "A", "b": "B"}, args, stream="s")
    assert [t for _, t, _, _ in order] == ["B", "A", "A", "B", "B", "A", "A", "B"]  # round -1 first: reversed
    assert all(i == 7 and s == "s" for _, _, i, s in order)
    assert ms == {"a": [3.0, 6.0, 7.0], "b": [4.0, 5.0, 8.0]}


def test_time_trees_holds_the_load_on_the_base_before_its_rounds(monkeypatch):
    from types import SimpleNamespace

    ab, events = fake_timing(monkeypatch)
    args = SimpleNamespace(rounds=1, warmup_rounds=0, iterations=5, hold_ms=750.0)
    ab.time_trees(lambda: None, {"a": "A", "b": "B"}, args)
    assert events[:2] == [("time", "A", 3, None), ("hold", "A", 1.0, 750.0)]  # the base, before any round
    assert events[2:] == [("time", "A", 5, None), ("time", "B", 5, None)]
    events.clear()
    ab.time_trees(lambda: None, {"a": "A", "b": "B"}, SimpleNamespace(rounds=1, warmup_rounds=0, iterations=5,
                                                                      hold_ms=0.0))
    assert [e[0] for e in events] == ["time", "time"]


def test_prepass_names_a_tree_and_switches_the_image_form_inside_it(tmp_path, capsys):
    """--prepass NAME: inside tree NAME's block launches take the image pre-pass (gg.use_prepass),
    inside every other tree's they do not, and afterwards the default is back; a name that is no
    --tree is refused before the GPU."""
    from lab.kernels import grouped_gemm as gg

    mod = load_script()
    trees = {"pre": jit.KERNEL_DIR, "work": jit.KERNEL_DIR}
    args = argparse.Namespace(prepass=["pre"])
    with mod.use(trees, "pre", args):
        assert gg._PREPASS[-1] is True
    with mod.use(trees, "work", args):
        assert gg._PREPASS[-1] is False
    assert gg._PREPASS == [None]
    with pytest.raises(SystemExit):
        mod.main(["--tree", f"a={jit.KERNEL_DIR}", "--tree", f"b={jit.KERNEL_DIR}", "--prepass", "c"])
    assert "--prepass" in capsys.readouterr().err
