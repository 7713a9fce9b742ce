"""Zip archives at the record level, for copying members without recompressing them.

Reading takes each member's compressed bytes as they lie in the archive;
writing emits canonical records: no extra fields, no data descriptors, unix
permissions 0644 or 0755, the given timestamps, names in the given order. The
same members therefore always give the same bytes, and an unchanged member
keeps its upstream compressed bytes, CRC and timestamp.
"""

from __future__ import annotations

import io
import struct
import time
import zipfile
import zlib
from dataclasses import dataclass
from typing import BinaryIO

from sm120fork.errors import FatalError

DateTime = tuple[int, int, int, int, int, int]
STORED, DEFLATED = zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_END = struct.Struct("<4sHHHHIIH")
_ZIP32_MAX = 0xFFFFFFFF
_VERSION = 20  # 2.0: deflate; what zipfile writes without zip64
_MADE_BY = (3 << 8) | _VERSION  # unix, so external attributes carry permissions
_UTF8_FLAG = 0x800


@dataclass(frozen=True)
class Member:
    """One file of an archive: its compressed bytes plus what a record needs."""

    method: int
    crc: int
    size: int  # uncompressed
    payload: bytes  # compressed
    date_time: DateTime
    executable: bool

    def data(self, where: str = "") -> bytes:
        """The uncompressed bytes, checked against the size and CRC."""
        data = self.payload if self.method == STORED else zlib.decompress(self.payload, -15)
        if len(data) != self.size or zlib.crc32(data) != self.crc:
            raise FatalError(f"{where}: CRC or size mismatch; the archive is damaged")
        return data


def deflate(data: bytes, date_time: DateTime, *, executable: bool = False) -> Member:
    compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
    payload = compressor.compress(data) + compressor.flush()
    return Member(DEFLATED, zlib.crc32(data), len(data), payload, date_time, executable)


def date_time_of(epoch: int) -> DateTime:
    """A zip timestamp (UTC) for seconds since the epoch, within zip's 1980-2107 range."""
    moment = time.gmtime(min(max(epoch, 315532800), 4354819199))
    return (
        moment.tm_year,
        moment.tm_mon,
        moment.tm_mday,
        moment.tm_hour,
        moment.tm_min,
        moment.tm_sec,
    )


class RawZip:
    """An archive in memory whose members come out with their compressed bytes."""

    def __init__(self, blob: bytes, name: str) -> None:
        self.name = name
        self._blob = blob
        try:
            self._zip = zipfile.ZipFile(io.BytesIO(blob))
        except (zipfile.BadZipFile, ValueError) as error:
            raise FatalError(f"{name} is not a readable zip ({error}); delete it") from error
        self.infos = tuple(info for info in self._zip.infolist() if not info.is_dir())

    def member(self, info: zipfile.ZipInfo) -> Member:
        mode = info.external_attr >> 16 if info.create_system == 3 else 0
        date_time: DateTime = info.date_time
        if info.flag_bits & 0x1:
            raise FatalError(f"{self.name}: member {info.filename} is encrypted; refusing it")
        if info.compress_type not in (STORED, DEFLATED):  # bzip2, lzma: recompress
            data = self.read(info)
            return deflate(data, date_time, executable=bool(mode & 0o111))
        offset = info.header_offset
        header = self._blob[offset : offset + _LOCAL.size]
        if len(header) < _LOCAL.size or header[:4] != b"PK\x03\x04":
            raise FatalError(f"{self.name}: member {info.filename} has no local header; damaged")
        name_length, extra_length = _LOCAL.unpack(header)[-2:]
        start = offset + _LOCAL.size + name_length + extra_length
        payload = self._blob[start : start + info.compress_size]
        if len(payload) != info.compress_size:
            raise FatalError(f"{self.name}: member {info.filename} is truncated; damaged")
        return Member(
            info.compress_type, info.CRC, info.file_size, payload, date_time, bool(mode & 0o111)
        )

    def read(self, info: zipfile.ZipInfo) -> bytes:
        try:
            return self._zip.read(info)
        except (zipfile.BadZipFile, zlib.error, NotImplementedError, EOFError) as error:
            raise FatalError(f"{self.name}: cannot read {info.filename} ({error})") from error


class ZipWriter:
    """Writes canonical records to `out`; `close()` writes the central directory."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._offset = 0
        self._central: list[bytes] = []

    def add(self, name: str, member: Member) -> None:
        encoded = name.encode("utf-8")
        flags = 0 if encoded.isascii() else _UTF8_FLAG
        dos_time, dos_date = _dos(member.date_time)
        if max(self._offset, member.size, len(member.payload)) >= _ZIP32_MAX:
            raise FatalError(f"{name}: the wheel would need zip64, which this tool does not write")
        common = (
            _VERSION,
            flags,
            member.method,
            dos_time,
            dos_date,
            member.crc,
            len(member.payload),
            member.size,
            len(encoded),
        )
        local = _LOCAL.pack(b"PK\x03\x04", *common, 0)
        mode = 0o100755 if member.executable else 0o100644
        self._central.append(
            _CENTRAL.pack(b"PK\x01\x02", _MADE_BY, *common, 0, 0, 0, 0, mode << 16, self._offset)
            + encoded
        )
        self._out.write(local + encoded)
        self._out.write(member.payload)
        self._offset += len(local) + len(encoded) + len(member.payload)

    def close(self) -> None:
        directory = b"".join(self._central)
        count = len(self._central)
        if count >= 0xFFFF or self._offset + len(directory) >= _ZIP32_MAX:
            raise FatalError("the wheel would need zip64, which this tool does not write")
        self._out.write(directory)
        self._out.write(
            _END.pack(b"PK\x05\x06", 0, 0, count, count, len(directory), self._offset, 0)
        )


def _dos(date_time: DateTime) -> tuple[int, int]:
    year, month, day, hour, minute, second = date_time
    return (hour << 11) | (minute << 5) | (second // 2), ((year - 1980) << 9) | (month << 5) | day
