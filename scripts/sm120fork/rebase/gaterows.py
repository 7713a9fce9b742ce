"""Gate-table rows observed on commits of the work repository (for verify.py).

The rows are gatetable/expectations.toml's, read by the harness's own parser
(sm120fork.harness.table). A commit's tree is archived once next to the work
repository (`verify/trees/<commit>/python`) and observed by the harness
(`observe --tree LABEL=DIR ...`, several trees in one matrix) run by the decision
environment's python from the fork's root. Observations are kept in the fork's
build/rebase-observed/ (a rebase starts by clearing build/rebase/), named by what
decides them: the commit's `python/` tree id, the environment (its path and
pins), the tool's source and the gate data the harness reads (archs, scenarios,
model configs). So a scenario runs once per tree however many patches' rows read
it, and a dry run's observations serve the rebase that follows it (the upstream
watch runs both).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sm120fork.errors import FatalError
from sm120fork.harness import spec, table
from sm120fork.rebase.decisionenv import DecisionEnv, installed_pins
from sm120fork.rebase.workrepo import WorkRepo

Observations = Mapping[str, Mapping[str, Mapping[str, Any]]]  # arch -> scenario -> fields
_TIMEOUT_S = 1800


class RowsUnavailable(FatalError):
    """The rows could not be run: the harness failed."""


@dataclass(frozen=True)
class Table:
    rows: tuple[table.Row, ...]
    archs: tuple[str, ...]  # every architecture of archs.toml
    sm12x: tuple[str, ...]  # those of capability major 12: the ones a patch changes
    untested: Mapping[str, str]  # patch -> why no row can observe it ([[untested]])

    def of(self, patch: str) -> list[table.Row]:
        return [row for row in self.rows if row.patch == patch]


def load(fork_root: Path) -> Table | None:
    """The fork's gate table; None when it has none."""
    folder = fork_root / "gatetable"
    if not (folder / "expectations.toml").is_file():
        return None
    archs = spec.load_archs(folder / "archs.toml")
    names = tuple(a.name for a in archs)
    loaded = table.load_table(names, folder / "expectations.toml")
    sm12x = tuple(a.name for a in archs if a.capability[0] == 12)
    return Table(loaded.rows, names, sm12x, loaded.untested)


def inputs_digest(env: DecisionEnv, fork_root: Path) -> str:
    """What decides an observation besides the tree: the environment, the tool's
    source (the harness and what it imports) and the fork's gate data."""
    digest = hashlib.sha256(f"{env.python}\n{installed_pins(env.venv)}\n".encode())
    tool = Path(__file__).resolve().parents[1]
    table_dir = fork_root / "gatetable"
    files = [
        *sorted(tool.rglob("*.py")),
        table_dir / "archs.toml",
        table_dir / "scenarios.toml",
        *sorted(p for p in (table_dir / "models").rglob("*") if p.is_file()),
    ]
    for path in files:
        digest.update(f"{path.relative_to(path.anchor)}\n".encode())
        digest.update(path.read_bytes() if path.is_file() else b"-")
    return digest.hexdigest()[:16]


class Observer:
    """Observes commits of `repo` in one decision environment, keeping every result
    in `kept` (named by the tree and `inputs_digest`)."""

    def __init__(self, repo: WorkRepo, env: DecisionEnv, fork_root: Path, kept: Path) -> None:
        self.repo, self.env, self.fork_root = repo, env, fork_root
        self.area = repo.root.parent / "verify"
        self.kept = kept / inputs_digest(env, fork_root)
        self._trees: dict[str, str] = {}

    def observe(
        self, commits: Sequence[str], scenarios: Sequence[str], archs: Sequence[str]
    ) -> dict[str, Observations]:
        """commit -> its observations of `scenarios` on `archs` (run where not kept)."""
        missing = {
            c: [s for s in scenarios if any(not self._kept(c, a, s).is_file() for a in archs)]
            for c in dict.fromkeys(commits)
        }
        todo = {c: s for c, s in missing.items() if s}
        if todo:
            self._run(todo, sorted({s for names in todo.values() for s in names}), archs)
        return {c: self._read(c, scenarios, archs) for c in dict.fromkeys(commits)}

    def _kept(self, commit: str, arch: str, scenario: str) -> Path:
        if commit not in self._trees:
            self._trees[commit] = self.repo.out("rev-parse", f"{commit}:python")
        return self.kept / self._trees[commit] / arch / f"{scenario}.json"

    def _read(self, commit: str, scenarios: Sequence[str], archs: Sequence[str]) -> Observations:
        return {
            arch: {s: json.loads(self._kept(commit, arch, s).read_text()) for s in scenarios}
            for arch in archs
        }

    def _run(
        self, commits: dict[str, list[str]], scenarios: list[str], archs: Sequence[str]
    ) -> None:
        out = self.area / "observed.json"
        command = ["observe", "--jobs", "2", "--json", str(out)]
        command += [f"--tree={c}={self._tree(c)}" for c in commits]
        command += [f"--arch={a}" for a in archs] + [f"--scenario={s}" for s in scenarios]
        self._harness(command)
        observed = json.loads(out.read_text())
        for commit in commits:
            for arch in archs:
                for scenario in scenarios:
                    found = observed.get(commit, {}).get(arch, {}).get(scenario)
                    kept = self._kept(commit, arch, scenario)
                    kept.parent.mkdir(parents=True, exist_ok=True)
                    kept.write_text(json.dumps(found))

    def _tree(self, commit: str) -> Path:
        """The commit's tree, archived once: the directory that holds its `sglang/`."""
        root = self.area / "trees" / commit
        python = root / "python"
        if not (python / "sglang" / "__init__.py").is_file():
            archive = self.repo.git("archive", "--format=tar", commit, "python").stdout
            root.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(root, filter="data")
        return python

    def _harness(self, args: list[str]) -> None:
        command = [str(self.env.python), "-m", "sm120fork.harness", *args]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        clean["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # the tool's harness
        clean["SM120_FORK_ROOT"] = str(self.fork_root)
        try:
            ran = subprocess.run(
                command,
                cwd=self.fork_root,
                env=clean,
                capture_output=True,
                text=True,
                check=False,
                timeout=_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as error:
            raise RowsUnavailable(f"the gate harness ran past {_TIMEOUT_S} s") from error
        if ran.returncode != 0:
            tail = " | ".join((ran.stderr or ran.stdout).strip().splitlines()[-3:])
            raise RowsUnavailable(f"the gate harness exited {ran.returncode}: {tail}")


def cells(
    row: table.Row, observations: Observations, archs: Sequence[str]
) -> list[table.CellResult]:
    """The row's cells on `archs`, judged against `observations`."""
    return [c for c in table.check_row(row, observations) if c.arch in archs]
