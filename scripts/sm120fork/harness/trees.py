"""The sglang trees the gate tests observe: pristine, patched, or one given by path."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .spec import REPO_ROOT, TOOL_SCRIPTS, VENDOR_PYTHON

PRISTINE = "pristine"
PATCHED = "patched"
MODES = (PRISTINE, PATCHED)


class TreeError(RuntimeError):
    """The patched tree could not be built."""


@dataclass(frozen=True)
class Tree:
    """A directory to put first on sys.path (it holds ``sglang/``) and how to judge it.

    mode ``patched``: every cell of the table must match. mode ``pristine``: rows
    without a patch must match, and each row naming a patch must differ somewhere.
    """

    label: str
    path: Path
    mode: str


def pristine_tree() -> Tree:
    return Tree(PRISTINE, VENDOR_PYTHON, PRISTINE)


def build_patched_tree(out: Path, python: str = sys.executable) -> Tree:
    """vendor/sglang with patches/series applied, via `sm120fork apply --out`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TOOL_SCRIPTS), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [python, "-m", "sm120fork", "-C", str(REPO_ROOT), "apply", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise TreeError(
            f"{' '.join(cmd)} exited {proc.returncode}\n"
            f"stdout: {proc.stdout}\nstderr: {proc.stderr}"
        )
    return Tree(PATCHED, out / "python", PATCHED)
