"""Atomic writes leave normal files: the umask decides their mode, as for open()."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sm120fork.fsutil import atomic_write, atomic_write_many


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_atomic_write_gives_the_mode_the_umask_gives(
    tmp_path: Path, mask: int, expected: int
) -> None:
    with umask(mask):
        atomic_write(tmp_path / "out" / "report.json", b"{}\n")
        atomic_write_many({tmp_path / "a.md": b"a\n", tmp_path / "b.md": b"b\n"})
        (tmp_path / "plain").write_bytes(b"")
    assert mode(tmp_path / "plain") == expected
    assert [mode(tmp_path / name) for name in ("out/report.json", "a.md", "b.md")] == [expected] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.md", "b.md", "out", "plain"]


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_bytes(b"old\n")
    target.chmod(0o600)
    with umask(0o022):
        atomic_write(target, b"new\n")
    assert target.read_bytes() == b"new\n"
    assert mode(target) == 0o644  # a new file, not the old one's mode
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_failed_stage_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file where a directory is needed\n")
    with pytest.raises(OSError):
        atomic_write_many({tmp_path / "a.md": b"a\n", tmp_path / "blocker" / "b.md": b"b\n"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]
