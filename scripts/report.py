"""Render docs/findings.md, and README's token-axis block, from the runs under results/.

    python scripts/report.py                       # the runs PAGE_RUNS in lab/report.py lists
    python scripts/report.py --layer a.json b.json --gemm g.json --out /tmp/findings.md
    python scripts/report.py --tile-sweep tile_sweep_full.json --out /tmp/findings.md
    python scripts/report.py --token-axis h200.json h100.json --readme /tmp/README.md

With no arguments it rewrites the committed page and README's generated block as committed.
README's block (between the markers lab/report_token_axis.py names) takes the first token-axis
run's table and every run's crossover; `--readme none` leaves README alone. The studies (--read-roofline,
--chunk-study, --tile-sweep) are optional: a file that is not there is reported on the page as
not measured, with the script that measures it. A file that is there but cannot be read is an
error (exit 2), as is a missing --layer or --gemm file. The charts are drawn beside the page when
matplotlib is installed (the `plot` extra); without it the page is the same and the charts
already there are left as they are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab.ceilings import validate as validate_ceilings  # noqa: E402
from lab.report import PAGE, PAGE_RUNS, charts_of, render  # noqa: E402
from lab.report_common import FILE_KEY, have_matplotlib  # noqa: E402
from lab.report_studies import STUDIES  # noqa: E402
from lab.report_token_axis import readme_block, splice_readme  # noqa: E402


def _shown(p: str) -> str:
    """The path as the page cites it: from the repository root when it is inside the repository."""
    path = Path(p).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", nargs="+", default=[str(ROOT / p) for p in PAGE_RUNS["layer"]],
                    help="run_layer.py JSON files; the first gives the setup table")
    ap.add_argument("--gemm", nargs="*", default=[str(ROOT / p) for p in PAGE_RUNS["gemm"]],
                    help="bench_gemm.py JSON files")
    for study, script in STUDIES.items():
        ap.add_argument(f"--{study.replace('_', '-')}", dest=study, default=str(ROOT / PAGE_RUNS[study]),
                        help=f"{script} JSON (optional)")
    ap.add_argument("--token-axis", nargs="*", default=[str(ROOT / p) for p in PAGE_RUNS["token_axis"]],
                    help="token_axis.py JSON files, one per board, the README's board first; a missing one is "
                         "reported and left out")
    ap.add_argument("--readme", default=str(ROOT / "README.md"),
                    help="README whose generated token-axis block is rewritten ('none': leave it)")
    ap.add_argument("--models", nargs="*", default=[str(ROOT / p) for p in PAGE_RUNS["models"]],
                    help="run_layer.py --model JSON files, one per preset (the per-model table)")
    ap.add_argument("--out", default=str(ROOT / PAGE), help="the page to write (charts go beside it)")
    ap.add_argument("--no-charts", action="store_true", help="leave the charts beside the page as they are")
    args = ap.parse_args(argv)

    def load(flag, p):
        try:
            run = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"report: {flag} {p}: {exc}", file=sys.stderr)
            return None
        run[FILE_KEY] = _shown(p)
        return run

    runs = []
    for flag, paths in (("--layer", args.layer), ("--gemm", args.gemm), ("--models", args.models)):
        loaded = [load(flag, p) for p in paths]
        if any(d is None for d in loaded):
            return 2
        runs.append(loaded)
    studies = {}
    for study in STUDIES:
        p = Path(getattr(args, study))
        if not p.exists():
            print(f"report: {p} not found: the page says {study} was not measured", file=sys.stderr)
            studies[study] = None
            continue
        studies[study] = load(f"--{study.replace('_', '-')}", p)
        if studies[study] is None:
            return 2
    boards = []
    for p in map(Path, args.token_axis):
        if not p.exists():
            print(f"report: {_shown(str(p))} not found: the page leaves that board's token axis out", file=sys.stderr)
            continue
        run = load("--token-axis", p)
        if run is None:
            return 2
        try:
            validate_ceilings(run.get("ceilings"))
        except ValueError as exc:
            print(f"report: --token-axis {_shown(str(p))}: {exc}", file=sys.stderr)
            return 2
        boards.append(run)
    readme = None if args.readme == "none" else Path(args.readme)
    if readme is not None:
        try:
            new_readme = splice_readme(readme.read_text(), readme_block(boards)) if boards else None
        except (OSError, ValueError) as exc:
            print(f"report: --readme {args.readme}: {exc}", file=sys.stderr)
            return 2
    out = Path(args.out)
    charts = not args.no_charts and have_matplotlib()
    text = render(runs[0], runs[1], out, charts=charts, model_runs=runs[2], token_axis=boards, **studies)
    if readme is not None and new_readme is not None:
        readme.write_text(new_readme)
        print(f"wrote {_shown(str(readme))}'s token-axis block")
    if not args.no_charts and not charts:
        left = " and ".join(_shown(str(out.parent / c)) for c in charts_of(text))
        print(f"report: matplotlib is not installed: left {left} as they are "
              f"(pip install -e '.[plot]' redraws them)")
    print(f"wrote {_shown(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
