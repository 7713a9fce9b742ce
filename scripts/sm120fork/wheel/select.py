"""Which upstream wheels of the locked release to build from, and the fork's file names."""

from __future__ import annotations

from packaging.tags import Tag, sys_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from sm120fork.errors import FatalError
from sm120fork.upstream.lock import Artifact, Lock


def wheel_artifacts(lock: Lock) -> tuple[Artifact, ...]:
    """The lock's wheels of sglang at the locked version, by file name."""
    wheels = tuple(
        sorted(
            (a for a in lock.artifacts if _is_release_wheel(a.file, lock.version)),
            key=lambda a: a.file,
        )
    )
    if not wheels:
        raise FatalError(
            f"vendor/sglang.lock records no wheel of sglang {lock.version} "
            f"(source {lock.source}); run `sm120fork import {lock.version}` to lock "
            "the release's files on the package index"
        )
    return wheels


def choose(lock: Lock, *, every: bool = False, artifact: str | None = None) -> tuple[Artifact, ...]:
    """`artifact`, or every wheel, or the one this interpreter would install (or the only one)."""
    wheels = wheel_artifacts(lock)
    if artifact is not None:
        found = [a for a in wheels if a.file == artifact]
        if not found:
            raise FatalError(
                f"vendor/sglang.lock lists no wheel {artifact}; pick one of: "
                + ", ".join(a.file for a in wheels)
            )
        return tuple(found)
    if every or len(wheels) == 1:
        return wheels
    for tag in sys_tags():
        for wheel in wheels:
            if tag in tags_of(wheel.file):
                return (wheel,)
    here = next(iter(sys_tags()))
    raise FatalError(
        f"none of the {len(wheels)} wheels of sglang {lock.version} fits this Python ({here}); "
        "pass --all, or --artifact with one of: " + ", ".join(a.file for a in wheels)
    )


def tags_of(file: str) -> frozenset[Tag]:
    return parse_wheel_filename(file)[3]


def download_target(file: str) -> tuple[str | None, str | None]:
    """(python tag, platform) to ask pip for `file`; (None, None) when this interpreter fits."""
    tags = tags_of(file)
    if any(tag in tags for tag in sys_tags()):
        return None, None
    tag = sorted(tags, key=str)[0]
    return tag.interpreter, None if tag.platform == "any" else tag.platform


def fork_wheel_name(upstream_file: str, version: str) -> str:
    """`upstream_file` with the version field replaced: tags and build number stay."""
    name, _, rest = upstream_file.removesuffix(".whl").split("-", 2)
    return f"{name}-{version}-{rest}.whl"


def _is_release_wheel(file: str, version: str) -> bool:
    if not file.endswith(".whl"):
        return False
    try:
        project, found, _, _ = parse_wheel_filename(file)
        return project == "sglang" and found == Version(version)
    except (InvalidWheelFilename, InvalidVersion):
        return False
