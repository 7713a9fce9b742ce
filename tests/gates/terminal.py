"""What the gate suite shows a person: the matrix's progress and the closing summary.

The matrix (one child interpreter per tree and architecture) takes minutes; while
it runs, `MatrixProgress` counts the children done per tree, with the time spent:
live on a terminal, a plain line per child in CI logs (sm120fork.progress).

The summary names each tree by what it is and splits its rows: on the pristine
tree, the rows that name a patch are *expected* to differ (they are what the series
changes), so they are listed compactly as such; only differences nobody expected,
or a patch row that does not differ, are failures, shown cell by cell.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from sm120fork.harness import runner, spec, table, trees
from sm120fork.progress import Progress, elapsed

WHAT = {
    trees.PRISTINE: "pristine (vendor/sglang as upstream released it)",
    trees.PATCHED: "patched (vendor/sglang with patches/series applied)",
}
NAMED = {"installed-wheel": "installed wheel (the fork's wheel as `pip install` lays it out"}
Results = Sequence[tuple[table.Row, Sequence[table.CellResult]]]


def describe(tree: trees.Tree) -> str:
    """A tree by what it is, for a person (labels are for test ids)."""
    if tree.label in WHAT:
        return WHAT[tree.label]
    what = NAMED.get(tree.label, f"{tree.label} (")
    return f"{what} in {_shown(tree.path)}, judged as {tree.mode})"


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(spec.REPO_ROOT))
    except ValueError:
        return str(path)


class MatrixProgress:
    """`on_done` for `runner.run_matrices`: children done per tree, and in all."""

    def __init__(self, labels: Sequence[str], archs: Sequence[spec.Arch], jobs: int) -> None:
        self.shown = Progress("gate matrix")
        self.archs = len(archs)
        self.labels = labels
        self.total = len(labels) * len(archs)
        self.done: dict[str, int] = dict.fromkeys(labels, 0)
        self.jobs = jobs

    def __enter__(self) -> Callable[[str, runner.ArchRun], None]:
        self.shown.__enter__()
        self.shown.line(
            f"{len(self.labels)} trees ({', '.join(self.labels)}) x {self.archs} architectures"
            f" = {self.total} child interpreters, {self.jobs} at a time"
        )
        self.counters = {label: self.shown.add(label, self.archs) for label in self.labels}
        return self.child_done

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shown.__exit__(exc_type, exc, tb)

    def child_done(self, label: str, run: runner.ArchRun) -> None:
        self.done[label] += 1
        self.shown.update(self.counters[label], completed=self.done[label])
        finished = sum(self.done.values())
        self.shown.line(
            f"{finished}/{self.total} {label} {run.arch} in {run.wall_s:.0f} s "
            f"({elapsed(self.shown.seconds)} elapsed)"
        )


def summary(
    results: Mapping[str, Results], gate_trees: Mapping[str, trees.Tree], *, every_arch: bool
) -> list[str]:
    """The summary's lines: per tree, what matched, what differed as expected, what failed.
    `every_arch`: False when --gate-arch chose some (a patch row's bite is not judged)."""
    lines: list[str] = []
    for label, rows in results.items():
        tree = gate_trees.get(label) or trees.Tree(label, Path(label), trees.PATCHED)
        lines.extend(_tree_lines(tree, rows, every_arch))
    return lines


def _tree_lines(tree: trees.Tree, rows: Results, every_arch: bool) -> list[str]:
    differing = [(row, [c for c in cells if not c.ok]) for row, cells in rows]
    expected = [(r, c) for r, c in differing if c and tree.mode == trees.PRISTINE and r.patch]
    failing = [(r, c) for r, c in differing if c and (tree.mode != trees.PRISTINE or not r.patch)]
    toothless = [
        r for r, c in differing if every_arch and not c and tree.mode == trees.PRISTINE and r.patch
    ]  # a patch row pristine sglang already satisfies
    head = f"{describe(tree)}: {len(rows)} rows checked"
    if not (expected or failing or toothless):
        return [f"{head}, all as expected"]
    lines = [head]
    if expected:
        lines.append(
            f"  {len(expected)} rows differ as expected: they are what the series changes "
            "(patch: its rows in expectations.toml, where they differ)"
        )
        by_patch: dict[str, list[tuple[table.Row, list[table.CellResult]]]] = {}
        for row, cells in expected:
            by_patch.setdefault(row.patch or "", []).append((row, cells))
        for patch, found in sorted(by_patch.items()):
            numbers = ", ".join(str(row.number) for row, _ in sorted(found, key=_number))
            archs = sorted({c.arch for _, cells in found for c in cells}, key=_arch_order)
            rows_word = "row" if len(found) == 1 else "rows"
            lines.append(f"    {patch}: {rows_word} {numbers} ({' '.join(archs)})")
    if failing:
        lines.append(f"  {len(failing)} rows differ from expectations.toml (failures):")
        for row, cells in failing:
            tag = f" [patch {row.patch}]" if row.patch else ""
            lines.append(f"    {row.label}{tag}")
            lines.extend(f"        {cell.describe()}" for cell in cells)
    if toothless:
        lines.append(
            f"  {len(toothless)} rows name a patch but pristine sglang already matches them "
            "(failures: the row does not test its patch):"
        )
        lines.extend(f"    {row.label} [patch {row.patch}]" for row in toothless)
    return lines


def _number(item: tuple[table.Row, list[table.CellResult]]) -> int:
    return item[0].number


def _arch_order(arch: str) -> tuple[int, str]:
    digits = "".join(ch for ch in arch if ch.isdigit())
    return (int(digits or 0), arch)
