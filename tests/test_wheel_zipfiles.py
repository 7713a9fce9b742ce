"""The record-level zip reader and writer, and RECORD rows."""

from __future__ import annotations

import io
import zipfile

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sm120fork.errors import FatalError
from sm120fork.upstream import record as upstream_record
from sm120fork.wheel import record
from sm120fork.wheel.zipfiles import RawZip, ZipWriter, date_time_of, deflate

WHEN = (2026, 11, 29, 0, 0, 0)


def written(entries: list[tuple[str, bytes, bool]]) -> bytes:
    out = io.BytesIO()
    writer = ZipWriter(out)
    for name, data, executable in entries:
        writer.add(name, deflate(data, WHEN, executable=executable))
    writer.close()
    return out.getvalue()


@given(
    st.lists(
        st.tuples(
            st.text(
                st.characters(exclude_characters="/\0", codec="utf-8", min_codepoint=32),
                min_size=1,
            ),
            st.binary(max_size=300),
            st.booleans(),
        ),
        max_size=6,
        unique_by=lambda entry: entry[0],
    )
)
def test_zipfile_reads_what_the_writer_wrote(entries: list[tuple[str, bytes, bool]]) -> None:
    blob = written(entries)
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        assert archive.testzip() is None
        for (name, data, executable), info in zip(entries, archive.infolist(), strict=True):
            assert info.filename == name
            assert archive.read(info) == data
            assert info.date_time == WHEN
            assert info.external_attr >> 16 == (0o100755 if executable else 0o100644)
    assert written(entries) == blob


def test_raw_copy_keeps_compressed_bytes() -> None:
    source = io.BytesIO()
    with zipfile.ZipFile(source, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        archive.writestr("a/b.py", b"x = 1\n" * 100)
        archive.writestr(zipfile.ZipInfo("c.txt", (2001, 2, 3, 4, 5, 6)), b"stored")
    raw = RawZip(source.getvalue(), "source.zip")
    out = io.BytesIO()
    writer = ZipWriter(out)
    for info in raw.infos:
        writer.add("renamed/" + info.filename, raw.member(info))
    writer.close()
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(out) as new:
        for info in old.infolist():
            copy = new.getinfo("renamed/" + info.filename)
            assert new.read(copy) == old.read(info)
            assert (copy.compress_type, copy.compress_size, copy.CRC, copy.date_time) == (
                info.compress_type,
                info.compress_size,
                info.CRC,
                info.date_time,
            )


def test_damaged_member_is_refused() -> None:
    member = deflate(b"data", WHEN)
    broken = type(member)(member.method, member.crc ^ 1, member.size, member.payload, WHEN, False)
    with pytest.raises(FatalError, match="CRC"):
        broken.data("x.whl: a")


def test_timestamps_clamp_to_the_zip_range() -> None:
    assert date_time_of(0) == (1980, 1, 1, 0, 0, 0)
    assert date_time_of(1796083200) == (2026, 12, 1, 0, 0, 0)


def test_record_rows_round_trip() -> None:
    rows = [record.row("a,b.py", b"x"), record.row("c.py", b"")]
    text = record.render(rows, "d.dist-info/RECORD")
    assert text.splitlines()[-1] == b"d.dist-info/RECORD,,"
    parsed = upstream_record.parse(text)
    assert parsed["a,b.py"] == (upstream_record.digest(b"x"), "1")
    assert upstream_record.digest(b"") == "sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU"
    empty = upstream_record.digest(b"")
    assert upstream_record.check("c.py", b"", parsed, "w.whl", "advice") == empty
    with pytest.raises(FatalError, match="does not match its RECORD sha256; advice"):
        upstream_record.check("c.py", b"!", parsed, "w.whl", "advice")
