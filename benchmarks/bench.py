"""Benchmark the fork's tools against the standard tools doing the same work, as
ratios of medians from one run, and the test suite's two tiers.

    nox -s bench [-- --runs 5 --rebase-runs 3 --sizes 10 50 --with-tests]
    PYTHONPATH=scripts python benchmarks/bench.py ...   (needs GNU quilt)

How apply (vs `cp -a` + `quilt push -a`), check, and the rebase onto a synthetic
next release (vs `git am -3` by hand) grow with synthetic series of --sizes
patches (check also at --check-sizes): bench_series.py, bench_rebase_growth.py.
With --with-tests, `nox -s tests` and `nox -s tests -- --fast` in fresh clones
(bench_tests.py); otherwise their last measured values, marked so.

Every side runs as fresh processes, ours and the baseline interleaved, after
one untimed warm-up each (page cache, bytecode). Set-up is not timed. Writes
build/bench/results.{json,md} and benchmarks/RESULTS.md (bench_results.py) and
prints the Markdown. Exits 0 whether or not a target is met: this is a
measurement, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
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
import bench_rebase_growth
import bench_series
import bench_tests
from bench_common import PROJECT, Row, machine
from bench_results import RESULTS_MD, render, results_file

GROUPS = ("growth", "rebase-growth", "envs")
# envs installs every release's decision environment, ~55 GB (bench_envs.py): opt-in
DEFAULT = ["growth", "rebase-growth"]
OUT = PROJECT / "build" / "bench"
TESTS = OUT / "tests.json"


def measure(args: argparse.Namespace, scratch: Path) -> tuple[list[Row], list[dict[str, Any]]]:
    rows: list[Row] = []
    growth: list[dict[str, Any]] = []
    if "growth" in args.only:
        print(f"bench: growth, synthetic series of {args.sizes} patches", file=sys.stderr)
        (scratch / "growth").mkdir()
        growth = bench_series.growth(args.runs, args.sizes, scratch / "growth", args.check_sizes)
        rows.extend(bench_series.check_rows(growth))
    if "rebase-growth" in args.only:
        (scratch / "rebase-growth").mkdir()
        carried = bench_rebase_growth.growth(
            args.rebase_runs, args.sizes, scratch / "rebase-growth"
        )
        by_size = {r["patches"]: r for r in growth}
        for result in carried:
            by_size.setdefault(result["patches"], {"patches": result["patches"]}).update(result)
        growth = sorted(by_size.values(), key=lambda r: r["patches"])
    if "envs" in args.only:
        print("bench: envs, every release's decision environment from an empty uv cache", file=sys.stderr)
        (scratch / "envs").mkdir()
        rows.extend(bench_envs.rows(scratch / "envs", args.envs_json))
    return rows, growth


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
    parser.add_argument("--with-tests", action="store_true", help="also time both test tiers")
    args = parser.parse_args()
    info = machine()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sm120-bench-") as tmp:
        rows, growth = measure(args, Path(tmp))
        measured = time.perf_counter() - started
        if args.with_tests:
            tiers = bench_tests.measure(Path(tmp))
            OUT.mkdir(parents=True, exist_ok=True)
            TESTS.write_text(json.dumps([r.to_json() for r in tiers], indent=2) + "\n")
            rows.extend(tiers)
    if not args.with_tests:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # never measured
            rows.extend(bench_tests.previous_rows(json.loads(TESTS.read_text())))
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
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = render(results)
    (OUT / "results.md").write_text(markdown)
    RESULTS_MD.write_text(results_file(results))
    print(markdown)
    print(
        f"benchmark wall time {elapsed:.0f} s; results in {OUT / 'results.json'} and {RESULTS_MD}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
