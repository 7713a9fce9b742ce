"""The one git boundary: every git invocation of the tool goes through here.

GitPython's `Git` is the engine. Git runs hermetically (no system config, C
locale, no pager, no quoting of paths) so that its output is stable wherever
the tool runs. A failure names the command, its exit code and both output
streams, read from GitPython's `GitCommandError`. `ObjectReader` keeps one
`git cat-file --batch` process for reading many blobs, where a process per
blob would cost more than the reading.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import git
from git.exc import GitCommandError, GitCommandNotFound

from sm120fork.errors import FatalError

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


def _engine(cwd: Path, env: Mapping[str, str] | None = None) -> git.Git:
    if not cwd.is_dir():
        raise FatalError(f"{cwd} is not a directory; git cannot run there")
    engine = git.Git(cwd)
    engine.update_environment(**_HERMETIC_ENV, **(env or {}))
    return engine


def run(
    args: Sequence[str],
    cwd: Path,
    *,
    check: bool = True,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run `git <args>` in `cwd`; raise GitError on a non-zero exit if `check`."""
    command = [git.Git.GIT_PYTHON_GIT_EXECUTABLE or "git", *_ALWAYS, *args]
    try:
        status, stdout, stderr = _engine(cwd, env).execute(
            command,
            with_extended_output=True,
            with_exceptions=check,
            stdout_as_string=False,
            strip_newline_in_stdout=False,
        )
    except GitCommandNotFound as error:
        raise FatalError(_NOT_INSTALLED) from error
    except GitCommandError as error:
        raise GitError(describe_error(args, error)) from error
    return subprocess.CompletedProcess(command, status, stdout, stderr.encode(errors="replace"))


def output(args: Sequence[str], cwd: Path, **kwargs: object) -> str:
    """Run git and return its stdout as text, stripped of the final newline."""
    result = run(args, cwd, **kwargs)  # type: ignore[arg-type]
    return result.stdout.decode("utf-8", "replace").rstrip("\n")


def describe_error(args: Sequence[str], error: GitCommandError) -> str:
    """One line: the command as the tool gave it, its exit code, both streams."""
    shown = " ".join(["git", *args])
    stdout = _stream(error.stdout, "stdout")
    stderr = _stream(error.stderr, "stderr")
    return f"`{shown}` exited {error.status}; stdout: {stdout or '-'}; stderr: {stderr or '-'}"


def describe_failure(args: Sequence[str], result: subprocess.CompletedProcess[bytes]) -> str:
    """`describe_error` for a command run with `check=False` that the caller judged failed."""
    return describe_error(
        args, GitCommandError(list(args), result.returncode, result.stderr, result.stdout)
    )


def _stream(framed: str, name: str) -> str:
    """GitCommandError keeps each stream as "\\n  stdout: '<text>'" (empty when none)."""
    return framed.removeprefix(f"\n  {name}: '").removesuffix("'").strip()


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
