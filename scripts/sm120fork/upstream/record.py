"""Verifying an upstream wheel against its RECORD, for `import` and for the fork's
wheel build alike: `path,<algorithm>=<urlsafe b64, no padding>,size` per member.

A member RECORD does not list, lists without a usable hash (sha256 or stronger,
as the wheel spec asks), or with other bytes, refuses the whole wheel; so
does a RECORD listing a member the wheel lacks.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
from collections.abc import Iterable, Mapping

from sm120fork.errors import FatalError

Record = Mapping[str, tuple[str, str]]  # member -> (hash, size) as written

_HASHES = frozenset({"sha256", "sha384", "sha512"})
# Signature files of RECORD, which RECORD lists without a hash.
SIGNATURES = ("RECORD.jws", "RECORD.p7s")


def digest(data: bytes, algorithm: str = "sha256") -> str:
    """`data`'s hash as RECORD writes it."""
    raw = hashlib.new(algorithm, data).digest()
    return f"{algorithm}=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def find(names: Iterable[str], wheel: str) -> str:
    """The name of the wheel's one `<name>.dist-info/RECORD`."""
    records = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise FatalError(f"{wheel} has no RECORD (or several); refusing an unverifiable wheel")
    return records[0]


def parse(data: bytes) -> dict[str, tuple[str, str]]:
    """path -> (hash, size) as written; empty strings where RECORD leaves them out."""
    rows: dict[str, tuple[str, str]] = {}
    for fields in csv.reader(io.StringIO(data.decode("utf-8", "replace"))):
        if fields:
            path, hash_, size = [*fields, "", ""][:3]
            rows[path] = (hash_, size)
    return rows


def require_listed(record: Record, members: Iterable[str], wheel: str) -> None:
    """Refuse a RECORD that lists a member the wheel lacks."""
    missing = sorted(set(record) - set(members))
    if missing:
        raise FatalError(f"{wheel}: RECORD lists {missing[0]} but the wheel lacks it")


def unhashed(member: str, record_name: str) -> bool:
    """RECORD itself or its signature: RECORD cannot hash them."""
    dist_info = record_name.rsplit("/", 1)[0]
    return member == record_name or member in (f"{dist_info}/{s}" for s in SIGNATURES)


def check(member: str, data: bytes, record: Record, wheel: str, advice: str) -> str:
    """The sha256 RECORD hash of `member`, refused unless RECORD lists it with its hash
    and size; `advice` says what to do about a wheel whose bytes do not match."""
    if member not in record:
        raise FatalError(f"{wheel}: member {member} is not in RECORD; refusing this wheel")
    hash_, size = record[member]
    algorithm = hash_.partition("=")[0]
    if algorithm not in _HASHES:
        raise FatalError(f"{wheel}: RECORD has no usable hash for {member}; refusing this wheel")
    sha256 = digest(data)
    if (sha256 if algorithm == "sha256" else digest(data, algorithm)) != hash_ or (
        size and size != str(len(data))
    ):
        raise FatalError(
            f"{wheel}: member {member} does not match its RECORD {algorithm}; {advice}"
        )
    return sha256
