"""`sm120fork review [BASE [HEAD]]`: what a change to `patches/` does, for a reviewer.

Writes build/review/review.md (a pull-request comment) and review.json. BASE
defaults to the merge base with origin/main (else main), HEAD to HEAD. Exit 0
when written, 2 on bad input (unknown ref, BASE not an ancestor of HEAD, a
dirty work tree): nothing is written then but build/review/ itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sm120fork.errors import EXIT_OK
from sm120fork.fsutil import atomic_write_many
from sm120fork.paths import RepoPaths
from sm120fork.review import review_change
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "base", nargs="?", help="the commit to compare with (default: merge base with origin/main)"
    )
    parser.add_argument("head", nargs="?", default="HEAD", help="the commit reviewed (HEAD)")
    parser.add_argument("--out", type=Path, help="output directory (default: build/review)")
    parser.add_argument(
        "--full-scan",
        action="store_true",
        help="scan every gate of both patched trees, also when vendor/ did not change",
    )
    parser.add_argument("--workers", type=int, help="processes for a full gate scan")


def _progress(message: str) -> None:
    print(f"review: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    paths = RepoPaths(args.repo)
    out: Path = args.out or paths.build_dir / "review"
    out.mkdir(parents=True, exist_ok=True)
    clear(out)
    started = time.monotonic()
    review = review_change(
        paths.root,
        args.base,
        args.head,
        full_scan=args.full_scan,
        workers=args.workers,
        progress=_progress,
    )
    json_path, md_path = write(review, out)
    print(review.verdict.line)
    print(f"wrote {md_path} and {json_path} in {time.monotonic() - started:.1f}s")
    return EXIT_OK
