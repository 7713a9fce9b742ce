"""Wheels and sdists are read without trusting them: RECORD, unsafe members, corruption."""

from __future__ import annotations

import io
import tarfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

import conftest
import pytest
from conftest import record_line
from sm120fork.errors import FatalError
from sm120fork.upstream import record
from sm120fork.upstream.archive import extract_wheel_package, is_text, read_sdist_license

DIST = "sglang-0.5.9.dist-info"
GOOD: dict[str, bytes] = {
    "sglang/__init__.py": b"__version__ = '0.5.9'\n",
    "sglang/srt/utils.py": b"def f():\n    return 1\n",
    "sglang/srt/_core.cpython-311-x86_64-linux-gnu.so": b"\x7fELF\x00\x01binary",
    f"{DIST}/METADATA": b"Metadata-Version: 2.4\nName: sglang\nVersion: 0.5.9\n"
    b"License-File: LICENSE\n",
    f"{DIST}/licenses/LICENSE": b"Apache License\n",
    f"{DIST}/WHEEL": b"Wheel-Version: 1.0\n",
}


def make_wheel(path: Path, files: Mapping[str, bytes] = GOOD, **options: str | None) -> Path:
    return conftest.make_wheel(path, files, **options)


def good_record() -> str:
    return "".join(record_line(n, d) for n, d in GOOD.items()) + f"{DIST}/RECORD,,\n"


def test_good_wheel_keeps_text_files_and_lists_binaries(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "sglang-0.5.9-py3-none-any.whl")
    result = extract_wheel_package(wheel, "sglang", tmp_path / "out")
    assert result.files == 2
    assert result.skipped == ("sglang/srt/_core.cpython-311-x86_64-linux-gnu.so",)
    assert result.license == (f"{DIST}/licenses/LICENSE", b"Apache License\n")
    assert (tmp_path / "out/sglang/srt/utils.py").read_bytes() == GOOD["sglang/srt/utils.py"]
    assert not (tmp_path / "out" / DIST).exists()


def test_text_means_utf8_without_nul() -> None:
    assert is_text(b"")
    assert is_text("h\u00e9\n".encode())
    assert not is_text(b"a\x00b")
    assert not is_text(b"\xff\xfe")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.replace("sha256=", "sha256=AA", 1), "does not match its RECORD"),
        (lambda r: "".join(r.splitlines(True)[1:]), "sglang/__init__.py is not in RECORD"),
        (lambda r: r + "sglang/gone.py,sha256=AAAA,1\n", "RECORD lists sglang/gone.py"),
        (lambda r: r.replace("sha256=", "md5=", 1), "no usable hash"),
    ],
)
def test_record_mismatch_refuses_the_wheel(tmp_path: Path, mutate: object, message: str) -> None:
    wheel = make_wheel(tmp_path / "w.whl", record=mutate(good_record()))  # type: ignore[operator]
    with pytest.raises(FatalError, match=message):
        extract_wheel_package(wheel, "sglang", tmp_path / "out")


def test_tampered_member_is_named(tmp_path: Path) -> None:
    files = {**GOOD, "sglang/srt/utils.py": b"import os; os.system('evil')\n"}
    wheel = make_wheel(tmp_path / "w.whl", files, record=good_record())
    with pytest.raises(FatalError, match=r"member sglang/srt/utils\.py does not match"):
        extract_wheel_package(wheel, "sglang", tmp_path / "out")


def test_wheel_without_record_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("sglang/__init__.py", "x = 1\n")
    with pytest.raises(FatalError, match="has no RECORD"):
        extract_wheel_package(wheel, "sglang", tmp_path / "out")


@pytest.mark.parametrize("name", ["../evil.py", "sglang/../../evil.py", "/abs/evil.py", "C:/x.py"])
def test_unsafe_zip_names_are_refused(tmp_path: Path, name: str) -> None:
    wheel = make_wheel(tmp_path / "w.whl", {**GOOD, name: b"x\n"})
    with pytest.raises(FatalError, match="unsafe member"):
        extract_wheel_package(wheel, "sglang", tmp_path / "out")
    assert not (tmp_path / "evil.py").exists()


def test_symlink_zip_member_is_refused(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "w.whl", symlink="sglang/link.py")
    with pytest.raises(FatalError, match=r"sglang/link\.py' is a symlink"):
        extract_wheel_package(wheel, "sglang", tmp_path / "out")


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.99])
def test_truncated_wheel_is_a_fatal_error(tmp_path: Path, fraction: float) -> None:
    data = make_wheel(tmp_path / "w.whl").read_bytes()
    (tmp_path / "w.whl").write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(FatalError, match="corrupt or truncated"):
        extract_wheel_package(tmp_path / "w.whl", "sglang", tmp_path / "out")


def test_corrupted_member_bytes_are_a_fatal_error(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "w.whl", {**GOOD, "sglang/data.py": b"A" * 64})
    wheel.write_bytes(wheel.read_bytes().replace(b"A" * 64, b"B" * 64))
    with pytest.raises(FatalError, match="corrupt or truncated"):
        extract_wheel_package(wheel, "sglang", tmp_path / "out")


def make_tar(path: Path, members: list[tarfile.TarInfo], data: Mapping[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for info in members:
            payload = data.get(info.name)
            if payload is not None:
                info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload) if payload is not None else None)
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


def test_sdist_license_is_read(tmp_path: Path) -> None:
    sdist = make_tar(
        tmp_path / "sglang-0.5.9.tar.gz",
        [member("sglang-0.5.9", tarfile.DIRTYPE), member("sglang-0.5.9/LICENSE")],
        {"sglang-0.5.9/LICENSE": b"Apache License\n"},
    )
    assert read_sdist_license(sdist) == ("sglang-0.5.9/LICENSE", b"Apache License\n")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (member("../evil"), "unsafe member"),
        (member("/abs/evil"), "unsafe member"),
        (member("sglang-0.5.9/link", tarfile.SYMTYPE, "/etc/passwd"), "is a link"),
        (member("sglang-0.5.9/hard", tarfile.LNKTYPE, "sglang-0.5.9/LICENSE"), "is a link"),
        (member("sglang-0.5.9/fifo", tarfile.FIFOTYPE), "not a regular file"),
    ],
)
def test_unsafe_sdist_members_are_refused(
    tmp_path: Path, bad: tarfile.TarInfo, message: str
) -> None:
    sdist = make_tar(
        tmp_path / "s.tar.gz",
        [member("sglang-0.5.9/LICENSE"), bad],
        {"sglang-0.5.9/LICENSE": b"L\n", bad.name: b"x\n"},
    )
    with pytest.raises(FatalError, match=message):
        read_sdist_license(sdist)


def test_truncated_sdist_and_missing_license(tmp_path: Path) -> None:
    sdist = make_tar(
        tmp_path / "s.tar.gz", [member("sglang-0.5.9/README")], {"sglang-0.5.9/README": b"r\n"}
    )
    with pytest.raises(FatalError, match="has no top-level LICENSE"):
        read_sdist_license(sdist)
    sdist.write_bytes(sdist.read_bytes()[:40])
    with pytest.raises(FatalError, match="corrupt or truncated"):
        read_sdist_license(sdist)


@pytest.mark.parametrize(
    ("member", "unhashed"),
    [
        (f"{DIST}/RECORD", True),
        (f"{DIST}/RECORD.jws", True),
        (f"{DIST}/RECORD.p7s", True),
        (f"{DIST}/METADATA", False),
        ("sglang/RECORD", False),
    ],
)
def test_only_record_and_its_signatures_go_unhashed(member: str, unhashed: bool) -> None:
    assert record.unhashed(member, f"{DIST}/RECORD") is unhashed


def test_the_one_record_of_a_wheel() -> None:
    names = ["sglang/__init__.py", f"{DIST}/RECORD", "sglang/x.dist-info/RECORD"]
    assert record.find(names, "w.whl") == f"{DIST}/RECORD"
    with pytest.raises(FatalError, match="has no RECORD"):
        record.find([*names, "other-1.dist-info/RECORD"], "w.whl")
