"""The findings page's three studies, each a question about the grouped GEMM: is its gap to
the read roofline the mainloop or the access pattern (read_roofline), does chunking lose time
through the tail or through launch and scheduling (chunk_study), does a token tile below 128
recover anything (tile_sweep); and the tile sweep's chart."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from tabulate import tabulate

from lab.report_common import DPI, FILE_KEY, NOISE_PCT, board, fmt as _fmt, source as _source, us as _us

# A cause "dominates" a loss when it accounts for at least this share; between 1 - DOMINANT
# and DOMINANT the verdict says both.
DOMINANT = 0.6
# study -> the script that writes results/<study>.json
STUDIES = {"read_roofline": "scripts/read_roofline.py", "chunk_study": "scripts/chunk_study.py",
           "tile_sweep": "scripts/tile_sweep.py"}
TILE_PNG = "tile-sweep-h200.png"
TILE_ALT = "tile sweep: % of the read roofline per token tile"


def missing(study: str) -> str:
    """What the page says in place of a study whose JSON is not there."""
    return (f"Not measured: `results/{study}.json` is missing; `python {STUDIES[study]} --json "
            f"results/{study}.json` writes it (on the GPU).")


# ---------------------------------------------------------------------------------------------
# read roofline (read_roofline.json): mainloop or access pattern?
# ---------------------------------------------------------------------------------------------


def read_roofline_table(rows: list[dict]) -> str:
    body = [[r["gemm"], f"{r['mean_tokens']:g}", _fmt(r["read_pattern_ms"]), _fmt(r["read_pattern_roof_pct"], 1),
             _fmt(r["ms"]), _fmt(r["roof_pct"], 1)] for r in rows]
    return tabulate(body, ["gemm", "tokens/expert", "pattern read ms", "pattern % of flat", "GEMM ms",
                           "GEMM % of flat"], tablefmt="github", disable_numparse=True)


def split_gap(r: dict) -> dict:
    """The GEMM's time over the roofline, split: the part its access pattern alone already
    takes (pattern read time over the roofline) and the rest, the mainloop (GEMM over the
    pattern read). A pattern read slower than the GEMM puts the whole gap on the pattern."""
    roof = r["ms"] * r["roof_pct"] / 100  # the required bytes at the flat read
    gap = max(0.0, r["ms"] - roof)
    mainloop = min(gap, max(0.0, r["ms"] - r["read_pattern_ms"]))
    share = mainloop / gap if gap else 0.0
    cause = "mainloop" if share >= DOMINANT else "access pattern" if share <= 1 - DOMINANT else "both"
    return {"roof_ms": roof, "gap_ms": gap, "mainloop_ms": mainloop, "pattern_ms": gap - mainloop,
            "mainloop_share": share, "cause": cause}


def read_roofline_verdicts(rows: list[dict]) -> list[str]:
    """Per mean: is the gap between the GEMM and the roofline the mainloop or the access pattern?"""
    out = []
    for m in dict.fromkeys(r["mean_tokens"] for r in rows):
        parts, causes = [], []
        for r in (r for r in rows if r["mean_tokens"] == m):
            s = split_gap(r)
            causes.append(s["cause"])
            head = (f"{r['gemm']} takes {r['ms']:.3f} ms ({r['roof_pct']:.1f}% of flat) against "
                    f"{r['read_pattern_ms']:.3f} ms for its access pattern read alone ({r['read_pattern_roof_pct']:.1f}%)")
            if r["read_pattern_ms"] >= r["ms"]:
                parts.append(f"{head}: the GEMM hides its math entirely, so all {_us(s['gap_ms'])} over the "
                             f"roofline is the access pattern")
            else:
                parts.append(f"{head}: of its {_us(s['gap_ms'])} over the roofline, {_us(s['mainloop_ms'])} "
                             f"({100 * s['mainloop_share']:.0f}%) is the mainloop")
        cause = causes[0] if len(set(causes)) == 1 else "mixed (" + ", ".join(causes) + ")"
        out.append(f"Mean {m:g}: {cause}. " + "; ".join(parts) + ".")
    return out


# ---------------------------------------------------------------------------------------------
# chunk study (chunk_study.json): tail effect or launch and scheduling?
# ---------------------------------------------------------------------------------------------


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def chunk_table(rows: list[dict]) -> str:
    body = [[f"{r['mean_tokens']:g}", r["k"], _fmt(r["ms"]), _fmt(r["roof_pct"], 1), f"{_mean(r['w13_waves']):.2f}",
             f"{_mean(r['last_wave_fill']):.2f}", _fmt(r["w13_gap_ms"]), _fmt(r["idle_ms"]), _fmt(r["span_ms"])]
            for r in rows]
    return tabulate(body, ["tokens/expert", "k", "ms (graph)", "roof%", "w13 waves/chunk", "last-wave fill",
                           "w13 gaps ms (direct)", "idle ms (direct)", "span ms (direct)"], tablefmt="github",
                    disable_numparse=True)


def chunk_cause(base: dict, r: dict) -> dict:
    """Chunk count k against k = 1: the loss (graph time), the extra time the w13 weight
    stream sits idle between chunks (direct run), and the wave slots the last waves leave
    empty. The part of the loss the gaps explain is launch and scheduling; the rest is put
    on the tail (wave quantisation)."""
    loss = r["ms"] - base["ms"]
    gaps = r["w13_gap_ms"] - base["w13_gap_ms"]
    empty = sum(math.ceil(w) - w for w in r["w13_waves"])
    empty_base = sum(math.ceil(w) - w for w in base["w13_waves"])
    if 100 * loss / base["ms"] <= NOISE_PCT:
        return {"loss_ms": loss, "gaps_ms": gaps, "empty_waves": empty, "empty_waves_k1": empty_base,
                "gap_share": None, "cause": "no loss"}
    share = min(1.0, max(0.0, gaps) / loss)
    cause = ("launch and scheduling" if share >= DOMINANT else "tail effect" if share <= 1 - DOMINANT else "both")
    return {"loss_ms": loss, "gaps_ms": gaps, "empty_waves": empty, "empty_waves_k1": empty_base,
            "gap_share": share, "cause": cause}


def chunk_verdicts(rows: list[dict]) -> list[str]:
    out = []
    for m in dict.fromkeys(r["mean_tokens"] for r in rows):
        mine = sorted((r for r in rows if r["mean_tokens"] == m), key=lambda r: r["k"])
        base = next((r for r in mine if r["k"] == 1), None)
        if base is None:
            out.append(f"Mean {m:g}: no k = 1 row to compare with.")
            continue
        parts, causes = [], []
        for r in mine:
            if r["k"] == 1:
                continue
            c = chunk_cause(base, r)
            pct = 100 * c["loss_ms"] / base["ms"]
            if c["cause"] == "no loss":
                parts.append(f"k={r['k']} {pct:+.1f}% (no loss)")
                continue
            causes.append(c["cause"])
            cover = ("covering the loss" if c["gap_share"] >= 1 else f"{100 * c['gap_share']:.0f}% of the loss")
            parts.append(f"k={r['k']} {pct:+.1f}% ({_us(c['loss_ms'])}): the w13 stream idles {_us(c['gaps_ms'])} "
                         f"more between chunks, {cover}; last waves "
                         f"{100 * _mean(r['last_wave_fill']):.0f}% full, {c['empty_waves']:.1f} empty wave slots "
                         f"against {c['empty_waves_k1']:.1f} at k=1 -> {c['cause']}")
        if not causes:
            verdict = "chunking loses nothing measurable"
        else:
            counts = {c: causes.count(c) for c in dict.fromkeys(causes)}
            top = max(counts.values())
            leaders = [c for c, n in counts.items() if n == top]
            verdict = leaders[0] if len(leaders) == 1 else "both"
            verdict = f"where chunking loses, it is {verdict}" + ("" if verdict != "both" else
                                                                  " (tail effect and launch and scheduling)")
        out.append(f"Mean {m:g} (k=1 {base['ms']:.3f} ms): {verdict}. " + "; ".join(parts) + ".")
    out.append("Gaps come from the directly launched run with events around every stage, times from the "
               "captured graph; gaps that exceed the loss mean the graph hides part of them.")
    return out


# ---------------------------------------------------------------------------------------------
# tile sweep (tile_sweep.json): does a token tile below 128 recover anything?
# ---------------------------------------------------------------------------------------------


def _tile(r: dict) -> str:
    return f"{r['token_tile']},{r['block_rows']},{r['k_step']},{r['stages']}"


def tile_tables(rows: list[dict]) -> tuple[str, str]:
    """(measured tiles table, failed tiles table)."""
    groups = list(dict.fromkeys((r["gemm"], r["mean_tokens"]) for r in rows))
    rows = sorted(rows, key=lambda r: (groups.index((r["gemm"], r["mean_tokens"])), r["token_tile"], r["block_rows"],
                                       r["k_step"], r["stages"]))
    ok = [r for r in rows if "ms" in r]
    bad = [r for r in rows if "ms" not in r]
    t1 = tabulate([[_tile(r), r["gemm"], f"{r['mean_tokens']:g}", _fmt(r["ms"]), f"{r['gbps']:.0f}",
                    _fmt(r["roof_pct"], 1)] for r in ok],
                  ["tile (token_tile,block_rows,k_step,stages)", "gemm", "tokens/expert", "ms", "GB/s", "roof%"], tablefmt="github",
                  disable_numparse=True)
    t2 = tabulate([[_tile(r), r["gemm"], f"{r['mean_tokens']:g}", r.get("error", "?")] for r in bad],
                  ["tile (token_tile,block_rows,k_step,stages)", "gemm", "tokens/expert", "why not"], tablefmt="github",
                  disable_numparse=True)
    return t1, t2


def tile_verdicts(rows: list[dict]) -> list[str]:
    out = []
    for gemm, m in dict.fromkeys((r["gemm"], r["mean_tokens"]) for r in rows):
        mine = [r for r in rows if r["gemm"] == gemm and r["mean_tokens"] == m]
        ok = [r for r in mine if "ms" in r]
        sub = [r for r in ok if r["token_tile"] < 128]
        t128 = [r for r in ok if r["token_tile"] == 128]
        head = f"{gemm} at mean {m:g}"
        if not sub:
            out.append(f"{head}: no token tile below 128 ran.")
            continue
        best = min(sub, key=lambda r: r["ms"])
        best_txt = f"the best tile below 128 tokens ({_tile(best)}) takes {best['ms']:.3f} ms ({best['roof_pct']:.1f}%)"
        if t128:
            b128 = min(t128, key=lambda r: r["ms"])
            gain = 100 * (b128["ms"] - best["ms"]) / b128["ms"]
            verdict = (f"yes, {gain:.1f}% ({_us(b128['ms'] - best['ms'])})" if gain > NOISE_PCT else
                       f"no ({gain:+.1f}%, inside {NOISE_PCT:g}%)" if gain >= -NOISE_PCT else
                       f"no, 128 tokens is {-gain:.1f}% faster")
            out.append(f"{head}: {verdict}: {best_txt} against {b128['ms']:.3f} ms ({b128['roof_pct']:.1f}%) for "
                       f"the best 128-token tile ({_tile(b128)}).")
            continue
        why = list(dict.fromkeys(r.get("error", "?") for r in mine if r["token_tile"] == 128))
        largest = max(r["token_tile"] for r in sub)
        lg = min((r for r in sub if r["token_tile"] == largest), key=lambda r: r["ms"])
        reason = f"unsupported here ({'; '.join(why)})" if why else "not in this sweep"
        s = f"{head}: a 128-token tile is {reason}, so there is no 128 to recover anything against; {best_txt}"
        if lg is not best:
            s += (f", {100 * (lg['ms'] - best['ms']) / lg['ms']:.1f}% under the largest that ran "
                  f"({_tile(lg)}, {lg['ms']:.3f} ms)")
        else:
            s += ", and is the largest token tile that ran"
        out.append(s + ".")
    return out


def tile_grid(rows: list[dict]) -> tuple[list[str], list[int], list[list[float | None]]]:
    """(row labels 'gemm @mean', token tiles, best roof% per cell or None where none ran)."""
    labels = list(dict.fromkeys((r["gemm"], r["mean_tokens"]) for r in rows))
    tiles = sorted({r["token_tile"] for r in rows})
    grid = []
    for g, m in labels:
        line = []
        for t in tiles:
            vals = [r["roof_pct"] for r in rows if (r["gemm"], r["mean_tokens"], r["token_tile"]) == (g, m, t)
                    and "roof_pct" in r]
            line.append(max(vals) if vals else None)
        grid.append(line)
    return [f"{g} @{m:g}" for g, m in labels], tiles, grid


def _tile_chart(plt, sweep: dict, path: Path) -> None:
    """Best % of the read roofline per token tile, one line per GEMM and mean (legend outside),
    whiskers down to the worst block_rows / K step / stages at that token tile, the roofline as the
    100% line; token tiles that could not run are marked on the axis with the reason."""
    rows = sweep["rows"]
    labels, tiles, grid = tile_grid(rows)
    keys = list(dict.fromkeys((r["gemm"], r["mean_tokens"]) for r in rows))
    fig, ax = plt.subplots(figsize=(12.5, 6.2))
    means = list(dict.fromkeys(m for _, m in keys))
    colors = plt.get_cmap("tab10").colors
    n = len(keys)
    for k, ((g, m), label, line) in enumerate(zip(keys, labels, grid)):
        xs, ys, lo = [], [], []
        for j, (t, best) in enumerate(zip(tiles, line)):
            if best is None:
                continue
            worst = min(r["roof_pct"] for r in rows if (r["gemm"], r["mean_tokens"], r["token_tile"]) == (g, m, t)
                        and "roof_pct" in r)
            xs.append(j + (k - (n - 1) / 2) * 0.035)
            ys.append(best)
            lo.append(best - worst)
        ax.errorbar(xs, ys, yerr=[lo, [0] * len(lo)], color=colors[means.index(m) % len(colors)],
                    linestyle="-" if g == keys[0][0] else ":", marker="o" if g == keys[0][0] else "s",
                    capsize=3, label=label)
    why = {t: sorted({r.get("error", "?") for r in rows if r["token_tile"] == t and "roof_pct" not in r})
           for t in tiles}
    ticks = []
    for t, col in zip(tiles, zip(*grid)):
        none = "\n".join(textwrap.wrap("none ran: " + "; ".join(why[t]), 24))
        ticks.append(f"{t}" + (f"\n{none}" if all(v is None for v in col) else ""))
    ax.axhline(100, color="k", linewidth=1.5, linestyle="--", label="read roofline (100%)")
    ax.set_xticks(range(len(tiles)), ticks, fontsize=14)
    ax.set_xlim(-0.5, len(tiles) - 0.5)
    ax.set_ylim(0, 108)
    ax.set_xlabel("token tile (tokens per CTA tile)")
    ax.set_ylabel("% of the read roofline")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"Tile sweep: best tile per token tile (whiskers down to the worst block_rows, K step, stages)\n"
                 f"{sweep.get(FILE_KEY, sweep.get('script', '?'))}, {sweep.get('setup', {}).get('lab_commit', '?')}: "
                 f"flat read {sweep['read_roofline']['gbps']:.0f} GB/s", fontsize=15)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=13, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def section(read_roofline: dict | None, chunk_study: dict | None, tile_sweep: dict | None, out_dir: Path,
            plt=None) -> list[str]:
    """The three study sections; a study passed as None is reported as not measured, naming the
    script that measures it. The tile chart is drawn into out_dir when plt is given."""
    parts = ["## Read roofline: is the GEMM's gap to the roofline the mainloop or the access pattern?", ""]
    if read_roofline is None:
        parts += [missing("read_roofline"), ""]
    else:
        parts += [(f"On the {board(read_roofline)}, from {_source(read_roofline)}; flat read {read_roofline['read_roofline']['gbps']:.0f} GB/s. "
                  f"The pattern read is the GEMM's grid and pipeline reading exactly its bytes with no decode "
                  f"or MMA."), "", read_roofline_table(read_roofline["rows"]), "", "Verdicts:", ""]
        parts += [f"- {v}" for v in read_roofline_verdicts(read_roofline["rows"])] + [""]

    parts += ["## Chunk study: does chunking lose time through the tail or through launch and scheduling?", ""]
    if chunk_study is None:
        parts += [missing("chunk_study"), ""]
    else:
        parts += [f"On the {board(chunk_study)}, from {_source(chunk_study)}; flat read {chunk_study['read_roofline']['gbps']:.0f} GB/s.", "",
                  chunk_table(chunk_study["rows"]), "", "Verdicts:", ""]
        parts += [f"- {v}" for v in chunk_verdicts(chunk_study["rows"])] + [""]

    parts += ["## Tile sweep: does a token tile below 128 recover anything?", ""]
    if tile_sweep is None:
        parts += [missing("tile_sweep"), ""]
    else:
        ok, bad = tile_tables(tile_sweep["rows"])
        parts += [f"On the {board(tile_sweep)}, from {_source(tile_sweep)}; flat read {tile_sweep['read_roofline']['gbps']:.0f} GB/s.", "",
                  ok, "", "Tiles that could not run:", "", bad, "", "Verdicts:", ""]
        parts += [f"- {v}" for v in tile_verdicts(tile_sweep["rows"])] + [""]
        parts += [f"![{TILE_ALT}]({TILE_PNG})", ""]
        if plt is not None:
            _tile_chart(plt, tile_sweep, out_dir / TILE_PNG)
    return parts
