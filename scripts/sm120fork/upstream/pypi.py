"""Upstream releases on the package index, through pip and pip's configuration.

No index host is written anywhere in the project: pip lists versions and
downloads files from whatever index this machine configures.
"""

from __future__ import annotations

import hashlib
import platform as _platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import parse_wheel_filename

from sm120fork.errors import FatalError

PROJECT = "sglang"
_NO_MATCH = "No matching distribution found"


def pip(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run this interpreter's pip; its configuration decides the index."""
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False
    )


def available_versions() -> tuple[str, ...]:
    """The versions of sglang pip offers this interpreter, as pip spells them.

    Only versions with a file for this interpreter: `upstream.fetch.available_versions`
    completes the list from the index's own pages."""
    result = pip(["index", "versions", PROJECT])
    match = re.search(r"^Available versions: (.*)$", result.stdout, re.MULTILINE)
    if match is None:  # `pip index` is experimental: fall back to pip's resolver error text
        with tempfile.TemporaryDirectory() as scratch:
            result = pip(["download", "--no-deps", "-d", scratch, f"{PROJECT}==0.0.0"])
        match = re.search(r"\(from versions: ([^)]*)\)", result.stderr)
    if match is None:
        raise FatalError(
            f"cannot list {PROJECT} releases on the package index ({pip_error(result)}); "
            "check pip's index configuration and the network"
        )
    return tuple(v.strip() for v in match.group(1).split(",") if v.strip() not in ("", "none"))


def pip_error(result: subprocess.CompletedProcess[str]) -> str:
    """pip's last error line, for a one-line message."""
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or [f"exit {result.returncode}"])[-1]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(version: str, workdir: Path, *, target: list[str] | None = None) -> Path:
    """The wheel pip picks for this interpreter (or for `target`'s pip tag options)."""
    args = ["--only-binary=:all:", *(target or [])]
    return _pip_download(args, f"{PROJECT}=={version}", workdir)


def download_sdist(version: str, workdir: Path) -> Path | None:
    """The sdist through pip, None when the release has none.

    Only the sglang requirement is built from source (`--no-binary sglang`): a
    global `:all:` would also refuse wheels of build dependencies.
    """
    try:
        return _pip_download(["--no-binary", PROJECT], f"{PROJECT}=={version}", workdir)
    except NoMatchingFile:
        return None


class NoMatchingFile(FatalError):
    """pip found no file of the requested kind (wheel for this interpreter, sdist)."""


def _pip_download(options: list[str], requirement: str, workdir: Path) -> Path:
    # A fresh directory per download: pip reuses files already in -d, and the
    # one new file there is the one pip chose.
    dest = Path(tempfile.mkdtemp(dir=workdir))
    result = pip(["download", "--no-deps", *options, "-d", str(dest), requirement])
    files = [p for p in dest.iterdir() if p.is_file()]
    if result.returncode != 0 or len(files) != 1:
        shutil.rmtree(dest, ignore_errors=True)
        message = f"pip could not download {requirement} {' '.join(options)} ({pip_error(result)})"
        if _NO_MATCH in result.stderr:
            raise NoMatchingFile(message)
        raise FatalError(f"{message}; check pip's index configuration and the network")
    return files[0]


def target_options(
    python_tag: str | None, platform: str | None, abi: str | None = None
) -> list[str]:
    """pip's --python-version/--implementation/--abi/--platform for a wheel tag."""
    options: list[str] = []
    if python_tag is not None:
        match = re.fullmatch(r"(cp|py|pp)(\d)(\d*)", python_tag)
        if match is None:
            raise FatalError(f"python tag {python_tag!r} is not like cp312 or py3; fix the tag")
        implementation, major, minor = match.groups()
        options += ["--python-version", f"{major}.{minor}" if minor else major]
        options += ["--implementation", implementation]
        abi = abi or (python_tag if implementation == "cp" and minor else None)
    if abi is not None and abi != "none":
        options += ["--abi", abi]
    if platform is not None and platform != "any":
        options += ["--platform", platform]
    return options


def fallback_wheel(names: list[str]) -> list[str] | None:
    """pip options that select one of the wheels `names` when none fits this
    interpreter: this machine's architecture first, then the newest CPython."""
    tags = {n: min(parse_wheel_filename(n)[3], key=str) for n in names if n.endswith(".whl")}
    if not tags:
        return None

    def preference(name: str) -> tuple[bool, int]:
        digits = re.sub(r"\D", "", tags[name].interpreter)
        return _platform.machine() in tags[name].platform, int(digits or 0)

    tag = tags[max(sorted(tags), key=preference)]
    return target_options(tag.interpreter, tag.platform, tag.abi)
