"""build/review/review.json and review.md, from the one record."""

from __future__ import annotations

import json
from pathlib import Path

from sm120fork.fsutil import atomic_write_many
from sm120fork.review.markdown import render
from sm120fork.review.model import Review

NAMES = ("review.json", "review.md")


def clear(directory: Path) -> None:
    """Remove an earlier run's outputs, so a failed run leaves no stale comment behind."""
    for name in NAMES:
        (directory / name).unlink(missing_ok=True)


def write(review: Review, directory: Path) -> tuple[Path, Path]:
    json_path, md_path = (directory / name for name in NAMES)
    atomic_write_many(
        {
            json_path: (json.dumps(review.to_json(), indent=2, ensure_ascii=False) + "\n").encode(),
            md_path: render(review).encode("utf-8"),
        }
    )
    return json_path, md_path
