"""The series of one side applied in memory to the few upstream files it touches.

A review needs the patched files, not the patched tree: the vendored release
is about 90 MB, the series changes a dozen files. Each patch's files are kept
as they were below it and after it (what the interdiff compares), and the
final state of every touched file (what the gate scan reads). Patches apply at
shifted lines too, so a series that `check` rejects is still shown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sm120fork.patches.applier import ApplyError, Overlay, apply_patch
from sm120fork.patches.patchfile import PatchFile

Files = Mapping[str, "str | None"]


@dataclass(frozen=True)
class Step:
    """One patch applied on its side: its files below it and after it."""

    name: str
    before: Files
    after: Files  # == before when the patch does not apply
    error: str | None = None
    shifted: bool = False


@dataclass(frozen=True)
class Applied:
    steps: Mapping[str, Step]
    final: Files  # every file the caller gave, after the whole series


class _Memory(Overlay):
    """An overlay holding every file it is asked for: nothing is read from disk."""

    def read(self, path: str) -> str | None:
        return self.changes.get(path)


def apply_series(patches: tuple[PatchFile, ...], pristine: Files) -> Applied:
    """Every patch in order on `pristine` (which must hold every path they touch)."""
    overlay = _Memory(Path(), dict(pristine))
    steps: dict[str, Step] = {}
    for patch in patches:
        before = {path: overlay.read(path) for path in patch.paths}
        try:
            result = apply_patch(overlay, patch, allow_offset=True)
        except ApplyError as error:
            steps[patch.name] = Step(patch.name, before, before, error=error.message)
            continue
        after = {path: overlay.read(path) for path in patch.paths}
        steps[patch.name] = Step(patch.name, before, after, shifted=result.shifted)
    return Applied(steps=steps, final=dict(overlay.changes))
