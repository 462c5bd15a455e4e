"""Render docs/findings-h200.md from the JSON under results/.

    python scripts/report.py                       # the default files below
    python scripts/report.py --layer a.json b.json --gemm g.json --out docs/findings-h200.md
    python scripts/report.py --tile-sweep results/tile_sweep_full.json

The studies (--read-roofline, --chunk-study, --tile-sweep) are optional: a file that is not
there is reported on the page as not measured, with the script that measures it. A file that
is there but cannot be read is an error (exit 2), as is a missing --layer or --gemm file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab.report import STUDIES, render  # noqa: E402  (after the path line above)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", nargs="+", default=[str(ROOT / "results/run_layer.json")],
                    help="run_layer.py JSON files; the first gives setup, bytes and stages")
    ap.add_argument("--gemm", nargs="*", default=[str(ROOT / "results/bench_gemm.json")],
                    help="bench_gemm.py JSON files")
    for study, script in STUDIES.items():
        ap.add_argument(f"--{study.replace('_', '-')}", dest=study, default=str(ROOT / f"results/{study}.json"),
                        help=f"{script} JSON (optional)")
    ap.add_argument("--out", default=str(ROOT / "docs/findings-h200.md"))
    ap.add_argument("--no-charts", action="store_true")
    args = ap.parse_args(argv)

    def load(flag, p):
        try:
            return json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"report: {flag} {p}: {exc}", file=sys.stderr)
            return None

    runs = []
    for flag, paths in (("--layer", args.layer), ("--gemm", args.gemm)):
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
    render(runs[0], runs[1], Path(args.out), charts=not args.no_charts, **studies)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
