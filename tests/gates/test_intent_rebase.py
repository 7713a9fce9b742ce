"""A rebase across a synthetic reformat and a synthetic move of the Glm4Moe gate ends
`resolved` (an intent re-applied with libcst), the Exaone override upstream moved into
another module ends `resolved` there (issue 15's case (b)), and the gate table's rows of
both hold on the result, judged by the real sglang on faked sm100, sm120 and sm121.

Upstream here is a local git remote made from vendor/sglang: v0.5.23 as vendored,
v0.5.24 with the gate in arg_groups/model_overrides/glm4_moe.py reformatted, v0.5.25
with that override module renamed and the Exaone override moved into gemma4.py (as
upstream moves overrides between releases). One walk carries both cases: a verified
rebase of the whole fork costs minutes a release.

The fork's series no longer patches this gate (the generic sm120-nvfp4-moe-checkpoint.patch
answers SM12x for every family), so the fork copy here appends a test-only patch derived
from this test's RECIPE, the 0.5.9 Glm4Moe recipe retargeted to glm4_moe.py: widen the
SM100 gate to SM12x and switch flashinfer_trtllm to flashinfer_cutlass there. On the NVFP4
scenarios it decides what the series decides (quantization modelopt_fp4, MoE
flashinfer_cutlass), so the table's Glm4Moe rows judge the result.
"""

from __future__ import annotations

import difflib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sm120fork.harness import runner, spec, table

from . import synthetic
from .test_synthetic_releases import EXAONE, resolved_in_steps, rows_hold, rows_of
from .test_synthetic_releases import move as move_exaone

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = "python/sglang/srt/arg_groups/model_overrides"
GLM4 = f"{OVERRIDES}/glm4_moe.py"
MOVED_TO = f"{OVERRIDES}/glm_moe_family.py"
INIT = f"{OVERRIDES}/__init__.py"
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

A patch made only for this test (tests/gates/test_intent_rebase.py), so that a rebase
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


def _run(cwd: Path, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return synthetic.run(cwd, *args, home=home)


def _reformat(upstream: Path) -> None:
    glm4 = upstream / GLM4
    assert GATE in glm4.read_text(), "the Glm4Moe gate moved upstream: update GATE"
    glm4.write_text(glm4.read_text().replace(GATE, REFORMATTED, 1))


def _move(upstream: Path) -> None:
    init = upstream / INIT
    assert IMPORT in init.read_text()
    init.write_text(init.read_text().replace(IMPORT, MOVED_IMPORT, 1))
    (upstream / GLM4).rename(upstream / MOVED_TO)
    move_exaone(upstream)


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


@pytest.fixture(scope="module")
def landed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    tmp = tmp_path_factory.mktemp("intent-rebase")
    home = tmp / "home"
    home.mkdir()
    releases = [("v0.5.23", None), ("v0.5.24", _reformat), ("v0.5.25", _move)]
    upstream = synthetic.cut_releases(tmp, home, releases)

    fork = tmp / "fork"
    fork.mkdir()
    for name in ("vendor", "patches", "gatetable", "tests", "pyproject.toml", "CHANGELOG.md"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, fork / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, fork / name)
    with (fork / "patches" / "intents.toml").open("a", encoding="utf-8") as intents:
        intents.write("\n" + RECIPE)
    (fork / "patches" / PATCH).write_text(_derived_patch(fork, home))
    with (fork / "patches" / "series").open("a", encoding="utf-8") as series:
        series.write(f"{PATCH}\n")
    python = [sys.executable, "-m", "sm120fork", "-C", str(fork)]
    for command in ("refresh", "check"):
        ran = _run(fork, *python, command, home=home)
        assert ran.returncode == 0, ran.stdout + ran.stderr
    (fork / ".gitignore").write_text("/build/\n__pycache__/\n")
    synthetic.git(fork, "init", "-q", ".", home=home)
    synthetic.commit_all(fork, "the fork at 0.5.23", home)
    rebase = _run(
        fork, *python, "rebase", "v0.5.25", "--step", "--upstream-git", upstream.as_uri(), home=home
    )
    assert rebase.returncode == 0, rebase.stderr
    applied = _run(fork, *python, "apply", "--out", str(tmp / "applied"), home=home)
    assert applied.returncode == 0, applied.stderr
    report = json.loads((fork / "build/rebase/report.json").read_text())
    return tmp / "applied" / "python", report


def test_the_moved_and_reformatted_gate_is_resolved_by_intent(
    landed: tuple[Path, dict[str, object]],
) -> None:
    resolved_in_steps(landed[1], PATCH, MOVED_TO, ["resolved", "resolved"])


def test_an_override_moved_to_another_module_is_resolved_there(
    landed: tuple[Path, dict[str, object]],
) -> None:
    resolved_in_steps(landed[1], EXAONE, "gemma4.py", ["clean", "resolved"])


def test_gate_rows_hold_on_the_resolved_tree(
    landed: tuple[Path, dict[str, object]], tmp_path: Path, zygote_pool: runner.ZygotePool
) -> None:
    """The Glm4Moe rows (the fixture patch decides what the series decides there, so
    they judge it) and the Exaone patch's own rows, on sm100, sm120 and sm121."""
    tree, _ = landed
    every = table.load_table([a.name for a in spec.load_archs()]).rows
    glm4 = [r for r in every if r.scenario.startswith("glm4_moe")]
    assert glm4, "no expectation rows for the Glm4Moe scenarios"
    rows = [*glm4, *(r for r in rows_of([EXAONE]) if r not in glm4)]
    rows_hold(tree, rows, tmp_path, zygote_pool)
