"""The fork wheel's RECORD: `path,sha256=<urlsafe b64, no padding>,size` per member.

Reading and verifying upstream's RECORD is `sm120fork.upstream.record`.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from typing import NamedTuple

from sm120fork.upstream.record import digest


class Row(NamedTuple):
    name: str
    hash: str
    size: int


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
