"""How the rebase grows with the series: synthetic series of N patches carried one
synthetic release, the tool against `git am -3` by hand.

Set-up (not timed): a fork repo holding the project's vendor/ (0.5.23, its lock
and manifest) and N one-line patches (bench_series.py's synthetic series); a
local git remote with v0.5.23 (that tree) and v0.5.24, the same tree with a
comment line added at the top of every file a patch touches and of every
tenth other Python file, so every patch carries at an offset and the release
changes files no patch touches. The gate scan of 0.5.23 is seeded into a
cache directory that each timed run starts from a fresh copy of: the old
tree is one the fork has scanned before (`nox -s gates`), the new one is not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import bench_series
from bench_common import PROJECT, Row, compare, run, tool, tool_env
from sm120fork import gitcmd
from sm120fork.patches.series import read_series

OLD, NEW = "0.5.23", "0.5.24"
MARK = "# sm120 bench: upstream {new}\n"
IDENTITY = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.com",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.com",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}
CACHE_VARIABLES = ("SM120FORK_GATE_SCAN_CACHE", "SM120FORK_INTENT_CACHE")


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


def cached_env(env: dict[str, str], cache: Path) -> dict[str, str]:
    """`env` with the tool's caches in `cache` (and nowhere a variable names)."""
    kept = {k: v for k, v in env.items() if k not in CACHE_VARIABLES}
    return {**kept, "XDG_CACHE_HOME": str(cache)}


def _next_release(old: Path, new: Path, touched: set[str]) -> None:
    shutil.copytree(old, new, symlinks=True)
    pythons = sorted(p.relative_to(new).as_posix() for p in new.rglob("*.py"))
    for k, rel in enumerate(pythons):
        if rel in touched or k % 10 == 0:
            path = new / rel
            path.write_bytes(MARK.format(new=NEW).encode() + path.read_bytes())


def setup(scratch: Path, size: int) -> tuple[Path, Path]:
    """(fork repo, upstream remote) for a series of `size` patches."""
    made = bench_series.synthetic_repo(scratch / "series", size)
    fork = scratch / "fork"
    fork.mkdir()
    (fork / ".gitignore").write_text("/build/\n")
    run(["cp", "-a", PROJECT / "vendor", fork / "vendor"])
    shutil.copytree(made / "patches", fork / "patches")
    (fork / "CHANGELOG.md").write_text(f"# Changelog\n\n## {OLD}+sm120.1 - 2026-11-29\n")
    git(fork, "init", "-q", ".")
    git(fork, "add", "-A", ".")
    git(fork, "commit", "-q", "-m", "fork")
    touched = {
        line.split(" b/", 1)[1].removeprefix("python/sglang/").strip()
        for patch in (fork / "patches").glob("*.patch")
        for line in patch.read_text().splitlines()
        if line.startswith("diff --git ")
    }
    old_tree = fork / "vendor" / "sglang"
    new_tree = scratch / "next"
    _next_release(old_tree / "python" / "sglang", new_tree / "python" / "sglang", touched)
    for extra in old_tree.iterdir():
        if extra.name != "python":
            dest = new_tree / extra.name
            (shutil.copytree if extra.is_dir() else shutil.copy2)(extra, dest)
    for item in (old_tree / "python").iterdir():
        if item.name != "sglang":
            dest = new_tree / "python" / item.name
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, dest)
    remote = scratch / "upstream"
    remote.mkdir()
    git(remote, "init", "-q", ".")
    commit_tree(remote, old_tree, f"sglang {OLD}", f"v{OLD}")
    commit_tree(remote, new_tree, f"sglang {NEW}", f"v{NEW}")
    return fork, remote


def seed_cache(fork: Path, cache: Path) -> None:
    """The old tree's gate scan, as `nox -s gates` leaves it in the user's cache."""
    env = cached_env(tool_env(), cache)
    out = cache.parent / "gates-seed"
    run(tool("-C", fork, "gates", "--out", out), env=env, ok=(0, 1))


def by_tool(fork: Path, remote: Path, seed: Path, cache: Path) -> float:
    shutil.rmtree(cache, ignore_errors=True)
    shutil.copytree(seed, cache)
    env = cached_env({**os.environ, **IDENTITY, **tool_env()}, cache)
    argv = [*tool("-C", fork, "rebase", f"v{NEW}"), "--upstream-git", remote.as_uri()]
    start = time.perf_counter()
    done = subprocess.run([*argv, "--dry-run"], env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"rebase failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return elapsed


def by_hand(scratch: Path, remote: Path, fork: Path) -> float:
    work = scratch / "by-hand"
    shutil.rmtree(work, ignore_errors=True)
    patches = fork / "patches"
    names = read_series(patches / "series").names
    start = time.perf_counter()
    git(scratch, "clone", "-q", "--no-checkout", remote.as_uri(), str(work))
    git(work, "checkout", "-q", f"v{OLD}")
    git(work, "am", "-q", *(str(patches / name) for name in names))
    mails = work / ".git" / "mails"
    git(work, "format-patch", "-q", "-o", str(mails), f"v{OLD}..HEAD")
    git(work, "checkout", "-q", f"v{NEW}")
    for mail in sorted(mails.iterdir()):
        if git(work, "am", "-q", "-3", str(mail), check=False).returncode != 0:
            git(work, "am", "--skip")
    refreshed = work / ".git" / "refreshed"
    git(work, "format-patch", "-q", "-o", str(refreshed), f"v{NEW}..HEAD")
    return time.perf_counter() - start


def growth(runs: int, sizes: Sequence[int], scratch: Path) -> list[dict[str, Any]]:
    results = []
    for size in sizes:
        print(f"bench: rebase growth, {size} patches", file=sys.stderr, flush=True)
        where = scratch / f"rebase-{size}"
        where.mkdir(parents=True)
        fork, remote = setup(where, size)
        seed = where / "seed" / "cache"
        seed_cache(fork, seed)
        ours, base = compare(
            runs,
            partial(by_tool, fork, remote, seed, where / "cache"),
            partial(by_hand, where, remote, fork),
            warmup=False,
        )
        row = Row("", "", "", tuple(ours), tuple(base), target_ratio=1.5)
        results.append(
            {
                "patches": size,
                "rebase_ours_median_s": round(row.ours_median, 4),
                "rebase_git_am_median_s": round(row.baseline_median or 0.0, 4),
                "rebase_ratio": round(row.ratio or 0.0, 4),
                "rebase_met": row.met,
                "rebase_ours_runs_s": [round(t, 4) for t in ours],
                "rebase_git_am_runs_s": [round(t, 4) for t in base],
            }
        )
        shutil.rmtree(where, ignore_errors=True)
    return results
