"""The bad-input corpus: every command, fed broken input, fails in one clear line.

Each case breaks a committed fork repository in one way, runs the CLI as a
person would (a subprocess), and requires: a non-zero exit, the error named
on one line, no traceback, and the repository byte-identical to before the
command (the files and `git status`). The tally goes to
build/reliability/corpus.json; the README's reliability section quotes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
from forkrepo import edit
from hermetic import git
from rebasefork import BASE, SA, UT, RebaseFork, make_rebase_fork

PROJECT = Path(__file__).resolve().parents[1]
TALLY: dict[str, Outcome] = {}


@dataclass(frozen=True)
class Outcome:
    exit: int
    clear_error: bool
    traceback: bool
    changed_files: tuple[str, ...]


@dataclass(frozen=True)
class Case:
    command: tuple[str, ...]
    expect: str  # a fragment of the error line (or of a finding, for `check`)
    setup: Callable[[Path], object] = lambda root: None
    exit_code: int = 2
    env: tuple[tuple[str, str], ...] = ()
    outside: bool = False  # run from the directory above the fork, without -C


def _write(path: str, data: bytes | str) -> Callable[[Path], object]:
    def setup(root: Path) -> None:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)

    return setup


def _edit(path: str, old: str, new: str) -> Callable[[Path], object]:
    def setup(root: Path) -> None:
        target = root / path
        target.write_bytes(edit(target.read_text(), old, new).encode())

    return setup


def _both(*steps: Callable[[Path], object]) -> Callable[[Path], object]:
    def setup(root: Path) -> None:
        for step in steps:
            step(root)

    return setup


def _commit(message: str) -> Callable[[Path], object]:
    def setup(root: Path) -> None:
        git("commit", "-q", "-a", "-m", message, cwd=root)

    return setup


def _symlink_escape(root: Path) -> None:
    outside = root.parent / "outside"
    (outside / "srt").mkdir(parents=True, exist_ok=True)
    (outside / "srt" / "utils.py").write_text(BASE[UT])
    link = root / "vendor/sglang/python/sglang/escape"
    link.symlink_to(outside, target_is_directory=True)
    patch = (root / "patches/0001-gate.patch").read_text()
    (root / "patches/0001-gate.patch").write_text(
        patch.replace("python/sglang/srt/server_args.py", "python/sglang/escape/srt/utils.py")
    )


P1 = "patches/0001-gate.patch"
UNREACHABLE_INDEX = (
    ("PIP_INDEX_URL", "http://127.0.0.1:9/simple"),
    ("PIP_RETRIES", "0"),
    ("PIP_TIMEOUT", "2"),
    ("PIP_FIND_LINKS", ""),
    ("PIP_EXTRA_INDEX_URL", ""),
)

CASES: dict[str, Case] = {
    "series-malformed-line": Case(
        ("refresh",), "unsupported option '-R'", _write("patches/series", "0001-gate.patch -R\n")
    ),
    "series-entry-without-file": Case(
        ("refresh",), "has no file", _write("patches/series", "0001-gate.patch\nnope.patch\n")
    ),
    "series-duplicate-entry": Case(
        ("apply", "--out", "build/out"),
        "is listed twice",
        _write("patches/series", "0001-gate.patch\n0001-gate.patch\n"),
    ),
    "unlisted-patch": Case(
        ("check",), "not in patches/series", _write("patches/0002-x.patch", "x"), exit_code=1
    ),
    "patch-path-dotdot": Case(("refresh",), "leaves the tree", _edit(P1, "+++ b/", "+++ b/../")),
    "patch-path-absolute": Case(("refresh",), "is absolute", _edit(P1, "--- a/", "--- /")),
    "patch-path-through-symlink": Case(("refresh",), "outside", _symlink_escape),
    "binary-patch": Case(("refresh",), "binary", _edit(P1, "--- a/", "GIT binary patch\n--- a/")),
    "crlf-patch": Case(("refresh",), "CRLF", lambda root: _crlf(root / P1)),
    "non-utf8-patch": Case(("refresh",), "not UTF-8", lambda root: _latin1(root / P1)),
    "empty-patch": Case(("refresh",), "is empty", _write(P1, b"")),
    "patch-for-missing-file": Case(
        ("refresh",), "does not exist upstream", lambda root: _rename_target(root / P1)
    ),
    "overlapping-hunks": Case(("refresh",), "overlaps", lambda root: _overlap(root / P1)),
    "truncated-hunk": Case(("refresh",), "truncated", lambda root: _truncate(root / P1)),
    "malformed-dep3": Case(
        ("check",), "missing DEP-3 Origin", _edit(P1, "Origin: vendor\n", ""), exit_code=1
    ),
    "apply-out-inside-tree": Case(
        ("apply", "--out", "vendor/sglang/python/out"), "must be outside the tree"
    ),
    "unknown-version": Case(("rebase", "v0.5.99", "--upstream-git", "{url}"), "nearest releases"),
    "dirty-working-tree": Case(
        ("rebase", "v0.5.10", "--upstream-git", "{url}"),
        "uncommitted changes",
        _write("vendor/sglang/python/sglang/srt/utils.py", "tampered\n"),
    ),
    "continue-with-nothing-in-progress": Case(("rebase", "--continue"), "no rebase in progress"),
    "abort-with-nothing-in-progress": Case(("rebase", "--abort"), "no rebase in progress"),
    "lock-sha256-mismatch": Case(
        ("wheel",),
        "sha256",
        lambda root: _tamper_lock(root),
        env=UNREACHABLE_INDEX,
    ),
    "no-network-to-the-index": Case(("import", "0.5.9"), "index", env=UNREACHABLE_INDEX),
    "wheel-from-git-lock": Case(("wheel",), "git", env=UNREACHABLE_INDEX),
    "check-outside-the-checkout": Case(
        ("check",), "is not a fork checkout (it has no patches/series", outside=True
    ),
    # vendor/sglang is trusted only as far as vendor/sglang.sha256 vouches for it (#16)
    "vendor-hand-edit-check": Case(
        ("check",),
        f"vendor/sglang/{UT}: differs from sglang 0.5.9",
        _write(f"vendor/sglang/{UT}", BASE[UT] + "# edited by hand\n"),
        exit_code=1,
    ),
    "vendor-added-file-check": Case(
        ("check",),
        "vendor/sglang/python/sglang/extra.py: is not part of sglang 0.5.9",
        _write("vendor/sglang/python/sglang/extra.py", "x = 1\n"),
        exit_code=1,
    ),
    "vendor-deleted-file-check": Case(
        ("check",),
        f"vendor/sglang/{UT}: is missing",
        lambda root: (root / "vendor/sglang" / UT).unlink(),
        exit_code=1,
    ),
    "vendor-symlink-check": Case(
        ("check",),
        "vendor/sglang/python/sglang/link.py: is a link",
        lambda root: (root / "vendor/sglang/python/sglang/link.py").symlink_to("/etc/passwd"),
        exit_code=1,
    ),
    "vendor-hand-edit-wheel": Case(
        ("wheel",),
        "the wheel would carry a series checked against another tree",
        _write(f"vendor/sglang/{UT}", BASE[UT] + "# edited by hand\n"),
        env=UNREACHABLE_INDEX,
    ),
    "vendor-hand-edit-apply": Case(
        ("apply", "--out", "build/out"),
        "the patched tree would not be upstream's release plus the series",
        _write(f"vendor/sglang/{UT}", BASE[UT] + "# edited by hand\n"),
    ),
    "vendor-hand-edit-committed-rebase": Case(
        ("rebase", "v0.5.10", "--upstream-git", "{url}"),
        f"as imported, before a rebase, but vendor/sglang/{UT}: differs",
        _both(_write(f"vendor/sglang/{UT}", BASE[UT] + "# edited\n"), _commit("edit vendor/")),
    ),
    "manifest-missing": Case(
        ("check",),
        "vendor/sglang.sha256: does not exist",
        lambda root: (root / "vendor/sglang.sha256").unlink(),
        exit_code=1,
    ),
    "manifest-malformed": Case(
        ("check",), "not a sha256sum line", _edit("vendor/sglang.sha256", "  LICENSE", "")
    ),
    "lock-version-edited-by-hand": Case(
        ("check",),
        "is for sglang 0.5.9 but vendor/sglang.lock pins 0.5.10",
        _edit("vendor/sglang.lock", 'version = "0.5.9"', 'version = "0.5.10"'),
        exit_code=1,
    ),
    "rebase-onto-an-older-release": Case(
        ("rebase", "v0.5.8", "--upstream-git", "{url}"), "is older than the pinned 0.5.9"
    ),
    "rebase-state-damaged": Case(
        ("rebase", "--continue"),
        "is damaged",
        _write(".git/sm120fork-rebase/state.json", "{not json"),
    ),
}


def _latin1(path: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b"Subject:", b"Subject: \xe9t\xe9"))


def _rename_target(path: Path) -> None:
    path.write_text(path.read_text().replace("server_args.py", "nowhere.py"))


def _crlf(path: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))


def _overlap(path: Path) -> None:
    text = path.read_text()
    hunk = text[text.index("@@") :]
    second = hunk.replace("x_40 = 40", "x_41 = 41", 1)
    path.write_text(text + second[second.index("@@") :])


def _truncate(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-2]))


def _tamper_lock(root: Path) -> None:
    """A lock from the index whose wheel, already in the cache, is not the locked one."""
    lock = root / "vendor/sglang.lock"
    text = lock.read_text().replace('source = "git"', 'source = "pypi"')
    text += '\n[[artifacts]]\nfile = "sglang-0.5.9-py3-none-any.whl"\nsha256 = "' + "0" * 64 + '"\n'
    lock.write_text(text)
    cached = root / "build/wheel/cache/sglang-0.5.9-py3-none-any.whl"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"PK not the locked wheel")


@pytest.fixture
def fork(request: pytest.FixtureRequest) -> RebaseFork:
    versions = {
        "v0.5.9": BASE,  # imported (the first)
        "v0.5.10": {**BASE, SA: BASE[SA].replace("x_70 = 70\n", "x_70 = 71\n")},
        "v0.5.8": BASE,
    }
    gate = [
        (SA, "if is_sm100_supported(): x_40 = 40\n", "if is_sm100_supported() or 1: x_40 = 40\n")
    ]
    return make_rebase_fork(request, versions, [("0001-gate.patch", gate)])


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_fails_in_one_clear_line_and_changes_nothing(name: str, fork: RebaseFork) -> None:
    case = CASES[name]
    case.setup(fork.root)
    before, status_before = fork.snapshot(), fork.status()
    env = {**os.environ, "PYTHONPATH": str(PROJECT / "scripts"), **dict(case.env)}
    command = [arg.replace("{url}", fork.url) for arg in case.command]
    where = [] if case.outside else ["-C", str(fork.root)]
    result = subprocess.run(
        [sys.executable, "-m", "sm120fork", *where, *command],
        capture_output=True, text=True, env=env, check=False, timeout=300, cwd=fork.root.parent,
    )  # fmt: skip
    output = result.stdout + result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    named = case.expect.lower() in (result.stderr if case.exit_code != 1 else output).lower()
    after = fork.snapshot()
    TALLY[name] = Outcome(
        exit=result.returncode,
        clear_error=named and (case.exit_code == 1 or len(error_lines) == 1),
        traceback="Traceback" in output,
        changed_files=tuple(
            sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
        ),
    )
    assert "Traceback" not in output, output
    assert result.returncode == case.exit_code, output
    if case.exit_code != 1:
        assert len(error_lines) == 1, result.stderr
    assert named, output
    assert after == before
    assert fork.status() == status_before


def test_tally_is_written() -> None:
    """Runs last in this module: the figures the README quotes."""
    if len(TALLY) != len(CASES):
        pytest.skip("only a subset of the corpus ran; no tally written")
    out = PROJECT / "build" / "reliability" / "corpus.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "bad_inputs_tried": len(TALLY),
        "clear_error": sum(1 for t in TALLY.values() if t.clear_error),
        "tracebacks": sum(1 for t in TALLY.values() if t.traceback),
        "files_changed_by_failed_commands": sum(len(t.changed_files) for t in TALLY.values()),
        "cases": {name: asdict(t) for name, t in sorted(TALLY.items())},
    }
    out.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    assert summary["tracebacks"] == 0
