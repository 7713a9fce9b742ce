"""Gate intelligence: find every architecture gate of an sglang tree, evaluate
it per architecture, apply the fork's review policy, compare two releases.

    inventory = apply_policy(scan_tree(root), load_policy(path))
    changes = diff_inventories(old_inventory, new_inventory)
    write_reports(inventory, out_dir, changes)
"""

from __future__ import annotations

from pathlib import Path

from sm120fork.gates.decide import apply_policy
from sm120fork.gates.diff import GateChange, GateDiff, diff_inventories
from sm120fork.gates.model import ARCHS, Arch, Gate, GateKey, Inventory, ScanProblem
from sm120fork.gates.policy import Policy, load_policy
from sm120fork.gates.report import write_reports
from sm120fork.gates.scan import scan_tree


def review_tree(
    root: Path,
    policy: Policy,
    *,
    workers: int | None = None,
    files: list[tuple[str, str, int]] | None = None,
) -> Inventory:
    """The tree's gates with the policy's decisions (`files`: see `scan_tree`)."""
    return apply_policy(scan_tree(root, workers=workers, files=files), policy)


def compare_trees(old_root: Path, new_root: Path, policy: Policy) -> GateDiff:
    """What changed in the gates from one upstream tree to another (for a rebase)."""
    return diff_inventories(review_tree(old_root, policy), review_tree(new_root, policy))


__all__ = [
    "ARCHS",
    "Arch",
    "Gate",
    "GateChange",
    "GateDiff",
    "GateKey",
    "Inventory",
    "Policy",
    "ScanProblem",
    "apply_policy",
    "compare_trees",
    "diff_inventories",
    "load_policy",
    "review_tree",
    "scan_tree",
    "write_reports",
]
