"""One side of a review (BASE or HEAD): the fork's inputs at that commit, read from git.

The series and its patches, every file under patches/ (for `check`), the gate
policy, the expectation table and the lock. A patch that is listed but has no
file, or cannot be parsed, is left out of `patches` and named in `unusable`:
the review goes on, and HEAD's `check` reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.patches.patchfile import PatchFile, PatchFileError, parse_patch
from sm120fork.patches.series import Series, parse_series
from sm120fork.review.revs import Rev, list_files, read_files, tree_id
from sm120fork.upstream import lock

PATCHES = "patches"
SERIES = "patches/series"
POLICY = "patches/gates.toml"
EXPECTATIONS = "gatetable/expectations.toml"
LOCK = "vendor/sglang.lock"
VENDOR = "vendor/sglang"


@dataclass(frozen=True)
class Side:
    rev: Rev
    series: Series
    patches: tuple[PatchFile, ...]  # in series order, the usable ones
    patch_files: dict[str, bytes]  # every file under patches/, by path relative to it
    unusable: tuple[tuple[str, str], ...]  # (patch name, why)
    policy: str | None
    expectations: str | None
    lock: lock.Lock | None
    vendor: str | None  # object name of vendor/sglang (None: not vendored)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.series.names))

    @property
    def version(self) -> str | None:
        return self.lock.version if self.lock else None

    def patch(self, name: str) -> PatchFile | None:
        return next((p for p in self.patches if p.name == name), None)

    @property
    def touched(self) -> tuple[str, ...]:
        """Every upstream path a patch of this side changes, in first-use order."""
        return tuple(dict.fromkeys(path for patch in self.patches for path in patch.paths))


def _text(data: bytes | None, path: str, rev: Rev) -> str | None:
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FatalError(f"{path} at {rev.ref} is not UTF-8 text; fix it there") from error


def load_side(root: Path, rev: Rev) -> Side:
    names = list_files(root, rev, PATCHES)
    blobs = read_files(root, rev, [*names, EXPECTATIONS, LOCK])
    patch_files = {
        name.removeprefix(f"{PATCHES}/"): data
        for name in names
        if (data := blobs.get(name)) is not None
    }
    series = parse_series(_text(patch_files.get("series"), SERIES, rev) or "")
    patches: list[PatchFile] = []
    unusable: list[tuple[str, str]] = []
    for entry in series.entries:
        if any(p.name == entry.name for p in patches):
            continue
        raw = patch_files.get(entry.name)
        if raw is None:
            unusable.append((entry.name, "listed in patches/series but has no file"))
            continue
        try:
            patches.append(parse_patch(raw, entry.name, entry.strip))
        except PatchFileError as error:
            unusable.append((entry.name, error.message))
    lock_text = _text(blobs[LOCK], LOCK, rev)
    return Side(
        rev=rev,
        series=series,
        patches=tuple(patches),
        patch_files=patch_files,
        unusable=tuple(unusable),
        policy=_text(patch_files.get("gates.toml"), POLICY, rev),
        expectations=_text(blobs[EXPECTATIONS], EXPECTATIONS, rev),
        lock=lock.loads(lock_text, origin=f"{LOCK} at {rev.ref}") if lock_text else None,
        vendor=tree_id(root, rev, VENDOR),
    )


def pristine(root: Path, side: Side, paths: tuple[str, ...]) -> dict[str, str | None]:
    """The upstream files at `paths` as vendored on `side` (None: upstream has no such file)."""
    blobs = read_files(root, side.rev, [f"{VENDOR}/{path}" for path in paths])
    return {path: _text(blobs[f"{VENDOR}/{path}"], f"{VENDOR}/{path}", side.rev) for path in paths}
