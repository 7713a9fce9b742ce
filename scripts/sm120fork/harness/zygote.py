"""A fork server for the gate children of one architecture: the fakes installed and the
heavy third-party packages imported once, then one child forked per tested tree.

Run by ``runner.py`` as ``python -m sm120fork.harness.zygote`` in the gate environment.
Its first line on stdin primes it: {"arch": ARCH, "env": {...}} (the architecture as the child
reads it, the environment every child of that architecture shares). It
then sets that environment, installs the fake GPU (``child.fake_hardware``) and
imports ``PRELOAD``: what a child would do first itself, since sglang imports those
packages before it decides anything. sglang itself is never imported here: each
tree's child imports its own. A child is therefore in the state a fresh
``python -m sm120fork.harness.child`` reaches after importing them, with the fakes already in place,
so every ``lru_cache`` and module-level flag of those packages computed itself from
the faked GPU, as in a fresh child. The runner checks that claim on one child of
every matrix against a fresh interpreter (runner.run_matrices, ``fresh_check``).

Protocol after priming, one JSON object a line: the runner writes {"id": N,
"argv": [request, result], "env": {...}, "cwd": DIR, "log": FILE, "timeout": S},
and may write the next job before the last one ended; the zygote forks each job
at once and answers {"id": N, "exit": CODE} when it ends (CODE null when it ran
past its timeout and was killed). Standard library, torch and the child only.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
import time
from typing import Any

importlib.import_module("torch")  # imported before anything else, as the child does
CHILD = "sm120fork.harness.child"

# About 7 of a child's 10 s of imports after torch are these packages and what they
# import (python -X importtime, 0.5.23's pins). Not DeepGEMM: sglang sets its
# DG_JIT_* environment before importing it.
PRELOAD = (
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "sgl_kernel",
    "flashinfer",
    "triton",
    "scipy.sparse",
    "openai",
    "compressed_tensors",
    "aiohttp",
)


def _point_output_at(path: str) -> None:
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _prime(prime: dict[str, Any]) -> None:
    os.environ.clear()
    os.environ.update(prime["env"])
    child = importlib.import_module(CHILD)
    child.fake_hardware(prime["arch"])
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except (
            Exception
        ) as exc:  # not installed in this release's pins: the child imports it, or not
            print(f"zygote: not preloaded {name}: {type(exc).__name__}: {exc}", file=sys.stderr)


def _child(job: dict[str, Any]) -> int:
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    _point_output_at(job["log"])
    sys.argv = [CHILD, *job["argv"]]
    child = importlib.import_module(CHILD)  # imported by _prime, as a fresh child would
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


def _fork(job: dict[str, Any]) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _child(job)
        finally:
            os._exit(code)
    return pid


def _reap(running: dict[int, tuple[int, float]], answer: Any) -> None:
    """Answer for every child that ended, or ran past its deadline (killed)."""
    for pid, (job_id, deadline) in list(running.items()):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code: int | None = os.waitstatus_to_exitcode(status)
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            code = None
        else:
            continue
        del running[pid]
        answer({"id": job_id, "exit": code})


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever torch, an import or a child prints never reaches the protocol
    pending = b""
    while b"\n" not in pending:
        chunk = os.read(0, 65536)
        if not chunk:
            return 0  # closed before priming: nothing to serve
        pending += chunk
    line, pending = pending.split(b"\n", 1)
    _prime(json.loads(line))

    def answer(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")

    running: dict[int, tuple[int, float]] = {}
    reading = True
    while reading or running:
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            job = json.loads(line)
            running[_fork(job)] = (job["id"], time.monotonic() + float(job["timeout"]))
        if reading and select.select([0], [], [], 0.05)[0]:
            chunk = os.read(0, 65536)
            reading = bool(chunk)
            pending += chunk
        elif not reading:
            time.sleep(0.05)
        _reap(running, answer)
    answers.flush()
    sys.stderr.flush()
    # Every child has ended and been answered: tearing down torch, transformers and the
    # rest would only cost seconds (a session ends seven zygotes).
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
