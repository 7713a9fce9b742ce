"""One upstream wheel -> one fork wheel.

Every upstream member is checked against upstream's RECORD. Patch paths
`python/sglang/X` are wheel members `sglang/X`; the series is applied to the
wheel's own members, which must equal vendor/sglang for every file a patch
touches. Unchanged members are copied with their compressed bytes; the
dist-info (and any .data directory) is renamed to the fork version, METADATA
is rewritten, the patch list is added and RECORD is computed anew, last.
When the series adds the doctor, its known-bad table and its command (a wheel
script) come too (wheel/doctor.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from packaging.version import InvalidVersion, Version

from sm120fork.errors import FatalError
from sm120fork.patches.applier import Overlay, apply_patch
from sm120fork.patches.patchfile import PatchFile
from sm120fork.upstream import record as upstream_record
from sm120fork.upstream.archive import safe_member_path
from sm120fork.wheel import doctor, record
from sm120fork.wheel.metadata import PATCHES_FILE, ForkInfo, fork_metadata, patches_json
from sm120fork.wheel.zipfiles import DateTime, Member, RawZip, ZipWriter, deflate

_TREE_PREFIX = "python/"  # vendor/sglang/python/sglang/X is the wheel's sglang/X
_DAMAGED = "the wheel is damaged, delete it and build again to download it anew"


@dataclass(frozen=True)
class Transformed:
    members: int
    changed: tuple[str, ...]  # wheel members the series changed, added or deleted


class _WheelOverlay(Overlay):
    """An Overlay whose base files are the wheel's members, not a directory."""

    def __init__(self, base: Path, load: Callable[[str], bytes | None]) -> None:
        super().__init__(base)
        self._load = load

    def read(self, path: str) -> str | None:
        if path in self.changes:
            return self.changes[path]
        data = self._load(path)
        if data is None:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise FatalError(f"{path} is not UTF-8 text; patch only text files") from error


class _Upstream:
    """The upstream wheel's members, each verified against RECORD when first read."""

    def __init__(self, archive: RawZip) -> None:
        self.archive = archive
        self.by_name = {info.filename: info for info in archive.infos}
        if len(self.by_name) != len(archive.infos):
            raise FatalError(f"{archive.name} has a member twice; refusing this wheel")
        for name in self.by_name:
            safe_member_path(name, archive.name)
        self.record_name = upstream_record.find(self.by_name, archive.name)
        self.dist_info = self.record_name.split("/")[0]
        self.record = upstream_record.parse(archive.read(self.by_name[self.record_name]))
        upstream_record.require_listed(self.record, self.by_name, archive.name)
        self._verified: dict[str, tuple[Member, bytes, str]] = {}

    def verified(self, name: str) -> tuple[Member, bytes, str]:
        """(member, its bytes, its sha256 RECORD hash) after checking it against RECORD."""
        if name not in self._verified:
            member = self.archive.member(self.by_name[name])
            data = member.data(f"{self.archive.name}: {name}")
            hash_ = upstream_record.check(name, data, self.record, self.archive.name, _DAMAGED)
            self._verified[name] = (member, data, hash_)
        return self._verified[name]

    def load(self, tree_path: str) -> bytes | None:
        name = tree_path.removeprefix(_TREE_PREFIX)
        return self.verified(name)[1] if name in self.by_name else None


def fork_wheel(
    upstream_wheel: bytes,
    upstream_name: str,
    out: BinaryIO,
    *,
    vendor: Path,
    patches: tuple[PatchFile, ...],
    info: ForkInfo,
    date_time: DateTime,
    known_bad: bytes | None = None,
) -> Transformed:
    """Write the fork of `upstream_wheel` (the bytes of file `upstream_name`) to `out`."""
    upstream = _Upstream(RawZip(upstream_wheel, upstream_name))
    old_prefix = _check_dist_info(upstream, info)
    new_prefix = f"{old_prefix.rsplit('-', 1)[0]}-{info.version}"
    changes = _apply(upstream, vendor, patches)
    with_doctor = doctor.ships(changes)
    if with_doctor:
        for name, data in doctor.known_bad_member(known_bad).items():
            if name in upstream.by_name or name in changes:
                raise FatalError(
                    f"{name} is already in the wheel; the fork adds it from "
                    f"{doctor.KNOWN_BAD_SOURCE}: remove it from the series"
                )
            changes[name] = data
    entry_points = f"{upstream.dist_info}/entry_points.txt"
    if with_doctor and entry_points in upstream.by_name:
        where = f"{upstream.archive.name}: {entry_points}"
        doctor.refuse_console_script(upstream.verified(entry_points)[1], where)

    def renamed(name: str) -> str:
        top, _, rest = name.partition("/")
        if top in (f"{old_prefix}.dist-info", f"{old_prefix}.data"):
            return f"{new_prefix}{top.removeprefix(old_prefix)}/{rest}"
        return name

    added = sorted(name for name in changes if name not in upstream.by_name)
    pending = list(added)  # new files go after the package's own, before the dist-info
    rows: list[record.Row] = []
    writer = ZipWriter(out)

    def write(name: str, member: Member, data: bytes, hash_: str | None = None) -> None:
        writer.add(name, member)
        rows.append(record.Row(name, hash_ or upstream_record.digest(data), len(data)))

    def write_added() -> None:
        for name in pending:
            data = changes[name]
            assert data is not None  # deleting a file the wheel lacks fails in apply
            write(name, deflate(data, date_time), data)
        pending.clear()

    for name in upstream.by_name:
        if name.partition("/")[0].endswith((".dist-info", ".data")):
            write_added()
        if upstream_record.unhashed(name, upstream.record_name):
            continue  # RECORD is written anew, last; its signatures would no longer hold
        member, data, hash_ = upstream.verified(name)
        if name in changes:
            new = changes[name]
            if new is not None:
                write(name, deflate(new, date_time, executable=member.executable), new)
        elif name == f"{upstream.dist_info}/METADATA":
            metadata = fork_metadata(data, info, f"{upstream.archive.name}: {name}")
            write(renamed(name), deflate(metadata, date_time), metadata)
        else:
            write(renamed(name), member, data, hash_)
    write_added()
    if with_doctor:
        script, source = doctor.script_member(changes, f"{new_prefix}.data")
        if script in map(renamed, upstream.by_name):
            raise FatalError(
                f"{script} is already in the wheel; the fork adds it from "
                f"{doctor.LAUNCHER}: remove it from the series"
            )
        write(script, deflate(source, date_time, executable=True), source)
        changes[script] = source
    listing = patches_json(info)
    write(f"{new_prefix}.dist-info/{PATCHES_FILE}", deflate(listing, date_time), listing)
    record_name = f"{new_prefix}.dist-info/RECORD"
    writer.add(record_name, deflate(record.render(rows, record_name), date_time))
    writer.close()
    return Transformed(len(rows) + 1, tuple(sorted(changes)))


def _check_dist_info(upstream: _Upstream, info: ForkInfo) -> str:
    prefix = upstream.dist_info.removesuffix(".dist-info")
    name, _, version = prefix.rpartition("-")
    try:
        same = Version(version) == Version(info.upstream_version)
    except InvalidVersion:
        same = False
    if name.lower() != "sglang" or not same:
        raise FatalError(
            f"{upstream.archive.name} holds {upstream.dist_info}, not sglang "
            f"{info.upstream_version} as the lock says; refusing it"
        )
    return prefix


def _apply(
    upstream: _Upstream, vendor: Path, patches: tuple[PatchFile, ...]
) -> dict[str, bytes | None]:
    """The series applied to the wheel's members: member name -> bytes (None: deleted)."""
    for path in dict.fromkeys(path for patch in patches for path in patch.paths):
        if not path.startswith(_TREE_PREFIX + "sglang/"):
            raise FatalError(
                f"the series changes {path}, which is outside python/sglang/ and so not part "
                "of the wheel; move that change out of patches/ or into python/sglang/"
            )
        _check_vendor(upstream, vendor, path)
    overlay = _WheelOverlay(vendor, upstream.load)
    for patch in patches:
        try:
            apply_patch(overlay, patch)
        except FatalError as error:
            raise FatalError(
                f"{patch.name} does not apply to {upstream.archive.name}: {error.message}; "
                "run `sm120fork check`"
            ) from error
    return {
        path.removeprefix(_TREE_PREFIX): None if text is None else text.encode("utf-8")
        for path, text in overlay.changes.items()
    }


def _check_vendor(upstream: _Upstream, vendor: Path, path: str) -> None:
    """A file the series touches must be the same in the wheel and in vendor/sglang."""
    in_wheel = upstream.load(path)
    vendored = vendor / path
    in_vendor = vendored.read_bytes() if vendored.is_file() else None
    if in_wheel == in_vendor:
        return
    member, wheel = path.removeprefix(_TREE_PREFIX), upstream.archive.name
    if in_wheel is None:
        problem = f"{wheel} lacks {member} but vendor/sglang has {path}"
    elif in_vendor is None:
        problem = f"{wheel} has {member} but vendor/sglang lacks {path}"
    else:
        problem = f"{member} in {wheel} differs from vendor/sglang/{path}"
    raise FatalError(
        f"{problem}; the series is written against vendor/sglang, so the two must agree: "
        "re-import the release with `sm120fork import`"
    )
