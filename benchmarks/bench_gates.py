"""The gate inventory of the newest release, with and without the scan cache.

- seen before: `sm120fork gates --tree` of a tree whose scan is in the cache
  (the warm-up run put it there): reading and hashing every file, loading the
  inventory, the policy and the reports, against `grep -rnE` of the helper
  names over the same files (gate_scan.py's; the read floor).
- never seen: the same command with an empty cache directory each run, against
  the `ast.parse` floor: one fresh Python process that reads every file and
  parses those holding a gate token (`semantics.TOKENS`), which any scan must
  at least do. The floor is one process; the scan uses its workers (2 here).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from bench_common import PROJECT, SCRIPTS, Row, compare, fresh, run, timed, tool, tool_env

FLOOR = """
import ast, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from sm120fork.gates.semantics import TOKENS
parsed = 0
for path in sorted(Path(sys.argv[1]).rglob("*.py")):
    data = path.read_bytes()
    if any(token in data for token in TOKENS):
        ast.parse(data, filename=str(path))
        parsed += 1
print(parsed)
"""


def rows(runs: int, fork: Path, scratch: Path, newest: str) -> list[Row]:
    from gate_scan import grep

    tree = fork / "vendor" / "sglang"
    package = tree / "python" / "sglang"
    out = scratch / "gates-out"
    command = tool("-C", PROJECT, "gates", "--tree", tree, "--out", out)
    warm_cache, cold_cache = scratch / "cache-warm", scratch / "cache-cold"
    found: dict[str, object] = {}

    def gates(cache: Path, empty: bool) -> float:
        fresh(out)
        if empty:
            shutil.rmtree(cache, ignore_errors=True)
        # Exit 1 if the policy has not reviewed every gate of that tree yet.
        return timed(command, env={**tool_env(), "XDG_CACHE_HOME": str(cache)}, ok=(0, 1))

    def floor_grep() -> float:
        start = time.perf_counter()
        found["grep lines, files"] = grep(package)
        return time.perf_counter() - start

    def floor_parse() -> float:
        start = time.perf_counter()
        done = run([sys.executable, "-c", FLOOR, package, SCRIPTS])
        elapsed = time.perf_counter() - start
        found["files parsed by the floor"] = int(done.stdout.strip())
        return elapsed

    warm, grep_s = compare(runs, lambda: gates(warm_cache, False), floor_grep)
    cold, parse_s = compare(runs, lambda: gates(cold_cache, True), floor_parse)
    what = f"gate inventory of the newest release ({newest})"
    return [
        Row(
            what=f"{what}, a tree scanned before",
            ours="`sm120fork gates --tree` (hash every file, cached scan, policy, reports)",
            baseline="`grep -rnE` of the helper names (the read floor)",
            ours_s=tuple(warm),
            baseline_s=tuple(grep_s),
            target_ratio=3.0,
            extra={"grep_found": found.get("grep lines, files")},
        ),
        Row(
            what=f"{what}, never scanned (empty cache)",
            ours="`sm120fork gates --tree` (scan, evaluate, policy, reports)",
            baseline="`ast.parse` of the files holding a gate token (one process)",
            ours_s=tuple(cold),
            baseline_s=tuple(parse_s),
            target_ratio=1.3,
            extra={"floor_parsed": found.get("files parsed by the floor")},
        ),
    ]
