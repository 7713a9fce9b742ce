"""vendor/sglang against vendor/sglang.sha256: written by `import`, checked by `check`
(a finding per file, saying how to restore it), refused by `apply` and the wheel."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import MakeUpstreamRepo
from forkrepo import BASE_FILES, make_fork
from sm120fork.cli import main
from sm120fork.errors import FatalError
from sm120fork.upstream import manifest

SA = "python/sglang/srt/server_args.py"
UT = "python/sglang/srt/utils.py"
TREE = "vendor/sglang"
REIMPORT = "`sm120fork import 0.5.9`"


def check(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(["-C", str(root), "check"])
    captured = capsys.readouterr()
    return code, [line for line in (captured.out + captured.err).splitlines() if line]


def test_import_writes_the_manifest_of_what_it_verified(
    tmp_path: Path, make_upstream_git_repo: MakeUpstreamRepo
) -> None:
    upstream = make_upstream_git_repo(tmp_path, {"v0.5.9": BASE_FILES})
    fork = tmp_path / "fork"
    fork.mkdir()
    assert main(["-C", str(fork), "import", "0.5.9", "--upstream-git", upstream.as_uri()]) == 0
    written = manifest.read(fork / "vendor" / "sglang.sha256")
    assert written is not None and written.version == "0.5.9"
    assert [path for path, _ in written.files] == ["LICENSE", SA, UT]
    assert written.hashes()[SA] == manifest.sha256_hex(BASE_FILES[SA].encode())
    assert manifest.verify(fork / TREE, written) == []


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="GNU coreutils is not installed")
def test_sha256sum_checks_the_manifest_by_hand(tmp_path: Path) -> None:
    make_fork(tmp_path)
    command = ["sha256sum", "--check", "--strict", "--quiet", "../sglang.sha256"]
    assert subprocess.run(command, cwd=tmp_path / TREE, check=False).returncode == 0
    (tmp_path / TREE / UT).write_text("edited\n")
    assert subprocess.run(command, cwd=tmp_path / TREE, capture_output=True).returncode == 1


def test_a_hand_edit_anywhere_in_the_tree_is_a_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fork(tmp_path)  # an empty series: the files are touched by no patch
    (tmp_path / TREE / SA).write_text(BASE_FILES[SA] + "edited = True\n")
    (tmp_path / TREE / UT).unlink()
    (tmp_path / TREE / "python/sglang/new.py").write_text("x = 1\n")
    (tmp_path / TREE / "python/sglang/link.py").symlink_to("new.py")
    code, lines = check(tmp_path, capsys)
    assert code == 1
    assert lines == [
        f"{TREE}/python/sglang/link.py: is a link or special file, which sglang 0.5.9 does "
        f"not ship; delete it, then restore it with `git checkout -- {TREE}/python/sglang/"
        f"link.py` or re-vendor with {REIMPORT}",
        f"{TREE}/python/sglang/new.py: is not part of sglang 0.5.9; delete it; a new file "
        "goes in a patch",
        f"{TREE}/{SA}: differs from sglang 0.5.9 (its sha256 is not the one in the "
        f"manifest); vendor/ is never edited by hand: restore it with `git checkout -- "
        f"{TREE}/{SA}` or re-vendor with {REIMPORT}; changes go in a patch",
        f"{TREE}/{UT}: is missing (sglang 0.5.9 has it); restore it with `git checkout -- "
        f"{TREE}/{UT}` or re-vendor with {REIMPORT}",
        "4 findings",
    ]


def test_bytecode_caches_are_not_part_of_the_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fork(tmp_path)
    cache = tmp_path / TREE / "python/sglang/srt/__pycache__"
    cache.mkdir()
    (cache / "utils.cpython-311.pyc").write_bytes(b"\x00bytecode")
    assert check(tmp_path, capsys)[0] == 0


def test_many_differences_are_named_then_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fork(tmp_path)
    for n in range(25):
        (tmp_path / TREE / f"python/sglang/extra_{n:02}.py").write_text(f"x = {n}\n")
    code, lines = check(tmp_path, capsys)
    assert code == 1
    assert len(lines) == 22 and lines[-1] == "21 findings"
    assert lines[-2] == (
        f"{TREE}: and 5 more files differ from vendor/sglang.sha256 (5 added); "
        f"re-vendor with {REIMPORT}"
    )


def test_no_manifest_or_one_for_another_release(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fork(tmp_path)
    text = (tmp_path / "vendor/sglang.sha256").read_text()
    (tmp_path / "vendor/sglang.sha256").unlink()
    assert check(tmp_path, capsys) == (
        1,
        [
            "vendor/sglang.sha256: does not exist, so nothing says vendor/sglang is "
            "upstream's release; re-vendor with `sm120fork import VERSION`",
            "1 finding",
        ],
    )
    (tmp_path / "vendor/sglang.sha256").write_text(text.replace("0.5.9", "0.5.8", 1))
    (tmp_path / "vendor/sglang.lock").write_text(_lock("0.5.9"))
    code, lines = check(tmp_path, capsys)
    assert (code, lines[0]) == (
        1,
        "vendor/sglang.sha256: is for sglang 0.5.8 but vendor/sglang.lock pins 0.5.9; "
        "re-vendor with `sm120fork import 0.5.9 --upstream-git file:///upstream`",
    )


def _lock(version: str) -> str:
    return (
        f'version = "{version}"\ntag = "v{version}"\nsource = "git"\nurl = "file:///upstream"\n'
        f'commit = "{"a" * 40}"\nimported = "2026-11-29"\ntree_from = "{"a" * 40}"\n'
        f'license_from = "{"a" * 40}:LICENSE"\n'
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", ":1: no `# sglang VERSION: ...` header"),
        ("# sglang 0.5.9: x\n", "lists no file"),
        ("# sglang 0.5.9: x\nnot a line\n", ":2: not a sha256sum line"),
        (f"# sglang 0.5.9: x\n{'A' * 64}  LICENSE\n", ":2: not a sha256sum line"),
        (f"# sglang 0.5.9: x\n{'a' * 64}  LICENSE\n{'b' * 64}  LICENSE\n", "listed twice"),
        (f"# sglang 0.5.9: x\n{'a' * 64}  python/../../x\n", "cannot be named"),
    ],
)
def test_malformed_manifest(text: str, message: str) -> None:
    with pytest.raises(FatalError, match=message):
        manifest.loads(text, "vendor/sglang.sha256")


def test_apply_refuses_a_tree_that_is_not_upstreams(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fork(tmp_path)
    (tmp_path / TREE / SA).write_text("edited\n")
    assert main(["-C", str(tmp_path), "apply", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"sm120fork apply: error: {TREE}/{SA}: differs from sglang 0.5.9 (its sha256 is not "
        "the one in the manifest); the patched tree would not be upstream's release plus the "
        "series: run `sm120fork check`, which lists every file and how to restore it"
    )
    assert not (tmp_path / "out").exists()
    # --tree names another tree on purpose: not the vendored one, not checked against it.
    other = tmp_path / "other"
    shutil.copytree(tmp_path / TREE, other)
    assert main(["-C", str(tmp_path), "apply", "--tree", str(other), "--out", "out"]) == 0
