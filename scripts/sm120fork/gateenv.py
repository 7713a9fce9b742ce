"""The architecture-gate tests' environment: where it lives, and installing it.

    python -m sm120fork.gateenv [--root DIR]     (what `nox -s tests` runs first)
    python -m sm120fork.gateenv --release 0.5.10  (another release's, for a rebase)

Upstream's wheel with its pinned dependencies (torch+CUDA, sgl-kernel,
flashinfer, ... about 11 GB), pytest, and the tool's own dependencies, in a venv
outside the checkout keyed by the vendored version, so that fresh clones reuse
it: `$SM120_GATE_ENV`, else `$XDG_CACHE_HOME/sglang-sm120/gate-env-<version>`
(`~/.cache/...`). pip runs only when the requirements differ from the ones the
venv was last installed with. Its output goes to a log file beside the venv,
named at the end; the terminal shows one line per phase with counts.

`locate` is standard library only, for the noxfile; `install` uses `rich`.
Another release's environment (`for_release`, used by the rebase to run a patch's
gate rows on that release) is keyed by its pin set: a venv installed for a release
records the release's own requirements (its wheel's Requires-Dist) in
`sm120-gate-pins.txt`, and a release with the same pins reuses it (the tested tree
shadows the installed sglang, so only the dependencies matter).
"""

from __future__ import annotations

import argparse
import email
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.progress import Progress, elapsed

PREFIX = "gate environment"
_VERSION = re.compile(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]")
# The lines of pip's output that mark progress (everything goes to the log).
_COLLECTING = re.compile(r"^Collecting (\S+)")
_DOWNLOADING = re.compile(r"^\s*Downloading \S+ \((\d+(?:\.\d+)?) (kB|MB|GB)\)")
_INSTALLING = re.compile(r"^Installing collected packages: (.*)")
_INSTALLED = re.compile(r"^Successfully installed (.*)")
_UNITS = {"kB": 1e-3, "MB": 1.0, "GB": 1e3}


class GateEnvError(FatalError):
    """The environment could not be made; the message names the log."""


@dataclass(frozen=True)
class GateEnv:
    venv: Path
    requirements: tuple[str, ...]

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
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sglang-sm120"


def _requirements(root: Path, version: str) -> tuple[str, ...]:
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    # Upstream's wheel brings its own pins; the tool's deps: `sm120fork apply` builds
    # the patched tree inside the gate run, and the harness shows progress with rich.
    return (f"sglang=={version}", "pytest>=8", *project["dependencies"])


def locate(root: Path) -> GateEnv:
    """The gate environment for the checkout at `root` (nothing is created)."""
    version = vendored_version(root)
    default = cache_dir() / f"gate-env-{version}"
    venv = Path(os.environ.get("SM120_GATE_ENV") or default)
    return GateEnv(venv, _requirements(root, version))


def release_pins(version: str) -> str:
    """sglang `version`'s own requirements, one a line, sorted (its wheel's Requires-Dist
    without extras), read from the wheel pip downloads for this interpreter."""
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
    pins = [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    return "\n".join(sorted(pins)) + "\n"


def for_release(root: Path, version: str, pins: str | None = None) -> GateEnv:
    """The gate environment that serves sglang `version` (nothing is installed): its own
    venv if there is one, else a venv installed for a release with the same pins
    (`pins`: release_pins(version), read when needed), else a new one of its own."""
    own = GateEnv(cache_dir() / f"gate-env-{version}", _requirements(root, version))
    if own.python.exists():
        return own
    pins = release_pins(version) if pins is None else pins
    for venv in sorted(cache_dir().glob("gate-env-*")):
        other = GateEnv(venv, ())
        if other.pins.is_file() and other.pins.read_text() == pins and other.stamp.is_file():
            return GateEnv(venv, tuple(other.stamp.read_text().splitlines()))
    return own


def install(env: GateEnv, shown: Progress, pins: str | None = None) -> None:
    """Create the venv if needed and pip-install the requirements, phase by phase
    (`pins`: the release's own requirements, recorded for for_release)."""
    if not env.python.exists():
        shown.line(f"creating the venv {env.venv}")
        _run([sys.executable, "-m", "venv", str(env.venv)], env.log, shown, "venv")
    first = not env.stamp.is_file()
    size = "about 11 GB, first time: several minutes" if first else "changed requirements"
    shown.line(f"installing {len(env.requirements)} requirements into {env.venv} ({size})")
    pip = [str(env.python), "-m", "pip", "install", "--progress-bar", "off", *env.requirements]
    _run(pip, env.log, shown, "pip")
    env.stamp.write_text(env.wanted)
    if pins is not None:
        env.pins.write_text(pins)


def _run(command: Sequence[str], log: Path, shown: Progress, what: str) -> None:
    """Run `command`, its output appended to `log`, its phases on the terminal."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        phases = _Phases(shown)
        for line in proc.stdout:
            out.write(line)
            phases.see(line)
        code = proc.wait()
        phases.close()
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise GateEnvError(f"{what} exited {code}; its output is in {log}; the end:\n{tail}")


class _Phases:
    """pip's output as two phases, a line each when it ends: collecting (pip resolves
    and downloads together: packages seen, already there, files and MB downloaded),
    then installing (packages unpacked)."""

    def __init__(self, shown: Progress) -> None:
        self.shown = shown
        self.seen = self.present = self.downloads = 0
        self.megabytes = 0.0
        self.phase = "collecting"
        self.started = shown.seconds
        self.counter = shown.add("pip: collecting", None)

    def see(self, line: str) -> None:
        if _COLLECTING.match(line) or line.startswith("Requirement already satisfied"):
            self.seen += 1
            self.present += line.startswith("Requirement already satisfied")
            self.shown.update(self.counter, name=f"collecting: {self._collected()}")
        elif match := _DOWNLOADING.match(line):
            self.downloads += 1
            self.megabytes += float(match[1]) * _UNITS[match[2]]
            self.shown.update(self.counter, name=f"collecting: {self._collected()}")
        elif match := _INSTALLING.match(line):
            self._end(f"collected {self._collected()}")
            self.phase = "installing"
            count = len(match[1].split(", "))
            self.shown.update(self.counter, name=f"installing {count} packages (unpacking)")
        elif match := _INSTALLED.match(line):
            self._end(f"installed {len(match[1].split())} packages")
            self.phase = ""

    def _collected(self) -> str:
        return (
            f"{self.seen} packages ({self.present} already there), "
            f"{self.downloads} downloaded ({self.megabytes:,.0f} MB)"
        )

    def _end(self, what: str) -> None:
        now = self.shown.seconds
        self.shown.line(f"{what} in {elapsed(now - self.started)}")
        self.started = now

    def close(self) -> None:
        if self.phase == "collecting":
            self._end(f"collected {self._collected()}; nothing to install")
        self.shown.update(self.counter, name="pip: done")


def ensure(root: Path, release: str | None = None) -> GateEnv:
    """The gate environment of `root` (or of sglang `release`), installed or brought up
    to date."""
    pins = release_pins(release) if release else None
    env = for_release(root, release, pins) if release else locate(root)
    if env.current:
        return env
    with Progress(PREFIX) as shown:
        what = f"sglang {release}'s" if release else "the vendored sglang's"
        shown.line(f"installing {what} gate environment; pip's output goes to {env.log}")
        try:
            install(env, shown, pins)
        except GateEnvError:
            shown.line(f"failed after {elapsed(shown.seconds)}; pip's output: {env.log}")
            raise
        shown.line(f"ready in {elapsed(shown.seconds)}: {env.venv}; pip's output: {env.log}")
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
