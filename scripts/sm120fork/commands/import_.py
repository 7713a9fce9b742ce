"""`sm120fork import VERSION [--upstream-git URL]`: vendor an upstream release.

Writes vendor/sglang (python/sglang/... and LICENSE), vendor/sglang.lock and
vendor/sglang.sha256 (every file's sha256, as verified on the way in).
Everything is built in a staging directory beside vendor/ and swapped in with
renames at the end (`fsutil.swap_in`), so a failure at any step leaves all
three as they were.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from sm120fork.errors import EXIT_OK, FatalError
from sm120fork.fsutil import swap_back, swap_in
from sm120fork.paths import MANIFEST_NAME, RepoPaths
from sm120fork.upstream import lock, manifest
from sm120fork.upstream.fetch import fetch_release
from sm120fork.upstream.source import UpstreamSource
from sm120fork.upstream.versions import SPEC_HELP


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
            source=UpstreamSource(args.upstream_git),
            workdir=staging / "work",
            progress=_progress,
            locked=locked,
        )
        new_lock = staging / "sglang.lock"
        new_lock.write_text(lock.dumps(release.lock(imported)), encoding="utf-8")
        new_manifest = staging / MANIFEST_NAME
        new_manifest.write_text(manifest.dumps(release.manifest()), encoding="utf-8")
        _progress(f"writing {paths.upstream_tree.relative_to(paths.root)}, its lock and manifest")
        _swap_in(
            release.tree,
            {new_manifest: paths.manifest_file, new_lock: paths.lock_file},
            paths,
            staging / "old",
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(
        f"imported sglang {release.version} ({release.source}, {release.tree_from}); "
        f"{len(release.skipped)} binary files left out; wrote vendor/sglang.lock and "
        f"vendor/{MANIFEST_NAME} ({len(release.files)} files)"
    )
    return EXIT_OK


def _swap_in(tree: Path, files: dict[Path, Path], paths: RepoPaths, old: Path) -> None:
    """Swap in vendor/sglang, then each of `files` (new -> final; the lock last), what
    was there kept in `old`; a failure puts back what was already replaced."""
    created_vendor = not paths.vendor_dir.exists()
    old.mkdir()
    started: list[tuple[Path, Path, bool]] = []  # (new, final, final existed) of each swap
    try:
        paths.vendor_dir.mkdir(exist_ok=True)
        try:
            for new, final in {tree: paths.upstream_tree, **files}.items():
                started.append((new, final, final.exists()))
                swap_in(new, final, old / final.name)
        except BaseException:
            for new, final, existed in reversed(started):
                swap_back(new, final, old / final.name, existed)
            raise
    except OSError as error:
        if created_vendor:
            shutil.rmtree(paths.vendor_dir, ignore_errors=True)
        raise FatalError(
            f"cannot replace {paths.upstream_tree} ({error}); it was left as it was"
        ) from error
