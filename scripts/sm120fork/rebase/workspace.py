"""Where a rebase works: what every phase is handed (`Workspace`), and its progress lines.

Not `commands/rebase.run()`: the workspace is the rebase's area (build/rebase,
or a temporary directory for --dry-run), the store its state is saved to, the
releases fetched there and the gate findings computed from them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from sm120fork.gates import warm
from sm120fork.gates.diff import GateDiff
from sm120fork.paths import RepoPaths
from sm120fork.rebase import gatefindings, targets
from sm120fork.rebase.state import RebaseState, Store

PREFIX = "sm120fork rebase"


def say(message: str) -> None:
    """Progress, on stderr."""
    print(f"{PREFIX}: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Workspace:
    """The rebase's area, the store of its state, and what is computed from them."""

    paths: RepoPaths
    area: Path  # build/rebase, or a temporary directory for --dry-run
    store: Store
    dry_run: bool = False

    @property
    def work(self) -> Path:
        """The work repository (its work tree is where a person resolves conflicts)."""
        return self.area / "work"

    def release_dir(self, version: str) -> Path:
        return self.area / "upstream" / version

    def tree(self, version: str) -> Path:
        return targets.tree(self.release_dir(version))

    def manifest(self, version: str) -> Path:
        return targets.manifest_file(self.release_dir(version))

    @property
    def reports(self) -> Path:
        return self.paths.rebase_dir

    def save(self, state: RebaseState) -> RebaseState:
        self.store.save(state)
        return state

    def gates(self, state: RebaseState) -> GateDiff:
        """The report's gates section: the pinned release against the final target."""
        if state.gates is not None:
            return state.gates
        say("comparing the architecture gates of the two releases")
        warm.wait()
        policy = self.paths.patches_dir / "gates.toml"
        return gatefindings.findings(
            policy, self.paths.upstream_tree, self.tree(state.final.version)
        )

    def release_gates(self, state: RebaseState) -> RebaseState:
        """With --step: `state` with each release's gate findings against the one before,
        and the report's gates section from the same scans (call it before `gates`)."""
        if not state.step_mode or state.release_gates is not None:
            return state
        trees = [(state.from_version, self.paths.upstream_tree)]
        trees += [(target.version, self.tree(target.version)) for target in state.targets]
        policy = self.paths.patches_dir / "gates.toml"
        warm.wait()
        found, overall = gatefindings.walk_findings(policy, trees, say)
        gates = state.gates if state.gates is not None else overall
        return self.save(replace(state, release_gates=found, gates=gates))
