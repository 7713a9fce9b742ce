"""Reading upstream archives without trusting them.

Every member name is checked before anything is written, links and special
files are refused, and files are written by this module (never by zipfile or
tarfile extraction) under a fresh directory, so a hostile archive cannot
reach outside the tree. A wheel is verified member by member against its
RECORD before its contents are used at all.
"""

from __future__ import annotations

import hashlib
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath

from sm120fork.errors import FatalError
from sm120fork.upstream import record

_ALTERED = "the wheel was altered or damaged, download it again from the index"


@dataclass(frozen=True)
class WheelTree:
    """What `extract_wheel_package` wrote, and what it left out."""

    skipped: tuple[str, ...]  # member names of binary files not written
    license: tuple[str, bytes] | None  # (member, bytes) of the dist-info LICENSE, if any
    hashes: tuple[tuple[str, str], ...] = ()  # (member, sha256 hex) of each file written

    @property
    def files(self) -> int:
        """How many files were written."""
        return len(self.hashes)


def is_text(data: bytes) -> bool:
    """Text for vendoring: valid UTF-8 with no NUL byte (so no `.so`, `.co`, images)."""
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def safe_member_path(name: str, archive: str) -> PurePosixPath:
    """`name` as a relative path that stays inside the tree, or a FatalError naming it."""
    parts = [part for part in name.split("/") if part not in ("", ".")]
    unsafe = (
        not parts
        or name.startswith("/")
        or "\\" in name
        or "\0" in name
        or (len(name) > 1 and name[1] == ":")  # a Windows drive
        or ".." in parts
    )
    if unsafe:
        raise FatalError(
            f"{archive}: unsafe member {name!r} would leave the tree; refusing this archive"
        )
    return PurePosixPath(*parts)


def write_file(root: Path, relative: PurePosixPath, data: bytes, *, executable: bool) -> str:
    """Write one member under `root` (a fresh directory this tool created); its sha256,
    for vendor/sglang.sha256 (the bytes were verified before they came here)."""
    target = root.joinpath(*relative.parts)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "xb") as handle:
            handle.write(data)
        target.chmod(0o755 if executable else 0o644)
    except OSError as error:
        raise FatalError(
            f"cannot write {relative} ({error.strerror}): the archive has conflicting members"
        ) from error
    return hashlib.sha256(data).hexdigest()


class MemberWriter:
    """`write_file` on a few threads: a release is 5700 files, and creating a file costs
    about a millisecond of the kernel's time on a virtual disk, most of it waiting,
    while the bytes are already in memory. `hashes()` waits for every write (the
    first failure is raised) and gives (name, sha256) in the order written."""

    _THREADS = 8

    def __init__(self, root: Path) -> None:
        self._root = root
        self._pool = ThreadPoolExecutor(max_workers=self._THREADS)
        self._written: list[tuple[str, Future[str]]] = []

    def write(self, name: str, relative: PurePosixPath, data: bytes, *, executable: bool) -> None:
        future = self._pool.submit(write_file, self._root, relative, data, executable=executable)
        self._written.append((name, future))

    def hashes(self) -> list[tuple[str, str]]:
        try:
            return [(name, future.result()) for name, future in self._written]
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> MemberWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def _corrupt_is_fatal(archive: Path) -> Iterator[None]:
    try:
        yield
    except (zipfile.BadZipFile, tarfile.TarError, zlib.error, EOFError, OSError) as error:
        if isinstance(error, FatalError):  # pragma: no cover - FatalError is no OSError
            raise
        raise FatalError(
            f"{archive.name} is corrupt or truncated ({error}); delete it and download it again"
        ) from error


def extract_wheel_package(wheel: Path, package: str, dest: Path) -> WheelTree:
    """Write the text files of `package/` as `dest/<package>/...`, verifying every
    member of `wheel` against RECORD on the way; binary files are skipped and listed.

    `dest` must be a fresh directory that the caller throws away if this raises."""
    skipped, license_files = [], {}
    writer = MemberWriter(dest)
    with _corrupt_is_fatal(wheel), writer, zipfile.ZipFile(wheel) as archive:
        infos = archive.infolist()
        _check_zip_members(infos, wheel.name)
        record_name = record.find((i.filename for i in infos), wheel.name)
        rows = record.parse(archive.read(record_name))
        dist_info = record_name.rsplit("/", 1)[0]
        listed = {info.filename for info in infos if not info.is_dir()}
        record.require_listed(rows, listed, wheel.name)
        for info in infos:
            if info.is_dir():
                continue
            data = archive.read(info)  # checks the CRC as well
            if not record.unhashed(info.filename, record_name):
                record.check(info.filename, data, rows, wheel.name, _ALTERED)
            path = safe_member_path(info.filename, wheel.name)
            if path.parts[0] == package:
                if is_text(data):
                    executable = bool((info.external_attr >> 16) & 0o111)
                    writer.write(info.filename, path, data, executable=executable)
                else:
                    skipped.append(info.filename)
            elif path.parts[0] == dist_info:
                license_files[info.filename] = data
        metadata = f"{dist_info}/METADATA"
        declared = _license_files(archive.read(metadata)) if metadata in listed else []
        hashes = writer.hashes()
    license = _pick_license(dist_info, declared, license_files)
    return WheelTree(tuple(skipped), license, tuple(hashes))


def _check_zip_members(infos: list[zipfile.ZipInfo], archive: str) -> None:
    seen: set[str] = set()
    for info in infos:
        safe_member_path(info.filename, archive)
        # Unix zips may carry a file type in the high bits; many tools leave it 0.
        file_type = stat.S_IFMT(info.external_attr >> 16) if info.create_system == 3 else 0
        if file_type not in (0, stat.S_IFREG, stat.S_IFDIR):
            kind = "a symlink" if file_type == stat.S_IFLNK else "not a regular file"
            raise FatalError(f"{archive}: member {info.filename!r} is {kind}; refusing this wheel")
        if info.filename in seen:
            raise FatalError(f"{archive}: member {info.filename!r} appears twice; refusing it")
        seen.add(info.filename)


def _license_files(metadata: bytes) -> list[str]:
    headers = HeaderParser().parsestr(metadata.decode("utf-8", "replace"))
    return headers.get_all("License-File") or []


def _pick_license(
    dist_info: str, declared: list[str], files: dict[str, bytes]
) -> tuple[str, bytes] | None:
    # Metadata 2.4 puts License-File entries under licenses/, older wheels at the top.
    candidates = [f"{dist_info}/licenses/{name}" for name in declared]
    candidates += [f"{dist_info}/{name}" for name in declared]
    candidates += [f"{dist_info}/licenses/LICENSE", f"{dist_info}/LICENSE"]
    # Upstream's repository licence is the file named LICENSE; prefer it over NOTICE etc.
    candidates.sort(key=lambda member: PurePosixPath(member).name != "LICENSE")
    for member in candidates:
        if member in files and is_text(files[member]):
            return member, files[member]
    return None


def read_sdist_license(sdist: Path) -> tuple[str, bytes]:
    """(`<top>/LICENSE`, its bytes) from an sdist tarball, refusing unsafe members."""
    with _corrupt_is_fatal(sdist), tarfile.open(sdist, "r:*") as archive:
        found: tarfile.TarInfo | None = None
        for member in archive:
            path = safe_member_path(member.name, sdist.name)
            if member.issym() or member.islnk():
                raise FatalError(f"{sdist.name}: member {member.name!r} is a link; refusing it")
            if not (member.isfile() or member.isdir()):
                raise FatalError(
                    f"{sdist.name}: member {member.name!r} is not a regular file; refusing it"
                )
            if len(path.parts) == 2 and path.parts[1] == "LICENSE" and member.isfile():
                found = member
        if found is None:
            raise FatalError(f"{sdist.name} has no top-level LICENSE; cannot vendor the licence")
        handle = archive.extractfile(found)
        assert handle is not None  # a regular file always has a handle
        data = handle.read()
    if not is_text(data):
        raise FatalError(f"{sdist.name}: {found.name} is not a text file; refusing it")
    return found.name, data
