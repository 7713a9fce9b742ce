"""`sm120fork check`: list every finding; exit 1 if there is any.

The vendored tree against vendor/sglang.sha256, then the series against the tree.
"""

from __future__ import annotations

import argparse
import sys

from sm120fork.errors import EXIT_FINDINGS, EXIT_OK
from sm120fork.intent.model import load_intents
from sm120fork.patches.checks import check_repository
from sm120fork.paths import RepoPaths
from sm120fork.upstream import manifest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options: the series, its files and vendor/ are the input


def run(args: argparse.Namespace) -> int:
    paths = RepoPaths(args.repo)
    findings = check_repository(paths)
    for finding in findings:
        print(finding)
    count = len(findings)
    if count:
        print(f"{count} finding{'s' if count != 1 else ''}", file=sys.stderr)
        return EXIT_FINDINGS
    for name, intent in sorted(load_intents(paths.intents_file).items()):
        if intent.stale:
            print(f"note: the intent of {name} is stale, so not proven: {intent.stale}")
    names = sum(1 for _ in paths.patches_dir.glob("*.patch"))
    vendored = manifest.read(paths.manifest_file)
    assert vendored is not None  # check_repository reports a missing manifest
    print(
        f"series clean: vendor/sglang is sglang {vendored.version} as imported "
        f"({len(vendored.files)} files); {names} patches apply exactly to it, all in normal form"
    )
    return EXIT_OK
