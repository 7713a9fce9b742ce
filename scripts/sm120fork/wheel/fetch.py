"""The locked upstream wheel's bytes: from the build cache, else through pip.

Whatever the source, the bytes must have the sha256 the lock records.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from sm120fork.errors import FatalError
from sm120fork.upstream.lock import Artifact, Lock
from sm120fork.wheel.select import download_target

Progress = Callable[[str], None]


def fetch(lock: Lock, artifact: Artifact, cache: Path, progress: Progress) -> bytes:
    cached = cache / artifact.file
    if cached.is_file():
        progress(f"using cached {artifact.file}")
        return _verified(cached, artifact, "delete it to download it again")
    # Imported here: the index client is heavy, and a cached wheel needs none of it.
    from sm120fork.upstream.artifacts import download_locked_wheel

    python_tag, platform = download_target(artifact.file)
    try:
        path = download_locked_wheel(
            lock, cache, python_tag=python_tag, platform=platform, progress=progress
        )
    except FatalError as error:
        raise FatalError(
            f"cannot get {artifact.file} through pip: {error.message} (or put the file in {cache})"
        ) from error
    if path.name != artifact.file:
        path.unlink(missing_ok=True)
        raise FatalError(
            f"pip downloaded {path.name} when asked for {artifact.file}; "
            "check pip's index configuration, or pass --artifact"
        )
    return _verified(path, artifact, "check pip's index or mirror, then delete it and retry")


def _verified(path: Path, artifact: Artifact, fix: str) -> bytes:
    try:
        blob = path.read_bytes()
    except OSError as error:
        raise FatalError(f"cannot read {path}: {error.strerror}; {fix}") from error
    actual = hashlib.sha256(blob).hexdigest()
    if actual != artifact.sha256:
        raise FatalError(
            f"{path} has sha256 {actual} but vendor/sglang.lock pins {artifact.sha256}; {fix}"
        )
    return blob
