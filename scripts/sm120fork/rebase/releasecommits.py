"""The work repository's commit of each release, made from git objects that hold it.

`WorkRepo.commit_dir` reads every file of a release (5700 files: a second or two,
most of it the disk) to commit it. But the pinned tree is committed in the fork's
own repository, and a release fetched from git came as git objects. Where the
files on disk are exactly those objects (the same paths, modes and sizes; for the
fork's tree, `git status` clean as well, nothing untracked or ignored), the commit
is made from their ids through `WorkRepo.borrow_objects`: the same commit, with
nothing read. Anything else, or any git failure, is `commit_dir` as before.
"""

from __future__ import annotations

from pathlib import Path

from sm120fork import gitcmd
from sm120fork.paths import RepoPaths
from sm120fork.rebase.workrepo import WorkRepo
from sm120fork.upstream import git as upstream_git
from sm120fork.upstream import lock


def commit_pinned(repo: WorkRepo, paths: RepoPaths, message: str) -> str:
    """The pinned release (vendor/sglang) as the work repository's root commit."""
    tree = paths.upstream_tree
    found = _committed_in_fork(paths)
    if found is not None:
        objects, known = found
        repo.borrow_objects(objects)
        commit = repo.commit_known(tree, known, None, message)
        if commit is not None:
            return commit
    return repo.commit_dir(tree, None, message)


def commit_fetched(
    repo: WorkRepo, tree: Path, release_dir: Path, lock_text: str, parent: str, message: str
) -> str:
    """A fetched release (`tree`, fetched into `release_dir`, its lock `lock_text`) as
    a commit on `parent`."""
    fetched = lock.loads(lock_text, origin="the fetched release's lock")
    if fetched.source == "git" and fetched.commit:
        known = upstream_git.fetched_files(release_dir, fetched.commit)
        if known is not None:
            repo.borrow_objects(upstream_git.fetched_repository(release_dir) / "objects")
            commit = repo.commit_known(tree, known, parent, message)
            if commit is not None:
                return commit
    return repo.commit_dir(tree, parent, message)


def _committed_in_fork(paths: RepoPaths) -> tuple[Path, dict[str, gitcmd.Blob]] | None:
    """(the fork's object store, vendor/sglang's files at HEAD) when the checkout's
    vendor/sglang is exactly HEAD's; None otherwise, or outside a git repository."""
    root = paths.root
    where = "./" + paths.upstream_tree.relative_to(root).as_posix()
    status = [
        "--no-optional-locks",
        "status",
        "--porcelain",
        "-z",
        "--ignored",
        "--untracked-files=all",
        "--",
        where,
    ]
    changed = gitcmd.run(status, root, check=False)
    if changed.returncode != 0 or changed.stdout:
        return None
    listed = gitcmd.run(["ls-tree", "-r", "-l", "-z", f"HEAD:{where}"], root, check=False)
    store = ["rev-parse", "--path-format=absolute", "--git-common-dir"]
    common = gitcmd.run(store, root, check=False)
    if listed.returncode != 0 or common.returncode != 0:
        return None
    known = gitcmd.listed_blobs(listed.stdout)
    objects = Path(common.stdout.decode("utf-8", "surrogateescape").strip()) / "objects"
    return (objects, known) if known else None
