"""Markdown pieces shared by the review's sections: fences, shortened lists."""

from __future__ import annotations

import re
from collections.abc import Sequence

# GitHub refuses a comment over 65536 characters; review.json keeps everything.
BODY_LIMIT = 65_000


def fenced(text: str, language: str = "", limit: int | None = None) -> list[str]:
    """A fenced block; with `limit`, at most that many lines and a note of the rest."""
    lines = text.rstrip("\n").split("\n")
    extra = []
    if limit is not None and len(lines) > limit:
        extra = [f"... {len(lines) - limit} more lines in review.json"]
        lines = lines[:limit]
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}{language}", *lines, *extra, fence]


def bullets(items: Sequence[str], limit: int | None) -> list[str]:
    shown = items if limit is None else items[:limit]
    lines = [f"- {item}" for item in shown]
    if len(shown) < len(items):
        lines.append(f"- ... and {len(items) - len(shown)} more in review.json")
    return lines


def details(summary: str, body: list[str], *, open_: bool = False) -> list[str]:
    tag = "<details open>" if open_ else "<details>"
    return [f"{tag}<summary>{summary}</summary>", "", *body, "", "</details>", ""]


def plural(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"
