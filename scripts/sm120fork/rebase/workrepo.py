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

import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from sm120fork import gitcmd
from sm120fork.rebase import fastimport

_CONFIG = {
    # Checking a release out creates 5700 files; on a virtual disk that is kernel time
    # spent waiting, which git's parallel checkout overlaps (one worker a core).
    "checkout.workers": "0",
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

    def git(
        self, *args: str, check: bool = True, input: bytes | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        return gitcmd.run(args, self.root, check=check, env=fastimport.IDENTITY, input=input)

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
        """Commit the files of `tree` (any directory) exactly as they are, as `git add -A -f`
        would: one `git fast-import` writing one pack, not a loose object per file (a
        release is 5700 files; on a slow file system creating them was most of a rebase's
        set-up)."""
        # the tree is `tree` alone, not the parent's plus it
        return self._fast_import(message, parent, [b"deleteall\n", *fastimport.file_commands(tree)])

    def commit_changes(self, parent: str, message: str, changes: Mapping[str, str | None]) -> str:
        """Commit `parent` with `changes` (path -> new text, None: deleted) made, without the
        work tree: the commit `git add -A` and `git commit` would make after writing them
        there (a changed file keeps its mode, a new one is 100644)."""
        return self.commit_series(parent, [(message, changes)])[-1]

    def commit_series(
        self, parent: str, series: Sequence[tuple[str, Mapping[str, str | None]]]
    ) -> list[str]:
        """`commit_changes` of each (message, changes) in turn, each on the one before,
        in one fast-import: the commits, in order."""
        paths = sorted({path for _, changes in series for path in changes})
        listed = self.git("ls-tree", "-l", "-z", parent, "--", *paths).stdout if paths else b""
        modes = {path: blob.mode for path, blob in (gitcmd.listed_blobs(listed) or {}).items()}
        commits: list[bytes] = []
        for number, (message, changes) in enumerate(series, start=1):
            commands: list[bytes] = []
            for path, text in sorted(changes.items()):
                quoted = fastimport.quoted(path.encode("utf-8"))
                if text is None:
                    commands += [b"D ", quoted, b"\n"]
                    modes.pop(path, None)  # re-created later: a new file
                    continue
                data = text.encode("utf-8")
                mode = modes.setdefault(path, "100644").encode()
                commands += [b"M ", mode, b" inline ", quoted, b"\ndata %d\n" % len(data)]
                commands += [data, b"\n"]
            from_ = parent if number == 1 else f":{number - 1}"
            commits.append(fastimport.commit_command(number, message, from_, commands))
        return self._run_fast_import(commits)

    def _fast_import(self, message: str, parent: str | None, commands: list[bytes]) -> str:
        """One commit of `commands` (fast-import's file commands) on `parent`."""
        return self._run_fast_import([fastimport.commit_command(1, message, parent, commands)])[0]

    def _run_fast_import(self, commits: list[bytes]) -> list[str]:
        return fastimport.run(self.git, self.root / ".git", commits)

    def checkout(self, commit: str) -> None:
        """Make the work tree exactly `commit`, whatever state a crash left it in."""
        self.git("cherry-pick", "--quit", check=False)  # forget a stopped cherry-pick
        self.git("checkout", "-q", "-f", "--detach", commit)
        self.git("clean", "-q", "-f", "-d", "-x")

    def commit_worktree(self, message: str, paths: Sequence[str] | None = None) -> str | None:
        """Commit every change of the work tree on HEAD (only `paths`, the files a
        strategy wrote, when it names them: git then looks at no other file); None if
        nothing changed. The commit `git commit` makes, without its second look at
        every file of the index."""
        if paths is None:
            self.git("add", "-A", ".")
        else:
            self.git("update-index", "--add", "--remove", "--", *paths)
        tree = self.out("write-tree")
        head, head_tree = self.out("rev-parse", "HEAD", "HEAD^{tree}").split()
        if tree == head_tree:
            return None
        commit = self.out("commit-tree", tree, "-p", head, "-m", message)
        self.git("update-ref", "HEAD", commit)
        return commit

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
        """The files that differ between two commit ids. Kept per pair: commits never change,
        and a carried patch asks twice (its normal form, then the names check)."""
        found = self._changed.get((old, new))
        if found is None:
            raw = self.git("diff", "--name-only", "--no-renames", "-z", old, new).stdout
            found = self._changed[(old, new)] = [p for p in raw.decode().split("\0") if p]
        return list(found)

    def dirty_paths(self) -> list[str]:
        """Files of the work tree that differ from HEAD, new files included."""
        raw = self.git(
            "status", "--porcelain", "-z", "--no-renames", "--untracked-files=all"
        ).stdout
        return [entry[3:] for entry in raw.decode().split("\0") if len(entry) > 3]

    def files(self) -> list[str]:
        """Every file of HEAD."""
        return [path for path in self.git("ls-files", "-z").stdout.decode().split("\0") if path]

    def defining(self, commit: str, names: Iterable[str]) -> dict[str, list[str]]:
        """The Python modules of `commit` with a `def NAME(` of each of `names` (one
        `git grep`); a name defined nowhere is left out."""
        wanted = sorted(set(names))
        if not wanted:
            return {}
        pattern = rf"^\s*(async\s+)?def\s+({'|'.join(wanted)})\s*\("
        grep = ["grep", "-n", "-E", "-e", pattern, commit, "--", "*.py"]
        found: dict[str, list[str]] = {}
        for line in self.git(*grep, check=False).stdout.decode("utf-8", "replace").splitlines():
            _, path, _, text = line.split(":", 3)
            name = re.search(r"def\s+(\w+)", text)
            if name is not None and name.group(1) in wanted:
                found.setdefault(name.group(1), []).append(path)
        return {name: sorted(set(paths)) for name, paths in found.items()}

    @cached_property
    def _changed(self) -> dict[tuple[str, str], list[str]]:
        return {}

    @cached_property
    def _objects(self) -> gitcmd.ObjectReader:
        return gitcmd.ObjectReader(self.root)

    def read(self, commit: str, path: str) -> str | None:
        """`path` at `commit`, None when that commit has no such file."""
        data = self._objects.read(f"{commit}:{path}")
        return data.decode("utf-8") if data is not None else None
