"""Atomic writes leave normal files: the umask decides their mode, as for open();
swaps into place by renames, and their undoing however far they got."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from sm120fork.fsutil import atomic_write, atomic_write_many, remove, swap_back, swap_in


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


def _tree(root: Path) -> dict[str, str]:
    """Every file under `root` (or `root` itself) with its text."""
    if root.is_file():
        return {".": root.read_text()}
    return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}


def _make(path: Path, kind: str, text: str) -> None:
    if kind == "file":
        path.write_text(text)
    else:
        (path / "sub").mkdir(parents=True)
        (path / "sub" / "a.txt").write_text(text)


@pytest.mark.parametrize("kind", ["file", "dir"])
@pytest.mark.parametrize("existed", [True, False])
def test_swap_in_puts_new_in_place_and_keeps_the_old(
    tmp_path: Path, kind: str, existed: bool
) -> None:
    new, target, old = tmp_path / "new", tmp_path / "target", tmp_path / "old"
    _make(new, kind, "new")
    if existed:
        _make(target, kind, "old")
    swap_in(new, target, old)
    assert _tree(target) == ({".": "new"} if kind == "file" else {"sub/a.txt": "new"})
    assert not new.exists() and old.exists() is existed


@pytest.mark.parametrize("kind", ["file", "dir"])
@pytest.mark.parametrize("existed", [True, False])
@pytest.mark.parametrize("renames", [0, 1, 2])  # how far the swap got before it stopped
def test_swap_back_undoes_a_swap_however_far_it_got(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, existed: bool, renames: int
) -> None:
    new, target, old = tmp_path / "new", tmp_path / "target", tmp_path / "old"
    _make(new, kind, "new")
    if existed:
        _make(target, kind, "old")
    before = _tree(target) if existed else None
    real_rename, done = Path.rename, list[object]()

    def stopping_rename(self: Path, to: str | os.PathLike[str]) -> Path:
        if len(done) == renames:
            raise OSError("stopped")
        done.append(to)
        return real_rename(self, to)

    monkeypatch.setattr(Path, "rename", stopping_rename)
    with suppress(OSError):
        swap_in(new, target, old)
    monkeypatch.setattr(Path, "rename", real_rename)
    swap_back(new, target, old, existed)
    assert (_tree(target) if target.exists() else None) == before
    assert not new.exists() and not old.exists()


def test_swap_in_resumes_after_the_first_rename(tmp_path: Path) -> None:
    new, target, old = tmp_path / "new", tmp_path / "target", tmp_path / "old"
    new.write_text("new")
    old.write_text("old")  # the target was moved aside already
    swap_in(new, target, old)
    assert (target.read_text(), old.read_text()) == ("new", "old")


def test_remove_takes_files_links_and_trees(tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "d")
    for name in ("link", "d", "f", "absent"):
        remove(tmp_path / name)
    assert list(tmp_path.iterdir()) == []
