"""Names a carried patch uses that the new upstream no longer defines.

A patch can apply cleanly, or at shifted lines, and still be broken: 0.5.21
stopped importing `is_sm120_supported` into `arg_groups/overrides.py`, and the
DeepSeek patch's `elif is_sm120_supported():` carried over it at an offset. The
result is a NameError on every GPU that reaches the branch. So after a patch is
carried (by any route) or resolved by hand, the Python files it changes are
checked with pyflakes, and an undefined name or a syntax error on one of the
patch's own added lines stops the rebase there for a person.

Only the patch's added lines count (upstream's own code is upstream's business),
and only names that are news: a name the patched file already lacked at the
previous release, or that the new upstream file itself uses undefined (a star
import, a name injected at run time), is not reported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import PurePosixPath

from sm120fork.patches.diffs import git_hunks
from sm120fork.rebase.workrepo import WorkRepo


@dataclass(frozen=True)
class Breakage:
    file: str
    line: int
    text: str  # the added line
    problem: str  # "undefined name `x`" or "does not parse: ..."

    def describe(self) -> str:
        return f"{self.problem} ({PurePosixPath(self.file).name}:{self.line})"


def broken_lines(repo: WorkRepo, old: str, new: str, before: str = "") -> list[Breakage]:
    """Problems on the lines commit `new` adds to the Python files it changes from `old`;
    `before` is the patch's commit at the previous release. Names undefined in `before`'s
    file or in `old`'s are the baseline."""
    found: list[Breakage] = []
    for path in repo.changed_paths(old, new):
        if not path.endswith(".py"):
            continue
        text = repo.read(new, path)
        if text is None:
            continue
        added = _added_lines(repo, old, new, path)
        suspects = [(line, problem) for line, problem in _problems(text, path) if line in added]
        if not suspects:
            continue  # the common case: one parse of the file, no baselines needed
        baselines = [repo.read(old, path), repo.read(before, path) if before else None]
        known = {p for t in baselines if t is not None for _, p in _problems(t, path)}
        lines = text.splitlines()
        for line, problem in suspects:
            if problem not in known:
                shown = lines[line - 1] if 0 < line <= len(lines) else ""
                found.append(Breakage(path, line, shown, problem))
    return found


def _added_lines(repo: WorkRepo, old: str, new: str, path: str) -> set[int]:
    diff = repo.out("diff", "-U0", "--no-renames", "--no-color", old, new, "--", path)
    added: set[int] = set()
    for hunk in git_hunks(diff):
        added.update(range(hunk.new_start, hunk.new_start + hunk.new_count))
    return added


def _problems(text: str, path: str) -> list[tuple[int, str]]:
    # Imported here: only a rebase needs pyflakes, not every command of the tool.
    from pyflakes import checker, messages

    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as error:
        return [(error.lineno or 0, f"does not parse: {error.msg}")]
    found = []
    for message in checker.Checker(tree, filename=path).messages:
        if isinstance(message, messages.UndefinedName):
            found.append((message.lineno, f"undefined name `{message.message_args[0]}`"))
    return found
