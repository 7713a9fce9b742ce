"""Writes that never leave a half-written file behind, and swaps of a file or a
directory into place by renames that can be undone; and `CacheDir`, results kept
under the user's cache directory by content key, written the same way.

Temporary files are created with mode 0666 filtered by the umask, as `open()`
creates a normal file, not 0600 as `tempfile.mkstemp` does: what is renamed
into place (wheels in dist/, reports) must be readable by whoever may read a
file this user writes, e.g. another user installing dist/ in a container.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_NORMAL_FILE = 0o666  # the kernel applies the umask, as for open(path, "w")


def create_temporary(directory: Path, name: str, suffix: str = "") -> tuple[int, Path]:
    """A new file `.<name>.<random><suffix>` in `directory`, opened for writing: (fd, path)."""
    directory.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        path = directory / f".{name}.{secrets.token_hex(6)}{suffix}"
        try:
            return os.open(path, flags, _NORMAL_FILE), path
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, then rename it into place."""
    fd, tmp = create_temporary(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_many(files: Mapping[Path, bytes]) -> None:
    """Stage every file first, then rename them all: a failure while staging writes nothing."""
    staged: list[tuple[Path, Path]] = []
    try:
        for path, data in files.items():
            fd, tmp = create_temporary(path.parent, path.name)
            staged.append((tmp, path))
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, path in staged:
        tmp.replace(path)


def remove(path: Path) -> None:
    """Remove a file, a link or a whole directory; nothing there is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def swap_in(new: Path, target: Path, old: Path) -> None:
    """Put `new` (a file or a directory) at `target` by two renames, moving what is
    there to `old` first; all three on one file system, `old` not yet there.

    Resumable: where `old` exists, the first rename happened already."""
    if not old.exists() and (target.exists() or target.is_symlink()):
        target.rename(old)
    new.rename(target)


def swap_back(new: Path, target: Path, old: Path, existed: bool) -> None:
    """Undo `swap_in(new, target, old)`, however far it got (if it started at all):
    `target` holds what it held before, or nothing where nothing (`existed`) was
    there; `new` is removed."""
    if old.exists():
        remove(target)
        old.rename(target)
    elif not existed and not new.exists():
        remove(target)  # what the swap put where nothing was
    remove(new)


class TreeCopy:
    """`source` copied to `dest` (which must not exist), links kept as links, in the
    background: the caller works meanwhile, then `wait()`s (or `cancel()`s).

    GNU `cp -a --reflink=auto` copies in the kernel (a reflink where the file
    system shares blocks, else copy_file_range): about twice as fast as
    `shutil.copytree`'s Python loop over 5700 files. Elsewhere, that loop, in `wait`.
    """

    def __init__(self, source: Path, dest: Path) -> None:
        self.source, self.dest = source, dest
        cp = shutil.which("cp")
        self._process: subprocess.Popen[bytes] | None = None
        if cp is not None and sys.platform.startswith("linux"):
            argv = [cp, "-a", "--reflink=auto", "--", str(source), str(dest)]
            self._process = subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )

    def wait(self) -> None:
        if self._process is not None and self._process.wait() == 0:
            return
        shutil.rmtree(self.dest, ignore_errors=True)  # not GNU cp, or it failed: the slow way
        shutil.copytree(self.source, self.dest, symlinks=True)

    def cancel(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def copy_tree(source: Path, dest: Path) -> None:
    """`source` copied to `dest` (which must not exist), links kept (see `TreeCopy`)."""
    TreeCopy(source, dest).wait()


# ---- CacheDir: a directory of results named by content keys, in the user cache.
#
# The gate scan (gates/scancache.py) and the intents' proofs (intent/proofcache.py)
# keep work this way: the key covers everything the result depends on (the code
# that made it and the bytes it read), so an entry is never stale, only unused.
#
# Entries are written to a temporary file and renamed into place, so concurrent
# writers of one key leave one whole entry. Each entry carries the SHA-256 of its
# payload: one that does not match is a miss, and is replaced. The oldest entries
# beyond `keep` are removed when one is written. A cache that cannot be read or
# written is no error: the work is done again.


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
