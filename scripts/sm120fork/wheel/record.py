"""A wheel's RECORD: `path,sha256=<urlsafe b64, no padding>,size` per member."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from sm120fork.errors import FatalError

_HASHES = frozenset({"sha256", "sha384", "sha512"})


class Row(NamedTuple):
    name: str
    hash: str
    size: int


def digest(data: bytes, algorithm: str = "sha256") -> str:
    raw = hashlib.new(algorithm, data).digest()
    return f"{algorithm}=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def parse(data: bytes) -> dict[str, tuple[str, str]]:
    """path -> (hash, size) as written; empty strings where RECORD leaves them out."""
    rows: dict[str, tuple[str, str]] = {}
    for fields in csv.reader(io.StringIO(data.decode("utf-8"))):
        if fields:
            path, hash_, size = [*fields, "", ""][:3]
            rows[path] = (hash_, size)
    return rows


def check(member: str, data: bytes, record: Mapping[str, tuple[str, str]], wheel: str) -> str:
    """The sha256 RECORD hash of `member`, refused unless RECORD lists it with its hash and size."""
    if member not in record:
        raise FatalError(f"{wheel}: member {member} is not in its RECORD; refusing this wheel")
    hash_, size = record[member]
    algorithm = hash_.partition("=")[0]
    if algorithm not in _HASHES:
        raise FatalError(f"{wheel}: RECORD has no usable hash for {member}; refusing this wheel")
    sha256 = digest(data)
    if (sha256 if algorithm == "sha256" else digest(data, algorithm)) != hash_ or (
        size and size != str(len(data))
    ):
        raise FatalError(
            f"{wheel}: member {member} does not match its RECORD; the wheel is damaged, "
            "delete it and build again to download it anew"
        )
    return sha256


def row(name: str, data: bytes) -> Row:
    return Row(name, digest(data), len(data))


def render(rows: Iterable[Row], record_name: str) -> bytes:
    """RECORD for `rows` (in member order), with its own row last."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for name, hash_, size in rows:
        writer.writerow([name, hash_, size])
    writer.writerow([record_name, "", ""])
    return out.getvalue().encode("utf-8")
