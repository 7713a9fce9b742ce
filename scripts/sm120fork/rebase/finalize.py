"""Land the result in one step: vendor/sglang, its lock, patches/ and CHANGELOG.md.

Each target is first written in full beside itself (`.<name>.rebase-new`),
then swapped in with two renames (target -> `.<name>.rebase-old`, new ->
target). The state's journal records the phase: `staging` (partial new
copies may exist), `staged` (all new copies complete: swapping may have
started), `swapped` (every target is new: only the old copies remain to
delete). Which renames of a `staged` swap happened is read back from which
of the three names exist, so --continue can finish a swap a crash cut short
and --abort can undo it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from sm120fork.rebase.state import Journal

Writer = Callable[[Path], None]  # writes one target's new content at the given path


def journal(root: Path, targets: Iterable[Path]) -> Journal:
    """The journal of a swap of `targets` (paths under `root`), before staging starts."""
    items = tuple((target.relative_to(root).as_posix(), target.exists()) for target in targets)
    return Journal("staging", items)


def new_copy(target: Path) -> Path:
    return target.with_name(f".{target.name}.rebase-new")


def old_copy(target: Path) -> Path:
    return target.with_name(f".{target.name}.rebase-old")


def stage(
    root: Path,
    plan: Journal,
    writers: Mapping[Path, Writer],
    after_each: Callable[[], None] = lambda: None,
) -> None:
    """Write every new copy, after removing what an interrupted staging left."""
    for target, _ in plan.items:
        new = new_copy(root / target)
        _remove(new)
        writers[root / target](new)
        after_each()


def swap(root: Path, plan: Journal, after_each: Callable[[], None] = lambda: None) -> None:
    """Move every new copy into place (idempotent: resumes a half-done swap)."""
    for target, existed in plan.items:
        path = root / target
        new, old = new_copy(path), old_copy(path)
        if not new.exists():
            continue  # swapped already
        if existed and path.exists() and not old.exists():
            path.rename(old)
        new.rename(path)
        after_each()


def undo(root: Path, plan: Journal) -> None:
    """Put every target back as it was before staging, whatever was swapped."""
    for target, existed in plan.items:
        path = root / target
        new, old = new_copy(path), old_copy(path)
        if old.exists():
            _remove(path)
            old.rename(path)
        elif not existed and not new.exists():
            _remove(path)  # a file the rebase created, already swapped in
        _remove(new)


def discard_old(root: Path, plan: Journal) -> None:
    for target, _ in plan.items:
        _remove(old_copy(root / target))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
