"""What the fork changes in the dist-info: METADATA's version and text, and the
list of applied patches (`sm120-patches.json`).

`pip show` prints Summary, so the Summary names the fork release and its
patches; the long description (PyPI's page, `importlib.metadata`) gets a
section listing every patch with its subject; the JSON file keeps the same
list for tools. Everything else in METADATA stays byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from sm120fork.errors import FatalError
from sm120fork.patches.patchfile import PatchFile

PATCHES_FILE = "sm120-patches.json"
_FIELD = re.compile(r"(?P<name>[A-Za-z0-9-]+):[ \t]?(?P<value>.*)")


@dataclass(frozen=True)
class AppliedPatch:
    name: str
    subject: str
    sha256: str  # of the patch file's bytes

    @classmethod
    def create(cls, patch: PatchFile) -> AppliedPatch:
        return cls(patch.name, patch.header.subject, hashlib.sha256(patch.raw).hexdigest())


@dataclass(frozen=True)
class ForkInfo:
    """What the fork's dist-info says about where the wheel came from."""

    version: str  # the fork version, e.g. 0.5.9+sm120.1
    upstream_version: str
    upstream_wheel: str  # file name
    upstream_sha256: str
    patches: tuple[AppliedPatch, ...]


def fork_metadata(original: bytes, info: ForkInfo, where: str) -> bytes:
    """Upstream's METADATA with the fork's Version, Summary and description section."""
    try:
        text = original.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FatalError(f"{where} is not UTF-8; refusing to rewrite it") from error
    head, separator, body = text.partition("\n\n")
    lines = head.split("\n")
    fields = [(i, _FIELD.fullmatch(line)) for i, line in enumerate(lines)]
    named = {match["name"].lower(): i for i, match in reversed(fields) if match}
    if "version" not in named:
        raise FatalError(f"{where} has no Version field; refusing this wheel")
    lines[named["version"]] = f"Version: {info.version}"
    summary = _summary(info)
    if "summary" in named:
        current = lines[named["summary"]].partition(":")[2].strip()
        lines[named["summary"]] = "Summary: " + " ".join(filter(None, (current, summary)))
    else:
        lines.insert(named["version"] + 1, f"Summary: {summary}")
    if "description" in named:  # an old-style Description field: leave the text alone
        return ("\n".join(lines) + separator + body).encode("utf-8")
    body = body.rstrip("\n") + "\n\n" if body.strip() else ""
    return ("\n".join(lines) + "\n\n" + body + _section(info)).encode("utf-8")


def patches_json(info: ForkInfo) -> bytes:
    document = {
        "version": info.version,
        "upstream": {
            "version": info.upstream_version,
            "wheel": info.upstream_wheel,
            "sha256": info.upstream_sha256,
        },
        "patches": [
            {"name": p.name, "subject": p.subject, "sha256": p.sha256} for p in info.patches
        ],
    }
    return (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _summary(info: ForkInfo) -> str:
    if not info.patches:
        return f"[sm120 fork {info.version}: no patches]"
    names = ", ".join(p.name.removesuffix(".patch") for p in info.patches)
    count = f"{len(info.patches)} patch" + ("es" if len(info.patches) > 1 else "")
    return f"[sm120 fork {info.version}: {count}: {names}]"


def _section(info: ForkInfo) -> str:
    lines = [
        "## sm120 fork",
        "",
        f"This is sglang {info.upstream_version} (`{info.upstream_wheel}`) with the "
        f"sglang-sm120 patch series applied: fork release {info.version}.",
        "",
    ]
    if info.patches:
        lines += ["Patches, in apply order:", ""]
        lines += [f"{i}. `{p.name}`: {p.subject}" for i, p in enumerate(info.patches, start=1)]
    else:
        lines.append("No patches: the package files are upstream's.")
    lines += ["", f"The same list is in the dist-info's `{PATCHES_FILE}`."]
    return "\n".join(lines) + "\n"
