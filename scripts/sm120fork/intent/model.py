"""The intent records and `patches/intents.toml`.

[[intent]]
patch = "0003-sm120-glm4-moe-nvfp4-cutlass.patch"
says = "In the Glm4Moe override, SM12x takes the quant auto-detect and flashinfer_cutlass"
anchor = "Glm4MoeForCausalLM"   # a string in the header of a block that encloses the gate
gate_admits = "sm100"           # the gate is the one in that block that admits this arch...
include = "sm120"               # ...and the patch lets this one in too
[[intent.switch]]               # inside the gate, on the included arch, this choice...
old = "flashinfer_trtllm"
new = "flashinfer_cutlass"      # ...becomes this one
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tomllib

from sm120fork.errors import FatalError

ARCH_FAMILIES = {"sm90": "sm90", "sm100": "sm100", "sm120": "sm120"}


@dataclass(frozen=True)
class Switch:
    old: str
    new: str


@dataclass(frozen=True)
class Insert:
    after: str
    code: str


@dataclass(frozen=True)
class Intent:
    patch: str
    says: str
    anchor: str
    gate_admits: str
    include: str
    switches: tuple[Switch, ...]
    files: tuple[str, ...]  # where the gate was when the intent was written (searched first)
    inserts: tuple[Insert, ...] = ()


def load_intents(path: Path) -> dict[str, Intent]:
    """Intents by patch name; an absent file means no patch declares one."""
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise FatalError(f"{path} is not valid TOML ({error}); fix the file") from error
    intents: dict[str, Intent] = {}
    for index, raw in enumerate(data.get("intent", []), start=1):
        intent = _parse(raw, f"{path.name} intent #{index}")
        if intent.patch in intents:
            raise FatalError(f"{path.name}: {intent.patch} has two intents; merge them")
        intents[intent.patch] = intent
    return intents


def _parse(raw: dict[str, object], where: str) -> Intent:
    def text(key: str) -> str:
        value = raw.get(key)
        if not isinstance(value, str) or not value.strip():
            raise FatalError(f"{where}: `{key}` must be a non-empty string")
        return value

    for key in ("gate_admits", "include"):
        if text(key) not in ARCH_FAMILIES:
            raise FatalError(f"{where}: `{key}` must be one of {', '.join(ARCH_FAMILIES)}")
    switches = []
    raw_switches = raw.get("switch", [])
    if not isinstance(raw_switches, list):
        raise FatalError(f"{where}: `switch` must be an array of tables ([[intent.switch]])")
    for item in raw_switches:
        if not isinstance(item, dict) or not all(
            isinstance(item.get(k), str) for k in ("old", "new")
        ):
            raise FatalError(f"{where}: every [[intent.switch]] needs string `old` and `new`")
        switches.append(Switch(item["old"], item["new"]))
    raw_inserts = raw.get("insert", [])
    if not isinstance(raw_inserts, list):
        raise FatalError(f"{where}: `insert` must be an array of tables ([[intent.insert]])")
    inserts = []
    for item in raw_inserts:
        if not isinstance(item, dict) or not all(
            isinstance(item.get(k), str) for k in ("after", "code")
        ):
            raise FatalError(f"{where}: every [[intent.insert]] needs string `after` and `code`")
        inserts.append(Insert(item["after"], item["code"]))
    files = raw.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise FatalError(f"{where}: `files` must be a list of paths")
    return Intent(
        patch=text("patch"),
        says=text("says"),
        anchor=text("anchor"),
        gate_admits=text("gate_admits"),
        include=text("include"),
        switches=tuple(switches),
        files=tuple(files),
        inserts=tuple(inserts),
    )
