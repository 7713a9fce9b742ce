"""Benchmark `sm120fork wheel` against the I/O floor: `wheel unpack` + `wheel pack`
of the same upstream wheel (needs `pip install wheel`).

    PYTHONPATH=scripts:tests python benchmarks/wheel_bench.py [--runs 7]

Both sides run as fresh processes, so both pay interpreter start-up. The fork
build uses a temporary repo: the project's vendor/sglang, lock, CHANGELOG and
series when the project has a lock, else the real 0.5.9 wheel with a one-patch
series. Prints its result; `nox -s bench` keeps the wheel rows in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
TARGET = 1.5


def timed(runs: int, setup: Callable[[], None], step: Callable[[], None]) -> list[float]:
    times = []
    for _ in range(runs):
        setup()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def run(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROJECT / "scripts")])}
    subprocess.run(args, check=True, capture_output=True, env=env)


def make_repo(root: Path) -> tuple[Path, str]:
    """A repo to build from: the project's inputs, or a stand-in series on 0.5.9."""
    sys.path[:0] = [str(PROJECT / "scripts"), str(PROJECT / "tests")]
    from forkrepo import edit, make_patch, write_manifest
    from sm120fork.upstream import lock as lockfile

    shutil.copytree(PROJECT / "vendor" / "sglang", root / "vendor" / "sglang")
    if (PROJECT / "vendor" / "sglang.lock").is_file() and (PROJECT / "CHANGELOG.md").is_file():
        shutil.copy(PROJECT / "vendor" / "sglang.lock", root / "vendor" / "sglang.lock")
        shutil.copy(PROJECT / "vendor" / "sglang.sha256", root / "vendor" / "sglang.sha256")
        shutil.copy(PROJECT / "CHANGELOG.md", root / "CHANGELOG.md")
        shutil.copytree(PROJECT / "patches", root / "patches")
        return root, "the project's lock, CHANGELOG and series"
    name = "sglang-0.5.9-py3-none-any.whl"
    sha = "8a936c4d25fea605f44254e533cff2144c73ceffbc1f8738aba393461bbb64d1"
    lock = lockfile.Lock(
        "0.5.9",
        "v0.5.9",
        "pypi",
        "2026-11-29",
        name,
        f"{name}:LICENSE",
        artifacts=(lockfile.Artifact(name, sha, 5201033),),
    )
    (root / "vendor" / "sglang.lock").write_text(lockfile.dumps(lock))
    write_manifest(root, "0.5.9")  # the wheel build refuses a tree nothing vouches for
    (root / "CHANGELOG.md").write_text("## 0.5.9+sm120.1 - 2026-11-29\n")
    path = "python/sglang/srt/utils/common.py"
    base = (root / "vendor" / "sglang" / path).read_text()
    patch = make_patch("Bench change", {path: base}, {path: edit(base, "\n", "\n# sm120\n")})
    (root / "patches").mkdir()
    (root / "patches" / "bench.patch").write_text(patch)
    (root / "patches" / "series").write_text("bench.patch\n")
    return root, "a stand-in one-patch series (the project has no vendor/sglang.lock yet)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        repo, inputs = make_repo(work / "repo")
        python = sys.executable
        # Warm-up build: downloads the upstream wheel into the repo's cache once.
        run(python, "-m", "sm120fork", "-C", str(repo), "wheel", "--dist", str(work / "d0"))
        (upstream,) = (repo / "build" / "wheel" / "cache").glob("*.whl")

        def clean() -> None:
            for name in ("dist", "unpacked", "packed"):
                shutil.rmtree(work / name, ignore_errors=True)

        ours = timed(
            args.runs,
            clean,
            lambda: run(
                python, "-m", "sm120fork", "-C", str(repo), "wheel", "--dist", str(work / "dist")
            ),
        )

        def unpack_pack() -> None:
            run(python, "-m", "wheel", "unpack", "-d", str(work / "unpacked"), str(upstream))
            (tree,) = (work / "unpacked").iterdir()
            (work / "packed").mkdir()
            run(python, "-m", "wheel", "pack", "-d", str(work / "packed"), str(tree))

        floor = timed(args.runs, clean, unpack_pack)
        (built,) = (work / "d0").iterdir()
        digest = hashlib.sha256(built.read_bytes()).hexdigest()[:16]
    ratio = statistics.median(ours) / statistics.median(floor)
    report = render(args.runs, inputs, upstream.name, built.name, digest, ours, floor, ratio)
    print(report)
    return 0 if ratio <= TARGET else 1


def render(
    runs: int,
    inputs: str,
    upstream: str,
    built: str,
    digest: str,
    ours: list[float],
    floor: list[float],
    ratio: float,
) -> str:
    def row(label: str, times: list[float]) -> str:
        return f"| {label} | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} |"

    verdict = "met" if ratio <= TARGET else "MISSED"
    return "\n".join(
        [
            "# `sm120fork wheel` benchmark",
            "",
            f"Measured {datetime.date.today()} on {platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}; {runs} runs each, fresh processes, "
            "warm page cache.",
            f"Upstream wheel: `{upstream}`; built: `{built}` (sha256 {digest}...) from {inputs}.",
            "",
            "| step | median s | min s | max s |",
            "|---|---|---|---|",
            row("`sm120fork wheel` (verify lock hash + RECORD, apply series, write)", ours),
            row("`wheel unpack` + `wheel pack` (I/O floor)", floor),
            "",
            f"Ratio (median ours / median floor): **{ratio:.2f}x**; "
            f"target <= {TARGET}x: {verdict}.",
            "",
            "Run again with `PYTHONPATH=scripts:tests python benchmarks/wheel_bench.py`.",
            "",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
