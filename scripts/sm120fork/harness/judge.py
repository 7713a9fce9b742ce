"""Judge the expectation table against saved observations (`python -m sm120fork.harness judge`).

For a maintainer editing rows: the verdict the matrix test reaches
(`table.row_problem`), read from `run --json` files instead of a fresh run,
limited to the scenarios observed.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import table

ARCHS = ("sm80", "sm89", "sm90", "sm100", "sm103", "sm120", "sm121")


def verdicts(observations: table.Observations, pristine: bool) -> list[str]:
    """One line per row the observations cover that the tree does not satisfy."""
    observed_scenarios = {s for per_arch in observations.values() for s in per_arch}
    problems = []
    for row in table.load_table(ARCHS).rows:
        if row.scenario not in observed_scenarios:
            continue
        problem = table.row_problem(row, table.check_row(row, observations), pristine)
        if problem is not None:
            problems.append(f"{row.label}: {problem}")
    return problems


def judge(path: Path, pristine: bool) -> int:
    observations = json.loads(path.read_text())
    problems = verdicts(observations, pristine)
    for line in problems:
        print(line)
    tree = "pristine" if pristine else "patched"
    print(f"{path}: {len(problems)} row(s) wrong for a {tree} tree")
    return 1 if problems else 0
