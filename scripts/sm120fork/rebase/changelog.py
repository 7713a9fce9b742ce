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

from typing import Any

from sm120fork import lock
from sm120fork.lines import split_lines
from sm120fork.rebase import gatefindings
from sm120fork.rebase.ledger import first_break
from sm120fork.rebase.state import PatchState, RebaseState

TITLE = "# Changelog\n"
_FATE = {
    "clean": "carried unchanged",
    "offset": "refreshed (it applied at shifted lines)",
    "merged": "merged with upstream's changes by a 3-way merge; refreshed",
    "resolved": "re-applied from its intent (patches/intents.toml); refreshed",
}


def entry(state: RebaseState, gates: dict[str, list[Any]], today: str) -> str:
    final = lock.loads(state.final.lock_text)
    lines = [
        f"## {final.version}+sm120.1 - {today}",
        "",
        "### Upstream",
        f"- Rebased onto sglang {final.version} (tag {final.tag}, from {final.source}); "
        f"was {state.from_version}.",
        "",
        "### Patches",
        *(f"- `{patch.name}`: {_fate(patch, state.step_mode)}" for patch in state.patches),
        "",
        "### Gates",
        *_gate_lines(gates),
    ]
    return "\n".join(lines) + "\n"


def _fate(patch: PatchState, step_mode: bool) -> str:
    if patch.status == "upstreamed":
        fate = f"dropped as upstreamed: {patch.detail.removesuffix('; dropped')}"
    elif patch.steps and patch.steps[-1].by_hand:
        fate = "merged; conflict resolved by hand; refreshed"
    else:
        fate = _FATE.get(patch.status, patch.status)
    found = first_break(patch.steps) if step_mode else None
    if found and patch.status != "upstreamed":
        fate += f" ({found[1]})"
    return fate.rstrip(".") + "."


def _gate_lines(gates: dict[str, list[Any]]) -> list[str]:
    """The counts, then every gate whose answer for SM12x changed (the report has all)."""
    lines = [f"- {gatefindings.summary(gates)} (the rebase report lists them)."]
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
