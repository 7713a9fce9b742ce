"""`sm120fork import VERSION` from a package index: a local PEP 503 index through real pip.

pip is pointed at a file:// simple index built here (no config files, no other
index), so these tests exercise the real downloads, the index's file list, the
RECORD check and the lock without the network. Only the last tests, marked
`network`, use the real index.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import pytest
from conftest import make_sdist, make_wheel, snapshot
from sm120fork.cli import main
from sm120fork.errors import FatalError
from sm120fork.upstream import lock
from sm120fork.upstream import pypi as upstream_pypi
from sm120fork.upstream.artifacts import download_locked_wheel
from sm120fork.upstream.fetch import available_versions, fetch_release

pytestmark = pytest.mark.slow  # each import runs pip three or four times

WHEEL = "sglang-0.5.9-py3-none-any.whl"
OTHER_WHEEL = "sglang-0.5.9-cp312-cp312-manylinux_2_34_x86_64.whl"  # not for this interpreter
SDIST = "sglang-0.5.9.tar.gz"
DIST = "sglang-0.5.9.dist-info"
SOURCES = {
    "sglang/__init__.py": b"__version__ = '0.5.9'\n",
    "sglang/srt/server_args.py": b"ARGS = 1\n",
    "sglang/srt/_core.so": b"\x7fELF\x00binary",
}
META = {
    f"{DIST}/METADATA": b"Metadata-Version: 2.4\nName: sglang\nVersion: 0.5.9\n"
    b"License-File: LICENSE\n",
    f"{DIST}/licenses/LICENSE": b"wheel licence\n",
    f"{DIST}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}


def wheel_bytes(tmp_path: Path, files: Mapping[str, bytes], **options: str) -> bytes:
    path = make_wheel(tmp_path / "scratch.whl", files, **options)
    data = path.read_bytes()
    path.unlink()
    return data


class Index:
    """A file:// simple index at `root` that pip is configured to use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, bytes] = {}

    @property
    def url(self) -> str:
        return (self.root / "simple").as_uri()

    def publish(self, files: Mapping[str, bytes]) -> None:
        self.files.update(files)
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        (self.root / "simple" / "sglang").mkdir(parents=True, exist_ok=True)
        links = []
        for name, data in sorted(self.files.items()):
            (self.root / "files" / name).write_bytes(data)
            digest = hashlib.sha256(data).hexdigest()
            links.append(f'<a href="../../files/{name}#sha256={digest}">{name}</a><br/>')
        page = "<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n"
        (self.root / "simple" / "sglang" / "index.html").write_text(page)
        (self.root / "simple" / "index.html").write_text('<a href="sglang/">sglang</a>\n')


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Index:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no pip.conf anywhere
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv(lock.DATE_ENV, "2026-02-03")
    idx = Index(tmp_path / "index")
    monkeypatch.setenv("PIP_INDEX_URL", idx.url)
    idx.publish(
        {
            WHEEL: wheel_bytes(tmp_path, {**SOURCES, **META}),
            OTHER_WHEEL: b"another platform's wheel",
            SDIST: make_sdist(
                tmp_path / SDIST, {"sglang-0.5.9/LICENSE": b"sdist licence\n"}
            ).read_bytes(),
        }
    )
    return idx


@pytest.fixture
def fork(tmp_path: Path) -> Path:
    root = tmp_path / "fork"
    root.mkdir()
    return root


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_import_locks_every_artifact_of_the_release(index: Index, fork: Path) -> None:
    assert main(["-C", str(fork), "import", "v0.5.9"]) == 0
    tree = fork / "vendor" / "sglang"
    assert (tree / "LICENSE").read_bytes() == b"sdist licence\n"
    assert (tree / "python/sglang/srt/server_args.py").read_bytes() == b"ARGS = 1\n"
    assert not (tree / "python/sglang/srt/_core.so").exists()
    assert not (tree / "python" / DIST).exists()
    locked = lock.read(fork / "vendor" / "sglang.lock")
    assert locked is not None
    assert (locked.version, locked.tag, locked.source) == ("0.5.9", "v0.5.9", "pypi")
    assert locked.tree_from == WHEEL
    assert locked.license_from == f"{SDIST}:sglang-0.5.9/LICENSE"
    assert locked.skipped == ("python/sglang/srt/_core.so",)
    assert locked.artifacts == (
        lock.Artifact(OTHER_WHEEL, sha(index.files[OTHER_WHEEL]), None),  # listed, not fetched
        lock.Artifact(WHEEL, sha(index.files[WHEEL]), len(index.files[WHEEL])),
        lock.Artifact(SDIST, sha(index.files[SDIST]), len(index.files[SDIST])),
    )
    # Same release again: same bytes.
    before = snapshot(fork)
    assert main(["-C", str(fork), "import", "latest"]) == 0
    assert snapshot(fork) == before


def test_changed_artifact_is_refused_against_the_lock(
    index: Index, fork: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["-C", str(fork), "import", "0.5.9"]) == 0
    before = snapshot(fork)
    # The index (a mirror, say) now serves another wheel under the same name, and
    # lists its hash, so pip itself is satisfied; the lock is not.
    evil = {**SOURCES, "sglang/__init__.py": b"import evil\n", **META}
    index.publish({WHEEL: wheel_bytes(tmp_path, evil)})
    capsys.readouterr()
    assert main(["-C", str(fork), "import", "0.5.9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{WHEEL} with sha256" in err
    assert "the file changed since it was locked" in err
    assert snapshot(fork) == before

    locked = lock.read(fork / "vendor" / "sglang.lock")
    assert locked is not None
    with pytest.raises(FatalError, match=f"downloaded {WHEEL} has sha256 .* lock pins"):
        download_locked_wheel(locked, tmp_path / "dl")
    assert list((tmp_path / "dl").iterdir()) == []


def test_download_locked_wheel_verifies_and_keeps_the_file(
    index: Index, fork: Path, tmp_path: Path
) -> None:
    assert main(["-C", str(fork), "import", "0.5.9"]) == 0
    locked = lock.read(fork / "vendor" / "sglang.lock")
    assert locked is not None
    path = download_locked_wheel(locked, tmp_path / "dl")
    assert path == tmp_path / "dl" / WHEEL
    assert path.read_bytes() == index.files[WHEEL]
    # A pure wheel fits every interpreter and platform.
    pure = download_locked_wheel(locked, tmp_path / "dl", python_tag="cp39", platform="win_amd64")
    assert pure == path
    missing = dataclasses.replace(locked, version="0.5.8")
    with pytest.raises(FatalError, match="has no wheel for cp39 win_amd64; the lock lists"):
        download_locked_wheel(missing, tmp_path / "dl", python_tag="cp39", platform="win_amd64")
    from_git = lock.Lock("0.5.9", "v0.5.9", "git", "2026-02-03", "c", "c:LICENSE", "u", "c")
    with pytest.raises(FatalError, match="records no wheel"):
        download_locked_wheel(from_git, tmp_path / "dl")


def test_wheel_failing_its_record_is_refused(
    index: Index, fork: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (fork / "vendor" / "sglang").mkdir(parents=True)
    (fork / "vendor" / "sglang" / "keep.txt").write_text("old tree\n")
    before = snapshot(fork)
    files = {**SOURCES, **META}
    record = "".join(
        f"{name},sha256=AAAA,{len(data)}\n" if name == "sglang/srt/server_args.py" else ""
        for name, data in files.items()
    )
    good = make_wheel(tmp_path / "good.whl", files).read_bytes()
    good_record = [line for line in _record(good).splitlines(True) if "server_args" not in line]
    index.publish({WHEEL: wheel_bytes(tmp_path, files, record="".join(good_record) + record)})
    assert main(["-C", str(fork), "import", "0.5.9"]) == 2
    assert "member sglang/srt/server_args.py does not match" in capsys.readouterr().err
    assert snapshot(fork) == before


def _record(wheel: bytes) -> str:
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(wheel)) as archive:
        return archive.read(f"{DIST}/RECORD").decode()


def test_release_without_sdist_takes_the_wheels_licence(
    index: Index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    del index.files[SDIST], index.files[OTHER_WHEEL]
    index.publish({})
    release = fetch_release("0.5.9", workdir=tmp_path / "work")
    assert (release.tree / "LICENSE").read_bytes() == b"wheel licence\n"
    assert release.license_from == f"{WHEEL}:{DIST}/licenses/LICENSE"
    assert [a.file for a in release.artifacts] == [WHEEL]

    no_licence = {**SOURCES, **META}
    del no_licence[f"{DIST}/licenses/LICENSE"]
    index.publish({WHEEL: wheel_bytes(tmp_path, no_licence)})
    with pytest.raises(FatalError, match="no sdist and its wheel no LICENSE"):
        fetch_release("0.5.9", workdir=tmp_path / "work2")


def test_unknown_version_names_the_nearest(
    index: Index, fork: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["-C", str(fork), "import", "0.5.10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(
        "sglang 0.5.10 is not a release on the package index; nearest releases: 0.5.9"
    )
    assert not (fork / "vendor").exists()


@pytest.mark.network
def test_real_index_0_5_9(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lock.DATE_ENV, "2026-02-03")
    release = fetch_release("v0.5.9", workdir=tmp_path / "work")
    assert release.tree_from == WHEEL
    assert release.license_from == f"{SDIST}:sglang-0.5.9/LICENSE"
    assert {a.file for a in release.artifacts} == {WHEEL, SDIST}
    wheel = next(a for a in release.artifacts if a.file == WHEEL)
    assert wheel.sha256 == "8a936c4d25fea605f44254e533cff2144c73ceffbc1f8738aba393461bbb64d1"
    assert (release.tree / "python" / "sglang" / "srt" / "server_args.py").is_file()


@pytest.mark.network
def test_real_index_versions() -> None:
    from sm120fork.upstream.pypi import available_versions
    from sm120fork.upstream.versions import resolve_version

    available = available_versions()
    assert resolve_version("0.5.10.post1", available) == "0.5.10.post1"
    assert resolve_version("v0.4.x", available) == "0.4.10.post2"


def test_platform_wheel_for_another_python_is_the_fallback(
    index: Index, tmp_path: Path, fork: Path
) -> None:
    # Like 0.5.23 seen from Python 3.10: only other interpreters' wheels exist.
    del index.files[WHEEL], index.files[OTHER_WHEEL], index.files[SDIST]
    platform_meta = {
        **META,
        f"{DIST}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
        b"Tag: cp399-cp399-manylinux_2_34_x86_64\n",
    }
    only = "sglang-0.5.9-cp399-cp399-manylinux_2_34_x86_64.whl"
    index.publish({only: wheel_bytes(tmp_path, {**SOURCES, **platform_meta})})
    assert upstream_pypi.available_versions() == ()  # pip hides it from this interpreter
    assert available_versions() == ["0.5.9"]  # the index's own list does not
    assert main(["-C", str(fork), "import", "latest"]) == 0
    locked = lock.read(fork / "vendor" / "sglang.lock")
    assert locked is not None
    assert locked.tree_from == only
    assert locked.license_from == f"{only}:{DIST}/licenses/LICENSE"
    assert download_locked_wheel(locked, tmp_path / "dl").name == only


def test_late_upload_is_accepted_but_unlisted_files_are_not(
    index: Index, tmp_path: Path, fork: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["-C", str(fork), "import", "0.5.9"]) == 0
    # The release gains a wheel after it was locked: the index vouches for it.
    late = "sglang-0.5.9-cp399-cp399-manylinux_2_34_x86_64.whl"
    index.publish({late: b"late upload"})
    assert main(["-C", str(fork), "import", "0.5.9"]) == 0
    locked = lock.read(fork / "vendor" / "sglang.lock")
    assert locked is not None
    assert locked.artifact(late) == lock.Artifact(late, sha(b"late upload"), None)

    # Without the index's list nothing vouches for a file the lock lacks.
    from sm120fork.upstream import index as upstream_index

    monkeypatch.setattr(upstream_index, "project_files", lambda: None)
    pinned = dataclasses.replace(locked, artifacts=(locked.artifact(SDIST),))  # type: ignore[arg-type]
    with pytest.raises(FatalError, match=f"downloaded {WHEEL}, which the lock .* does not list"):
        fetch_release("0.5.9", workdir=tmp_path / "work", locked=pinned)
    # ... and a file it has is checked and kept, with what the lock already knew.
    # (No sdist now: pip would build the fake one to prepare its metadata.)
    del index.files[SDIST]
    index.publish({})
    release = fetch_release("0.5.9", workdir=tmp_path / "work2", locked=locked)
    assert release.artifacts == locked.artifacts
    assert release.license_from == f"{WHEEL}:{DIST}/licenses/LICENSE"


def test_failed_swap_leaves_vendor_untouched(
    index: Index, fork: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["-C", str(fork), "import", "0.5.9"]) == 0
    (fork / "vendor" / "sglang" / "python" / "sglang" / "local.py").write_text("x\n")
    before = snapshot(fork)
    real_rename = Path.rename
    failed: list[Path] = []

    def failing_rename(self: Path, target: str | os.PathLike[str]) -> Path:
        # the new lock's move into place, the last, after the old one moved aside
        if Path(target) == fork / "vendor" / "sglang.lock" and not failed:
            failed.append(self)
            raise PermissionError(13, "Permission denied")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    monkeypatch.setenv(lock.DATE_ENV, "2026-03-04")
    assert main(["-C", str(fork), "import", "0.5.9"]) == 2
    assert "it was left as it was" in capsys.readouterr().err
    assert snapshot(fork) == before
    assert failed and failed[0].parent != fork / "vendor"  # it failed where meant to
