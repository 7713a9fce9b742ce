"""patches/intents.toml as a landing writes it: the intents of dropped patches gone, the
functions followed to new names written in, and every other intent proven again on
the new base, as `check` will.

An intent that no longer reproduces its landed patch (a rule, a merge or a person
carried the patch, and the recipe still describes the old code) is marked
`stale = "<why>"`: `check` does not prove a stale intent but names it, so the
landed fork is consistent and the maintainer knows which recipe to re-derive; the
carry may still try it (its result is verified by the patch's rows like any
other), and a later landing where it reproduces again clears the mark.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

from sm120fork.intent import renames
from sm120fork.intent.model import Intent, load_intents
from sm120fork.intent.proofcache import reapply_kept
from sm120fork.patches.applier import ApplyError, Overlay, apply_patch
from sm120fork.patches.patchfile import PatchFile

_INTENT = re.compile(r"^(?=\[\[intent\]\][ \t]*$)", re.MULTILINE)
_STALE = re.compile(r"^stale = .*\n", re.MULTILINE)


def _blocks(text: str) -> tuple[str, list[str]]:
    head, *blocks = _INTENT.split(text)
    return head, blocks


def _patch_of(block: str) -> str | None:
    name = tomllib.loads(block)["intent"][0].get("patch")
    return name if isinstance(name, str) else None


def written(
    path: Path,
    dropped: set[str],
    renamed: Mapping[str, Mapping[str, str]],
    tree: Path,
    patches: Iterable[PatchFile],
    version: str,
) -> dict[str, str]:
    """Rewrite `path` for the landed series `patches` on `tree` (sglang `version`);
    the patches whose intent is now stale, with why."""
    if not path.is_file():
        return {}
    head, blocks = _blocks(path.read_text("utf-8"))
    blocks = [b for b in blocks if _patch_of(b) not in dropped]
    blocks = [_renamed(b, renamed) for b in blocks]
    path.write_text(head + "".join(blocks), encoding="utf-8")
    stale = unproven(tree, patches, load_intents(path), version)
    marked = [_marked(b, stale.get(_patch_of(b) or "")) for b in blocks]
    path.write_text(head + "".join(marked), encoding="utf-8")
    return stale


def _renamed(block: str, renamed: Mapping[str, Mapping[str, str]]) -> str:
    name = _patch_of(block)
    return renames.renamed_text(block, dict(renamed[name])) if name and name in renamed else block


def _marked(block: str, why: str | None) -> str:
    """The block with its `stale` line set to `why`, or removed (None)."""
    block = _STALE.sub("", block)
    if why is None:
        return block
    end = block.index("\n", block.index("patch = ")) + 1
    return block[:end] + f"stale = {json.dumps(why)}\n" + block[end:]


def stale(path: Path) -> tuple[tuple[str, str], ...]:
    """(patch, why) of every intent in `path` marked stale, for the landing's report."""
    return tuple((name, i.stale) for name, i in sorted(load_intents(path).items()) if i.stale)


def unproven(
    tree: Path, patches: Iterable[PatchFile], intents: Mapping[str, Intent], version: str
) -> dict[str, str]:
    """The patches whose intent does not reproduce them on `tree` (each patch applied
    exactly on the ones before it), with why."""
    overlay = Overlay(tree)
    found: dict[str, str] = {}
    for patch in patches:
        intent = intents.get(patch.name)
        recipe = reapply_kept(intent, overlay.read, patch.paths) if intent else None
        try:
            apply_patch(overlay, patch)
        except ApplyError:
            return found  # `check` says why; the landing verified every patch applies
        after = {path: overlay.read(path) for path in patch.paths}
        if recipe is not None and recipe.changes != after:
            found[patch.name] = (
                f"since {version}: the recipe does not reproduce the landed patch "
                f"({recipe.status}); re-derive it from the patch"
            )
    return found
