"""The patch stack: the series with its patch files, applied in order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.patches.applier import Overlay, PatchResult, apply_patch
from sm120fork.patches.normalform import DiffRenderer, render_patch
from sm120fork.patches.patchfile import PatchFile, load_patch
from sm120fork.patches.series import Series, duplicate_entries, read_series
from sm120fork.paths import RepoPaths


@dataclass(frozen=True)
class Stack:
    series: Series
    patches: tuple[PatchFile, ...]


def load_stack(paths: RepoPaths) -> Stack:
    """The series and its patches; any inconsistency is a FatalError (run `check` for all)."""
    series = read_series(paths.series_file)
    if series.problems:
        problem = series.problems[0]
        raise FatalError(f"patches/series:{problem.lineno}: {problem.message}; run `check`")
    for duplicate in duplicate_entries(series.entries):
        raise FatalError(f"patches/series:{duplicate.lineno}: {duplicate.name} is listed twice")
    patches = []
    for entry in series.entries:
        path = paths.patches_dir / entry.name
        if not path.is_file():
            raise FatalError(f"patches/series:{entry.lineno}: {entry.name} has no file in patches/")
        patches.append(load_patch(path, entry.name, entry.strip))
    return Stack(series=series, patches=tuple(patches))


def apply_stack(
    tree: Path, patches: tuple[PatchFile, ...], *, allow_offset: bool = False
) -> Overlay:
    """All patches applied in memory on top of `tree`; raises ApplyError on the first failure."""
    overlay = Overlay(tree)
    for patch in patches:
        apply_patch(overlay, patch, allow_offset=allow_offset)
    return overlay


@dataclass(frozen=True)
class Refreshed:
    patch: PatchFile
    result: PatchResult
    text: bytes  # the patch in normal form
    empty: bool  # the patch changes nothing on this tree

    @property
    def changed(self) -> bool:
        return self.text != self.patch.raw


def refresh_stack(
    tree: Path, patches: tuple[PatchFile, ...], *, allow_offset: bool = False
) -> Iterator[Refreshed]:
    """Apply in order and yield each patch in normal form against the tree below it
    (every diff rendered at once, after the last patch applied)."""
    overlay = Overlay(tree)
    applied = []
    for patch in patches:
        before = {path: overlay.read(path) for path in patch.paths}
        result = apply_patch(overlay, patch, allow_offset=allow_offset)
        after = {path: overlay.read(path) for path in patch.paths}
        applied.append((patch, result, before, after))
    with DiffRenderer() as renderer:
        diffs = renderer.diff_many([(before, after) for _, _, before, after in applied])
    for (patch, result, _, _), diff in zip(applied, diffs, strict=True):
        yield Refreshed(patch, result, render_patch(patch.header, diff), empty=not diff)
