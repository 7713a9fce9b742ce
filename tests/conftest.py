"""Shared fixtures. Keep each helper's fixtures under its own heading."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import stat
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from hermetic import SEAL, Seal, git

# The architecture-gate suite runs in its own environment (torch + CUDA wheels):
# `nox -s gate_tests`, with --confcutdir=tests/gates so that this file is not read
# there. A plain `pytest` of the tool's tests leaves it out here, on purpose.
collect_ignore = ["gates"]

# --- the seal from the user's setup (see hermetic.py), for the whole session ---


@pytest.fixture(scope="session", autouse=True)
def hermetic_seal() -> Iterator[Seal]:
    """No test sees the user's HOME, git config or GIT_* variables: the tool's own git
    and every CLI subprocess inherit the seal from os.environ."""
    with pytest.MonkeyPatch.context() as patch:
        for name in [name for name in os.environ if name.startswith("GIT_")]:
            patch.delenv(name)
        patch.delenv("GITHUB_OUTPUT", raising=False)  # the tool writes its outcome there
        for name, value in SEAL.variables().items():
            patch.setenv(name, value)
        yield SEAL


@pytest.fixture
def git_env(hermetic_seal: Seal) -> dict[str, str]:
    """The sealed git environment (already in force for the session), for tests that ask."""
    return dict(hermetic_seal.variables())


# --- tests marked `network`: run where pip reaches the package index ---


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--network",
        choices=("auto", "yes", "no"),
        default="auto",
        help="tests marked network (the package index through pip): auto runs them when "
        "pip can list sglang's releases, yes always (an unreachable index fails them), no never",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("network")]
    mode = config.getoption("--network")
    if not marked or mode == "yes":
        return
    reason = "--network=no" if mode == "no" else _index_unreachable()
    for item in marked if reason else ():
        item.add_marker(pytest.mark.skip(reason=f"needs the package index: {reason}"))


def _index_unreachable() -> str | None:
    """Why pip cannot list sglang's releases here (one line), or None when it can."""
    command = [sys.executable, "-m", "pip", "index", "versions", "sglang"]
    command += ["--retries", "0", "--timeout", "15"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode == 0 and "Available versions:" in result.stdout:
        return None
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    return (errors or [f"`pip index versions sglang` exited {result.returncode}"])[-1]


# --- synthetic upstream repositories (upstream import tests) ---

UPSTREAM_LICENSE = "Apache License\nVersion 2.0, January 2004\n(test copy)\n"

UpstreamFiles = Mapping[str, str | bytes | None]
MakeUpstreamRepo = Callable[[Path, Mapping[str, UpstreamFiles]], Path]


def _make_upstream_git_repo(tmp_path: Path, versions: Mapping[str, UpstreamFiles]) -> Path:
    """A repo at tmp_path/upstream with one commit and annotated tag per entry of
    `versions` (tag -> {path: content}), in order. Each commit is a snapshot of
    exactly the given files plus a default LICENSE (map "LICENSE" to None to
    leave it out)."""
    root = tmp_path / "upstream"
    root.mkdir()
    git("init", "-q", ".", cwd=root)
    for tag, files in versions.items():
        git("rm", "-r", "-q", "--ignore-unmatch", ".", cwd=root)
        snapshot: dict[str, str | bytes | None] = {"LICENSE": UPSTREAM_LICENSE, **files}
        for path, content in snapshot.items():
            if content is None:
                continue
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            data = content.encode("utf-8") if isinstance(content, str) else content
            target.write_bytes(data)
        git("add", "-A", ".", cwd=root)
        git("commit", "-q", "--allow-empty", "-m", f"release {tag}", cwd=root)
        git("tag", "-a", "-m", f"sglang {tag}", tag, cwd=root)
    return root


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path under `root` with its bytes (files) or link target: to prove no change."""
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        key = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[key] = "-> " + str(path.readlink())
        elif path.is_file():
            found[key] = path.read_bytes()
        else:
            found[key] = "dir"
    return found


@pytest.fixture
def make_upstream_git_repo() -> MakeUpstreamRepo:
    """`make_upstream_git_repo(tmp_path, {"v0.5.9": {"python/sglang/x.py": "..."}})`."""
    return _make_upstream_git_repo


# --- synthetic release artifacts (upstream import tests) ---


def record_line(name: str, data: bytes) -> str:
    """A wheel RECORD row for `name` holding `data`."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def make_wheel(
    path: Path,
    files: Mapping[str, bytes],
    *,
    record: str | None = None,
    symlink: str | None = None,
) -> Path:
    """A wheel with `files` and a correct RECORD (in the one *.dist-info among
    `files`) unless `record` replaces it; `symlink` adds a symlink member."""
    dist_info = next(n.split("/")[0] for n in files if n.split("/")[0].endswith(".dist-info"))
    if record is None:
        record = "".join(record_line(n, d) for n, d in files.items())
        record += f"{dist_info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        if symlink is not None:
            info = zipfile.ZipInfo(symlink)
            info.create_system = 3
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            archive.writestr(info, "/etc/passwd")
        archive.writestr(f"{dist_info}/RECORD", record)
    return path


def make_sdist(path: Path, files: Mapping[str, bytes]) -> Path:
    """A gzipped tar sdist holding `files` (regular files only)."""
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            archive.addfile(info, io.BytesIO(data))
    return path
