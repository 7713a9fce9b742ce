"""The tests' seal from the user's setup, and their one way to run git.

A run of the suite must not depend on the user's ~/.gitconfig (diff.interHunkContext,
diff.noprefix, core.autocrlf, commit.template, commit.gpgsign, ...), on the
system's git config or on GIT_* variables in the environment. `SEAL` is made
once per process: an empty HOME, GIT_CONFIG_GLOBAL and GIT_CONFIG_SYSTEM at
empty files, fixed identities and dates, init.defaultBranch. conftest puts it
into os.environ for the whole session, so the tool's own git and the CLI run
as a subprocess see it too; `git()` passes it explicitly, so that the patches
test modules make at import time, before any fixture runs, are sealed as well.

pip's own configuration is kept (copied into the new HOME) and so is its cache:
which package index to use is this machine's business, as for the tool itself,
and the network tests would otherwise download every wheel again. So is the
gate-scan cache (`SM120FORK_GATE_SCAN_CACHE`) and the intent-proof cache
(`SM120FORK_INTENT_CACHE`): their entries are named by the files' contents and
the tool's own source, so none can be stale.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DATE = "2026-01-02T03:04:05+00:00"


# pip's user configuration files, relative to HOME (pip reads both).
_PIP_CONFIGS = (".config/pip/pip.conf", ".pip/pip.conf")


@dataclass(frozen=True)
class Seal:
    root: Path  # a fresh directory holding the HOME and the two empty config files
    pip_cache: str | None  # the user's pip cache, unless pip is told where already
    scan_cache: str  # the user's gate-scan cache: keyed by content and scanner source
    intent_cache: str  # the user's intent-proof cache: keyed by content and tool source

    @classmethod
    def create(cls, environ: Mapping[str, str]) -> Seal:
        root = Path(tempfile.mkdtemp(prefix="sm120fork-test-seal-"))
        atexit.register(shutil.rmtree, root, True)
        home = root / "home"
        (home / ".config").mkdir(parents=True)
        (root / "global.gitconfig").write_text("")
        (root / "system.gitconfig").write_text("")
        user_home = Path(environ.get("HOME") or Path.home())
        user_config = Path(environ.get("XDG_CONFIG_HOME") or user_home / ".config")
        for relative, found in zip(
            _PIP_CONFIGS, (user_config / "pip/pip.conf", user_home / ".pip/pip.conf"), strict=True
        ):
            if found.is_file():
                (home / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(found, home / relative)
        cache = Path(environ.get("XDG_CACHE_HOME") or user_home / ".cache") / "pip"
        told = "PIP_CACHE_DIR" in environ or "PIP_NO_CACHE_DIR" in environ
        scans = environ.get("SM120FORK_GATE_SCAN_CACHE") or str(
            cache.parent / "sglang-sm120" / "gate-scan"
        )
        proofs = environ.get("SM120FORK_INTENT_CACHE") or str(
            cache.parent / "sglang-sm120" / "intent-proofs"
        )
        return cls(root, None if told else str(cache), scans, proofs)

    def variables(self) -> dict[str, str]:
        home = self.root / "home"
        return {
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "GIT_CONFIG_GLOBAL": str(self.root / "global.gitconfig"),
            "GIT_CONFIG_SYSTEM": str(self.root / "system.gitconfig"),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": "Test Author",
            "GIT_AUTHOR_EMAIL": "author@example.com",
            "GIT_AUTHOR_DATE": DATE,
            "GIT_COMMITTER_NAME": "Test Committer",
            "GIT_COMMITTER_EMAIL": "committer@example.com",
            "GIT_COMMITTER_DATE": DATE,
            "GIT_CONFIG_COUNT": "1",
            "GIT_CONFIG_KEY_0": "init.defaultBranch",
            "GIT_CONFIG_VALUE_0": "main",
            **({"PIP_CACHE_DIR": self.pip_cache} if self.pip_cache else {}),
            "SM120FORK_GATE_SCAN_CACHE": self.scan_cache,
            "SM120FORK_INTENT_CACHE": self.intent_cache,
        }

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` without any GIT_* variable it had, with the seal's."""
        kept = {k: v for k, v in base.items() if not k.startswith("GIT_")}
        return {**kept, **self.variables()}


SEAL = Seal.create(os.environ)


def git(
    *args: str, cwd: Path, input: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """`git ARGS` in `cwd` under the seal; a failure (with `check`) shows both streams."""
    result = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env=SEAL.env(os.environ),
        input=input,
        capture_output=True,
        text=True,
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"`git {' '.join(args)}` in {cwd} exited {result.returncode}; "
            f"stdout: {result.stdout.strip() or '-'}; stderr: {result.stderr.strip() or '-'}"
        )
    return result


def output(*args: str, cwd: Path) -> str:
    """git's stdout, without the final newline."""
    return git(*args, cwd=cwd).stdout.rstrip("\n")
