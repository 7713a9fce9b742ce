"""The test suite as benchmark rows: `nox -s tests` (what CI runs) and its fast tier
(`nox -s tests -- --fast`), each one run in a fresh clone of the project's HEAD, the
gate environment and pip's cache warm, as on a maintainer's machine. The limits are
issue 39's: the suite within 20 minutes, the fast tier within 5, on 2 cores."""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import PROJECT, Row, run

TIERS: tuple[tuple[str, list[str], float], ...] = (
    ("whole test suite", [], 1200.0),
    ("fast tier", ["--", "--fast"], 300.0),
)


def measure(scratch: Path) -> list[Row]:
    """One run of each tier, in its own fresh clone, outside this session's venv."""
    env = dict(os.environ)
    venv = env.pop("VIRTUAL_ENV", None)
    if venv:
        inside = str(Path(venv) / "bin")
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != inside)
    nox = shutil.which("nox", path=env["PATH"])
    argv = [nox] if nox else [sys.executable, "-m", "nox"]
    rows: list[Row] = []
    for what, extra, limit in TIERS:
        clone = scratch / f"clone-{len(rows)}"
        run(["git", "clone", "-q", PROJECT, clone])
        command = " ".join(["nox -s tests", *extra])
        print(f"bench: `{command}` in a fresh clone (minutes)", file=sys.stderr, flush=True)
        load_before = round(os.getloadavg()[0], 2)
        start = time.perf_counter()
        done = run([*argv, "-s", "tests", *extra], cwd=clone, env=env, ok=range(256))
        elapsed = time.perf_counter() - start
        outcome = "passed" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
        load_after = round(os.getloadavg()[0], 2)
        rows.append(
            Row(
                what=what,
                ours=f"`{command}` (a fresh clone, gate environment warm)",
                baseline="-",
                ours_s=(elapsed,),
                limit_s=limit,
                note=f"one run, {outcome}, load {load_before} -> {load_after}",
                extra={
                    "measured_at": datetime.datetime.now(datetime.UTC).strftime(
                        "%Y-%m-%d %H:%M UTC"
                    ),
                    "measured_now": True,
                    "exit_code": done.returncode,
                    "outcome": outcome,
                    "tail": done.stdout[-1500:],
                },
            )
        )
    return rows


def previous_rows(previous: list[dict[str, Any]]) -> list[Row]:
    """The last measured tiers (build/bench/tests.json), marked as not measured now."""
    rows: list[Row] = []
    for found in previous:
        rows.append(
            Row(
                what=str(found["what"]),
                ours=str(found["ours"]),
                baseline="-",
                ours_s=(float(found["ours_median_s"]),),
                limit_s=found.get("limit_s"),
                note=(
                    f"not measured in this run but beside it, {found.get('measured_at')}: "
                    f"{found.get('outcome', 'outcome unknown')}; `-- --with-tests` measures it"
                ),
                extra={"measured_at": found.get("measured_at"), "measured_now": False},
            )
        )
    return rows
