"""Benchmark the gate environments with uv (issue 38): every release's decision
environment from 0.5.9 to the vendored release, from an empty uv cache, then the
fork's own gate environment reinstalled from the warm cache.

    PYTHONPATH=scripts nice -n 10 python benchmarks/bench_envs.py [--root DIR] [--json F]
    nox -s bench -- --only envs [--envs-json F]   (its rows in benchmarks/RESULTS.md)

The env root (`--root`, default ~/.cache/sglang-sm120/bench-envs) is emptied first:
its uv cache too. Not timed: reading each release's pins (pip downloads its wheel,
as the rebase's fetch does). Timed, release by release, in the rebase's own code:
`decisionenv.find` (an existing venv with the same pins, else `uv venv` + `uv pip
install` as of the release's time). Disk: `du` over the root (hard links counted
once) and over its uv cache. The fork's gate environment (`gateenv.ensure`) is
installed once, deleted, and installed again, timed, from the warm cache. Stops
installing when less than 10 GB of disk is free. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
FIRST = "0.5.9"
MIN_FREE = 10 * 10**9


def _say(message: str) -> None:
    print(f"bench envs: {message}", file=sys.stderr, flush=True)


def releases(vendored: str) -> list[str]:
    from sm120fork.upstream import pypi

    found = [Version(v) for v in pypi.available_versions()]
    chosen = [v for v in found if Version(FIRST) <= v <= Version(vendored) and not v.is_prerelease]
    return [str(v) for v in sorted(chosen)]


def du_bytes(path: Path) -> int:
    ran = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(ran.stdout.split()[0])


def measure(root: Path, scratch: Path) -> dict[str, Any]:
    from sm120fork import gateenv
    from sm120fork.rebase import decisionenv
    from sm120fork.upstream import pypi

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    os.environ["SM120_ENV_ROOT"] = str(root)
    os.environ["SM120_GATE_ENV"] = str(root / "gate-env-fork")
    for name in (decisionenv.INSTALL_VARIABLE, decisionenv.OVERRIDE_VARIABLE):
        os.environ.pop(name, None)
    versions = releases(gateenv.vendored_version(ROOT))
    _say(f"{len(versions)} releases: {', '.join(versions)}")
    for version in versions:  # not timed: the rebase's fetch reads the pins
        folder = scratch / version
        folder.mkdir()
        decisionenv.record_pins(folder, pypi.download_wheel(version, folder), None)
    walked: list[dict[str, Any]] = []
    for version in versions:
        free = shutil.disk_usage(root).free
        if free < MIN_FREE:
            walked.append({"version": version, "stopped": f"{free / 1e9:.1f} GB free"})
            break
        start = time.perf_counter()
        try:
            env = decisionenv.find(ROOT, version, scratch / version, _say)
            done: dict[str, Any] = {"venv": env.venv.name, "why": env.why}
        except decisionenv.NoDecisionEnv as error:
            done = {"failed": error.message}
        seconds = time.perf_counter() - start
        walked.append({"version": version, "s": round(seconds, 1), **done})
        _say(f"{version}: {seconds:.0f} s, {done}")
    total_s = sum(w.get("s", 0.0) for w in walked)
    disk = du_bytes(root)
    cache = du_bytes(root / "uv")
    start = time.perf_counter()
    gateenv.ensure(ROOT)
    first_s = time.perf_counter() - start
    shutil.rmtree(root / "gate-env-fork")
    start = time.perf_counter()
    gateenv.ensure(ROOT)
    warm_s = time.perf_counter() - start
    return {
        "releases": walked,
        "total_s": round(total_s, 1),
        "disk_gb": round(disk / 1e9, 1),
        "cache_gb": round(cache / 1e9, 1),
        "venvs": len({w["venv"] for w in walked if "venv" in w}),
        "failed": [w["version"] for w in walked if "failed" in w or "stopped" in w],
        "gate_env_first_s": round(first_s, 1),
        "gate_env_warm_s": round(warm_s, 1),
    }


def rows(scratch: Path, measured: Path | None = None) -> list[Any]:
    """The two rows of benchmarks/RESULTS.md (bench.py's group `envs`): measured now, or
    read from `measured` (this script's --json, to keep a run of many minutes)."""
    from bench_common import Row

    if measured is not None:
        found = json.loads(measured.read_text())
    else:
        found = measure(default_root(), scratch)
    count = len(found["releases"])
    failed = ", ".join(found["failed"]) or "none"
    fits = "yes" if found["disk_gb"] <= 60 else "**no**"
    return [
        Row(
            what=(
                f"{count} release decision environments {found['releases'][0]['version']} ... "
                f"{found['releases'][-1]['version']} from an empty uv cache (bench_envs.py)"
            ),
            ours="`decisionenv.find` (uv, one cache, hard links)",
            baseline="-",
            ours_s=(found["total_s"],),
            limit_s=600.0,
            note=(
                f"{found['venvs']} venvs; {found['disk_gb']} GB on disk of which the uv cache "
                f"{found['cache_gb']} GB (<= 60 GB: {fits}); not installed: {failed}"
            ),
            extra={"envs": found},
        ),
        Row(
            what="the fork's own gate environment from a warm uv cache",
            ours="`python -m sm120fork.gateenv`",
            baseline="-",
            ours_s=(found["gate_env_warm_s"],),
            limit_s=120.0,
            note=f"its first install after the releases' {found['gate_env_first_s']:.0f} s",
        ),
    ]


def default_root() -> Path:
    return Path.home() / ".cache" / "sglang-sm120" / "bench-envs"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=default_root())
    parser.add_argument("--json", type=Path, help="write the measurement here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sm120-bench-envs-") as tmp:
        found = measure(args.root, Path(tmp))
    text = json.dumps(found, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
