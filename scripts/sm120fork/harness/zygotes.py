"""How a gate child runs: forked from its architecture's zygote (zygote.py, which has
installed the fakes and imported the heavy packages once), or as a fresh interpreter.
Standard library only."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spec import TOOL_SCRIPTS, Arch

# Run as modules of the tool (-P: the working directory is not put on sys.path).
ZYGOTE = ("-P", "-m", "sm120fork.harness.zygote")
CHILD = ("-P", "-m", "sm120fork.harness.child")
CHILD_TIMEOUT_S = 600


class HarnessError(RuntimeError):
    """The matrix could not be observed (broken environment, crashed child)."""


@dataclass(frozen=True)
class Fakes:
    lib_dir: Path  # holds the stand-ins libcuda.so.1 and libnvidia-ml.so.1
    bin_dir: Path  # holds the fake nvidia-smi


def child_environ(arch: Arch, stubs: Fakes, scratch: Path, hf_home: Path) -> dict[str, str]:
    """The child's environment: the caller's, made hermetic, plus the fakes. `hf_home`
    is the matrix's (a zygote's imports read it, for every tree's child)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SGLANG_", "CUDA_", "PYTHON", "HF_", "TRANSFORMERS_"))
    }
    env["PATH"] = f"{stubs.bin_dir}{os.pathsep}{env.get('PATH', '')}"
    ld = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = f"{stubs.lib_dir}{os.pathsep}{ld}" if ld else str(stubs.lib_dir)
    env.update(arch.smi_environ())
    env["SM120_GATE_SMI_LOG"] = str(scratch / "nvidia-smi-unexpected.log")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["HF_HOME"] = str(hf_home)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONPATH"] = str(TOOL_SCRIPTS)  # the tool, for `-m sm120fork.harness.child`
    return env


class Zygote:
    """One zygote (zygote.py) primed for one architecture: every child of that architecture is
    a fork of it, several at once (each `run` waits for its own child)."""

    def __init__(self, python: str, arch: Arch, env: Mapping[str, str], log: Path) -> None:
        self._log = log.open("w")
        self._process = subprocess.Popen(
            [python, *ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=dict(env),
            text=True,
        )
        self._lock = threading.Lock()
        self._waiting: dict[int, queue.Queue[int | str | None]] = {}
        self._next_id = 0
        self._send({"arch": arch.child_request(), "env": dict(env)})
        self._reader = threading.Thread(target=self._read_answers, daemon=True)
        self._reader.start()

    def _send(self, message: Mapping[str, Any]) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(message) + "\n")
        self._process.stdin.flush()

    def _read_answers(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            answer = json.loads(line)
            with self._lock:
                self._waiting.pop(answer["id"]).put(answer["exit"])
        with self._lock:  # the zygote is gone: nobody waits forever
            for slot in self._waiting.values():
                slot.put("died")
            self._waiting.clear()

    def run(self, argv: list[str], env: Mapping[str, str], cwd: Path, log: Path) -> int | None:
        """The child's exit code; None when it ran past CHILD_TIMEOUT_S."""
        slot: queue.Queue[int | str | None] = queue.Queue(maxsize=1)
        job = {"argv": argv, "env": dict(env), "cwd": str(cwd), "log": str(log)}
        with self._lock:
            job_id, self._next_id = self._next_id, self._next_id + 1
            self._waiting[job_id] = slot
            if self._process.poll() is None:
                self._send({"id": job_id, **job, "timeout": CHILD_TIMEOUT_S})
            else:
                slot.put("died")
        code = slot.get()
        if isinstance(code, str):
            raise HarnessError(f"the gate zygote died; its log: {self._log.name}")
        return code

    def stop(self) -> None:
        """Ask the zygote to end: its stdin at EOF (it waits for its children first)."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()

    def close(self) -> None:
        """End the zygote (`stop`, then wait for it) and its pipes."""
        self.stop()
        self._process.wait(timeout=CHILD_TIMEOUT_S)
        self._reader.join(timeout=60)
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._log.close()


Start = Callable[[Arch, list[str], Mapping[str, str], Path, Path], int | None]


def fresh_process(python: str) -> Start:
    """The child as its own process (SM120_GATE_ZYGOTE=0, and the fresh check)."""

    def start(
        arch: Arch, argv: list[str], env: Mapping[str, str], cwd: Path, log: Path
    ) -> int | None:
        with open(log, "w") as out:
            try:
                return subprocess.run(
                    [python, *CHILD, *argv],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=dict(env),
                    cwd=cwd,
                    timeout=CHILD_TIMEOUT_S,
                    check=False,
                ).returncode
            except subprocess.TimeoutExpired:
                return None

    return start


class ZygotePool:
    """A zygote per architecture, started with its first child. Given `children` (the
    children to come, per architecture), a zygote ends after its last one (the work is
    ordered by architecture, so about as many are alive as there are jobs); without,
    every zygote lives until `close`, for all the matrices run with this pool: a test
    session primes each architecture once (about 5 s a zygote), not once a matrix.
    Children run with the pool's fakes and HF_HOME, which a zygote's imports fixed."""

    def __init__(
        self,
        python: str,
        stubs: Fakes,
        scratch: Path,
        hf_home: Path,
        children: Mapping[str, int] | None = None,
    ) -> None:
        self.python, self.stubs, self.hf_home = python, stubs, hf_home
        self._scratch = scratch
        self._left = dict(children) if children is not None else None
        self._lock = threading.Lock()
        self._alive: dict[str, Zygote] = {}

    def start(
        self, arch: Arch, argv: list[str], env: Mapping[str, str], cwd: Path, log: Path
    ) -> int | None:
        primed = self._scratch / f"zygote-{arch.name}"
        with self._lock:
            zygote = self._alive.get(arch.name)
            if zygote is None:
                primed.mkdir(parents=True, exist_ok=True)
                prime_env = child_environ(arch, self.stubs, primed, self.hf_home)
                zygote = Zygote(self.python, arch, prime_env, primed / "zygote.log")
                self._alive[arch.name] = zygote
        try:
            return zygote.run(argv, env, cwd, log)
        finally:
            last = False
            with self._lock:
                if self._left is not None:
                    self._left[arch.name] -= 1
                    last = self._left[arch.name] <= 0
                    if last:
                        del self._alive[arch.name]
            if last:
                zygote.close()
                refuse_unexpected_queries(primed)

    def close(self, *, check: bool = True) -> None:
        """End every zygote still alive; `check`: what they asked the fake nvidia-smi
        in vain fails here (not while another error is on its way)."""
        with self._lock:
            alive, self._alive = dict(self._alive), {}
        for zygote in alive.values():
            zygote.stop()  # all at once: each then ends while the next is waited for
        for zygote in alive.values():
            zygote.close()
        if check:
            for name in alive:
                refuse_unexpected_queries(self._scratch / f"zygote-{name}")


def refuse_unexpected_queries(primed: Path) -> None:
    """A zygote's imports run with the fake nvidia-smi too; what it cannot answer there
    would reach no child's log, so it fails the matrix here."""
    log = primed / "nvidia-smi-unexpected.log"
    if log.is_file():
        raise HarnessError(f"while a gate zygote imported its packages: {log.read_text().strip()}")
