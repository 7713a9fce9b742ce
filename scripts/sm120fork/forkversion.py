"""The fork's version, `<upstream>+sm120.<n>`, read from the top of CHANGELOG.md.

The release number `n` lives in one reviewed place: the first `## ` heading of
CHANGELOG.md, written as `## 0.5.9+sm120.1 - 2026-11-29`. A rebase onto a new
upstream release writes a new `+sm120.1` entry, so `n` restarts with each base.
Between releases the top entry may be `## 0.5.9+sm120.2 - unreleased`, as
pre-commit keeps its changelog; a wheel built then is dated like the release
below it, so that it stays reproducible.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.version import InvalidVersion, Version

from sm120fork.errors import FatalError

_HEADING = re.compile(r"##\s+(?P<version>\S+)\s+-\s+(?P<date>\d{4}-\d{2}-\d{2}|unreleased)\s*")
UNRELEASED = "unreleased"
# The date of an unreleased entry with no release below it: the earliest a zip records.
_NO_RELEASE_YET = "1980-01-01"
_FORK_VERSION = re.compile(r"(?P<upstream>[^+]+)\+sm120\.(?P<n>[1-9]\d*)")


@dataclass(frozen=True)
class ForkVersion:
    upstream: str  # as the lock spells it, e.g. "0.5.9"
    n: int
    date: str  # YYYY-MM-DD of the entry; for an unreleased one, of the release below it
    released: bool = True

    def __str__(self) -> str:
        return f"{self.upstream}+sm120.{self.n}"

    @property
    def epoch(self) -> int:
        """Midnight UTC of the release date, as seconds since the epoch."""
        day = datetime.date.fromisoformat(self.date)
        moment = datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.UTC)
        return int(moment.timestamp())


def parse_changelog(text: str, origin: str = "CHANGELOG.md") -> ForkVersion:
    """The version of the top `## ` heading; any other shape is a FatalError."""
    example = "`## 0.5.9+sm120.1 - 2026-11-29` (or `- unreleased`)"
    top: ForkVersion | None = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("## "):
            continue
        heading = _HEADING.fullmatch(line)
        version = _FORK_VERSION.fullmatch(heading["version"]) if heading else None
        if top is not None:  # looking for the date of the release below an unreleased top
            if heading is not None and heading["date"] != UNRELEASED and _is_date(heading["date"]):
                return replace(top, date=heading["date"])
            continue
        if heading is None or version is None:
            raise FatalError(
                f"{origin}:{lineno}: the top entry {line.strip()!r} is not like {example}; "
                "the fork release number comes from that heading"
            )
        found = ForkVersion(version["upstream"], int(version["n"]), heading["date"])
        if heading["date"] != UNRELEASED:
            if not _is_date(heading["date"]):
                raise FatalError(f"{origin}:{lineno}: {heading['date']} is not a date")
            return found
        top = replace(found, date=_NO_RELEASE_YET, released=False)
    if top is not None:
        return top
    raise FatalError(f"{origin} has no `## ` entry; add one like {example} at the top")


def _is_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


def read_fork_version(changelog: Path, upstream: str) -> ForkVersion:
    """The fork version for `upstream` (the lock's version) from `changelog`."""
    try:
        text = changelog.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FatalError(
            f"{changelog.name} does not exist; add it with an entry `## {upstream}+sm120.1 - "
            "YYYY-MM-DD` at the top"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise FatalError(f"cannot read {changelog}: {error}") from error
    found = parse_changelog(text, changelog.name)
    if not _same_version(found.upstream, upstream):
        raise FatalError(
            f"{changelog.name}'s top entry is {found} but vendor/sglang.lock pins sglang "
            f"{upstream}; add a CHANGELOG entry for {upstream}+sm120.1 at the top"
        )
    return replace(found, upstream=upstream)


def _same_version(left: str, right: str) -> bool:
    try:
        return Version(left) == Version(right)
    except InvalidVersion:
        return left == right
