"""The quilt series file: `patches/series`.

One patch per line in apply order, optionally followed by `-pN`; `#` starts
a comment; blank lines are allowed. The file is kept line by line so that
writing back a series that was only read gives the same bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.patches.lines import split_rows

_STRIP_OPTION = re.compile(r"-p(\d+)")
# A patch name is a plain relative path inside patches/: no `..`, no absolute
# path, no whitespace (quilt splits on whitespace).
_SAFE_NAME = re.compile(r"[A-Za-z0-9._+-]+(?:/[A-Za-z0-9._+-]+)*")


@dataclass(frozen=True)
class SeriesEntry:
    name: str
    strip: int
    lineno: int
    raw: str  # the line as written, without its newline


@dataclass(frozen=True)
class SeriesLine:
    """A line of the series file: an entry, or a comment / blank line (entry is None)."""

    raw: str
    entry: SeriesEntry | None


@dataclass(frozen=True)
class SeriesProblem:
    lineno: int
    message: str


@dataclass(frozen=True)
class Series:
    lines: tuple[SeriesLine, ...]
    problems: tuple[SeriesProblem, ...] = ()

    @property
    def entries(self) -> tuple[SeriesEntry, ...]:
        return tuple(line.entry for line in self.lines if line.entry is not None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(entry.name for entry in self.entries)

    def render(self) -> str:
        return "".join(line.raw + "\n" for line in self.lines)

    def without(self, name: str) -> Series:
        """The series with `name`'s entry removed (comments kept)."""
        return replace(self, lines=tuple(ln for ln in self.lines if not _is_entry(ln, name)))

    def appended(self, name: str, strip: int = 1) -> Series:
        raw = name if strip == 1 else f"{name} -p{strip}"
        entry = SeriesEntry(name=name, strip=strip, lineno=len(self.lines) + 1, raw=raw)
        return replace(self, lines=(*self.lines, SeriesLine(raw=raw, entry=entry)))


def _is_entry(line: SeriesLine, name: str) -> bool:
    return line.entry is not None and line.entry.name == name


def parse_series(text: str) -> Series:
    """Parse series text; malformed lines become problems, never exceptions."""
    lines: list[SeriesLine] = []
    problems: list[SeriesProblem] = []
    for lineno, raw in enumerate(split_rows(text), start=1):
        entry, problem = _parse_line(raw, lineno)
        lines.append(SeriesLine(raw=raw, entry=entry))
        if problem:
            problems.append(SeriesProblem(lineno, problem))
    return Series(lines=tuple(lines), problems=tuple(problems))


def _parse_line(raw: str, lineno: int) -> tuple[SeriesEntry | None, str | None]:
    content = raw.split("#", 1)[0].strip()
    if not content:
        return None, None
    name, *options = content.split()
    if not _SAFE_NAME.fullmatch(name) or ".." in name.split("/"):
        return None, f"series entry {name!r} is not a plain file name inside patches/"
    strip = 1
    for option in options:
        match = _STRIP_OPTION.fullmatch(option)
        if match is None:
            return None, f"series entry {name!r} has an unsupported option {option!r} (only -pN)"
        strip = int(match.group(1))
    return SeriesEntry(name=name, strip=strip, lineno=lineno, raw=raw), None


def read_series(path: Path) -> Series:
    if not path.is_file():
        raise FatalError(f"{path} does not exist; create it with one patch name per line")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise FatalError(
            f"{path} is not UTF-8 text ({error.reason}); re-save it as UTF-8"
        ) from error
    return parse_series(text)


def duplicate_entries(entries: Iterable[SeriesEntry]) -> Iterator[SeriesEntry]:
    """Every entry whose name already appeared earlier in the series."""
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            yield entry
        seen.add(entry.name)
