"""What the scripts share on the command line beyond lab/gemm_bench.study_parser: help text for
every flag, and the model presets' shape flags (lab/models.py).

    ap = study_parser(__doc__, means, iterations)
    study_arguments(ap)           --model, shape flags with help, help for the common flags
    args = ap.parse_args(argv)
    problem = resolve_shape(args, ap)   (lab.models)
"""

from __future__ import annotations

import argparse

from . import models

STUDY_HELP = {
    "mean_tokens": "mean tokens per expert, one measurement each",
    "seed": "seed of the synthetic weights, routing and activations",
    "iterations": "timed runs per measurement (median, min, max)",
    "json": "write every table here as JSON",
}


def describe(ap: argparse.ArgumentParser, texts: dict) -> None:
    """Give the flags named in `texts` (by dest) that help text, where a shared parser added them
    without any. A dest the parser does not have is an error: the text would be lost silently."""
    # argparse has no public way to reach an action already added; _actions is the list it
    # keeps, unchanged in form since the module appeared.
    actions = {a.dest: a for a in ap._actions}
    missing = sorted(set(texts) - set(actions))
    if missing:
        raise ValueError(f"describe: the parser has no flag for {', '.join(missing)}")
    for dest, text in texts.items():
        actions[dest].help = text


def study_arguments(ap: argparse.ArgumentParser) -> None:
    """--model and the shape flags (lab.models), and help text for study_parser's other flags."""
    models.add_shape_arguments(ap)
    describe(ap, STUDY_HELP)
