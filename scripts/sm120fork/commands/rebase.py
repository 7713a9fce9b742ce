"""`sm120fork rebase VERSION | --continue | --abort`: carry the series onto a new release.

Exit 0 when done, up to date (nothing newer than the pinned release) or a dry
run found no conflict; 1 when stopped on a conflict; 2 on bad input. Started
with VERSION (and no other rebase in progress), it leaves build/rebase/report.json,
whose `result` says which: nox maps every failure to exit 1. See sm120fork.rebase
for the steps.
"""

from __future__ import annotations

import argparse
import signal
import sys

from sm120fork.errors import FatalError
from sm120fork.paths import RepoPaths
from sm120fork.rebase import flow
from sm120fork.rebase.state import StateDir
from sm120fork.upstream.source import UpstreamSource
from sm120fork.upstream.versions import SPEC_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("version", nargs="?", help=f"the release to rebase onto: {SPEC_HELP}")
    parser.add_argument(
        "--upstream-git",
        metavar="URL",
        default=None,
        help="take tag vX.Y.Z of this git remote (python/sglang, LICENSE) instead of the index",
    )
    parser.add_argument(
        "--step",
        action="store_true",
        help="carry through every release after the pinned one, naming the first that broke "
        "each patch (only the final tree lands)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="do everything but the writes; write only build/rebase/report.{json,md}",
    )
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="go on after resolving a conflict in build/rebase/work (or after a crash)",
    )
    resume.add_argument(
        "--abort", action="store_true", help="drop the rebase in progress and its work area"
    )
    resume.add_argument(
        "--drop",
        metavar="REASON",
        default="",
        help="drop the conflicted patch because upstream no longer needs it (REASON, e.g. "
        "'upstream 0.5.10 routes SM120 to ...', goes into the report and CHANGELOG), and go on",
    )
    parser.add_argument(
        "--note",
        metavar="TEXT",
        default="",
        help="with --continue: why the tool could not carry the patch you resolved "
        "(goes into the report and CHANGELOG)",
    )


def run(args: argparse.Namespace) -> int:
    paths = RepoPaths(args.repo)
    if args.note and not args.resume:
        raise FatalError("--note goes with --continue (it says why a resolution was needed)")
    if args.resume or args.abort or args.drop:
        extra = args.version or args.upstream_git or args.step or args.dry_run
        if extra:
            raise FatalError("--continue, --drop and --abort take no version or other option")
        if args.drop and not args.drop.strip():
            raise FatalError("--drop needs a reason: why upstream no longer needs the patch")
        if args.abort:
            return flow.abort(paths)
        return flow.resume(paths, note=args.note.strip(), drop=args.drop.strip())
    if not args.version:
        raise FatalError("name the release to rebase onto (e.g. v0.5.10), or --continue / --abort")
    state_dir = StateDir.of(paths.root)
    already = state_dir.exists()
    try:
        return flow.start(
            paths,
            args.version,
            source=UpstreamSource(args.upstream_git),
            step=args.step,
            dry_run=args.dry_run,
        )
    except KeyboardInterrupt:
        if not already and state_dir.exists():
            _abort_interrupted(paths)
        raise


def _abort_interrupted(paths: RepoPaths) -> None:
    """Ctrl-C during the rebase this run started: leave the repository as `--abort`
    would, deaf to a second Ctrl-C until that is done. A rebase resumed with
    --continue keeps its state (and the person's resolutions) instead."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        flow.abort(paths)
    except FatalError as error:  # it had landed already: the message says what to do
        print(f"sm120fork rebase: {error.message}", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, previous)
