"""`check`: every way the series, its files and the vendored tree can disagree, as findings.

Unlike `stack.load_stack`, nothing here stops at the first problem: a
maintainer fixing a broken series wants the whole list at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.intent.model import Intent, load_intents
from sm120fork.intent.proofcache import reapply_kept
from sm120fork.patches import dep3
from sm120fork.patches.applier import ApplyError, Overlay, apply_patch
from sm120fork.patches.gitobjects import Files
from sm120fork.patches.normalform import DiffRenderer, render_patch
from sm120fork.patches.patchfile import PatchFile, PatchFileError, load_patch
from sm120fork.patches.series import Series, duplicate_entries, read_series
from sm120fork.paths import RepoPaths
from sm120fork.upstream import pristine

INTENTS_FILE = "intents.toml"


@dataclass(frozen=True, order=True)
class Finding:
    where: str  # a path relative to the repository root
    line: int  # 0: the file as a whole (a vendored file that differs, or is missing)
    message: str

    def __str__(self) -> str:
        if not self.line:
            return f"{self.where}: {self.message}"
        return f"{self.where}:{self.line}: {self.message}"


def check_repository(paths: RepoPaths, *, verify_tree: bool = True) -> list[Finding]:
    """Every finding; `verify_tree=False` for a partial vendor tree (the review's HEAD
    holds only the files the series touches), whose check is the series alone."""
    if not paths.upstream_tree.is_dir():
        raise FatalError(f"{paths.upstream_tree} does not exist; run `sm120fork import VERSION`")
    # The tree first: every later finding is about patches against it.
    findings = (
        [Finding(p.where, 0, p.message) for p in pristine.problems(paths)] if verify_tree else []
    )
    series = read_series(paths.series_file)
    findings += _series_findings(paths, series)
    patches = _load_patches(paths, series, findings)
    intents = load_intents(paths.intents_file)
    for name in sorted(set(intents) - set(series.names)):
        findings.append(
            Finding(f"patches/{INTENTS_FILE}", 1, f"intent for {name}, which is not in the series")
        )
    findings.extend(_patch_findings(paths.upstream_tree, patches, intents))
    return findings


def _series_findings(paths: RepoPaths, series: Series) -> list[Finding]:
    findings = [Finding("patches/series", p.lineno, p.message) for p in series.problems]
    for duplicate in duplicate_entries(series.entries):
        findings.append(
            Finding("patches/series", duplicate.lineno, f"duplicate entry {duplicate.name}")
        )
    listed = set(series.names)
    for entry in series.entries:
        if not (paths.patches_dir / entry.name).is_file():
            findings.append(
                Finding("patches/series", entry.lineno, f"{entry.name} is listed but has no file")
            )
    for path in sorted(paths.patches_dir.rglob("*.patch")):
        name = path.relative_to(paths.patches_dir).as_posix()
        if name not in listed:
            findings.append(Finding(f"patches/{name}", 1, "patch file is not in patches/series"))
    return findings


def _load_patches(paths: RepoPaths, series: Series, findings: list[Finding]) -> list[PatchFile]:
    patches: list[PatchFile] = []
    seen: set[str] = set()
    for entry in series.entries:
        path = paths.patches_dir / entry.name
        if entry.name in seen or not path.is_file():
            continue
        seen.add(entry.name)
        try:
            patch = load_patch(path, entry.name, entry.strip)
        except PatchFileError as error:
            findings.append(Finding(f"patches/{entry.name}", error.lineno, error.reason))
            continue
        for problem in dep3.validate(patch.header):
            findings.append(Finding(f"patches/{entry.name}", problem.lineno, problem.message))
        patches.append(patch)
    return patches


def _patch_findings(
    tree: Path, patches: list[PatchFile], intents: Mapping[str, Intent]
) -> list[Finding]:
    """Exact application in order, and normal form against the tree below each patch."""
    # Findings per patch, in series order; the diffs of all applied patches are
    # rendered together afterwards (one git process for the series).
    per_patch: list[list[Finding]] = []
    applied: list[tuple[int, PatchFile, Files, Files]] = []
    overlay = Overlay(tree)
    for patch in patches:
        found: list[Finding] = []
        per_patch.append(found)
        intent = intents.get(patch.name)
        proven = intent is not None and not intent.stale  # a stale one is named by `check`
        recipe = reapply_kept(intent, overlay.read, patch.paths) if intent and proven else None
        before = {path: overlay.read(path) for path in patch.paths}
        try:
            apply_patch(overlay, patch)
        except ApplyError as error:
            line = _patch_line(patch, error)
            found.append(
                Finding(f"patches/{patch.name}", line, f"does not apply exactly: {error.message}")
            )
            continue
        after = {path: overlay.read(path) for path in patch.paths}
        if recipe is not None and recipe.changes != after:
            found.append(
                Finding(
                    f"patches/{INTENTS_FILE}",
                    1,
                    f"the intent of {patch.name} does not reproduce the patch "
                    f"({recipe.status}: {recipe.detail}); fix the recipe or the patch",
                )
            )
        applied.append((len(per_patch) - 1, patch, before, after))
    with DiffRenderer() as renderer:
        diffs = renderer.diff_many([(before, after) for _, _, before, after in applied])
    for (index, patch, _, _), diff in zip(applied, diffs, strict=True):
        per_patch[index].extend(_normal_form_findings(patch, diff))
    return [finding for found in per_patch for finding in found]


def _normal_form_findings(patch: PatchFile, diff: str) -> list[Finding]:
    where = f"patches/{patch.name}"
    if not diff:
        return [Finding(where, 1, "changes nothing on the tree below it")]
    normal = render_patch(patch.header, diff)
    if normal == patch.raw:
        return []
    line = _first_difference(patch.raw, normal)
    return [
        Finding(
            where,
            line,
            "is not in normal form (a refresh would rewrite it from this line); "
            "run `sm120fork refresh`",
        )
    ]


def _patch_line(patch: PatchFile, error: ApplyError) -> int:
    if error.hunk_lineno is not None:
        return error.hunk_lineno
    return next((f.lineno for f in patch.files if f.path == error.path), 1)


def _first_difference(old: bytes, new: bytes) -> int:
    old_lines, new_lines = old.split(b"\n"), new.split(b"\n")
    for lineno, (a, b) in enumerate(zip(old_lines, new_lines, strict=False), start=1):
        if a != b:
            return lineno
    return min(len(old_lines), len(new_lines))
