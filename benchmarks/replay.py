"""Replay the fork's 0.5.9 series through every real release up to 0.5.23 with
`rebase --step`, and count the stops that need a person, by class.

    PYTHONPATH=scripts python benchmarks/replay.py [--to 0.5.23] [--work DIR]
        [--resume] [--record] [--install-envs X,Y] [--verify] [--out docs/rebases]

A scratch fork is made in --work (default /tmp/sm120-replay/fork): sglang 0.5.9
imported from the package index, the series as it stood then
(benchmarks/data/series-0.5.9: patches, intents, gate policy) and the gate rows,
scenarios and model configs of that era (series-0.5.9/gates) beside the current
gate harness (sm120fork.harness, which observes every release), so that
the behaviour strategy judges the patches by their own 0.5.9 rows. Then
`sm120fork rebase <to> --step` runs from the package index.

Where it stops for a person, the replay continues with the person's recorded
resolution, benchmarks/data/series-0.5.9/resolutions/<version>/<patch>.toml
(`class`: why it is a judgement, `note`: the person's words, and either `drop`,
the reason for `--drop`, or the patch text beside it in the file <patch>, applied
to the work tree before `rebase --continue --note`), and counts the stop. A stop
with no recorded resolution ends the replay there (exit 1); --record saves the
work tree's edits as that resolution's patch text and --resume goes on.

Gate environments: a release's behaviour check needs that release's; only those
of --install-envs are installed (SM120_GATE_ENV_INSTALL; default none; `''`: every
release's, with uv about 55 GB for 0.5.9 ... 0.5.23, benchmarks/bench_envs.py), so
a release without one says so in its stop's reason. Per release the result names
the environment that decided its rows, that venv's size and the tool's wall time
there. Results: replay_report.py
writes <out>/replay-<from>-to-<to>.{json,md}; with --verify, after a complete
replay, the landed series' own rows are run on the final patched tree (SM12x
cells, the target's gate environment) and the result says which patches still do
what their rows say. Not part of `nox -s tests`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import replay_report  # noqa: E402

BASE = "0.5.9"
SERIES = ROOT / "benchmarks" / "data" / f"series-{BASE}"
RESOLUTIONS = SERIES / "resolutions"
SM12X = ("--arch=sm120", "--arch=sm121")
IDENTITY = {
    "GIT_AUTHOR_NAME": "replay",
    "GIT_AUTHOR_EMAIL": "replay@example.com",
    "GIT_COMMITTER_NAME": "replay",
    "GIT_COMMITTER_EMAIL": "replay@example.com",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def say(message: str) -> None:
    print(f"replay: {message}", file=sys.stderr, flush=True)


def run(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **IDENTITY, "PYTHONPATH": str(ROOT / "scripts")}
    return subprocess.run(args, cwd=cwd, env=env, text=True, check=check, capture_output=True)


# The release a progress line of the rebase works on (carry, or its rows on pristine).
_AT = re.compile(r"release \d+/\d+ sglang (\S+?):|on (?:pristine|patched) sglang (\S+) in")
SECONDS: dict[str, float] = {}  # per release: the tool's wall time there, over every call


def tool(fork: Path, *args: str) -> int:
    """`sm120fork -C fork ARGS`, its progress streamed through (stderr), its wall time
    counted to the release its progress lines name (SECONDS)."""
    env = {**os.environ, **IDENTITY, "PYTHONPATH": str(ROOT / "scripts")}
    command = [sys.executable, "-m", "sm120fork", "-C", str(fork), *args]
    current, last = "", time.monotonic()
    with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            now = time.monotonic()
            SECONDS[current] = SECONDS.get(current, 0.0) + now - last
            last = now
            if found := _AT.search(line):
                current = found[1] or found[2]
        SECONDS[current] = SECONDS.get(current, 0.0) + time.monotonic() - last
        return proc.wait()


def setup(fork: Path) -> None:
    """The scratch fork at 0.5.9: vendor/, the series, the 0.5.9 gate rows, one commit."""
    if fork.exists():
        shutil.rmtree(fork)
    fork.mkdir(parents=True)
    run(fork, "git", "init", "-q", ".")
    (fork / ".gitignore").write_text("/build/\n__pycache__/\n")
    say(f"importing sglang {BASE} from the package index into {fork}")
    if tool(fork, "import", BASE) != 0:
        raise SystemExit(f"replay: `sm120fork import {BASE}` failed")
    patches = fork / "patches"
    shutil.copytree(SERIES, patches, ignore=shutil.ignore_patterns("gates", "resolutions"))
    shutil.copytree(SERIES / "gates", fork / "gatetable")
    shutil.copy(ROOT / "pyproject.toml", fork / "pyproject.toml")  # gateenv reads the deps
    (fork / "CHANGELOG.md").write_text(f"# Changelog\n\n## {BASE}+sm120.1 - 2026-11-29\n")
    run(fork, "git", "add", "-A", ".")
    run(fork, "git", "commit", "-q", "-m", f"the fork at {BASE} (replay)")


def report(fork: Path) -> dict[str, Any]:
    return dict(json.loads((fork / "build" / "rebase" / "report.json").read_text()))


def stopped_at(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(release, patch entry) of the conflict the rebase stopped on."""
    patch = next(p for p in data["patches"] if p["status"] == "conflict")
    return patch["steps"][-1]["version"], patch


def resolution(version: str, name: str) -> tuple[dict[str, Any], Path] | None:
    meta = RESOLUTIONS / version / f"{name}.toml"
    text = RESOLUTIONS / version / name
    if not meta.is_file():
        return None
    recorded = tomllib.loads(meta.read_text())
    if "drop" not in recorded and not text.is_file():
        return None  # the person's words are kept, their patch text is not yet
    return recorded, text


def resolve(fork: Path, version: str, patch: dict[str, Any], stops: list[dict[str, Any]]) -> bool:
    """Continue past one stop with its recorded resolution; False if none is recorded."""
    name = patch["name"]
    found = resolution(version, name)
    stop = {
        "release": version,
        "patch": name,
        "reason": patch["steps"][-1]["detail"],
        "conflicts": [f"{c['file']}:{c['line']}" for c in patch.get("conflicts", [])],
    }
    if found is None:
        stops.append({**stop, "class": "unrecorded", "resolution": "none recorded"})
        return False
    meta, text = found
    stops.append({**stop, "class": meta["class"], "note": meta["note"]})
    work = fork / "build" / "rebase" / "work"
    run(work, "git", "reset", "-q", "--hard", "HEAD")
    run(work, "git", "clean", "-q", "-fd")
    if "drop" in meta:
        say(f"stop {len(stops)} at sglang {version}, {name}: dropping it as recorded")
        stops[-1]["resolution"] = "drop"
        return tool(fork, "rebase", "--drop", meta["drop"]) in (0, 1)
    say(f"stop {len(stops)} at sglang {version}, {name}: applying {text.relative_to(ROOT)}")
    stops[-1]["resolution"] = str(text.relative_to(ROOT))
    run(work, "git", "apply", "--whitespace=nowarn", str(text))
    return tool(fork, "rebase", "--continue", "--note", meta["note"]) in (0, 1)


def record(fork: Path) -> Path:
    """Save the work tree's edits as the stopped patch's resolution text."""
    version, patch = stopped_at(report(fork))
    work = fork / "build" / "rebase" / "work"
    diff = run(work, "git", "diff", "HEAD").stdout
    if not diff.strip():
        raise SystemExit("replay: the work tree has no edits to record")
    header = patch_header(fork, patch["name"])
    target = RESOLUTIONS / version / patch["name"]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(header + diff)
    return target


def verify(fork: Path, to: str) -> dict[str, Any]:
    """The landed series' own rows on the final patched tree, SM12x cells, in the
    target's gate environment: which patches do what their 0.5.9 rows say."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from sm120fork import gateenv
    from sm120fork.patches.series import read_series

    env = gateenv.for_release(ROOT, to)
    tree = fork.parent / "final"
    obs = fork.parent / "final-observations.json"
    harness = ["env", f"PYTHONPATH={ROOT / 'scripts'}", str(env.python), "-m", "sm120fork.harness"]
    if obs.is_file() and obs.stat().st_mtime > (fork / "patches" / "series").stat().st_mtime:
        say(f"reusing the observations of the landed series in {obs}")
    else:
        shutil.rmtree(tree, ignore_errors=True)
        say(f"applying the landed series to sglang {to} in {tree}")
        run(fork, sys.executable, "-m", "sm120fork", "-C", str(fork), "apply", "--out", str(tree))
        say(f"running the series' rows on the patched sglang {to} (sm120, sm121) in {env.venv}")
        args = ["run", "--tree", str(tree / "python"), *SM12X]
        run(fork, *harness, *args, "--jobs", "2", "--json", str(obs))
    from sm120fork.harness import spec, table

    observations = json.loads(obs.read_text())
    rows_dir = fork / "gatetable"  # the fork's own rows, not this checkout's
    archs = [a.name for a in spec.load_archs(rows_dir / "archs.toml")]
    rows = table.load_table(archs, rows_dir / "expectations.toml").rows
    found: dict[str, Any] = {}
    for name in read_series(fork / "patches" / "series").names:
        cells = [
            (row, cell)
            for row in rows
            if row.patch == name
            for cell in table.check_row(row, observations)
            if cell.arch in ("sm120", "sm121")
        ]
        wrong = [
            f"row {row.number} {row.scenario}:{row.field} {cell.arch}: expected "
            f"{table.render(cell.expected)}, observed {table.render(cell.observed)}"
            for row, cell in cells
            if not cell.ok
        ]
        found[name] = {"cells": len(cells), "wrong": wrong}
    return found


def _saved(stops: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    return {"stops": stops, "seconds": seconds, "per_release": SECONDS}


def _disk(venv: str) -> float | None:
    """GB that a decision venv holds, its hard links to the uv cache counted in full."""
    ran = subprocess.run(["du", "-sb", venv], capture_output=True, text=True, check=False)
    return round(int(ran.stdout.split()[0]) / 1e9, 1) if ran.returncode == 0 else None


def interrupted(fork: Path, timed: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """The report of a replay stopped from outside (its process killed) as far as the
    rebase's saved state got, and the tool's wall time per release from `timed`, its
    stderr with each line prefixed by the epoch second it came (`tail -F | date`),
    counted from the end of the fetch (the newest fetched release's directory)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from dataclasses import replace

    from sm120fork.gates.diff import GateDiff
    from sm120fork.rebase import report as rebase_report
    from sm120fork.rebase.state import StateDir

    state_dir = StateDir.of(fork)
    state = state_dir.load()
    state = replace(state, release_gates=state.release_gates or {})
    data = dict(rebase_report.build(state, "conflict", GateDiff.empty(), None).to_json())
    data["result"] = f"interrupted at sglang {state.target.version}"
    data["releases"] = [t.version for t in state.targets[: state.release_index + 1]]
    fetched = fork / "build" / "rebase" / "upstream"
    last = max(p.stat().st_mtime for p in fetched.iterdir())
    current = state.targets[0].version
    seconds: dict[str, float] = {}
    for line in timed.read_text().splitlines() if timed.is_file() else []:
        stamp, _, text = line.partition(" ")
        now = float(stamp)
        seconds[current] = seconds.get(current, 0.0) + max(0.0, now - last)
        last = now
        if found := _AT.search(text):
            current = found[1] or found[2]
    return data, seconds


def patch_header(fork: Path, name: str) -> str:
    text = (fork / "patches" / name).read_text()
    return text[: text.index("\n---\n") + 5]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--to", default="0.5.23")
    parser.add_argument("--work", type=Path, default=Path("/tmp/sm120-replay"))
    parser.add_argument("--resume", action="store_true", help="go on from the last stop")
    parser.add_argument("--record", action="store_true", help="save the stop's resolution")
    parser.add_argument(
        "--install-envs", default="no", help="releases whose gate env may be installed (X,Y)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "rebases")
    parser.add_argument("--verify", action="store_true", help="run the rows on the result")
    parser.add_argument(
        "--interrupted", action="store_true", help="write the result of a killed replay"
    )
    args = parser.parse_args()
    fork = args.work / "fork"
    log = args.work / "stops.json"
    if args.interrupted:
        data, per_release = interrupted(fork, args.work / "timed.log")
        saved = json.loads(log.read_text()) if log.is_file() else {"stops": [], "seconds": 0}
        seconds = sum(per_release.values())
        result = replay_report.build(BASE, args.to, data, saved["stops"], seconds)
        replay_report.add_costs(result, per_release, _disk)
        say(f"{data['result']}: {replay_report.write(args.out, result)}")
        return 0
    if args.record:
        say(f"recorded {record(fork).relative_to(ROOT)}; add its .toml, then --resume")
        return 0
    os.environ["SM120_GATE_ENV_INSTALL"] = args.install_envs
    started = time.monotonic()
    if args.resume:
        saved = json.loads(log.read_text())
        stops, spent = saved["stops"], saved["seconds"]
        SECONDS.update(saved.get("per_release", {}))
        if stops and stops[-1]["class"] == "unrecorded":
            stops.pop()  # its resolution is recorded now: counted again below
    else:
        stops, spent = [], 0.0
        setup(fork)
        say(f"rebase {BASE} -> {args.to} --step from the package index")
        tool(fork, "rebase", args.to, "--step")
    data = report(fork)
    while data["result"] == "conflict":
        version, patch = stopped_at(data)
        resolved = resolve(fork, version, patch, stops)
        seconds = spent + time.monotonic() - started
        log.write_text(json.dumps(_saved(stops, seconds), indent=1))
        if not resolved:
            break
        data = report(fork)
    seconds = spent + time.monotonic() - started
    log.write_text(json.dumps(_saved(stops, seconds), indent=1))
    for stop in stops:  # the recorded resolution is the source of a stop's class
        found = resolution(stop["release"], stop["patch"])
        if found is not None:
            stop["class"], stop["note"] = found[0]["class"], found[0]["note"]
    rows = verify(fork, args.to) if args.verify and data["result"] == "complete" else None
    result = replay_report.build(BASE, args.to, data, stops, seconds, rows)
    replay_report.add_costs(result, SECONDS, _disk)
    paths = replay_report.write(args.out, result)
    say(f"{data['result']}: {len(stops)} stops for a person in {seconds:.0f} s; {paths}")
    if data["result"] == "conflict":
        version, patch = stopped_at(data)
        say(
            f"no recorded resolution for {patch['name']} at sglang {version}: resolve it in "
            f"{fork}/build/rebase/work, then --record and --resume"
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
