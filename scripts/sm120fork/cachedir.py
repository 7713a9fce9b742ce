"""A directory of results named by content keys, under the user's cache directory.

The gate scan (gates/scancache.py) and the intents' proofs (intent/proofcache.py)
keep work this way: the key covers everything the result depends on (the code
that made it and the bytes it read), so an entry is never stale, only unused.

Entries are written to a temporary file and renamed into place, so concurrent
writers of one key leave one whole entry. Each entry carries the SHA-256 of its
payload: one that does not match is a miss, and is replaced. The oldest entries
beyond `keep` are removed when one is written. A cache that cannot be read or
written is no error: the work is done again.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from sm120fork.fsutil import create_temporary


@dataclass(frozen=True)
class CacheDir:
    name: str  # the folder under $XDG_CACHE_HOME/sglang-sm120/
    variable: str  # an environment variable naming another folder (the test suite's seal)
    magic: bytes  # the first line of every entry: its format
    suffix: str  # of an entry's file name
    keep: int  # entries

    def directory(self) -> Path:
        if chosen := os.environ.get(self.variable):
            return Path(chosen)
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "sglang-sm120" / self.name

    def load(self, key: str) -> bytes | None:
        """The payload kept under `key`; None when there is none, or it is damaged."""
        try:
            raw = (self.directory() / f"{key}{self.suffix}").read_bytes()
        except OSError:
            return None
        head, _, rest = raw.partition(b"\n")
        checksum, _, payload = rest.partition(b"\n")
        if head + b"\n" != self.magic or checksum != hashlib.sha256(payload).hexdigest().encode():
            return None
        return payload

    def store(self, key: str, payload: bytes) -> None:
        folder = self.directory()
        checksum = hashlib.sha256(payload).hexdigest().encode()
        try:
            fd, temp = create_temporary(folder, key, ".tmp")
        except OSError:
            return
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(self.magic + checksum + b"\n" + payload)
            temp.replace(folder / f"{key}{self.suffix}")
            self._prune(folder)
        except OSError:
            temp.unlink(missing_ok=True)

    def _prune(self, folder: Path) -> None:
        entries = []
        for entry in folder.glob(f"*{self.suffix}"):
            try:
                entries.append((entry.stat().st_mtime, entry))
            except OSError:  # removed by another writer meanwhile
                continue
        for _, entry in sorted(entries, reverse=True)[self.keep :]:
            entry.unlink(missing_ok=True)
