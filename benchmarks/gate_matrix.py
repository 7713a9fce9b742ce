"""Time the architecture-gate matrix (every scenario on every faked architecture).

Run with the gate environment's python (`nox -s gate_bench -- --jobs 1 2 3`, or
`<gate-env>/bin/python benchmarks/gate_matrix.py`). Prints one Markdown table row
per (tree, jobs) setting.
Not a timed test: nothing fails on a slow machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from sm120fork.harness import runner, spec, trees


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, nargs="+", default=[os.cpu_count() or 1])
    parser.add_argument(
        "--tree", choices=[*trees.MODES, "both"], default="pristine", help="what to time"
    )
    args = parser.parse_args()
    archs = spec.load_archs()
    scenarios = list(spec.load_scenarios().values())
    print(
        f"# {platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"{len(archs)} architectures x {len(scenarios)} scenarios"
    )
    print("| tree | jobs | matrix wall s | slowest child s | mean child s | mean import s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="sm120-gate-bench-") as tmp:
        scratch = Path(tmp)
        stubs = runner.prepare_fakes(sys.executable, scratch / "fakes")
        chosen: dict[str, Path] = {}
        if args.tree in (trees.PRISTINE, "both"):
            chosen[trees.PRISTINE] = trees.pristine_tree().path
        if args.tree in (trees.PATCHED, "both"):
            chosen[trees.PATCHED] = trees.build_patched_tree(scratch / "patched").path
        for jobs in args.jobs:
            started = time.monotonic()
            runs = runner.run_matrices(
                chosen, archs, scenarios, scratch=scratch / f"j{jobs}", jobs=jobs, stubs=stubs
            )
            wall = time.monotonic() - started
            children = [run for matrix in runs.values() for run in matrix.runs.values()]
            walls = [run.wall_s for run in children]
            imports = [float(run.meta.get("import_s") or 0.0) for run in children]
            print(
                f"| {'+'.join(chosen)} | {jobs} | {wall:.0f} | {max(walls):.0f} | "
                f"{sum(walls) / len(walls):.0f} | {sum(imports) / len(imports):.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
