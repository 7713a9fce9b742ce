"""A fork server for the gate children: imports torch once, forks one child per run.

Run by ``runner.py`` as ``python zygote.py`` in the gate environment, with the
environment every child shares (the stand-in libraries on LD_LIBRARY_PATH, the
fake nvidia-smi on PATH). Importing torch is the first thing ``child.py`` does
and takes about 2 CPU-seconds; the matrix starts 21 children. Nothing else is
imported here: the fakes must go in before sglang, transformers or triton
are imported, so each forked child installs them and goes on exactly as a fresh
``python child.py`` would.

Protocol, one JSON object a line: the runner writes {"argv": [request, result],
"env": {...}, "cwd": DIR, "log": FILE, "timeout": S}; the zygote answers
{"exit": CODE} (CODE null when the child ran past its timeout and was killed).
Standard library and torch only, like child.py.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

importlib.import_module("torch")  # the point: imported once, shared by every fork
CHILD = str(Path(__file__).resolve().with_name("child.py"))


def _child(job: dict[str, Any]) -> int:
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    sys.argv = [CHILD, *job["argv"]]
    # This directory is sys.path[0], as for `python child.py`.
    child = importlib.import_module("child")
    try:
        return int(child.main(sys.argv))
    except SystemExit as exc:
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
        return code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever torch or a child prints never reaches the protocol
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(job)
            finally:
                os._exit(code)
        answers.write(json.dumps({"exit": _wait(pid, float(job["timeout"]))}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
