"""`sm120fork review`: a change to the series shown as behaviour, on real git repositories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reviewrepo import (
    MOE,
    MOE_0_5_10,
    MOE_PATCH,
    OLMO2,
    OLMO2_0_5_10,
    OLMO2_PATCH,
    OLMO2_ROW,
    ReviewRepo,
    cells,
    lock_text,
    make_review_repo,
    moe_patch,
    olmo2_patch,
    policy,
    row,
)

pytestmark = pytest.mark.usefixtures("git_env")


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ReviewRepo:
    monkeypatch.chdir(tmp_path)  # the CLI changes into the repository; restore it after
    return make_review_repo(tmp_path / "fork")


def _lines(text: str) -> list[str]:
    return text.splitlines()


def test_refresh_only_is_one_line(repo: ReviewRepo) -> None:
    # BASE's patch applied only at an offset (its hunk said line 6); HEAD refreshed it.
    stale = olmo2_patch().replace("@@ -8,6 +8,8 @@", "@@ -6,6 +6,8 @@")
    assert stale != olmo2_patch()
    repo.git("checkout", "-q", "main")
    repo.commit("a stale patch", {f"patches/{OLMO2_PATCH}": stale})
    repo.git("checkout", "-q", "-B", "pr")
    repo.commit("refresh", {f"patches/{OLMO2_PATCH}": olmo2_patch()})

    assert repo.review("main") == 0

    md = repo.markdown()
    assert f"- `{OLMO2_PATCH}`: refresh only: the same change, at other lines." in _lines(md)
    assert "```diff" not in md
    assert "**SM12x: no change; sm80-sm103: no change; series check: clean.**" in md
    data = repo.json()
    (patch,) = data["series"]["patches"]
    assert (patch["name"], patch["status"], patch["effect"]) == (OLMO2_PATCH, "changed", "refresh")
    assert patch["interdiff"] == ""
    assert data["gates"]["scan"]["scope"] == "limited"
    assert data["gates"]["scan"]["changed"] == []
    assert data["checks"] == {"clean": True, "findings": []}


def test_changed_condition_shows_the_line_and_the_gate(repo: ReviewRepo) -> None:
    narrowed = "get_platform().device_sm == 120"
    sm121_fa3 = OLMO2_ROW.replace('sm121 = "triton"', 'sm121 = "fa3"')
    repo.commit(
        "olmo2: SM120 only",
        {
            f"patches/{OLMO2_PATCH}": olmo2_patch(narrowed),
            "gatetable/expectations.toml": sm121_fa3,
        },
    )

    assert repo.review("main") == 0

    md = _lines(repo.markdown())
    assert md[0] == "<!-- sm120fork-review -->"
    assert md[1] == "## Review of `patches/`: main -> pr"
    assert md[3] == "**SM12x: 2 behaviour changes; sm80-sm103: no change; series check: clean.**"
    assert "- row `olmo2_tp1` attention_backend (sm121: triton -> fa3)" in md
    assert f"- gate `{OLMO2}:11` _olmo2_overrides: `{narrowed}` (sm121: yes -> no)" in md
    assert f"#### `{OLMO2_PATCH}`: changes what the patched file does" in md
    assert "-        elif get_platform().is_sm120:" in md
    assert f"+        elif {narrowed}:" in md
    assert (
        f"- `{OLMO2}:11` _olmo2_overrides: `get_platform().is_sm120` -> `{narrowed}` "
        "(sm120 yes, sm121 no): sm121: yes -> no"
    ) in md
    table_row = next(line for line in md if line.startswith("| `olmo2_tp1` |"))
    assert "| triton | **triton → fa3** |" in table_row

    data = repo.json()
    (patch,) = data["series"]["patches"]
    assert patch["effect"] == "changed"
    assert "+        elif get_platform().device_sm == 120:\n" in patch["interdiff"]
    (change,) = data["gates"]["scan"]["changed"]
    assert change["archs"] == {"sm121": [True, False]}
    assert change["new"]["condition"] == narrowed
    (cell_change,) = data["behaviour"]["changed"]
    assert cell_change["changed"] == {"sm121": ["triton", "fa3"]}
    assert data["verdict"]["other_archs"] == []


def test_added_patch_with_its_rows_and_decision(repo: ReviewRepo) -> None:
    moe_row = row(
        "moe_fp4",
        "moe_runner_backend",
        cells("auto", sm100="flashinfer_trtllm", sm103="flashinfer_trtllm",
              sm120="flashinfer_cutlass", sm121="flashinfer_cutlass"),
        MOE_PATCH,
    )  # fmt: skip
    decided = (
        f'decision = "patched"\npatch = "{MOE_PATCH}"\n'
        'reason = "SM12x gets the CUTLASS MoE runner from the patch"'
    )
    repo.commit(
        "moe patch",
        {
            f"patches/{MOE_PATCH}": moe_patch(),
            "patches/series": f"{OLMO2_PATCH}\n{MOE_PATCH}\n",
            "patches/gates.toml": policy(decided),
            "gatetable/expectations.toml": OLMO2_ROW + moe_row,
        },
    )

    assert repo.review("main") == 0

    md = _lines(repo.markdown())
    assert "1 -> 2 patches: 1 added." in md
    assert f"#### `{MOE_PATCH}`: new in the series" in md
    assert f"Pick the CUTLASS MoE runner on SM12x (`{MOE}`)" in md
    assert "+    elif is_sm120_supported():" in md
    assert (
        f"- {MOE}: pick_moe_runner: `is_sm100_supported()`: excluded -> patched (`{MOE_PATCH}`); "
        "reason was: TRT-LLM MoE kernels are SM100 only; now: SM12x gets the CUTLASS MoE "
        "runner from the patch"
    ) in md
    assert "Added rows (1):" in md
    assert (
        "| `moe_fp4` | moe_runner_backend | auto | auto | auto | flashinfer_trtllm | "
        f"flashinfer_trtllm | flashinfer_cutlass | flashinfer_cutlass | `{MOE_PATCH}` |"
    ) in md
    assert (
        "- new row `moe_fp4` moe_runner_backend (sm120 = flashinfer_cutlass, "
        "sm121 = flashinfer_cutlass)"
    ) in md
    assert (
        f"- new gate `{MOE}:9` pick_moe_runner: `is_sm120_supported()` (sm120: yes; sm121: yes)"
    ) in md

    data = repo.json()
    assert data["series"]["added"] == [MOE_PATCH]
    assert data["series"]["head"] == [OLMO2_PATCH, MOE_PATCH]
    (decision,) = data["gates"]["decisions"]
    assert decision["kind"] == "changed"
    assert (decision["old"]["decision"], decision["new"]["decision"]) == ("excluded", "patched")
    assert [g["condition"] for g in data["gates"]["scan"]["new"]] == ["is_sm120_supported()"]
    assert [r["scenario"] for r in data["behaviour"]["added"]] == ["moe_fp4"]
    assert data["checks"]["clean"] is True


def test_dropped_patch_and_its_orphaned_row(repo: ReviewRepo) -> None:
    repo.commit(
        "drop the olmo2 patch",
        {f"patches/{OLMO2_PATCH}": None, "patches/series": "# nothing left\n"},
    )

    assert repo.review("main") == 0

    md = _lines(repo.markdown())
    assert "1 -> 0 patches: 1 removed." in md
    assert f"#### `{OLMO2_PATCH}`: dropped from the series" in md
    assert "-        elif get_platform().is_sm120:" in md
    assert (
        f"- removed gate `{OLMO2}:11` _olmo2_overrides: `get_platform().is_sm120` "
        "(sm120: yes; sm121: yes)"
    ) in md
    assert "Rows whose patch is not in the series (1):" in md
    # The policy still names the dropped patch: HEAD's check says so.
    data = repo.json()
    assert data["series"]["removed"] == [OLMO2_PATCH]
    (patch,) = data["series"]["patches"]
    assert patch["effect"] == "removed"
    assert [r["patch"] for r in data["behaviour"]["orphaned"]] == [OLMO2_PATCH]
    assert [g["condition"] for g in data["gates"]["scan"]["removed"]] == ["get_platform().is_sm120"]


def test_rebase_pr_shows_the_base_and_keeps_upstream_hunks_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    repo = make_review_repo(tmp_path / "fork", moe=True)
    report = {
        "from": "0.5.9",
        "to": "0.5.10",
        "source": "pypi",
        "result": "complete",
        "patches": [
            {"name": OLMO2_PATCH, "status": "offset", "detail": "", "conflicts": []},
            {"name": MOE_PATCH, "status": "resolved", "detail": "", "conflicts": []},
        ],
        "gates": {"new": [], "changed": [], "moved": [], "removed": [], "unreviewed": []},
    }
    narrowed = 'is_sm120_supported() and args.quantization == "modelopt_fp4"'
    repo.commit(
        "rebase onto 0.5.10",
        {
            f"vendor/sglang/{OLMO2}": OLMO2_0_5_10,
            f"vendor/sglang/{MOE}": MOE_0_5_10,
            f"patches/{OLMO2_PATCH}": olmo2_patch(version="0.5.10"),
            f"patches/{MOE_PATCH}": moe_patch(narrowed, version="0.5.10"),
            "vendor/sglang.lock": lock_text("0.5.10"),
            "docs/rebases/0.5.9-to-0.5.10/report.json": json.dumps(report),
        },
    )

    assert repo.review("main") == 0

    md = _lines(repo.markdown())
    assert "BASE `main` (" in md[5] and ", sglang 0.5.9), HEAD `pr` (" in md[5]
    assert (
        "`vendor/sglang.lock` changed: sglang 0.5.9 -> 0.5.10 (sglang-0.5.9-py3-none-any.whl "
        "-> sglang-0.5.10-py3-none-any.whl)."
    ) in md
    assert "Rebase report (`docs/rebases/0.5.9-to-0.5.10/report.json`):" in md
    assert "- From sglang 0.5.9 to 0.5.10 (pypi): **complete**; 1 offset, 1 resolved." in md
    assert "- Gates: no architecture gate changed between the two releases." in md
    assert any(line.startswith("Scanned both patched trees in full: ") for line in md)
    assert (
        f"- `{OLMO2_PATCH}`: refresh only: the same change, at other lines "
        "(the file below it changed; it removes and adds the same lines)."
    ) in md
    assert f"#### `{MOE_PATCH}`: changes what the patched file does" in md
    assert f"+    elif {narrowed}:" in md
    assert "    return dict(args)" not in "\n".join(md)  # upstream's own change, left out
    assert "- 1 hunk of changes below the patch (upstream's, or an earlier patch's) left out" in md

    data = repo.json()
    assert data["base"]["version"] == "0.5.9" and data["head"]["version"] == "0.5.10"
    upstream = data["upstream"]
    assert (upstream["old"], upstream["new"]) == ("0.5.9", "0.5.10")
    assert upstream["report"] == "docs/rebases/0.5.9-to-0.5.10/report.json"
    assert data["gates"]["scan"]["scope"] == "full"
    effects = {p["name"]: p["effect"] for p in data["series"]["patches"]}
    assert effects == {OLMO2_PATCH: "refresh", MOE_PATCH: "changed"}
    (change,) = data["gates"]["scan"]["changed"]
    depends = [True, "depends: args.quantization"]
    unparsed = "is_sm120_supported() and args.quantization == 'modelopt_fp4'"
    assert change["archs"] == {"sm120": depends, "sm121": depends}
    assert data["verdict"]["sm12x"] == [
        f"gate `{MOE}:9` pick_moe_runner: `{unparsed}` "
        "(sm120: yes -> depends; sm121: yes -> depends)"
    ]


def test_renamed_and_reordered_patch_and_a_header_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    repo = make_review_repo(tmp_path / "fork", moe=True)
    renamed = "sm120-olmo2-triton.patch"
    newer = moe_patch().replace("Last-Update: 2026-11-29", "Last-Update: 2026-12-01")
    repo.commit(
        "rename, reorder, date",
        {
            f"patches/{OLMO2_PATCH}": None,
            f"patches/{renamed}": olmo2_patch(),
            f"patches/{MOE_PATCH}": newer,
            "patches/series": f"{MOE_PATCH}\n{renamed}\n",
        },
    )

    assert repo.review("main") == 0

    md = _lines(repo.markdown())
    assert "2 -> 2 patches: 1 renamed, 1 reordered, 1 changed." in md
    assert f"- `{renamed}` moved from place 1 to 2" in md
    assert f"- `{OLMO2_PATCH}` -> `{renamed}`: the same change." in md
    assert f"#### `{MOE_PATCH}`: only its DEP-3 header changed" in md
    assert "- Last-Update: 2026-11-29 -> 2026-12-01" in md
    assert "**SM12x: no change; sm80-sm103: no change; series check: clean.**" in md
    data = repo.json()
    assert data["series"]["renamed"] == [{"old": OLMO2_PATCH, "new": renamed}]
    assert data["series"]["reordered"] == [{"name": renamed, "old_position": 1, "new_position": 2}]
    # The rows still name the old file name: HEAD's rows whose patch is gone.
    assert [r["patch"] for r in data["behaviour"]["orphaned"]] == [OLMO2_PATCH]


def test_default_base_is_the_merge_base_with_main(repo: ReviewRepo) -> None:
    fork_point = repo.git("rev-parse", "main")
    repo.commit("olmo2", {f"patches/{OLMO2_PATCH}": olmo2_patch("get_platform().is_blackwell")})
    repo.git("checkout", "-q", "main")
    repo.commit("main moves on", {"README.md": "later\n"})
    repo.git("checkout", "-q", "pr")

    assert repo.review() == 0

    data = repo.json()
    assert data["base"] == {"ref": "merge-base main", "commit": fork_point, "version": "0.5.9"}
    assert data["head"]["ref"] == "pr"
    assert data["series"]["patches"][0]["effect"] == "changed"


def test_a_long_interdiff_fits_a_comment_and_stays_whole_in_the_json(repo: ReviewRepo) -> None:
    body = "".join(
        f"            value_{i} = {i}  # a long line to fill the comment\n" for i in range(3000)
    )
    repo.commit("a long patch", {f"patches/{OLMO2_PATCH}": olmo2_patch().replace(
        '+            overrides["attention_backend"] = "triton"\n',
        '+            overrides["attention_backend"] = "triton"\n'
        + "".join(f"+{line}\n" for line in body.splitlines()),
    ).replace("@@ -8,6 +8,8 @@", "@@ -8,6 +8,3008 @@")})  # fmt: skip

    assert repo.review("main") == 0

    md = repo.markdown()
    assert len(md) <= 65_000
    assert "more lines in review.json" in md
    assert "value_2999 = 2999" in repo.json()["series"]["patches"][0]["interdiff"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("nosuchref",), "unknown ref 'nosuchref'"),
        (("main", "nosuchref"), "unknown ref 'nosuchref'"),
        (("sibling",), "BASE sibling is not an ancestor of pr"),
    ],
)
def test_bad_refs_exit_2_and_write_nothing(
    repo: ReviewRepo, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    repo.git("branch", "sibling", "main")
    repo.git("checkout", "-q", "sibling")
    repo.commit("elsewhere", {"README.md": "sibling\n"})
    repo.git("checkout", "-q", "pr")
    repo.commit("olmo2", {f"patches/{OLMO2_PATCH}": olmo2_patch("get_platform().is_blackwell")})
    repo.out.mkdir(parents=True)
    (repo.out / "review.md").write_text("an earlier run's comment\n")

    assert repo.review(*args) == 2

    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert sorted(p.name for p in repo.out.iterdir()) == []


@pytest.mark.parametrize(
    ("path", "text"),
    [(f"patches/{OLMO2_PATCH}", "edited\n"), ("patches/new.patch", "untracked\n")],
)
def test_a_dirty_tree_exits_2(
    repo: ReviewRepo, capsys: pytest.CaptureFixture[str], path: str, text: str
) -> None:
    repo.write({path: text})

    assert repo.review("main") == 2

    err = capsys.readouterr().err.strip()
    assert err.startswith("sm120fork review: error: the work tree is dirty (")
    assert path in err and "\n" not in err
    assert not (repo.out / "review.md").exists()
    assert sorted(p.parent.name for p in (repo.root / "build").rglob("*")) == ["build"]


def test_untracked_files_elsewhere_do_not_count_and_nothing_is_checked_out(
    repo: ReviewRepo,
) -> None:
    repo.commit("olmo2", {f"patches/{OLMO2_PATCH}": olmo2_patch("get_platform().is_blackwell")})
    repo.write({"notes.txt": "mine\n"})
    head = repo.git("rev-parse", "HEAD")

    assert repo.review("main") == 0

    assert repo.git("rev-parse", "HEAD") == head
    assert repo.git("status", "--porcelain") == "?? notes.txt"
