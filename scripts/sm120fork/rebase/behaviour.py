"""The behaviour strategy: a patch no other strategy carried is `upstreamed` when the
new pristine release already gives SM12x what the patch's own gate-table rows expect.

The last strategy before the final conflict. Upstream often makes the fork's
decision with other code (a new branch, a narrowed condition, the choice moved to
another module), so no text of the patch matches; what the decision does is what
the gate table records. For the rows whose `patch` names the patch (gaterows.py)
the SM12x cells are observed on the target release's pristine tree (the work
repository's `target.base_commit`), in that release's gate environment (installed
when missing: a rebase to one release needs it anyway). Every cell must match,
with one allowance: a cell that expects the patch's own refusal (`raises:` with
words the patch itself adds) is met by upstream refusing at the same point in its
own words; the reason quotes them.

Then the patch is upstreamed, its reason names the rows, and, where the gate
inventory can tell, the upstream gates of the patch's files whose SM12x answer
changed in this release. Otherwise (a cell differs, the environment cannot be had,
the harness fails) the strategy says why and the patch stays a conflict: never a
silent pass. A patch without rows is not this strategy's case (None).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Protocol

from sm120fork.errors import FatalError
from sm120fork.gates import compare_trees, load_policy
from sm120fork.patches.applier import write_changes
from sm120fork.patches.patchfile import PatchFile
from sm120fork.paths import RepoPaths
from sm120fork.rebase import gaterows
from sm120fork.rebase.gatefindings import describe_gate
from sm120fork.rebase.merge import conflict
from sm120fork.rebase.state import Target
from sm120fork.rebase.strategy import CarriedPatch, CarryContext, Outcome
from sm120fork.rebase.workrepo import WorkRepo
from sm120fork.rebase.workspace import say

NAME = "behaviour"
_LITERAL = re.compile(r"""(["'])((?:\\.|(?!\1).)*)\1""")
_SHOWN = 3  # rows and gates quoted in a reason


class Context(Protocol):
    """What the strategy reads of the carry's context."""

    @property
    def repo(self) -> WorkRepo: ...
    @property
    def target(self) -> Target: ...
    @property
    def fork_root(self) -> Path: ...


class Carried(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def parsed(self) -> PatchFile: ...


def try_behaviour(ctx: CarryContext, patch: CarriedPatch) -> Outcome | None:
    """`upstreamed` when the pristine release gives the patch's SM12x cells; otherwise
    the final conflict (merge.conflict), its reason saying what the rows showed or why
    they could not run; None (nothing touched) when no row names the patch."""
    judged = judge(ctx, patch, say)
    if judged is None:
        return None
    upstreamed, why = judged
    if upstreamed:
        return Outcome("upstreamed", why, strategy=NAME)
    stopped = conflict(ctx, patch)
    return replace(stopped, reason=f"{stopped.reason}; its gate rows did not settle it: {why}")


def judge(ctx: Context, patch: Carried, progress: Callable[[str], None]) -> tuple[bool, str] | None:
    """(upstreamed, why), or None when no row names the patch."""
    rows = gaterows.rows_of(ctx.fork_root, patch.name)
    if not rows:
        return None
    version = ctx.target.version
    listed = f"{len(rows)} gate-table row{'s' if len(rows) != 1 else ''}"
    try:
        env = gaterows.gate_env(ctx.fork_root, version, progress)
        tree = gaterows.pristine_tree(ctx.repo, ctx.target.base_commit, version)
        archs = gaterows.sm12x_archs(ctx.fork_root)
        progress(
            f"running {patch.name}'s {listed} on pristine sglang {version} "
            f"({', '.join(archs)}) in {env.venv}"
        )
        cells = gaterows.observe(env, ctx.fork_root, tree, rows, archs, patch.name)
    except FatalError as error:
        return False, (
            f"its {listed} could not be run on pristine sglang {version}, so whether upstream "
            f"now makes its decision is untold: {error.message}"
        )
    added = added_text(patch.parsed)
    upstreamed, why = verdict(version, listed, cells, added)
    return upstreamed, (_evidence(ctx, patch, why) if upstreamed else why)


def verdict(version: str, listed: str, cells: list[gaterows.Cell], added: str) -> tuple[bool, str]:
    """Whether the observed SM12x `cells` are the patched ones (`added`: the lines the
    patch adds, whose refusal words upstream may say otherwise), and why."""
    wrong = [c for c in cells if not c.ok and not _own_refusal(c, added)]
    if not cells or wrong:
        shown = "; ".join(
            f"{c.label} {c.arch}: patched {c.expected}, upstream {c.observed}"
            for c in wrong[:_SHOWN]
        )
        return False, (
            f"pristine sglang {version} does not give SM12x what its {listed} expect "
            f"({shown or 'no SM12x cell observed'}{_more(len(wrong))}), so upstream does "
            "not make the patch's decision and the patch is still needed"
        )
    labels = sorted({c.label for c in cells}, key=lambda label: int(label.split()[1]))
    rows = ", ".join(labels[:_SHOWN]) + _more(len(labels))
    archs = sorted({c.arch for c in cells})
    words = sorted({c.observed for c in cells if not c.ok})
    refusal = f"; it refuses where the patch does, in its own words ({words[0]})" if words else ""
    return True, (
        f"upstream {version} already gives {'/'.join(archs)} what the patch's own rows "
        f"expect ({rows}, run on the pristine release){refusal}"
    )


def _more(count: int) -> str:
    return f" and {count - _SHOWN} more" if count > _SHOWN else ""


def _own_refusal(cell: gaterows.Cell, added: str) -> bool:
    """A cell expecting the patch's own refusal message, met by upstream refusing. The
    words are the patch's when its added lines hold them, or hold what follows their
    first `: ` (a prefix such as `--attention-backend trtllm_mla: ` the patch formats
    at run time)."""
    words = cell.expects_raise
    if not words or not cell.raised:
        return False
    tail = words.partition(": ")[2]
    return words in added or (len(tail) >= 20 and tail in added)


def added_text(patch: PatchFile) -> str:
    """The lines the patch adds, then the string literals among them joined as Python
    joins adjacent literals (a message split over lines reads whole)."""
    lines = [
        line.text
        for diff in patch.files
        for hunk in diff.hunks
        for line in hunk.lines
        if line.tag == "+"
    ]
    literals = "".join(m.group(2) for line in lines for m in _LITERAL.finditer(line))
    return "\n".join(lines) + "\n" + literals


def _evidence(ctx: Context, patch: Carried, why: str) -> str:
    where = _changed_gates(ctx, patch)
    return f"{why}; its gates there: {where}" if where else why


def _changed_gates(ctx: Context, patch: Carried) -> str:
    """The gates of the patch's files whose SM12x answer changed from the release before
    (its pristine commit is the parent of this one's), or new there; "" if none."""
    files = sorted({diff.path for diff in patch.parsed.files})
    repo = ctx.repo
    previous = repo.out("rev-parse", f"{ctx.target.base_commit}^")
    try:
        with tempfile.TemporaryDirectory(prefix="sm120-behaviour-") as tmp:
            trees = []
            for label, commit in (("old", previous), ("new", ctx.target.base_commit)):
                root = Path(tmp) / label
                write_changes(root, {path: repo.read(commit, path) for path in files})
                root.mkdir(exist_ok=True)
                trees.append(root)
            policy = load_policy(RepoPaths(ctx.fork_root).gates_policy)
            diff = compare_trees(trees[0], trees[1], policy)
    except (OSError, ValueError, FatalError):
        return ""
    found = [describe_gate(c) for c in (*diff.changed, *diff.moved) if c.note]
    found += [f"new {describe_gate(g)}" for g in diff.new]
    names = ", ".join(PurePosixPath(f).name for f in files)
    return "; ".join(found[:_SHOWN]) + (f" (of {len(found)} in {names})" if found else "")
