"""One rebase walk of the real fork across two synthetic releases cut from the
pinned tree (issues 15 and 30), `--step` by step. v0.5.24 reformats the Glm4Moe gate;
in v0.5.25 upstream
(a) rewrites the Exaone gate with the same meaning (a local bound to
    `get_platform()`, the test re-wrapped over lines, comments) and
(b) moves that override into gemma4.py, and glm4_moe.py to another module:
    the intents carry both patches there, and their rows verify them;
(c) fixes the Olmo2 decision with other code: the patch's rows pass on the pristine
    release, so it is upstreamed with them as evidence;
(d) decides the NVFP4 MoE runner for SM12x itself, ahead of the patched branch:
    `sm120-moe-runner-fit.patch` still refuses cases upstream now resolves
    otherwise than 0.5.24 did, so the rebase stops there for a person's review;
    `sm120-nvfp4-moe-auto-fit.patch` (after it in the series) still applies as
    text, but its branch is never reached and its rows fail as on the pristine
    release, so the rebase stops at it as dead code.
A `--dry-run` first predicts both stops. `--continue` past the review, then
`--drop` of the dead code, land the rest, and `check` passes at once. The cases
share one walk: a verified rebase of the whole fork costs minutes a release.

The fork's series no longer patches the Glm4Moe gate (the generic
sm120-nvfp4-moe-checkpoint.patch answers SM12x for every family), so the fork copy
here appends a test-only patch derived from this test's RECIPE, the 0.5.9 Glm4Moe
recipe retargeted to glm4_moe.py: widen the SM100 gate to SM12x and switch
flashinfer_trtllm to flashinfer_cutlass there. On the NVFP4 scenarios it decides what
the series decides (quantization modelopt_fp4, MoE flashinfer_cutlass), so the
table's Glm4Moe rows judge the result.

The releases are a local git remote made from vendor/sglang with this gate
environment's pins declared in python/pyproject.toml, so the rebase reads them
there and decides the rows here (synthetic.decided_here), downloading nothing.
"""

from __future__ import annotations

import difflib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sm120fork.harness import runner, spec, table

from . import synthetic

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = Path("python/sglang/srt/arg_groups/model_overrides")
EXAONE = "sm120-exaone-attention-triton.patch"
OLMO2 = "sm120-olmo2-attention-triton.patch"
EXAONE_GATE = """\
            if get_platform().is_cuda and get_platform().is_sm100:
                overrides["attention_backend"] = "trtllm_mha"
            elif get_platform().is_cuda and get_platform().device_sm >= 80:
"""
# The same meaning: a local for the platform, the test re-wrapped, comments.
SAME_MEANING = """\
            platform = get_platform()
            # Blackwell datacenter parts take TRT-LLM MHA.
            if (
                platform.is_cuda
                and platform.is_sm100  # SM100 and SM103
            ):
                overrides["attention_backend"] = "trtllm_mha"
            elif platform.is_cuda and (
                platform.device_sm >= 80
            ):
"""
OLMO2_CHAIN = """\
        if get_platform().is_cuda and get_platform().is_sm100:
            overrides["attention_backend"] = "trtllm_mha"
        elif get_platform().is_cuda and get_platform().device_sm >= 80:
            overrides["attention_backend"] = "fa3"
        else:
            overrides["attention_backend"] = "triton"
"""
# Upstream's own fix, not the patch's lines: FA3 only below Blackwell workstation parts,
# and the warning the patch's rows ask for (upstream took the fork's words for it).
OLMO2_UPSTREAM = """\
        platform = get_platform()
        if platform.is_cuda and platform.is_sm100:
            overrides["attention_backend"] = "trtllm_mha"
        elif platform.is_cuda and 80 <= platform.device_sm < 120:
            overrides["attention_backend"] = "fa3"
        else:
            # FA3 has no kernels for SM12x (nor below SM80).
            overrides["attention_backend"] = "triton"
            if platform.is_cuda and platform.device_sm >= 120:
                logger.warning(
                    "Attention backend triton on SM120/SM121 for %s: fa3 has no SM12x "
                    "kernels; flashinfer is refused for Olmo models.",
                    hf_config.architectures[0],
                )
"""
AUTO_FIT = "sm120-nvfp4-moe-auto-fit.patch"
MOE_FIT = "sm120-moe-runner-fit.patch"
MODELOPT = Path("python/sglang/srt/layers/quantization/modelopt_quant.py")
NVFP4_DEFAULT = """\
        moe_runner_backend = get_moe_runner_backend()

        if moe_runner_backend.is_auto():
            if is_cuda() and (8, 0) <= get_device_capability() < (10, 0):
"""
# Upstream decides SM12x ahead of the branch the patch adds, outside its context:
# the patch still applies as text, and its branch is never reached.
NVFP4_DECIDED = """\
        moe_runner_backend = get_moe_runner_backend()

        if moe_runner_backend.is_auto() and is_cuda() and get_device_capability()[0] == 12:
            moe_runner_backend = MoeRunnerBackend.FLASHINFER_CUTLASS
        if moe_runner_backend.is_auto():
            if is_cuda() and (8, 0) <= get_device_capability() < (10, 0):
"""
EXAONE_IMPORT = "from sglang.srt.arg_groups.model_overrides import exaone  # noqa: F401\n"
GLM4 = f"{OVERRIDES.as_posix()}/glm4_moe.py"
MOVED_TO = f"{OVERRIDES.as_posix()}/glm_moe_family.py"
INIT = f"{OVERRIDES.as_posix()}/__init__.py"
IMPORT = "from sglang.srt.arg_groups.model_overrides import glm4_moe  # noqa: F401\n"
MOVED_IMPORT = "from sglang.srt.arg_groups.model_overrides import glm_moe_family  # noqa: F401\n"
PATCH = "sm120-glm4-intent-fixture.patch"  # test-only: not in patches/series
GATE = "    if get_platform().is_sm100:\n        quantization_config = getattr("
REFORMATTED = (
    "    if (\n        get_platform().is_sm100\n    ):\n        quantization_config = getattr("
)
RECIPE = f"""\
[[intent]]
patch = "{PATCH}"
says = "In the Glm4Moe override, SM12x takes the quant auto-detect and flashinfer_cutlass"

[[intent.edit]]
model = "Glm4MoeForCausalLM"
condition = "get_platform().is_sm100"
by = "get_platform().is_sm100 or get_platform().is_sm120"

[[intent.edit]]
model = "Glm4MoeForCausalLM"
within = "get_platform().is_sm100"
replace = '"flashinfer_trtllm"'
by = '("flashinfer_cutlass" if get_platform().is_sm120 else "flashinfer_trtllm")'

[[intent.edit]]
model = "Glm4MoeForCausalLM"
within = "get_platform().is_sm100"
replace = '"Use flashinfer_trtllm as MoE runner backend on sm100 for Glm4MoeForCausalLM"'
by = '''
(
    "Use flashinfer_cutlass as MoE runner backend on sm120 for Glm4MoeForCausalLM"
    if get_platform().is_sm120
    else "Use flashinfer_trtllm as MoE runner backend on sm100 for Glm4MoeForCausalLM"
)
'''
"""
HEADER = """\
From: sglang-sm120 maintainers <sglang-sm120@users.noreply.github.com>
Subject: [PATCH] Test fixture: the Glm4Moe gate widened to SM12x by intent

A patch made only for this test (tests/gates/test_synthetic_releases.py), so that a rebase
has a gate patch to carry across a reformat and a move by its intent.

Origin: vendor
Forwarded: not-needed
Last-Update: 2026-12-01
---
"""
DERIVE = """\
import sys
from pathlib import Path
from sm120fork.intent.model import load_intents
from sm120fork.intent.reapply import reapply
fork, patch, path = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
intent = load_intents(fork / "patches" / "intents.toml")[patch]
def read(name):
    file = fork / "vendor" / "sglang" / name
    return file.read_text() if file.is_file() else None
result = reapply(intent, read, [path])
assert result.status == "resolved", result.detail
sys.stdout.write(result.changes[path])
"""


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path.name} changed upstream: update this test's edit"
    path.write_text(text.replace(old, new, 1))


def same_meaning(tree: Path) -> None:
    """(a) the Exaone gate the patch widens, rewritten with the same meaning."""
    _replace(tree / OVERRIDES / "exaone.py", EXAONE_GATE, SAME_MEANING)


def dead_code(tree: Path) -> None:
    """(d) upstream sends SM12x's auto NVFP4 MoE runner to flashinfer_cutlass itself,
    ahead of the branch the auto-fit patch adds."""
    _replace(tree / MODELOPT, NVFP4_DEFAULT, NVFP4_DECIDED)


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


def reformat_glm4(tree: Path) -> None:
    """v0.5.24: the Glm4Moe gate re-wrapped over lines."""
    _replace(tree / GLM4, GATE, REFORMATTED)


def move_glm4(tree: Path) -> None:
    """(b) glm4_moe.py renamed to another module (its import with it)."""
    _replace(tree / INIT, IMPORT, MOVED_IMPORT)
    (tree / GLM4).rename(tree / MOVED_TO)


def next_release(tree: Path) -> None:
    """v0.5.25: (a) and (b) of the Exaone patch, (b) of the Glm4Moe fixture, (c), (d):
    they touch different patches' modules (the Exaone rewrite before its move)."""
    same_meaning(tree)
    move(tree)
    move_glm4(tree)
    fix_upstream(tree)
    dead_code(tree)


def _run(cwd: Path, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return synthetic.run(cwd, *args, home=home)


def _derived_patch(fork: Path, home: Path) -> str:
    """The test recipe's patch for the pinned tree: the real header, the recipe's diff."""
    derived = _run(fork, sys.executable, "-c", DERIVE, str(fork), PATCH, GLM4, home=home)
    assert derived.returncode == 0, derived.stderr
    before = (fork / "vendor" / "sglang" / GLM4).read_text()
    diff = difflib.unified_diff(
        before.splitlines(True),
        derived.stdout.splitlines(True),
        f"a/{GLM4}",
        f"b/{GLM4}",
    )
    return HEADER + f"diff --git a/{GLM4} b/{GLM4}\n" + "".join(diff)


def _with_fixture_patch(fork: Path, home: Path) -> None:
    """The test-only Glm4Moe patch and its recipe appended to the fork's series."""
    with (fork / "patches" / "intents.toml").open("a", encoding="utf-8") as intents:
        intents.write("\n" + RECIPE)
    (fork / "patches" / PATCH).write_text(_derived_patch(fork, home))
    with (fork / "patches" / "series").open("a", encoding="utf-8") as series:
        series.write(f"{PATCH}\n")
    python = [sys.executable, "-m", "sm120fork", "-C", str(fork)]
    for command in ("refresh", "check"):
        ran = _run(fork, *python, command, home=home)
        assert ran.returncode == 0, ran.stdout + ran.stderr
    synthetic.commit_all(fork, "the test-only Glm4Moe patch", home)


@dataclass
class Rebase:
    fork: Path
    home: Path
    dry_code: int = 0  # how `rebase v0.5.25 --dry-run` exited, first
    dry: dict[str, object] = field(default_factory=dict)
    dry_output: str = ""
    code: int = 0  # how `rebase v0.5.25 --step` exited
    report: dict[str, object] = field(default_factory=dict)  # where it ended
    output: str = ""
    dead_code: int = 0  # how the `--continue` past the review exited (at the dead code)
    dead: dict[str, object] = field(default_factory=dict)
    dead_output: str = ""
    landed_code: int = 0  # how the `--drop` of the dead code exited
    landed: dict[str, object] = field(default_factory=dict)
    landed_output: str = ""

    def tool(self, *args: str) -> subprocess.CompletedProcess[str]:
        python = [sys.executable, "-m", "sm120fork", "-C", str(self.fork)]
        return _run(self.fork, *python, *args, home=self.home)


def _report(fork: Path) -> dict[str, object]:
    return dict(json.loads((fork / "build/rebase/report.json").read_text()))


def rebased(tmp: Path) -> Rebase:
    """`rebase v0.5.25 --dry-run` (both releases at once), then `rebase v0.5.25 --step`;
    where it stops, `--continue` past the review, then `--drop` the dead code, to land
    it. Each test asserts what it is about (a mutation of the tool fails the tests it
    breaks, not the fixture)."""
    home = tmp / "home"
    home.mkdir()
    releases = [("v0.5.23", None), ("v0.5.24", reformat_glm4), ("v0.5.25", next_release)]
    upstream = synthetic.cut_releases(tmp, home, releases)
    state = Rebase(synthetic.fork_checkout(tmp, home), home)
    _with_fixture_patch(state.fork, home)
    dry = state.tool("rebase", "v0.5.25", "--dry-run", "--upstream-git", upstream.as_uri())
    state.dry_code, state.dry, state.dry_output = dry.returncode, _report(state.fork), dry.stderr
    ran = state.tool("rebase", "v0.5.25", "--step", "--upstream-git", upstream.as_uri())
    state.code, state.report, state.output = (
        ran.returncode,
        _report(state.fork),
        ran.stdout + ran.stderr,
    )
    state.dead_code, state.dead, state.dead_output = state.code, state.report, state.output
    if state.code == 1:
        kept = state.tool("rebase", "--continue", "--note", "the refusal still holds")
        state.dead_code, state.dead = kept.returncode, _report(state.fork)
        state.dead_output = kept.stdout + kept.stderr
    state.landed_code, state.landed = state.dead_code, state.dead
    state.landed_output = state.dead_output
    if state.dead_code == 1:
        dropped = state.tool("rebase", "--drop", "upstream decides SM12x first")
        state.landed_code, state.landed = dropped.returncode, _report(state.fork)
        state.landed_output = dropped.stdout + dropped.stderr
    return state


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


@pytest.fixture(scope="module")
def rebase(tmp_path_factory: pytest.TempPathFactory) -> Rebase:
    return rebased(tmp_path_factory.mktemp("synthetic-releases"))


def test_a_gate_rewritten_with_the_same_meaning_is_carried_and_verified(rebase: Rebase) -> None:
    carried = _status(rebase.report, EXAONE)
    assert (carried["status"], carried["strategy"]) == ("resolved", "intent"), rebase.output
    assert str(carried["verified"]).startswith("verified: its rows pass"), carried
    assert "exaone4_swa_tp1:attention_backend" in str(carried["verified"])


def test_the_same_decision_in_other_code_is_upstreamed_by_its_rows(rebase: Rebase) -> None:
    carried = _status(rebase.report, OLMO2)
    assert (carried["status"], carried["strategy"]) == ("upstreamed", "rows"), carried
    detail = str(carried["detail"])
    assert "olmo2_dense_tp1:attention_backend" in detail and "decided in" in detail, detail
    assert f"{sys.prefix} (the same pins as 0.5.25)" in detail, detail  # who decided


def test_a_patch_upstream_made_dead_code_stops_the_rebase(rebase: Rebase) -> None:
    """After the review is settled, the rebase stops at the auto-fit patch: it
    applies, but changes no row's outcome on 0.5.25, and its rows fail."""
    assert (rebase.dead_code, rebase.dead["result"]) == (1, "conflict"), rebase.dead_output
    names = [p["name"] for p in rebase.dead["patches"]]  # type: ignore[attr-defined]
    statuses = [_status(rebase.dead, name)["status"] for name in names]
    at = names.index(AUTO_FIT)
    assert statuses[at] == "conflict" and set(statuses[at + 1 :]) == {"pending"}, statuses
    detail = str(_status(rebase.dead, AUTO_FIT)["detail"])
    assert "then stopped: dead code on 0.5.25" in detail, detail
    situ = "nvfp4_moe_layer_fit_tp1:modelopt_quant.nvfp4_moe_runner_backend[situ]"
    cell = f'{situ} sm120: expected "marlin"'
    assert cell in detail, detail


def test_a_dry_run_predicts_the_same_stop(rebase: Rebase) -> None:
    """The held-out releases were first fed through `--dry-run`: it goes on past the
    stop, so the patches after it are predicted, not pending."""
    assert (rebase.dry_code, rebase.dry["result"]) == (1, "dry-run"), rebase.dry_output
    stopped = _status(rebase.dry, AUTO_FIT)
    assert stopped["status"] == "conflict", stopped
    assert "then stopped: dead code on 0.5.25" in str(stopped["detail"]), stopped
    assert (_status(rebase.dry, OLMO2)["status"], _status(rebase.dry, EXAONE)["status"]) == (
        "upstreamed",
        "resolved",
    )
    stops = {p["name"] for p in rebase.dry["patches"] if p["status"] == "conflict"}  # type: ignore[attr-defined]
    pending = [p["name"] for p in rebase.dry["patches"] if p["status"] == "pending"]  # type: ignore[attr-defined]
    assert (stops, pending) == ({AUTO_FIT, MOE_FIT}, []), rebase.dry_output


def test_a_refusal_upstream_now_resolves_otherwise_stops_for_a_person(rebase: Rebase) -> None:
    """(d) also changes how upstream resolves a case the MoE-fit patch refuses: the
    rebase stops there first, with both resolutions."""
    assert (rebase.code, rebase.report["result"]) == (1, "conflict"), rebase.output
    stopped = _status(rebase.report, MOE_FIT)
    detail = str(stopped["detail"])
    assert stopped["status"] == "conflict", stopped
    assert "it still refuses where upstream 0.5.25 now resolves the case otherwise" in detail
    assert 'upstream now "flashinfer_cutlass", before "flashinfer_trtllm"' in detail, detail


def test_after_landing_the_fork_is_consistent(rebase: Rebase) -> None:
    """Every other patch verified, the stopped one dropped, and `check` green at once."""
    assert (rebase.landed_code, rebase.landed["result"]) == (0, "complete"), rebase.landed_output
    assert _status(rebase.landed, AUTO_FIT)["status"] == "dropped"
    carried = [p for p in rebase.landed["patches"] if p["status"] not in ("upstreamed", "dropped")]  # type: ignore[attr-defined]
    untested = table.load_table([a.name for a in spec.load_archs()]).untested
    unverified = [p["name"] for p in carried if not str(p["verified"]).startswith("verified")]
    # each says why: the table's reason (the test-only patch has no rows)
    assert set(unverified) == {*untested, PATCH}, unverified
    kept = _status(rebase.landed, MOE_FIT)
    assert str(kept["verified"]).startswith("verified by a person (`--continue`)"), kept
    series = (rebase.fork / "patches" / "series").read_text()
    assert OLMO2 not in series and AUTO_FIT not in series, series
    check = rebase.tool("check")
    assert check.returncode == 0, check.stdout + check.stderr
    stale = {s["patch"] for s in rebase.landed.get("stale_intents", [])}  # type: ignore[attr-defined]
    assert all(f"the intent of {name} is stale" in check.stdout for name in stale), check.stdout


def test_the_moved_and_reformatted_gate_is_resolved_by_intent(rebase: Rebase) -> None:
    resolved_in_steps(rebase.landed, PATCH, MOVED_TO, ["resolved", "resolved"])


def test_an_override_moved_to_another_module_is_resolved_there(rebase: Rebase) -> None:
    resolved_in_steps(rebase.landed, EXAONE, "gemma4.py", ["clean", "resolved"])


def test_gate_rows_hold_on_the_resolved_tree(
    rebase: Rebase, tmp_path: Path, zygote_pool: runner.ZygotePool
) -> None:
    """The Glm4Moe rows (the fixture patch decides what the series decides there, so
    they judge it) and the Exaone patch's own rows, on sm100, sm120 and sm121, on the
    landed fork applied to 0.5.25."""
    applied = rebase.tool("apply", "--out", str(tmp_path / "applied"))
    assert applied.returncode == 0, applied.stderr
    every = table.load_table([a.name for a in spec.load_archs()]).rows
    glm4 = [r for r in every if r.scenario.startswith("glm4_moe")]
    assert glm4, "no expectation rows for the Glm4Moe scenarios"
    rows = [*glm4, *(r for r in rows_of([EXAONE]) if r not in glm4)]
    rows_hold(tmp_path / "applied" / "python", rows, tmp_path / "rows", zygote_pool)


@pytest.mark.parametrize(
    "edit", [same_meaning, move, fix_upstream, dead_code, reformat_glm4, move_glm4]
)
def test_each_edit_applies_to_the_pinned_tree(tmp_path: Path, edit: Callable[[Path], None]) -> None:
    """The synthetic edits still find their text in vendor/sglang (a rebase of the
    fork itself would otherwise turn these cases into a failed setup). Only the files
    the edits touch are copied."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "vendor" / "sglang" / OVERRIDES, tree / OVERRIDES)
    (tree / MODELOPT).parent.mkdir(parents=True)
    shutil.copy(ROOT / "vendor" / "sglang" / MODELOPT, tree / MODELOPT)
    edit(tree)
