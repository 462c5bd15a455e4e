"""The findings page renders from JSON alone, and its verdicts are arithmetic on those figures:
change a figure and the verdict changes with it."""

import importlib.util
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from lab import report, report_common, report_gemm, report_layer, report_studies
from lab.report_token_axis import token_png

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def layer_run(sep=1.0, graph=0.99, chunk2=1.02, ceiling=0.95, fused=None, fold_b=None, fold_err=2e-3,
              fused_correct="match"):
    """A run_layer JSON at mean 8. fused: {'fused-swiglu': ms, 'fused-layer': ms}; fold_b: ms."""
    def row(name, expect, ms, correct, checks=()):
        return {"variant": name, "expect": expect, "correct": correct, "checks": list(checks),
                "ms@8": ms, "roof%@8": None if ms is None else 80.0 / ms, "roofline_ms@8": 0.8}
    rows = [row("separate", "baseline", sep, "baseline", [{"mean": 8.0, "ok": True, "layer_rel": 4e-7}]),
            row("cuda-graph", "match", graph, "match"), row("chunked-2", "match", chunk2, "match")]
    for name, ms in (fused or {}).items():
        rows.append(row(name, "match", ms, fused_correct))
    if fold_b is not None:
        rows.append(row("fold-b", "approx", fold_b, f"approx ({fold_err:.1e})",
                        [{"mean": 8.0, "ok": True, "rel": fold_err}]))
    rows += [row("one-launch-2G", "ceiling", ceiling, "invalid, ceiling"),
             row("cublas-fp16", "approx", 40.0, "approx (9e-03)")]
    return {"script": "scripts/run_layer.py", "argv": ["--iterations", "3"],
            "setup": {"gpu": "NVIDIA H200", "sms": 132},
            "read_roofline": {"gbps": 4500.0},
            "layer": rows,
            "stages": [{"stage": "act", "ms": 0.02, "pct_of_layer": 2.0, "roof_pct": 30.0},
                       {"stage": "separate (one run)", "ms": sep, "pct_of_layer": 100.0}]}


GEMM = {"rows": [{"gemm": "w13", "mean_tokens": 8.0, "ms": 0.8, "roof_pct": 76.5, "read_pattern_roof_pct": 81.0,
                  "cublas_ms": 40.0, "config": {"warps": 4, "row_tiles": 4, "k_step": 128, "stages": 4,
                                                "max_frags": 2, "mma": 0}}]}


def test_held_gemm_figures_get_their_columns_and_verdict(tmp_path):
    held = {"rows": [dict(GEMM["rows"][0], sustained_ms=0.9, sustained_roof_pct=68.0),
                     dict(GEMM["rows"][0], gemm="w2", roof_pct=80.0, sustained_ms=0.85, sustained_roof_pct=75.0)]}
    text = render(tmp_path, gemm=[GEMM, held])
    assert "## Grouped GEMM on the ?, run 1" in text and "## Grouped GEMM on the ?, run 2" in text
    assert text.count("held % roofline") == 1  # only the run that has held figures
    # w13 76.5 -> 68.0 (8.5 points), w2 80.0 -> 75.0 (5.0)
    assert "read 5.0-8.5 points less of the roofline (most: w13 at mean 8, 76.5% -> 68.0%)" in text


def read_roofline_json(pattern_ms_8=0.70, ms_8=0.78):
    """read_roofline.py rows at means 2 (GEMM faster than its pattern read) and 8."""
    def row(gemm, mean, ms, roof_pct, pattern_ms):
        return {"gemm": gemm, "mean_tokens": mean, "ms": ms, "roof_pct": roof_pct, "read_pattern_ms": pattern_ms,
                "read_pattern_roof_pct": roof_pct * ms / pattern_ms, "pattern_pct": 100 * pattern_ms / ms}
    roof_8 = 0.60  # ms at the flat read
    return {"script": "scripts/read_roofline.py", "argv": [], "read_roofline": {"gbps": 4500.0},
            "rows": [row("w13", 2, 0.60, 90.0, 0.65), row("w2", 2, 0.30, 88.0, 0.33),
                     row("w13", 8, ms_8, 100 * roof_8 / ms_8, pattern_ms_8),
                     row("w2", 8, ms_8 / 2, 100 * roof_8 / ms_8, pattern_ms_8 / 2)]}


def chunk_json(gaps_per_k=0.05, loss_per_k=0.03):
    """chunk_study.py rows at mean 8 for k = 1, 2, 4: each k adds loss_per_k ms and gaps_per_k ms."""
    rows = []
    for i, k in enumerate((1, 2, 4)):
        waves = [17.45 / k] * k
        rows.append({"mean_tokens": 8, "k": k, "ms": 1.2 + i * loss_per_k, "ms_min": 1.19, "ms_max": 1.3,
                     "roof_pct": 75.0, "w13_waves": waves, "last_wave_fill": [w % 1 for w in waves],
                     "w13_gap_ms": i * gaps_per_k, "w13_gaps": [], "idle_ms": 0.004, "span_ms": 1.25})
    return {"script": "scripts/chunk_study.py", "argv": [], "read_roofline": {"gbps": 4500.0}, "rows": rows}


def tile_json():
    return json.loads((FIXTURES / "tile_sweep.json").read_text())


def render(tmp_path, *layer, **kw):
    kw.setdefault("charts", False)
    return report.render(list(layer) or [layer_run()], kw.pop("gemm", [GEMM]), tmp_path / "findings.md", **kw)


# ---------------------------------------------------------------------------------------------
# layer runs
# ---------------------------------------------------------------------------------------------


def test_report_renders_tables_and_verdicts(tmp_path):
    text = render(tmp_path)
    assert (tmp_path / "findings.md").read_text() == text
    assert "| separate " in text and "4500 GB/s" in text and "4,4,128,4,2,0" in text
    # graph: 1.0 - 0.99 ms = 10 us = 1.0%; ceiling 0.95 vs best valid (graph, 0.99): 4.0%
    assert "CUDA graph at mean 8: 10.0 us (1.0%) off separate's 1.000 ms" in text
    assert "4.0% under the best valid variant (cuda-graph, 0.990 ms)" in text
    assert "k=2 +2.0%" in text
    assert "2.0% of separate's layer" in text
    assert "reaches 81.0% of the flat read; the GEMM 76.5%" in text
    assert "Token tiles measured: 16 tokens" in text
    assert "Stages of separate at mean 8" in text  # found from separate's time = the stage table's


def test_verdicts_follow_the_numbers(tmp_path):
    """Swap which variant is fastest: the verdicts change with the data, not with the code."""
    text = render(tmp_path, layer_run(sep=0.9, graph=1.1, chunk2=1.0, ceiling=None), gemm=[])
    assert "Best valid variant at mean 8: separate, 0.900 ms" in text
    assert "-200.0 us" in text  # the graph made it slower in this made-up run
    assert "one-launch-2G ceiling" not in text  # no ceiling timed, no ceiling sentence


def test_fused_variants_not_measured_say_so(tmp_path):
    text = render(tmp_path)
    assert "fused-swiglu and fused-layer were not measured in this run" in text
    assert "fold-b (option (b)) was not measured in this run" in text
    assert "The SwiGLU epilogue (fused-swiglu against cuda-graph) was not measured" in text
    assert text.count("fused-swiglu and fused-layer were not measured") == 1  # once per run, not per mean


def test_fusion_verdicts_from_the_fused_rows(tmp_path):
    # graph 0.99, ceiling 0.95: the ceiling allows 40 us; fused-layer at 0.97 collects 20 us of it
    text = render(tmp_path, layer_run(fused={"fused-swiglu": 0.98, "fused-layer": 0.97}, fold_b=0.975))
    assert "fused-layer at mean 8: 0.970 ms, 20.0 us (2.0%) under cuda-graph's 0.990 ms" in text
    assert "it collects 50% of the 40.0 us the ceiling allows" in text
    assert "fusion is worth 20.0 us (2.0%) over cuda-graph, with fused-layer" in text
    assert "fused-layer adds 20.0 us on top of the graph" in text
    # SwiGLU epilogue: 0.99 - 0.98 = 10 us against an act stage of 0.02 ms: 50%
    assert "fused-swiglu is 10.0 us (1.0%) under cuda-graph's 0.990 ms" in text
    assert "the epilogue saves 50% of the stage's time" in text
    # option (b): 0.975 vs fused-swiglu 0.98: 5 us, 0.5% -> inside the noise; error 2e-3 vs 4e-7
    assert "fold-b 0.975 ms, 5.0 us (0.5%) under fused-swiglu's 0.980 ms" in text
    assert "its layer error against float64 is 2.00e-03 (separate's, option (a): 4.00e-07)" in text
    assert "option (a) costs nothing measurable against (b)" in text


def test_fusion_verdicts_change_with_the_numbers(tmp_path):
    text = render(tmp_path, layer_run(fused={"fused-swiglu": 1.0, "fused-layer": 0.995}, fold_b=0.95))
    assert "fusion is worth nothing measurable" in text  # best fused 0.995 vs graph 0.99
    assert "fused-swiglu is 10.0 us (1.0%) over cuda-graph's 0.990 ms" in text
    assert "the epilogue saves nothing, it costs 0.5x the stage it replaces" in text
    assert "of the 40.0 us the ceiling allows it collects none" in text
    assert "option (a) costs 50.0 us (5.0%) against (b)" in text  # fold-b 0.95 vs fused-swiglu 1.0


def test_a_variant_faster_than_the_ceiling_is_called_so(tmp_path):
    """The one-launch ceiling writes h and its output in fp32; a fused layer that keeps h on chip can
    beat it, and the page says so instead of claiming more than 100% of the ceiling's margin."""
    text = render(tmp_path, layer_run(graph=0.99, ceiling=0.96, fused={"fused-swiglu": 0.98, "fused-layer": 0.95}))
    assert "The one-launch-2G 'ceiling' at mean 8 (0.960 ms) is not one in this run: fused-layer (0.950 ms)" in text
    assert "it is 10.0 us under the one-launch-2G ceiling itself" in text
    assert "collects 133%" not in text


def test_fusion_that_costs_time_says_so(tmp_path):
    """Fused variants 10% slower than the graph (as the first fused kernels were): a loss, not noise."""
    text = render(tmp_path, layer_run(sep=1.0, graph=1.02, fused={"fused-swiglu": 1.122, "fused-layer": 1.15}))
    assert ("fusion is worth nothing; it costs: the best fused variant (fused-swiglu, 1.122 ms) is 102.0 us "
            "(10.0%) slower than cuda-graph") in text
    assert "the graph is slower here, by more than the 1% noise" in text
    assert "the best fused variant (fused-swiglu) is 102.0 us slower than the graph" in text


def test_a_mismatching_fused_variant_is_not_counted(tmp_path):
    text = render(tmp_path, layer_run(fused={"fused-layer": 0.5}, fused_correct="MISMATCH"))
    assert "fused-layer at mean 8 is not counted: 0.500 ms, correct: 'MISMATCH'" in text
    assert "Best valid variant at mean 8: cuda-graph" in text


# ---------------------------------------------------------------------------------------------
# studies
# ---------------------------------------------------------------------------------------------


def test_missing_studies_name_their_scripts(tmp_path):
    text = render(tmp_path)
    for study, script in report_studies.STUDIES.items():
        assert f"`results/{study}.json` is missing; `python {script} --json results/{study}.json`" in text


def test_read_roofline_mainloop_or_access_pattern(tmp_path):
    text = render(tmp_path, read_roofline=read_roofline_json())
    assert "| w13    | 2               | 0.650             | 83.1" in text
    # mean 2: the pattern read (0.65) is slower than the GEMM (0.60): all of the gap is the pattern
    assert "Mean 2: access pattern." in text
    # mean 8: GEMM 0.78, pattern 0.70, roofline 0.60: 80 of 180 us is the mainloop (44%): both
    assert "Mean 8: both." in text and "80.0 us (44%) is the mainloop" in text
    text = render(tmp_path, read_roofline=read_roofline_json(pattern_ms_8=0.62))  # 160 of 180 us
    assert "Mean 8: mainloop." in text and "160.0 us (89%) is the mainloop" in text


def test_split_gap_arithmetic():
    s = report_studies.split_gap({"ms": 1.0, "roof_pct": 50.0, "read_pattern_ms": 0.6})
    assert s["roof_ms"] == pytest.approx(0.5) and s["mainloop_ms"] == pytest.approx(0.4)
    assert s["pattern_ms"] == pytest.approx(0.1) and s["cause"] == "mainloop"
    s = report_studies.split_gap({"ms": 1.0, "roof_pct": 50.0, "read_pattern_ms": 1.2})
    assert s["mainloop_ms"] == 0.0 and s["cause"] == "access pattern"


def test_chunk_study_tail_or_launch(tmp_path):
    # each k: 30 us lost, 50 us more w13 gaps -> the gaps cover it: launch and scheduling
    text = render(tmp_path, chunk_study=chunk_json())
    assert "| 8               | 4   | 1.260        |" in text
    assert "Mean 8 (k=1 1.200 ms): where chunking loses, it is launch and scheduling." in text
    assert "covering the loss" in text
    # no gaps: the loss is not launch and scheduling: the tail
    text = render(tmp_path, chunk_study=chunk_json(gaps_per_k=0.0))
    assert "where chunking loses, it is tail effect" in text and "0% of the loss" in text
    # losses inside the noise: nothing to explain
    text = render(tmp_path, chunk_study=chunk_json(loss_per_k=0.001))
    assert "chunking loses nothing measurable" in text


def test_chunk_cause_counts_empty_wave_slots():
    rows = chunk_json()["rows"]
    c = report_studies.chunk_cause(rows[0], rows[2])  # k=4: 4 chunks of 4.36 waves, 0.64 empty each
    assert c["empty_waves"] == pytest.approx(4 * (5 - 17.45 / 4))
    assert c["empty_waves_k1"] == pytest.approx(18 - 17.45)
    assert c["loss_ms"] == pytest.approx(0.06) and c["gaps_ms"] == pytest.approx(0.10)


def test_tile_sweep_fixture_has_the_structure_tile_sweep_writes():
    """The fixture's tile points are the ones scripts/tile_sweep.py sweeps around the heuristic's
    tiles at means 8 and 32, and each row holds what it writes: a measurement or a reason.
    (Which tiles fail, and why, is the kernel's business: not pinned here.)"""
    from lab.kernels import gemm_config as gc

    spec = importlib.util.spec_from_file_location("tile_sweep", ROOT / "scripts/tile_sweep.py")
    ts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ts)
    d = tile_json()
    assert {"script", "argv", "setup", "read_roofline", "rows"} <= d.keys()
    assert d["script"] == "scripts/tile_sweep.py"
    bases = {8: gc.GemmConfig(4, 4, 128, 4, 2), 32: gc.GemmConfig(8, 2, 128, 4, 8)}
    for mean, base in bases.items():
        mine = [r for r in d["rows"] if r["mean_tokens"] == mean]
        want = [tuple(desc.values()) for desc, _ in ts.candidates(base, full=False)]
        assert want == [(r["token_tile"], r["block_rows"], r["k_step"], r["stages"]) for r in mine]
        for r in mine:
            if "error" in r:
                assert isinstance(r["error"], str) and r["error"] and "ms" not in r
            else:
                assert {"config", "ms", "ms_min", "ms_max", "gbps", "roof_pct", "unwritten", "bytes"} <= r.keys()
                assert 8 * r["config"]["max_frags"] == r["token_tile"]


def test_tile_sweep_128_unsupported_quotes_the_reason(tmp_path):
    text = render(tmp_path, tile_sweep=tile_json())
    assert re.search(r"\| 128,256,128,4 +\| w13 +\| 8 +\| token tile 128 not compiled \(max 64\)", text)
    assert ("w13 at mean 8: a 128-token tile is unsupported here (token tile 128 not compiled (max 64)), so "
            "there is no 128 to recover anything against") in text
    assert "the best tile below 128 tokens (64,256,128,4) takes 0.773 ms (83.0%), and is the largest" in text


@pytest.mark.parametrize("ms128, verdict", [
    (0.800, "w13 at mean 32: yes, 3.3% (26.5 us)"),  # 128 slower than the best sub-128 tile (0.7735 ms)
    (0.700, "w13 at mean 32: no, 128 tokens is 10.5% faster"),  # 128 faster
    (0.775, "w13 at mean 32: no (+0.2%, inside 1%)"),  # a tie
])
def test_tile_sweep_verdict_against_a_measured_128(tmp_path, ms128, verdict):
    d = tile_json()
    for r in d["rows"]:
        if r["token_tile"] == 128 and r["mean_tokens"] == 32:
            r.pop("error")
            r.update({"ms": ms128, "gbps": 3000.0, "roof_pct": 70.0})
    text = render(tmp_path, tile_sweep=d)
    assert verdict in text


# ---------------------------------------------------------------------------------------------
# charts and the script
# ---------------------------------------------------------------------------------------------


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, which the format puts first."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def test_charts_written_and_linked(tmp_path):
    if not report_common.have_matplotlib():
        pytest.skip("charts need matplotlib (the plot extra)")
    text = render(tmp_path, layer_run(), layer_run(sep=1.02), charts=True, tile_sweep=tile_json())
    assert report.charts_of(text) == [report_layer.LAYER_PNG, report_studies.TILE_PNG]
    for png in report.charts_of(text):
        w, h = png_size(tmp_path / png)
        assert w <= report_common.CHART_MAX_PX and h <= report_common.CHART_MAX_PX, (png, w, h)


def test_page_text_does_not_depend_on_matplotlib(tmp_path, monkeypatch):
    """Without matplotlib the page is the same page, and charts already beside it stay as they are."""
    with_charts = render(tmp_path, charts=False, tile_sweep=tile_json())
    (tmp_path / report_layer.LAYER_PNG).write_bytes(b"an older chart")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert not report_common.have_matplotlib()
    assert render(tmp_path, charts=True, tile_sweep=tile_json()) == with_charts
    assert f"]({report_layer.LAYER_PNG})" in with_charts and f"]({report_studies.TILE_PNG})" in with_charts
    assert (tmp_path / report_layer.LAYER_PNG).read_bytes() == b"an older chart"
    assert not (tmp_path / report_studies.TILE_PNG).exists()


def test_repeated_layer_runs_make_one_series_with_their_spread():
    """Two runs of one command at one commit are repeats: one series per mean, at the median run,
    with the min and max over the runs; a run with other flags is a series of its own."""
    a, b, c = layer_run(sep=1.0), layer_run(sep=1.25), layer_run(sep=0.8)
    for run in (a, b, c):
        run["setup"]["lab_commit"] = "abc1234"
    c["argv"] = ["--settle-ms", "0", "--json", "/tmp/x.json"]
    series = report_layer.layer_series([a, b, c])
    assert [s["label"] for s in series] == ["mean 8, --iterations 3 (run 1, 2, abc1234)",
                                            "mean 8, --settle-ms 0 (run 3, abc1234)"]
    sep = series[0]["values"]["separate"]
    assert sep["n"] == 2 and sep["lo"] == pytest.approx(64.0) and sep["hi"] == pytest.approx(80.0)
    assert sep["roof"] == pytest.approx(64.0) and sep["ms"] == pytest.approx(1.25)  # the lower median
    assert series[1]["values"]["separate"]["n"] == 1
    assert series[1]["values"]["separate"]["roof"] == pytest.approx(100.0)


def test_tile_grid_best_per_token_tile():
    labels, tiles, grid = report_studies.tile_grid(tile_json()["rows"])
    assert labels == ["w13 @8", "w13 @32"] and tiles == [8, 16, 32, 64, 128]
    assert grid[0][4] is None and grid[1][3] == pytest.approx(83.0, abs=0.05)


def run_script(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts/report.py"), *map(str, args)],
                          check=False, capture_output=True, text=True, cwd=ROOT)


def test_report_script_reads_files_and_names_a_bad_one(tmp_path):
    (tmp_path / "layer.json").write_text(json.dumps(layer_run()))
    (tmp_path / "gemm.json").write_text(json.dumps(GEMM))
    (tmp_path / "chunk.json").write_text(json.dumps(chunk_json()))
    out = tmp_path / "docs" / "f.md"
    ok = run_script("--layer", tmp_path / "layer.json", "--gemm", tmp_path / "gemm.json", "--out", out,
                    "--no-charts", "--chunk-study", tmp_path / "chunk.json",
                    "--read-roofline", tmp_path / "absent.json", "--tile-sweep", FIXTURES / "tile_sweep.json")
    assert ok.returncode == 0, ok.stderr
    text = out.read_text()
    assert "CUDA graph at mean 8" in text and "Mean 8 (k=1 1.200 ms)" in text and "w13 at mean 32" in text
    assert "`results/read_roofline.json` is missing" in text and "absent.json not found" in ok.stderr
    bad = run_script("--layer", tmp_path / "nope.json")
    assert bad.returncode == 2 and "nope.json" in bad.stderr
    (tmp_path / "broken.json").write_text("{")
    bad = run_script("--layer", tmp_path / "layer.json", "--gemm", "--out", out, "--chunk-study",
                     tmp_path / "broken.json")
    assert bad.returncode == 2 and "broken.json" in bad.stderr


def test_report_needs_a_layer_run(tmp_path):
    with pytest.raises(ValueError, match="run_layer"):
        report.render([], [], tmp_path / "f.md")


# ---------------------------------------------------------------------------------------------
# the committed page and the files it stands on
# ---------------------------------------------------------------------------------------------

PAGE = ROOT / report.PAGE


def test_default_runs_reproduce_the_committed_page(tmp_path):
    """`python scripts/report.py` renders the committed page byte for byte (here into a temporary
    folder); the charts it draws, when it can, have the committed charts' sizes."""
    out = tmp_path / PAGE.name
    r = run_script("--out", out)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == PAGE.read_text()
    charts = report.charts_of(PAGE.read_text())
    if not report_common.have_matplotlib():
        assert r.stdout.count("matplotlib is not installed") == 1
        assert not any((tmp_path / c).exists() for c in charts)
    else:
        for c in charts:
            assert png_size(tmp_path / c) == png_size(PAGE.parent / c), c


def test_committed_charts_fit_the_page():
    charts = report.charts_of(PAGE.read_text())
    boards = [json.loads((ROOT / p).read_text()) for p in report.PAGE_RUNS["token_axis"]]
    assert charts == [token_png(b) for b in boards] + [report_layer.LAYER_PNG, report_studies.TILE_PNG]
    for c in charts:
        w, h = png_size(PAGE.parent / c)
        assert 600 <= w <= report_common.CHART_MAX_PX and h <= report_common.CHART_MAX_PX, (c, w, h)


def test_page_runs_are_the_files_under_results():
    listed = [p for v in report.PAGE_RUNS.values() for p in ([v] if isinstance(v, str) else v)]
    assert all((ROOT / p).is_file() for p in listed), listed
    for p in listed:
        assert f"({p}, " in PAGE.read_text() or re.search(rf"\b[Ff]rom {re.escape(p)}, ", PAGE.read_text()), p


# What scripts/check_gpu.sh writes under results/: run output, not committed (.gitignore).
WRITTEN_NOT_KEPT = {"results/pytest_gpu.log", "results/sanitizer.txt"}
# The index of results/: a line for each file, and the files whose run records no lab commit.
RESULTS_INDEX = ROOT / "results" / "README.md"
NO_LAB_COMMIT = "## Without setup.lab_commit"


def results_json() -> list[str]:
    return sorted(p.relative_to(ROOT / "results").as_posix() for p in (ROOT / "results").rglob("*.json"))


def test_results_hold_json_listed_in_their_index():
    """results/ keeps JSON only, in board folders (h200, h100) and studies/ one level down, each file
    with its line in results/README.md, which names no file that is gone (older runs are cited from
    git history)."""
    under = [p.relative_to(ROOT / "results") for p in (ROOT / "results").rglob("*")]
    folders = sorted(p.as_posix() for p in under if (ROOT / "results" / p).is_dir())
    assert all(re.fullmatch(r"[a-z]+\d+|studies", f) for f in folders), folders
    files = sorted(p.as_posix() for p in under if (ROOT / "results" / p).is_file())
    assert [f for f in files if not f.endswith(".json") and f != "README.md"] == []
    index = RESULTS_INDEX.read_text()
    rows = re.findall(r"^\| `([\w./-]+\.json)` \|", index, re.M)
    assert [f for f in results_json() if f not in rows] == []
    assert len(rows) == len(set(rows)), rows
    named = re.findall(r"`([\w./-]+\.json)`", re.sub(r"git show [0-9a-f]{7,40}:\S+", "", index))
    assert [n for n in dict.fromkeys(named) if not (ROOT / "results" / n).is_file()] == []


def test_runs_record_their_lab_commit():
    """A results JSON a script wrote (a top-level "script") records the commit it ran
    (setup.lab_commit), or results/README.md lists it under NO_LAB_COMMIT with the reason."""
    lacking = [f for f in results_json()
               if "script" in (run := json.loads((ROOT / "results" / f).read_text()))
               and not (run.get("setup") or {}).get("lab_commit")]
    excused = re.findall(r"^- `([\w./-]+\.json)`: \S", RESULTS_INDEX.read_text().split(NO_LAB_COMMIT, 1)[1], re.M)
    assert lacking == sorted(excused)


def test_notes_and_readme_cite_paths_that_exist():
    """A run, note or probe that the notes, the README or the page name is in the tree, or cited
    with its commit (`git show <commit>:<path>`). A command's --json argument is where that run was
    written first (the page prints each run's command as recorded), not a file the tree keeps."""
    pat = re.compile(r"(?<![\w/:.-])(?<!--json )((?:results|notes|scripts/probes|docs)/[\w./-]*\w)")
    missing = []
    # the version logs (notes/*-log.md) are history: a path there was right at its version's commit
    for doc in ["README.md", report.PAGE, "notes/gemm.md", "notes/layer.md", "results/README.md"]:
        text = re.sub(r"git show [0-9a-f]{7,40}:\S+", "", (ROOT / doc).read_text())
        for path in dict.fromkeys(pat.findall(text)):
            if path not in WRITTEN_NOT_KEPT and not (ROOT / path).exists():
                missing.append(f"{doc}: {path}")
    assert missing == []


def test_gemm_verdicts_pair_each_bf16_row_with_its_nvfp4_twin():
    def row(gemm, act, mean, ms, frags=2):
        return {"gemm": gemm, "act": act, "mean_tokens": mean, "ms": ms, "roof_pct": 90.0, "read_pattern_roof_pct": 100.0,
                "config": {"warps": 4, "row_tiles": 4, "k_step": 128, "stages": 3, "max_frags": frags, "mma": 0,
                           "act": act}}
    rows = [row("w13", "nvfp4", 8, 0.5), row("w13", "bf16", 8, 0.6), row("w2", "nvfp4", 8, 0.25),
            row("w2", "bf16", 32, 0.4, frags=8)]  # no nvfp4 twin at 32: left out
    v = report_gemm.gemm_verdicts(rows)
    assert v[0].startswith("w13 (nvfp4) at mean 8") and v[1].startswith("w13 (bf16) at mean 8")
    pair = [s for s in v if s.startswith("bf16 activations (W4A16)")]
    assert len(pair) == 1 and "w13 at 8 1.20x" in pair[0] and "w2 at" not in pair[0], pair
    # one activation form only: no pairing, no label
    v = report_gemm.gemm_verdicts([r for r in rows if r["act"] == "nvfp4"])
    assert v[0].startswith("w13 at mean 8") and not any(s.startswith("bf16 activations") for s in v)


def test_skew_is_read_from_the_runs_command():
    assert report_layer._skew({"argv": ["--mean-tokens", "8", "--skew", "0.4", "--json", "x.json"]}) == 0.4
    assert report_layer._skew({"argv": ["--json", "x.json"]}) == 0.0
    assert report_layer._skew({"argv": ["--skew"]}) == 0.0  # a flag with no value (never written by run_layer)
    assert report_layer._skew({}) == 0.0


def test_graph_verdict_under_skew_names_the_two_streams():
    rows = [{"variant": "separate", "expect": "baseline", "correct": "baseline", "ms@8": 1.10},
            {"variant": "cuda-graph", "expect": "match", "correct": "match", "ms@8": 1.05}]
    uniform, skewed = report_layer.graph_verdicts(rows, "8")[0], report_layer.graph_verdicts(rows, "8", skewed=True)[0]
    assert "launch overhead" in uniform and "two streams" not in uniform
    assert "two streams" in skewed
    rows[1]["ms@8"] = 1.099  # within the noise: no cause named either way
    assert "two streams" not in report_layer.graph_verdicts(rows, "8", skewed=True)[0]


def test_split_plans_from_the_recorded_plans_else_the_skew():
    one = [{"config": {}, "counts_in": [1, 2**31 - 1]}]
    two = one + [{"config": {}, "counts_in": [17, 2**31 - 1]}]
    assert report_layer._split_plans({"gemm_plans": {"8": {"w13": one, "w2": two}}, "argv": []})
    assert not report_layer._split_plans({"gemm_plans": {"8": {"w13": one, "w2": one}}, "argv": ["--skew", "1.2"]})
    assert report_layer._split_plans({"argv": ["--skew", "0.4"]}) and not report_layer._split_plans({"argv": []})


def test_split_rows_name_their_launches_and_streams():
    cfg = {"warps": 4, "row_tiles": 4, "k_step": 128, "stages": 3, "max_frags": 2, "mma": 0}
    hot = {**cfg, "warps": 8, "row_tiles": 2, "max_frags": 20, "mma": 1, "image": True}
    row = {"config": cfg, "split": [16], "plan": [{"config": cfg, "counts_in": [1, 16]},
                                                  {"config": hot, "counts_in": [17, 2**31 - 1]}]}
    assert report_gemm.gemm_tile(row) == "split at 16: 4,4,128,3,2,0 on 1..16 + 8,2,128,3,20,1,image on 17.."
    assert report_gemm.gemm_tile({**row, "streams": 2}).startswith("split at 16, two streams: 4,4,128,3,2,0 on 1..16 + ")
