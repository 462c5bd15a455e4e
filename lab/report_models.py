"""The findings page's per-model section: the lab's best valid variant on each real model's
routed-expert shape (run_layer --model, one run per preset), against the binding ceiling and the
fastest peer."""

from __future__ import annotations

from tabulate import tabulate

from lab.report_common import board, fmt as _fmt, layer_means, source as _source, valid as _valid


def _model_name(run: dict) -> str:
    argv = list(map(str, run.get("argv", [])))
    return argv[argv.index("--model") + 1] if "--model" in argv else "study"


def _best(rows: list[dict], mean: str) -> dict | None:
    ok = [r for r in rows if not r.get("peer") and _valid(r) and r.get(f"ms@{mean}") is not None]
    return min(ok, key=lambda r: r[f"ms@{mean}"]) if ok else None


def _fastest_peer(rows: list[dict], mean: str) -> dict | None:
    ps = [r for r in rows if r.get("peer") and r.get(f"ms@{mean}") is not None]
    return min(ps, key=lambda r: r[f"ms@{mean}"]) if ps else None


def models_table(runs: list[dict]) -> str:
    """One row per (model, mean): shape, best valid variant, its ms and roof% (binding ceiling),
    the fastest peer's ms, and the ratio."""
    body = []
    for run in runs:
        p = run["problem"]
        shape = f"{p['experts']} x {p['hidden']} x {p['intermediate']}, top {p['top_k']}"
        for mean in layer_means(run):
            best, peer = _best(run["layer"], mean), _fastest_peer(run["layer"], mean)
            binds = best.get(f"binds@{mean}", "read") if best else "-"
            body.append([_model_name(run), shape, mean, best["variant"] if best else "-",
                         _fmt(best and best[f"ms@{mean}"]), _fmt(best and best[f"roof%@{mean}"], 1) + f" ({binds})",
                         f"{peer['variant']} {_fmt(peer[f'ms@{mean}'])}" if peer else "-",
                         _fmt(best and peer and peer[f"ms@{mean}"] / best[f"ms@{mean}"], 2)])
    return tabulate(body, ["model", "experts x H x I", "tokens/expert", "best valid variant", "ms", "roof%",
                           "fastest peer ms", "x fastest peer"], tablefmt="github", disable_numparse=True)


def models_verdicts(runs: list[dict]) -> list[str]:
    out = []
    for mean in ("8", "32"):
        pts = [(_model_name(r), _best(r["layer"], mean), _fastest_peer(r["layer"], mean)) for r in runs
               if mean in layer_means(r)]
        pts = [(m, b, p) for m, b, p in pts if b is not None]
        if not pts:
            continue
        roofs = [b[f"roof%@{mean}"] for _, b, _ in pts]
        ratios = [p[f"ms@{mean}"] / b[f"ms@{mean}"] for _, b, p in pts if p is not None]
        lo = min(pts, key=lambda t: t[1][f"roof%@{mean}"])
        text = (f"At {mean} tokens per expert the best valid variant reaches {min(roofs):.0f}-{max(roofs):.0f}% of the "
                f"binding ceiling over the {len(pts)} shapes (lowest: {lo[0]}, {lo[1]['variant']})")
        if ratios:
            text += f", {min(ratios):.2f}x-{max(ratios):.2f}x faster than the fastest peer"
        out.append(text + ".")
    small = [(_model_name(r), r) for r in runs if r["problem"]["hidden"] * r["problem"]["intermediate"] <= 2048 * 768]
    for name, r in small:
        b = _best(r["layer"], "8")
        if b is not None and b["roof%@8"] < 85:
            out.append(f"{name} is the smallest shape ({r['problem']['experts']} experts of "
                       f"{r['problem']['hidden']} x {r['problem']['intermediate']}): its weight stream is over in "
                       f"{b['ms@8']:.3f} ms, where a launch's fixed cost and tail weigh most; {b['variant']} reaches "
                       f"{b[f'roof%@8']:.0f}% at 8 tokens per expert.")
    return out


def section(runs: list[dict]) -> list[str]:
    """The section: its table, the run each row comes from, and the verdicts."""
    parts = [f"## Real models on the {board(runs[0])}: their routed-expert shapes at 8 and 32 tokens per "
             "expert", "",
             ("`python scripts/run_layer.py --model NAME` for each preset in lab/models.py (the study's own "
              "shape is the default run); every variant and both peers, each run on its own. best = the "
              "fastest variant whose output equals separate's; roof% against the binding ceiling of that "
              "run."), "", models_table(runs), ""]
    parts += [f"- From {_source(r)} ({_model_name(r)})" for r in runs] + ["", "Verdicts:", ""]
    parts += [f"- {v}" for v in models_verdicts(runs)] + [""]
    return parts
