"""`sm120fork refresh`: rewrite every patch of the series in normal form."""

from __future__ import annotations

import argparse

from sm120fork.errors import EXIT_OK
from sm120fork.fsutil import atomic_write_many
from sm120fork.patches.stack import load_stack, refresh_stack
from sm120fork.paths import RepoPaths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-offset",
        action="store_true",
        help="also refresh patches that apply only at shifted lines",
    )


def run(args: argparse.Namespace) -> int:
    paths = RepoPaths(args.repo)
    stack = load_stack(paths)
    refreshed = list(
        refresh_stack(paths.upstream_tree, stack.patches, allow_offset=args.allow_offset)
    )
    changed = {paths.patches_dir / r.patch.name: r.text for r in refreshed if r.changed}
    atomic_write_many(changed)
    for item in refreshed:
        state = "refreshed" if item.changed else "unchanged"
        print(f"{state:9} {item.patch.name}")
    return EXIT_OK
