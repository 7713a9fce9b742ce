"""The environment a release's gate rows are decided in, found by the release's pins.

The rows decide at argument time and in load-time probes; they run no kernel, and
the tree under test shadows whatever sglang a venv holds. So what a release needs
of a venv is its dependencies: the release's own pins, read from what the rebase
was given (the git tag's `python/pyproject.toml`, or the fetched wheel's
Requires-Dist), never downloaded again. Any gate venv whose installed sglang
declares the same pins decides for it: the fork's own (`gateenv.locate`), or one
under the cache (`gate-env-*`). A release whose pins no venv has gets a venv of its
own with exactly those pins (unless `SM120_GATE_ENV_INSTALL` says no), installed
with uv as of the release's time (`released.txt` beside its pins; uvinstall.py),
and a verdict there names any pin overridden; where that cannot be had, the rows
cannot run, and the rebase stops saying why (uv's own reason).

`SM120_REBASE_GATE_ENV=DIR` decides every release in one venv, whatever its pins
(the report says so).
"""

from __future__ import annotations

import datetime
import email
import os
import subprocess
import tomllib
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from sm120fork import gateenv
from sm120fork.errors import FatalError
from sm120fork.progress import Progress
from sm120fork.rebase import uvinstall
from sm120fork.upstream.git import fetched_repository

PINS_FILE = "pins.txt"  # beside a fetched release's tree
RELEASED_FILE = "released.txt"  # when it was made: its wheel's build, its tag's commit
INSTALL_VARIABLE = "SM120_GATE_ENV_INSTALL"  # "no", or the versions to install for
OVERRIDE_VARIABLE = "SM120_REBASE_GATE_ENV"


class NoDecisionEnv(FatalError):
    """No environment can decide the release's rows; the message says why."""


@dataclass(frozen=True)
class DecisionEnv:
    python: Path
    why: str  # which venv, and why it fits: the report's "decided in" line

    @property
    def venv(self) -> Path:
        return self.python.parents[1]


def normalized(requirements: list[str]) -> str:
    """Requirements without extras-only ones, one a line, as packaging spells them."""
    kept = []
    for text in requirements:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            kept.append(text.strip())
            continue
        if requirement.marker is None or "extra" not in str(requirement.marker):
            kept.append(str(requirement))
    return "".join(f"{line}\n" for line in sorted(set(kept)))


def record_pins(workdir: Path, wheel: Path | None, git_commit: str | None) -> None:
    """Write the fetched release's pins beside its tree: its wheel's Requires-Dist, or its
    tag's python/pyproject.toml (`git_commit` in the fetch's bare repository). A tag
    without one gets no pins file, and its rows then cannot run."""
    text: str | None = None
    released: datetime.datetime | None = None
    if wheel is not None:
        with zipfile.ZipFile(wheel) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            metadata = email.message_from_bytes(archive.read(name))
        text = normalized(metadata.get_all("Requires-Dist") or [])
        released = gateenv.wheel_time(wheel)
    elif git_commit is not None:
        git = ["git", "--git-dir", str(fetched_repository(workdir))]
        shown = subprocess.run(
            [*git, "show", f"{git_commit}:python/pyproject.toml"], capture_output=True, check=False
        )
        if shown.returncode == 0:
            text = normalized(_pyproject_dependencies(shown.stdout.decode("utf-8")))
        dated = subprocess.run(
            [*git, "show", "-s", "--format=%cI", git_commit], capture_output=True, check=False
        )
        if dated.returncode == 0:
            released = datetime.datetime.fromisoformat(dated.stdout.decode().strip())
    if text is not None:
        (workdir / PINS_FILE).write_text(text, encoding="utf-8")
    if released is not None:
        (workdir / RELEASED_FILE).write_text(f"{released.isoformat()}\n", encoding="utf-8")


def _pyproject_dependencies(text: str) -> list[str]:
    return list(tomllib.loads(text).get("project", {}).get("dependencies", []))


def installed_pins(venv: Path) -> str | None:
    """The pins of the sglang installed in `venv` (its dist-info's Requires-Dist)."""
    found = sorted(venv.glob("lib/python3*/site-packages/sglang-*.dist-info/METADATA"))
    if not found:
        return None
    metadata = email.message_from_bytes(found[-1].read_bytes())
    return normalized(metadata.get_all("Requires-Dist") or [])


def _recorded_pins(venv: Path) -> str | None:
    """A venv installed by this module records the pins it was made for."""
    pins = venv / "sm120-gate-pins.txt"
    return pins.read_text(encoding="utf-8") if pins.is_file() else installed_pins(venv)


def find(
    fork_root: Path, version: str, release_dir: Path, say: Callable[[str], None] = print
) -> DecisionEnv:
    """The venv that decides sglang `version`'s rows (fetched into `release_dir`),
    installed when none has its pins and installing is allowed; NoDecisionEnv else."""
    override = os.environ.get(OVERRIDE_VARIABLE)
    if override:
        python = Path(override) / "bin" / "python"
        if not python.exists():
            raise NoDecisionEnv(f"{OVERRIDE_VARIABLE}={override} holds no bin/python")
        return DecisionEnv(python, f"{override} ({OVERRIDE_VARIABLE}, whatever its pins)")
    pins_file = release_dir / PINS_FILE
    if not pins_file.is_file():
        raise NoDecisionEnv(
            f"sglang {version} declares no pins where the rebase was given it (no "
            "python/pyproject.toml at its tag, no wheel metadata), so no environment can "
            "be chosen to run its rows in"
        )
    pins = pins_file.read_text(encoding="utf-8")
    own = gateenv.locate(fork_root).venv
    candidates = [own, *sorted(gateenv.cache_dir().glob("gate-env-*"))]
    for venv in dict.fromkeys(candidates):
        if (venv / "bin" / "python").exists() and _recorded_pins(venv) == pins:
            why = f"{venv} (the same pins as {version}{_overridden(venv)})"
            return DecisionEnv(venv / "bin" / "python", why)
    released_file = release_dir / RELEASED_FILE
    released = None
    if released_file.is_file():
        released = datetime.datetime.fromisoformat(released_file.read_text().strip())
    return _install(fork_root, version, (pins, released), say)


def _overridden(venv: Path) -> str:
    """The pins a venv's install overrode, as the verdicts name them."""
    said = venv / uvinstall.OVERRIDES_FILE
    lines = said.read_text(encoding="utf-8").splitlines() if said.is_file() else []
    return "".join(f"; {line}" for line in lines if line)


def _install(
    fork_root: Path,
    version: str,
    release: tuple[str, datetime.datetime | None],
    say: Callable[[str], None],
) -> DecisionEnv:
    pins, released = release
    venv = gateenv.cache_dir() / f"gate-env-{version}"
    allowed = os.environ.get(INSTALL_VARIABLE, "").strip()
    if allowed.lower() == "no" or ("." in allowed and version not in allowed.split(",")):
        raise NoDecisionEnv(
            f"no gate environment has sglang {version}'s pins and {INSTALL_VARIABLE}="
            f"{allowed} forbids installing one into {venv}"
        )
    tool = gateenv.locate(fork_root).requirements[1:]  # pytest and the tool's own
    env = gateenv.GateEnv(venv, (*pins.splitlines(), *tool), released, tool)
    say(f"installing a gate environment with sglang {version}'s pins into {venv}")
    try:
        with Progress("gate environment", live=False) as shown:
            gateenv.install(env, shown)
    except FatalError as error:
        why = f"its pins could not be installed into {venv}: {error.message}"
        raise NoDecisionEnv(why) from error
    (venv / "sm120-gate-pins.txt").write_text(pins, encoding="utf-8")
    return DecisionEnv(env.python, f"{venv} (installed for {version}'s pins{_overridden(venv)})")
