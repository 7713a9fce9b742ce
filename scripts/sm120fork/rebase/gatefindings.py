"""The report's `gates` section: how the architecture gates moved between the releases.

The gate inventory of each pristine upstream tree, with the fork's decisions
(patches/gates.toml), compared by `sm120fork.gates.compare_trees` into a
`GateDiff`, which the rebase state keeps (`to_json` / `from_json`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sm120fork.gates import compare_trees, diff_inventories, load_policy, review_tree
from sm120fork.gates.diff import GateChange, GateDiff
from sm120fork.gates.model import Gate

KINDS = ("new", "changed", "moved", "removed", "unreviewed")


def findings(policy: Path, old_tree: Path, new_tree: Path) -> GateDiff:
    """Gate sites new, changed, moved or removed from `old_tree` to `new_tree`, and the
    new tree's gates that no decision covers."""
    return compare_trees(old_tree, new_tree, load_policy(policy))


def walk_findings(
    policy: Path, trees: list[tuple[str, Path]], progress: Callable[[str], None]
) -> tuple[dict[str, GateDiff], GateDiff]:
    """For a --step walk: each release's findings against the release before it, and the
    findings of the last tree against the first. `trees` is (version, tree), oldest
    first, starting with the pinned release; each tree is scanned once."""
    rules = load_policy(policy)
    found: dict[str, GateDiff] = {}
    inventories = []
    for version, tree in trees:
        progress(f"scanning the architecture gates of sglang {version}")
        inventories.append(review_tree(tree, rules))
        if len(inventories) > 1:
            found[version] = diff_inventories(inventories[-2], inventories[-1])
    return found, diff_inventories(inventories[0], inventories[-1])


def describe_gate(finding: Gate | GateChange) -> str:
    """One line for a gate finding: `file:line` `function`: `condition` (and what changed)."""
    site = finding.new if isinstance(finding, GateChange) else finding
    text = f"{site.file}:{site.line}"
    if site.function:
        text += f" `{site.function}`"
    if site.condition:
        text += f": `{site.condition}`"
    if isinstance(finding, GateChange) and finding.note:
        text += f" ({finding.note})"
    return text


def summary(gates: GateDiff) -> str:
    """`94 new, 13 changed, 10 moved, 18 removed; 79 unreviewed`, or that nothing changed."""
    counts = ", ".join(f"{len(gates.of_kind(kind))} {kind}" for kind in KINDS[:-1])
    if not any(gates.of_kind(kind) for kind in KINDS):
        return "no architecture gate changed between the two releases"
    return f"{counts}; {len(gates.unreviewed)} unreviewed"


def sm12x_changes(gates: GateDiff) -> list[str]:
    """The changed or moved gates whose answer for SM12x changed, one line each."""
    return [describe_gate(change) for change in (*gates.changed, *gates.moved) if change.note]
