"""The findings page's grouped-GEMM section: per bench_gemm run, each GEMM's time and tile
against the read roofline, the read of its own access pattern, and the tensor peak."""

from __future__ import annotations

from tabulate import tabulate

from lab.report_common import board, fmt as _fmt, source as _source


def _config_tile(c: dict) -> str:
    return (f"{c['warps']},{c['row_tiles']},{c['k_step']},{c['stages']},{c['max_frags']},{c.get('mma', 0)}"
            + (",image" if c.get("image") else ""))


def gemm_tile(r: dict) -> str:
    """A GEMM row's tile; a split row (bench_gemm --split) names each launch's tile and experts."""
    if "plan" not in r:
        return _config_tile(r["config"])
    hi = lambda v: "" if v >= 2**31 - 1 else str(v)  # noqa: E731
    at = ",".join(map(str, r["split"])) if isinstance(r["split"], list) else r["split"]
    streams = ", two streams" if r.get("streams") == 2 else ""
    return f"split at {at}{streams}: " + " + ".join(f"{_config_tile(p['config'])} on {p['counts_in'][0]}..{hi(p['counts_in'][1])}"
                                                  for p in r["plan"])


def gemm_table(rows: list[dict]) -> str:
    held = any(r.get("sustained_ms") is not None for r in rows)
    acts = any("act" in r for r in rows)  # W4A4 and W4A16 rows side by side (runs since the act flag)
    tensor = any(r.get("tflops") is not None for r in rows)  # runs since bench_gemm measured the tensor peak
    head = (["gemm"] + (["activations"] if acts else []) +
            ["tokens/expert", "max on one expert", "tile warps,row_tiles,k_step,stages,max_frags,mma", "ms",
             "% roofline", "read-pattern % roofline"] + (["TFLOP/s (% tensor peak)"] if tensor else []) +
            (["held ms", "held % roofline"] if held else []))
    body = []
    for r in rows:
        tile = gemm_tile(r)
        body.append([r["gemm"]] + ([r.get("act", "nvfp4")] if acts else []) +
                    [f"{r['mean_tokens']:g}", str(r.get("max_count", "-")), tile, _fmt(r["ms"]), _fmt(r["roof_pct"], 1),
                     _fmt(r.get("read_pattern_roof_pct"), 1)]
                    + ([f"{r['tflops']:.0f} ({r['tensor_pct']:.1f})" if r.get("tflops") is not None else "-"] if tensor else [])
                    + ([_fmt(r.get("sustained_ms")), _fmt(r.get("sustained_roof_pct"), 1)] if held else []))
    return tabulate(body, head, tablefmt="github", disable_numparse=True)


def gemm_verdicts(gemm_rows: list[dict]) -> list[str]:
    out = []
    acts = len({r.get("act", "nvfp4") for r in gemm_rows}) > 1
    for r in gemm_rows:
        if r.get("read_pattern_roof_pct") is not None:
            out.append(f"{r['gemm']}{' (' + r.get('act', 'nvfp4') + ')' if acts else ''} at mean {r['mean_tokens']:g}: "
                       f"the GEMM's own access pattern read with no math reaches {r['read_pattern_roof_pct']:.1f}% "
                       f"of the flat read; the GEMM {r['roof_pct']:.1f}%.")
    if acts:  # the same GEMM, tile and mean with bf16 activations (W4A16) against NVFP4 ones (W4A4)
        key = (lambda r: (r["gemm"], r["mean_tokens"], tuple(sorted((k, v) for k, v in r["config"].items() if k != "act"))))
        w4a4 = {key(r): r for r in gemm_rows if r.get("act", "nvfp4") == "nvfp4"}
        pairs = [(w4a4[key(r)], r) for r in gemm_rows if r.get("act") == "bf16" and key(r) in w4a4]
        if pairs:
            out.append("bf16 activations (W4A16) against NVFP4 ones (W4A4), the same tile, as time ratios: " +
                       ", ".join(f"{b['gemm']} at {b['mean_tokens']:g} {b['ms'] / a['ms']:.2f}x" for a, b in pairs) +
                       " (the bf16 activation tile is 3.6x the bytes of the NVFP4 one, read once per row block).")
    held = [r for r in gemm_rows if r.get("sustained_roof_pct") is not None]
    if held:
        loss = sorted(r["roof_pct"] - r["sustained_roof_pct"] for r in held)
        worst = max(held, key=lambda r: r["roof_pct"] - r["sustained_roof_pct"])
        out.append(f"Held back to back instead of in a burst after an idle pause, the GEMMs read "
                   f"{loss[0]:.1f}-{loss[-1]:.1f} points less of the roofline (most: {worst['gemm']} at mean "
                   f"{worst['mean_tokens']:g}, {worst['roof_pct']:.1f}% -> {worst['sustained_roof_pct']:.1f}%).")
    # several tiles of one GEMM, activation form and mean (a --config run): the fastest, and the others' time
    groups: dict[tuple, list[dict]] = {}
    for r in gemm_rows:
        groups.setdefault((r["gemm"], r.get("act", "nvfp4"), r["mean_tokens"]), []).append(r)
    for (gemm, act, mean), rs in groups.items():
        if len(rs) < 2:
            continue
        rs = sorted(rs, key=lambda r: r["ms"])
        name = (lambda r: gemm_tile(r) if "plan" in r else "tile " + gemm_tile(r))  # noqa: E731
        out.append(f"{gemm}{' (' + act + ')' if acts else ''} at mean {mean:g}: fastest {name(rs[0])}, "
                   f"{rs[0]['ms']:.3f} ms ({rs[0]['roof_pct']:.1f}% of the read roofline); "
                   + ", ".join(f"{name(r)} {r['ms'] / rs[0]['ms']:.2f}x its time" for r in rs[1:]) + ".")
    tiles = sorted({p["config"]["max_frags"] * 8 for r in gemm_rows for p in r.get("plan", [r])})
    if tiles:
        out.append(f"Token tiles measured: {', '.join(map(str, tiles))} tokens"
                   + (" (all below CUTLASS's minimum of 128; the tile sweep below says whether one of 128 does "
                      "better)." if tiles[-1] < 128 else "."))
    return out


def section(runs: list[dict]) -> list[str]:
    """One subsection per run that has rows: its table and verdicts."""
    parts = []
    for i, run in enumerate(runs, 1):
        if not run.get("rows"):
            continue
        parts += [f"## Grouped GEMM on the {board(run)}, run {i} ({_source(run)})", ""]
        if run.get("read_roofline"):
            parts += [f"Flat streaming read in this run: {run['read_roofline']['gbps']:.0f} GB/s.", ""]
        parts += [gemm_table(run["rows"]), "", "Verdicts:", ""]
        parts += [f"- {v}" for v in gemm_verdicts(run["rows"])] + [""]
    return parts
