"""Installing a gate venv with uv: one cache, hard links, exact pins as of a date.

Every gate venv (the fork's own, and each release's decision environment) is made
with `uv venv` and filled with `uv pip install --link-mode hardlink` from one uv
cache beside the venvs (`<env root>/uv`, the same filesystem, so a wheel that
nineteen releases pin lies on disk once). The resolution is as of the release:
`--exclude-newer` its time plus a day (the release's own uploads and the pins
published with it follow its build or tag by hours), so a floating requirement
resolves as it did for the release, not as it does today.

uv does not read pip's configuration: the constraint files this machine gives pip
(`constraint` in pip.conf, `$PIP_CONSTRAINT`) are passed to uv explicitly. A pin
that cannot be installed here is overridden only where it is listed below, with
the reason; the venv records each override (`sm120-gate-overrides.txt`) and the
decision environment names it in every verdict it gives.
"""

from __future__ import annotations

import configparser
import datetime
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

OVERRIDES_FILE = "sm120-gate-overrides.txt"
AS_OF_FILE = "sm120-gate-as-of.txt"
MARGIN = datetime.timedelta(days=1)
_SYSTEM_CONFIG = Path("/etc/pip.conf")


@dataclass(frozen=True)
class Override:
    pinned: str  # the release's requirement, as packaging spells it
    by: str  # what is installed instead
    uploaded: str  # the replacement's upload time: exempt from --exclude-newer
    why: str

    def said(self) -> str:
        return f"{self.pinned} overridden to {self.by} ({self.why})"


# sglang 0.5.18-0.5.22 pin cuda-tile==1.6.0rc5, an sdist whose build downloads from a
# host this machine cannot reach; no sglang source of those releases imports cuda.tile.
KNOWN = (
    Override(
        "cuda-tile==1.6.0rc5",
        "cuda-tile==1.6.0",
        "2026-09-11T00:00:00Z",
        "1.6.0rc5 is a stub sdist that downloads from an unreachable host; "
        "no sglang source imports cuda.tile",
    ),
)


def uv_binary() -> str:
    """The uv the tool depends on (its wheel's binary), else the one on PATH."""
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found is None:
            raise FileNotFoundError("uv is not installed: `pip install uv`") from None
        return found


def pip_constraints() -> list[Path]:
    """The constraint files pip would apply here: `constraint` in its configuration
    files ([global] or [install]; site, then user, then $PIP_CONFIG_FILE) and
    $PIP_CONSTRAINT; the last setting wins, as in pip."""
    dirs = os.environ.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    files = [Path(d) / "pip" / "pip.conf" for d in dirs.split(":")]
    files += [_SYSTEM_CONFIG, Path.home() / ".pip/pip.conf"]
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    files.append(config_home / "pip" / "pip.conf")
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    value = ""
    for file in files:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(file)
        except configparser.Error:
            continue
        for section in ("global", "install"):
            value = parser.get(section, "constraint", fallback=value)
    value = os.environ.get("PIP_CONSTRAINT", value)
    return [Path(v) for v in value.split() if Path(v).is_file()]


def overrides_for(requirements: Sequence[str]) -> list[Override]:
    """The known overrides whose pinned requirement is among `requirements`."""
    spelled = set()
    for text in requirements:
        try:
            spelled.add(_key(Requirement(text)))
        except InvalidRequirement:
            continue
    return [o for o in KNOWN if _key(Requirement(o.pinned)) in spelled]


def _key(requirement: Requirement) -> tuple[str, str]:
    return canonicalize_name(requirement.name), str(requirement.specifier)


def as_of(released: datetime.datetime) -> str:
    """The --exclude-newer of a release made at `released` (UTC)."""
    moment = released.astimezone(datetime.UTC) + MARGIN
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def commands(
    venv: Path,
    cache: Path,
    requirements: Sequence[str],
    as_of: tuple[str | None, Sequence[str]],
    workdir: Path,
) -> tuple[list[str], list[str]]:
    """`uv venv` and `uv pip install` of `requirements` into `venv` (the requirements and
    the overrides that apply to them written into `workdir`), with pip's constraints;
    `as_of`: the --exclude-newer, and the requirements exempt from it (the tool's own,
    whose floors may be younger than the release: resolved as of now)."""
    exclude_newer, exempt = as_of
    uv = uv_binary()
    common = ["--cache-dir", str(cache), "--no-config"]
    make = [uv, "venv", "--seed", "--python", sys.executable, *common, str(venv)]
    wanted = workdir / "requirements.txt"
    wanted.write_text("".join(f"{line}\n" for line in requirements))
    install = [uv, "pip", "install", *common, "--python", str(venv / "bin" / "python")]
    install += ["--link-mode", "hardlink", "-r", str(wanted)]
    for constraint in pip_constraints():
        install += ["--constraint", str(constraint)]
    overrides = overrides_for(requirements)
    if overrides:
        (workdir / "overrides.txt").write_text("".join(f"{o.by}\n" for o in overrides))
        install += ["--overrides", str(workdir / "overrides.txt")]
    if exclude_newer:
        install += ["--exclude-newer", exclude_newer]
        for override in overrides:  # the replacement is younger than the release
            name = Requirement(override.by).name
            install += ["--exclude-newer-package", f"{name}={override.uploaded}"]
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for text in exempt:
            install += ["--exclude-newer-package", f"{Requirement(text).name}={now}"]
    return make, install
