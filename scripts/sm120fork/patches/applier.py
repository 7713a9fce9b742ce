"""Apply parsed patches to files in memory: exactly, or at shifted lines.

Exact means what `quilt push` calls clean: every hunk's old lines are found
at the line numbers the hunk states (counted in the original file), with no
offset and no fuzz. `allow_offset` also accepts the nearest place where the
old lines match verbatim, as `patch` does, and reports the shift.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.patches.diffs import FileDiff, Hunk
from sm120fork.patches.lines import split_lines
from sm120fork.patches.patchfile import PatchFile


class ApplyError(FatalError):
    def __init__(self, path: str, hunk: Hunk | None, message: str) -> None:
        where = f"{path}" + (f" (hunk at patch line {hunk.lineno})" if hunk else "")
        super().__init__(f"{where}: {message}")
        self.path = path
        self.hunk_lineno = hunk.lineno if hunk else None
        self.reason = message


@dataclass
class Overlay:
    """A tree on disk plus in-memory changes; None marks a deleted file."""

    base: Path
    changes: dict[str, str | None] = field(default_factory=dict)

    def read(self, path: str) -> str | None:
        if path in self.changes:
            return self.changes[path]
        file_path = self.base / path
        if not file_path.resolve().is_relative_to(self.base.resolve()):
            raise FatalError(f"{path} leads outside {self.base} through a symbolic link; refusing")
        if not file_path.is_file():
            return None
        try:
            return file_path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            raise FatalError(
                f"{path} in {self.base} is not UTF-8 text; patch only text files"
            ) from error

    def write(self, path: str, text: str | None) -> None:
        self.changes[path] = text


def write_changes(root: Path, changes: Mapping[str, str | None]) -> None:
    """Write an overlay's changes under `root` (None deletes the file): the one writer
    of applied patches, for `apply`, the wheel and the rebase's work tree."""
    for path, text in changes.items():
        target = root / path
        if text is None:
            target.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text.encode("utf-8"))


@dataclass(frozen=True)
class PatchResult:
    name: str
    offsets: dict[str, tuple[int, ...]]  # per file, the shift of each hunk

    @property
    def shifted(self) -> bool:
        return any(any(offsets) for offsets in self.offsets.values())


def apply_patch(overlay: Overlay, patch: PatchFile, *, allow_offset: bool = False) -> PatchResult:
    """Apply every file of `patch` to `overlay`; nothing is written if any file fails."""
    staged: dict[str, str | None] = {}
    offsets: dict[str, tuple[int, ...]] = {}
    for file_diff in patch.files:
        original = overlay.read(file_diff.path)
        staged[file_diff.path], offsets[file_diff.path] = apply_file(
            original, file_diff, allow_offset=allow_offset
        )
    for path, text in staged.items():
        overlay.write(path, text)
    return PatchResult(patch.name, offsets)


def apply_file(
    original: str | None, file_diff: FileDiff, *, allow_offset: bool = False
) -> tuple[str | None, tuple[int, ...]]:
    path = file_diff.path
    if file_diff.old_path is None and original is not None:
        raise ApplyError(path, None, "the patch creates this file but it already exists")
    if file_diff.old_path is not None and original is None:
        raise ApplyError(path, None, "the patch changes this file but it does not exist upstream")
    old_lines = split_lines(original or "")
    result: list[str] = []
    consumed = 0  # lines of old_lines already copied or replaced
    offsets: list[int] = []
    for hunk in file_diff.hunks:
        expected = hunk.old_start - 1 if hunk.old_count else hunk.old_start
        if expected < consumed:
            raise ApplyError(path, hunk, "hunk overlaps the previous hunk; regenerate the patch")
        position = _locate(old_lines, hunk, expected, consumed, allow_offset)
        if position is None:
            raise ApplyError(path, hunk, _mismatch(old_lines, hunk, expected, consumed))
        offsets.append(position - expected)
        result.extend(old_lines[consumed:position])
        result.extend(hunk.new_lines)
        consumed = position + len(hunk.old_lines)
    result.extend(old_lines[consumed:])
    if file_diff.new_path is None:
        if result:
            raise ApplyError(path, None, "the patch deletes this file but lines would remain")
        return None, tuple(offsets)
    return "".join(result), tuple(offsets)


def _matches(old_lines: list[str], hunk: Hunk, position: int) -> bool:
    wanted = hunk.old_lines
    return position >= 0 and old_lines[position : position + len(wanted)] == wanted


def _locate(
    old_lines: list[str], hunk: Hunk, expected: int, floor: int, allow_offset: bool
) -> int | None:
    if _matches(old_lines, hunk, expected):
        return expected
    if not allow_offset:
        return None
    # Nearest match first, searching both ways, never before the previous hunk.
    for distance in range(1, len(old_lines) + 1):
        for candidate in (expected - distance, expected + distance):
            if candidate >= floor and _matches(old_lines, hunk, candidate):
                return candidate
        if expected - distance < floor and expected + distance > len(old_lines):
            break
    return None


def _mismatch(old_lines: list[str], hunk: Hunk, expected: int, floor: int) -> str:
    shifted = _locate(old_lines, hunk, expected, floor, allow_offset=True)
    if shifted is not None:
        return (
            f"applies only at offset {shifted - expected:+d} lines (line {shifted + 1} instead of "
            f"{expected + 1}); refresh the patch so it applies exactly"
        )
    return f"context at line {hunk.old_start} does not match the file; the patch needs a rebase"
