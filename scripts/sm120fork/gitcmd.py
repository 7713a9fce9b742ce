"""The one git boundary: every git invocation of the tool goes through `run`.

Git runs hermetically (no system config, C locale, no pager, no quoting of
paths) so that its output is stable wherever the tool runs. A failure names
the command, its exit code and both output streams.
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


def _env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
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
) -> subprocess.CompletedProcess[bytes]:
    """Run `git <args>` in `cwd`; raise GitError on a non-zero exit if `check`."""
    command = ["git", *_ALWAYS, *args]
    try:
        result = subprocess.run(
            command,
            cwd=cwd,
            input=input,
            capture_output=True,
            env=_env(env),
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
