"""The one git boundary: every git invocation of the tool goes through `run`.

Git runs hermetically (no system config, C locale, no pager, no quoting of
paths) so that its output is stable wherever the tool runs. In the tool's own
scratch repositories (the default) it also reads no global config and inherits
no GIT_* variable: a user's ~/.gitconfig (diff.interHunkContext, commit.gpgsign,
a commit template, ...) must not change a patch's normal form or a rebase, and
GIT_DIR or GIT_INDEX_FILE set by a hook must not point a scratch `git add` at
the user's repository. Commands on the user's own repository or on a remote
pass `user_config=True` (their excludes, credentials, URL rewrites). A failure
names the command, its exit code and both output streams.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from sm120fork.errors import FatalError

_HERMETIC_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "LC_ALL": "C",
    "GIT_PAGER": "cat",
    "GIT_TERMINAL_PROMPT": "0",
}
_ALWAYS = ["-c", "core.quotepath=false", "-c", "core.autocrlf=false", "-c", "color.ui=false"]


class GitError(FatalError):
    """A git command failed; the message carries the command and its output."""


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
        raise FatalError("git is not installed or not on PATH; install git and retry") from error
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
