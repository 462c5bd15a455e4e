"""How much does folding the gate/up global ratio into e4m3 block scales (option (b)) cost?

For a ratio r, folds r into every finite positive e4m3 code (gate scales x r, which can
saturate at 448) and 1/r (up scales / r, which loses precision at small codes instead), and
with --checkpoint does the same over that checkpoint's actual gate and up scales, also with
each expert's own ratio. Prints a table and, with --json, writes the same rows as JSON.

    python scripts/scale_fold_probe.py --ratio 1.2308
    python scripts/scale_fold_probe.py --checkpoint model.safetensors --json fold.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate  # noqa: E402

from lab.scale_fold import FINITE_POSITIVE_CODES, fold_stats  # noqa: E402

COLUMNS = ["scales", "fold", "codes", "mean_rel_err", "max_rel_err", "max_rel_err_unsaturated",
           "saturated", "flushed_to_zero"]


def probe_rows(ratio: float, checkpoint: Path | None = None, layer: int | None = None) -> tuple[list[dict], dict | None]:
    rows = [
        {"scales": "all 126 finite codes", "fold": f"x {ratio:g}", **fold_stats(FINITE_POSITIVE_CODES, ratio)},
        {"scales": "all 126 finite codes", "fold": f"x 1/{ratio:g}", **fold_stats(FINITE_POSITIVE_CODES, 1.0 / ratio)},
    ]
    report = None
    if checkpoint is not None:
        from lab.checkpoint import load_checkpoint

        weights, rep = load_checkpoint(checkpoint, layer=layer)
        report = rep.as_dict()
        I = weights.intermediate
        gate, up = weights.w13_scales[:, :I], weights.w13_scales[:, I:]
        per_expert = rep.gate_up_ratio
        rows += [
            {"scales": "checkpoint gate", "fold": f"x {ratio:g}", **fold_stats(gate, ratio)},
            {"scales": "checkpoint up", "fold": f"x 1/{ratio:g}", **fold_stats(up, 1.0 / ratio)},
            {"scales": "checkpoint gate", "fold": "x own ratio", **fold_stats(gate, per_expert)},
            {"scales": "checkpoint up", "fold": "x 1/own ratio", **fold_stats(up, 1.0 / per_expert)},
        ]
    return rows, report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratio", type=float, default=1.2308, help="gate global / up global (default: the study's 1.2308)")
    p.add_argument("--checkpoint", type=Path, help="also probe this NVFP4 checkpoint's block scales")
    p.add_argument("--layer", type=int, help="checkpoint layer (default: the only one)")
    p.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = p.parse_args(argv)
    if not args.ratio > 0:
        p.error(f"--ratio must be > 0, got {args.ratio}")

    rows, report = probe_rows(args.ratio, args.checkpoint, args.layer)
    if report is not None:
        print(f"checkpoint {report['path']} layer {report['layer']}: gate/up ratio "
              f"min {report['ratio_min']:.4f} mean {report['ratio_mean']:.4f} max {report['ratio_max']:.4f}")
    print(tabulate([[r[c] for c in COLUMNS] for r in rows], headers=COLUMNS, floatfmt=".4g"))
    if args.json:
        args.json.write_text(json.dumps({"ratio": args.ratio, "checkpoint": report, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
