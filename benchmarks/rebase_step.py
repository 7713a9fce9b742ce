"""Benchmark one real rebase step (the fork's 0.5.9 series, 0.5.9 -> 0.5.10) against
doing the same by hand with `git am -3` on the same trees.

    PYTHONPATH=scripts python benchmarks/rebase_step.py [--runs 3] [--to 0.5.10]

The step is fixed, whatever release the project vendors now: the series as it stood
on 0.5.9 is kept in benchmarks/data/series-0.5.9/ (12 patches, its intents and gate
policy), so the figures stay comparable across rebases of the project itself.

Setup (not timed): sglang 0.5.9 and <to> are fetched once from the package index;
a local git remote gets them as tags v0.5.9 and v<to>; a temporary fork repo gets
0.5.9 as vendor/ (with its lock) and the kept series as patches/. `check` and
`gates` of that fork fill a cache directory (its intent proofs, the 0.5.9 gate
scan), as the fork's own CI leaves them; each timed run starts from a fresh copy
of it, so <to> is never a tree scanned before and nothing the run writes is read
by the next one.

Timed, each as fresh processes, best of --runs:
- tool: `sm120fork rebase v<to> --upstream-git file://... --dry-run` (fetch from
  the local remote, carry every patch, classify, refresh, report; a dry run goes
  on past conflicts, so every patch is tried);
- by hand: the steps a maintainer would script: a clone of the remote at
  v<from>, `git am` of the series, `git format-patch` (git am -3 needs the blob
  ids the normal form leaves out), checkout v<to>, `git am -3` of each patch
  (`git am --skip` on a conflict), then `git format-patch` of what applied.
The hand route neither classifies (clean/offset/merged/upstreamed), nor
re-renders normal form, nor writes a report. `nox -s bench` keeps this row in
benchmarks/RESULTS.md. Not a timed test.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from sm120fork import gitcmd  # noqa: E402
from sm120fork.patches.series import read_series  # noqa: E402
from sm120fork.upstream import lock  # noqa: E402
from sm120fork.upstream.fetch import fetch_release  # noqa: E402

IDENTITY = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.com",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.com",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}


def git(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return gitcmd.run(args, cwd, check=check, env=IDENTITY)


def commit_tree(repo: Path, tree: Path, message: str, tag: str) -> None:
    for entry in repo.iterdir():
        if entry.name != ".git":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    shutil.copytree(tree, repo, dirs_exist_ok=True)
    git(repo, "add", "-A", "-f", ".")
    git(repo, "commit", "-q", "-m", message)
    git(repo, "tag", tag)


BASE = "0.5.9"
SERIES = ROOT / "benchmarks" / "data" / f"series-{BASE}"


def setup(scratch: Path, version: str) -> tuple[Path, Path, str]:
    """(fork repo, upstream remote, pinned version); the seeded cache is seed_dir(fork)."""
    fork = scratch / "fork"
    fork.mkdir()
    (fork / ".gitignore").write_text("/build/\n")
    git(fork, "init", "-q", ".")
    print(f"importing sglang {BASE} from the package index (not timed)", file=sys.stderr)
    env = {**os.environ, **IDENTITY, "PYTHONPATH": str(ROOT / "scripts")}
    command = [sys.executable, "-m", "sm120fork", "-C", str(fork), "import", BASE]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    pinned = lock.read(fork / "vendor/sglang.lock")
    assert pinned is not None and pinned.version == BASE
    # The series as it stood; its era's gate data and the replay's recorded resolutions
    # (benchmarks/replay.py) are not part of patches/.
    shutil.copytree(SERIES, fork / "patches", ignore=shutil.ignore_patterns("gates", "resolutions"))
    (fork / "CHANGELOG.md").write_text(f"# Changelog\n\n## {BASE}+sm120.1 - 2026-11-29\n")
    git(fork, "add", "-A", ".")
    git(fork, "commit", "-q", "-m", "fork")
    print(f"fetching sglang {version} from the package index (not timed)", file=sys.stderr)
    release = fetch_release(version, workdir=scratch / "fetch")
    remote = scratch / "upstream"
    remote.mkdir()
    git(remote, "init", "-q", ".")
    commit_tree(remote, fork / "vendor/sglang", f"sglang {BASE}", f"v{BASE}")
    commit_tree(remote, release.tree, f"sglang {release.version}", f"v{release.version}")
    seed = cached_env(env, seed_dir(fork))
    for command in (["check"], ["gates", "--out", str(scratch / "gates-seed")]):
        tool = [sys.executable, "-m", "sm120fork", "-C", str(fork), *command]
        subprocess.run(tool, env=seed, check=False, stdout=subprocess.DEVNULL)
    return fork, remote, BASE


CACHE_VARIABLES = ("SM120FORK_GATE_SCAN_CACHE", "SM120FORK_INTENT_CACHE")


def cached_env(env: dict[str, str], cache: Path) -> dict[str, str]:
    """`env` with the tool's caches in `cache` (and nowhere a variable names)."""
    kept = {k: v for k, v in env.items() if k not in CACHE_VARIABLES}
    return {**kept, "XDG_CACHE_HOME": str(cache)}


def seed_dir(fork: Path) -> Path:
    """The cache `check` and `gates` of the fork left (intent proofs, the old tree's scan)."""
    return fork.parent / "cache-seed"


def by_tool(fork: Path, remote: Path, version: str) -> tuple[float, str]:
    cache = fork.parent / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    shutil.copytree(seed_dir(fork), cache)
    env = cached_env({**os.environ, **IDENTITY, "PYTHONPATH": str(ROOT / "scripts")}, cache)
    command = [sys.executable, "-m", "sm120fork", "-C", str(fork), "rebase", f"v{version}"]
    start = time.perf_counter()
    result = subprocess.run(
        [*command, "--upstream-git", remote.as_uri(), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.perf_counter() - start
    if result.returncode not in (0, 1):
        raise SystemExit(result.stderr)
    return elapsed, result.stdout.strip()


def by_hand(scratch: Path, remote: Path, old: str, new: str) -> tuple[float, list[str]]:
    work = scratch / "by-hand"
    shutil.rmtree(work, ignore_errors=True)
    names = read_series(SERIES / "series").names
    start = time.perf_counter()
    git(scratch, "clone", "-q", "--no-checkout", remote.as_uri(), str(work))
    git(work, "checkout", "-q", f"v{old}")
    git(work, "am", "-q", *(str(SERIES / name) for name in names))
    mails = work / ".git" / "mails"
    git(work, "format-patch", "-q", "-o", str(mails), f"v{old}..HEAD")
    git(work, "checkout", "-q", f"v{new}")
    failed = []
    for mail, name in zip(sorted(mails.iterdir()), names, strict=True):
        if git(work, "am", "-q", "-3", str(mail), check=False).returncode != 0:
            git(work, "am", "--skip")
            failed.append(name)
    git(work, "format-patch", "-q", "-o", str(work / ".git" / "refreshed"), f"v{new}..HEAD")
    return time.perf_counter() - start, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--to", default="0.5.10")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sm120-rebase-bench-") as tmp:
        scratch = Path(tmp)
        fork, remote, old = setup(scratch, args.to)
        tool: list[float] = []
        hand: list[float] = []
        summary, failed = "", list[str]()
        for _ in range(args.runs):
            elapsed, summary = by_tool(fork, remote, args.to)
            tool.append(elapsed)
            elapsed, failed = by_hand(scratch, remote, old, args.to)
            hand.append(elapsed)
        print(
            f"# {platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}, "
            f"{len(read_series(SERIES / 'series').names)} patches, {old} -> {args.to}, "
            f"best of {args.runs}"
        )
        print("| route | wall s (best) | all runs s |")
        print("|---|---|---|")
        print(
            f"| tool `rebase --dry-run` | {min(tool):.2f} | {', '.join(f'{t:.2f}' for t in tool)} |"
        )
        print(f"| by hand `git am -3` | {min(hand):.2f} | {', '.join(f'{t:.2f}' for t in hand)} |")
        print(f"\nratio tool / by hand: {min(tool) / min(hand):.2f}")
        print(f"tool: {summary}")
        print(f"git am -3 failed on: {', '.join(failed) or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
