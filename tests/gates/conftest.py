"""pytest wiring of the architecture-gate suite (run it in the gate environment).

Options (all optional):
  --gate-tree T     the sglang to test, repeatable: ``pristine`` (vendor/sglang),
                    ``patched`` (vendor/sglang + patches/series, built with
                    `sm120fork apply`), or a directory to put first on sys.path
                    (e.g. a `pip install --target` dir), optionally named:
                    ``installed-wheel=DIR``; default: pristine and patched
  --gate-mode M     how a directory given to --gate-tree is judged: patched (default)
                    or pristine
  --gate-arch A     only these architectures (repeatable; for quick iteration)
  --gate-jobs N     parallel child interpreters (default: CPU count)
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import pytest
from sm120fork.harness import moe_sweep, runner, spec, table, trees

from . import terminal

RESULTS = pytest.StashKey[dict[str, list[tuple[table.Row, list[table.CellResult]]]]]()
TREES = pytest.StashKey[dict[str, trees.Tree]]()
_NAME = re.compile(r"[a-z][a-z0-9-]*")
SWEEP_UNEXPECTED_SMI: list[str] = []  # nvidia-smi calls the fake could not answer, per child


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sm120 gates", "architecture-gate tests")
    group.addoption("--gate-tree", action="append", default=[], metavar="TREE")
    group.addoption("--gate-mode", choices=trees.MODES, default=trees.PATCHED)
    group.addoption("--gate-arch", action="append", default=[], metavar="ARCH")
    group.addoption("--gate-jobs", type=int, default=None, metavar="N")


def _tree_specs(config: pytest.Config) -> list[tuple[str, str]]:
    """(label, tree option value) for every tree to test, known at collection time."""
    values: list[str] = config.getoption("--gate-tree") or [trees.PRISTINE, trees.PATCHED]
    specs = []
    for index, value in enumerate(values):
        name, _, path = value.partition("=")
        if path and _NAME.fullmatch(name):
            specs.append((name, path))
        else:
            specs.append(
                (value if value in trees.MODES else f"tree{index}-{Path(value).name}", value)
            )
    return specs


def pytest_configure(config: pytest.Config) -> None:
    config.stash[RESULTS] = {}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    labels = [label for label, _ in _tree_specs(config)]
    if "tree_label" in metafunc.fixturenames and "row" in metafunc.fixturenames:
        rows = load_rows()
        params = [(label, row) for label in labels for row in rows]
        metafunc.parametrize(
            ("tree_label", "row"),
            params,
            ids=[f"{label}-{row.number}-{row.scenario}:{row.field}" for label, row in params],
        )
    elif "tree_label" in metafunc.fixturenames:
        metafunc.parametrize("tree_label", labels)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The matrix's tests last: its children keep both cores busy, while the rebases of
    the synthetic walks are one process each; run first, they share the machine with
    the tool's tests, which `nox -s tests` runs beside this suite on one core."""
    items.sort(key=lambda item: "matrices" in getattr(item, "fixturenames", ()))


def load_archs() -> tuple[spec.Arch, ...]:
    return spec.load_archs()


def load_rows() -> tuple[table.Row, ...]:
    return table.load_table([a.name for a in load_archs()]).rows


@pytest.fixture(scope="session")
def gate_trees(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, trees.Tree]:
    result = {}
    for label, value in _tree_specs(pytestconfig):
        if value == trees.PRISTINE:
            result[label] = trees.pristine_tree()
        elif value == trees.PATCHED:
            result[label] = trees.build_patched_tree(tmp_path_factory.mktemp("patched-tree"))
        else:
            path = Path(value).resolve()
            if not (path / "sglang" / "__init__.py").is_file():
                raise pytest.UsageError(f"--gate-tree {value}: no sglang/__init__.py in {path}")
            result[label] = trees.Tree(label, path, pytestconfig.getoption("--gate-mode"))
    pytestconfig.stash[TREES] = result
    return result


@pytest.fixture(scope="session")
def gate_archs(pytestconfig: pytest.Config) -> tuple[spec.Arch, ...]:
    wanted = set(pytestconfig.getoption("--gate-arch"))
    archs = tuple(a for a in load_archs() if not wanted or a.name in wanted)
    if wanted - {a.name for a in archs}:
        raise pytest.UsageError(f"--gate-arch: unknown {sorted(wanted - {a.name for a in archs})}")
    return archs


@pytest.fixture(scope="session")
def zygote_pool(
    tmp_path_factory: pytest.TempPathFactory, gate_trees: dict[str, trees.Tree]
) -> Iterator[runner.ZygotePool]:
    """One zygote per architecture for the whole session: the synthetic walks' row
    checks and the matrix fork their children from the same ones. Its fakes cover the
    trees under test; a walk's trees are copies of vendor/sglang (no extensions)."""
    scratch = tmp_path_factory.mktemp("zygotes")
    paths = [tree.path for tree in gate_trees.values()]
    stubs = runner.prepare_fakes(sys.executable, scratch / "fakes", paths)
    pool = runner.ZygotePool(sys.executable, stubs, scratch, scratch / "hf-home")
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def matrices(
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
    gate_trees: dict[str, trees.Tree],
    gate_archs: tuple[spec.Arch, ...],
    zygote_pool: runner.ZygotePool,
) -> dict[str, runner.MatrixRun]:
    """Observe every tree on every architecture once per session (children in parallel),
    counting the children done on the terminal (pytest's capture is off meanwhile).
    The first tree's sm120 child (or its first architecture's) also runs in a fresh
    interpreter, and must observe exactly what its zygote's fork did."""
    jobs = pytestconfig.getoption("--gate-jobs") or os.cpu_count() or 1
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    reporter = pytestconfig.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")  # end the line of progress dots
        reporter.flush()
    with (
        capture.global_and_fixture_disabled(),
        terminal.MatrixProgress(list(gate_trees), gate_archs, jobs) as on_done,
    ):
        return runner.run_matrices(
            {label: tree.path for label, tree in gate_trees.items()},
            gate_archs,
            list(spec.load_scenarios().values()),
            scratch=tmp_path_factory.mktemp("gate-matrix"),
            jobs=jobs,
            on_done=on_done,
            fresh_check=(next(iter(gate_trees)), _fresh_checked(gate_archs)),
            zygotes=zygote_pool,
        )


def _fresh_checked(archs: tuple[spec.Arch, ...]) -> str:
    names = [a.name for a in archs]
    return "sm120" if "sm120" in names else names[0]


@pytest.fixture
def record_row(
    pytestconfig: pytest.Config,
) -> Iterator[list[tuple[str, table.Row, list[table.CellResult]]]]:
    """Collects (tree, row, cells) for the terminal summary."""
    box: list[tuple[str, table.Row, list[table.CellResult]]] = []
    yield box
    store = pytestconfig.stash[RESULTS]
    for label, row, cells in box:
        store.setdefault(label, []).append((row, cells))


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    store = config.stash.get(RESULTS, {})
    if not store:
        return
    terminalreporter.section("architecture gates: each tree against expectations.toml")
    every_arch = not config.getoption("--gate-arch")
    tested: dict[str, trees.Tree] = config.stash.get(TREES, {})
    for line in terminal.summary(store, tested, every_arch=every_arch):
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def sweep(
    tmp_path_factory: pytest.TempPathFactory,
    gate_trees: dict[str, trees.Tree],
    gate_archs: tuple[spec.Arch, ...],
    zygote_pool: runner.ZygotePool,
) -> dict[str, dict[str, dict[str, Any]]]:
    """The MoE sweep observed (tree label -> arch -> cell name -> observation): every
    cell on each SM12x arch; on sm80..sm103, cell i on UPSTREAM[i % 5]. Judged by
    test_moe_sweep.py; test_moe_forward.py runs the forward of what it resolved."""
    every = spec.load_archs()
    sm12x = [a for a in every if a.capability[0] == 12]
    upstream = [a for a in every if a.capability[0] != 12]
    where = tmp_path_factory.mktemp("moe-sweep")
    scenarios = moe_sweep.scenarios(moe_sweep.cells(), where / "configs")
    wanted = {a.name for a in gate_archs}
    paths = {label: tree.path for label, tree in gate_trees.items()}
    plan = [([a for a in sm12x if a.name in wanted], scenarios)]
    plan += [
        ([arch], scenarios[index :: len(upstream)])
        for index, arch in enumerate(upstream)
        if arch.name in wanted
    ]
    observed: dict[str, dict[str, dict[str, Any]]] = {label: {} for label in paths}
    for number, (archs, chosen) in enumerate(plan):
        if not archs:
            continue
        runs = runner.run_matrices(
            paths, archs, chosen, scratch=where / f"run{number}", zygotes=zygote_pool
        )
        for label, run in runs.items():
            for arch, scenario_obs in run.observations.items():
                observed[label][arch] = dict(scenario_obs)
            for child in run.runs.values():
                log = child.log.with_name("nvidia-smi-unexpected.log")
                if log.is_file():
                    line = f"{label} {child.arch}: {log.read_text().strip()}"
                    SWEEP_UNEXPECTED_SMI.append(line)
    return observed
