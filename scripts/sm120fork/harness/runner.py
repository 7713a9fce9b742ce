"""Run the architecture matrix: one child interpreter per (tree, architecture), each a
fork of that architecture's zygote (zygotes.py; SM120_GATE_ZYGOTE=0: fresh interpreters).

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
from .spec import Arch, Scenario
from .zygotes import Fakes, HarnessError, Start, ZygotePool, child_environ, fresh_process

__all__ = ["ArchRun", "HarnessError", "MatrixRun", "ZygotePool", "prepare_fakes", "run_matrices"]

HARNESS_FAILURE_EXIT = 3  # child.HarnessFailure: resolution or fakes not seen to act


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

    `fresh_check` (tree label, architecture): that child also runs in a fresh
    interpreter, and any observation that differs from its forked twin's fails
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
    fresh = fresh_process(python)
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
