"""What a finished rebase lands: the new tree, its lock and manifest, patches/, CHANGELOG.md.

Each writer fills one staged copy (see finalize.py). A patch whose diff did
not change keeps its bytes, `Last-Update` included; a changed one gets
`Last-Update` = today ($SM120FORK_DATE). Upstreamed and dropped patches leave
the series, patches/ and patches/intents.toml.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from sm120fork import lock
from sm120fork.errors import FatalError
from sm120fork.gates.diff import GateDiff
from sm120fork.lines import split_lines
from sm120fork.normalform import render_patch
from sm120fork.patchfile import parse_patch
from sm120fork.paths import RepoPaths
from sm120fork.rebase import changelog, fate
from sm120fork.rebase.finalize import Writer
from sm120fork.rebase.state import PatchState, RebaseState
from sm120fork.series import read_series

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

INTENTS = "intents.toml"
_INTENT = re.compile(r"^(?=\[\[intent\]\][ \t]*$)", re.MULTILINE)


def writers(
    paths: RepoPaths,
    state: RebaseState,
    new_tree: Path,
    new_manifest: Path,
    gates: GateDiff,
) -> dict[Path, Writer]:
    today = lock.today()

    def tree(dest: Path) -> None:
        shutil.copytree(new_tree, dest, symlinks=True)

    def lock_file(dest: Path) -> None:
        dest.write_bytes(state.final.lock_text.encode("utf-8"))

    def manifest_file(dest: Path) -> None:
        try:
            shutil.copyfile(new_manifest, dest)
        except FileNotFoundError:  # fetched by a tool from before the manifest
            raise FatalError(
                f"{new_manifest} is missing; run `rebase --abort`, then start the rebase again"
            ) from None

    def patches(dest: Path) -> None:
        shutil.copytree(paths.patches_dir, dest, symlinks=True)
        series = read_series(paths.series_file)
        dropped = {patch.name for patch in state.patches if fate.leaves_series(patch.status)}
        for patch in state.patches:
            if patch.name in dropped:
                (dest / patch.name).unlink()
                series = series.without(patch.name)
            else:
                original = (paths.patches_dir / patch.name).read_bytes()
                (dest / patch.name).write_bytes(patch_bytes(original, patch, today))
        (dest / "series").write_bytes(series.render().encode("utf-8"))
        intents = dest / INTENTS
        if intents.is_file() and dropped:
            text = intents.read_text("utf-8")
            intents.write_bytes(without_intents(text, dropped).encode("utf-8"))

    def changelog_file(dest: Path) -> None:
        current = paths.changelog.read_text("utf-8") if paths.changelog.is_file() else None
        text = changelog.insert(current, changelog.entry(state, gates, today))
        dest.write_bytes(text.encode("utf-8"))

    return {
        paths.upstream_tree: tree,
        paths.manifest_file: manifest_file,
        paths.lock_file: lock_file,
        paths.patches_dir: patches,
        paths.changelog: changelog_file,
    }


def patch_bytes(original: bytes, patch: PatchState, today: str) -> bytes:
    """The carried patch file: the original bytes if its diff is unchanged, else
    the new diff under the original header with Last-Update = `today`."""
    carried = patch.text.encode("utf-8")
    if carried == original:
        return original
    parsed = parse_patch(carried, patch.name, patch.strip)
    diff = "".join(split_lines(patch.text)[parsed.header_lines :])
    return render_patch(parsed.header.with_last_update(today), diff)


def without_intents(text: str, dropped: set[str]) -> str:
    """patches/intents.toml without the `[[intent]]` blocks of `dropped` patches
    (`check` refuses an intent for a patch the series lacks); the rest verbatim."""
    head, *blocks = _INTENT.split(text)
    kept = [b for b in blocks if tomllib.loads(b)["intent"][0].get("patch") not in dropped]
    return head + "".join(kept)
