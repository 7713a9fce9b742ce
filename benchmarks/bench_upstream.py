"""The rows on other upstream releases: carrying the series to 0.5.10 and the wheel
of 0.5.9 and 0.5.23 (the gate inventory of 0.5.23 is bench_gates.py).

The measuring code of the single-purpose benchmarks is reused, not copied:
rebase_step.py's set-up and both of its routes, wheel_bench.py's fork repo of
the project's series.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench_common import PROJECT, Row, compare, fresh, run, timed, tool, tool_env

REBASE_TO = "0.5.10"
NEWEST = "0.5.23"
TESTS_LIMIT_S = 300.0  # `nox -s tests` on a warm fresh clone, 2 cores


def rebase_row(runs: int, scratch: Path) -> Row:
    import rebase_step

    fork, remote, old = rebase_step.setup(scratch, REBASE_TO)
    found: dict[str, object] = {}

    def ours() -> float:
        elapsed, found["tool"] = rebase_step.by_tool(fork, remote, REBASE_TO)
        return elapsed

    def by_hand() -> float:
        elapsed, found["git am -3 failed on"] = rebase_step.by_hand(scratch, remote, old, REBASE_TO)
        return elapsed

    # No warm-up: the set-up has just read every input, and a run takes ~30 s.
    mine, theirs = compare(runs, ours, by_hand, warmup=False)
    return Row(
        what=f"carry the series one release ({old} -> {REBASE_TO})",
        ours="`rebase --dry-run` (from a local git remote)",
        baseline="clone + `git am` + `format-patch` + `git am -3` (+ `--skip`) + `format-patch`",
        ours_s=tuple(mine),
        baseline_s=tuple(theirs),
        target_ratio=1.5,
        extra={"found": found},
    )


def newest_fork(scratch: Path) -> Path:
    """A fork repo pinning the newest release with an empty series (`sm120fork import`)."""
    root = scratch / f"fork-{NEWEST}"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "series").write_text("")
    (root / "CHANGELOG.md").write_text(f"## {NEWEST}+sm120.1 - 2026-11-29\n")
    print(f"bench: importing sglang {NEWEST} (not timed)", file=sys.stderr, flush=True)
    run(tool("-C", root, "import", NEWEST), env=tool_env())
    return root


def wheel_row(runs: int, repo: Path, label: str, scratch: Path) -> Row:
    """`sm120fork wheel` against `wheel unpack` + `wheel pack` of the same upstream wheel."""
    cache = scratch / "wheel-cache"
    dist = scratch / "dist"
    build = tool("-C", repo, "wheel", "--cache", cache, "--dist", dist)
    print(f"bench: fetching the upstream wheel of {label} (not timed)", file=sys.stderr, flush=True)
    run(build, env=tool_env())
    (upstream,) = cache.glob("*.whl")
    (built,) = dist.glob("*.whl")

    def ours() -> float:
        fresh(dist)
        return timed(build, env=tool_env())

    def unpack_pack() -> float:
        unpacked, packed = fresh(scratch / "unpacked"), fresh(scratch / "packed")
        packed.mkdir(parents=True)
        start = time.perf_counter()
        run([sys.executable, "-m", "wheel", "unpack", "-d", unpacked, upstream])
        (tree,) = unpacked.iterdir()
        run([sys.executable, "-m", "wheel", "pack", "-d", packed, tree])
        return time.perf_counter() - start

    # The fetching build above was ours' warm-up and read the upstream wheel into the cache.
    mine, theirs = compare(runs, ours, unpack_pack, warmup=False)
    size = upstream.stat().st_size / 1e6
    return Row(
        what=f"rebuild the wheel of {label} ({size:.0f} MB)",
        ours="`sm120fork wheel`",
        baseline="`wheel unpack` + `wheel pack` of the upstream wheel",
        ours_s=tuple(mine),
        baseline_s=tuple(theirs),
        target_ratio=1.5,
        extra={"upstream_wheel": upstream.name, "built": built.name},
    )


def project_wheel_repo(scratch: Path) -> Path:
    """The project's lock, CHANGELOG and series in a temporary repo (wheel_bench.py's)."""
    from wheel_bench import make_repo

    repo, _ = make_repo(scratch / "fork-pinned")
    return repo


def tests_row(previous: dict[str, object] | None) -> Row | None:
    """The last measured `nox -s tests` (build/bench/tests.json), marked as such."""
    if previous is None:
        return None
    return Row(
        what="whole test suite",
        ours=str(previous.get("ours", "`nox -s tests`")),
        baseline="-",
        ours_s=(float(str(previous["ours_median_s"])),),
        limit_s=TESTS_LIMIT_S,
        note=(
            f"not measured in this run but beside it, {previous.get('measured_at', 'earlier')}"
            f": {previous.get('note', previous.get('outcome', 'outcome unknown'))}; "
            "`-- --with-tests` or `--tests-only` measures it"
        ),
        extra={
            "measured_at": previous.get("measured_at"),
            "measured_now": False,
            "exit_code": previous.get("exit_code"),
            "outcome": previous.get("outcome"),
        },
    )


def measure_tests(scratch: Path) -> Row:
    """One run of `nox -s tests` in a fresh clone of the project's HEAD (the gate
    environment and pip's cache warm, as on a maintainer's machine), outside this
    session's venv."""
    import datetime
    import os
    import shutil

    env = dict(os.environ)
    venv = env.pop("VIRTUAL_ENV", None)
    if venv:
        inside = str(Path(venv) / "bin")
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != inside)
    nox = shutil.which("nox", path=env["PATH"])
    argv = [nox] if nox else [sys.executable, "-m", "nox"]
    clone = scratch / "clone"
    run(["git", "clone", "-q", PROJECT, clone])
    print("bench: running `nox -s tests` in a fresh clone (minutes)", file=sys.stderr, flush=True)
    load_before = round(os.getloadavg()[0], 2)
    start = time.perf_counter()
    done = run([*argv, "-s", "tests"], cwd=clone, env=env, ok=range(256))
    elapsed = time.perf_counter() - start
    outcome = "passed" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
    load_after = round(os.getloadavg()[0], 2)
    return Row(
        what="whole test suite",
        ours="`nox -s tests` (a fresh clone, gate environment warm)",
        baseline="-",
        ours_s=(elapsed,),
        limit_s=TESTS_LIMIT_S,
        note=f"one run, {outcome}, load {load_before} -> {load_after}",
        extra={
            "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "measured_now": True,
            "exit_code": done.returncode,
            "outcome": outcome,
            "load_1min_before": load_before,
            "load_1min_after": load_after,
            "tail": done.stdout[-1500:],
        },
    )
