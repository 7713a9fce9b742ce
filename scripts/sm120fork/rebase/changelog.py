"""The CHANGELOG.md entry of a rebase: a new fork release `<upstream>+sm120.1`.

The top `## ` heading is the fork's version (see forkversion.py), so the
entry goes above every earlier one:

    ## 0.5.10+sm120.1 - 2026-11-29

    ### Upstream
    - Rebased onto sglang 0.5.10 (tag v0.5.10, from pypi); was 0.5.9.

    ### Patches
    - `sm120-x.patch`: carried unchanged.
    - `sm120-y.patch`: dropped as upstreamed: upstream 0.5.10 already makes ...

    ### Gates
    - new: python/sglang/srt/server_args.py:1748 `ServerArgs._handle_moe` ...
"""

from __future__ import annotations

from sm120fork.gates.diff import GateDiff
from sm120fork.patches.lines import split_lines
from sm120fork.rebase import fate, gatefindings
from sm120fork.rebase.state import RebaseState
from sm120fork.upstream import lock

TITLE = "# Changelog\n"


def entry(state: RebaseState, gates: GateDiff, today: str) -> str:
    """The new entry; with --step one per release walked, newest first."""
    if state.step_mode and state.release_gates is not None and len(state.targets) > 1:
        return _walk_entries(state, gates, today)
    final = lock.loads(state.final.lock_text)
    lines = [
        f"## {final.version}+sm120.1 - {today}",
        "",
        "### Upstream",
        f"- Rebased onto sglang {final.version} (tag {final.tag}, from {final.source}); "
        f"was {state.from_version}.",
        "",
        "### Patches",
        *(f"- `{patch.name}`: {fate.overall(patch, state.step_mode)}" for patch in state.patches),
        "",
        "### Gates",
        *_gate_lines(gates),
    ]
    return "\n".join(lines) + "\n"


def _walk_entries(state: RebaseState, gates: GateDiff, today: str) -> str:
    """Newest first: the release that lands, then each release walked on the way, each
    with what happened to every patch there and how its gates differ from the release
    before it (the report's `walk` section holds the same)."""
    assert state.release_gates is not None
    versions = [target.version for target in state.targets]
    entries = []
    for index in reversed(range(len(versions))):
        version = versions[index]
        before = versions[index - 1] if index else state.from_version
        final = lock.loads(state.targets[index].lock_text)
        if index == len(versions) - 1:
            upstream = [
                f"- Rebased onto sglang {version} (tag {final.tag}, from {final.source}); "
                f"was {state.from_version}. Walked all {len(versions)} releases after it "
                "with `rebase --step`: this entry is the last; each earlier one has its own "
                "entry below, not vendored or released on its own.",
            ]
        else:
            upstream = [
                f"- sglang {version} (tag {final.tag}, from {final.source}), walked from "
                f"{before} on the way to {versions[-1]}: not vendored or released on its own.",
            ]
        lines = [
            f"## {version}+sm120.1 - {today}",
            "",
            "### Upstream",
            *upstream,
            "",
            "### Patches",
            *_patches_at(state, version),
            "",
            "### Gates",
            *_gate_lines(state.release_gates.get(version, GateDiff.empty()), before),
        ]
        if index == len(versions) - 1:
            lines += [
                "",
                f"### Across the walk from {state.from_version}",
                *(f"- `{patch.name}`: {fate.overall(patch, True)}" for patch in state.patches),
                *_gate_lines(gates, state.from_version),
            ]
        entries.append("\n".join(lines) + "\n")
    return "\n".join(entries)


def _patches_at(state: RebaseState, version: str) -> list[str]:
    lines, gone = [], []
    for patch in state.patches:
        step = next((s for s in patch.steps if s.version == version), None)
        if step is None:
            gone.append(patch.name)
        else:
            lines.append(f"- `{patch.name}`: {fate.at_release(step)}")
    if gone:
        lines.append(f"- {fate.gone(gone)}")
    return lines


def _gate_lines(gates: GateDiff, since: str = "") -> list[str]:
    """The counts, then every gate whose answer for SM12x changed (the report has all)."""
    against = f" against {since}" if since else ""
    lines = [f"- Gates{against}: {gatefindings.summary(gates)} (the rebase report lists them)."]
    return lines + [
        f"- SM12x answer changed: {line}." for line in gatefindings.sm12x_changes(gates)
    ]


def insert(text: str | None, new_entry: str) -> str:
    """CHANGELOG.md with `new_entry` above the first release heading."""
    if not text:
        return f"{TITLE}\n{new_entry}"
    lines = split_lines(text)
    for index, line in enumerate(lines):
        if line.startswith("## "):
            return "".join(lines[:index]) + new_entry + "\n" + "".join(lines[index:])
    return text.rstrip("\n") + "\n\n" + new_entry
