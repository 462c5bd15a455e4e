"""A variant whose kernels are compiled from another source tree (a directory laid out as
lab/kernels: another commit's, from `git archive`, or a copy with an edit), so that a kernel edit
is timed against the shipped kernels in one process at the layer level, on the same inputs and
buffers (scripts/token_axis.py --tree). Only the kernels come from the tree: the launches, plans
and checks are this checkout's Python, so the tree's kernels must take the same arguments."""

from __future__ import annotations

from pathlib import Path

from lab.kernels import jit

SEPARATOR = "@"  # "<variant>@<label>": the variant with its kernels from the tree labelled so


class FromTree:
    """`inner` (a variant) with every kernel it compiles, in prepare and in run, taken from
    `tree`; named "<inner's name>@<label>", and otherwise inner itself (expect, stages, buffers)."""

    def __init__(self, inner, label: str, tree):
        self.inner, self.label, self.tree = inner, label, Path(tree).resolve()  # (use_tree checks its layout)
        self.name = f"{inner.name}{SEPARATOR}{label}"

    def __getattr__(self, attr):  # (only for what FromTree itself does not hold)
        return getattr(self.inner, attr)

    def prepare(self, runner, layer) -> None:
        with jit.use_tree(self.tree):
            self.inner.prepare(runner, layer)

    def run(self, runner, layer) -> None:
        with jit.use_tree(self.tree):
            self.inner.run(runner, layer)


def split(name: str) -> tuple[str, str | None]:
    """("w4a8", "base") for "w4a8@base"; (name, None) for a name with no label."""
    base, sep, label = name.partition(SEPARATOR)
    if sep and (not base or not label):
        raise ValueError(f"variant {name!r}: expected <variant>{SEPARATOR}<tree label>")
    return base, (label if sep else None)
