"""`sm120fork import VERSION [--upstream-git URL]`: vendor an upstream release.

Writes vendor/sglang (python/sglang/... and LICENSE) and vendor/sglang.lock.
Everything is built in a staging directory beside vendor/ and swapped in with
renames at the end, so a failure at any step leaves both exactly as they were.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from sm120fork import lock
from sm120fork.errors import EXIT_OK, FatalError
from sm120fork.paths import RepoPaths
from sm120fork.upstream import SPEC_HELP, fetch_release


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("version", help=SPEC_HELP)
    parser.add_argument(
        "--upstream-git",
        metavar="URL",
        default=None,
        help="take tag vX.Y.Z of this git remote (python/sglang, LICENSE) instead of the index",
    )


def _progress(message: str) -> None:
    print(f"sm120fork import: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    paths = RepoPaths(args.repo)
    if not paths.root.is_dir():
        raise FatalError(f"{paths.root} is not a directory; pass the fork's root with -C")
    locked = lock.read(paths.lock_file)
    imported = lock.today()
    # Beside vendor/ (same file system), so the final renames cannot cross devices.
    staging = Path(tempfile.mkdtemp(prefix=".sm120fork-import-", dir=paths.root))
    try:
        release = fetch_release(
            args.version,
            git_url=args.upstream_git,
            workdir=staging / "work",
            progress=_progress,
            locked=locked,
        )
        new_lock = staging / "sglang.lock"
        new_lock.write_text(lock.dumps(release.lock(imported)), encoding="utf-8")
        _progress(f"writing {paths.upstream_tree.relative_to(paths.root)} and its lock")
        _swap_in(release.tree, new_lock, paths, staging / "old")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(
        f"imported sglang {release.version} ({release.source}, {release.tree_from}); "
        f"{len(release.skipped)} binary files left out; wrote vendor/sglang.lock"
    )
    return EXIT_OK


def _swap_in(tree: Path, new_lock: Path, paths: RepoPaths, old: Path) -> None:
    """Replace vendor/sglang and vendor/sglang.lock, undoing the first rename if
    the second fails (the lock is replaced last, by an atomic rename)."""
    created_vendor = not paths.vendor_dir.exists()
    had_tree = paths.upstream_tree.exists()
    try:
        paths.vendor_dir.mkdir(exist_ok=True)
        if had_tree:
            paths.upstream_tree.rename(old)
        try:
            tree.rename(paths.upstream_tree)
            try:
                new_lock.replace(paths.lock_file)
            except BaseException:
                paths.upstream_tree.rename(tree)
                raise
        except BaseException:
            if had_tree:
                old.rename(paths.upstream_tree)
            raise
    except OSError as error:
        if created_vendor:
            shutil.rmtree(paths.vendor_dir, ignore_errors=True)
        raise FatalError(
            f"cannot replace {paths.upstream_tree} ({error}); it was left as it was"
        ) from error
