"""Judge the expectation table against saved observations (`gate_harness judge`).

For a maintainer editing rows: the same verdicts the matrix test reaches (patch
rows must differ on pristine trees, every other row must match), read from
`run --json` files instead of a fresh run, limited to the scenarios observed.
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
        results = table.check_row(row, observations)
        differing = [r for r in results if not r.ok]
        if pristine and row.patch:
            if not [r for r in differing if not r.blind]:
                problems.append(f"{row.label}: names {row.patch} but pristine matches it")
        elif differing:
            problems.append(f"{row.label}: " + "; ".join(r.describe() for r in differing))
    return problems


def judge(path: Path, pristine: bool) -> int:
    observations = json.loads(path.read_text())
    problems = verdicts(observations, pristine)
    for line in problems:
        print(line)
    tree = "pristine" if pristine else "patched"
    print(f"{path}: {len(problems)} row(s) wrong for a {tree} tree")
    return 1 if problems else 0
