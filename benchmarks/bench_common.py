"""What every part of `benchmarks/bench.py` shares: how a side is timed, the row
record, the machine description and the Markdown rendering.

Each side of a comparison is a callable that does its untimed set-up, times only
the work and returns the seconds it took. `compare` runs the two sides
interleaved (ours first on even rounds, the baseline first on odd ones) so that
noise on this shared machine falls on both, and keeps every run: a row shows
medians and their ratio, never one absolute time.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT = Path(__file__).resolve().parents[1]
SCRIPTS = PROJECT / "scripts"
Side = Callable[[], float]


class BenchError(Exception):
    """A step of the benchmark itself failed (not slow: broken)."""


def run(
    argv: Sequence[str | Path],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    ok: Collection[int] = (0,),
) -> subprocess.CompletedProcess[str]:
    """Run a command; a failure names the command, its exit code and both streams."""
    words = [str(a) for a in argv]
    result = subprocess.run(
        words, cwd=cwd, env=env, capture_output=True, text=True, check=False
    )  # fmt: skip
    if result.returncode not in ok:
        raise BenchError(
            f"`{' '.join(words)}` exited {result.returncode}\n"
            f"stdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}"
        )
    return result


def timed(argv: Sequence[str | Path], **kwargs: Any) -> float:
    """Wall seconds of one command, as a fresh process."""
    start = time.perf_counter()
    run(argv, **kwargs)
    return time.perf_counter() - start


def tool_env() -> dict[str, str]:
    """The environment for `python -m sm120fork`: this checkout's tool first."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), path]))}


def tool(*args: str | Path) -> list[str | Path]:
    return [sys.executable, "-m", "sm120fork", *args]


def compare(
    runs: int, ours: Side, baseline: Side, *, warmup: bool = True
) -> tuple[list[float], list[float]]:
    """(ours, baseline) seconds of `runs` interleaved runs, after one untimed run of each."""
    if warmup:
        ours()
        baseline()
    mine: list[float] = []
    theirs: list[float] = []
    for round_ in range(runs):
        if round_ % 2 == 0:
            mine.append(ours())
            theirs.append(baseline())
        else:
            theirs.append(baseline())
            mine.append(ours())
    return mine, theirs


def repeat(runs: int, side: Side, *, warmup: bool = True) -> list[float]:
    if warmup:
        side()
    return [side() for _ in range(runs)]


def fresh(path: Path) -> Path:
    """`path` removed (not timed: called before the clock starts)."""
    shutil.rmtree(path, ignore_errors=True)
    return path


@dataclass(frozen=True)
class Row:
    """One line of the results: our median against the baseline's on the same inputs."""

    what: str
    ours: str
    baseline: str
    ours_s: tuple[float, ...]
    baseline_s: tuple[float, ...] = ()
    target_ratio: float | None = None
    limit_s: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ours_median(self) -> float:
        return statistics.median(self.ours_s)

    @property
    def baseline_median(self) -> float | None:
        return statistics.median(self.baseline_s) if self.baseline_s else None

    @property
    def ratio(self) -> float | None:
        base = self.baseline_median
        return self.ours_median / base if base else None

    @property
    def target(self) -> str:
        parts = []
        if self.target_ratio is not None:
            parts.append(f"<= {self.target_ratio:g}x")
        if self.limit_s is not None:
            parts.append(f"< {self.limit_s:g} s")
        return " and ".join(parts) or "-"

    @property
    def met(self) -> bool | None:
        if self.target_ratio is None and self.limit_s is None:
            return None
        ratio = self.ratio
        ratio_ok = self.target_ratio is None or (ratio is not None and ratio <= self.target_ratio)
        return ratio_ok and (self.limit_s is None or self.ours_median < self.limit_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "ours": self.ours,
            "baseline": self.baseline,
            "ours_median_s": round(self.ours_median, 4),
            "baseline_median_s": _round(self.baseline_median),
            "ratio": _round(self.ratio),
            "target": self.target,
            "met": self.met,
            "target_ratio": self.target_ratio,
            "limit_s": self.limit_s,
            "ours_runs_s": [round(t, 4) for t in self.ours_s],
            "baseline_runs_s": [round(t, 4) for t in self.baseline_s],
            "note": self.note,
            **self.extra,
        }


def row_from_json(data: dict[str, Any]) -> Row:
    """A row of results.json read back (its runs, targets and extra fields)."""
    known = {"what", "ours", "baseline", "note", "target_ratio", "limit_s"}
    derived = {"ours_median_s", "baseline_median_s", "ratio", "target", "met"}
    runs = {"ours_runs_s", "baseline_runs_s"}
    targets = _parse_target(str(data.get("target", "")))
    return Row(
        **{**targets, **{key: data[key] for key in known if data.get(key) is not None}},
        ours_s=tuple(data["ours_runs_s"]),
        baseline_s=tuple(data.get("baseline_runs_s", ())),
        extra={k: v for k, v in data.items() if k not in known | derived | runs},
    )


def _parse_target(text: str) -> dict[str, float]:
    """`Row.target`'s words read back ("<= 1.5x and < 5 s"), for results written without
    the numbers themselves."""
    found: dict[str, float] = {}
    for part in text.split(" and "):
        if part.startswith("<= ") and part.endswith("x"):
            found["target_ratio"] = float(part[3:-1])
        elif part.startswith("< ") and part.endswith(" s"):
            found["limit_s"] = float(part[2:-2])
    return found


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return {
        "cpu": cpu or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "git": _version(["git", "--version"]),
        "quilt": _version(["quilt", "--version"]),
        "load_1min_at_start": round(os.getloadavg()[0], 2),
    }


def _memory_gib() -> float | None:
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None


def _version(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return None


def describe(info: dict[str, Any]) -> str:
    return (
        f"{info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, {info['os']}, "
        f"Python {info['python']}, {info['git']}, quilt {info['quilt']}"
    )


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| what | ours | baseline | ours median s | baseline median s | ratio | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = row.baseline_median
        ratio = row.ratio
        met = {True: "yes", False: "**no**", None: "-"}[row.met]
        what = f"{row.what} ({row.note})" if row.note else row.what
        lines.append(
            f"| {what} | {row.ours} | {row.baseline} | {row.ours_median:.2f} | "
            f"{'-' if base is None else f'{base:.2f}'} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | {row.target} | {met} |"
        )
    return "\n".join(lines)
