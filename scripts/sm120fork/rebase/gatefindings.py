"""The report's `gates` section: how the architecture gates moved between the releases.

The gate inventory of each pristine upstream tree, with the fork's decisions
(patches/gates.toml), compared by `sm120fork.gates.compare_trees`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sm120fork.gates import compare_trees, diff_inventories, load_policy, review_tree

KINDS = ("new", "changed", "moved", "removed", "unreviewed")


def empty() -> dict[str, list[Any]]:
    return {kind: [] for kind in KINDS}


def findings(policy: Path, old_tree: Path, new_tree: Path) -> dict[str, list[Any]]:
    """Gate sites new, changed, moved or removed from `old_tree` to `new_tree`, and the
    new tree's gates that no decision covers (JSON-ready)."""
    return compare_trees(old_tree, new_tree, load_policy(policy)).to_json()


def walk_findings(
    policy: Path, trees: list[tuple[str, Path]], progress: Callable[[str], None]
) -> tuple[dict[str, dict[str, list[Any]]], dict[str, list[Any]]]:
    """For a --step walk: each release's findings against the release before it, and the
    findings of the last tree against the first. `trees` is (version, tree), oldest
    first, starting with the pinned release; each tree is scanned once."""
    rules = load_policy(policy)
    found: dict[str, dict[str, list[Any]]] = {}
    inventories = []
    for version, tree in trees:
        progress(f"scanning the architecture gates of sglang {version}")
        inventories.append(review_tree(tree, rules))
        if len(inventories) > 1:
            found[version] = diff_inventories(inventories[-2], inventories[-1]).to_json()
    return found, diff_inventories(inventories[0], inventories[-1]).to_json()


def describe_gate(gate: dict[str, Any]) -> str:
    """One line for a gate finding: `file:line` `function`: `condition` (and what changed)."""
    change = gate if "new" in gate else None
    site: dict[str, Any] = gate["new"] if change else gate
    text = f"{site.get('file', '?')}:{site.get('line', '?')}"
    if site.get("function"):
        text += f" `{site['function']}`"
    if site.get("condition"):
        text += f": `{site['condition']}`"
    if change and change.get("note"):
        text += f" ({change['note']})"
    return text


def summary(gates: dict[str, list[Any]]) -> str:
    """`94 new, 13 changed, 10 moved, 18 removed; 79 unreviewed`, or that nothing changed."""
    counts = ", ".join(f"{len(gates.get(kind, []))} {kind}" for kind in KINDS[:-1])
    if not any(gates.get(kind) for kind in KINDS):
        return "no architecture gate changed between the two releases"
    return f"{counts}; {len(gates.get('unreviewed', []))} unreviewed"


def sm12x_changes(gates: dict[str, list[Any]]) -> list[str]:
    """The changed or moved gates whose answer for SM12x changed, one line each."""
    return [
        describe_gate(change)
        for kind in ("changed", "moved")
        for change in gates.get(kind, [])
        if change.get("note")
    ]
