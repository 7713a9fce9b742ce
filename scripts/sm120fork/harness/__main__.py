"""Command line for looking at the matrix without pytest (run from the repo root).

  python -m sm120fork.harness run [--tree pristine|patched|DIR] [--arch A ...]
        [--scenario S ...] [--jobs N] [--json OUT]
      observe and print every scenario's fields per architecture
  python -m sm120fork.harness observe --tree LABEL=DIR [...] --scenario S [...] --json OUT
      observe several trees in one matrix (what the rebase's verification runs)
  python -m sm120fork.harness rows OBS.json SCENARIO:FIELD [...]
      print [[row]] blocks holding the observed values (to paste into expectations.toml)
  python -m sm120fork.harness markdown OBS.json [--scenario S ...]
  python -m sm120fork.harness explain --model-path DIR [--arch A ...] [-- sglang args]
      print the observations as Markdown tables (gatetable/observed-<version>.md)

Use the gate environment's python (the one with torch): see gatetable/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import explain, report, runner, spec, table, trees


def _tree(value: str, scratch: Path) -> trees.Tree:
    if value == trees.PRISTINE:
        return trees.pristine_tree()
    if value == trees.PATCHED:
        return trees.build_patched_tree(scratch / "patched")
    return trees.Tree("custom", Path(value).resolve(), trees.PATCHED)


def _print_matrix(observations: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> None:
    archs = list(observations)
    scenarios = sorted({s for per_arch in observations.values() for s in per_arch})
    for scenario in scenarios:
        print(f"\n[{scenario}]")
        fields = sorted(
            {f for per_arch in observations.values() for f in per_arch.get(scenario, {})}
        )
        for field in fields:
            cells = [
                table.render(table.observed_cell(observations[a].get(scenario), field))
                for a in archs
            ]
            print(
                f"  {field}: " + " | ".join(f"{a}={c}" for a, c in zip(archs, cells, strict=True))
            )


def cmd_run(args: argparse.Namespace) -> int:
    archs = [a for a in spec.load_archs() if not args.arch or a.name in args.arch]
    scenarios = [
        s for s in spec.load_scenarios().values() if not args.scenario or s.name in args.scenario
    ]
    with tempfile.TemporaryDirectory(prefix="sm120-gates-") as tmp:
        scratch = Path(tmp)
        tree = _tree(args.tree, scratch)
        started = time.monotonic()
        runs = runner.run_matrices(
            {tree.label: tree.path}, archs, scenarios, scratch=scratch, jobs=args.jobs
        )
        wall = time.monotonic() - started
    matrix = runs[tree.label]
    _print_matrix(matrix.observations)
    print()
    for arch, run in matrix.runs.items():
        print(f"{arch}: {run.wall_s:.1f} s (import {run.meta.get('import_s')} s)")
    print(f"matrix wall time: {wall:.1f} s with {args.jobs or 'all'} jobs")
    if args.json:
        args.json.write_text(json.dumps(matrix.observations, indent=1, sort_keys=True))
    return 0


def cmd_observe(args: argparse.Namespace) -> int:
    """Several trees in one matrix (one zygote an architecture serves them all)."""
    archs = [a for a in spec.load_archs() if not args.arch or a.name in args.arch]
    scenarios = [s for s in spec.load_scenarios().values() if s.name in args.scenario]
    trees = dict(item.split("=", 1) for item in args.tree)
    with tempfile.TemporaryDirectory(prefix="sm120-gates-") as tmp:
        paths = {label: Path(path).resolve() for label, path in trees.items()}
        runs = runner.run_matrices(paths, archs, scenarios, scratch=Path(tmp), jobs=args.jobs)
    observed = {label: run.observations for label, run in runs.items()}
    args.json.write_text(json.dumps(observed, indent=1, sort_keys=True))
    return 0


def cmd_rows(args: argparse.Namespace) -> int:
    observations = json.loads(args.observations.read_text())
    archs = [a.name for a in spec.load_archs()]
    for item in args.cells:
        scenario, _, field = item.partition(":")
        print(table.toml_row(scenario, field, observations, archs))
    return 0


def cmd_markdown(args: argparse.Namespace) -> int:
    observations = json.loads(args.observations.read_text())
    archs = [a.name for a in spec.load_archs()]
    order = [s for s in spec.load_scenarios() if not args.scenario or s in args.scenario]
    print(report.markdown(observations, archs, order), end="")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    extra = list(args.sglang_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    try:
        text = explain.explain(args.model_path, args.arch or ["sm120"], args.tree, extra, args.json)
    except explain.ExplainError as exc:
        print(f"explain: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sm120fork.harness")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="observe the matrix and print it")
    run.add_argument("--tree", default=trees.PRISTINE, help="pristine, patched, or a directory")
    run.add_argument("--arch", action="append", help="only this architecture (repeatable)")
    run.add_argument("--scenario", action="append", help="only this scenario (repeatable)")
    run.add_argument("--jobs", type=int, default=None, help="parallel interpreters")
    run.add_argument("--json", type=Path, help="write the observations here")
    run.set_defaults(func=cmd_run)
    ob = sub.add_parser("observe", help="observe several trees, write their observations")
    ob.add_argument("--tree", action="append", required=True, help="LABEL=DIR (repeatable)")
    ob.add_argument("--arch", action="append", help="only this architecture (repeatable)")
    ob.add_argument("--scenario", action="append", required=True, help="scenario (repeatable)")
    ob.add_argument("--jobs", type=int, default=None, help="parallel interpreters")
    ob.add_argument("--json", type=Path, required=True, help="{label: observations} here")
    ob.set_defaults(func=cmd_observe)
    rows = sub.add_parser("rows", help="print [[row]] blocks from saved observations")
    rows.add_argument("observations", type=Path)
    rows.add_argument("cells", nargs="+", metavar="SCENARIO:FIELD")
    rows.set_defaults(func=cmd_rows)
    md = sub.add_parser("markdown", help="print saved observations as Markdown tables")
    md.add_argument("observations", type=Path)
    md.add_argument("--scenario", action="append", help="only this scenario (repeatable)")
    md.set_defaults(func=cmd_markdown)
    ex = sub.add_parser("explain", help="one checkpoint on one GPU: upstream beside the fork")
    ex.add_argument("--model-path", type=Path, required=True, help="checkpoint dir (config.json)")
    ex.add_argument("--arch", action="append", help="architecture (repeatable; default sm120)")
    ex.add_argument(
        "--tree", default=trees.PATCHED, help="the fork: patched, or a dir with sglang/"
    )
    ex.add_argument("--json", type=Path, help="also write the comparison here")
    ex.add_argument("sglang_args", nargs=argparse.REMAINDER, help="-- then sglang arguments")
    ex.set_defaults(func=cmd_explain)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
