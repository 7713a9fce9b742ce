"""The gate-scan cache (issue 20): a tree scanned before is answered from the cache,
any changed byte or scanner source is another key, and a damaged entry is a miss."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sm120fork.gates import scancache
from sm120fork.gates.scan import list_files, package_dir, scan_tree

GATED = """\
import torch


def pick():
    if torch.cuda.get_device_capability()[0] >= 10:
        return "fast"
    return "slow"
"""


@pytest.fixture(autouse=True)
def _cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SM120FORK_GATE_SCAN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _tree(root: Path, text: str = GATED) -> Path:
    package = root / "python" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pick.py").write_text(text)
    return root


def _entries() -> list[Path]:
    return sorted(scancache.directory().glob("*.pickle"))


def test_a_second_scan_of_the_same_content_is_the_cached_inventory(tmp_path: Path) -> None:
    first = scan_tree(_tree(tmp_path / "a"))
    assert first.gates and len(_entries()) == 1
    again = scan_tree(_tree(tmp_path / "b"))  # another directory, the same bytes
    assert again.root == str(tmp_path / "b")
    assert again.gates == first.gates and len(_entries()) == 1


def test_a_changed_byte_is_another_key(tmp_path: Path) -> None:
    scan_tree(_tree(tmp_path / "a"))
    changed = scan_tree(_tree(tmp_path / "b", GATED.replace(">= 10", ">= 12")))
    assert len(_entries()) == 2
    assert "12" in changed.gates[0].condition


def test_the_key_covers_the_scanner_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = list_files(package_dir(_tree(tmp_path / "a")))
    before = scancache.tree_key(files)
    monkeypatch.setattr(scancache, "scanner_version", lambda: "another scanner")
    assert scancache.tree_key(files) != before


@pytest.mark.parametrize(
    "damage",
    [b"", b"garbage", scancache._MAGIC + b"0" * 64 + b"\nnot a pickle"],
    ids=["empty", "garbage", "bad-checksum"],
)
def test_a_damaged_entry_is_a_miss_and_is_replaced(tmp_path: Path, damage: bytes) -> None:
    root = _tree(tmp_path / "a")
    first = scan_tree(root)
    (entry,) = _entries()
    entry.write_bytes(damage)
    assert scancache.load(entry.stem) is None
    assert scan_tree(root).gates == first.gates
    assert scancache.load(entry.stem) is not None


def test_concurrent_writers_leave_one_whole_entry(tmp_path: Path) -> None:
    root = _tree(tmp_path / "a")
    inventory = scan_tree(root)
    (entry,) = _entries()
    entry.unlink()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: scancache.store(entry.stem, inventory), range(16)))
    assert _entries() == [entry]
    assert not list(scancache.directory().glob("*.tmp"))
    loaded = scancache.load(entry.stem)
    assert loaded is not None and loaded.gates == inventory.gates


def test_an_unwritable_cache_is_no_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert scan_tree(_tree(tmp_path / "a")).gates
