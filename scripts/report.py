"""Render docs/findings-h200.md from the JSON under results/.

    python scripts/report.py                       # the default files below
    python scripts/report.py --layer a.json b.json --gemm g.json --out docs/findings-h200.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lab.report import render

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", nargs="+", default=[str(ROOT / "results/run_layer.json"),
                                                   str(ROOT / "results/run_layer_one_launch.json")],
                    help="run_layer.py JSON files; the first gives setup, bytes and stages")
    ap.add_argument("--gemm", nargs="*", default=[str(ROOT / "results/bench_gemm.json")],
                    help="bench_gemm.py JSON files")
    ap.add_argument("--out", default=str(ROOT / "docs/findings-h200.md"))
    ap.add_argument("--no-charts", action="store_true")
    args = ap.parse_args(argv)
    runs = []
    for name, paths in (("--layer", args.layer), ("--gemm", args.gemm)):
        loaded = []
        for p in paths:
            try:
                loaded.append(json.loads(Path(p).read_text()))
            except (OSError, json.JSONDecodeError) as exc:
                print(f"report: {name} {p}: {exc}", file=sys.stderr)
                return 2
        runs.append(loaded)
    render(runs[0], runs[1], Path(args.out), charts=not args.no_charts)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
