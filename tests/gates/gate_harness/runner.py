"""Run the architecture matrix: one child interpreter per (tree, architecture), each a
fork of a zygote that has imported torch (zygote.py; SM120_GATE_ZYGOTE=0: fresh ones).

Standard library only; torch is imported by the children (child.py), never here.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
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


def child_environ(arch: Arch, stubs: Fakes, scratch: Path) -> dict[str, str]:
    """The child's environment: the caller's, made hermetic, plus the fakes."""
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
    env["HF_HOME"] = str(scratch / "hf-home")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


class Zygote:
    """One `zygote.py` (torch imported once) serving one worker thread's children in turn."""

    def __init__(self, python: str, env: Mapping[str, str], log: Path) -> None:
        self._log = log.open("w")
        self._process = subprocess.Popen(
            [python, str(ZYGOTE_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=dict(env),
            text=True,
        )

    def run(self, argv: list[str], env: Mapping[str, str], cwd: Path, log: Path) -> int | None:
        """The child's exit code; None when it ran past CHILD_TIMEOUT_S."""
        job = {"argv": argv, "env": dict(env), "cwd": str(cwd), "log": str(log)}
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps({**job, "timeout": CHILD_TIMEOUT_S}) + "\n")
        self._process.stdin.flush()
        answer = self._process.stdout.readline()
        if not answer:
            raise HarnessError(f"the gate zygote died; its log: {self._log.name}")
        code: int | None = json.loads(answer)["exit"]
        return code

    def close(self) -> None:
        """End the zygote (its stdin at EOF) and close both pipes and its log."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=60)
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._log.close()


def _run_one(
    start: Callable[[list[str], Mapping[str, str], Path, Path], int | None],
    tree: Path,
    arch: Arch,
    scenarios: Sequence[Scenario],
    stubs: Fakes,
    scratch: Path,
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
    code = start([str(request), str(result)], child_environ(arch, stubs, scratch), scratch, log)
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


def _fresh_process(python: str) -> Callable[[list[str], Mapping[str, str], Path, Path], int | None]:
    """`python child.py ...` as its own process (SM120_GATE_ZYGOTE=0)."""

    def start(argv: list[str], env: Mapping[str, str], cwd: Path, log: Path) -> int | None:
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


def _ordered(trees: Mapping[str, Path], archs: Sequence[Arch]) -> list[tuple[str, Path, Arch]]:
    return [(label, tree, arch) for label, tree in trees.items() for arch in archs]


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
) -> dict[str, MatrixRun]:
    """Observe every scenario on every architecture for every tree (label -> path);
    `on_done(label, run)` is called (in this thread) as each child finishes."""
    stubs = stubs or prepare_fakes(python, scratch / "fakes", list(trees.values()))
    jobs = jobs or os.cpu_count() or 1
    work = [(label, tree, arch) for label, tree, arch in _ordered(trees, archs)]
    # One zygote per worker thread: each child is a fork of an interpreter that has
    # imported torch already (zygote.py), instead of a fresh `python child.py`.
    zygotes: queue.Queue[Zygote] = queue.Queue()
    started: list[Zygote] = []
    use_zygote = os.environ.get("SM120_GATE_ZYGOTE", "1") != "0" and bool(archs)
    fresh = _fresh_process(python)

    def start(argv: list[str], env: Mapping[str, str], cwd: Path, log: Path) -> int | None:
        if not use_zygote:
            return fresh(argv, env, cwd, log)
        try:
            zygote = zygotes.get_nowait()
        except queue.Empty:
            zygote = Zygote(python, env, scratch / f"zygote-{len(started)}.log")
            started.append(zygote)
        try:
            return zygote.run(argv, env, cwd, log)
        finally:
            zygotes.put(zygote)

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {
                pool.submit(
                    _run_one, start, tree, arch, scenarios, stubs, scratch / label / arch.name
                ): (label, arch.name)
                for label, tree, arch in work
            }
            done = {}
            for future in as_completed(futures):
                label, arch_name = futures[future]
                done[(label, arch_name)] = future.result()
                if on_done is not None:
                    on_done(label, done[(label, arch_name)])
    finally:
        for zygote in started:
            zygote.close()
    return {
        label: MatrixRun(tree, {arch.name: done[(label, arch.name)] for arch in archs})
        for label, tree in trees.items()
    }
