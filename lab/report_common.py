"""What every section of the findings page shares: the thresholds verdicts turn on, the number
formats, how a run_layer row and its means are read, where a run came from and which board ran
it, and matplotlib where it is installed."""

from __future__ import annotations

import re

VALID = ("baseline", "match")
# A time difference under this is called no difference: medians of the same variant moved
# 0.7-1.5% between two runs on the H200 (separate and cuda-graph; notes/layer.md).
NOISE_PCT = 1.0
# The key scripts/report.py gives each run it loads: the file the page cites for it.
FILE_KEY = "_file"
# Charts: drawn at DPI, no wider than CHART_MAX_PX (the page shows them at 880 px): a chart
# that wide stays legible scaled down to the page, and a 2x display shows it at full resolution.
CHART_MAX_PX = 1600
DPI = 110


def fmt(v, nd=3):
    return "-" if v is None else f"{v:.{nd}f}"


def us(ms: float) -> str:
    return f"{1000 * ms:.1f} us"


def valid(r: dict) -> bool:
    """A run_layer row that is timed, and whose output is what it promises (separate's checks
    passed, or bitwise equal)."""
    return r["expect"] in VALID and r.get("correct", r["expect"]) in VALID


def layer_means(layer_json: dict) -> list[str]:
    """The mean-token labels present in a run_layer JSON ('8', '32', ...), in column order."""
    keys = layer_json["layer"][0].keys() if layer_json.get("layer") else []
    return [k[3:] for k in keys if k.startswith("ms@")]


def source(run: dict) -> str:
    """'results/x.json, `script args` at <lab commit>': the file the page read, the command that
    wrote it and the kernels it ran (the command's --json is where the file was written first)."""
    cmd = "`" + " ".join([run.get("script", "?"), *map(str, run.get("argv", []))]) + "`"
    commit = run.get("setup", {}).get("lab_commit")
    cmd += f" at {commit}" if commit else ""
    return f"{run[FILE_KEY]}, {cmd}" if run.get(FILE_KEY) else cmd


def board(run: dict) -> str:
    """The GPU a run measured, as its model name ('H200', 'H100'), from the setup the scripts
    record; the whole device name where it holds no model number, '?' where none was recorded."""
    gpu = (run.get("setup") or {}).get("gpu") or ""
    m = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b", gpu)
    return m.group(1) if m else (gpu or "?")


def have_matplotlib() -> bool:
    return pyplot() is not None


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    # the page shows a chart ~1400 px wide at 880 px: 13 pt text lands at ~9 px there
    plt.rcParams.update({"font.size": 13})
    return plt
