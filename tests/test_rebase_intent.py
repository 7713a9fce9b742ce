"""A gate conflict that the patch's declared intent re-applies: status `resolved`."""

from __future__ import annotations

import textwrap

import pytest
from forkrepo import edit
from hermetic import git
from intentcase import GLM_ONLY, INTENT, INTENTS_TOML, SA
from rebasefork import RebaseFork, make_rebase_fork
from sm120fork.cli import main
from sm120fork.intent.reapply import reapply

ORIGINAL = GLM_ONLY
# 0.5.10 reformats the gate the patch rewrites: the 3-way merge conflicts there.
REFORMATTED = edit(
    ORIGINAL,
    "            if is_sm100_supported():",
    "            if (\n                is_sm100_supported()\n            ):",
)


def fork_with_intent(request: pytest.FixtureRequest, after: str) -> RebaseFork:
    patched = reapply(INTENT, {SA: ORIGINAL}.get, [SA]).changes[SA]
    versions = {"v0.5.9": {SA: ORIGINAL}, "v0.5.10": {SA: after}}
    fork = make_rebase_fork(request, versions, [(INTENT.patch, [(SA, ORIGINAL, patched)])])
    (fork.root / "patches/intents.toml").write_text(INTENTS_TOML)
    git("add", "-A", ".", cwd=fork.root)
    git("commit", "-q", "-m", "declare the intent", cwd=fork.root)
    return fork


def test_gate_conflict_resolved_by_intent(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    fork = fork_with_intent(request, REFORMATTED)
    result = fork.rebase("v0.5.10")
    assert result.returncode == 0, result.stderr
    [patch] = fork.report()["patches"]
    assert patch["status"] == "resolved"
    assert "re-applied intent in python/sglang/srt/server_args.py" in patch["detail"]
    assert patch["conflicts"] and patch["conflicts"][0]["gate"] is True
    landed = fork.read("patches/0001-glm.patch")
    assert "+                is_sm100_supported() or is_sm120_supported()\n" in landed
    assert '("flashinfer_cutlass" if is_sm120_supported() else "flashinfer_trtllm")' in landed
    assert "resolved by its intent" in fork.read("build/rebase/report.md")
    # The recipe still reproduces the patch on the new base: the series checks clean.
    assert main(["-C", str(fork.root), "check"]) == 0, capsys.readouterr().out


def test_gate_that_upstream_opened_to_sm120_is_upstreamed(
    request: pytest.FixtureRequest,
) -> None:
    opened = edit(ORIGINAL, "if is_sm100_supported():", "if is_blackwell_supported():")
    opened = edit(
        opened,
        "    is_sm100_supported,\n",
        "    is_blackwell_supported,\n    is_sm120_supported,\n",
    )
    opened = edit(
        opened,
        '"flashinfer_trtllm"',
        '"flashinfer_cutlass" if is_sm120_supported() else "flashinfer_trtllm"',
    )
    fork = fork_with_intent(request, opened)
    result = fork.rebase("v0.5.10")
    assert result.returncode == 0, result.stderr
    [patch] = fork.report()["patches"]
    assert patch["status"] == "upstreamed"
    assert "is_blackwell_supported()" in patch["detail"], patch["detail"]
    assert fork.read("patches/series") == ""
    assert not (fork.root / "patches/0001-glm.patch").exists()
    assert "[[intent]]" not in fork.read("patches/intents.toml")  # its recipe went too


MOVED_TO = "python/sglang/srt/arg_groups/glm4_moe.py"
MOVED = textwrap.dedent("""\
    from sglang.srt.utils import is_sm100_supported


    @_register_for("Glm4MoeForCausalLM")
    def _glm4_moe_overrides(server_args, hf_config):
        overrides = {}
        if is_sm100_supported():
            overrides["quantization"] = "modelopt_fp4"
            overrides["moe_runner_backend"] = "flashinfer_trtllm"
        return overrides
""")


def test_gate_moved_to_another_file_is_resolved_there(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    emptied = edit(ORIGINAL, ORIGINAL[ORIGINAL.index("        if model_arch") :], "        pass\n")
    patched = reapply(INTENT, {SA: ORIGINAL}.get, [SA]).changes[SA]
    versions = {"v0.5.9": {SA: ORIGINAL}, "v0.5.10": {SA: emptied, MOVED_TO: MOVED}}
    fork = make_rebase_fork(request, versions, [(INTENT.patch, [(SA, ORIGINAL, patched)])])
    (fork.root / "patches/intents.toml").write_text(INTENTS_TOML)
    git("add", "-A", ".", cwd=fork.root)
    git("commit", "-q", "-m", "declare the intent", cwd=fork.root)
    result = fork.rebase("v0.5.10")
    assert result.returncode == 0, result.stderr
    [patch] = fork.report()["patches"]
    assert patch["status"] == "resolved", patch
    assert MOVED_TO in patch["detail"]
    landed = fork.read("patches/0001-glm.patch")
    assert f"+++ b/{MOVED_TO}" in landed and "server_args.py" not in landed
    assert "+    if is_sm100_supported() or is_sm120_supported():" in landed
    assert "+from sglang.srt.utils import is_sm100_supported, is_sm120_supported" in landed
    assert main(["-C", str(fork.root), "check"]) == 0, capsys.readouterr().out
