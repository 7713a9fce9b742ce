"""`sm120fork wheel`: the upstream release wheel with the series applied, in dist/.

Writes `dist/sglang-<upstream>+sm120.<n>-<tags>.whl` for the wheel of the
locked release that this Python would install (or the only one), or for every
wheel of the release with `--all`. The paths built go to stdout, progress to
stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sm120fork.errors import EXIT_OK
from sm120fork.paths import RepoPaths
from sm120fork.wheel.build import build_wheels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--all",
        dest="every",
        action="store_true",
        help="one fork wheel for every upstream wheel of the locked release",
    )
    which.add_argument(
        "--artifact", metavar="FILE", help="build from this upstream wheel of the lock only"
    )
    parser.add_argument(
        "--dist", type=Path, default=None, help="output directory (default: REPO/dist)"
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="where upstream wheels are kept (default: REPO/build/wheel/cache)",
    )


def run(args: argparse.Namespace) -> int:
    paths = RepoPaths(args.repo)
    built = build_wheels(
        paths,
        dist=(args.dist or paths.root / "dist").absolute(),
        cache=args.cache or paths.build_dir / "wheel" / "cache",
        every=args.every,
        artifact=args.artifact,
        progress=_progress,
    )
    for path in built:
        print(path)
    return EXIT_OK


def _progress(message: str) -> None:
    print(f"wheel: {message}", file=sys.stderr, flush=True)
