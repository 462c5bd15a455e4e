"""Findings page from the JSON the scripts write: tables and one verdict per question, every
number read from the files (nothing typed in). `scripts/report.py` is the command line.

    inputs  run_layer.json (layer table, stages, setup)   bench_gemm*.json (GEMM rows)
    output  docs/findings-h200.md (+ PNG charts beside it when matplotlib is installed)
"""

from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

VALID = ("baseline", "match")


def _fmt(v, nd=3):
    return "-" if v is None else f"{v:.{nd}f}"


def layer_means(layer_json: dict) -> list[str]:
    """The mean-token labels present in a run_layer JSON ('8', '32', ...), in column order."""
    keys = layer_json["layer"][0].keys() if layer_json.get("layer") else []
    return [k[3:] for k in keys if k.startswith("ms@")]


def layer_table(rows: list[dict], means: list[str]) -> str:
    head = ["variant"] + [f"ms @{m}" for m in means] + [f"roof% @{m}" for m in means] + ["correct"]
    body = [[r["variant"]] + [_fmt(r.get(f"ms@{m}")) for m in means] + [_fmt(r.get(f"roof%@{m}"), 1) for m in means]
            + [r["correct"]] for r in rows]
    return tabulate(body, head, tablefmt="github")


def gemm_table(rows: list[dict]) -> str:
    head = ["gemm", "tokens/expert", "tile W,R,BK,S,F,mma", "ms", "% roofline", "read-pattern % roofline",
            "cuBLAS fp16 ms"]
    body = []
    for r in rows:
        c = r["config"]
        tile = f"{c['warps']},{c['row_tiles']},{c['k_step']},{c['stages']},{c['max_frags']},{c.get('mma', 0)}"
        body.append([r["gemm"], r["mean_tokens"], tile, _fmt(r["ms"]), _fmt(r["roof_pct"], 1),
                     _fmt(r.get("read_pattern_roof_pct"), 1), _fmt(r.get("cublas_ms"))])
    return tabulate(body, head, tablefmt="github")


def _ms(rows, name, mean):
    r = next((r for r in rows if r["variant"] == name), None)
    return None if r is None else r.get(f"ms@{mean}")


def verdicts(rows: list[dict], stages: list[dict], gemm_rows: list[dict], means: list[str]) -> list[str]:
    """One sentence per question, from the figures alone; `rows` come from one run, so every
    comparison is between times taken against the same measured roofline."""
    out = []
    for m in means:
        valid = [(r[f"ms@{m}"], r["variant"]) for r in rows
                 if r["expect"] in VALID and r.get(f"ms@{m}") is not None]
        if not valid:
            continue
        best_ms, best = min(valid)
        best_roof = next(r[f"roof%@{m}"] for r in rows if r["variant"] == best)
        ceil = _ms(rows, "one-launch-2G", m)
        if ceil is not None:
            out.append(f"Fusion at mean {m}: the one-launch ceiling ({ceil:.3f} ms) is "
                       f"{100 * (best_ms - ceil) / best_ms:.1f}% under the best valid variant "
                       f"({best}, {best_ms:.3f} ms): the most any single-kernel layer could collect "
                       f"with these mainloops.")
        sep, graph = _ms(rows, "separate", m), _ms(rows, "cuda-graph", m)
        if sep is not None and graph is not None:
            out.append(f"CUDA graph at mean {m}: {1000 * (sep - graph):.1f} us "
                       f"({100 * (sep - graph) / sep:.1f}%) off separate's {sep:.3f} ms.")
        chunks = sorted((int(r["variant"].split("-")[1]), r[f"ms@{m}"]) for r in rows
                        if r["variant"].startswith("chunked-") and r.get(f"ms@{m}") is not None)
        if chunks and sep is not None:
            trend = ", ".join(f"k={k} {100 * (ms - sep) / sep:+.1f}%" for k, ms in chunks)
            out.append(f"Chunking at mean {m} against separate: {trend}. (Whether a loss is tail "
                       f"effect or launch and scheduling is not measured in this run.)")
        out.append(f"Best valid variant at mean {m}: {best}, {best_ms:.3f} ms, {best_roof:.1f}% of the "
                   f"read roofline measured in the same run.")
    act = next((s for s in stages if s["stage"] == "act"), None)
    total = next((s for s in stages if s["stage"].startswith("separate")), None)
    if act and total:
        out.append(f"SwiGLU + quantize is {act['ms']:.3f} ms, {100 * act['ms'] / total['ms']:.1f}% of separate's "
                   f"layer: the most a SwiGLU epilogue saves in launch and stage time (it also removes "
                   f"the fp32 h round trip).")
    for r in gemm_rows:
        if r.get("read_pattern_roof_pct") is not None:
            out.append(f"{r['gemm']} at mean {r['mean_tokens']:g}: the GEMM's own access pattern read with no "
                       f"math reaches {r['read_pattern_roof_pct']:.1f}% of the flat read; the GEMM "
                       f"{r['roof_pct']:.1f}%.")
    tiles = sorted({r["config"]["max_frags"] * 8 for r in gemm_rows})
    if tiles:
        out.append(f"Token tiles measured: {', '.join(map(str, tiles))} tokens (all below CUTLASS's "
                   f"minimum of 128); a 128-token tile is not in these runs.")
    return out


def render(layer_runs: list[dict], gemm_runs: list[dict], out_md: Path, charts: bool = True) -> str:
    """Write the findings page (and charts when matplotlib is there); returns the markdown."""
    if not layer_runs:
        raise ValueError("render: need at least one run_layer JSON")
    base = layer_runs[0]
    gemm_rows = [r for run in gemm_runs for r in run["rows"]]
    setup = base.get("setup", {})
    parts = ["# Findings on the H200", "",
             "Generated by `scripts/report.py` from the JSON under `results/`; every figure comes "
             "from those files, and every comparison is between figures of one run.", "",
             "## Setup", "", tabulate([[k, v] for k, v in setup.items()], ["", ""], tablefmt="github"), ""]
    for i, run in enumerate(layer_runs, 1):
        means = layer_means(run)
        parts += [f"## Layer, run {i} (`{run.get('script', '?')} {' '.join(map(str, run.get('argv', [])))}`)", "",
                  f"Flat streaming read in this run: {run['read_roofline']['gbps']:.0f} GB/s.", "",
                  layer_table(run["layer"], means), ""]
        if run.get("stages"):
            parts += ["Stages of separate:", "",
                      tabulate([[s["stage"], _fmt(s["ms"]), _fmt(s.get("pct_of_layer"), 1),
                                 _fmt(s.get("roof_pct"), 1)] for s in run["stages"]],
                               ["stage", "ms", "% of layer", "roof%"], tablefmt="github"), ""]
        parts += ["Verdicts from this run:", ""]
        parts += [f"- {v}" for v in verdicts(run["layer"], run.get("stages", []), [], means)] + [""]
    if gemm_rows:
        parts += ["## Grouped GEMM", "", gemm_table(gemm_rows), "", "Verdicts:", ""]
        parts += [f"- {v}" for v in verdicts([], [], gemm_rows, [])]
    if charts:
        parts += ["", _charts(base["layer"], layer_means(base), out_md.parent)]
    text = "\n".join(parts) + "\n"
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(text)
    return text


def _charts(rows, means, folder: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(Charts: matplotlib is not installed; `pip install -e '.[plot]'` adds them.)"
    timed = [r for r in rows if r["expect"] != "approx" and r.get(f"ms@{means[0]}") is not None]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r["variant"] for r in timed], [r[f"roof%@{means[0]}"] for r in timed], color="tab:blue")
    ax.axhline(100, color="k", lw=1)
    ax.set_ylabel(f"% of read roofline @{means[0]}")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(folder / "variants-roofline.png", dpi=120)
    plt.close(fig)
    return "![variants against the roofline](variants-roofline.png)"
