"""How the last `nox -s rebase -- VERSION` ended, for the upstream watch's next steps.

nox turns every failed session into exit 1, so a rebase's outcome is read from
`result` in build/rebase/report.json instead: up-to-date, dry-run (with the
count of patches that would conflict), complete or conflict. Written as
`result=`, `to=` and `conflicts=` lines to $GITHUB_OUTPUT (stdout without it).
Bad input, and a report that is missing (a crash) or unreadable, fail with the
reason as a GitHub error annotation. Standard library only: the workflow runs
it with the runner's Python, outside nox's environment.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPORT = Path("build/rebase/report.json")
GOOD = ("up-to-date", "dry-run", "complete", "conflict")


def outcome(report_path: Path) -> tuple[dict[str, str], str | None]:
    """(outputs, error): the step outputs, or the reason the step must fail."""
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
        result = report["result"]
    except FileNotFoundError:
        return {}, f"the rebase wrote no {report_path}: it crashed, see its output above"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return {}, f"cannot read the result in {report_path} ({error})"
    if result == "bad-input":
        return {"result": result}, f"the rebase refused: {report.get('error', '?')}"
    if result not in GOOD:
        return {}, f"{report_path} has an unknown result {result!r}"
    conflicts = sum(1 for patch in report.get("patches", []) if patch["status"] == "conflict")
    return {"result": result, "to": str(report["to"]), "conflicts": str(conflicts)}, None


def main() -> int:
    outputs, error = outcome(REPORT)
    lines = "".join(f"{key}={value}\n" for key, value in outputs.items())
    target = os.environ.get("GITHUB_OUTPUT")
    if target:
        with open(target, "a", encoding="utf-8") as handle:
            handle.write(lines)
    else:
        sys.stdout.write(lines)
    if error is not None:
        print(f"::error::{error}")  # a workflow command: GitHub reads it from stdout
        return 1
    print(f"rebase outcome: {outputs['result']} (sglang {outputs['to']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
