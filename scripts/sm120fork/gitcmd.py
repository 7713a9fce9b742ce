"""The one git boundary: every git invocation of the tool goes through here.

Git runs hermetically (no system config, C locale, no pager, no quoting of
paths) so that its output is stable wherever the tool runs. In the tool's own
scratch repositories (the default) it also reads no global config and inherits
no GIT_* variable: a user's ~/.gitconfig (diff.interHunkContext, commit.gpgsign,
a commit template, ...) must not change a patch's normal form or a rebase, and
GIT_DIR or GIT_INDEX_FILE set by a hook must not point a scratch `git add` at
the user's repository. Commands on the user's own repository or on a remote
pass `user_config=True` (their excludes, credentials, URL rewrites). A failure
names the command, its exit code and both output streams.

`run` starts git through subprocess because only there can the inherited GIT_*
variables be dropped (GitPython's `Git.execute` always starts from the caller's
environment). GitPython is the engine of `ObjectReader`, which keeps one
`git cat-file --batch` process for reading many blobs, where a process per blob
would cost more than the reading.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, NamedTuple

from sm120fork.errors import FatalError

if TYPE_CHECKING:  # GitPython is imported by the first ObjectReader (~0.2 s a start)
    import git

_HERMETIC_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "LC_ALL": "C",
    "GIT_PAGER": "cat",
    "GIT_TERMINAL_PROMPT": "0",
}
_OPTIONS = ("core.quotepath=false", "core.autocrlf=false", "color.ui=false")
_ALWAYS = [arg for option in _OPTIONS for arg in ("-c", option)]
_NOT_INSTALLED = "git is not installed or not on PATH; install git and retry"


class GitError(FatalError):
    """A git command failed; the message carries the command and its output."""


class Blob(NamedTuple):
    """A file as a commit holds it (`ls-tree -l`)."""

    mode: str  # "100644", "100755" or "120000"
    size: int
    oid: str


def listed_blobs(listing: bytes) -> dict[str, Blob] | None:
    """`ls-tree -r -l -z` output as path -> Blob; None if it lists anything else (a
    submodule)."""
    found: dict[str, Blob] = {}
    for record in listing.decode("utf-8", "surrogateescape").split("\0"):
        if not record:
            continue
        meta, _, path = record.partition("\t")
        mode, kind, oid, size = meta.split()
        if kind != "blob":
            return None
        found[path] = Blob(mode, int(size), oid)
    return found


def _env(extra: Mapping[str, str] | None, user_config: bool) -> dict[str, str]:
    if user_config:
        env = dict(os.environ)
    else:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        env["GIT_CONFIG_GLOBAL"] = os.devnull  # git >= 2.32; ~/.gitconfig and XDG both
    env.update(_HERMETIC_ENV)
    if extra:
        env.update(extra)
    return env


def run(
    args: Sequence[str],
    cwd: Path,
    *,
    input: bytes | None = None,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    user_config: bool = False,
) -> subprocess.CompletedProcess[bytes]:
    """Run `git <args>` in `cwd`; raise GitError on a non-zero exit if `check`.
    `user_config`: the user's repository or a remote, read with the user's git config."""
    if not cwd.is_dir():
        raise FatalError(f"{cwd} is not a directory; git cannot run there")
    command = ["git", *_ALWAYS, *args]
    try:
        result = subprocess.run(
            command,
            cwd=cwd,
            input=input,
            capture_output=True,
            env=_env(env, user_config),
            check=False,
        )
    except FileNotFoundError as error:
        raise FatalError(_NOT_INSTALLED) from error
    if check and result.returncode != 0:
        raise GitError(describe_failure(args, result))
    return result


def output(args: Sequence[str], cwd: Path, **kwargs: object) -> str:
    """Run git and return its stdout as text, stripped of the final newline."""
    result = run(args, cwd, **kwargs)  # type: ignore[arg-type]
    return result.stdout.decode("utf-8", "replace").rstrip("\n")


def describe_failure(args: Sequence[str], result: subprocess.CompletedProcess[bytes]) -> str:
    shown = " ".join(["git", *args])
    stdout = result.stdout.decode("utf-8", "replace").strip()
    stderr = result.stderr.decode("utf-8", "replace").strip()
    return f"`{shown}` exited {result.returncode}; stdout: {stdout or '-'}; stderr: {stderr or '-'}"


def _engine(cwd: Path) -> git.Git:
    if not cwd.is_dir():
        raise FatalError(f"{cwd} is not a directory; git cannot run there")
    import git

    engine = git.Git(cwd)
    engine.update_environment(**_HERMETIC_ENV, GIT_CONFIG_GLOBAL=os.devnull)
    return engine


class ObjectReader:
    """Blobs of one repository through one long-lived `git cat-file --batch`.

    `git_dir` is for a bare repository (or one whose work tree is elsewhere).
    """

    def __init__(self, cwd: Path, git_dir: Path | None = None) -> None:
        self._engine = _engine(cwd)
        options: dict[str, object] = {"c": list(_OPTIONS)}
        if git_dir is not None:
            options["git_dir"] = str(git_dir)
        self._engine.set_persistent_git_options(**options)

    def read(self, name: str) -> bytes | None:
        """The object `name` (`<commit>:<path>`, an object id) is, None when it names none."""
        from git.exc import GitCommandNotFound

        try:
            _, kind, _, data = self._engine.get_object_data(name)
        except ValueError:  # git answered "<name> missing" (or ambiguous)
            return None
        except GitCommandNotFound as error:
            raise FatalError(_NOT_INSTALLED) from error
        except (BrokenPipeError, OSError) as error:
            where = self._engine.working_dir
            raise GitError(f"`git cat-file --batch` in {where} died: {error}") from error
        # GitPython hands the header's fields over as bytes, whatever its annotations say.
        is_blob = kind in ("blob", b"blob")
        return data if is_blob else None

    def close(self) -> None:
        self._engine.clear_cache()

    def __enter__(self) -> ObjectReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
