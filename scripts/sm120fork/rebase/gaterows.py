"""A patch's own gate-table rows, run on a pristine release in that release's gate
environment (for behaviour.py).

The rows are the `[[row]]` tables of the fork's gatetable/expectations.toml whose
`patch` names the patch; the cells that speak for it are the SM12x ones (archs.toml
entries of capability major 12), since a patch of the series changes only what
SM12x gets. The tool's harness (sm120fork.harness) observes them, run by the release's
gate-environment python from the fork's root:
`run --tree DIR --arch A --scenario S --json F`, then `cells F --patch NAME`.

The pristine tree is the work repository's commit of the release, archived once
per release next to the work repository (`pristine/<version>/python`); each
scenario's observation is kept there too, so the patches of one release that
share a scenario run it once.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.gateenv import GateEnv, GateEnvError, for_release, install, release_pins
from sm120fork.progress import Progress
from sm120fork.rebase.workrepo import WorkRepo

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GATES = Path("gatetable")
# "no": a release whose gate environment is not installed yet is not installed (the
# patch then stays a conflict, and its reason says so); a comma-separated list of
# versions: only those are installed; unset or anything else: every one is.
INSTALL_VARIABLE = "SM120_GATE_ENV_INSTALL"
# A venv to judge every release in, whatever its version (a synthetic release cut
# from the pinned tree has no wheel to read pins from; the pinned release's env fits).
OVERRIDE_VARIABLE = "SM120_REBASE_GATE_ENV"
_TIMEOUT_S = 1800


class RowsUnavailable(FatalError):
    """The rows could not be run: no gate environment, or the harness failed."""


@dataclass(frozen=True)
class Row:
    number: int
    scenario: str
    field: str


@dataclass(frozen=True)
class Cell:
    """One SM12x cell of a row, as the harness judged it on the pristine release."""

    row: int
    scenario: str
    field: str
    arch: str
    expected: str  # as written in expectations.toml
    observed: str
    ok: bool
    raised: bool  # the release raised (an observed refusal, not a harness failure)
    expects_raise: str | None  # the substring a `raises:` cell wants
    blind: bool

    @property
    def label(self) -> str:
        return f"row {self.row} {self.scenario}:{self.field}"


def rows_of(fork_root: Path, patch: str) -> list[Row]:
    """The rows of the fork's gate table that name `patch` (none without a table)."""
    path = fork_root / GATES / "expectations.toml"
    if not path.is_file():
        return []
    rows = tomllib.loads(path.read_text(encoding="utf-8")).get("row", [])
    return [
        Row(number, str(raw["scenario"]), str(raw["field"]))
        for number, raw in enumerate(rows, start=1)
        if raw.get("patch") == patch
    ]


def sm12x_archs(fork_root: Path) -> list[str]:
    archs = tomllib.loads((fork_root / GATES / "archs.toml").read_text(encoding="utf-8"))
    return [name for name, arch in archs.items() if int(arch["capability"][0]) == 12]


def gate_env(fork_root: Path, version: str, say: Callable[[str], None]) -> GateEnv:
    """sglang `version`'s gate environment (or $SM120_REBASE_GATE_ENV), installed if it
    is missing (unless SM120_GATE_ENV_INSTALL=no); GateEnvError says why it cannot be had."""
    override = os.environ.get(OVERRIDE_VARIABLE)
    if override:
        env = GateEnv(Path(override), ())
        if not env.python.exists():
            raise GateEnvError(f"{OVERRIDE_VARIABLE}={override} holds no bin/python")
        return env
    env = for_release(fork_root, version)
    if env.current:
        return env
    allowed = os.environ.get(INSTALL_VARIABLE, "").strip()
    if allowed.lower() == "no" or ("." in allowed and version not in allowed.split(",")):
        raise GateEnvError(
            f"sglang {version}'s gate environment is not installed ({env.venv}) and "
            f"{INSTALL_VARIABLE}={allowed}; `python -m sm120fork.gateenv --release {version}` "
            "installs it"
        )
    pins = release_pins(version)
    say(f"installing sglang {version}'s gate environment into {env.venv} (pip's log: {env.log})")
    # Plain lines: the carry's own live counters are on the terminal already.
    with Progress("gate environment", live=False) as shown:
        install(env, shown, pins)
    return env


def pristine_tree(repo: WorkRepo, commit: str, version: str) -> Path:
    """The release's tree (the work repository's `commit`), archived once per release;
    the directory that holds its `sglang/`."""
    root = repo.root.parent / "pristine" / version
    python = root / "python"
    if (python / "sglang" / "__init__.py").is_file():
        return python
    archive = repo.git("archive", "--format=tar", commit, "python").stdout
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    return python


def observe(
    env: GateEnv, fork_root: Path, tree: Path, rows: list[Row], archs: list[str], patch: str
) -> list[Cell]:
    """Run the rows' scenarios (those not yet observed on `tree`) on `archs`, and the
    cells of `patch`'s rows as the harness judges them."""
    kept = tree.parent / "observations"
    kept.mkdir(exist_ok=True)
    scenarios = sorted({row.scenario for row in rows})
    missing = [s for s in scenarios if not (kept / f"{s}.json").is_file()]
    if missing:
        out = kept / "run.json"
        command = ["run", "--tree", str(tree), "--jobs", "2", "--json", str(out)]
        command += [f"--arch={arch}" for arch in archs]
        command += [f"--scenario={scenario}" for scenario in missing]
        _harness(env, fork_root, command)
        observed = json.loads(out.read_text())
        for scenario in missing:
            per_arch = {arch: {scenario: observed.get(arch, {}).get(scenario)} for arch in archs}
            (kept / f"{scenario}.json").write_text(json.dumps(per_arch))
    merged: dict[str, dict[str, object]] = {arch: {} for arch in archs}
    for scenario in scenarios:
        for arch, per in json.loads((kept / f"{scenario}.json").read_text()).items():
            if per.get(scenario) is not None:
                merged[arch][scenario] = per[scenario]
    both = kept / f"cells-{patch}.json"
    both.write_text(json.dumps(merged))
    judged = _harness(env, fork_root, ["cells", str(both), f"--patch={patch}"])
    return [Cell(**cell) for cell in json.loads(judged) if cell["arch"] in archs]


def _harness(env: GateEnv, fork_root: Path, args: list[str]) -> str:
    command = [str(env.python), "-m", "sm120fork.harness", *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    clean["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # the tool's own harness
    try:
        ran = subprocess.run(
            command,
            cwd=fork_root,
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
    return ran.stdout
