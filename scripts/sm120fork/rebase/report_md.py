"""report.md and the writing of both report files: the Markdown is a pull request's
description (the upstream watch posts it), rendered from the `Report` record."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from sm120fork.fsutil import atomic_write_many
from sm120fork.rebase import fate, gatefindings
from sm120fork.rebase.gatefindings import KINDS
from sm120fork.rebase.report import PatchEntry, Release, Report, _Conditions, _conditions

_DRY_RUN_NOTE = [
    "A dry run goes on past a conflict: the patches after one were carried without it.",
    "",
]


def _dry_run_note(report: Report) -> list[str]:
    """A dry run goes on past a conflict; it stops, as the rebase would, where a patch's
    rows cannot run (the patches after it are then pending)."""
    if not any(p.status == "pending" for p in report.patches):
        return _DRY_RUN_NOTE
    return [
        "The dry run stopped where the rebase would: the patches after it were not carried.",
        "",
    ]


def write(directory: Path, report: Report) -> tuple[Path, Path]:
    json_path, md_path = directory / "report.json", directory / "report.md"
    atomic_write_many(
        {
            json_path: (json.dumps(report.to_json(), indent=2) + "\n").encode("utf-8"),
            md_path: markdown(report).encode("utf-8"),
        }
    )
    workflow_outputs(report)
    return json_path, md_path


def workflow_outputs(report: Report) -> None:
    """In a GitHub workflow ($GITHUB_OUTPUT set): how the rebase ended, as the step's
    outputs `result`, `to` and `conflicts` (nox turns every failure into exit 1, so the
    upstream watch reads these), and a refusal as an error annotation."""
    target = os.environ.get("GITHUB_OUTPUT")
    if not target:
        return
    conflicts = sum(1 for patch in report.patches if patch.status == "conflict")
    with open(target, "a", encoding="utf-8") as handle:
        handle.write(f"result={report.result}\nto={report.to}\nconflicts={conflicts}\n")
    if report.error is not None:
        print(f"::error::the rebase refused: {report.error}", flush=True)
    else:
        print(f"rebase outcome: {report.result} (sglang {report.to})", flush=True)


# GitHub refuses a pull-request body over 65536 characters; the upstream watch uses
# report.md as one, so the gate lists are shortened until it fits (report.json has all).
BODY_LIMIT = 65_000


def markdown(report: Report) -> str:
    """report.md: whole gate lists if they fit in a pull-request body, else shortened."""
    for listed in (None, 200, 50, 10, 0):
        text = _markdown(report, listed)
        if len(text) <= BODY_LIMIT:
            return text
    return text


def _markdown(report: Report, listed: int | None) -> str:
    if report.result == "up-to-date":
        return (
            f"# The sm120 series is up to date\n\nsglang {report.to} ({report.source}) "
            "is the newest release: nothing to rebase.\n"
        )
    if report.result == "bad-input":
        return (
            f"# Rebase the sm120 series onto sglang {report.to}\n\n"
            f"**Refused** (bad input), from sglang {report.from_version}: {report.error}\n"
        )
    stops = any(p.status == "conflict" for p in report.patches)
    lines = [
        f"# Rebase the sm120 series onto sglang {report.to}",
        "",
        report.summary_line(),
        "",
        *(_dry_run_note(report) if report.result == "dry-run" and stops else []),
        "| patch | status | strategy | what happened |",
        "|---|---|---|---|",
        *(
            f"| `{p.name}` | {p.status} | {p.strategy or '-'} | {_cell(_said(p))} |"
            for p in report.patches
        ),
    ]
    lines += _walk_markdown(report.walk)
    lines += _conflicts_markdown(report)
    lines += _stale_markdown(report.stale_intents)
    lines += ["", "## Gates", ""]
    if report.result == "conflict":
        return "\n".join([*lines, "Compared when the rebase completes.", ""])
    gates = report.gates
    lines += [gatefindings.summary(gates).capitalize() + ".", ""]
    for line in gatefindings.sm12x_changes(gates):
        lines.append(f"- SM12x answer changed: {line}")
    for kind in KINDS:
        found = gates.of_kind(kind)
        if found:
            listing = found if listed is None else found[:listed]
            lines += ["", f"<details><summary>{kind} ({len(found)})</summary>", ""]
            lines += [f"- {gatefindings.describe_gate(gate)}" for gate in listing]
            if len(listing) < len(found):
                lines.append(f"- ... and {len(found) - len(listing)} more in report.json")
            lines += ["", "</details>"]
    return "\n".join(lines).rstrip("\n") + "\n"


def _conflicts_markdown(report: Report) -> list[str]:
    conflicted = [p for p in report.patches if p.conflicts]
    if not conflicted:
        return []
    lines = ["", "## Conflicts", ""]
    if report.work_tree:
        lines += [
            f"The work tree with conflict markers is `{report.work_tree}`: edit the "
            "files there, then run `nox -s rebase -- --continue` (or `--abort`).",
            "",
        ]
    for patch in conflicted:
        how = " (resolved by its intent)" if patch.status == "resolved" else ""
        for c in patch.conflicts:
            gate = " (architecture gate)" if c.gate else ""
            title = f"`{patch.name}`{how}: `{c.file}` line {c.line}{gate}"
            lines += [f"### {title}", ""]
            lines += _conditions_table(_conditions(c))
            lines += ["Upstream (ours):", "", *_fenced(c.ours), ""]
            lines += ["The patch (theirs):", "", *_fenced(c.theirs), ""]
            if c.base:
                lines += ["Before both, in the old upstream:", "", *_fenced(c.base), ""]
    return lines


def _stale_markdown(stale: tuple[tuple[str, str], ...]) -> list[str]:
    if not stale:
        return []
    lines = ["", "## Intents for a person", ""]
    lines += [
        "These recipes in `patches/intents.toml` no longer reproduce their landed patch; "
        "they are marked `stale` (`check` names them) until a person re-derives them:",
        "",
    ]
    return lines + [f"- `{name}`: {why}" for name, why in stale]


def _walk_markdown(walk: tuple[Release, ...] | None) -> list[str]:
    """Release by release: each patch's fate there, and the gate changes."""
    if not walk:
        return []
    lines = ["", "## Release by release", ""]
    for release in walk:
        lines += [f"### sglang {release.version}", ""]
        lines += [f"- `{name}`: {_cell(fate.at_release(s))}" for name, s in release.results]
        lines += [f"- Gates: {gatefindings.summary(release.gates)}."]
        changed = gatefindings.sm12x_changes(release.gates)
        lines += [f"- SM12x answer changed: {line}" for line in changed]
        lines.append("")
    return lines


def _conditions_table(conditions: _Conditions | None) -> list[str]:
    if conditions is None:
        return []
    sides = (conditions.old_upstream, conditions.new_upstream, conditions.patch)
    if not any(sides):
        return []
    rows = max(len(side) for side in sides)

    def cell(values: list[str], i: int) -> str:
        return f"`{_cell(values[i])}`" if i < len(values) else ""

    lines = ["| old upstream | new upstream | the patch wanted |", "|---|---|---|"]
    lines += [f"| {' | '.join(cell(side, i) for side in sides)} |" for i in range(rows)]
    return [*lines, ""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _fenced(text: str) -> list[str]:
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}python", *text.rstrip("\n").split("\n"), fence]


def _said(patch: PatchEntry) -> str:
    """What happened, then what its rows showed (verify.py)."""
    return f"{patch.detail}; {patch.verified}" if patch.verified else patch.detail
