"""Run the architecture matrix: one child interpreter per (tree, architecture), each a
fork of that architecture's zygote, which has installed the fakes and imported the
heavy third-party packages (zygote.py; SM120_GATE_ZYGOTE=0: fresh interpreters).

Standard library only; torch is imported by the children (child.py), never here.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import fakes
from .spec import CHILD_SCRIPT, Arch, Scenario

ZYGOTE_SCRIPT = CHILD_SCRIPT.with_name("zygote.py")

CHILD_TIMEOUT_S = 600
HARNESS_FAILURE_EXIT = 3  # child.HarnessFailure: resolution or fakes not seen to act


class HarnessError(RuntimeError):
    """The matrix could not be observed (broken environment, crashed child)."""


@dataclass(frozen=True)
class Fakes:
    lib_dir: Path  # holds the stand-ins libcuda.so.1 and libnvidia-ml.so.1
    bin_dir: Path  # holds the fake nvidia-smi


@dataclass(frozen=True)
class ArchRun:
    arch: str
    scenarios: Mapping[str, Mapping[str, Any]]
    meta: Mapping[str, Any]
    wall_s: float
    log: Path


@dataclass(frozen=True)
class MatrixRun:
    """Everything observed for one tested sglang tree."""

    tree: Path
    runs: Mapping[str, ArchRun]

    @property
    def observations(self) -> dict[str, Mapping[str, Mapping[str, Any]]]:
        return {arch: run.scenarios for arch, run in self.runs.items()}


def site_packages(python: str) -> list[Path]:
    code = (
        "import json, sysconfig; p = sysconfig.get_paths(); "
        "print(json.dumps([p['purelib'], p['platlib']]))"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise HarnessError(f"{python} cannot report its site-packages:\n{proc.stderr}")
    return sorted({Path(p) for p in json.loads(proc.stdout)})


def prepare_fakes(python: str, scratch: Path, extra_roots: Sequence[Path] = ()) -> Fakes:
    """Build the stand-in libcuda and the fake nvidia-smi for ``python``'s environment."""
    roots = [*site_packages(python), *(r for r in extra_roots if r.is_dir())]
    try:
        lib_dir = fakes.build_libcuda(roots, scratch / "lib")
        fakes.build_libnvidia_ml(lib_dir)
    except fakes.FakeBuildError as exc:
        raise HarnessError(str(exc)) from exc
    return Fakes(lib_dir=lib_dir, bin_dir=fakes.write_nvidia_smi(scratch / "bin"))


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
    return env


class Zygote:
    """One `zygote.py` primed for one architecture: every child of that architecture is
    a fork of it, several at once (each `run` waits for its own child)."""

    def __init__(self, python: str, arch: Arch, env: Mapping[str, str], log: Path) -> None:
        self._log = log.open("w")
        self._process = subprocess.Popen(
            [python, str(ZYGOTE_SCRIPT)],
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


def _run_one(
    start: Start,
    tree: Path,
    arch: Arch,
    scenarios: Sequence[Scenario],
    stubs: Fakes,
    scratch: Path,
    hf_home: Path,
) -> ArchRun:
    scratch.mkdir(parents=True, exist_ok=True)
    request = scratch / "request.json"
    result = scratch / "result.json"
    log = scratch / "child.log"
    request.write_text(
        json.dumps(
            {
                "arch": arch.child_request(),
                "sglang_path": str(tree),
                "scenarios": [s.child_request() for s in scenarios],
            },
            indent=1,
        )
    )
    started = time.monotonic()
    env = child_environ(arch, stubs, scratch, hf_home)
    code = start(arch, [str(request), str(result)], env, scratch, log)
    if code is None:
        raise HarnessError(f"{arch.name} on {tree}: timed out; log {log}")
    wall = time.monotonic() - started
    if code == HARNESS_FAILURE_EXIT:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
        raise HarnessError(f"{arch.name} on {tree}: the harness cannot observe it:\n{tail}")
    if code != 0 or not result.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise HarnessError(f"{arch.name} on {tree}: child exited {code}; log {log}:\n{tail}")
    data = json.loads(result.read_text())
    return ArchRun(arch.name, data["scenarios"], data["meta"], wall, log)


def _fresh_process(python: str) -> Start:
    """`python child.py ...` as its own process (SM120_GATE_ZYGOTE=0, and the fresh check)."""

    def start(
        arch: Arch, argv: list[str], env: Mapping[str, str], cwd: Path, log: Path
    ) -> int | None:
        with open(log, "w") as out:
            try:
                return subprocess.run(
                    [python, str(CHILD_SCRIPT), *argv],
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
                _refuse_unexpected_queries(primed)

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
                _refuse_unexpected_queries(self._scratch / f"zygote-{name}")


def _refuse_unexpected_queries(primed: Path) -> None:
    """A zygote's imports run with the fake nvidia-smi too; what it cannot answer there
    would reach no child's log, so it fails the matrix here."""
    log = primed / "nvidia-smi-unexpected.log"
    if log.is_file():
        raise HarnessError(f"while a gate zygote imported its packages: {log.read_text().strip()}")


def _differences(zygote: ArchRun, fresh: ArchRun) -> list[str]:
    """Where a zygote's child and a fresh interpreter observed differently."""
    found = []
    for name in sorted(set(zygote.scenarios) | set(fresh.scenarios)):
        mine, theirs = zygote.scenarios.get(name, {}), fresh.scenarios.get(name, {})
        for field in sorted(set(mine) | set(theirs)):
            if mine.get(field) != theirs.get(field):
                found.append(
                    f"{name}.{field}: {mine.get(field)!r} forked, {theirs.get(field)!r} fresh"
                )
    return found


def run_matrices(
    trees: Mapping[str, Path],
    archs: Sequence[Arch],
    scenarios: Sequence[Scenario],
    *,
    scratch: Path,
    python: str = sys.executable,
    jobs: int | None = None,
    stubs: Fakes | None = None,
    on_done: Callable[[str, ArchRun], None] | None = None,
    fresh_check: tuple[str, str] | None = None,
    zygotes: ZygotePool | None = None,
) -> dict[str, MatrixRun]:
    """Observe every scenario on every architecture for every tree (label -> path);
    `on_done(label, run)` is called (in this thread) as each child finishes.

    `fresh_check` (tree label, architecture): that child also runs as a fresh
    `python child.py`, and any observation that differs from its forked twin's fails
    the matrix (HarnessError): the zygote's claim to change nothing, checked.
    `zygotes`: a pool kept across matrices (its fakes and HF_HOME are then the
    children's too); without one, this matrix's own, ended with it."""
    own = zygotes is None
    if zygotes is None:
        stubs = stubs or prepare_fakes(python, scratch / "fakes", list(trees.values()))
        children = {arch.name: len(trees) for arch in archs}
        zygotes = ZygotePool(python, stubs, scratch, scratch / "hf-home", children)
    stubs, hf_home, python = zygotes.stubs, zygotes.hf_home, zygotes.python
    jobs = jobs or os.cpu_count() or 1
    # By architecture: each zygote serves every tree's child of its architecture.
    work = [(label, tree, arch) for arch in archs for label, tree in trees.items()]
    use_zygote = os.environ.get("SM120_GATE_ZYGOTE", "1") != "0" and bool(archs)
    fresh = _fresh_process(python)
    start = zygotes.start if use_zygote else fresh
    checked = fresh_check if use_zygote and fresh_check else None
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {
                pool.submit(
                    _run_one,
                    start,
                    tree,
                    arch,
                    scenarios,
                    stubs,
                    scratch / label / arch.name,
                    hf_home,
                ): (label, arch.name, "")
                for label, tree, arch in work
            }
            if checked is not None:
                label, arch = checked[0], next(a for a in archs if a.name == checked[1])
                where = scratch / label / f"{arch.name}-fresh"
                twin = pool.submit(
                    _run_one, fresh, trees[label], arch, scenarios, stubs, where, hf_home
                )
                futures[twin] = (label, arch.name, "fresh")
            done: dict[tuple[str, str, str], ArchRun] = {}
            for future in as_completed(futures):
                key = futures[future]
                done[key] = future.result()
                if on_done is not None and not key[2]:
                    on_done(key[0], done[key])
    finally:
        if own:
            zygotes.close(check=False)  # each zygote was checked after its last child
    if checked is not None:
        differ = _differences(done[(*checked, "")], done[(*checked, "fresh")])
        if differ:
            raise HarnessError(
                f"{checked[1]} on {trees[checked[0]]}: a child forked from its zygote observed "
                f"otherwise than a fresh interpreter ({len(differ)} fields; run with "
                "SM120_GATE_ZYGOTE=0 meanwhile): " + "; ".join(differ[:5])
            )
    return {
        label: MatrixRun(tree, {arch.name: done[(label, arch.name, "")] for arch in archs})
        for label, tree in trees.items()
    }
