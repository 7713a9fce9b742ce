"""Which upstream release a spec names: X.Y.Z, vX.Y.Z, vX.Y.x (newest X.Y) or latest.

Pure functions over a list of available versions (from the index or from a
remote's tags), so the rebase can reuse them and tests need no network. Only
final and .postN releases count.
"""

from __future__ import annotations

from collections.abc import Iterable

from packaging.version import InvalidVersion, Version

from sm120fork.errors import FatalError

SPEC_HELP = "X.Y.Z, vX.Y.Z, vX.Y.x (newest X.Y release) or latest"


def releases(available: Iterable[str]) -> list[tuple[Version, str]]:
    """Final and post releases only, oldest first, with the spelling the source uses."""
    found = []
    for text in available:
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if not (version.is_prerelease or version.is_devrelease or version.local):
            found.append((version, text))
    return sorted(found)


def nearest_releases(wanted: Version, available: Iterable[str], count: int = 2) -> list[str]:
    """The `count` releases on each side of `wanted`, nearest first below then above."""
    known = releases(available)
    below = [text for version, text in known if version < wanted][-count:]
    above = [text for version, text in known if version > wanted][:count]
    return [*reversed(below), *above]


def resolve_version(
    spec: str, available: Iterable[str], where: str = "on the package index"
) -> str:
    """`spec` (X.Y.Z, vX.Y.Z, vX.Y.x, latest) -> a release in `available`, as spelled there."""
    known = releases(available)
    text = spec.strip().lower().removeprefix("v")
    if not known:
        raise FatalError(f"no sglang release found {where}; check the source and retry")
    if text == "latest":
        return known[-1][1]
    if text.endswith(".x"):
        try:
            prefix = Version(text[:-2]).release
        except InvalidVersion:
            prefix = ()
        matching = [t for v, t in known if prefix and v.release[: len(prefix)] == prefix]
        if not matching:
            raise FatalError(f"no sglang release matches {spec} {where}; newest is {known[-1][1]}")
        return matching[-1]
    try:
        wanted = Version(text)
    except InvalidVersion:
        raise FatalError(f"{spec!r} is not a version; use {SPEC_HELP}") from None
    if wanted.is_prerelease or wanted.is_devrelease or wanted.local:
        raise FatalError(
            f"{spec} is not a final release; only final and .postN releases are imported"
        )
    for version, spelled in known:
        if version == wanted:
            return spelled
    nearest = ", ".join(nearest_releases(wanted, available))
    raise FatalError(f"sglang {spec} is not a release {where}; nearest releases: {nearest}")
