"""Gate scans started early in another process, so that they overlap other work.

A rebase knows the trees it will compare as soon as it has fetched them, but
compares them only after carrying every patch (mostly waiting on git). Scanning
them meanwhile puts their inventories into `scancache`, where the comparison
then finds them; if the warming fails or is not done, the comparison scans as
before, so the result never depends on it.

    python -m sm120fork.gates.warm TREE...
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

_running: list[subprocess.Popen[bytes]] = []
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding sm120fork/


def start(roots: Sequence[Path]) -> None:
    """Scan `roots` in the background (into the scan cache)."""
    if not roots or os.environ.get("SM120FORK_GATE_WARM") == "0":
        return
    path = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "sm120fork.gates.warm", *(str(root) for root in roots)]
    _running.append(
        subprocess.Popen(
            argv,
            env={**os.environ, "PYTHONPATH": path},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )


def wait() -> None:
    """Let every background scan finish (its inventories are then in the cache)."""
    while _running:
        _running.pop().wait()


def stop() -> None:
    """End the background scans still running (the rebase stopped before comparing)."""
    while _running:
        process = _running.pop()
        if process.poll() is None:
            process.terminate()
            process.wait()


def main(argv: list[str]) -> int:
    from sm120fork.gates.scan import scan_tree

    for root in argv:
        if Path(root).is_dir():
            scan_tree(Path(root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
