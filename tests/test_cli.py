"""The scripts' command lines (lab/cli.py): every output path is checked as the arguments are
parsed, before any work and before a GPU is asked for; --help shows each option's default; the
help's examples name paths that exist or that a line shown beside them makes."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

from lab import cli

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(ROOT.glob("scripts/*.py")) + sorted(ROOT.glob("scripts/probes/*.py"))
# every script that writes JSON, and the flag that names the file
JSON_SCRIPTS = ["ab_kernels", "bench_gemm", "chunk_study", "read_roofline", "run_layer", "sass_mix",
                "scale_fold_probe", "tile_sweep", "token_axis", "probes/coresident_probe",
                "probes/fold_directions_probe", "probes/green_ctx_probe", "probes/slow_state_probe",
                "probes/sm_partition_probe", "probes/split_streams_probe", "probes/tile_families_probe",
                "probes/unit_cost_probe", "probes/wgmma_rate_probe", "same_sass", "w4a8_error_study",
                "w4a8_promotion_study", "w4a8_stage_study"]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"cli_{name.replace('/', '_')}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def exits_2(main, argv, capsys) -> str:
    """main(argv) must end in argparse's exit 2; its stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    return err


# ---------------------------------------------------------------------------------------------
# output paths
# ---------------------------------------------------------------------------------------------


def test_output_problem_names_what_is_wrong(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("")
    assert cli.output_problem(tmp_path / "new.json") is None
    assert cli.output_problem(tmp_path / "f") is None  # replaced
    assert cli.output_problem("x.json") is None  # the current folder
    assert cli.output_problem(tmp_path / "no" / "x.json") == f"folder '{tmp_path / 'no'}' does not exist"
    assert cli.output_problem(tmp_path) == f"'{tmp_path}' is a folder, expected a file name"
    assert cli.output_problem(tmp_path / "f" / "x.json") == f"'{tmp_path / 'f'}' is not a folder"
    assert cli.output_problem(tmp_path, folder=True) is None
    assert cli.output_problem(tmp_path / "new", folder=True) is None
    assert cli.output_problem(tmp_path / "f", folder=True) == f"'{tmp_path / 'f'}' is a file, expected a folder"
    # permissions mean nothing to root: the refusal is checked through what os.access answers
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != tmp_path)
    assert cli.output_problem(tmp_path / "new.json") == f"'{tmp_path}' is not writable"
    assert cli.output_problem(tmp_path / "f") is None


def test_output_path_is_an_argparse_type_naming_the_flag(capsys):
    ap = argparse.ArgumentParser(prog="x")
    ap.add_argument("--json", type=cli.output_path)
    assert ap.parse_args(["--json", "r.json"]).json == "r.json"
    err = exits_2(lambda argv: ap.parse_args(argv), ["--json", "/nonexistent/r.json"], capsys)
    assert err.splitlines()[-1] == ("x: error: argument --json: folder '/nonexistent' does not exist "
                                    "(for '/nonexistent/r.json')")


def test_every_script_that_writes_json_is_listed():
    writes = {str(p.relative_to(ROOT / "scripts").with_suffix("")) for p in SCRIPTS
              if '"--json"' in p.read_text() or "study_parser(" in p.read_text()}
    assert writes == set(JSON_SCRIPTS)


@pytest.mark.parametrize("name", JSON_SCRIPTS)
def test_a_json_path_that_cannot_be_written_exits_2_before_any_work(name, tmp_path, capsys):
    main = load(name).main
    err = exits_2(main, ["--json", "/nonexistent/x.json"], capsys)
    assert err.splitlines()[-1].endswith("error: argument --json: folder '/nonexistent' does not exist "
                                         "(for '/nonexistent/x.json')"), err
    assert "needs a CUDA GPU" not in err and "Traceback" not in err
    err = exits_2(main, ["--json", str(tmp_path)], capsys)
    assert err.splitlines()[-1].endswith(f"error: argument --json: '{tmp_path}' is a folder, expected a file name")


@pytest.mark.parametrize("argv, word", [
    (["/nonexistent/c.safetensors"], "out: folder '/nonexistent' does not exist"),
    (["{tmp}"], "out: '{tmp}' is a folder, expected a file name; pass a file name, or --shards N"),
    (["{tmp}/f", "--shards", "2"], "out: '{tmp}/f' is a file, expected a folder"),
])
def test_make_checkpoint_checks_its_output_before_drawing_weights(argv, word, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    argv = [a.format(tmp=tmp_path) for a in argv] + ["--experts", "2", "--hidden", "64", "--intermediate", "64"]
    err = exits_2(load("make_checkpoint").main, argv, capsys)
    assert word.format(tmp=tmp_path) in err.splitlines()[-1] and "drawing" not in err, err


# ---------------------------------------------------------------------------------------------
# --help: defaults shown, docstrings kept as written
# ---------------------------------------------------------------------------------------------


class _Parsed(Exception):
    pass


def parser_of(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser a script's main builds, caught as it parses."""
    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed) as exc:
        load(name).main([])
    return exc.value.args[0]


# report.py keeps its own parser (its defaults are the committed page's inputs, listed in its help)
HELP_SCRIPTS = [p.stem for p in sorted(ROOT.glob("scripts/*.py")) if p.stem != "report"]


@pytest.mark.parametrize("name", HELP_SCRIPTS)
def test_help_shows_every_default_and_keeps_the_docstring(name, monkeypatch):
    ap = parser_of(name, monkeypatch)
    fmt = ap._get_formatter()
    missing = [a.option_strings[0] for a in ap._actions
               if a.option_strings and a.help and a.default not in (None, False, argparse.SUPPRESS, [])
               and "default" not in fmt._get_help_string(a)]
    assert missing == [], f"{name}: no default in the help of {missing}"
    text = ap.format_help()
    lines = [line for line in ap.description.splitlines()[:12] if line.strip()]
    assert len(lines) > 2 and all(line in text for line in lines), "the docstring is rewrapped"


def test_help_defaults_read_as_typed(monkeypatch):
    ap = argparse.ArgumentParser(formatter_class=cli.HelpFormatter)
    ap.add_argument("--means", type=float, nargs="+", default=[8, 32], help="means")
    ap.add_argument("--iterations", type=int, default=20, help="timed runs")
    ap.add_argument("--rounds", type=int, help="rounds (default: as many as fit)")
    ap.add_argument("--json", help="write here")
    ap.add_argument("--no-check", action="store_true", help="skip")
    text = " ".join(ap.format_help().split())
    assert "means (default: 8 32)" in text and "timed runs (default: 20)" in text
    assert text.count("default") == 3  # not after --json's None, --no-check's False, or twice for --rounds


# ---------------------------------------------------------------------------------------------
# the help's examples
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sass_mix", "ab_kernels", "token_axis"])
def test_tree_examples_name_trees_that_exist_or_that_a_shown_line_makes(name, tmp_path):
    doc = load(name).__doc__
    made = re.findall(r"^\s*(mkdir -p (\S+) && git archive HEAD lab/kernels \| tar -x -C (\S+))\s*$", doc, re.M)
    trees = [t for line in doc.splitlines() if "python scripts/" in line for t in re.findall(r"--tree \w+=(\S+)", line)]
    assert trees, f"{name}'s help shows no --tree example"
    for line, folder, into in made:
        assert folder == into, line
        # the line as shown, into a folder of the test's own
        subprocess.run(["bash", "-c", line.replace(folder, str(tmp_path / "t"))], cwd=ROOT, check=True)
    for tree in trees:
        folder = next((f for _, f, _ in made if tree.startswith(f + "/")), None)
        path = ROOT / tree if folder is None else Path(tree.replace(folder, str(tmp_path / "t"), 1))
        assert (path / "grouped_gemm.cu").is_file(), f"{name}: --tree {tree} is not a kernel tree, nor made by a line shown"
