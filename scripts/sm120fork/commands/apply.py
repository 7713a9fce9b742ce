"""`sm120fork apply --out DIR`: vendor/sglang with the series applied, written to DIR.

DIR gets upstream's layout (DIR/python/sglang/...). The gate tests and the
wheel build read the patched tree from here.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from sm120fork.errors import EXIT_OK, FatalError
from sm120fork.fsutil import TreeCopy, swap_in
from sm120fork.patches.applier import write_changes
from sm120fork.patches.stack import apply_stack, load_stack
from sm120fork.paths import RepoPaths
from sm120fork.upstream import pristine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="directory to write (replaced)")
    parser.add_argument(
        "--tree",
        type=Path,
        default=None,
        help="upstream tree to patch instead of vendor/sglang",
    )


def run(args: argparse.Namespace) -> int:
    paths = RepoPaths(args.repo)
    tree = args.tree or paths.upstream_tree
    if not tree.is_dir():
        raise FatalError(f"{tree} is not a directory; run `sm120fork import VERSION` first")
    out: Path = args.out.resolve()
    if out == tree.resolve() or tree.resolve() in out.parents:
        raise FatalError(f"--out {out} must be outside the tree it patches")
    # Build beside the target and swap, so a failure leaves `out` as it was. The copy
    # runs while the tree is verified and the series applied in memory (the copy is
    # I/O, the rest CPU); nothing reaches `out` unless both succeed.
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    copy = TreeCopy(tree, staging / "tree")
    try:
        if args.tree is None:  # the gate tests judge this tree as upstream's plus the series
            why = "the patched tree would not be upstream's release plus the series"
            pristine.require(paths, why)
        stack = load_stack(paths)
        overlay = apply_stack(tree, stack.patches)
        copy.wait()
        write_changes(staging / "tree", overlay.changes)
        swap_in(staging / "tree", out, staging / "old")  # the old `out` goes with staging
    finally:
        copy.cancel()
        shutil.rmtree(staging, ignore_errors=True)
    print(f"applied {len(stack.patches)} patches to {tree} -> {out}")
    return EXIT_OK
