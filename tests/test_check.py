"""`sm120fork check`: one scenario per kind of finding, on small real trees."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from forkrepo import BASE_FILES, edit, make_fork, make_patch
from hermetic import git
from sm120fork.cli import main

SA = "python/sglang/srt/server_args.py"
UT = "python/sglang/srt/utils.py"

FIRST = make_patch(
    "first change", BASE_FILES, {SA: edit(BASE_FILES[SA], "line 10\n", "line ten\n")}
)
# The second patch is made against the tree with the first applied.
AFTER_FIRST = {**BASE_FILES, SA: edit(BASE_FILES[SA], "line 10\n", "line ten\n")}
SECOND = make_patch(
    "second change",
    AFTER_FIRST,
    {
        SA: edit(AFTER_FIRST[SA], "line 30\n", "line thirty\n"),
        UT: edit(BASE_FILES[UT], "return False", "return True"),
    },
)


def run_check(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(["-C", str(root), "check"])
    out = capsys.readouterr().out
    return code, [line for line in out.splitlines() if line]


def test_clean_series_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_fork(tmp_path, {"0001-first.patch": FIRST, "0002-second.patch": SECOND})
    code, lines = run_check(tmp_path, capsys)
    assert code == 0, lines
    assert lines == [
        "series clean: vendor/sglang is sglang 0.5.9 as imported (2 files); "
        "2 patches apply exactly to it, all in normal form"
    ]


def test_series_comments_blank_lines_and_strip_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    series = "# SM120 series\n\n0001-first.patch -p1  # the first\n0002-second.patch\n"
    make_fork(tmp_path, {"0001-first.patch": FIRST, "0002-second.patch": SECOND}, series=series)
    assert run_check(tmp_path, capsys)[0] == 0


Mutation = Callable[[Path], object]


def _series(text: str) -> Mutation:
    return lambda root: (root / "patches" / "series").write_text(text)


def _patch_text(name: str, old: str, new: str) -> Mutation:
    def mutate(root: Path) -> None:
        path = root / "patches" / name
        path.write_text(edit(path.read_text(), old, new))

    return mutate


def _patch_bytes(name: str, data: bytes) -> Mutation:
    return lambda root: (root / "patches" / name).write_bytes(data)


def _vendor_edit(path: str, old: str, new: str) -> Mutation:
    def mutate(root: Path) -> None:
        target = root / "vendor" / "sglang" / path
        target.write_text(edit(target.read_text(), old, new))

    return mutate


BROKEN: dict[str, tuple[Mutation, str, str]] = {
    # name: (mutation, where, expected message fragment)
    "entry-without-file": (
        _series("0001-first.patch\n0002-second.patch\n0003-missing.patch\n"),
        "patches/series:3",
        "0003-missing.patch is listed but has no file",
    ),
    "file-not-in-series": (
        _series("0001-first.patch\n"),
        "patches/0002-second.patch:1",
        "not in patches/series",
    ),
    "duplicate-entry": (
        _series("0001-first.patch\n0002-second.patch\n0001-first.patch\n"),
        "patches/series:3",
        "duplicate entry 0001-first.patch",
    ),
    "malformed-option": (
        _series("0001-first.patch -R\n0002-second.patch\n"),
        "patches/series:1",
        "unsupported option '-R'",
    ),
    "entry-escaping-patches-dir": (
        _series("../0001-first.patch\n0002-second.patch\n"),
        "patches/series:1",
        "not a plain file name",
    ),
    "missing-origin": (
        _patch_text("0001-first.patch", "Origin: vendor\n", ""),
        "patches/0001-first.patch:1",
        "missing DEP-3 Origin",
    ),
    "missing-forwarded": (
        _patch_text("0001-first.patch", "Forwarded: no\n", ""),
        "patches/0001-first.patch:1",
        "missing DEP-3 Forwarded",
    ),
    "missing-author": (
        _patch_text("0001-first.patch", "From: Test Maintainer <test@example.com>\n", ""),
        "patches/0001-first.patch:1",
        "missing DEP-3 Author",
    ),
    "missing-subject": (
        _patch_text("0001-first.patch", "Subject: [PATCH] first change\n", ""),
        "patches/0001-first.patch:1",
        "missing DEP-3 Description",
    ),
    "missing-description-paragraph": (
        _patch_text("0001-first.patch", "first change, because a test needs it.\n", ""),
        "patches/0001-first.patch:2",
        "missing description paragraph",
    ),
    "bad-last-update": (
        _patch_text("0001-first.patch", "Last-Update: 2026-11-29", "Last-Update: 2026-13-45"),
        "patches/0001-first.patch:9",
        "not a YYYY-MM-DD date",
    ),
    "bug-not-a-url": (
        _patch_text(
            "0001-first.patch", "Bug: https://github.com/sgl-project/sglang/issues/1", "Bug: #1"
        ),
        "patches/0001-first.patch:7",
        "DEP-3 Bug must be a URL",
    ),
    "bad-forwarded": (
        _patch_text("0001-first.patch", "Forwarded: no", "Forwarded: maybe"),
        "patches/0001-first.patch:8",
        "must be no, not-needed or a URL",
    ),
    "context-mismatch": (
        _vendor_edit(SA, "line 9\n", "line nine\n"),
        "patches/0001-first.patch:14",
        "does not apply exactly",
    ),
    "applies-only-with-offset": (
        _vendor_edit(SA, "line 1\n", "line 0\nline 1\n"),
        "patches/0001-first.patch:14",
        "applies only at offset +1 lines",
    ),
    "file-missing-upstream": (
        lambda root: (root / "vendor" / "sglang" / UT).unlink(),
        "patches/0002-second.patch",
        "does not exist upstream",
    ),
    "not-normal-form-index-line": (
        _patch_text("0001-first.patch", "--- a/", "index 1234567..89abcde 100644\n--- a/"),
        "patches/0001-first.patch",
        "is not in normal form",
    ),
    "not-normal-form-diffstat": (
        _patch_text("0001-first.patch", "---\ndiff", "---\n server_args.py | 2 +-\ndiff"),
        "patches/0001-first.patch",
        "is not in normal form",
    ),
    "not-normal-form-context": (
        _patch_text("0001-first.patch", "@@ -7,7 +7,7 @@", "@@ -7,7 +7,7 @@ def f():"),
        "patches/0001-first.patch",
        "is not in normal form",
    ),
    "crlf-patch": (
        lambda root: (root / "patches" / "0001-first.patch").write_bytes(
            FIRST.replace("\n", "\r\n").encode()
        ),
        "patches/0001-first.patch:1",
        "CRLF line endings",
    ),
    "non-utf8-patch": (
        _patch_bytes("0001-first.patch", FIRST.encode().replace(b"Test", b"T\xe9st")),
        "patches/0001-first.patch:1",
        "is not UTF-8",
    ),
    "empty-patch": (
        _patch_bytes("0001-first.patch", b""),
        "patches/0001-first.patch:1",
        "is empty",
    ),
    "binary-patch": (
        _patch_text("0001-first.patch", "--- a/", "GIT binary patch\nliteral 0\n--- a/"),
        "patches/0001-first.patch",
        "binary patches are not supported",
    ),
    "absolute-path": (
        _patch_text("0001-first.patch", "--- a/python", "--- /python"),
        "patches/0001-first.patch",
        "is absolute",
    ),
    "dotdot-path": (
        _patch_text("0001-first.patch", "+++ b/python", "+++ b/../python"),
        "patches/0001-first.patch",
        "leaves the tree",
    ),
    "truncated-hunk": (
        _patch_text("0001-first.patch", " line 13\n", ""),
        "patches/0001-first.patch",
        "the patch is truncated",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_broken_case_is_named(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fork(tmp_path, {"0001-first.patch": FIRST, "0002-second.patch": SECOND})
    mutate, where, fragment = BROKEN[case]
    mutate(tmp_path)
    code, lines = run_check(tmp_path, capsys)
    assert code == 1
    assert any(line.startswith(where) and fragment in line for line in lines), lines


def test_overlapping_hunks_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = BASE_FILES[SA]
    patch = make_patch(
        "two hunks",
        BASE_FILES,
        {SA: edit(edit(base, "line 5\n", "five\n"), "line 30\n", "thirty\n")},
    )
    # Move the second hunk's header to start inside the first hunk.
    patch = patch.replace("@@ -27,7 +27,7 @@", "@@ -6,7 +6,7 @@")
    make_fork(tmp_path, {"0001-two.patch": patch})
    code, lines = run_check(tmp_path, capsys)
    assert code == 1
    assert any("overlaps the previous hunk" in line for line in lines), lines


def test_all_findings_are_listed_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fork(tmp_path, {"0001-first.patch": FIRST, "0002-second.patch": SECOND})
    _series("0002-second.patch\n0003-missing.patch\n")(tmp_path)
    _patch_text("0002-second.patch", "Origin: vendor\n", "")(tmp_path)
    code, lines = run_check(tmp_path, capsys)
    assert code == 1
    assert len(lines) >= 3, lines  # unlisted first, missing third, no Origin, and no longer applies


def test_refresh_brings_patches_to_normal_form_and_is_idempotent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fork(tmp_path, {"0001-first.patch": FIRST, "0002-second.patch": SECOND})
    _patch_text("0001-first.patch", "--- a/", "index 1234567..89abcde 100644\n--- a/")(tmp_path)
    assert run_check(tmp_path, capsys)[0] == 1
    assert main(["-C", str(tmp_path), "refresh"]) == 0
    assert (tmp_path / "patches" / "0001-first.patch").read_text() == FIRST
    assert run_check(tmp_path, capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "patches").iterdir()}
    assert main(["-C", str(tmp_path), "refresh"]) == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "patches").iterdir()} == before


def test_refresh_of_a_broken_series_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fork(tmp_path, {"0001-first.patch": FIRST, "0002-second.patch": SECOND})
    _vendor_edit(UT, "return False", "return None")(tmp_path)
    _patch_text("0001-first.patch", "--- a/", "index 1234567..89abcde 100644\n--- a/")(tmp_path)
    before = {p.name: p.read_bytes() for p in (tmp_path / "patches").iterdir()}
    assert main(["-C", str(tmp_path), "refresh"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match" in err[0]
    assert {p.name: p.read_bytes() for p in (tmp_path / "patches").iterdir()} == before


def test_apply_writes_the_patched_tree(tmp_path: Path) -> None:
    make_fork(tmp_path, {"0001-first.patch": FIRST, "0002-second.patch": SECOND})
    out = tmp_path / "out"
    assert main(["-C", str(tmp_path), "apply", "--out", str(out)]) == 0
    assert "line ten\n" in (out / SA).read_text()
    assert "line thirty\n" in (out / SA).read_text()
    assert "return True" in (out / UT).read_text()
    assert (tmp_path / "vendor" / "sglang" / UT).read_text() == BASE_FILES[UT]


@pytest.mark.skipif(shutil.which("quilt") is None, reason="GNU quilt is not installed")
def test_series_applies_with_quilt_without_offset_or_fuzz(tmp_path: Path) -> None:
    make_fork(tmp_path, {"0001-first.patch": FIRST, "0002-second.patch": SECOND})
    work = tmp_path / "work"
    shutil.copytree(tmp_path / "vendor" / "sglang", work)
    env = {**os.environ, "QUILT_PATCHES": str(tmp_path / "patches"), "QUILTRC": "/dev/null"}
    result = subprocess.run(
        ["quilt", "push", "-a"], cwd=work, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "offset" not in result.stdout and "fuzz" not in result.stdout, result.stdout


def test_patches_are_git_am_able_on_upstream_layout(tmp_path: Path) -> None:
    make_fork(tmp_path, {"0001-first.patch": FIRST, "0002-second.patch": SECOND})
    upstream = tmp_path / "upstream"
    shutil.copytree(tmp_path / "vendor" / "sglang", upstream)
    git("init", "-q", ".", cwd=upstream)
    git("add", "-A", cwd=upstream)
    git("commit", "-qm", "base", cwd=upstream)
    for name in ("0001-first.patch", "0002-second.patch"):
        git("am", str(tmp_path / "patches" / name), cwd=upstream)
    log = git("log", "--format=%an|%s", "-2", cwd=upstream).stdout.splitlines()
    assert log == ["Test Maintainer|second change", "Test Maintainer|first change"]
