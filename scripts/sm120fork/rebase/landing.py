"""Landing a finished rebase in one step: vendor/sglang, its lock, patches/, CHANGELOG.md.

`land` stages, swaps under the journal, cleans up and writes the report;
resumable from any point: the journal in the state says how far it got, and
every step is idempotent.

What lands (`writers`): the new tree, its lock and manifest, patches/ and
CHANGELOG.md. A patch whose diff did not change keeps its bytes,
`Last-Update` included; a changed one gets `Last-Update` = today
($SM120FORK_DATE). Upstreamed and dropped patches leave the series, patches/
and patches/intents.toml.

How it lands: each target is first written in full beside itself
(`.<name>.rebase-new`), then swapped in with two renames (target ->
`.<name>.rebase-old`, new -> target). The state's journal records the phase:
`staging` (partial new copies may exist), `staged` (all new copies complete:
swapping may have started), `swapped` (every target is new: only the old
copies remain to delete). Which renames of a `staged` swap happened is read
back from which of the three names exist, so --continue can finish a swap a
crash cut short and --abort can undo it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from sm120fork.errors import EXIT_OK, FatalError
from sm120fork.fsutil import copy_tree, remove, swap_back, swap_in
from sm120fork.gates.diff import GateDiff
from sm120fork.patches.lines import split_lines
from sm120fork.patches.normalform import render_patch
from sm120fork.patches.series import read_series
from sm120fork.paths import RepoPaths
from sm120fork.rebase import changelog, fate, landintents, report, report_md
from sm120fork.rebase.state import Journal, PatchState, RebaseState, crash_point
from sm120fork.rebase.strategy import parsed
from sm120fork.rebase.workspace import Workspace, say
from sm120fork.upstream import lock


def land(workspace: Workspace, state: RebaseState) -> int:
    """Land `state` (its journal says how far an earlier attempt got); write the report."""
    root = workspace.paths.root
    plan = state.journal
    if plan is None or plan.step == "staging":
        state = workspace.release_gates(state)  # with --step, also the gates section below
        gates = workspace.gates(state)
        final = state.final.version
        new = writers(
            workspace.paths, state, workspace.tree(final), workspace.manifest(final), gates
        )
        plan = journal(root, new)
        state = workspace.save(replace(state, journal=plan, gates=gates))
        say("staging vendor/sglang, its lock, patches/ and CHANGELOG.md")
        stage(root, plan, new, after_each=lambda: crash_point("mid-stage"))
        plan = replace(plan, step="staged")
        state = workspace.save(replace(state, journal=plan))
        crash_point("after-stage")
    if plan.step == "staged":
        swap(root, plan, after_each=lambda: crash_point("mid-swap"))
        plan = replace(plan, step="swapped")
        state = workspace.save(replace(state, journal=plan))
        crash_point("after-swap")
    discard_old(root, plan)
    built = report.build(state, "complete", workspace.gates(state), None)
    stale = landintents.stale(workspace.paths.intents_file)
    _, md = report_md.write(workspace.reports, replace(built, stale_intents=stale))
    shutil.rmtree(workspace.work, ignore_errors=True)
    shutil.rmtree(workspace.area / "upstream", ignore_errors=True)
    workspace.store.remove()
    kept = sum(not fate.leaves_series(p.status) for p in state.patches)
    print(
        f"rebased onto sglang {state.final.version}: {kept} of {len(state.patches)} patches "
        f"carried; wrote vendor/sglang, its lock, patches/ and CHANGELOG.md; report {md}"
    )
    return EXIT_OK


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
        remove(new)
        writers[root / target](new)
        after_each()


def swap(root: Path, plan: Journal, after_each: Callable[[], None] = lambda: None) -> None:
    """Move every new copy into place (idempotent: resumes a half-done swap)."""
    for target, _ in plan.items:
        path = root / target
        new = new_copy(path)
        if not new.exists():
            continue  # swapped already
        swap_in(new, path, old_copy(path))
        after_each()


def undo(root: Path, plan: Journal) -> None:
    """Put every target back as it was before staging, whatever was swapped."""
    for target, existed in plan.items:
        path = root / target
        swap_back(new_copy(path), path, old_copy(path), existed)


def discard_old(root: Path, plan: Journal) -> None:
    for target, _ in plan.items:
        remove(old_copy(root / target))


def writers(
    paths: RepoPaths,
    state: RebaseState,
    new_tree: Path,
    new_manifest: Path,
    gates: GateDiff,
) -> dict[Path, Writer]:
    today = lock.today()

    def tree(dest: Path) -> None:
        copy_tree(new_tree, dest)

    def lock_file(dest: Path) -> None:
        dest.write_bytes(state.final.lock_text.encode("utf-8"))

    def manifest_file(dest: Path) -> None:
        try:
            shutil.copyfile(new_manifest, dest)
        except FileNotFoundError:  # fetched by a tool from before the manifest
            raise FatalError(
                f"{new_manifest} is missing; run `rebase --abort`, then start the rebase again"
            ) from None

    def patches(dest: Path) -> None:
        shutil.copytree(paths.patches_dir, dest, symlinks=True)
        series = read_series(paths.series_file)
        dropped = {patch.name for patch in state.patches if fate.leaves_series(patch.status)}
        for patch in state.patches:
            if patch.name in dropped:
                (dest / patch.name).unlink()
                series = series.without(patch.name)
            else:
                original = (paths.patches_dir / patch.name).read_bytes()
                (dest / patch.name).write_bytes(patch_bytes(original, patch, today))
        (dest / "series").write_bytes(series.render().encode("utf-8"))
        intents = dest / paths.intents_file.relative_to(paths.patches_dir)  # staged patches/
        renamed = {p.name: dict(p.renames) for p in state.patches if p.renames}
        landed = [parsed(p) for p in state.patches if p.name not in dropped]
        version = state.final.version
        for name, why in landintents.written(
            intents, dropped, renamed, new_tree, landed, version
        ).items():
            say(f"the intent of {name} is marked stale {why}")

    def changelog_file(dest: Path) -> None:
        current = paths.changelog.read_text("utf-8") if paths.changelog.is_file() else None
        text = changelog.insert(current, changelog.entry(state, gates, today))
        dest.write_bytes(text.encode("utf-8"))

    return {
        paths.upstream_tree: tree,
        paths.manifest_file: manifest_file,
        paths.lock_file: lock_file,
        paths.patches_dir: patches,
        paths.changelog: changelog_file,
    }


def patch_bytes(original: bytes, patch: PatchState, today: str) -> bytes:
    """The carried patch file: the original bytes if its diff is unchanged, else
    the new diff under the original header with Last-Update = `today`."""
    carried = patch.text.encode("utf-8")
    if carried == original:
        return original
    file = parsed(patch)
    diff = "".join(split_lines(patch.text)[file.header_lines :])
    return render_patch(file.header.with_last_update(today), diff)
