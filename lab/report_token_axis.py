"""The findings page's token-axis section, per board, and the README's headline block: the lab
against the fastest peer measured in the same run, from decode to prefill (scripts/token_axis.py
JSON). Every sentence is computed from the files; nothing is typed in."""

from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from lab.report_common import DPI, FILE_KEY, NOISE_PCT, board, fmt as _fmt, source as _source

def _ta_impl(point: dict, name: str) -> dict | None:
    e = point["impls"].get(name)
    return e if e is not None and e.get("ms") is not None else None


# The W4A16 variants (NVFP4 weights, bf16 activations); the best of them stands for W4A16 as the
# best valid variant stands for W4A4.
W4A16 = ("w4a16", "w4a16-fused", "w4a16-layer")


def _fastest_of(point: dict, names: tuple[str, ...]) -> tuple[str, dict] | None:
    """(name, entry) of the fastest of `names` that ran without error at this mean."""
    ran = [(n, e) for n in names if (e := _ta_impl(point, n)) is not None and not e.get("error")]
    return min(ran, key=lambda ne: ne[1]["ms"]) if ran else None


def best_w4a16(point: dict) -> tuple[str, dict] | None:
    """(name, entry) of the fastest W4A16 variant that ran without error at this mean."""
    return _fastest_of(point, W4A16)


def _by_noise(pairs: list[tuple[float, float]]) -> tuple[list, list, list]:
    """(mean, ratio) pairs split into (above 1, level within NOISE_PCT, below 1)."""
    return ([(m, r) for m, r in pairs if (r - 1) * 100 > NOISE_PCT],
            [(m, r) for m, r in pairs if abs(r - 1) * 100 <= NOISE_PCT],
            [(m, r) for m, r in pairs if (1 - r) * 100 > NOISE_PCT])


def _means_and_ratios(pairs: list[tuple[float, float]]) -> str:
    return ", ".join(f"{m:g} ({r:.2f}x)" for m, r in pairs)


def w4a16_verdicts(ta: dict) -> list[str]:
    """W4A4 against W4A16 on the same kernels: where each is faster and by how much (times within
    NOISE_PCT are level), W4A16 against the fastest peer, and the error each pays against the
    float64 layer on unquantized activations."""
    points = [p for p in sorted(ta["points"], key=lambda p: p["mean"]) if best_w4a16(p) and p.get("best_lab")]
    if not points:
        return []
    cost = [(p["mean"], best_w4a16(p)[1]["ms"] / _ta_impl(p, p["best_lab"])["ms"]) for p in points]
    dearer, level, cheaper = _by_noise(cost)
    out = []
    text = "W4A16 (the best of " + ", ".join(W4A16) + ") against W4A4 (the lab's best valid variant), as W4A16's time / W4A4's:"
    if level:
        text += f" level (within {NOISE_PCT:g}%) at {_means_and_ratios(level)};"
    if dearer:
        text += f" slower at {_means_and_ratios(dearer)};"
    if cheaper:
        text += f" faster at {_means_and_ratios(cheaper)};"
    out.append(text.rstrip(";") + ".")
    vs_peer = [(p["mean"], _ta_impl(p, p["fastest_peer"])["ms"] / best_w4a16(p)[1]["ms"], p["fastest_peer"])
               for p in points if p.get("fastest_peer") and _ta_impl(p, p["fastest_peer"])]
    if vs_peer:
        ahead, _, behind = _by_noise([(m, r) for m, r, _ in vs_peer])
        peers_named = sorted({n for _, _, n in vs_peer})
        text = f"W4A16 against the fastest peer ({', '.join(peers_named)}), as the peer's time / W4A16's:"
        if ahead:
            text += f" faster at {_means_and_ratios(ahead)};"
        if behind:
            text += f" slower at {_means_and_ratios(behind)};"
        out.append(text.rstrip(";") + ".")
    e16 = [best_w4a16(p)[1].get("e2e_rel") for p in points]
    e4 = [_ta_impl(p, p["best_lab"]).get("e2e_rel") for p in points]
    pairs = [(a, b) for a, b in zip(e16, e4) if a is not None and b is not None and a > 0]
    if pairs:
        gain = sorted(b / a for a, b in pairs)
        out.append(f"Error against the float64 layer on unquantized activations: W4A16 "
                   f"{min(a for a, _ in pairs):.1e}-{max(a for a, _ in pairs):.1e}, W4A4 "
                   f"{min(b for _, b in pairs):.1e}-{max(b for _, b in pairs):.1e}: W4A16's is "
                   f"{gain[0]:.0f}-{gain[-1]:.0f}x smaller where both were measured.")
        if gain[0] > 1:  # W4A16 is the more accurate at every mean: the choice is time against error
            if level or cheaper:
                out.append(f"Where W4A16 is level with W4A4 or faster ({', '.join(f'{m:g}' for m, _ in level + cheaper)} "
                           f"tokens per expert) it is the better choice outright: no more time for the smaller error.")
            if dearer:
                lo, hi = (f"{(f(r for _, r in dearer) - 1) * 100:.0f}" for f in (min, max))
                out.append(f"Where W4A4 is faster ({', '.join(f'{m:g}' for m, _ in dearer)}), W4A16 costs "
                           f"{lo if lo == hi else lo + '-' + hi}% more time for its smaller error.")
    return out


# The W4A8 variants (NVFP4 weights as e4m3 on the fp8 tensor cores, 1x128 fp8 activations).
W4A8 = ("w4a8", "w4a8-fused", "w4a8-layer")
# W4A8's targets per band of tokens per expert: (lowest mean, highest mean, % of the binding
# ceiling, the ceiling the target names, None: whichever binds). Means outside every band have
# none. The other two targets hold at every mean: faster than the fastest peer, and an error
# against the float64 layer no larger than the fp8 peer's in the same run.
W4A8_TARGETS = ((1, 8, 93.0, "read"), (16, 32, 80.0, "read"), (64, 128, 75.0, None), (512, 2048, 70.0, "tensor fp8"))
FP8_PEER = "torch-fp8"


def best_w4a8(point: dict) -> tuple[str, dict] | None:
    """(name, entry) of the fastest W4A8 variant that ran without error at this mean."""
    return _fastest_of(point, W4A8)


def w4a8_target(mean: float) -> tuple[float, str | None] | None:
    """(% of the binding ceiling, the ceiling named or None) that W4A8 must reach at this mean."""
    return next(((pct, kind) for lo, hi, pct, kind in W4A8_TARGETS if lo <= mean <= hi), None)


def _w4a8_ceiling(mean: float, e: dict) -> tuple[str, str | None, bool | None]:
    """('84% of read', 'target 93% of read' or None where no target applies, met) for one mean;
    met None where no target applies or the roof% is missing (its ceiling was not measured)."""
    target = w4a8_target(mean)
    pct = e.get("roof_pct")
    have = "-" if pct is None else f"{pct:.0f}% of {_binds(e)}"
    if target is None:
        return have, None, None
    want, kind = target
    wanted = f"target {want:g}%{'' if kind is None else ' of ' + kind}"
    if pct is None:
        return have, wanted, None
    # a target naming one ceiling is met only on that ceiling: 95% of the fp8 peak where the read
    # binds says nothing about the read
    return have, wanted, pct >= want and (kind is None or _binds(e) == kind)


def _w4a8_ceiling_cell(mean: float, e: dict) -> str:
    """'84% of read, target 93% of read: below' (', no target' where none applies)."""
    have, wanted, met = _w4a8_ceiling(mean, e)
    if wanted is None:
        return f"{have}, no target"
    return f"{have}, {wanted}" + ("" if met is None else f": {'met' if met else 'below'}")


def w4a8_table(points: list[dict]) -> str:
    """One row per mean where a W4A8 variant ran: the fastest, its time, its share of its binding
    ceiling against the target, its ratio to the fastest peer, its error and the fp8 peer's."""
    head = ["tokens/expert", "best W4A8", "ms", "binding ceiling (target)", "x fastest peer",
            f"error vs float64: W4A8 / {FP8_PEER}"]
    body = []
    for p in points:
        b = best_w4a8(p)
        if b is None:
            continue
        name, e = b
        peer = _ta_impl(p, FP8_PEER)
        err = lambda x: "-" if x is None or x.get("e2e_rel") is None else f"{x['e2e_rel']:.1e}"  # noqa: E731
        body.append([f"{p['mean']:g}", name, f"{e['ms']:.3f}", _w4a8_ceiling_cell(p["mean"], e),
                     _fmt(e.get("x_fastest_peer"), 2), f"{err(e)} / {err(peer)}"])
    return tabulate(body, head, tablefmt="github", disable_numparse=True)


def w4a8_verdicts(ta: dict) -> list[str]:
    """W4A8 against its three targets, each over the means where it was measured: the share of
    the binding ceiling (per band), the fastest peer, and the fp8 peer's error."""
    points = [p for p in sorted(ta["points"], key=lambda p: p["mean"]) if best_w4a8(p)]
    if not points:
        return []
    out = []
    cells = [(p["mean"], *_w4a8_ceiling(p["mean"], best_w4a8(p)[1])) for p in points]
    met = [m for m, _, _, ok in cells if ok]
    below = [(m, have, wanted) for m, have, wanted, ok in cells if ok is False]
    text = "W4A8's share of its binding ceiling:"
    if met:
        text += f" on target at {', '.join(f'{m:g}' for m in met)};"
    if below:
        text += " below it at " + "; ".join(f"{m:g} ({have}, {wanted})" for m, have, wanted in below) + ";"
    if not met and not below:
        text += " no mean measured falls in a band with a target;"
    out.append(text.rstrip(";") + ".")
    vs = [(p["mean"], best_w4a8(p)[1].get("x_fastest_peer"), p.get("fastest_peer")) for p in points]
    vs = [(m, r, n) for m, r, n in vs if r is not None]
    if vs:
        ahead, level, behind = _by_noise([(m, r) for m, r, _ in vs])
        behind = [(m, 1 / r) for m, r in behind]
        text = f"W4A8 against the fastest peer ({', '.join(sorted({n for _, _, n in vs}))}):"
        if ahead:
            text += f" faster at {_means_and_ratios(ahead)};"
        if level:
            text += f" level at {', '.join(f'{m:g}' for m, _ in level)};"
        if behind:
            text += f" slower at {_means_and_ratios(behind)}, as W4A8's time / the peer's;"
        out.append(text.rstrip(";") + ".")
    pairs = [(p["mean"], best_w4a8(p)[1].get("e2e_rel"), (_ta_impl(p, FP8_PEER) or {}).get("e2e_rel")) for p in points]
    pairs = [(m, a, b) for m, a, b in pairs if a is not None and b is not None]
    if pairs:
        worse = [(m, a / b) for m, a, b in pairs if a > b]
        text = (f"Error against the float64 layer on unquantized activations: W4A8 "
                f"{min(a for _, a, _ in pairs):.1e}-{max(a for _, a, _ in pairs):.1e}, {FP8_PEER} "
                f"{min(b for _, _, b in pairs):.1e}-{max(b for _, _, b in pairs):.1e}; ")
        text += ("no larger than the fp8 peer's at every mean measured." if not worse else
                 "larger than the fp8 peer's at " + _means_and_ratios(worse) + " (W4A8's / the peer's).")
        out.append(text)
    return out


def _binds(e: dict) -> str:
    """What bound an implementation's roofline: 'read', 'tensor fp16' or 'tensor fp8' (a run
    before the fp8 ceiling has no per-row binding: its rows were all on the fp16 one)."""
    return e.get("binds") or "fp16 roofline"


def _pct(e: dict | None) -> str:
    """'62.0 (read)': % of the implementation's own binding roofline, or '-'."""
    if not e or e.get("roof_pct") is None:
        return "-"
    return f"{e['roof_pct']:.1f} ({_binds(e)})"


def _peer_cell(e: dict | None) -> str:
    """'1.437 (61% read)'; a peer whose compiled stage failed says that the eager one stood in, one
    timed in a pass of its own (out of memory beside the others) that it ran alone."""
    if not e:
        return "-"
    pct = "" if e.get("roof_pct") is None else f" ({e['roof_pct']:.0f}% {_binds(e)})"
    return (f"{e['ms']:.3f}{pct}" + (" eager stand-in" if e.get("stand_in") else "")
            + (" alone" if e.get("apart") else ""))


def token_axis_table(points: list[dict]) -> str:
    """One row per mean: the roofline and what binds, the lab's best valid variant, separate and
    each peer (ms and % of the binding roofline), the best's ratio to the fastest peer."""
    peer_names = list(dict.fromkeys(n for p in points for n, e in p["impls"].items() if e["peer"]))
    w4a16 = any(best_w4a16(p) for p in points)  # NVFP4 weights, bf16 activations: a column of its own
    head = (["tokens/expert", "roofline ms (binds)", "best lab variant", "ms", "roof% (binds)", "separate ms"] +
            (["best W4A16 ms (error)"] if w4a16 else []) +
            [f"{n} ms (roof%)" for n in peer_names] + ["x fastest peer",
                                                       "error vs float64: lab / " + " / ".join(peer_names)])
    body = []
    for p in points:
        best = _ta_impl(p, p["best_lab"]) if p.get("best_lab") else None
        sep = _ta_impl(p, "separate")
        row = [f"{p['mean']:g}", f"{p['roofline']['ms']:.3f} ({p['roofline']['binds']})",
               p.get("best_lab") or "-", _fmt(best and best["ms"]), _pct(best),
               _fmt(sep and sep["ms"])]
        if w4a16:
            b = best_w4a16(p)
            row.append("-" if b is None else f"{b[1]['ms']:.3f} ({'-' if b[1].get('e2e_rel') is None else format(b[1]['e2e_rel'], '.1e')})")
        row += [_peer_cell(_ta_impl(p, n)) for n in peer_names]
        row.append(_fmt(best and best["x_fastest_peer"], 2))
        errs = [best and best.get("e2e_rel")] + [_ta_impl(p, n) and _ta_impl(p, n).get("e2e_rel") for n in peer_names]
        row.append(" / ".join("-" if e is None else f"{e:.1e}" for e in errs))
        body.append(row)
    return tabulate(body, head, tablefmt="github", disable_numparse=True)


def _gemm_cell(g: dict, name: str) -> str:
    """'0.412 (88% tensor fp8)': the stage's ms and % of its own binding roofline."""
    row = g[name]
    if row.get("roof_pct") is None:
        return f"{row['ms']:.3f}"
    kind = row.get("tensor")
    binds = (g.get("rooflines") or {}).get(kind, {}).get("binds") if kind else None
    where = "" if binds is None else f" {binds}" + ("" if binds == "read" else f" {kind}")
    return f"{row['ms']:.3f} ({row['roof_pct']:.0f}%{where})"


def token_axis_gemm_table(points: list[dict]) -> str:
    """Each GEMM stage of separate and of the peers: ms and % of that GEMM's binding roofline."""
    names = list(dict.fromkeys(n for p in points for g in p.get("gemm", {}).values() for n in g
                               if n not in ("roofline", "rooflines", "bytes", "flops")))
    head = ["tokens/expert", "gemm", "roofline ms (binds)"] + [f"{n} ms (roof%)" for n in names]
    body = []
    for p in points:
        for gemm, g in p.get("gemm", {}).items():
            body.append([f"{p['mean']:g}", gemm, f"{g['roofline']['ms']:.3f} ({g['roofline']['binds']})"] +
                        ["-" if n not in g else _gemm_cell(g, n) for n in names])
    return tabulate(body, head, tablefmt="github", disable_numparse=True)


def token_axis_verdicts(ta: dict) -> list[str]:
    """Where NVFP4 on the H200 beats each peer and by how much, where it does not and what binds
    there, and the accuracy each implementation pays."""
    points = sorted(ta["points"], key=lambda p: p["mean"])
    out = []
    peer_names = list(dict.fromkeys(n for p in points for n, e in p["impls"].items() if e["peer"]))
    if not peer_names or not any(_ta_impl(p, n) for p in points for n in peer_names):
        skipped = {e.get("skipped") for p in points for e in p["impls"].values() if e["peer"] and e.get("skipped")}
        return [f"No peer was measured{': ' + '; '.join(sorted(skipped)) if skipped else ''}."]
    for n in peer_names:
        ratios = [(p["mean"], _ta_impl(p, n)["ms"] / _ta_impl(p, p["best_lab"])["ms"]) for p in points
                  if _ta_impl(p, n) and p.get("best_lab")]
        if not ratios:
            continue
        wins = [(m, r) for m, r in ratios if r > 1 + NOISE_PCT / 100]
        losses = [(m, r) for m, r in ratios if r < 1 - NOISE_PCT / 100]
        lead = []
        for m, r in ratios:  # the lab leads from the smallest mean up to the first mean it does not
            if r <= 1 + NOISE_PCT / 100:
                break
            lead.append((m, r))
        if lead:
            text = (f"Against {n}, the lab's best valid variant is faster at every mean from {lead[0][0]:g} to "
                    f"{lead[-1][0]:g} tokens per expert: {min(r for _, r in lead):.2f}x to "
                    f"{max(r for _, r in lead):.2f}x.")
        else:
            text = f"Against {n}, the lab is not faster at the smallest mean measured ({ratios[0][0]:g})."
        if losses:
            text += (f" It is slower at {', '.join(f'{m:g}' for m, _ in losses)} "
                     f"({', '.join(f'{1 / r:.2f}x' for _, r in losses)} the peer's time).")
        elif len(wins) == len(ratios):
            text += " It is faster at every mean measured."
        out.append(text)
    slow = [p for p in points if p.get("fastest_peer") and p.get("best_lab")
            and _ta_impl(p, p["best_lab"])["x_fastest_peer"] < 1 - NOISE_PCT / 100]
    for p in slow:
        best = _ta_impl(p, p["best_lab"])
        peer = _ta_impl(p, p["fastest_peer"])
        peer_pct = "-" if peer.get("roof_pct") is None else f"{peer['roof_pct']:.0f}%"
        out.append(f"At {p['mean']:g} tokens per expert the lab's binding ceiling is the "
                   f"{best.get('binds') or p['roofline']['binds']} one; the lab's {p['best_lab']} reaches "
                   f"{best['roof_pct']:.0f}% of it ({best['tflops']:.0f} TFLOP/s, {best['gbps']:.0f} GB/s) against "
                   f"{p['fastest_peer']}'s {peer_pct} of its own ({_binds(peer)}).")
    errs = {}
    for p in points:
        for n, e in p["impls"].items():
            if e.get("e2e_rel") is not None and (e["peer"] or n == p.get("best_lab")):
                errs.setdefault("lab (W4A4)" if not e["peer"] else n, []).append(e["e2e_rel"])
    if errs:
        out.append("Error against the float64 layer on unquantized activations (what a user pays), over the "
                   "means: " + "; ".join(f"{k} {min(v):.1e}-{max(v):.1e}" for k, v in errs.items()) + ".")
    return out


def ceilings_line(ta: dict) -> str:
    """'flat read 4540 GB/s, dense tensor peaks fp16 750 and fp8 1400 TFLOP/s': what the run
    measured, saying so where the fp8 one was not measured or could not be."""
    c = ta["ceilings"]
    fp8 = c.get("tensor_fp8")
    text = f"flat read {c['read']['gbps']:.0f} GB/s, dense fp16 tensor peak {c['tensor']['tflops']:.0f} TFLOP/s (cuBLAS)"
    if fp8 is None:
        return text + ", no fp8 peak (the run predates it: fp8 rows are compared with the fp16 one)"
    if fp8.get("tflops") is None:
        return text + f", no fp8 peak ({fp8.get('error', 'not measured')}: fp8 rows get no roof%)"
    return text + f", dense fp8 tensor peak {fp8['tflops']:.0f} TFLOP/s (cuBLASLt)"


def token_axis_section(ta: dict) -> list[str]:
    points = sorted(ta["points"], key=lambda p: p["mean"])
    cut = "" if ta.get("complete", True) else (" The run was cut short after " + str(len(points)) + " means (" +
                                                 ", ".join(format(p["mean"], "g") for p in points) +
                                                 "); the rest were not measured.")
    return [f"From {_source(ta)}; {ceilings_line(ta)}, all in this run.{cut} Each row's roofline is the larger of "
            f"its bytes over the read and its useful flops over the tensor peak its arithmetic can use: fp16 for "
            f"the lab's exact NVFP4 path (its decoded operands are fp16) and for bf16, fp8 for fp8 peers; roof% "
            f"is against that one, and the table names which binds. x fastest peer = the fastest peer's ms / the "
            f"lab's (above 1: the lab is faster).", "",
            token_axis_table(points), "", "Each GEMM (separate's stages and the peers'):", "",
            token_axis_gemm_table(points), "", "Verdicts:", ""] + [f"- {v}" for v in token_axis_verdicts(ta)] + [""] + \
        (["W4A4 or W4A16 (the same weights and kernels; bf16 activations instead of NVFP4 ones):", ""] +
         [f"- {v}" for v in w4a16_verdicts(ta)] + [""] if w4a16_verdicts(ta) else []) + \
        (["W4A8 (NVFP4 weights as e4m3 on the fp8 tensor cores, 1x128 fp8 activations), against its targets:", "",
          w4a8_table(points), ""] + [f"- {v}" for v in w4a8_verdicts(ta)] + [""] if w4a8_verdicts(ta) else [])


def _token_chart(plt, ta: dict, path: Path) -> None:
    """Two panels over tokens per expert (log x). Left: time per token (log y) of the lab's best
    valid variant, separate and each peer, with the read and fp16/fp8 tensor ceilings dashed.
    Right: the fastest peer's time over the lab's best (linear y, 1 = level), so that a crossover
    shows as the line passing 1. Fonts sized for the page's 880 px."""
    points = sorted(ta["points"], key=lambda p: p["mean"])
    xs = [p["mean"] for p in points]
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(14, 6.2), gridspec_kw={"width_ratios": [1.35, 1]})

    def per_token(p, ms):
        return None if ms is None else 1e3 * ms / p["tokens"]

    series = {"lab, best valid variant": [per_token(p, (_ta_impl(p, p["best_lab"]) or {}).get("ms"))
                                          if p.get("best_lab") else None for p in points],
              "lab, separate": [per_token(p, (_ta_impl(p, "separate") or {}).get("ms")) for p in points]}
    for n in dict.fromkeys(n for p in points for n, e in p["impls"].items() if e["peer"]):
        series[n] = [per_token(p, (_ta_impl(p, n) or {}).get("ms")) for p in points]
    styles = {"lab, best valid variant": ("C0", "-", "o"), "lab, separate": ("C0", ":", "."),
              "torch-bf16": ("C1", "-", "s"), "torch-fp8": ("C3", "-", "^"),
              "torch-bf16-eager": ("C1", ":", "s"), "torch-fp8-eager": ("C3", ":", "^")}
    for label, ys in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            c, ls, mk = styles.get(label, (None, "-", "o"))
            ax.plot(*zip(*pts), color=c, linestyle=ls, marker=mk, label=label)
    ax.plot(xs, [1e3 * p["roofline"]["read_ms"] / p["tokens"] for p in points], color="k", linestyle="--",
            linewidth=1.2, label="read ceiling")
    for kind, color in (("fp16", "0.5"), ("fp8", "0.75")):
        ys = [(p.get("rooflines") or {"fp16": p["roofline"]}).get(kind) for p in points]
        if all(ys):
            ax.plot(xs, [1e3 * r["tensor_ms"] / p["tokens"] for r, p in zip(ys, points)], color=color,
                    linestyle="--", linewidth=1.2, label=f"{kind} tensor ceiling")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=11)
    ax.set_xlabel("mean tokens per expert")
    ax.set_ylabel("microseconds per token (layer)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper right", fontsize=11, frameon=False)
    rs = against_fastest_peer(ta)
    if rs:
        rx.plot([m for m, _, _ in rs], [r for _, r, _ in rs], color="C0", marker="o", label="lab best vs fastest peer")
        for m, r, n in rs:
            rx.annotate(n.replace("torch-", ""), (m, r), textcoords="offset points", xytext=(0, 8), ha="center",
                        fontsize=9, color="0.35")
    rx.axhline(1.0, color="k", linewidth=1)
    rx.set_xscale("log", base=2)
    rx.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=11)
    rx.set_xlabel("mean tokens per expert")
    rx.set_ylabel("fastest peer's time / lab's (above 1: lab faster)")
    rx.grid(alpha=0.3)
    fig.suptitle(f"{board(ta)}: the layer over tokens per expert ({ta.get(FILE_KEY, ta.get('script', '?'))}, "
                 f"{ta.get('setup', {}).get('lab_commit', '?')})", fontsize=14)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# against the fastest peer: the crossover per board, the README's headline
# ---------------------------------------------------------------------------------------------

TOKEN_ALT = "the layer over tokens per expert: time per token (log) and the lab's speed against the fastest peer"


def token_png(run: dict) -> str:
    """The token-axis chart of a run's board: token-axis-h200.png, token-axis-h100.png."""
    return f"token-axis-{board(run).lower()}.png"


def failed_peers(p: dict) -> list[str]:
    """The peers that failed at this point (an error, not a skip for want of torch)."""
    return [n for n, e in p["impls"].items() if e["peer"] and e.get("error")]


def left_out(ta: dict) -> str:
    """' Left out: 1024 (torch-fp8 failed: prepare: OutOfMemoryError)': the means where a peer
    failed, which no verdict against the fastest peer may use (the fastest may be the one missing)."""
    notes = []
    for p in sorted(ta["points"], key=lambda p: p["mean"]):
        bad = failed_peers(p)
        if bad:
            # the error's stage and type ('prepare: OutOfMemoryError'), not torch's whole message
            why = sorted({":".join(p["impls"][n]["error"].split(":")[:2]).strip() for n in bad})
            notes.append(f"{p['mean']:g} ({', '.join(bad)} failed: {'; '.join(why)})")
    return f" Left out, where a peer failed: {', '.join(notes)}." if notes else ""


def timed_alone(ta: dict) -> str:
    """' Timed alone, after the others (out of device memory beside them): 1024 (torch-fp8)': the
    peers token_axis timed in a pass of their own, not interleaved with the rest."""
    notes = [f"{p['mean']:g} ({', '.join(n for n, e in p['impls'].items() if e.get('apart'))})"
             for p in sorted(ta["points"], key=lambda p: p["mean"]) if any(e.get("apart") for e in p["impls"].values())]
    return f" Timed alone, after the others (out of device memory beside them): {', '.join(notes)}." if notes else ""


def against_fastest_peer(ta: dict) -> list[tuple[float, float, str]]:
    """(mean, the fastest peer's ms / the lab's best valid variant's ms, that peer) at each mean
    where both ran and no peer failed, in order of mean: above 1 the lab is faster."""
    out = []
    for p in sorted(ta["points"], key=lambda p: p["mean"]):
        if failed_peers(p):
            continue
        best = _ta_impl(p, p["best_lab"]) if p.get("best_lab") else None
        peer = _ta_impl(p, p["fastest_peer"]) if p.get("fastest_peer") else None
        if best and peer:
            out.append((p["mean"], peer["ms"] / best["ms"], p["fastest_peer"]))
    return out


def _side(r: float) -> str:
    return "faster" if r > 1 + NOISE_PCT / 100 else "slower" if r < 1 - NOISE_PCT / 100 else "level"


def _span(means: list[float]) -> str:
    return f"{means[0]:g}" if len(means) == 1 else f"{means[0]:g} to {means[-1]:g}"


def crossover_mean(ta: dict) -> float | None:
    """The smallest mean from which the lab is slower than the fastest peer at every larger mean
    measured; None where the lab is not slower at the largest one."""
    rs = against_fastest_peer(ta)
    first = None
    for m, r, _ in reversed(rs):
        if _side(r) != "slower":
            break
        first = m
    return first


def crossover_sentence(ta: dict) -> str | None:
    """Where the lab's best valid variant is faster than the fastest peer of the same run, level
    with it and slower, by how much, and which peer that was; None without a peer."""
    rs = against_fastest_peer(ta)
    if not rs:
        return None
    runs: list[tuple[str, list[tuple[float, float]]]] = []
    for m, r, _ in rs:
        side = _side(r)
        if runs and runs[-1][0] == side:
            runs[-1][1].append((m, r))
        else:
            runs.append((side, [(m, r)]))
    parts = []
    for side, seg in runs:
        means = [m for m, _ in seg]
        if side == "level":
            parts.append(f"level (within {NOISE_PCT:g}%) at {_span(means)}")
            continue
        fs = [r if side == "faster" else 1 / r for _, r in seg]
        how = f"{fs[0]:.2f}x" if len(fs) == 1 else f"{min(fs):.2f}x to {max(fs):.2f}x"
        parts.append(f"{side} at {_span(means)} ({how})")
    peers = sorted({n for _, _, n in rs})
    return (f"On the {board(ta)}, the lab's best valid variant against the fastest peer measured in the same run "
            f"({', '.join(peers)}{_eager_note(ta)}), by tokens per expert: " + "; ".join(parts) + "." + left_out(ta)
            + timed_alone(ta))


def _eager_note(ta: dict) -> str:
    """'; its activation stage eager: ...' for a run made before the peers compiled that stage
    (their entries carry no `stand_in` field), so that the sentence does not pass such a peer off
    as the compiled one."""
    peer_entries = [e for p in ta["points"] for e in p["impls"].values() if e["peer"] and e.get("ms")]
    if peer_entries and not any("stand_in" in e for e in peer_entries):
        return "; a run from before the compiled peers: its activation stage ran eagerly"
    return ""


def board_shift_sentence(runs: list[dict]) -> str | None:
    """How the crossover moves between boards (two or more runs of different boards)."""
    if len({board(r) for r in runs}) < 2:
        return None
    parts = []
    for ta in runs:
        rs = against_fastest_peer(ta)
        if not rs:
            continue
        m_last, r_last, peer = rs[-1]
        cross = crossover_mean(ta)
        at_last = (f"{1 / r_last:.2f}x slower" if _side(r_last) == "slower" else
                   f"{r_last:.2f}x faster" if _side(r_last) == "faster" else "level")
        if cross is None:
            parts.append(f"on the {board(ta)} the lab is not behind at the largest mean ({at_last} at {m_last:g})")
        else:
            parts.append(f"on the {board(ta)} the fastest peer leads from {cross:g} tokens per expert up "
                         f"({peer}; the lab {at_last} at {m_last:g})")
    return ("Between boards: " + "; ".join(parts) + ".") if len(parts) > 1 else None


def headline_table(ta: dict) -> str:
    """The README's table: per mean, the lab's best W4A4 and W4A16 variants, the fastest peer, each
    against its own binding ceiling, and the lab against that peer."""
    head = ["tokens per expert", "lab W4A4, best (ms)", "% of its ceiling", "lab W4A16, best (ms)",
            "fastest peer (ms)", "% of its ceiling", "lab W4A4 against it"]
    body = []
    for p in sorted(ta["points"], key=lambda p: p["mean"]):
        best = _ta_impl(p, p["best_lab"]) if p.get("best_lab") else None
        w16 = best_w4a16(p)
        peer = _ta_impl(p, p["fastest_peer"]) if p.get("fastest_peer") else None
        versus = "-"
        if failed_peers(p):
            versus = f"- ({', '.join(failed_peers(p))} failed)"
        elif best and peer:
            r = peer["ms"] / best["ms"]
            versus = {"faster": f"{r:.2f}x faster", "slower": f"{1 / r:.2f}x slower", "level": "level"}[_side(r)]
        body.append([f"{p['mean']:g}", "-" if not best else f"{best['ms']:.3f} ({p['best_lab']})", _pct(best),
                     "-" if not w16 else f"{w16[1]['ms']:.3f}",
                     "-" if not peer else f"{peer['ms']:.3f} ({p['fastest_peer']}{', alone' if peer.get('apart') else ''})",
                     _pct(peer), versus])
    return tabulate(body, head, tablefmt="github", disable_numparse=True)


def readme_block(runs: list[dict]) -> str:
    """The README's generated block: the first run's headline table (the board the lab is built
    for comes first in PAGE_RUNS), then the crossover on every board and how it moves."""
    if not runs:
        raise ValueError("readme_block: need at least one token_axis run")
    first = runs[0]
    lines = [f"On the {board(first)} ({_source(first)}; {ceilings_line(first)}, all in that run). % of its "
             f"ceiling: against the binding one of each row, the flat read or the tensor peak its arithmetic can "
             f"use (fp16 for the lab's exact NVFP4 path and bf16, fp8 for fp8).", "", headline_table(first), ""]
    lines += [f"- {s}" for s in (crossover_sentence(ta) for ta in runs) if s]
    shift = board_shift_sentence(runs)
    lines += [f"- {shift}"] if shift else []
    return "\n".join(lines).rstrip("\n")


def section(runs: list[dict], out_dir: Path, plt=None) -> list[str]:
    """The findings page's token-axis section: one subsection per board's run (its tables,
    verdicts and chart), then how the crossover moves between boards."""
    parts = []
    for ta in runs:
        parts += [f"### {board(ta)}", ""] + token_axis_section(ta)
        cross = crossover_sentence(ta)
        if cross:
            parts += [f"- {cross}", ""]
        parts += [f"![{TOKEN_ALT}, {board(ta)}]({token_png(ta)})", ""]
        if plt is not None:
            _token_chart(plt, ta, out_dir / token_png(ta))
    shift = board_shift_sentence(runs)
    return parts + ([shift, ""] if shift else [])


README_BEGIN = "<!-- token axis: generated by scripts/report.py from results/<board>/token_axis.json -->"
README_END = "<!-- end of the generated token axis -->"


def splice_readme(text: str, block: str) -> str:
    """README text with the lines between README_BEGIN and README_END replaced by `block`;
    ValueError naming the markers when either is missing or out of order."""
    a, b = text.find(README_BEGIN), text.find(README_END)
    if a < 0 or b < 0 or b < a:
        raise ValueError(f"README has no '{README_BEGIN}' ... '{README_END}' block to regenerate")
    return text[:a + len(README_BEGIN)] + "\n\n" + block + "\n\n" + text[b:]
