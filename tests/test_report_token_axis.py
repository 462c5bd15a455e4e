"""The token-axis section per board and README's generated block: every sentence follows the
figures in the files (change one, the sentence changes), boards are grouped by the GPU each run
recorded, and README's block is rewritten between its markers only."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab import report_token_axis as rta
from lab.report_common import FILE_KEY, board

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "token_axis.json"


def _run(gpu: str = "NVIDIA H200", scale_best: dict | None = None) -> dict:
    """The fixture as one board's run: its GPU named, the best lab variant's time at each mean
    in `scale_best` multiplied by that factor (and its ratio to the fastest peer kept consistent)."""
    ta = json.loads(FIXTURE.read_text())
    ta["setup"]["gpu"] = gpu
    ta[FILE_KEY] = f"results/{board(ta).lower()}/token_axis.json"
    for p in ta["points"]:
        f = (scale_best or {}).get(p["mean"])
        if f:
            best = p["impls"][p["best_lab"]]
            best["ms"] *= f
        peer_ms = {n: e["ms"] for n, e in p["impls"].items() if e["peer"] and e.get("ms")}
        p["fastest_peer"] = min(peer_ms, key=peer_ms.get)
        for e in p["impls"].values():
            if e.get("ms"):
                e["x_fastest_peer"] = peer_ms[p["fastest_peer"]] / e["ms"]
    return ta


def test_board_is_the_model_name_of_the_recorded_gpu():
    assert board({"setup": {"gpu": "NVIDIA H200"}}) == "H200"
    assert board({"setup": {"gpu": "NVIDIA H100 80GB HBM3"}}) == "H100"
    assert board({"setup": {"gpu": "Some Accelerator"}}) == "Some Accelerator"
    assert board({}) == "?"


def test_the_crossover_sentence_follows_a_changed_figure():
    ta = _run()
    ratios = rta.against_fastest_peer(ta)
    assert [m for m, _, _ in ratios] == [8.0, 64.0, 600.0]
    before = rta.crossover_sentence(ta)
    assert before.startswith("On the H200, the lab's best valid variant against the fastest peer")
    assert rta.crossover_mean(ta) is None
    # the lab 4x slower at the largest mean: the sentence must now say where and by how much
    slow = _run(scale_best={600.0: 4.0})
    after = rta.crossover_sentence(slow)
    r = rta.against_fastest_peer(slow)[-1][1]
    assert after != before and f"slower at 600 ({1 / r:.2f}x)" in after, after
    assert rta.crossover_mean(slow) == 600.0


def test_boards_get_a_subsection_each_and_the_shift_between_them(tmp_path):
    h200 = _run()
    h100 = _run("NVIDIA H100 80GB HBM3", scale_best={64.0: 6.0, 600.0: 6.0})
    text = "\n".join(rta.section([h200, h100], tmp_path))
    assert "### H200" in text and "### H100" in text and text.index("### H200") < text.index("### H100")
    assert "(token-axis-h200.png)" in text and "(token-axis-h100.png)" in text
    shift = rta.board_shift_sentence([h200, h100])
    assert "on the H200 the lab is not behind at the largest mean" in shift
    assert "on the H100 the fastest peer leads from 64 tokens per expert up" in shift
    assert rta.board_shift_sentence([h200, _run()]) is None  # one board twice: nothing moves


def test_report_rewrites_readme_between_its_markers_from_the_files(tmp_path):
    """scripts/report.py end to end on copies: the README's block is the first board's table and
    every board's crossover; prose outside the markers is kept byte for byte; a changed figure
    in a file changes the block."""
    files = []
    for name, run in (("h200.json", _run()), ("h100.json", _run("NVIDIA H100 80GB HBM3", {600.0: 5.0}))):
        run.pop(FILE_KEY)
        (tmp_path / name).write_text(json.dumps(run))
        files.append(str(tmp_path / name))
    readme = tmp_path / "README.md"
    prose = "# lab\n\nbefore\n\n" + rta.README_BEGIN + "\nold table\n" + rta.README_END + "\n\nafter\n"
    readme.write_text(prose)

    def report():
        return subprocess.run([sys.executable, "scripts/report.py", "--out", str(tmp_path / "f.md"), "--no-charts",
                               "--token-axis", *files, "--readme", str(readme)],
                              cwd=ROOT, capture_output=True, text=True)

    r = report()
    assert r.returncode == 0, r.stderr
    text = readme.read_text()
    assert text.startswith("# lab\n\nbefore\n\n" + rta.README_BEGIN) and text.endswith(rta.README_END + "\n\nafter\n")
    assert "old table" not in text and "| 600 " in text
    assert "On the H200, the lab's best" in text and "On the H100, the lab's best" in text
    first = text
    run = json.loads(Path(files[0]).read_text())
    p = run["points"][-1]
    p["impls"][p["best_lab"]]["ms"] *= 7.0
    Path(files[0]).write_text(json.dumps(run))
    assert report().returncode == 0
    assert readme.read_text() != first and "slower at 600" in readme.read_text().split("On the H100")[0]


def test_report_refuses_a_readme_without_markers_and_a_broken_ceiling(tmp_path):
    run = _run()
    run.pop(FILE_KEY)
    f = tmp_path / "ta.json"
    f.write_text(json.dumps(run))
    readme = tmp_path / "README.md"
    readme.write_text("# no block here\n")
    args = [sys.executable, "scripts/report.py", "--out", str(tmp_path / "f.md"), "--no-charts", "--token-axis", str(f)]
    r = subprocess.run(args + ["--readme", str(readme)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "has no '<!-- token axis" in r.stderr
    assert readme.read_text() == "# no block here\n"  # nothing lost
    run["ceilings"]["read"]["gbps"] = 0
    f.write_text(json.dumps(run))
    r = subprocess.run(args + ["--readme", "none"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "read.gbps must be a positive number" in r.stderr


def test_rows_name_the_ceiling_they_are_compared_with():
    ta = _run()
    p = ta["points"][-1]
    p["rooflines"] = {"fp16": p["roofline"], "fp8": dict(p["roofline"], binds="tensor", tensor="fp8")}
    for n, e in p["impls"].items():
        e["tensor"] = "fp8" if n == "torch-fp8" else "fp16"
        e["binds"] = "tensor fp8" if n == "torch-fp8" else "read"
    p["impls"]["torch-fp8"]["ms"] = 0.5 * p["impls"]["torch-bf16"]["ms"]  # fp8 the fastest peer here
    p["fastest_peer"] = "torch-fp8"
    table = rta.token_axis_table(ta["points"])
    row = next(line for line in table.splitlines() if line.startswith("| 600 "))
    assert "tensor fp8" in row and "(read)" in row
    head = next(line for line in rta.headline_table(ta).splitlines() if line.startswith("| 600 "))
    assert "tensor fp8" in head  # the fastest peer at 600 is torch-fp8, compared with the fp8 peak


def test_a_peer_timed_alone_is_named_in_the_sentence_and_the_tables():
    ta = _run()
    p = max(ta["points"], key=lambda p: p["mean"])
    plain = rta.crossover_sentence(ta)
    assert "Timed alone" not in plain and ", alone" not in rta.headline_table(ta)
    p["impls"][p["fastest_peer"]]["apart"] = "timed alone, after the others: out of device memory beside them"
    said = rta.crossover_sentence(ta)
    assert said.endswith(f" Timed alone, after the others (out of device memory beside them): "
                         f"{p['mean']:g} ({p['fastest_peer']})."), said
    assert f"({p['fastest_peer']}, alone)" in rta.headline_table(ta)
    assert " alone" in rta.token_axis_table(ta["points"])
