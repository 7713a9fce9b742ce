"""The fork's version, `<upstream>+sm120.<n>`, read from the top of CHANGELOG.md.

The release number `n` lives in one reviewed place: the first `## ` heading of
CHANGELOG.md, written as `## 0.5.9+sm120.1 - 2026-11-29`, or `## 0.5.9+sm120.2 -
unreleased` while the next release is being prepared (its wheels are dated like
the newest dated entry below it, so they stay reproducible). A rebase onto a new
upstream release writes a new `+sm120.1` entry, so `n` restarts with each base.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from sm120fork.errors import FatalError

_HEADING = re.compile(r"##\s+(?P<version>\S+)\s+-\s+(?P<date>\d{4}-\d{2}-\d{2}|unreleased)\s*")
_DATED = re.compile(r"##\s+\S+\s+-\s+(?P<date>\d{4}-\d{2}-\d{2})\s*")
UNRELEASED = "unreleased"
_FORK_VERSION = re.compile(r"(?P<upstream>[^+]+)\+sm120\.(?P<n>[1-9]\d*)")


@dataclass(frozen=True)
class ForkVersion:
    upstream: str  # as the lock spells it, e.g. "0.5.9"
    n: int
    date: str  # the release date of the CHANGELOG entry (of the last one, if unreleased)

    def __str__(self) -> str:
        return f"{self.upstream}+sm120.{self.n}"

    @property
    def epoch(self) -> int:
        """Midnight UTC of the release date, as seconds since the epoch."""
        day = datetime.date.fromisoformat(self.date)
        moment = datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.timezone.utc)
        return int(moment.timestamp())


def parse_changelog(text: str, origin: str = "CHANGELOG.md") -> ForkVersion:
    """The version of the top `## ` heading; any other shape is a FatalError."""
    example = "`## 0.5.9+sm120.1 - 2026-11-29`"
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("## "):
            continue
        heading = _HEADING.fullmatch(line)
        version = _FORK_VERSION.fullmatch(heading["version"]) if heading else None
        if heading is None or version is None:
            raise FatalError(
                f"{origin}:{lineno}: the top entry {line.strip()!r} is not like {example}; "
                "the fork release number comes from that heading"
            )
        date = heading["date"]
        if date == UNRELEASED:
            date = _last_release(text.splitlines()[lineno:], origin, lineno)
        try:
            datetime.date.fromisoformat(date)
        except ValueError:
            raise FatalError(f"{origin}:{lineno}: {date} is not a date") from None
        return ForkVersion(version["upstream"], int(version["n"]), date)
    raise FatalError(f"{origin} has no `## ` entry; add one like {example} at the top")


def _last_release(below: list[str], origin: str, lineno: int) -> str:
    """The date of the newest dated entry below an unreleased one."""
    for line in below:
        dated = _DATED.fullmatch(line)
        if dated is not None:
            return dated["date"]
    raise FatalError(
        f"{origin}:{lineno}: the top entry is unreleased and no dated entry follows it; "
        "give it its release date"
    )


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
    return ForkVersion(upstream, found.n, found.date)


def _same_version(left: str, right: str) -> bool:
    try:
        return Version(left) == Version(right)
    except InvalidVersion:
        return left == right
