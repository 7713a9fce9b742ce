"""A patch file of the series: DEP-3 header, a `---` line, then the diff."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.patches import dep3, diffs
from sm120fork.patches.lines import split_lines


class PatchFileError(FatalError):
    """A patch file that cannot be read at all; `lineno` points into it."""

    def __init__(self, name: str, lineno: int, message: str) -> None:
        super().__init__(f"{name}:{lineno}: {message}")
        self.name = name
        self.lineno = lineno
        self.reason = message


@dataclass(frozen=True)
class PatchFile:
    name: str
    strip: int
    header: dep3.Dep3Header
    header_lines: int  # lines before the diff part, separator included
    files: tuple[diffs.FileDiff, ...]
    raw: bytes

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files)


def load_patch(path: Path, name: str | None = None, strip: int = 1) -> PatchFile:
    name = name or path.name
    if path.is_symlink():
        raise PatchFileError(name, 1, "is a symbolic link; patches must be regular files")
    raw = path.read_bytes()
    return parse_patch(raw, name, strip)


def parse_patch(raw: bytes, name: str, strip: int = 1) -> PatchFile:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        lineno = raw[: error.start].count(b"\n") + 1
        raise PatchFileError(name, lineno, "is not UTF-8 text; re-save it as UTF-8") from error
    if "\r\n" in text:
        lineno = text[: text.index("\r\n")].count("\n") + 1
        raise PatchFileError(name, lineno, "has CRLF line endings; convert it to LF (dos2unix)")
    if not text.strip():
        raise PatchFileError(
            name, 1, "is empty; delete it and its series entry, or write the change"
        )
    lines = split_lines(text)
    start = diffs.diff_start(lines)
    if start is None:
        raise PatchFileError(name, len(lines), "contains no diff ('--- a/...' '+++ b/...')")
    header_text = "".join(lines[:start])
    header_text = _without_separator(header_text)
    try:
        files = diffs.parse_diff("".join(lines[start:]), strip=strip, first_lineno=start + 1)
    except diffs.DiffError as error:
        raise PatchFileError(name, error.lineno, error.message) from error
    if not files:
        raise PatchFileError(name, start + 1, "contains no file changes")
    _refuse_duplicate_files(name, files)
    return PatchFile(
        name=name,
        strip=strip,
        header=dep3.parse_header(header_text),
        header_lines=start,
        files=files,
        raw=raw,
    )


def _without_separator(header_text: str) -> str:
    """The header without the `---` separator line and any diffstat after it."""
    lines = header_text.split("\n")
    if "---" in lines:
        lines = lines[: lines.index("---")]
    return "\n".join(lines).rstrip("\n") + "\n"


def _refuse_duplicate_files(name: str, files: tuple[diffs.FileDiff, ...]) -> None:
    seen: set[str] = set()
    for file_diff in files:
        if file_diff.path in seen:
            raise PatchFileError(
                name, file_diff.lineno, f"changes {file_diff.path} twice; merge the two sections"
            )
        seen.add(file_diff.path)
