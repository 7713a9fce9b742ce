"""Is vendor/sglang still the release its lock pins? Checked against vendor/sglang.sha256.

The series is checked and carried against vendor/sglang, and the wheel is built
from upstream's wheel: a hand edit of the tree would make both silently wrong.
`problems` says, file by file, what differs and how to put it back; `require`
refuses to go on when anything does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from sm120fork.errors import FatalError
from sm120fork.paths import RepoPaths
from sm120fork.upstream import lock as lockfile
from sm120fork.upstream import manifest

SHOWN = 20  # files named one by one; the rest are counted (a re-import fixes them all)


@dataclass(frozen=True)
class Problem:
    where: str  # relative to the repository root
    what: str  # what is wrong
    fix: str  # how to put it back
    files: int = 1  # how many files it stands for (the last of many counts the rest)

    @property
    def message(self) -> str:
        return f"{self.what}; {self.fix}"


def problems(paths: RepoPaths) -> list[Problem]:
    """What makes vendor/sglang differ from its manifest (empty: pristine)."""
    manifest_file = paths.manifest_file
    where = manifest_file.relative_to(paths.root).as_posix()
    locked = lockfile.read(paths.lock_file)
    found = manifest.read(manifest_file)
    if found is None:
        what = "does not exist, so nothing says vendor/sglang is upstream's release"
        return [Problem(where, what, f"re-vendor with {_reimport(locked, None)}")]
    if locked is not None and locked.version != found.version:
        what = f"is for sglang {found.version} but vendor/sglang.lock pins {locked.version}"
        return [Problem(where, what, f"re-vendor with {_reimport(locked, found)}")]
    tree = paths.upstream_tree.relative_to(paths.root).as_posix()
    differences = manifest.verify(paths.upstream_tree, found)
    fix = _reimport(locked, found)
    shown = [_problem(d, found.version, fix, tree) for d in differences]
    if len(shown) <= SHOWN:
        return shown
    rest = Counter(d.kind for d in differences[SHOWN:])
    counted = ", ".join(f"{n} {kind}" for kind, n in sorted(rest.items()))
    rest_count = len(differences) - SHOWN
    what = f"and {rest_count} more files differ from {where} ({counted})"
    more = Problem(tree, what, f"re-vendor with {fix}", files=rest_count)
    return [*shown[:SHOWN], more]


def require(paths: RepoPaths, why: str) -> None:
    """Refuse (FatalError) unless vendor/sglang is exactly its manifest; `why` says
    what would go wrong, e.g. "the wheel would not be built from the checked tree"."""
    found = problems(paths)
    if found:
        first = found[0]
        others = sum(problem.files for problem in found) - 1
        more = f" (and {others} more)" if others else ""
        raise FatalError(
            f"{first.where}{more}: {first.what}; {why}: "
            "run `sm120fork check`, which lists every file and how to restore it"
        )


def _problem(difference: manifest.Difference, version: str, fix: str, tree: str) -> Problem:
    path = f"{tree}/{difference.path}"
    restore = f"restore it with `git checkout -- {path}` or re-vendor with {fix}"
    if difference.kind == "changed":
        what = f"differs from sglang {version} (its sha256 is not the one in the manifest)"
        return Problem(
            path, what, f"vendor/ is never edited by hand: {restore}; changes go in a patch"
        )
    if difference.kind == "deleted":
        return Problem(path, f"is missing (sglang {version} has it)", restore)
    if difference.kind == "added":
        what = f"is not part of sglang {version}"
        return Problem(path, what, "delete it; a new file goes in a patch")
    what = f"is a link or special file, which sglang {version} does not ship"
    return Problem(path, what, f"delete it, then {restore}")


def _reimport(locked: lockfile.Lock | None, found: manifest.Manifest | None) -> str:
    version = locked.version if locked else found.version if found else "VERSION"
    source = f" --upstream-git {locked.url}" if locked and locked.source == "git" else ""
    return f"`sm120fork import {version}{source}`"
