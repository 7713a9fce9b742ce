"""Markdown text shared by every report the tool writes (review, gates, the harness).
Standard library only: the harness imports it in the gate environment."""

from __future__ import annotations

import re


def cell(text: str | None, limit: int | None = 160) -> str:
    """Text for one table cell: on one line, at most `limit` characters, `|` escaped."""
    text = " ".join((text or "").split())
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def code(text: str) -> str:
    """Inline code that survives backticks inside."""
    ticks = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (ticks + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"
