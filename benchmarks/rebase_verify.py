"""Benchmark a warm single-release rebase with verification: the fork as it is onto a
synthetic release cut from the vendored one (issue 30: at most 5 minutes on the
2-core machine).

    flock /tmp/sm120-gates.lock env PYTHONPATH=scripts $GATE_PY \
        benchmarks/rebase_verify.py [--runs 1]

Run it with the gate environment's python: the synthetic release declares that
environment's pins in python/pyproject.toml (tests/gates/synthetic.py), so the
rebase finds it as the release's decision environment, installs nothing and
downloads nothing ("warm"); the gate-scan and intent-proof caches are the user's,
as the fork's CI leaves them.

Setup (not timed): a local git remote with v<pinned> as vendored and v<next> the
same tree with one comment line added to a module no patch touches (every patch
carries, so every patch's rows run); a git checkout of the fork.
Timed, best of --runs, each on a fresh checkout: `sm120fork rebase v<next>
--upstream-git file://...`: fetch, carry, the rows of every patch on the pristine
release (upstreamed?) and on the patched one (verified?), land. Not a timed test:
bench.py's opt-in group `rebase-verify` runs it in the gate environment (`row`) for
benchmarks/RESULTS.md (name every group with --only: a run rewrites that file from
its own rows). Measured on the shared 2-core machine (other engineers' jobs
beside it), 2026-12-04: 158.6 s with 19 patches (18 verified; sm120-doctor.patch
is `[[untested]]`), then 226.1 s through `row` with 20 (19 verified).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gates import synthetic  # noqa: E402

TOUCHED = Path("python/sglang/srt/utils/__init__.py")  # no patch changes it


def comment(tree: Path) -> None:
    path = tree / TOUCHED
    path.write_text(path.read_text() + "# a release that changes nothing the fork carries\n")


def one_run(scratch: Path, remote: Path, home: Path, tag: str) -> tuple[float, dict[str, object]]:
    shutil.rmtree(scratch / "fork", ignore_errors=True)
    fork = synthetic.fork_checkout(scratch, home)
    tool = [sys.executable, "-m", "sm120fork", "-C", str(fork), "rebase", tag]
    start = time.perf_counter()
    ran = synthetic.run(fork, *tool, "--upstream-git", remote.as_uri(), home=home)
    elapsed = time.perf_counter() - start
    if ran.returncode != 0:
        raise SystemExit(f"the rebase exited {ran.returncode}:\n{ran.stderr[-4000:]}")
    return elapsed, json.loads((fork / "build/rebase/report.json").read_text())


def row(runs: int, scratch: Path) -> Any:
    """The benchmark's row for benchmarks/RESULTS.md (bench.py, in the tool's venv): this
    script run by the gate environment's python."""
    from bench_common import Row  # benchmarks/ is on bench.py's path
    from sm120fork import gateenv

    out = scratch / "rebase-verify.json"
    python = gateenv.locate(ROOT).python
    command = [str(python), __file__, "--runs", str(runs), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts")}
    subprocess.run(command, env=env, check=True)
    found = json.loads(out.read_text())
    return Row(
        what="warm rebase onto one release, every carried patch verified by its rows",
        ours="`rebase --upstream-git` (synthetic next release)",
        baseline="-",
        ours_s=tuple(found["runs_s"]),
        limit_s=300.0,
        note=f"{found['verified']} of {found['patches']} patches verified",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the runs here (for bench.py)")
    args = parser.parse_args()
    pinned = str(tomllib.loads((ROOT / "vendor/sglang.lock").read_text())["version"])
    major, minor, patch = pinned.split(".")
    following = f"{major}.{minor}.{int(patch) + 1}"
    with tempfile.TemporaryDirectory(prefix="sm120-rebase-verify-") as tmp:
        scratch = Path(tmp)
        home = scratch / "home"
        home.mkdir()
        releases = [(f"v{pinned}", None), (f"v{following}", comment)]
        remote = synthetic.cut_releases(scratch, home, releases)
        times: list[float] = []
        report: dict[str, object] = {}
        for _ in range(args.runs):
            elapsed, report = one_run(scratch, remote, home, f"v{following}")
            times.append(elapsed)
    patches = report["patches"]
    assert isinstance(patches, list)
    verified = sum(1 for p in patches if str(p["verified"]).startswith("verified"))
    print(
        f"# {platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"{len(patches)} patches, {pinned} -> synthetic {following}, best of {args.runs}"
    )
    print(f"| warm `rebase` with verification | {min(times):.1f} s | runs: {times} |")
    print(f"result {report['result']}: {verified} of {len(patches)} patches verified by rows")
    if args.json:
        found = {"runs_s": times, "verified": verified, "patches": len(patches)}
        args.json.write_text(json.dumps(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
