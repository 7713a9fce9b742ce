"""`sm120fork gates`: inventory the architecture gates, with the fork's decisions.

Exit 0 when every gate is reviewed, 1 when some are not (or a file could not
be scanned, or the policy names a patch the series lacks). `--against DIR`
also compares with another upstream tree and writes the diff.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sm120fork.errors import EXIT_FINDINGS, EXIT_OK
from sm120fork.gates import diff_inventories, review_tree, write_reports
from sm120fork.gates.diff import GateDiff
from sm120fork.gates.model import OPEN, Gate, Inventory
from sm120fork.gates.policy import Policy, load_policy, missing_patches, unmatched_added
from sm120fork.gates.report import needs_attention, summary
from sm120fork.patches.series import read_series
from sm120fork.patches.stack import apply_stack, load_stack
from sm120fork.paths import RepoPaths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tree", type=Path, help="upstream tree to inventory (default: vendor/sglang)"
    )
    parser.add_argument("--policy", type=Path, help="review policy (default: patches/gates.toml)")
    parser.add_argument("--out", type=Path, help="report directory (default: build/gates)")
    parser.add_argument(
        "--against",
        type=Path,
        metavar="DIR",
        help="another upstream tree (the directory holding python/sglang): "
        "also write the gate diff from --tree to it (diff.json, diff.md)",
    )
    parser.add_argument("--workers", type=int, help="processes to scan with (default: CPUs)")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="also fail on stale policy entries (policy entries that match no gate)",
    )


def _line(gate: Gate, what: str) -> str:
    return f"{gate.where}: {what} in {gate.function}: {gate.condition}"


def _report(inventory: Inventory, label: str) -> None:
    info = summary(inventory)
    decided = ", ".join(f"{n} {d}" for d, n in info["decisions"].items() if n)
    print(
        f"{label}: {info['gates']} gates in {info['files_with_gates']} files "
        f"({inventory.files_parsed}/{inventory.files_total} files parsed): {decided}"
    )


def run(args: argparse.Namespace) -> int:
    paths = RepoPaths(args.repo)
    tree = args.tree or paths.upstream_tree
    policy = load_policy(args.policy or paths.gates_policy)
    inventory = _shown(review_tree(tree, policy, workers=args.workers), paths)
    new: Inventory | None = None
    changes: GateDiff | None = None
    if args.against is not None:
        new = _shown(review_tree(args.against, policy, workers=args.workers), paths)
        changes = diff_inventories(inventory, new)
    out = args.out or paths.build_dir / "gates"
    write_reports(inventory, out, changes)

    failed = _findings(inventory, policy, paths, strict=args.strict)
    if Path(tree).resolve() == paths.upstream_tree.resolve():
        failed = _added_findings(policy, paths, strict=args.strict) or failed
    _report(inventory, inventory.root)
    if new is not None and changes is not None:
        _report(new, new.root)
        counts = ", ".join(f"{len(v)} {k}" for k, v in changes.to_json().items())
        print(f"diff {inventory.root} -> {new.root}: {counts} (see {out / 'diff.md'})")
        failed = failed or bool(changes.unreviewed)
    print(f"reports in {out}")
    return EXIT_FINDINGS if failed else EXIT_OK


def _shown(inventory: Inventory, paths: RepoPaths) -> Inventory:
    """The inventory naming its tree relative to the repository when inside it."""
    root = Path(inventory.root).resolve()
    try:
        shown = root.relative_to(paths.root.resolve()).as_posix()
    except ValueError:
        return inventory
    return inventory.with_gates(inventory.gates, root=shown)


def _added_findings(policy: Policy, paths: RepoPaths, *, strict: bool) -> bool:
    """Entries for gates the series adds, checked against the patched sources."""
    if not policy.added:
        return False
    overlay = apply_stack(paths.upstream_tree, load_stack(paths).patches)
    unmatched = unmatched_added(policy, overlay.read)
    for entry in unmatched:
        print(f"{entry}: added gate not found in the patched tree", file=sys.stderr)
    return strict and bool(unmatched)


def _findings(inventory: Inventory, policy: Policy, paths: RepoPaths, *, strict: bool) -> bool:
    """Print every finding; True if any fails the command."""
    failed = False
    for gate in inventory.unreviewed:
        print(_line(gate, "unreviewed gate"))
        failed = True
    for problem in inventory.problems:
        print(f"{problem.file}: scan problem: {problem.message}")
        failed = True
    if paths.series_file.is_file():
        for patch in missing_patches(policy, read_series(paths.series_file).names):
            print(f"{policy.source}: names {patch}, which patches/series does not list")
            failed = True
    for gate in inventory.gates:
        if gate.decision == OPEN:
            print(_line(gate, f"open gate (SM12x is wrong here, no fix yet): {gate.reason}"))
            failed = True
        elif needs_attention(gate):
            # SM12x reaches code it cannot run and the review did not say why that is fine.
            token = gate.wrongly_included_token
            print(_line(gate, f"wrongly included ({token}), decision {gate.decision}"))
            failed = True
    for entry in inventory.stale_policy:
        print(f"{entry}: policy entry matches no gate", file=sys.stderr)
        failed = failed or strict
    for helper in inventory.unknown_helpers:
        print(f"helper of unknown meaning (evaluated as depends): {helper}", file=sys.stderr)
    return failed
