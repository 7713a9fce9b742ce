"""`sm120fork wheel` on synthetic upstream wheels: contents, metadata, RECORD,
reproducibility, installation, and refusals that leave dist/ as it was."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest
from forkrepo import edit, make_patch, write_manifest
from sm120fork.cli import main
from wheelrepo import (
    FORK,
    INIT,
    PACKAGE_TEXT,
    SA,
    SCRIPT,
    SO,
    UT,
    make_venv,
    make_wheel_repo,
    pip_into,
    site_packages,
    snapshot,
    verify_record,
    wheel_entries,
    write_wheel,
)

FORK_WHEEL = f"sglang-{FORK}-py3-none-any.whl"
DIST_INFO = f"sglang-{FORK}.dist-info"
AFTER_FIRST = {**PACKAGE_TEXT, SA: edit(PACKAGE_TEXT[SA], "line 10\n", "line ten\n")}
FIRST = make_patch("Enable SM120 in server args", PACKAGE_TEXT, {SA: AFTER_FIRST[SA]})
SECOND = make_patch(
    "Report SM120 support",
    AFTER_FIRST,
    {
        SA: edit(AFTER_FIRST[SA], "line 30\n", "line thirty\n"),
        UT: edit(PACKAGE_TEXT[UT], "return False", "return True"),
    },
)
NEW_FILE = "python/sglang/srt/sm120.py"
ADD_AND_DELETE = make_patch(
    "Add an SM120 module and drop the version file", PACKAGE_TEXT, {NEW_FILE: "SM = 120\n"}
) + (
    f"diff --git a/{INIT} b/{INIT}\ndeleted file mode 100644\n--- a/{INIT}\n+++ /dev/null\n"
    f"@@ -1 +0,0 @@\n-{PACKAGE_TEXT[INIT]}"
)
PATCHES = {"0001-first.patch": FIRST, "0002-second.patch": SECOND}


def build(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["-C", str(root), "wheel", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def built(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> Path:
    code, out, err = build(root, capsys, *args)
    assert code == 0, err
    return Path(out.splitlines()[-1])


def members(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_builds_the_fork_wheel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_wheel_repo(tmp_path, PATCHES)
    wheel = built(root, capsys)
    assert wheel == root / "dist" / FORK_WHEEL
    assert sorted(p.name for p in (root / "dist").iterdir()) == [FORK_WHEEL]
    got = members(wheel)
    assert list(got)[-1] == f"{DIST_INFO}/RECORD"
    assert not [n for n in got if n.startswith("sglang-0.5.9.")]  # all renamed
    assert f"sglang-{FORK}.data/scripts/sglang-tool" in got
    metadata = got[f"{DIST_INFO}/METADATA"].decode()
    assert f"\nVersion: {FORK}\n" in metadata
    assert "Name: sglang\n" in metadata
    assert got["sglang/srt/server_args.py"].decode().count("line ten\n") == 1
    assert b"return True" in got["sglang/srt/utils.py"]
    assert verify_record(wheel) == []


def test_unchanged_members_are_upstreams_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path, PATCHES)
    wheel = built(root, capsys)
    upstream = wheel_entries()
    with zipfile.ZipFile(wheel) as fork, zipfile.ZipFile(root / "wheels" / upstream_name()) as up:
        for name, entry in upstream.items():
            new_name = name.replace("sglang-0.5.9.", f"sglang-{FORK}.")
            info = fork.getinfo(new_name)
            mode = info.external_attr >> 16
            assert bool(mode & 0o111) == entry.executable, name
            if name.endswith(("METADATA", "server_args.py", "utils.py")):
                continue
            assert fork.read(new_name) == entry.data, name
            # copied record for record: same compressed bytes, CRC and timestamp
            old = up.getinfo(name)
            assert (info.CRC, info.compress_size, info.date_time) == (
                old.CRC,
                old.compress_size,
                old.date_time,
            )


def upstream_name() -> str:
    return "sglang-0.5.9-py3-none-any.whl"


def test_patches_are_listed_in_metadata_and_dist_info(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path, PATCHES)
    got = members(built(root, capsys))
    metadata = got[f"{DIST_INFO}/METADATA"].decode()
    summary = next(line for line in metadata.splitlines() if line.startswith("Summary:"))
    assert summary == (
        "Summary: SGLang is a fast serving framework. "
        f"[sm120 fork {FORK}: 2 patches: 0001-first, 0002-second]"
    )
    body = metadata.partition("\n\n")[2]
    assert body.startswith("# SGLang\n\nUpstream's long description.\n\n## sm120 fork\n")
    assert "1. `0001-first.patch`: Enable SM120 in server args\n" in body
    assert "2. `0002-second.patch`: Report SM120 support\n" in body
    listing = json.loads(got[f"{DIST_INFO}/sm120-patches.json"])
    assert listing["version"] == FORK
    assert listing["upstream"]["wheel"] == upstream_name()
    assert [(p["name"], p["subject"]) for p in listing["patches"]] == [
        ("0001-first.patch", "Enable SM120 in server args"),
        ("0002-second.patch", "Report SM120 support"),
    ]


def test_two_builds_are_byte_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_wheel_repo(tmp_path, PATCHES)
    first = built(root, capsys).read_bytes()
    (root / "dist" / FORK_WHEEL).unlink()
    (root / "patches" / "series").touch()  # mtimes do not matter
    assert built(root, capsys).read_bytes() == first
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    moved = built(root, capsys)
    assert moved.read_bytes() != first  # rewritten members take the given time
    with zipfile.ZipFile(moved) as archive:
        assert archive.getinfo(f"{DIST_INFO}/RECORD").date_time == (2023, 11, 14, 22, 13, 20)
        assert archive.getinfo("sglang/srt/utils.py").date_time == (2023, 11, 14, 22, 13, 20)
        assert archive.getinfo(f"{DIST_INFO}/WHEEL").date_time == (2026, 2, 23, 8, 13, 52)


def test_files_added_and_deleted_by_the_series(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path, {"0001-add-delete.patch": ADD_AND_DELETE})
    wheel = built(root, capsys)
    got = members(wheel)
    assert got["sglang/srt/sm120.py"] == b"SM = 120\n"
    assert "sglang/__init__.py" not in got
    names = list(got)
    assert names.index("sglang/srt/sm120.py") < names.index(f"{DIST_INFO}/METADATA")
    assert verify_record(wheel) == []


def test_empty_series_still_renames_and_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path, {})
    got = members(built(root, capsys))
    assert "[sm120 fork 0.5.9+sm120.1: no patches]" in got[f"{DIST_INFO}/METADATA"].decode()
    assert json.loads(got[f"{DIST_INFO}/sm120-patches.json"])["patches"] == []


def test_installs_into_a_fresh_venv_as_vendor_plus_series(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path / "repo", {**PATCHES, "0003-add.patch": ADD_AND_DELETE})
    wheel = built(root, capsys)
    assert main(["-C", str(root), "apply", "--out", str(tmp_path / "applied")]) == 0
    python = make_venv(tmp_path / "venv")
    pip_into(python, "install", "--no-deps", "--no-compile", "--quiet", str(wheel))
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert version.stdout.strip() == FORK
    installed = snapshot(site_packages(python) / "sglang")
    expected = snapshot(tmp_path / "applied" / "python" / "sglang")
    binaries = {SO.removeprefix("sglang/"): wheel_entries()[SO].data}
    assert installed == {**expected, **binaries}
    shown = pip_into(python, "show", "-v", "sglang").stdout
    assert f"Version: {FORK}\n" in shown
    assert "2 patches" not in shown and "3 patches: 0001-first, 0002-second, 0003-add]" in shown
    assert (python.parent / "sglang-tool").is_file()


# --- which upstream wheels ---


def other_tag() -> str:
    return "cp27-cp27m-win32"  # no interpreter running these tests can install it


def this_tag() -> str:
    from packaging.tags import sys_tags

    tag = next(iter(sys_tags()))
    return f"{tag.interpreter}-{tag.abi}-{tag.platform}"


def test_default_builds_the_wheel_this_python_installs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path, PATCHES, tags=(other_tag(), this_tag()))
    wheel = built(root, capsys)
    assert wheel.name == f"sglang-{FORK}-{this_tag()}.whl"
    assert [p.name for p in (root / "dist").iterdir()] == [wheel.name]
    with zipfile.ZipFile(wheel) as archive:
        assert f"Tag: {this_tag()}\n" in archive.read(f"sglang-{FORK}.dist-info/WHEEL").decode()


def test_all_builds_one_per_upstream_wheel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path, PATCHES, tags=(other_tag(), this_tag()))
    code, out, _ = build(root, capsys, "--all")
    assert code == 0
    expected = sorted(f"sglang-{FORK}-{tag}.whl" for tag in (other_tag(), this_tag()))
    assert sorted(Path(line).name for line in out.splitlines()) == expected
    assert sorted(p.name for p in (root / "dist").iterdir()) == expected


def test_the_only_wheel_is_built_even_for_another_python(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path, PATCHES, tags=(other_tag(),))
    assert built(root, capsys).name == f"sglang-{FORK}-{other_tag()}.whl"


def test_artifact_picks_one_wheel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_wheel_repo(tmp_path, PATCHES, tags=(other_tag(), this_tag()))
    wheel = built(root, capsys, "--artifact", f"sglang-0.5.9-{other_tag()}.whl")
    assert wheel.name == f"sglang-{FORK}-{other_tag()}.whl"


# --- refusals: one line, non-zero exit, dist/ untouched ---


def refused(root: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    (root / "dist").mkdir(exist_ok=True)
    (root / "dist" / "keep.txt").write_text("an earlier build\n")
    before = snapshot(root / "dist"), top_level(root)
    code, out, err = build(root, capsys, *args)
    assert code == 2
    assert out == ""
    last = err.splitlines()[-1]
    assert last.startswith("sm120fork wheel: error: ")
    assert [line for line in err.splitlines() if "error" in line] == [last]
    assert (snapshot(root / "dist"), top_level(root)) == before
    return last


def top_level(root: Path) -> list[str]:
    """What lies in the repo root, except build/ (the download cache may appear there)."""
    return sorted(p.name for p in root.iterdir() if p.name != "build")


def test_cached_wheel_with_wrong_hash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_wheel_repo(tmp_path, PATCHES)
    cached = root / "build" / "wheel" / "cache" / upstream_name()
    cached.write_bytes(cached.read_bytes() + b"\0")
    message = refused(root, capsys)
    assert "has sha256" in message and "but vendor/sglang.lock pins" in message
    assert "delete it" in message


def test_patch_that_does_not_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = make_patch(
        "Stale change", PACKAGE_TEXT, {SA: edit(PACKAGE_TEXT[SA], "line 10\n", "line 10!\n")}
    ).replace(" line 9\n", " line nine\n")
    root = make_wheel_repo(tmp_path, {"0001-first.patch": FIRST, "0002-stale.patch": stale})
    message = refused(root, capsys)
    assert "0002-stale.patch does not apply to sglang-0.5.9-py3-none-any.whl" in message
    assert "sm120fork check" in message


@pytest.mark.parametrize("edit_file", [UT, INIT, "python/sglang/srt/added.py"])
def test_vendor_differs_from_its_lock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit_file: str
) -> None:
    # Also a file the series does not touch, or a new one: the series was checked
    # against the whole tree.
    root = make_wheel_repo(tmp_path, PATCHES)
    (root / "vendor" / "sglang" / edit_file).write_text("# edited by hand\n")
    message = refused(root, capsys)
    assert f"error: vendor/sglang/{edit_file}: " in message
    assert "the wheel would carry a series checked against another tree" in message
    assert "sm120fork check" in message


def test_vendor_differs_from_the_wheel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The manifest re-written to agree with the edit: the wheel's own member still differs.
    root = make_wheel_repo(tmp_path, PATCHES)
    (root / "vendor" / "sglang" / UT).write_text("def is_sm120_supported():\n    return False\n#\n")
    write_manifest(root)
    message = refused(root, capsys)
    assert "sglang/srt/utils.py in sglang-0.5.9-py3-none-any.whl differs from vendor" in message


def test_lock_without_wheels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_wheel_repo(tmp_path, PATCHES)
    lock = root / "vendor" / "sglang.lock"
    text = lock.read_text()
    lock.write_text(text[: text.index('[[artifacts]]\nfile = "sglang-0.5.9-py3')])
    message = refused(root, capsys)
    assert "records no wheel of sglang 0.5.9" in message


def test_unknown_artifact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_wheel_repo(tmp_path, PATCHES)
    message = refused(root, capsys, "--artifact", "sglang-0.5.9-cp99-cp99-any.whl")
    assert "lists no wheel sglang-0.5.9-cp99-cp99-any.whl" in message


def test_no_wheel_fits_and_several_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path, PATCHES, tags=(other_tag(), "cp27-cp27m-win_amd64"))
    assert "pass --all" in refused(root, capsys)


def test_changelog_for_another_upstream(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    changelog = "# Changelog\n\n## 0.5.8+sm120.3 - 2026-10-01\n"
    root = make_wheel_repo(tmp_path, PATCHES, changelog=changelog)
    assert "add a CHANGELOG entry for 0.5.9+sm120.1" in refused(root, capsys)


def test_upstream_member_not_matching_its_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path, PATCHES)
    entries = wheel_entries()
    good = write_wheel(tmp_path / "good.whl", entries)
    with zipfile.ZipFile(good) as archive:
        record = archive.read("sglang-0.5.9.dist-info/RECORD")
    entries[SO] = type(entries[SO])(entries[SO].data + b"tampered", executable=True)
    bad = write_wheel(root / "build" / "wheel" / "cache" / upstream_name(), entries, record=record)
    relock(root, bad)
    assert f"member {SO} does not match its RECORD" in refused(root, capsys)


def test_patch_outside_the_package(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outside = make_patch("Build tweak", {}, {"python/pyproject.toml": "[project]\n"})
    root = make_wheel_repo(tmp_path, {"0001-outside.patch": outside})
    assert "python/pyproject.toml, which is outside python/sglang/" in refused(root, capsys)


def test_failure_on_the_second_wheel_builds_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path, PATCHES, tags=(other_tag(), this_tag()))
    cached = root / "build" / "wheel" / "cache" / f"sglang-0.5.9-{this_tag()}.whl"
    cached.write_bytes(b"not a wheel")
    refused(root, capsys, "--all")
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]


def test_dist_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_wheel_repo(tmp_path, PATCHES)
    (root / "dist").write_text("not a directory\n")
    code, _, err = build(root, capsys)
    assert code == 2
    assert err.splitlines()[-1].startswith(f"sm120fork wheel: error: cannot write {root / 'dist'}")
    assert (root / "dist").read_text() == "not a directory\n"
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]


def relock(root: Path, wheel: Path) -> None:
    """Point the lock's entry for `wheel` at its current bytes."""
    import hashlib

    lock = root / "vendor" / "sglang.lock"
    text = lock.read_text()
    start = text.index(f'file = "{wheel.name}"')
    old = text[start:].split("sha256 = ", 1)[1][1:65]
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    lock.write_text(text.replace(old, digest, 1))


# --- download through pip (offline: a find-links directory stands in for the index) ---


@pytest.fixture
def offline_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


def test_downloads_the_locked_wheel_through_pip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], offline_pip: Path
) -> None:
    root = make_wheel_repo(tmp_path / "repo", PATCHES, cached=False)
    (offline_pip / upstream_name()).write_bytes((root / "wheels" / upstream_name()).read_bytes())
    assert built(root, capsys).name == FORK_WHEEL
    assert (root / "build" / "wheel" / "cache" / upstream_name()).is_file()


def test_download_with_wrong_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], offline_pip: Path
) -> None:
    root = make_wheel_repo(tmp_path / "repo", PATCHES, cached=False)
    entries = wheel_entries()
    entries[SCRIPT] = type(entries[SCRIPT])(b"#!python\nprint('other')\n", executable=True)
    write_wheel(offline_pip / upstream_name(), entries)
    message = refused(root, capsys)
    assert "sha256" in message and "lock pins" in message
    assert not (root / "build" / "wheel" / "cache" / upstream_name()).exists()


def test_download_of_a_missing_wheel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], offline_pip: Path
) -> None:
    root = make_wheel_repo(tmp_path / "repo", PATCHES, cached=False)
    assert "cannot get sglang-0.5.9-py3-none-any.whl through pip" in refused(root, capsys)
    cache = root / "build" / "wheel" / "cache"
    assert not list(cache.iterdir())


def test_the_wheel_is_a_normal_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Copied into an image and installed by another user: 0644 under umask 022, not 0600.
    root = make_wheel_repo(tmp_path, PATCHES)
    old = os.umask(0o022)
    try:
        wheel = built(root, capsys)
    finally:
        os.umask(old)
    assert stat.S_IMODE(wheel.stat().st_mode) == 0o644
