"""The conflicts of a stopped 3-way merge that a rule resolves, in the order tried.

Each rule is named (the name is the strategy the report and the CHANGELOG
show) and takes one diff3 block (ours: the new upstream, base: the old one,
theirs: the patch), answering its merged lines or None. A merge is resolved
only if every block is resolved by some rule; anything else stays a conflict
for a person, and `why_not` says which blocks and why no rule could decide.
A file upstream deleted, that the patch changes, is resolved by deleting it:
the patch's hunks there go with it, and the reason says so (relocate.py has
looked for the code elsewhere first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

from sm120fork.patches.applier import write_changes
from sm120fork.patches.lines import split_lines
from sm120fork.rebase import adjacent, cosmetic
from sm120fork.rebase.conflicts import segments
from sm120fork.rebase.workrepo import WorkRepo

Rule = Callable[[list[str], list[str], list[str]], "list[str] | None"]


def _prose_edit(ours: list[str], base: list[str], theirs: list[str]) -> list[str] | None:
    if not adjacent.prose_only(ours, base):
        return None
    return adjacent.merged(ours, base, theirs, same_point=False)


def _adjacent_edit(ours: list[str], base: list[str], theirs: list[str]) -> list[str] | None:
    return adjacent.merged(ours, base, theirs, same_point=False)


def _two_insertions(ours: list[str], base: list[str], theirs: list[str]) -> list[str] | None:
    if not adjacent.same_point_insertions(ours, base, theirs):
        return None
    return adjacent.merged(ours, base, theirs, same_point=True)


RULES: tuple[tuple[str, Rule], ...] = (
    ("docstring", cosmetic.reworded_comments),  # same lines, re-worded comments
    ("import-list", cosmetic.merged_import),  # one `from M import ...` both changed
    ("import-list", cosmetic.merged_import_names),  # `name,` lines of one list
    ("docstring", _prose_edit),  # a comment or docstring re-written beside the patch
    ("adjacent-edits", _adjacent_edit),  # upstream changed code beside the patch
    ("two-insertions", _two_insertions),  # upstream's first: an order by rule
)
DELETED_FILE = "deleted-file"
PHRASES = {
    "docstring": "upstream re-worded a comment or docstring beside the patch",
    "import-list": "both sides changed the same import statement",
    "adjacent-edits": "upstream changed lines next to the patch's, not the same ones",
    "two-insertions": (
        "both sides inserted lines at one point (both kept, upstream's first: an order "
        "chosen by rule, for the gate rows to judge)"
    ),
}


@dataclass(frozen=True)
class Resolved:
    kinds: tuple[str, ...]  # the rules used, in RULES order, deleted-file last
    phrases: tuple[str, ...]
    deleted: tuple[str, ...] = ()  # the files upstream deleted, with the patch's hunks


def resolve_block(
    ours: list[str], base: list[str], theirs: list[str]
) -> tuple[list[str], str] | None:
    """The merged lines of one block and the rule's name, or None."""
    for name, rule in RULES:
        lines = rule(ours, base, theirs)
        if lines is not None:
            return lines, name
    return None


def resolve_text(text: str) -> tuple[str, set[str]] | None:
    """`text` (a file with diff3 conflict blocks) with every block resolved, and the
    rules used; None when some block is beyond every rule."""
    out: list[str] = []
    kinds: set[str] = set()
    for segment in segments(split_lines(text)):
        if isinstance(segment, str):
            out.append(segment)
            continue
        resolved = resolve_block(segment.ours, segment.base, segment.theirs)
        if not segment.closed or resolved is None:
            return None  # an unterminated block is not ours to guess
        out.extend(resolved[0])
        kinds.add(resolved[1])
    return "".join(out), kinds


def resolve_worktree(repo: WorkRepo) -> Resolved | None:
    """Resolve the stopped merge in the work tree if every conflict is a rule's; None
    (nothing written) otherwise."""
    texts: dict[str, str] = {}
    deleted: list[str] = []
    kinds: set[str] = set()
    for path, stages in repo.unmerged().items():
        file = repo.root / path
        if stages == {1, 3}:  # upstream deleted it, the patch changed it
            deleted.append(path)
            continue
        merged = resolve_text(file.read_text("utf-8")) if file.is_file() else None
        if merged is None:
            return None
        texts[path], kinds = merged[0], kinds | merged[1]
    write_changes(repo.root, {**texts, **dict.fromkeys(deleted)})
    order = [name for name, _ in RULES]
    used = sorted(kinds, key=order.index)
    phrases = [PHRASES[kind] for kind in used]
    if deleted:
        used.append(DELETED_FILE)
        names = ", ".join(PurePosixPath(p).name for p in sorted(deleted))
        phrases.append(f"upstream deleted {names} (the patch's hunks there go with it)")
    return Resolved(tuple(used), tuple(phrases), tuple(sorted(deleted)))


def why_not(repo: WorkRepo) -> str:
    """Why the stopped merge's conflicts are beyond the rules, one clause per file."""
    found: list[str] = []
    for path, stages in sorted(repo.unmerged().items()):
        name = PurePosixPath(path).name
        file = repo.root / path
        if stages == {1, 2}:
            found.append(f"the patch deletes {name}, which upstream changed")
            continue
        if stages == {1, 3}:
            found.append(f"upstream deleted {name}, and nothing else of the patch is left")
            continue
        if not file.is_file():
            continue
        blocks = [
            s
            for s in segments(split_lines(file.read_text("utf-8", "replace")))
            if not isinstance(s, str)
        ]
        stuck = [b for b in blocks if resolve_block(b.ours, b.base, b.theirs) is None]
        whys = [adjacent.why_not(b.ours, b.base, b.theirs) for b in stuck]
        for why in dict.fromkeys(whys):
            count = whys.count(why)
            found.append(f"in {name}, {count} block{'s' if count != 1 else ''} where {why}")
    return "; ".join(found)
