"""A conflict stops the rebase; --continue finishes it after a person's edit; --abort undoes it."""

from __future__ import annotations

import pytest
from hermetic import git
from rebasefork import BASE, SA, RebaseFork, edited, make_rebase_fork, shifted

# 0.5.10 rewrites the gate patch 2 rewrites, below five new lines.
AFTER = edited(
    {**BASE, SA: shifted(BASE[SA])},
    (SA, "if is_sm100_supported():", "if is_blackwell_supported():"),
)
SERIES = [
    # Two lines above the conflict: ours has them, the line numbers reported do not.
    ("0001-top.patch", [(SA, "x_3 = 3\n", "x_3 = 3\nfork_a = 1\nfork_b = 2\n")]),
    ("0002-gate.patch", [(SA, "if is_sm100_supported():", "if is_sm100_or_sm120():")]),
    ("0003-later.patch", [(SA, "x_70 = 70\n", "x_70 = 'fork'\n")]),
]
WORK = "build/rebase/work"


@pytest.fixture
def stopped(request: pytest.FixtureRequest) -> tuple[RebaseFork, dict[str, bytes]]:
    fork = make_rebase_fork(request, {"v0.5.9": BASE, "v0.5.10": AFTER}, SERIES)
    before = fork.snapshot()
    result = fork.rebase("v0.5.10")
    assert result.returncode == 1, result.stderr
    assert f"edit the conflict markers in {WORK}" in result.stderr
    assert f"conflict: {SA}:45" in result.stderr
    return fork, before


def test_conflict_report_names_file_line_and_both_sides(
    stopped: tuple[RebaseFork, dict[str, bytes]],
) -> None:
    fork, before = stopped
    report = fork.report()
    assert report["result"] == "conflict"
    assert report["work_tree"] == WORK
    assert fork.statuses() == {
        "0001-top.patch": "offset",
        "0002-gate.patch": "conflict",
        "0003-later.patch": "pending",
    }
    [conflict] = report["patches"][1]["conflicts"]
    assert conflict == {
        "file": SA,
        "line": 45,  # in 0.5.10, five lines below 0.5.9's line 40
        "gate": True,
        "ours": "if is_blackwell_supported(): x_40 = 40\n",
        "theirs": "if is_sm100_or_sm120(): x_40 = 40\n",
        "base": "if is_sm100_supported(): x_40 = 40\n",
        "conditions": {  # the gate's conditions side by side
            "old_upstream": ["is_sm100_supported()"],
            "new_upstream": ["is_blackwell_supported()"],
            "patch": ["is_sm100_or_sm120()"],
        },
    }
    assert "0002-gate.patch" in report["patches"][2]["detail"]
    markdown = fork.read("build/rebase/report.md")
    assert "```python\nif is_blackwell_supported(): x_40 = 40\n```" in markdown
    assert "(architecture gate)" in markdown
    assert (
        "| `is_sm100_supported()` | `is_blackwell_supported()` | `is_sm100_or_sm120()` |"
        in markdown
    )
    # Nothing landed; the markers wait in the work tree.
    assert fork.snapshot() == before
    assert fork.status() == ""
    assert "<<<<<<< " in fork.read(f"{WORK}/{SA}")


def test_second_rebase_is_refused_while_one_is_in_progress(
    stopped: tuple[RebaseFork, dict[str, bytes]],
) -> None:
    fork, _ = stopped
    result = fork.rebase("v0.5.10")
    assert result.returncode == 2
    assert "already in progress" in result.stderr


def test_continue_refuses_while_markers_remain(
    stopped: tuple[RebaseFork, dict[str, bytes]],
) -> None:
    fork, before = stopped
    result = fork.cli("rebase", "--continue")
    assert result.returncode == 1
    assert f"conflict markers remain at {SA}:" in result.stderr
    assert fork.snapshot() == before


def test_continue_after_resolving_by_hand(stopped: tuple[RebaseFork, dict[str, bytes]]) -> None:
    fork, _ = stopped
    resolved = "from sglang.srt.utils import is_sm120\n" + (
        shifted(BASE[SA])
        .replace("if is_sm100_supported():", "if is_blackwell_supported() and not is_sm120():")
        .replace("x_3 = 3\n", "x_3 = 3\nfork_a = 1\nfork_b = 2\n")
    )
    (fork.root / WORK / SA).write_text(resolved)
    result = fork.cli("rebase", "--continue")
    assert result.returncode == 0, result.stderr
    assert fork.statuses() == {
        "0001-top.patch": "offset",
        "0002-gate.patch": "merged",
        "0003-later.patch": "offset",
    }
    assert fork.report()["patches"][1]["detail"] == "conflict resolved by hand"
    assert "+if is_blackwell_supported() and not is_sm120():" in fork.read(
        "patches/0002-gate.patch"
    )
    changelog = fork.read("CHANGELOG.md")
    assert "merged; conflict resolved by hand" in changelog
    # The gate upstream rewrote now admits SM12x: the report and the changelog say so.
    [changed] = fork.report()["gates"]["changed"]
    assert changed["new"]["condition"] == "is_blackwell_supported()"
    assert "- SM12x answer changed: python/sglang/srt/server_args.py:45" in changelog
    assert not (fork.root / WORK).exists()
    assert not (fork.root / ".git/sm120fork-rebase").exists()


def test_abort_restores_everything(stopped: tuple[RebaseFork, dict[str, bytes]]) -> None:
    fork, before = stopped
    result = fork.cli("rebase", "--abort")
    assert result.returncode == 0, result.stderr
    assert fork.snapshot() == before
    assert fork.status() == ""
    assert not (fork.root / "build/rebase").exists()
    assert not (fork.root / ".git/sm120fork-rebase").exists()
    assert fork.cli("rebase", "--continue").returncode == 2  # nothing left to continue


def test_continue_refuses_when_patches_changed_meanwhile(
    stopped: tuple[RebaseFork, dict[str, bytes]],
) -> None:
    fork, _ = stopped
    (fork.root / "patches/0001-top.patch").write_text("edited\n")
    result = fork.cli("rebase", "--continue")
    assert result.returncode == 2
    assert "changed while the rebase was stopped (patches/0001-top.patch)" in result.stderr
    git("commit", "-q", "-a", "-m", "edit a patch mid-rebase", cwd=fork.root)
    result = fork.cli("rebase", "--continue")
    assert result.returncode == 2
    assert "a commit changed them" in result.stderr
