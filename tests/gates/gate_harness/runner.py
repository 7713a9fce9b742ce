"""Run the architecture matrix: one fresh child interpreter per (tree, architecture).

Standard library only; torch is imported by the children (child.py), never here.
"""

from __future__ import annotations

import json
import os
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


def _run_one(
    python: str,
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
    with open(log, "w") as out:
        try:
            proc = subprocess.run(
                [python, str(CHILD_SCRIPT), str(request), str(result)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_environ(arch, stubs, scratch),
                cwd=scratch,
                timeout=CHILD_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise HarnessError(f"{arch.name} on {tree}: timed out; log {log}") from exc
    wall = time.monotonic() - started
    if proc.returncode == HARNESS_FAILURE_EXIT:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
        raise HarnessError(f"{arch.name} on {tree}: the harness cannot observe it:\n{tail}")
    if proc.returncode != 0 or not result.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise HarnessError(
            f"{arch.name} on {tree}: child exited {proc.returncode}; log {log}:\n{tail}"
        )
    data = json.loads(result.read_text())
    return ArchRun(arch.name, data["scenarios"], data["meta"], wall, log)


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
    work = [(label, tree, arch) for label, tree in trees.items() for arch in archs]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {
            pool.submit(
                _run_one, python, tree, arch, scenarios, stubs, scratch / label / arch.name
            ): (label, arch.name)
            for label, tree, arch in work
        }
        done = {}
        for future in as_completed(futures):
            label, arch_name = futures[future]
            done[(label, arch_name)] = future.result()
            if on_done is not None:
                on_done(label, done[(label, arch_name)])
    return {
        label: MatrixRun(tree, {arch.name: done[(label, arch.name)] for arch in archs})
        for label, tree in trees.items()
    }
