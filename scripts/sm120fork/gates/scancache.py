"""Scans already made, kept by the content of the tree scanned.

A scan costs seconds of parsing; reading and hashing the same files costs a
tenth of that. So an inventory is kept under the user's cache directory
(`$XDG_CACHE_HOME/sglang-sm120/gate-scan/`, `~/.cache/...` without it), named
by a key over (the scanner's own source, the Python version, every file's
path and the SHA-1 of its content, git's blob id): a scanner change, another
Python or any changed byte is another key, so an entry is never stale.

Entries live in a `fsutil.CacheDir` (atomic writes, checksummed payloads, the
oldest pruned). The payload is a pickle: the directory is the user's own, as
trusted as the environment that runs the tool.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from functools import cache
from pathlib import Path

from sm120fork.fsutil import CacheDir
from sm120fork.gates.model import Inventory

_MAGIC = b"sm120fork-gate-scan 1\n"
_SCANNER = Path(__file__).resolve().parent  # the gates package: scan, evaluator, ...
# `$SM120FORK_GATE_SCAN_CACHE` (the test suite's seal keeps the user's), else the
# user's cache directory; 64 entries.
_ENTRIES = CacheDir("gate-scan", "SM120FORK_GATE_SCAN_CACHE", _MAGIC, ".pickle", 64)


def directory() -> Path:
    return _ENTRIES.directory()


@cache
def scanner_version() -> str:
    digest = hashlib.sha256(sys.version.encode())
    for path in sorted(_SCANNER.rglob("*.py")):
        digest.update(path.relative_to(_SCANNER).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _blob_id(path: str) -> bytes:
    with open(path, "rb") as handle:
        data = handle.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).digest()


def tree_key(files: list[tuple[str, str, int]]) -> str:
    """The key of a scan of `files` ((relative path, absolute path, size), sorted)."""
    digest = hashlib.sha256(scanner_version().encode())
    for rel, full, _ in files:
        digest.update(rel.encode("utf-8", "surrogateescape") + b"\0" + _blob_id(full))
    return digest.hexdigest()


def load(key: str) -> Inventory | None:
    payload = _ENTRIES.load(key)
    if payload is None:
        return None
    try:
        found = pickle.loads(payload)
    except Exception:  # an entry of a build whose classes moved: a miss
        return None
    return found if isinstance(found, Inventory) else None


def store(key: str, inventory: Inventory) -> None:
    """Keep `inventory` under `key`; a cache that cannot be written is no error."""
    _ENTRIES.store(key, pickle.dumps(inventory, protocol=pickle.HIGHEST_PROTOCOL))
