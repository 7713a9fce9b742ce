"""Command line entry point: `python -m sm120fork <command>` or `sm120fork <command>`.

Each command lives in `sm120fork.commands.<name>` and exposes
`add_arguments(parser)` and `run(args) -> int`. User errors (`FatalError`)
are turned into one line on stderr and a non-zero exit here, and only here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from sm120fork.errors import EXIT_INTERRUPTED, FatalError
from sm120fork.paths import require_checkout

DESCRIPTION = (
    "Maintain the sglang-sm120 fork: pristine upstream sglang in vendor/, the SM120 changes "
    "as a quilt series in patches/; check, rebase, review and build the fork's wheel."
)
EPILOG = "`sm120fork COMMAND --help` for a command's options; `nox -l` for the sessions over them."

# name -> one-line help; the module sm120fork.commands.<name> implements it.
COMMANDS: dict[str, str] = {
    "import": "vendor an upstream release into vendor/sglang and write its lock",
    "check": "check that the patch series is consistent and applies exactly",
    "refresh": "rewrite every patch in normal form",
    "rebase": "carry the series onto a new upstream release",
    "gates": "inventory the architecture gates of vendor/sglang",
    "wheel": "build the fork's wheel from the upstream release wheel",
    "apply": "write vendor/sglang with the series applied into a directory",
    "review": "show what a change to patches/ does: interdiffs, gates, expectation cells",
}

STARTS_A_FORK = frozenset({"import"})  # runs in an empty directory (a fork's first import)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported, so one broken command spoils no other."""
    parser = argparse.ArgumentParser(prog="sm120fork", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument(
        "-C",
        "--repo",
        type=Path,
        default=Path.cwd(),
        help="root of the fork's repository; relative paths are taken from there (default: .)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            _command_module(name).add_arguments(command_parser)
    return parser


def _command_module(name: str) -> ModuleType:
    # `import` is a keyword, so its module is `import_`.
    module = "import_" if name == "import" else name.replace("-", "_")
    return importlib.import_module(f"sm120fork.commands.{module}")


def _chosen_command(argv: Sequence[str]) -> str | None:
    # The first word that names a command (options before it take no values but -C's).
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word in ("-C", "--repo"):
            skip = True
        elif word in COMMANDS:
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_chosen_command(argv)).parse_args(argv)
    try:
        # Like `git -C`: run from the repository, so relative paths given on the
        # command line (--out, --dist, ...) mean paths inside it.
        args.repo = args.repo.resolve()
        if not args.repo.is_dir():
            raise FatalError(f"-C {args.repo}: no such directory; give the fork's root")
        os.chdir(args.repo)
        if args.command not in STARTS_A_FORK:
            require_checkout(args.repo)
        return int(_command_module(args.command).run(args))
    except FatalError as error:
        print(f"sm120fork {args.command}: error: {error.message}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        # A command mid-change has put the repository back before this (rebase aborts
        # the rebase it started; import and refresh swap or write nothing half-done).
        print(f"sm120fork {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
