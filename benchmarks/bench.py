"""Benchmark the fork's tools against the standard tools doing the same work on
the same real upstream inputs, as ratios of medians from one run.

    nox -s bench [-- --runs 5 --rebase-runs 3 --with-tests --only apply gates]
    PYTHONPATH=scripts python benchmarks/bench.py ...   (needs GNU quilt, `wheel`)

Rows (see bench_series.py, bench_upstream.py, bench_gates.py and
bench_rebase_growth.py for what each side does): apply the series (vs `cp -a` +
`quilt push -a`), carry it 0.5.9 -> 0.5.10 (vs `git am -3` by hand), the gate
inventory of 0.5.23 seen before (vs `grep -rn`) and never seen (vs the
`ast.parse` floor), check of a 1000-patch synthetic series and its cost a patch, the wheel
of 0.5.9 and 0.5.23 (vs `wheel unpack` + `wheel pack`), the git boundary
(GitPython and one `cat-file --batch`, vs the subprocess-a-command boundary before
#18; see bench_git.py), and the test suite
(only with --with-tests; otherwise the last measured value, marked so), and, only
with `--only rebase-verify` (it needs the gate environment), a warm rebase onto one
synthetic release with every carried patch verified by its rows (rebase_verify.py). Then
how apply, check and the rebase (onto a synthetic next release) grow with
synthetic series of --sizes patches (check also at --check-sizes).

Every side runs as fresh processes, ours and the baseline interleaved, after
one untimed warm-up each (page cache, bytecode). Set-up (downloads through pip
and its cache, imports, temp repos) is not timed. Writes
build/bench/results.{json,md} and benchmarks/RESULTS.md (bench_results.py) and prints
the Markdown. Exits 0
whether or not a target is met: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_envs
import bench_gates
import bench_git
import bench_rebase_growth
import bench_series
import bench_upstream
import rebase_verify
from bench_common import PROJECT, Row, machine
from bench_results import RESULTS_MD, render, results_file

GROUPS = (
    "apply", "rebase", "gates", "wheel", "git", "growth", "rebase-growth", "rebase-verify", "envs"
)  # fmt: skip
# rebase-verify needs the gate environment; envs installs ~50 GB of them (bench_envs.py)
DEFAULT = [g for g in GROUPS if g not in ("rebase-verify", "envs")]
OUT = PROJECT / "build" / "bench"
TESTS = OUT / "tests.json"


def _say(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def measure(args: argparse.Namespace, scratch: Path) -> tuple[list[Row], list[dict[str, Any]]]:
    rows: list[Row] = []
    growth: list[dict[str, Any]] = []
    chosen = set(args.only)
    newest: Path | None = None

    def sub(name: str) -> Path:
        path = scratch / name
        path.mkdir(parents=True)
        return path

    if chosen & {"gates", "wheel"}:
        newest = bench_upstream.newest_fork(sub("newest"))
    if "apply" in chosen:
        _say("apply: the project's series, ours vs quilt")
        rows.append(bench_series.apply_row(args.runs, sub("apply")))
    if "rebase" in chosen:
        _say(f"rebase: 0.5.9 -> {bench_upstream.REBASE_TO}, {args.rebase_runs} runs a side")
        rows.append(bench_upstream.rebase_row(args.rebase_runs, sub("rebase")))
    if "gates" in chosen and newest is not None:
        _say(f"gates: sglang {bench_upstream.NEWEST}, ours vs grep")
        rows.extend(bench_gates.rows(args.runs, newest, sub("gates"), bench_upstream.NEWEST))
    if "wheel" in chosen and newest is not None:
        pinned = bench_upstream.project_wheel_repo(sub("wheel-pinned"))
        for repo, label in ((pinned, "the pinned release"), (newest, bench_upstream.NEWEST)):
            _say(f"wheel: {label}, ours vs wheel unpack + pack")
            rows.append(bench_upstream.wheel_row(args.runs, repo, label, sub(label)))
    if "git" in chosen and bench_git.available():
        _say("git: the git boundary, GitPython vs the boundary before #18")
        rows.extend(bench_git.rows(args.runs))
    if "rebase-verify" in chosen:
        _say("rebase-verify: the fork onto a synthetic release, verified, in the gate env")
        rows.append(rebase_verify.row(args.rebase_runs, sub("rebase-verify")))
    if "envs" in chosen:
        _say("envs: every release's decision environment from an empty uv cache")
        rows.extend(bench_envs.rows(sub("envs"), args.envs_json))
    if "growth" in chosen:
        _say(f"growth: synthetic series of {args.sizes} patches")
        growth = bench_series.growth(args.runs, args.sizes, sub("growth"), args.check_sizes)
        rows.extend(bench_series.check_rows(growth))
    if "rebase-growth" in chosen:
        _say(f"rebase growth: synthetic series of {args.sizes} patches, one release")
        carried = bench_rebase_growth.growth(args.rebase_runs, args.sizes, sub("rebase-growth"))
        by_size = {r["patches"]: r for r in growth}
        for result in carried:
            by_size.setdefault(result["patches"], {"patches": result["patches"]}).update(result)
        growth = sorted(by_size.values(), key=lambda r: r["patches"])
    return rows, growth


def previous_tests() -> dict[str, Any] | None:
    """The last measured `nox -s tests` (build/bench/tests.json, which `--with-tests` and
    `--tests-only` write and a run without them leaves alone)."""
    try:
        found: dict[str, Any] = json.loads(TESTS.read_text())
    except (OSError, ValueError):
        return None
    return found


def _keep_tests(row: Row) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    TESTS.write_text(json.dumps(row.to_json(), indent=2) + "\n")


def tests_only() -> int:
    """Measure the test suite and put it into the last results (their other rows stay)."""
    with tempfile.TemporaryDirectory(prefix="sm120-bench-") as tmp:
        row = bench_upstream.measure_tests(Path(tmp))
    _keep_tests(row)
    try:  # read after measuring: a full run may have ended meanwhile
        old = json.loads((OUT / "results.json").read_text())
    except (OSError, ValueError):
        print(f"`nox -s tests`: {row.ours_median:.0f} s ({row.note}); in {TESTS}")
        return 0
    kept = [r for r in old["rows"] if r.get("what") != row.what]
    old["rows"] = [*kept, row.to_json()]
    old["command"] = f"{old.get('command', 'nox -s bench')}, then `nox -s bench -- --tests-only`"
    _write(old)
    return 0


def _write(results: dict[str, Any]) -> None:
    """build/bench/results.{json,md}, and benchmarks/RESULTS.md from them."""
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = render(results)
    (OUT / "results.md").write_text(markdown)
    RESULTS_MD.write_text(results_file(results))
    print(markdown)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs a side (default 5)")
    parser.add_argument("--rebase-runs", type=int, default=3, help="for the rebase (default 3)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument(
        "--check-sizes", type=int, nargs="*", default=[1000], help="sizes for check alone"
    )
    parser.add_argument("--only", nargs="+", choices=GROUPS, default=DEFAULT)
    parser.add_argument(
        "--envs-json", type=Path, help="the group envs from bench_envs.py --json, not measured"
    )
    parser.add_argument("--with-tests", action="store_true", help="also time `nox -s tests`")
    parser.add_argument(
        "--tests-only",
        action="store_true",
        help="time `nox -s tests` alone, replacing that row of the last results",
    )
    args = parser.parse_args()
    if args.tests_only:
        return tests_only()
    info = machine()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sm120-bench-") as tmp:
        rows, growth = measure(args, Path(tmp))
        measured = time.perf_counter() - started
        if args.with_tests:
            rows.append(bench_upstream.measure_tests(Path(tmp)))
        if args.with_tests:
            _keep_tests(rows[-1])
    # Read at the end: a `--tests-only` run may have finished meanwhile.
    if not args.with_tests and (tests := bench_upstream.tests_row(previous_tests())) is not None:
        rows.append(tests)
    elapsed = time.perf_counter() - started
    info["load_1min_at_end"] = round(os.getloadavg()[0], 2)
    results = {
        "command": " ".join(["nox -s bench", *(["--", *sys.argv[1:]] if sys.argv[1:] else [])]),
        "date": datetime.date.today().isoformat(),
        "machine": info,
        "runs": args.runs,
        "rebase_runs": args.rebase_runs,
        "bench_wall_s": round(elapsed, 1),
        "bench_wall_s_without_tests": round(measured, 1),
        "rows": [row.to_json() for row in rows],
        "growth": growth,
    }
    _write(results)
    print(
        f"benchmark wall time {elapsed:.0f} s ({measured:.0f} s without the test suite); "
        f"results in {OUT / 'results.json'} and {RESULTS_MD}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
