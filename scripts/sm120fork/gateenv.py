"""The architecture-gate tests' environment: where it lives, and installing it.

    python -m sm120fork.gateenv [--root DIR]     (what `nox -s tests` runs first)
    python -m sm120fork.gateenv --release 0.5.10  (another release's, for a rebase)

Upstream's wheel with its pinned dependencies (torch+CUDA, sgl-kernel,
flashinfer, ... about 11 GB), pytest, and the tool's own dependencies, in a venv
outside the checkout keyed by the vendored version, so that fresh clones reuse
it: `$SM120_GATE_ENV`, else `<env root>/gate-env-<version>`, the env root being
`$SM120_ENV_ROOT`, else `$XDG_CACHE_HOME/sglang-sm120` (`~/.cache/...`). uv
installs it (rebase/uvinstall.py: one cache under the env root, hard links, resolved as
of the release's time, pip's constraints), and only when the requirements differ
from the ones the venv was last installed with. Its output goes to a log file
beside the venv, named at the end; the terminal shows uv's phase lines.

`locate` is standard library only, for the noxfile; `install` uses `rich`.
Another release's environment (`for_release`, used by the rebase to run a patch's
gate rows on that release) is keyed by its pin set: a venv installed for a release
records the release's own requirements (its wheel's Requires-Dist) in
`sm120-gate-pins.txt`, and a release with the same pins reuses it (the tested tree
shadows the installed sglang, so only the dependencies matter).
"""

from __future__ import annotations

import argparse
import datetime
import email
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.progress import Progress, elapsed

PREFIX = "gate environment"
_VERSION = re.compile(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]")
# The lines of uv's output that end a phase (everything goes to the log).
_PHASE = re.compile(r"^(Resolved|Prepared|Installed|Uninstalled|Audited|Using) ")


class GateEnvError(FatalError):
    """The environment could not be made; the message names the log."""


@dataclass(frozen=True)
class GateEnv:
    venv: Path
    requirements: tuple[str, ...]
    released: datetime.datetime | None = None  # resolve as of then (uvinstall.as_of)
    tool: tuple[str, ...] = ()  # of the requirements, the tool's own: resolved as of now

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def stamp(self) -> Path:
        """The requirements the venv was last installed with."""
        return self.venv / "sm120-gate-requirements.txt"

    @property
    def pins(self) -> Path:
        """The release's own requirements the venv was installed for (for_release)."""
        return self.venv / "sm120-gate-pins.txt"

    @property
    def log(self) -> Path:
        return self.venv.with_name(self.venv.name + "-install.log")

    @property
    def wanted(self) -> str:
        return "\n".join(self.requirements) + "\n"

    @property
    def current(self) -> bool:
        return (
            self.python.exists() and self.stamp.is_file() and self.stamp.read_text() == self.wanted
        )


def vendored_version(root: Path) -> str:
    lock = root / "vendor" / "sglang.lock"
    if lock.is_file():
        return str(tomllib.loads(lock.read_text())["version"])
    version_file = root / "vendor" / "sglang" / "python" / "sglang" / "_version.py"
    match = _VERSION.search(version_file.read_text()) if version_file.is_file() else None
    if not match:
        raise GateEnvError("cannot tell the vendored sglang version: no vendor/sglang.lock")
    return match.group(1)


def cache_dir() -> Path:
    """The env root: every gate venv and the uv cache they are installed from."""
    if os.environ.get("SM120_ENV_ROOT"):
        return Path(os.environ["SM120_ENV_ROOT"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sglang-sm120"


def _requirements(root: Path, version: str) -> tuple[str, ...]:
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    # Upstream's wheel brings its own pins; the tool's deps: `sm120fork apply` builds
    # the patched tree inside the gate run, and the harness shows progress with rich
    # (not uv: the gate run installs no environment).
    deps = [d for d in project["dependencies"] if not re.match(r"uv\b", d)]
    return (f"sglang=={version}", "pytest>=8", *deps)


def locate(root: Path) -> GateEnv:
    """The gate environment for the checkout at `root` (nothing is created)."""
    version = vendored_version(root)
    default = cache_dir() / f"gate-env-{version}"
    venv = Path(os.environ.get("SM120_GATE_ENV") or default)
    requirements = _requirements(root, version)
    return GateEnv(venv, requirements, tool=requirements[1:])


def release_pins(version: str) -> tuple[str, datetime.datetime]:
    """sglang `version`'s own requirements, one a line, sorted (its wheel's Requires-Dist
    without extras), and when it was built, read from the wheel pip downloads for this
    interpreter."""
    with tempfile.TemporaryDirectory(prefix="sm120-pins-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        command += ["--only-binary=:all:", f"sglang=={version}", "-d", tmp]
        ran = subprocess.run(command, capture_output=True, text=True, check=False)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if ran.returncode != 0 or not wheels:
            why = (ran.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise GateEnvError(f"cannot download sglang {version}'s wheel to read its pins: {why}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
            metadata = email.message_from_bytes(wheel.read(name))
        built = wheel_time(wheels[0])
    pins = [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    return "\n".join(sorted(pins)) + "\n", built


def wheel_time(wheel: Path) -> datetime.datetime:
    """When a wheel was built: its newest entry's time (as UTC; a build runner's clock),
    within the hour before the upload for sglang's releases."""
    with zipfile.ZipFile(wheel) as archive:
        newest = max(info.date_time for info in archive.infolist())
    return datetime.datetime(*newest, tzinfo=datetime.UTC)


def for_release(root: Path, version: str, pins: str | None = None) -> GateEnv:
    """The gate environment that serves sglang `version` (nothing is installed): its own
    venv if there is one, else a venv installed for a release with the same pins
    (`pins`: release_pins(version), read when needed), else a new one of its own."""
    requirements = _requirements(root, version)
    own = GateEnv(cache_dir() / f"gate-env-{version}", requirements, tool=requirements[1:])
    if own.python.exists():
        return own
    pins = release_pins(version)[0] if pins is None else pins
    for venv in sorted(cache_dir().glob("gate-env-*")):
        other = GateEnv(venv, ())
        if other.pins.is_file() and other.pins.read_text() == pins and other.stamp.is_file():
            return GateEnv(venv, tuple(other.stamp.read_text().splitlines()))
    return own


def install(env: GateEnv, shown: Progress, pins: str | None = None) -> None:
    """Create the venv if needed and uv-install the requirements (`pins`: the release's
    own requirements, recorded for for_release); the overrides made are recorded."""
    from sm120fork.rebase import uvinstall  # packaging: not for the noxfile's import

    overrides = uvinstall.overrides_for(env.requirements)
    exclude_newer = uvinstall.as_of(env.released) if env.released else None
    first = not env.stamp.is_file()
    size = "about 11 GB, first time: minutes" if first else "changed requirements"
    when = f", as of {exclude_newer}" if exclude_newer else ""
    shown.line(f"installing {len(env.requirements)} requirements into {env.venv} ({size}{when})")
    for override in overrides:
        shown.line(override.said())
    cache = cache_dir() / "uv"
    with tempfile.TemporaryDirectory(prefix="sm120-uv-") as tmp:
        try:
            make, fill = uvinstall.commands(
                env.venv, cache, env.requirements, (exclude_newer, env.tool), Path(tmp)
            )
        except FileNotFoundError as error:
            raise GateEnvError(str(error)) from error
        if not env.python.exists():
            _run(make, env.log, shown, "uv venv")
        _run(fill, env.log, shown, "uv pip install")
    env.stamp.write_text(env.wanted)
    said = "".join(f"{o.said()}\n" for o in overrides)
    (env.venv / uvinstall.OVERRIDES_FILE).write_text(said)
    (env.venv / uvinstall.AS_OF_FILE).write_text(f"{exclude_newer or ''}\n")
    if pins is not None:
        env.pins.write_text(pins)


def _run(command: Sequence[str], log: Path, shown: Progress, what: str) -> None:
    """Run `command`, its output appended to `log`, its phase lines on the terminal."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = shown.seconds
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                if _PHASE.match(line):
                    shown.line(f"{what}: {line.strip()}")
            code = proc.wait()
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise GateEnvError(f"{what} exited {code}; its output is in {log}; the end:\n{tail}")
    shown.line(f"{what} done in {elapsed(shown.seconds - started)}")


def ensure(root: Path, release: str | None = None) -> GateEnv:
    """The gate environment of `root` (or of sglang `release`), installed or brought up
    to date."""
    if release:
        pins, built = release_pins(release)
        env = replace(for_release(root, release, pins), released=built)
    else:
        pins, env = None, locate(root)
        if env.current:
            return env
        env = replace(env, released=release_pins(vendored_version(root))[1])
    if env.current:
        return env
    with Progress(PREFIX) as shown:
        what = f"sglang {release}'s" if release else "the vendored sglang's"
        shown.line(f"installing {what} gate environment; uv's output goes to {env.log}")
        try:
            install(env, shown, pins)
        except GateEnvError:
            shown.line(f"failed after {elapsed(shown.seconds)}; uv's output: {env.log}")
            raise
        shown.line(f"ready in {elapsed(shown.seconds)}: {env.venv}; uv's output: {env.log}")
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sm120fork.gateenv",
        description="Install or update the architecture-gate tests' environment.",
    )
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the fork's checkout")
    parser.add_argument("--release", help="another sglang release's environment (X.Y.Z)")
    args = parser.parse_args(argv)
    try:
        ensure(args.root.resolve(), args.release)
    except FatalError as error:
        print(f"{PREFIX}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
