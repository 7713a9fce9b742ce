"""Re-apply an intent to a tree whose code moved or was reformatted.

Every edit is located on the code as it is before the intent (not on another
edit's output), so the edits of one file are spliced into it together.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import libcst as cst

from sm120fork.intent import edits
from sm120fork.intent.freenames import stored
from sm120fork.intent.locate import may_hold, scopes, within
from sm120fork.intent.model import NEW_FILE, Edit, Intent
from sm120fork.intent.present import present
from sm120fork.intent.source import Source, parsed


@dataclass(frozen=True)
class Reapplied:
    status: str  # "resolved", "upstreamed" or "not-found"
    detail: str
    changes: dict[str, str] = field(default_factory=dict)  # path -> new text


class _Tree:
    """The candidate files, read and parsed once, searched by each edit's scope."""

    def __init__(
        self,
        read: Callable[[str], str | None],
        candidates: Iterable[str],
        keep: frozenset[str] | None,
    ) -> None:
        self.read = read
        self.keep = keep
        self.paths = list(dict.fromkeys(candidates))
        self.texts: dict[str, str | None] = {}
        self.sources: dict[str, Source | None] = {}

    def find(self, edit: Edit) -> list[tuple[Source, cst.CSTNode]]:
        found: list[tuple[Source, cst.CSTNode]] = []
        for path in self.paths:
            if path not in self.texts:
                self.texts[path] = self.read(path)
            text = self.texts[path]
            if text is None or not may_hold(edit, text):
                continue
            if path not in self.sources:
                self.sources[path] = parsed(path, text, self.keep)
            source = self.sources[path]
            if source is not None:
                found.extend((source, node) for node in scopes(source, edit))
        return found


def reapply(
    intent: Intent, read: Callable[[str], str | None], candidates: Iterable[str]
) -> Reapplied:
    """Find each edit's scope among `candidates` (any module) and make the edits there."""
    tree = _Tree(read, candidates, _scope_names(intent))
    planned: dict[str, tuple[Source, list[edits.Splice]]] = {}
    already: list[str] = []
    adaptations: list[str] = []
    introduced = _introduced(intent)
    created: dict[str, str] = {}
    for order, edit in enumerate(intent.edits):
        if edit.scope == NEW_FILE:
            there = read(edit.name)
            if there is None:
                created[edit.name] = edit.code
            elif there == edit.code:
                already.append(f"{edit.where()}: upstream has it, byte for byte")
            else:
                detail = "the tree already has another file there; merge the two by hand"
                return Reapplied("not-found", f"{edit.where()}: {detail}")
            continue
        found = tree.find(edit)
        if not found:
            return Reapplied("not-found", f"{edit.where()}: not in the tree")
        fits, misses = _fits(found, edit, order, introduced)
        if len(fits) != 1:
            if fits:
                where = ", ".join(dict.fromkeys(fit[0].path for fit in fits))
                detail = f"{len(fits)} places fit ({where}); the intent is ambiguous there"
                return Reapplied("not-found", f"{edit.where()}: {detail}")
            return Reapplied("not-found", f"{misses[0]} the code no longer fits the intent")
        source, note, splices, adapted = fits[0]
        if note:
            already.append(f"{edit.where()} in {source.path}: {note}")
        else:
            planned.setdefault(source.path, (source, []))[1].extend(splices)
        if adapted:
            adaptations.append(f"{edit.where()}: {adapted}")
    if not planned and not created:
        return Reapplied("upstreamed", f"upstream's code already does it: {'; '.join(already)}")
    changes = dict(created)
    for path, (source, splices) in planned.items():
        text = _spliced(source.text, splices)
        if text is None:
            return Reapplied("not-found", f"two edits of the intent overlap in {path}")
        changes[path] = text
    detail = f"re-applied intent in {', '.join(changes)}: {intent.says}"
    if adaptations:
        detail += f" ({'; '.join(adaptations)})"
    if already:
        detail += f" (already upstream: {'; '.join(already)})"
    return Reapplied("resolved", detail, changes)


# where, what is already there, the splices, how the code was adapted to the place
Fit = tuple[Source, str, list[edits.Splice], str]


def _scope_names(intent: Intent) -> frozenset[str] | None:
    """What the edits' scopes are found by (a function's own name, a model
    architecture, a module's name): a function whose text names none of them cannot
    hold an edit, and is parsed as a skeleton (locate.Source.parse). None (parse
    whole) for an intent that edits a class's own statements, whose positions are
    worked out for the whole class."""
    if any(edit.scope == "class" for edit in intent.edits):
        return None
    return frozenset(e.name.rsplit(".", 1)[-1] for e in intent.edits if e.scope != NEW_FILE)


def _introduced(intent: Intent) -> frozenset[str]:
    """The names the intent's edits bind (a new function, an import), which its other
    edits' code may use (a new module's names need an import to be used)."""
    names: set[str] = set()
    for edit in intent.edits:
        if edit.scope == NEW_FILE:
            continue
        if edit.op == "import_beside":
            names.add(edit.code)
            continue
        with contextlib.suppress(SyntaxError):  # a `by` expression binds nothing new
            names |= stored(ast.parse(textwrap.dedent(edit.code).strip("\n")))
    return frozenset(names)


def _fits(
    found: list[tuple[Source, cst.CSTNode]], edit: Edit, order: int, introduced: frozenset[str]
) -> tuple[list[Fit], list[str]]:
    """The scopes where `edit` is already made or can be made, and why the others cannot
    (a name can be in several modules: the one holding the anchor is meant)."""
    fits: list[Fit] = []
    misses: list[str] = []
    for source, outer in found:
        inner = within(source, outer, edit)
        if not inner:  # the gate `within` names is gone: perhaps upstream made the change
            if note := present(source, outer, edit):
                fits.append((source, note, [], ""))
            else:
                misses.append(f"{source.path}: no `if {edit.within}` in {edit.where()};")
        for scope in inner:
            if note := present(source, scope, edit):
                fits.append((source, note, [], ""))
                continue
            try:
                planned = edits.plan(source, scope, edit, order, introduced)
                fits.append((source, "", planned.splices, planned.note))
            except edits.Missing as error:  # the scope that had the anchor says most
                miss = f"{source.path}: {error};"
                misses.insert(0 if error.anchored else len(misses), miss)
            except ValueError as error:  # a pattern that is not Python
                misses.append(f"{source.path}: {error};")
    return fits, misses


def _spliced(text: str, splices: list[edits.Splice]) -> str | None:
    ordered = sorted(splices)
    for first, second in itertools.pairwise(ordered):
        if second.start < first.end:
            return None
    for splice in reversed(ordered):
        text = text[: splice.start] + splice.text + text[splice.end :]
    return text
