"""What the scripts' command lines share: help that shows the defaults, and output paths
checked when the arguments are parsed, before any work.

    HelpFormatter          a module docstring as written; each option's default after its help
    output_path            argparse type of a file a script writes (--json): refused with the
                           flag, the path and what is wrong when it could not be written
    output_problem(path)   what is wrong with writing `path` (a file, or a folder), or None
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """RawDescriptionHelpFormatter, plus ArgumentDefaultsHelpFormatter's "(default: ...)" after
    each option's help, left out where the help already speaks of its default or there is none
    to show (None, a switch's False, an empty list): a "(default: None)" would only add noise.
    A list shows as it is typed (8 32), not as Python prints it."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text or default is None or default is False
                or default is argparse.SUPPRESS or (isinstance(default, (list, tuple)) and not default)):
            return text
        if isinstance(default, (list, tuple)):
            # the help is %-formatted by argparse: a literal % in a value must be doubled
            return text + " (default: " + " ".join(str(v) for v in default).replace("%", "%%") + ")"
        return text + " (default: %(default)s)"


def output_problem(path, folder: bool = False) -> str | None:
    """What stands in the way of writing `path`, in words naming it, or None. ``folder``: the
    path is a folder the writer creates (or fills, when it exists)."""
    path = Path(path)
    if path.is_dir() and not folder:
        return f"'{path}' is a folder, expected a file name"
    if path.exists() and folder and not path.is_dir():
        return f"'{path}' is a file, expected a folder"
    parent = path.parent
    if not parent.exists():
        return f"folder '{parent}' does not exist"
    if not parent.is_dir():
        return f"'{parent}' is not a folder"
    # the folder when the path exists (a file is replaced in place, a folder is written into),
    # else its parent, where it would be created
    target = path if path.exists() else parent
    if not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
        return f"'{target}' is not writable"
    return None


def output_path(text: str) -> str:
    """argparse type of an output file: `text` itself, or ArgumentTypeError saying what is wrong
    (argparse puts the flag before it and exits 2)."""
    problem = output_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem if f"'{text}'" in problem else f"{problem} (for '{text}')")
    return text
