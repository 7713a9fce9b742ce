"""Benchmark: the gate scan of a whole sglang release, against `grep -rn`.

    PYTHONPATH=scripts python benchmarks/gate_scan.py [--tree DIR] [--runs N]

Without --tree it downloads the sglang 0.5.23 platform wheel with pip into a
temporary directory outside the repository and unpacks its `sglang/` package
(the layout `scan_tree` accepts: DIR/sglang or DIR/python/sglang). Prints a
Markdown table: wall and CPU time of `scan_tree` (default workers and one
worker), and `grep -rn` of the helper names over the same files, with what
each finds. `nox -s bench` keeps the gate-scan rows in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sm120fork.gates import Inventory, scan_tree
from sm120fork.gates.scan import default_workers, list_files, package_dir

T = TypeVar("T")
GREP_PATTERN = (
    r"is_sm[0-9]+|is_blackwell|is_hopper|is_ampere_with|get_device_capability|get_device_sm"
)


def download(version: str, where: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    subprocess.run([*command, f"sglang=={version}", "-d", str(where), "-q"], check=True)
    (wheel,) = where.glob(f"sglang-{version}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(where, [n for n in archive.namelist() if n.startswith("sglang/")])
    return where


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(run: Callable[[], T], runs: int) -> tuple[list[float], list[float], T]:
    walls, cpus = [], []
    for _ in range(runs):
        cpu, wall = _cpu(), time.perf_counter()
        result = run()
        walls.append(time.perf_counter() - wall)
        cpus.append(_cpu() - cpu)
    return walls, cpus, result


def grep(package: Path) -> tuple[int, int]:
    done = subprocess.run(
        ["grep", "-rnE", GREP_PATTERN, "--include=*.py", str(package)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = done.stdout.splitlines()
    return len(lines), len({line.split(":", 1)[0] for line in lines})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, help="an unpacked sglang (default: download)")
    parser.add_argument("--version", default="0.5.23")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gate-scan-") as tmp:
        tree = args.tree or download(args.version, Path(tmp))
        package = package_dir(tree)
        files = list_files(package)
        megabytes = sum(size for _, _, size in files) / 1e6
        load = os.getloadavg()
        rows = []
        for workers in (default_workers(), 1):

            def scan(workers: int = workers) -> Inventory:
                return scan_tree(tree, workers=workers)

            walls, cpus, inventory = timed(scan, args.runs)
            found = f"{len(inventory.gates)} gates in {inventory.files_parsed} parsed files"
            rows.append((f"scan_tree, {workers} worker(s)", walls, cpus, found))
        walls, cpus, (lines, hit_files) = timed(lambda: grep(package), args.runs)
        rows.append(("grep -rnE helper names", walls, cpus, f"{lines} lines in {hit_files} files"))
    print(f"sglang {args.version}: {len(files)} Python files, {megabytes:.1f} MB")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, "
        f"load average before: {' '.join(f'{x:.2f}' for x in load)}"
    )
    print()
    print(f"| what | wall min (s) | wall median (s) | CPU median (s) | finds |  ({args.runs} runs)")
    print("|---|---|---|---|---|")
    for name, walls, cpus, found in rows:
        print(
            f"| {name} | {min(walls):.2f} | {statistics.median(walls):.2f} "
            f"| {statistics.median(cpus):.2f} | {found} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
