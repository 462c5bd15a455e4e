"""The findings page's layer section: per run_layer run, every variant's time against the read
roofline measured in the same run, separate's stages, and the verdicts on fusion, the CUDA graph,
the SwiGLU epilogue, option (a) against (b) and chunking; then the chart of the uniform-routing
runs."""

from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from lab.report_common import CHART_MAX_PX, DPI, FILE_KEY, NOISE_PCT, board, fmt as _fmt, layer_means, source as _source
from lab.report_common import us as _us, valid as _valid

FUSED = ("fused-layer", "fused-swiglu")
RUN_ALL = ("python scripts/run_layer.py --variants separate cuda-graph fused-swiglu fused-layer fold-b "
           "one-launch-2G --json results/run_layer.json")
LAYER_PNG = "layer-h200.png"
LAYER_ALT = "layer variants against the read roofline, every uniform-routing run"


def _versus(ms: float, ref_ms: float, ref: str) -> str:
    """'12.0 us (1.0%) under cuda-graph's 1.200 ms' (or 'over')."""
    d = ms - ref_ms
    return f"{_us(abs(d))} ({100 * abs(d) / ref_ms:.1f}%) {'under' if d < 0 else 'over'} {ref}'s {ref_ms:.3f} ms"


def layer_table(rows: list[dict], means: list[str]) -> str:
    # the error a user pays (against the float64 layer on unquantized activations), in runs that have it
    e2e = any(r.get("e2e_rel") for r in rows)
    head = (["variant"] + [f"ms @{m}" for m in means] + [f"roof% @{m}" for m in means] +
            ([f"vs float64 @{m}" for m in means] if e2e else []) + ["correct"])
    body = [[r["variant"]] + [_fmt(r.get(f"ms@{m}")) for m in means] + [_fmt(r.get(f"roof%@{m}"), 1) for m in means]
            + ([_rel(r.get("e2e_rel", {}).get(m)) for m in means] if e2e else []) + [r["correct"]] for r in rows]
    return tabulate(body, head, tablefmt="github", disable_numparse=True)


def _rel(v) -> str:
    return "-" if v is None else f"{v:.1e}"


def _row(rows, name):
    return next((r for r in rows if r["variant"] == name), None)


def _ms(rows, name, mean):
    r = _row(rows, name)
    return None if r is None else r.get(f"ms@{mean}")


def _valid_ms(rows, name, mean):
    r = _row(rows, name)
    return r.get(f"ms@{mean}") if r is not None and _valid(r) else None


def _layer_error(row: dict, mean: str):
    """The layer's relative error against float64 at `mean` from the row's checks: `rel` for
    approx variants, `layer_rel` for separate; None when not checked."""
    for c in row.get("checks", []):
        if float(c.get("mean", "nan")) == float(mean):
            v = c.get("rel", c.get("layer_rel"))
            if v is not None:
                return v
    return None


def _not_valid_note(rows, names, mean) -> list[str]:
    out = []
    for n in names:
        r = _row(rows, n)
        if r is not None and not _valid(r):
            t = r.get(f"ms@{mean}")
            out.append(f"{n} at mean {mean} is not counted: {'not timed' if t is None else f'{t:.3f} ms'}, "
                       f"correct: '{r['correct']}'.")
    return out


def fusion_verdicts(rows: list[dict], mean: str) -> list[str]:
    """Is fusion worth anything on the H200: the fused variants against the captured layer
    (cuda-graph) and separate, and the share of the one-launch ceiling they collect."""
    sep, graph = _valid_ms(rows, "separate", mean), _valid_ms(rows, "cuda-graph", mean)
    ceil = _ms(rows, "one-launch-2G", mean)
    out = _not_valid_note(rows, FUSED, mean)
    fused = [(n, _valid_ms(rows, n, mean)) for n in FUSED]
    fused = [(n, t) for n, t in fused if t is not None]
    if ceil is not None:
        valid = [(r[f"ms@{mean}"], r["variant"]) for r in rows if _valid(r) and r.get(f"ms@{mean}") is not None]
        if valid:
            best_ms, best = min(valid)
            if ceil < best_ms:
                out.append(f"The one-launch-2G ceiling at mean {mean} ({ceil:.3f} ms) is "
                           f"{100 * (best_ms - ceil) / best_ms:.1f}% under the best valid variant ({best}, "
                           f"{best_ms:.3f} ms): the most any single-kernel layer could collect with these mainloops.")
            else:
                out.append(f"The one-launch-2G 'ceiling' at mean {mean} ({ceil:.3f} ms) is not one in this run: "
                           f"{best} ({best_ms:.3f} ms) is {_us(ceil - best_ms)} faster. The ceiling is the plain "
                           f"kernel: it writes h and its output in fp32, where a fused layer keeps h on chip "
                           f"and writes bf16, so it bounds launch structure, not epilogue traffic.")
    if not fused:
        out.append(f"fused-swiglu and fused-layer were not measured in this run (`{RUN_ALL}` measures them).")
        return out
    for n, t in fused:
        parts = [f"{n} at mean {mean}: {t:.3f} ms"]
        if graph is not None:
            parts.append(_versus(t, graph, "cuda-graph"))
        if sep is not None:
            parts.append(_versus(t, sep, "separate"))
        s = ", ".join(parts)
        if graph is not None and ceil is not None and graph > ceil:
            if t <= ceil:
                s += f"; it is {_us(ceil - t)} under the one-launch-2G ceiling itself"
            elif t < graph:
                s += f"; it collects {100 * (graph - t) / (graph - ceil):.0f}% of the {_us(graph - ceil)} the ceiling allows"
            else:
                s += f"; of the {_us(graph - ceil)} the ceiling allows it collects none"
        out.append(s + ".")
    ref, ref_name = (graph, "cuda-graph") if graph is not None else (sep, "separate")
    if ref is not None:
        best_t, best_n = min((t, n) for n, t in fused)
        gain = 100 * (ref - best_t) / ref
        if gain > NOISE_PCT:
            out.append(f"Verdict at mean {mean}: fusion is worth {_us(ref - best_t)} ({gain:.1f}%) over {ref_name}, "
                       f"with {best_n}.")
        elif gain >= -NOISE_PCT:
            out.append(f"Verdict at mean {mean}: fusion is worth nothing measurable: the best fused variant ({best_n}, "
                       f"{best_t:.3f} ms) is {gain:+.1f}% against {ref_name}, inside the {NOISE_PCT:g}% noise.")
        else:
            out.append(f"Verdict at mean {mean}: fusion is worth nothing; it costs: the best fused variant ({best_n}, "
                       f"{best_t:.3f} ms) is {_us(best_t - ref)} ({-gain:.1f}%) slower than {ref_name}.")
    return out


def graph_verdicts(rows: list[dict], mean: str, skewed: bool = False) -> list[str]:
    """Does a CUDA graph collect it: cuda-graph against separate, beside what fusion adds.
    `skewed`: a GEMM of the run split by expert size (_split_plans), where the graph runs the two
    launches side by side on two streams (separate runs them in order)."""
    sep, graph = _valid_ms(rows, "separate", mean), _valid_ms(rows, "cuda-graph", mean)
    if sep is None or graph is None:
        return ["separate and cuda-graph are not both timed and valid in this run."
                if _row(rows, "separate") is None or _row(rows, "cuda-graph") is None else
                f"At mean {mean} separate and cuda-graph are not both timed and valid."]
    gain = 100 * (sep - graph) / sep
    s = f"CUDA graph at mean {mean}: {_us(sep - graph)} ({gain:.1f}%) off separate's {sep:.3f} ms"
    if gain > NOISE_PCT and skewed:
        s += (": the graph collects the launch overhead and, where a GEMM's plan splits by expert size, runs "
              "the two launches side by side on two streams (separate runs them in order)")
    elif gain > NOISE_PCT:
        s += ": the graph collects the launch overhead"
    elif gain >= -NOISE_PCT:
        s += f": nothing measurable (within {NOISE_PCT:g}%), so launches cost little here"
    else:
        s += f": the graph is slower here, by more than the {NOISE_PCT:g}% noise"
    fused = [(t, n) for n in FUSED if (t := _valid_ms(rows, n, mean)) is not None]
    if fused:
        t, n = min(fused)
        s += (f"; {n} adds {_us(graph - t)} on top of the graph" if t < graph else
              f"; the best fused variant ({n}) is {_us(t - graph)} slower than the graph")
    return [s + "."]


def swiglu_verdicts(rows: list[dict], stages: list[dict], mean: str, stage_mean: str | None) -> list[str]:
    """What the SwiGLU epilogue is worth: fused-swiglu against cuda-graph, against the act stage."""
    act = next((s for s in stages if s["stage"] == "act"), None)
    total = next((s for s in stages if s["stage"].startswith("separate")), None)
    fs, graph = _valid_ms(rows, "fused-swiglu", mean), _valid_ms(rows, "cuda-graph", mean)
    act_txt = ""
    if act and total and (stage_mean is None or stage_mean == mean):
        act_txt = f"the act stage (SwiGLU + quantize) is {act['ms']:.3f} ms, {100 * act['ms'] / total['ms']:.1f}% of separate's layer"
    if fs is None or graph is None:
        out = ["The SwiGLU epilogue (fused-swiglu against cuda-graph) was not measured in this run."]
        if act_txt:
            out.append(f"At mean {mean} {act_txt}: the most an epilogue saves in launch and stage time (it also "
                       f"removes the fp32 h round trip).")
        return out
    saved = graph - fs
    s = f"SwiGLU epilogue at mean {mean}: fused-swiglu is {_versus(fs, graph, 'cuda-graph')}"
    if act_txt and saved > 0:
        s += f"; {act_txt}, so the epilogue saves {100 * saved / act['ms']:.0f}% of the stage's time"
        s += " (over 100%: the h round trip it removes counts too)" if saved > act["ms"] else ""
    elif act_txt:
        s += (f"; {act_txt}: the epilogue saves nothing, it costs {saved / -act['ms']:.1f}x the stage it "
              f"replaces")
    return [s + "."]


def fold_verdicts(rows: list[dict], mean: str) -> list[str]:
    """What option (a) costs against (b): fold-b (one w13 alpha, the gate/up ratio folded into
    the e4m3 scales) against fused-swiglu (option (a) with the same epilogue) or cuda-graph."""
    fb = _row(rows, "fold-b")
    t = None if fb is None else fb.get(f"ms@{mean}")
    if fb is None:
        return [f"fold-b (option (b)) was not measured in this run (`{RUN_ALL}` measures it)."]
    if t is None:
        return [f"At mean {mean} fold-b (option (b)) was not timed: '{fb['correct']}'."]
    ref_name = next((n for n in ("fused-swiglu", "cuda-graph") if _valid_ms(rows, n, mean) is not None), None)
    s = f"Option (b) at mean {mean}: fold-b {t:.3f} ms"
    if ref_name is not None:
        ref = _valid_ms(rows, ref_name, mean)
        s += f", {_versus(t, ref, ref_name)} (option (a))"
    err_b = _layer_error(fb, mean)
    sep = _row(rows, "separate")
    err_a = None if sep is None else _layer_error(sep, mean)
    if err_b is not None:
        s += f"; its layer error against float64 is {err_b:.2e}"
        if err_a is not None:
            s += f" (separate's, option (a): {err_a:.2e})"
    else:
        s += f"; its error: '{fb['correct']}'"
    if ref_name is not None:
        ref = _valid_ms(rows, ref_name, mean)
        gain = 100 * (ref - t) / ref
        s += (f". Verdict: option (a) costs {_us(ref - t)} ({gain:.1f}%) against (b)" if gain > NOISE_PCT else
              f". Verdict: option (a) costs nothing measurable against (b) ({gain:+.1f}%, inside {NOISE_PCT:g}%)")
    return [s + "."]


def layer_verdicts(rows: list[dict], stages: list[dict], means: list[str],
                   stage_mean: str | None = None, skewed: bool = False) -> dict[str, list[str]]:
    """Question -> sentences, from one run's figures (every comparison is against the same
    measured roofline). ``stage_mean``: the mean the stage table was timed at (None: unknown);
    ``skewed``: a GEMM of the run split by expert size (graph_verdicts)."""
    q: dict[str, list[str]] = {"Is fusion worth anything on the H200?": [],
                               "Does a CUDA graph collect it?": [],
                               "What is the SwiGLU epilogue worth?": [],
                               "What does option (a) cost against (b)?": [],
                               "Chunking": [], "Best valid variant": []}
    for m in means:
        q["Is fusion worth anything on the H200?"] += fusion_verdicts(rows, m)
        q["Does a CUDA graph collect it?"] += graph_verdicts(rows, m, skewed)
        q["What is the SwiGLU epilogue worth?"] += swiglu_verdicts(rows, stages, m, stage_mean)
        q["What does option (a) cost against (b)?"] += fold_verdicts(rows, m)
        sep = _valid_ms(rows, "separate", m)
        chunks = sorted((int(r["variant"].split("-")[1]), r[f"ms@{m}"]) for r in rows
                        if r["variant"].startswith("chunked-") and _valid(r) and r.get(f"ms@{m}") is not None)
        if chunks and sep is not None:
            trend = ", ".join(f"k={k} {100 * (ms - sep) / sep:+.1f}%" for k, ms in chunks)
            q["Chunking"].append(f"Chunking at mean {m} against separate: {trend} (tail effect or launch and "
                                 f"scheduling: the chunk study below).")
        valid = [(r[f"ms@{m}"], r["variant"]) for r in rows if _valid(r) and r.get(f"ms@{m}") is not None]
        if valid:
            best_ms, best = min(valid)
            best_roof = _row(rows, best)[f"roof%@{m}"]
            q["Best valid variant"].append(f"Best valid variant at mean {m}: {best}, {best_ms:.3f} ms, "
                                           f"{best_roof:.1f}% of the read roofline measured in the same run.")
    return {k: list(dict.fromkeys(v)) for k, v in q.items() if v}  # run-wide sentences once


def _stage_mean(run: dict) -> str | None:
    """The mean the stage table was timed at: the one where separate's layer time is the stage
    table's 'separate (one run)' (run_layer times both in the same run), else --stage-mean."""
    total = next((s for s in run.get("stages", []) if s["stage"].startswith("separate")), None)
    sep = _row(run.get("layer", []), "separate")
    if total and sep:
        for m in layer_means(run):
            if sep.get(f"ms@{m}") == total["ms"]:
                return m
    argv = [str(a) for a in run.get("argv", [])]
    if "--stage-mean" in argv[:-1]:
        return f"{float(argv[argv.index('--stage-mean') + 1]):g}"
    return None


def _split_plans(run: dict) -> bool:
    """Whether a GEMM of the run split by expert size: its recorded plans (run_layer's
    gemm_plans), or, for runs before they were recorded, a skewed routing (where gemm_plan may
    split)."""
    plans = run.get("gemm_plans")
    if plans is None:
        return _skew(run) > 0
    return any(len(p) > 1 for by_gemm in plans.values() for p in by_gemm.values())


def _skew(run: dict) -> float:
    """The routing skew a run was made with (its --skew; 0: uniform)."""
    argv = run.get("argv", [])
    return float(argv[argv.index("--skew") + 1]) if "--skew" in argv[:-1] else 0.0


def _condition(run: dict) -> str:
    """What sets a run apart from a default run of its script: its flags, less the output path
    and the selections (means, variants) that only choose what is timed."""
    argv, out, skip = [str(a) for a in run.get("argv", [])], [], False
    for a in argv:
        if skip and not a.startswith("--"):
            continue
        skip = a in ("--json", "--mean-tokens", "--variants")
        if not skip:
            out.append(a)
    return " ".join(out)


def layer_series(layer_runs: list[dict]) -> list[dict]:
    """One series per (run condition, kernels, mean) over the layer runs, in run order. Runs of
    the same command at the same commit are repeats: their medians make one series, drawn at
    the median run with a min-max whisker. Each variant's value is % of the read roofline of
    its own run (roofline time at that run's flat read over the variant's time)."""
    groups: dict[tuple, dict] = {}
    for i, run in enumerate(layer_runs, 1):
        key = (run.get("script"), _condition(run), run.get("setup", {}).get("lab_commit"))
        g = groups.setdefault(key, {"condition": key[1], "commit": key[2], "runs": [], "gbps": []})
        g["runs"].append(i)
        g["gbps"].append(run["read_roofline"]["gbps"])
        for m in layer_means(run):
            s = g.setdefault(m, {})
            for r in run["layer"]:
                if r.get(f"roof%@{m}") is not None:
                    s.setdefault(r["variant"], []).append((r[f"roof%@{m}"], r[f"ms@{m}"], r))
    out = []
    for g in groups.values():
        for m in [k for k in g if k not in ("condition", "commit", "runs", "gbps")]:
            label = f"mean {m}" + (f", {g['condition']}" if g["condition"] else "")
            label += f" (run {', '.join(map(str, g['runs']))}, {g['commit']})" if g["commit"] else ""
            vals = {}
            for v, pts in g[m].items():
                pts = sorted(pts, key=lambda p: p[0])
                mid = pts[(len(pts) - 1) // 2]
                vals[v] = {"roof": mid[0], "ms": mid[1], "lo": pts[0][0], "hi": pts[-1][0], "n": len(pts),
                           "row": mid[2]}
            out.append({"label": label, "values": vals})
    return out


def _variant_label(row: dict) -> str:
    tag = ("ceiling, not valid" if row["expect"] == "ceiling" else "approx." if row["expect"] == "approx"
           else None if _valid(row) else f"not valid: {row['correct']}")
    return row["variant"] + (f" ({tag})" if tag else "")


def _layer_chart(plt, layer_runs: list[dict], path: Path) -> None:
    """Horizontal bars: % of the read roofline per variant (on the axis), one bar per series
    (legend outside the plot), the roofline as the 100% line, whiskers the spread of repeats."""
    series = layer_series(layer_runs)
    variants = list(dict.fromkeys(v for s in series for v in s["values"]))
    rows = {v: next(s["values"][v]["row"] for s in series if v in s["values"]) for v in variants}
    n = len(series)
    bar = 0.8 / n
    # taller with more bars, up to the page's limit (then the bars grow thinner, the labels stay)
    fig, ax = plt.subplots(figsize=(12.5, min(3.0 + 0.24 * len(variants) * n, (CHART_MAX_PX - 20) / DPI)))
    colors = plt.get_cmap("tab10").colors
    for k, s in enumerate(series):
        ys, xs, lo, hi, ms, hatch = [], [], [], [], [], []
        for j, v in enumerate(variants):
            if v not in s["values"]:
                continue
            d = s["values"][v]
            ys.append(j + (k - (n - 1) / 2) * bar)
            xs.append(d["roof"])
            lo.append(d["roof"] - d["lo"])
            hi.append(d["hi"] - d["roof"])
            ms.append(d["ms"])
            hatch.append(not _valid(d["row"]))
        many = any(d["n"] > 1 for d in s["values"].values())
        label = s["label"] + (" (whiskers: min-max over the runs)" if many else "")
        bars = ax.barh(ys, xs, bar * 0.92, color=colors[k % len(colors)], label=label,
                       xerr=[lo, hi] if many else None, capsize=3 if many else 0)
        for b, h in zip(bars, hatch):
            if h:
                b.set_hatch("//")
                b.set_edgecolor("white")
        for y, x, t in zip(ys, xs, ms):
            ax.text(x + 0.8, y, f"{t:.3f} ms", va="center", fontsize=10)
    ax.axvline(100, color="k", linewidth=1.5, linestyle="--",
               label="read roofline: the layer's bytes at the run's flat read (100%)")
    ax.text(100.8, -0.6, "read roofline", fontsize=14, va="bottom")
    if any(not _valid(rows[v]) for v in variants):
        ax.bar(0, 0, color="white", edgecolor="grey", hatch="//",
               label="hatched: not counted among valid variants (approximate output, or the ceiling)")
    ax.set_yticks(range(len(variants)), [_variant_label(rows[v]) for v in variants], fontsize=14)
    ax.invert_yaxis()
    ax.set_xlim(0, 118)
    ax.set_xlabel("% of the read roofline (higher is faster; bar labels: median layer time)")
    ax.grid(axis="x", alpha=0.3)
    title = "\n".join(f"run {i} ({run.get(FILE_KEY, run.get('script', '?'))}, "
                      f"{run.get('setup', {}).get('lab_commit', '?')}): flat read "
                      f"{run['read_roofline']['gbps']:.0f} GB/s" for i, run in enumerate(layer_runs, 1))
    ax.set_title("Layer time per variant against the read roofline\n" + title, fontsize=15)
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.07), fontsize=12, frameon=False, ncol=1)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def section(runs: list[dict], out_dir: Path, plt=None) -> list[str]:
    """One subsection per run (its table, separate's stages, the verdicts), then the chart, drawn
    into out_dir when plt is given."""
    parts = []
    for i, run in enumerate(runs, 1):
        means = layer_means(run)
        parts += [f"## Layer on the {board(run)}, run {i} ({_source(run)})", "",
                  f"Flat streaming read in this run: {run['read_roofline']['gbps']:.0f} GB/s."
                  + (" vs float64 = the error against the float64 layer on unquantized activations (what a user "
                     "pays); approx (e) under correct = the error against the lab's float64 reference, which "
                     "quantizes the activations to NVFP4 as W4A4 does." if any(r.get("e2e_rel") for r in run["layer"])
                     else ""), "",
                  layer_table(run["layer"], means), ""]
        if run.get("stages"):
            sm = _stage_mean(run)
            parts += [f"Stages of separate{'' if sm is None else f' at mean {sm}'}:", "",
                      tabulate([[s["stage"], _fmt(s["ms"]), _fmt(s.get("pct_of_layer"), 1),
                                 _fmt(s.get("roof_pct"), 1)] for s in run["stages"]],
                               ["stage", "ms", "% of layer", "roof%"], tablefmt="github"), ""]
        parts += ["Verdicts from this run:", ""]
        for question, sentences in layer_verdicts(run["layer"], run.get("stages", []), means,
                                                  _stage_mean(run), _split_plans(run)).items():
            parts += [f"**{question}**", ""] + [f"- {s}" for s in sentences] + [""]
    parts += [f"![{LAYER_ALT}]({LAYER_PNG})", ""]
    if plt is not None:  # the uniform-routing runs; the skewed ones have their tables above
        _layer_chart(plt, [r for r in runs if not _skew(r)] or runs[:1], out_dir / LAYER_PNG)
    return parts
