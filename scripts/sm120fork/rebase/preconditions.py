"""What must hold before a rebase touches anything, and before it goes on."""

from __future__ import annotations

from sm120fork import gitcmd
from sm120fork.errors import FatalError
from sm120fork.patches.checks import check_repository
from sm120fork.paths import RepoPaths
from sm120fork.rebase.state import StateDir
from sm120fork.upstream import lock


def refuse_in_progress(state_dir: StateDir) -> None:
    if state_dir.exists():
        raise FatalError(
            "a rebase is already in progress; finish it with --continue or drop it with --abort"
        )


def check_start(paths: RepoPaths, *, dry_run: bool) -> lock.Lock:
    """Refuse (exit 2) unless a rebase may start; returns the lock in force."""
    if not dry_run:
        what = "the repository has uncommitted changes"
        _refuse_changes(paths, what, (), "commit or undo them, then retry")
    pinned = lock.read(paths.lock_file)
    if pinned is None:
        raise FatalError(f"{paths.lock_file} does not exist; run `sm120fork import VERSION` first")
    findings = check_repository(paths)
    if findings:
        raise FatalError(
            "the series must apply exactly to vendor/sglang, as imported, before a rebase, "
            f"but {findings[0]}"
            f" ({len(findings)} finding{'s' if len(findings) != 1 else ''}); "
            "run `sm120fork check` and fix them first"
        )
    return pinned


LANDS = ("vendor", "patches", "CHANGELOG.md")


def fingerprint(paths: RepoPaths) -> str:
    """The committed ids of what a rebase lands ("" in a repository without commits)."""
    result = gitcmd.run(
        ["ls-tree", "HEAD", "--", *LANDS], paths.root, check=False, user_config=True
    )
    return result.stdout.decode("utf-8", "replace") if result.returncode == 0 else ""


def check_resume(paths: RepoPaths, started: str) -> None:
    """What a rebase lands must be as it was when the rebase started (`started` is
    its fingerprint then): neither edited nor committed since."""
    what = "vendor/, patches/ or CHANGELOG.md changed while the rebase was stopped"
    _refuse_changes(paths, what, LANDS, "undo them (the rebase writes these files), or --abort")
    if fingerprint(paths) != started:
        raise FatalError(f"{what} (a commit changed them); undo that commit, or --abort")


def _refuse_changes(paths: RepoPaths, what: str, pathspec: tuple[str, ...], fix: str) -> None:
    status = gitcmd.output(
        ["status", "--porcelain", "--untracked-files=normal", "--", *pathspec],
        paths.root,
        user_config=True,  # the user's excludes decide what counts as a change, as for them
    )
    if status:
        changes = status.splitlines()
        first = changes[0][3:]
        raise FatalError(
            f"{what} ({first}{f' and {len(changes) - 1} more' if len(changes) > 1 else ''}); {fix}"
        )
