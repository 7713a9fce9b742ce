"""The scratch git repository the series is carried in (build/rebase/work).

History: the old base, one commit per patch on top of it, then each new
release as a commit whose parent is the previous base. Carrying a patch is
`git cherry-pick` of its previous commit onto the new tip: a 3-way merge whose
merge base is the tree the patch was made against. The work tree is where a
person resolves a conflict. Commits use a fixed identity and date, and the
repository's own config turns off whatever a user's config could change
(hooks, signing, rerere, the conflict style). Files of its commits are read
through one `git cat-file --batch` for the repository's lifetime: a rebase
reads every file each patch changes, before and after, at every release.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from sm120fork import gitcmd

_IDENTITY = {
    "GIT_AUTHOR_NAME": "sm120fork rebase",
    "GIT_AUTHOR_EMAIL": "rebase@sm120fork.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "sm120fork rebase",
    "GIT_COMMITTER_EMAIL": "rebase@sm120fork.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+00:00",
}
_CONFIG = {
    "commit.gpgsign": "false",
    "core.autocrlf": "false",
    "core.hooksPath": "/dev/null",
    "core.excludesFile": "/dev/null",
    "gc.auto": "0",
    "merge.conflictStyle": "diff3",
    "merge.renames": "true",
    "rerere.enabled": "false",
}
_EXCLUDE = "__pycache__/\n*.pyc\n"


@dataclass(frozen=True)
class WorkRepo:
    root: Path

    def git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return gitcmd.run(args, self.root, check=check, env=_IDENTITY)

    def out(self, *args: str) -> str:
        return self.git(*args).stdout.decode("utf-8", "replace").strip()

    @classmethod
    def create(cls, root: Path) -> WorkRepo:
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        repo = cls(root)
        repo.git("init", "-q", ".")
        for key, value in _CONFIG.items():
            repo.git("config", key, value)
        (root / ".git" / "info").mkdir(exist_ok=True)
        (root / ".git" / "info" / "exclude").write_text(_EXCLUDE)
        return repo

    def commit_dir(self, tree: Path, parent: str | None, message: str) -> str:
        """Commit the files of `tree` (any directory) exactly as they are."""
        index = self.root / ".git" / "sm120fork-tree-index"
        index.unlink(missing_ok=True)
        env = {**_IDENTITY, "GIT_INDEX_FILE": str(index)}
        git_dir = ["--git-dir", str(self.root / ".git"), "--work-tree", str(tree)]
        gitcmd.run([*git_dir, "add", "-A", "-f", "."], tree, env=env)
        tree_id = gitcmd.output([*git_dir, "write-tree"], tree, env=env)
        index.unlink()
        parents = ["-p", parent] if parent else []
        return self.out("commit-tree", tree_id, *parents, "-m", message)

    def checkout(self, commit: str) -> None:
        """Make the work tree exactly `commit`, whatever state a crash left it in."""
        self.git("cherry-pick", "--quit", check=False)  # forget a stopped cherry-pick
        self.git("checkout", "-q", "-f", "--detach", commit)
        self.git("clean", "-q", "-f", "-d", "-x")

    def commit_worktree(self, message: str) -> str | None:
        """Commit every change of the work tree on HEAD; None if nothing changed."""
        self.git("add", "-A", ".")
        if self.git("diff", "--cached", "--quiet", "HEAD", check=False).returncode == 0:
            return None
        self.git("commit", "-q", "--no-verify", "-m", message)
        return self.out("rev-parse", "HEAD")

    def cherry_pick(self, commit: str) -> bool:
        """3-way merge `commit`'s change into the work tree; False on conflict."""
        result = self.git("cherry-pick", "--no-commit", commit, check=False)
        if result.returncode == 0:
            return True
        if not self.unmerged():
            raise gitcmd.GitError(gitcmd.describe_failure(["cherry-pick", commit], result))
        return False

    def unmerged(self) -> dict[str, set[int]]:
        """path -> the index stages it has (1 base, 2 ours, 3 theirs) while conflicted."""
        found: dict[str, set[int]] = {}
        for record in self.git("ls-files", "-u", "-z").stdout.decode().split("\0"):
            if record:
                meta, _, path = record.partition("\t")
                found.setdefault(path, set()).add(int(meta.split()[2]))
        return found

    def changed_paths(self, old: str, new: str) -> list[str]:
        raw = self.git("diff", "--name-only", "--no-renames", "-z", old, new).stdout
        return [path for path in raw.decode().split("\0") if path]

    def dirty_paths(self) -> list[str]:
        """Files of the work tree that differ from HEAD, new files included."""
        raw = self.git(
            "status", "--porcelain", "-z", "--no-renames", "--untracked-files=all"
        ).stdout
        return [entry[3:] for entry in raw.decode().split("\0") if len(entry) > 3]

    def files(self) -> list[str]:
        """Every file of HEAD."""
        return [path for path in self.git("ls-files", "-z").stdout.decode().split("\0") if path]

    @cached_property
    def _objects(self) -> gitcmd.ObjectReader:
        return gitcmd.ObjectReader(self.root)

    def read(self, commit: str, path: str) -> str | None:
        """`path` at `commit`, None when that commit has no such file."""
        data = self._objects.read(f"{commit}:{path}")
        return data.decode("utf-8") if data is not None else None
