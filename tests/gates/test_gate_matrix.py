"""Architecture-gate tests: sglang's decisions per faked GPU against expectations.toml.

Runs only in the gate environment (torch + sglang's pins): `nox -s gate_tests`.
See gatetable/README.md.
"""

from __future__ import annotations

import pytest
from sm120fork.harness import runner, spec, table, trees

ARCHS = [a.name for a in spec.load_archs()]


def test_table_names_known_scenarios_and_patches() -> None:
    scenarios = spec.load_scenarios()
    series = set(spec.series_patches())
    gate_table = table.load_table(ARCHS)
    problems = [
        f"{row.label}: no scenario {row.scenario!r} in scenarios.toml"
        for row in gate_table.rows
        if row.scenario not in scenarios
    ]
    problems += [
        f"{row.label}: patch {row.patch!r} is not in patches/series"
        for row in gate_table.rows
        if row.patch and row.patch not in series
    ]
    problems += [
        f"[[untested]] {name!r} is not in patches/series"
        for name in gate_table.untested
        if name not in series
    ]
    assert not problems, "\n".join(problems)


def test_every_patch_is_tested_by_a_row() -> None:
    gate_table = table.load_table(ARCHS)
    named = {row.patch for row in gate_table.rows if row.patch}
    untested = [
        name
        for name in spec.series_patches()
        if name not in named and name not in gate_table.untested
    ]
    assert not untested, (
        "patches with no row in tests/gates/expectations.toml (add a row naming the patch, "
        f"or an [[untested]] entry with the reason): {', '.join(untested)}"
    )


def test_rows_observe_real_fields(tree_label: str, matrices: dict[str, runner.MatrixRun]) -> None:
    """A misspelled field would read "<missing>" everywhere and 'differ' vacuously."""
    observations = matrices[tree_label].observations
    missing = []
    for row in table.load_table(ARCHS).rows:
        cells = [
            table.observed_cell(per_arch.get(row.scenario), row.field)
            for per_arch in observations.values()
        ]
        if all(cell == table.MISSING for cell in cells):
            missing.append(row.label)
    assert not missing, f"{tree_label}: fields observed on no architecture: {', '.join(missing)}"


def test_fake_nvidia_smi_saw_only_known_queries(
    tree_label: str, matrices: dict[str, runner.MatrixRun]
) -> None:
    """An nvidia-smi call the fake cannot answer means a decision saw a broken fake."""
    unexpected = []
    for run in matrices[tree_label].runs.values():
        log = run.log.with_name("nvidia-smi-unexpected.log")
        if log.is_file():
            unexpected.append(f"{run.arch}: {log.read_text().strip()}")
    assert not unexpected, "\n".join(unexpected)


def test_row(
    tree_label: str,
    row: table.Row,
    matrices: dict[str, runner.MatrixRun],
    gate_trees: dict[str, trees.Tree],
    gate_archs: tuple[spec.Arch, ...],
    record_row: list[tuple[str, table.Row, list[table.CellResult]]],
) -> None:
    tree = gate_trees[tree_label]
    wanted = {a.name for a in gate_archs}
    cells = [c for c in table.check_row(row, matrices[tree_label].observations) if c.arch in wanted]
    record_row.append((tree_label, row, cells))
    pristine = tree.mode == trees.PRISTINE
    if pristine and row.patch and len(wanted) < len(ARCHS) and all(c.ok for c in cells):
        pytest.skip("bite check needs every architecture (--gate-arch given)")
    problem = table.row_problem(row, cells, pristine)
    assert problem is None, f"{tree_label} ({tree.path}) {row.label}: {problem}"
