"""Helpers for the gate-inventory tests: small synthetic sglang trees.

Each scenario is a few Python sources laid out as upstream does
(`<root>/python/sglang/...`), scanned in-process (one worker).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path

from sm120fork.gates import Gate, Inventory, scan_tree
from sm120fork.gates.model import ARCHS

ARCH_NAMES = tuple(a.name for a in ARCHS)


def make_tree(root: Path, files: Mapping[str, str]) -> Path:
    """Write `files` (paths under python/sglang/) into a tree; return its root."""
    package = root / "python" / "sglang"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").touch()
    for rel, text in files.items():
        path = package / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.parent.relative_to(package).parents:
            (package / parent / "__init__.py").touch()
        (path.parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return root


def scan(root: Path, files: Mapping[str, str]) -> Inventory:
    return scan_tree(make_tree(root, files), workers=1)


def answers(gate: Gate) -> str:
    """One letter per architecture: T, F or ? (depends)."""
    return "".join({"yes": "T", "no": "F"}.get(gate.archs[a].word, "?") for a in ARCH_NAMES)


def only(inventory: Inventory, condition: str) -> Gate:
    found = [g for g in inventory.gates if g.condition == condition]
    assert len(found) == 1, f"{condition!r}: {[g.condition for g in inventory.gates]}"
    return found[0]


def conditions(inventory: Inventory) -> list[str]:
    return [g.condition for g in inventory.gates]
