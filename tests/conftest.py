"""Shared fixtures. Keep each helper's fixtures under its own heading."""

from __future__ import annotations

import base64
import hashlib
import io
import stat
import tarfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from sm120fork import gitcmd

# The architecture-gate suite runs in its own environment (torch + CUDA wheels):
# `nox -s gate_tests`, with --confcutdir=tests/gates so that this file is not read
# there. A plain `pytest` of the tool's tests leaves it out here, on purpose.
collect_ignore = ["gates"]

# --- hermetic git and synthetic upstream repositories (upstream import tests) ---

GIT_DATE = "2026-01-02T03:04:05+00:00"
UPSTREAM_LICENSE = "Apache License\nVersion 2.0, January 2004\n(test copy)\n"

UpstreamFiles = Mapping[str, str | bytes | None]
MakeUpstreamRepo = Callable[[Path, Mapping[str, UpstreamFiles]], Path]


@pytest.fixture
def git_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Git that reads no user or system config, with fixed identities and dates."""
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "Upstream Author",
        "GIT_AUTHOR_EMAIL": "author@example.com",
        "GIT_AUTHOR_DATE": GIT_DATE,
        "GIT_COMMITTER_NAME": "Upstream Committer",
        "GIT_COMMITTER_EMAIL": "committer@example.com",
        "GIT_COMMITTER_DATE": GIT_DATE,
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "init.defaultBranch",
        "GIT_CONFIG_VALUE_0": "main",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("GIT_DIR", raising=False)
    monkeypatch.delenv("GIT_WORK_TREE", raising=False)
    return env


def _make_upstream_git_repo(tmp_path: Path, versions: Mapping[str, UpstreamFiles]) -> Path:
    """A repo at tmp_path/upstream with one commit and annotated tag per entry of
    `versions` (tag -> {path: content}), in order. Each commit is a snapshot of
    exactly the given files plus a default LICENSE (map "LICENSE" to None to
    leave it out)."""
    root = tmp_path / "upstream"
    root.mkdir()
    gitcmd.run(["init", "-q", "."], root)
    for tag, files in versions.items():
        gitcmd.run(["rm", "-r", "-q", "--ignore-unmatch", "."], root)
        snapshot: dict[str, str | bytes | None] = {"LICENSE": UPSTREAM_LICENSE, **files}
        for path, content in snapshot.items():
            if content is None:
                continue
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            data = content.encode("utf-8") if isinstance(content, str) else content
            target.write_bytes(data)
        gitcmd.run(["add", "-A", "."], root)
        gitcmd.run(["commit", "-q", "--allow-empty", "-m", f"release {tag}"], root)
        gitcmd.run(["tag", "-a", "-m", f"sglang {tag}", tag], root)
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
def make_upstream_git_repo(git_env: dict[str, str]) -> MakeUpstreamRepo:
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
