"""The findings page renders from JSON alone, and its verdicts are arithmetic on those figures."""

import json

import pytest

from lab import report


def layer_run(sep=1.0, graph=0.99, chunk2=1.02, ceiling=0.95):
    def row(name, expect, ms, correct):
        return {"variant": name, "expect": expect, "correct": correct,
                "ms@8": ms, "roof%@8": None if ms is None else 80.0 / ms}
    return {"script": "scripts/run_layer.py", "argv": ["--iterations", "3"],
            "setup": {"gpu": "NVIDIA H200", "sms": 132},
            "read_roofline": {"gbps": 4500.0},
            "layer": [row("separate", "baseline", sep, "baseline"), row("cuda-graph", "match", graph, "match"),
                      row("chunked-2", "match", chunk2, "match"),
                      row("one-launch-2G", "ceiling", ceiling, "invalid, ceiling"),
                      row("cublas-fp16", "approx", 40.0, "approx (9e-03)")],
            "stages": [{"stage": "act", "ms": 0.02, "pct_of_layer": 2.0, "roof_pct": 30.0},
                       {"stage": "separate (one run)", "ms": sep, "pct_of_layer": 100.0}]}


GEMM = {"rows": [{"gemm": "w13", "mean_tokens": 8.0, "ms": 0.8, "roof_pct": 76.5, "read_pattern_roof_pct": 81.0,
                  "cublas_ms": 40.0, "config": {"warps": 4, "row_tiles": 4, "k_step": 128, "stages": 4,
                                                "max_frags": 2, "mma": 0}}]}


def test_report_renders_tables_and_verdicts(tmp_path):
    text = report.render([layer_run()], [GEMM], tmp_path / "findings.md", charts=False)
    assert (tmp_path / "findings.md").read_text() == text
    assert "| separate " in text and "4500 GB/s" in text and "4,4,128,4,2,0" in text
    # graph: 1.0 - 0.99 ms = 10 us = 1.0%; ceiling 0.95 vs best valid (graph, 0.99): 4.0%
    assert "CUDA graph at mean 8: 10.0 us (1.0%)" in text
    assert "4.0% under the best valid variant (cuda-graph, 0.990 ms)" in text
    assert "k=2 +2.0%" in text
    assert "2.0% of separate's layer" in text
    assert "reaches 81.0% of the flat read; the GEMM 76.5%" in text
    assert "Token tiles measured: 16 tokens" in text


def test_verdicts_follow_the_numbers(tmp_path):
    """Swap which variant is fastest: the verdicts change with the data, not with the code."""
    text = report.render([layer_run(sep=0.9, graph=1.1, chunk2=1.0, ceiling=None)], [], tmp_path / "f.md",
                         charts=False)
    assert "Best valid variant at mean 8: separate, 0.900 ms" in text
    assert "-200.0 us" in text  # the graph made it slower in this made-up run
    assert "one-launch ceiling" not in text  # no ceiling timed, no fusion verdict


def test_report_script_reads_files_and_names_a_bad_one(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "layer.json").write_text(json.dumps(layer_run()))
    (tmp_path / "gemm.json").write_text(json.dumps(GEMM))
    out = tmp_path / "docs" / "f.md"
    ok = subprocess.run([sys.executable, str(root / "scripts/report.py"), "--layer", str(tmp_path / "layer.json"),
                         "--gemm", str(tmp_path / "gemm.json"), "--out", str(out), "--no-charts"],
                        capture_output=True, text=True, cwd=root)
    assert ok.returncode == 0, ok.stderr
    assert "CUDA graph at mean 8" in out.read_text()
    bad = subprocess.run([sys.executable, str(root / "scripts/report.py"), "--layer", str(tmp_path / "nope.json")],
                         capture_output=True, text=True, cwd=root)
    assert bad.returncode == 2 and "nope.json" in bad.stderr


def test_report_needs_a_layer_run(tmp_path):
    with pytest.raises(ValueError, match="run_layer"):
        report.render([], [], tmp_path / "f.md")
