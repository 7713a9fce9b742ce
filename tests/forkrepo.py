"""Build small fork repositories (vendor tree + patches) for the tool's tests."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

from hermetic import git
from hermetic import output as git_output
from sm120fork.paths import MANIFEST_NAME
from sm120fork.upstream import manifest

HEADER = """\
From: Test Maintainer <test@example.com>
Subject: [PATCH] {subject}

{subject}, because a test needs it.

Origin: vendor
Bug: https://github.com/sgl-project/sglang/issues/1
Forwarded: no
Last-Update: 2026-11-29
---
"""

BASE_FILES = {
    "python/sglang/srt/server_args.py": "".join(f"line {i}\n" for i in range(1, 41)),
    "python/sglang/srt/utils.py": "def is_sm120_supported():\n    return False\n",
}


def write_tree(root: Path, files: Mapping[str, str]) -> None:
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(text.encode("utf-8"))


def make_patch(subject: str, base: Mapping[str, str], changed: Mapping[str, str]) -> str:
    """A normal-form patch turning `base` into `changed` (git diff, no index lines).

    Test modules call this at import time, so git runs sealed through `hermetic.git`
    (a fixture would come too late)."""
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        git("init", "-q", ".", cwd=root)
        write_tree(root, {path: base[path] for path in changed if path in base})
        git("add", "-A", ".", cwd=root)
        old_tree = git_output("write-tree", cwd=root)
        write_tree(root, changed)
        git("add", "-A", ".", cwd=root)
        new_tree = git_output("write-tree", cwd=root)
        diff = git(
            "diff", "--no-color", "--no-renames", "-U3", "--src-prefix=a/", "--dst-prefix=b/",
            old_tree, new_tree, cwd=root,
        ).stdout  # fmt: skip
    body = "".join(line for line in diff.splitlines(keepends=True) if not line.startswith("index "))
    return HEADER.format(subject=subject) + body


def write_manifest(root: Path, version: str = "0.5.9") -> None:
    """vendor/sglang.sha256 for the tree as it is now (as `import` would write it)."""
    hashes = manifest.hash_tree(root / "vendor" / "sglang")
    found = manifest.Manifest.create(version, {p: h for p, h in hashes.items() if h})
    (root / "vendor" / MANIFEST_NAME).write_text(manifest.dumps(found))


def make_fork(
    root: Path,
    patches: Mapping[str, str] | None = None,
    base: Mapping[str, str] = BASE_FILES,
    series: str | None = None,
) -> Path:
    """A fork repo at `root`: vendor/sglang from `base` and its manifest, the given
    patches and series."""
    write_tree(root / "vendor" / "sglang", base)
    write_manifest(root)
    patches_dir = root / "patches"
    patches_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (patches or {}).items():
        (patches_dir / name).write_bytes(text.encode("utf-8"))
    if series is None:
        series = "".join(f"{name}\n" for name in (patches or {}))
    (patches_dir / "series").write_text(series)
    return root


def edit(text: str, old: str, new: str) -> str:
    assert old in text, f"{old!r} not in text"
    return text.replace(old, new, 1)
