"""`sm120fork rebase VERSION | --continue | --abort`: carry the series onto a new release.

Exit 0 when done (or a dry run found no conflict), 1 when stopped on a
conflict, 2 on bad input. See sm120fork.rebase for the steps.
"""

from __future__ import annotations

import argparse

from sm120fork.errors import FatalError
from sm120fork.paths import RepoPaths
from sm120fork.rebase import flow
from sm120fork.upstream import SPEC_HELP


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


def run(args: argparse.Namespace) -> int:
    paths = RepoPaths(args.repo)
    if args.resume or args.abort:
        extra = args.version or args.upstream_git or args.step or args.dry_run
        if extra:
            raise FatalError("--continue and --abort take no version or other option")
        return flow.resume(paths) if args.resume else flow.abort(paths)
    if not args.version:
        raise FatalError("name the release to rebase onto (e.g. v0.5.10), or --continue / --abort")
    return flow.start(
        paths, args.version, git_url=args.upstream_git, step=args.step, dry_run=args.dry_run
    )
