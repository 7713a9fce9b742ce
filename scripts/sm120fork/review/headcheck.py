"""`check` of HEAD's series, run on HEAD's files without checking HEAD out.

A scratch repository root holds HEAD's patches/ and, under vendor/sglang,
only the upstream files the series touches: `check` of the series reads no
others (the vendored tree against its manifest is `check`'s job on a checkout).
"""

from __future__ import annotations

from pathlib import Path

from sm120fork.patches.applier import write_changes
from sm120fork.patches.checks import check_repository
from sm120fork.paths import RepoPaths
from sm120fork.review.model import CheckReview
from sm120fork.review.patched import Files
from sm120fork.review.side import Side


def check_head(scratch: Path, head: Side, pristine: Files) -> CheckReview:
    paths = RepoPaths(scratch)
    for name, data in head.patch_files.items():
        target = paths.patches_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    paths.upstream_tree.mkdir(parents=True, exist_ok=True)
    write_changes(paths.upstream_tree, pristine)
    if not paths.series_file.is_file():
        return CheckReview(clean=True, findings=())
    # The vendored tree itself is checked where it lives (`check` on HEAD's checkout).
    findings = tuple(str(f) for f in check_repository(paths, verify_tree=False))
    return CheckReview(clean=not findings, findings=findings)
