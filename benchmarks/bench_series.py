"""Apply and check: how both grow with synthetic series of N small patches (apply
against GNU quilt).

Fairness of `apply`: `sm120fork apply --out DIR` reads vendor/sglang and writes
a whole patched tree to DIR (it copies the pristine tree, then writes the
patched files). The baseline does the same work with the standard tools:
`cp -a vendor/sglang DIR` then `quilt push -a` inside DIR. So the copy is
counted on both sides; removing the previous DIR is not timed on either.

A synthetic series: N patches, each inserting one comment line in the middle
of a different real file of vendor/sglang (evenly spread over its Python
files), so no two overlap; rendered by the tool's own normal-form renderer,
with the DEP-3 header the tests use. Its fork repo links vendor/ to the
project's.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bench_common import PROJECT, Row, compare, fresh, repeat, run, timed, tool, tool_env

VENDOR = PROJECT / "vendor"
APPLY_TARGET = 1.0  # ours / `cp -a` + `quilt push -a`, at every size
CHECK_PER_PATCH_S = 0.005
QUILT = ["quilt", "--quiltrc=-", "push", "-a", "-q"]
HEADER = """\
From: Bench Maintainer <bench@example.com>
Subject: [PATCH] Bench change {k}

Bench change {k}: one comment line, so that a series of N patches can be timed.

Origin: vendor
Forwarded: not-needed
Last-Update: 2026-11-29
---
"""


def apply_ours(repo: Path, out: Path) -> float:
    fresh(out)
    return timed(tool("-C", repo, "apply", "--out", out), env=tool_env())


def apply_quilt(repo: Path, copy: Path) -> float:
    fresh(copy)
    env = {**os.environ, "QUILT_PATCHES": str(repo / "patches")}
    start = time.perf_counter()
    run(["cp", "-a", VENDOR / "sglang", copy])
    run(QUILT, cwd=copy, env=env)
    return time.perf_counter() - start


def check_ours(repo: Path) -> float:
    return timed(tool("-C", repo, "check"), env=tool_env())


def growth(
    runs: int, sizes: Sequence[int], scratch: Path, check_only: Sequence[int] = ()
) -> list[dict[str, Any]]:
    """Per N: apply (ours vs quilt, interleaved) and check (ours), medians of `runs`;
    for the sizes in `check_only`, check alone."""
    results = []
    for size in [*sizes, *check_only]:
        repo = synthetic_repo(scratch / f"series-{size}", size)
        check = repeat(runs, partial(check_ours, repo))
        checked = Row("", "", "", tuple(check))
        result: dict[str, Any] = {
            "patches": size,
            "check_ours_median_s": round(checked.ours_median, 4),
            "check_ours_runs_s": [round(t, 4) for t in check],
        }
        if size in sizes:
            ours, base = compare(
                runs,
                partial(apply_ours, repo, scratch / "ours"),
                partial(apply_quilt, repo, scratch / "quilt"),
            )
            apply = Row("", "", "", tuple(ours), tuple(base), target_ratio=APPLY_TARGET)
            result |= {
                "apply_ours_median_s": round(apply.ours_median, 4),
                "apply_quilt_median_s": round(apply.baseline_median or 0.0, 4),
                "apply_ratio": round(apply.ratio or 0.0, 4),
                "apply_target": apply.target,
                "apply_met": apply.met,
                "apply_ours_runs_s": [round(t, 4) for t in ours],
                "apply_quilt_runs_s": [round(t, 4) for t in base],
            }
        results.append(result)
    return results


def check_rows(results: Sequence[dict[str, Any]]) -> list[Row]:
    """The largest check, and the cost of a patch (the slope from the smallest)."""
    if len(results) < 2:
        return []
    by_size = sorted(results, key=lambda r: r["patches"])
    small, large = by_size[0], by_size[-1]
    slope = (large["check_ours_median_s"] - small["check_ours_median_s"]) / (
        large["patches"] - small["patches"]
    )
    return [
        Row(
            what=f"check a synthetic {large['patches']}-patch series",
            ours="`sm120fork check`",
            baseline="-",
            ours_s=tuple(large["check_ours_runs_s"]),
            limit_s=10.0,
        ),
        Row(
            what=f"check, cost of one patch (slope {small['patches']} -> {large['patches']})",
            ours="`sm120fork check`",
            baseline="-",
            ours_s=(max(slope, 0.0),),
            limit_s=CHECK_PER_PATCH_S,
            note=f"{slope * 1000:.2f} ms a patch; target 5 ms",
        ),
    ]


def growth_table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| patches | apply ours s | `cp -a` + `quilt push -a` s | ratio | <= 1.0x met "
        "| check ours s | rebase ours s | `git am -3` by hand s | ratio | <= 1.5x met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(r: dict[str, Any], key: str, form: str) -> str:
        value = r.get(key)
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "**no**"
        return format(value, form)

    for r in results:
        lines.append(
            f"| {r['patches']} | {cell(r, 'apply_ours_median_s', '.2f')} | "
            f"{cell(r, 'apply_quilt_median_s', '.2f')} | {cell(r, 'apply_ratio', '.2f')}x | "
            f"{cell(r, 'apply_met', '')} | {cell(r, 'check_ours_median_s', '.2f')} | "
            f"{cell(r, 'rebase_ours_median_s', '.2f')} | "
            f"{cell(r, 'rebase_git_am_median_s', '.2f')} | {cell(r, 'rebase_ratio', '.2f')}x | "
            f"{cell(r, 'rebase_met', '')} |"
        )
    return "\n".join(lines).replace("| -x |", "| - |")


def synthetic_repo(root: Path, size: int) -> Path:
    """A fork repo whose series is `size` one-line patches on different real files."""
    from sm120fork.patches.normalform import DiffRenderer

    root.mkdir(parents=True)
    (root / "vendor").symlink_to(VENDOR, target_is_directory=True)
    before, after = _edits(VENDOR / "sglang", size)
    with DiffRenderer() as renderer:
        diff = renderer.diff(before, after)
    blocks = [b for b in re.split(r"(?m)^(?=diff --git )", diff) if b]
    if len(blocks) != size:
        raise AssertionError(f"expected {size} file diffs, git gave {len(blocks)}")
    patches = root / "patches"
    patches.mkdir()
    names = []
    for k, block in enumerate(blocks, start=1):
        name = f"bench-{k:03d}.patch"
        (patches / name).write_bytes((HEADER.format(k=k) + block).encode("utf-8"))
        names.append(name)
    (patches / "series").write_text("".join(f"{n}\n" for n in names))
    return root


def _edits(tree: Path, size: int) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """(before, after) texts of `size` files spread evenly over the tree's Python files."""
    candidates = []
    for path in sorted(tree.rglob("*.py")):
        data = path.read_bytes()
        if data.count(b"\n") >= 40 and b"\r" not in data and _is_utf8(data):
            candidates.append(path)
    if len(candidates) < size:
        raise AssertionError(f"only {len(candidates)} files to patch, {size} asked")
    step = len(candidates) / size
    before: dict[str, str | None] = {}
    after: dict[str, str | None] = {}
    for k in range(size):
        path = candidates[int(k * step)]
        rel = path.relative_to(tree).as_posix()
        text = path.read_bytes().decode("utf-8")
        lines = text.split("\n")
        middle = len(lines) // 2
        before[rel] = text
        after[rel] = "\n".join([*lines[:middle], f"# sm120 bench change {k + 1}", *lines[middle:]])
    return before, after


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
