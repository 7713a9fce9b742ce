"""The architecture gates of the two patched trees, and how they differ.

Neither patched tree is built: the scanner is given the list of files to read,
the patched ones written to a scratch directory and every other one read
where it already is.

`full`: every Python file of the side's release; needed when vendor/ changed,
since any gate of the new release may answer differently. The release is read
from the work tree when it is the side's (the tree is clean), else from `git
archive`. `limited`: only the files either series touches, patched; enough
when vendor/ is the same on both sides, because every other file is the same
too. A flag one of these files exports is then not followed into the files
importing it (the report says so).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from sm120fork.gates import diff_inventories, review_tree
from sm120fork.gates.policy import Policy
from sm120fork.gates.scan import list_files, package_dir
from sm120fork.review.model import GateScan
from sm120fork.review.patched import Files
from sm120fork.review.revs import extract, resolve, tree_id
from sm120fork.review.side import VENDOR, Side

Listing = dict[str, tuple[str, str, int]]  # path -> (path, where to read it, size)
Sides = tuple[tuple[Side, Files, Policy], tuple[Side, Files, Policy]]


def _patched(listing: Listing, files: Files, scratch: Path) -> list[tuple[str, str, int]]:
    """`listing` with the patched Python files of the package swapped in."""
    listing = dict(listing)
    for path, text in files.items():
        if not (path.startswith("python/sglang/") and path.endswith(".py")):
            continue
        if text is None:
            listing.pop(path, None)
            continue
        target = scratch / path
        target.parent.mkdir(parents=True, exist_ok=True)
        data = text.encode("utf-8")
        target.write_bytes(data)
        listing[path] = (path, str(target), len(data))
    return sorted(listing.values())


def _release(root: Path, scratch: Path, side: Side, cache: dict[str, Listing]) -> Listing:
    """Every Python file of the side's vendored release, extracted at most once."""
    if side.vendor is None:
        return {}
    if side.vendor not in cache:
        tree = root / VENDOR
        if tree_id(root, resolve(root, "HEAD"), VENDOR) != side.vendor:
            extract(root, side.rev, VENDOR, scratch / side.vendor, suffix=".py")
            tree = scratch / side.vendor / VENDOR
        cache[side.vendor] = {entry[0]: entry for entry in list_files(package_dir(tree))}
    return cache[side.vendor]


def scan_patched(
    root: Path, scratch: Path, sides: Sides, *, full: bool, workers: int | None = None
) -> GateScan:
    """`sides`: BASE then HEAD, each with its patched files (the union of both series'
    files, every one present) and its gate policy."""
    releases: dict[str, Listing] = {}
    inventories = []
    for index, (side, files, policy) in enumerate(sides):
        listing = _release(root, scratch, side, releases) if full else {}
        listed = _patched(listing, files, scratch / f"patched-{index}")
        inventories.append(review_tree(scratch, policy, workers=workers, files=listed))
    old, new = inventories
    return GateScan(
        scope="full" if full else "limited",
        files=() if full else tuple(sorted(p for p in sides[1][1] if p.endswith(".py"))),
        base_gates=len(old.gates),
        head_gates=len(new.gates),
        # The policy reviews the pristine tree: a gate the series adds has no entry by
        # design, so "unreviewed" means nothing here (`nox -s gates` reports the real ones).
        diff=replace(diff_inventories(old, new), unreviewed=()),
    )
