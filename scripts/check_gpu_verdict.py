"""Whether a run of scripts/check_gpu.sh checked what it says it checked, from the files it wrote.

    python scripts/check_gpu_verdict.py results     (check_gpu.sh runs it on its output folder)

pytest_gpu.log (the tail of the GPU suite's output) must end with a pytest summary that counts
passed tests and no failure or error: a suite that skipped or deselected everything checked
nothing. Each "== TOOL NAME" section of sanitizer.txt must hold the same of its own pytest run
under compute-sanitizer, and the sanitizer's summary line with 0 errors (ERROR SUMMARY, or
racecheck's RACECHECK SUMMARY). An empty section is a run that never started (no sanitizer,
no pytest summary). Prints one line per problem, naming the file or the section, and exits 1;
prints "clean: ..." and exits 0 when there is none.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# pytest's last line: "3 passed, 110 deselected in 1.47s", "1 failed, 2 passed, 1 warning in 3.0s",
# "no tests ran in 0.01s"; without -q it is framed in "=" signs
SUMMARY = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+|no tests ran)\s+in\s+[\d.]+s\b")
COUNT = re.compile(r"(\d+) ([a-z]+)")
# compute-sanitizer's last line: "ERROR SUMMARY: 0 errors"; racecheck's: "RACECHECK SUMMARY: 0
# hazards displayed (0 errors, 0 warnings)"
SANITIZER = re.compile(r"\bSUMMARY:.*?\b(\d+) errors?\b")
SECTION = re.compile(r"^== (\S+) (\S+)\s*$")
SUITE_LINE = "GPU suite in the same call:"  # what check_gpu.sh writes after the last section


def pytest_counts(lines: list[str]) -> dict[str, int] | None:
    """{outcome: count} of the last pytest summary line among `lines` ("error" for "errors"),
    {} for "no tests ran", None when there is no summary line."""
    for line in reversed(lines):
        m = SUMMARY.search(line.strip())
        if m:
            return {("error" if w == "errors" else w): int(n) for n, w in COUNT.findall(m.group(1))}
    return None


def run_problems(lines: list[str], what: str) -> list[str]:
    """What is wrong with one pytest run's output (`what` names it in each line)."""
    counts = pytest_counts(lines)
    if counts is None:
        return [f"{what}: no pytest summary line (the tests did not run)"]
    problems = []
    bad = {k: counts[k] for k in ("failed", "error") if counts.get(k)}
    if bad:
        problems.append(f"{what}: " + ", ".join(f"{n} {k}" for k, n in bad.items()))
    if not counts.get("passed"):
        said = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no tests ran"
        problems.append(f"{what}: ran no test ({said}): every test skipped or deselected")
    return problems


def sections(text: str) -> dict[str, list[str]]:
    """{"TOOL NAME": its lines} of sanitizer.txt, in order."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = SECTION.match(line)
        if m:
            current = f"{m.group(1)} {m.group(2)}"
            out[current] = []
        elif line.startswith(SUITE_LINE):
            current = None
        elif current is not None:
            out[current].append(line)
    return out


def section_problems(name: str, lines: list[str]) -> list[str]:
    """What is wrong with one sanitizer section: its pytest run's problems, then the sanitizer's."""
    what = f"sanitizer section '{name}'"
    if not any(line.strip() for line in lines):
        return [f"{what}: empty: no pytest summary line and no compute-sanitizer summary (the run did not start)"]
    problems = run_problems(lines, what)
    errors = [int(m.group(1)) for m in map(SANITIZER.search, lines) if m]
    if not errors:
        problems.append(f"{what}: no compute-sanitizer SUMMARY line (the sanitizer did not finish)")
    elif any(errors):
        problems.append(f"{what}: compute-sanitizer reports {max(errors)} error(s)")
    return problems


def verdict(folder: Path) -> list[str]:
    """Every problem of the run whose files are in `folder` ([]: a clean run)."""
    problems = []
    for name in ("pytest_gpu.log", "sanitizer.txt"):
        if not (folder / name).is_file():
            problems.append(f"{folder / name}: missing")
    if problems:
        return problems
    problems += run_problems((folder / "pytest_gpu.log").read_text().splitlines(), "GPU suite (pytest_gpu.log)")
    found = sections((folder / "sanitizer.txt").read_text())
    if not found:
        problems.append(f"{folder / 'sanitizer.txt'}: no '== TOOL NAME' section")
    for name, lines in found.items():
        problems += section_problems(name, lines)
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="check_gpu.sh's output folder (pytest_gpu.log, sanitizer.txt)")
    args = ap.parse_args(argv)
    if not args.folder.is_dir():
        ap.error(f"folder: '{args.folder}' is not a folder")
    problems = verdict(args.folder)
    for p in problems:
        print(f"check_gpu: FAILED: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"check_gpu: clean: the GPU suite and {len(sections((args.folder / 'sanitizer.txt').read_text()))} "
          f"sanitizer sections ran tests that passed, with no sanitizer error")
    return 0


if __name__ == "__main__":
    sys.exit(main())
