"""A synthetic release cut from the pinned tree, and a rebase of the real fork onto it
(issue 15): upstream (a) reformats a patched gate and (c) fixes the same SM12x
decision with different code, in one release; the patches end `resolved` and
`upstreamed`, the rebase exits 0, and both patches' own expectation rows hold on
the resulting patched tree (real sglang, faked sm100, sm120 and sm121). Case (b),
upstream moving a patched function to another module, is a release of the walk
in test_intent_rebase.py: each rebase of a whole fork costs about half a minute.

The release is a local git remote made from vendor/sglang: v0.5.23 as vendored,
v0.5.24 with both edits. (c) judges by behaviour (rebase/behaviour.py): the rows
run on the new pristine release in this gate environment (SM120_REBASE_GATE_ENV;
the synthetic release has no wheel of its own to install one from).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from sm120fork.harness import runner, spec, table

from . import synthetic

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = Path("python/sglang/srt/arg_groups/model_overrides")
EXAONE = "sm120-exaone-attention-triton.patch"
OLMO2 = "sm120-olmo2-attention-triton.patch"
EXAONE_GATE = "            if get_platform().is_cuda and get_platform().is_sm100:\n"
REFORMATTED = (
    "            if (\n"
    "                get_platform().is_cuda\n"
    "                and get_platform().is_sm100\n"
    "            ):\n"
)
OLMO2_CHAIN = """\
        if get_platform().is_cuda and get_platform().is_sm100:
            overrides["attention_backend"] = "trtllm_mha"
        elif get_platform().is_cuda and get_platform().device_sm >= 80:
            overrides["attention_backend"] = "fa3"
        else:
            overrides["attention_backend"] = "triton"
"""
# Upstream's own fix, not the patch's lines: FA3 only below Blackwell workstation parts.
OLMO2_UPSTREAM = """\
        platform = get_platform()
        if platform.is_cuda and platform.is_sm100:
            overrides["attention_backend"] = "trtllm_mha"
        elif platform.is_cuda and 80 <= platform.device_sm < 120:
            overrides["attention_backend"] = "fa3"
        else:
            # FA3 has no kernels for SM12x (nor below SM80).
            overrides["attention_backend"] = "triton"
"""
EXAONE_IMPORT = "from sglang.srt.arg_groups.model_overrides import exaone  # noqa: F401\n"


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path.name} changed upstream: update this test's edit"
    path.write_text(text.replace(old, new, 1))


def reformat(tree: Path) -> None:
    """(a) the Exaone gate the patch widens, split over lines as a formatter would."""
    _replace(tree / OVERRIDES / "exaone.py", EXAONE_GATE, REFORMATTED)


def move(tree: Path) -> None:
    """(b) the Exaone override moved into gemma4.py (its module deleted), as upstream
    regroups overrides; no rename git could follow."""
    source = (tree / OVERRIDES / "exaone.py").read_text()
    function = source[source.index("@_register_for(") :]
    (tree / OVERRIDES / "exaone.py").unlink()
    _replace(tree / OVERRIDES / "__init__.py", EXAONE_IMPORT, "")
    gemma4 = tree / OVERRIDES / "gemma4.py"
    gemma4.write_text(gemma4.read_text() + "\n\n" + function)


def fix_upstream(tree: Path) -> None:
    """(c) upstream sends SM12x to triton itself, with other code than the patch's."""
    _replace(tree / OVERRIDES / "olmo2.py", OLMO2_CHAIN, OLMO2_UPSTREAM)


def _run(cwd: Path, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    # this gate environment judges (c)
    return synthetic.run(cwd, *args, home=home, env={"SM120_REBASE_GATE_ENV": sys.prefix})


def rebased(tmp: Path, edit: Callable[[Path], None]) -> tuple[Path, dict[str, object], str]:
    """(patched tree, report, rebase output) after `rebase v0.5.24` onto `edit`ed 0.5.23."""
    home = tmp / "home"
    home.mkdir()
    upstream = synthetic.cut_releases(tmp, home, [("v0.5.23", None), ("v0.5.24", edit)])
    fork = tmp / "fork"
    fork.mkdir()
    for name in ("vendor", "patches", "gatetable", "tests", "pyproject.toml", "CHANGELOG.md"):
        source = ROOT / name
        ignore = shutil.ignore_patterns("__pycache__")
        if source.is_dir():
            shutil.copytree(source, fork / name, ignore=ignore)
        else:
            shutil.copy(source, fork / name)
    (fork / ".gitignore").write_text("/build/\n__pycache__/\n")
    synthetic.git(fork, "init", "-q", ".", home=home)
    synthetic.commit_all(fork, "the fork at 0.5.23", home)
    python = [sys.executable, "-m", "sm120fork", "-C", str(fork)]
    ran = _run(fork, *python, "rebase", "v0.5.24", "--upstream-git", upstream.as_uri(), home=home)
    output = ran.stdout + ran.stderr
    report = json.loads((fork / "build/rebase/report.json").read_text())
    assert ran.returncode == 0, output
    applied = _run(fork, *python, "apply", "--out", str(tmp / "applied"), home=home)
    assert applied.returncode == 0, applied.stderr
    return tmp / "applied" / "python", report, output


def rows_of(patches: Sequence[str]) -> list[table.Row]:
    """The expectation rows naming each of `patches` (every one must have some)."""
    mine = [
        r for r in table.load_table([a.name for a in spec.load_archs()]).rows if r.patch in patches
    ]
    named = {r.patch for r in mine}
    assert named == set(patches), f"no expectation rows name {sorted(set(patches) - named)}"
    return mine


def rows_hold(
    tree: Path, rows: Sequence[table.Row], scratch: Path, zygotes: runner.ZygotePool
) -> None:
    """`rows` match on `tree` on sm100, sm120 and sm121 (one child interpreter an
    architecture, for every row's scenario, forked from the session's zygotes)."""
    archs = [a for a in spec.load_archs() if a.name in ("sm100", "sm120", "sm121")]
    scenarios = [spec.load_scenarios()[name] for name in sorted({r.scenario for r in rows})]
    matrix = runner.run_matrices(
        {"result": tree}, archs, scenarios, scratch=scratch, jobs=2, zygotes=zygotes
    )
    observations = matrix["result"].observations
    wrong = [
        f"{row.label} {cell.describe()}"
        for row in rows
        for cell in table.check_row(row, observations)
        if cell.arch in {a.name for a in archs} and not cell.ok
    ]
    assert not wrong, "\n".join(wrong)


def resolved_in_steps(report: dict[str, object], patch: str, where: str, steps: list[str]) -> None:
    """`patch` ends `resolved` at `where` (a file its detail names), step by step `steps`."""
    carried = _status(report, patch)
    assert carried["status"] == "resolved", carried
    assert where in str(carried["detail"]), carried["detail"]
    assert [s["status"] for s in carried["steps"]] == steps  # type: ignore[attr-defined]


def _status(report: dict[str, object], patch: str) -> dict[str, object]:
    patches = {p["name"]: p for p in report["patches"]}  # type: ignore[attr-defined]
    return dict(patches[patch])


def reformat_and_fix_upstream(tree: Path) -> None:
    """(a) and (c) in one release: they touch different patches' modules."""
    reformat(tree)
    fix_upstream(tree)


@pytest.fixture(scope="module")
def landed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object], str]:
    return rebased(tmp_path_factory.mktemp("synthetic-release"), reformat_and_fix_upstream)


def test_a_reformatted_gate_is_resolved(landed: tuple[Path, dict[str, object], str]) -> None:
    _, report, output = landed
    assert _status(report, EXAONE)["status"] == "resolved", output


def test_the_same_decision_in_other_code_is_upstreamed(
    landed: tuple[Path, dict[str, object], str],
) -> None:
    tree, report, output = landed
    carried = _status(report, OLMO2)
    assert carried["status"] == "upstreamed", output
    detail = str(carried["detail"])
    assert "row" in detail and "olmo2_dense_tp1:attention_backend" in detail, detail
    assert "running sm120-olmo2-attention-triton.patch's 1 gate-table row" in output
    series = (tree.parents[1] / "fork" / "patches" / "series").read_text()
    assert OLMO2 not in series


def test_both_patches_rows_hold_on_the_result(
    landed: tuple[Path, dict[str, object], str], tmp_path: Path, zygote_pool: runner.ZygotePool
) -> None:
    tree, _, _ = landed
    rows_hold(tree, rows_of([EXAONE, OLMO2]), tmp_path / "rows", zygote_pool)


@pytest.mark.parametrize("edit", [reformat, move, fix_upstream])
def test_each_edit_applies_to_the_pinned_tree(tmp_path: Path, edit: Callable[[Path], None]) -> None:
    """The synthetic edits still find their text in vendor/sglang (a rebase of the
    fork itself would otherwise turn these cases into a failed setup). The edits touch
    the model overrides only, so only those are copied."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "vendor" / "sglang" / OVERRIDES, tree / OVERRIDES)
    edit(tree)
