"""A variant with its kernels from another source tree (lab/variants/from_tree.py) and
token_axis's --tree: the naming, the tree each compile sees, and the arguments' errors."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from lab import variants
from lab.kernels import jit
from lab.kernels import w4a8_gemm as wg
from lab.variants import from_tree

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "token_axis.py"


def kernel_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "kernels"
    shutil.copytree(jit.KERNEL_DIR, tree, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    return tree


def test_names_split_into_variant_and_tree_label():
    assert from_tree.split("w4a8") == ("w4a8", None)
    assert from_tree.split("w4a8-fused@base") == ("w4a8-fused", "base")
    for bad in ("w4a8@", "@base"):
        with pytest.raises(ValueError, match="expected <variant>@<tree label>"):
            from_tree.split(bad)


def test_make_wraps_the_variant_and_names_what_is_missing(tmp_path):
    tree = kernel_tree(tmp_path)
    v = variants.make("w4a8-fused@base", {"base": tree})
    assert isinstance(v, from_tree.FromTree) and v.name == "w4a8-fused@base" and v.tree == tree.resolve()
    assert v.expect == variants.make("w4a8-fused").expect and v.stages == variants.make("w4a8-fused").stages
    with pytest.raises(ValueError, match="no kernel tree labelled 'other'; known: base"):
        variants.make("w4a8@other", {"base": tree})
    with pytest.raises(ValueError, match="no kernel tree labelled 'base'; known: none"):
        variants.make("w4a8@base")
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        variants.make("nope@base", {"base": tree})


class Recorder:
    """A variant stand-in that records the tree kernels would compile from."""
    name, expect = "recorder", "approx"

    def __init__(self):
        self.seen = []

    def prepare(self, runner, layer):
        self.seen.append(("prepare", jit.current_tree()))

    def run(self, runner, layer):
        self.seen.append(("run", jit.current_tree()))
        raise RuntimeError("in run")


def test_prepare_and_run_compile_from_the_tree_and_restore_the_default(tmp_path):
    tree = kernel_tree(tmp_path)
    inner = Recorder()
    v = from_tree.FromTree(inner, "base", tree)
    v.prepare(None, None)
    assert jit.current_tree() == jit.KERNEL_DIR
    with pytest.raises(RuntimeError, match="in run"):  # an error inside leaves the default tree
        v.run(None, None)
    assert inner.seen == [("prepare", tree.resolve()), ("run", tree.resolve())]
    assert jit.current_tree() == jit.KERNEL_DIR
    with pytest.raises(ValueError, match="laid out as lab/kernels"):
        from_tree.FromTree(Recorder(), "empty", tmp_path).prepare(None, None)


def test_w4a8_kernels_compile_from_the_current_tree(tmp_path, monkeypatch):
    tree = kernel_tree(tmp_path)
    asked = []

    class Module:
        def get_function(self, expression):
            return expression

    monkeypatch.setattr(wg, "_module", lambda name, exprs, t: asked.append(t) or Module())
    monkeypatch.setattr("lab.gpu.require_gpu", lambda what: None)
    assert wg._kernel(wg.GEMM_SOURCE, ("e",), "e") == "e"
    with jit.use_tree(tree):
        wg._kernel(wg.GEMM_SOURCE, ("e",), "e")
    assert asked == [jit.KERNEL_DIR, tree.resolve()]


def load_script():
    spec = importlib.util.spec_from_file_location("token_axis_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv, message", [
    (["--variants", "w4a8@base"], "--variants w4a8@base: no --tree labelled 'base'"),
    (["--variants", "w4a8@"], "--variants: variant 'w4a8@': expected <variant>@<tree label>"),
    (["--variants", "nope@base"], "--variants: unknown 'nope'"),
    (["--tree", "base=/nonexistent"], "--tree: expected NAME=DIR"),
])
def test_token_axis_names_a_bad_tree_argument_before_any_work(argv, message, capsys):
    ta = load_script()
    with pytest.raises(SystemExit) as exc:
        ta.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_token_axis_takes_each_tree_label_once(tmp_path, capsys):
    tree = kernel_tree(tmp_path)
    ta = load_script()
    with pytest.raises(SystemExit):
        ta.main(["--tree", f"base={tree}", "--tree", f"base={tree}", "--variants", "w4a8@base"])
    assert "--tree: each LABEL once" in capsys.readouterr().err


def test_a_variant_from_another_tree_gets_its_own_activation_image(tmp_path):
    """The image buffers a W4A8 variant allocates in prepare are keyed by the tree its kernels come
    from: w13's image is written in prepare by the tree's own pre-pass, so a shared buffer would
    hand the other variant an image in the other tree's layout."""
    import numpy as np

    from lab.variants import w4a8 as v

    class Runner:
        def __init__(self):
            self.names = []

        def buffer(self, name, shape, dtype):
            self.names.append(name)
            return np.empty(0, dtype)

    tree = kernel_tree(tmp_path)
    plan = wg.GemmPlan(128, 1, warpgroups=2, image=True, ahead=True)
    prep = wg.W4A8Weights(None, None, None, None, None, 4, 256, 512)
    here, there = Runner(), Runner()
    v.image_buffers(here, plan, prep, 100, "w13")
    with jit.use_tree(tree):
        v.image_buffers(there, plan, prep, 100, "w13")
    assert here.names == ["w4a8/w13_image128", "w4a8/w13_image128_sx"]
    assert len(there.names) == 2 and not set(there.names) & set(here.names)
    assert all(n.startswith("w4a8/w13_image128@") for n in there.names), there.names
    assert jit.current_tree_key() == "" and v.image_buffers(here, wg.GemmPlan(8, 1), prep, 100, "w13") is None
