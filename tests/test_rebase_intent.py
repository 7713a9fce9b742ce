"""A gate conflict that the patch's declared intent re-applies: status `resolved`."""

from __future__ import annotations

import textwrap
import tomllib

import pytest
from forkrepo import edit
from hermetic import git
from intentcase import GLM_ONLY, IMPORTS, INTENTS_TOML, SA
from rebasefork import RebaseFork, make_rebase_fork
from sm120fork.cli import main
from sm120fork.intent.model import parse_intent
from sm120fork.intent.reapply import reapply

ORIGINAL = GLM_ONLY
# 0.5.10 reformats the gate the patch rewrites: the 3-way merge conflicts there.
REFORMATTED = edit(
    ORIGINAL,
    "            if is_sm100_supported():",
    "            if (\n                is_sm100_supported()\n            ):",
)


def fork_with_intent(request: pytest.FixtureRequest, after: str) -> RebaseFork:
    return fork_declaring(request, {"v0.5.9": {SA: ORIGINAL}, "v0.5.10": {SA: after}}, INTENTS_TOML)


def fork_declaring(
    request: pytest.FixtureRequest,
    versions: dict[str, dict[str, str]],
    intents_toml: str,
) -> RebaseFork:
    """A fork whose one patch is what its intent makes on the first release."""
    raw = tomllib.loads(intents_toml)["intent"][0]
    intent = parse_intent(raw, "test")
    first = next(iter(versions.values()))
    made = reapply(intent, first.get, sorted(first))
    assert made.status == "resolved", made.detail
    edits = [(path, first[path], text) for path, text in made.changes.items()]
    fork = make_rebase_fork(request, versions, [(raw["patch"], edits)])
    (fork.root / "patches/intents.toml").write_text(intents_toml)
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
    versions = {"v0.5.9": {SA: ORIGINAL}, "v0.5.10": {SA: emptied, MOVED_TO: MOVED}}
    fork = fork_declaring(request, versions, INTENTS_TOML)
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


# The two shapes of upstream change the 0.5.9 -> 0.5.23 replay met (issue #15).
OLMO_TOML = """\
[[intent]]
patch = "0001-olmo.patch"
says = "Olmo2 on SM12x defaults to triton attention"

[[intent.edit]]
model = "Olmo2ForCausalLM"
add_elif_after = "is_sm100_supported()"
code = '''
elif is_sm120_supported():
    self.attention_backend = "triton"
'''
"""
OLMO_METHOD = IMPORTS.replace("    is_hip,\n", "    is_hip,\n    is_sm120_supported,\n") + (
    """\
        if model_arch in ["Olmo2ForCausalLM"]:
            if is_sm100_supported():
                self.attention_backend = "trtllm_mha"
            else:
                self.attention_backend = "fa3"
"""
)
OLMO_PASS_PATH = "python/sglang/srt/arg_groups/model_overrides/olmo2.py"
OLMO_PASS = textwrap.dedent("""\
    from sglang.srt.utils import is_sm100_supported, is_sm120_supported


    @_register_for("Olmo2ForCausalLM")
    def _olmo2_overrides(server_args, hf_config):
        overrides = {}
        if is_sm100_supported():
            overrides["attention_backend"] = "trtllm_mha"
        else:
            overrides["attention_backend"] = "fa3"
        return overrides
""")


def test_a_serverargs_gate_moved_into_an_override_pass_is_written_in_its_form(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """0.5.15 and 0.5.19: Olmo2's default left ServerArgs for a registered function
    returning `overrides`; the intent lands there as upstream writes such code."""
    moved_out = edit(
        OLMO_METHOD, OLMO_METHOD[OLMO_METHOD.index("        if model_arch") :], "        pass\n"
    )
    versions = {
        "v0.5.9": {SA: OLMO_METHOD},
        "v0.5.10": {SA: moved_out, OLMO_PASS_PATH: OLMO_PASS},
    }
    fork = fork_declaring(request, versions, OLMO_TOML)
    result = fork.rebase("v0.5.10")
    assert result.returncode == 0, result.stderr
    [patch] = fork.report()["patches"]
    assert (patch["status"], patch["strategy"]) == ("resolved", "intent"), patch
    assert "written in the override-pass form" in patch["detail"]
    landed = fork.read("patches/0001-olmo.patch")
    assert f"+++ b/{OLMO_PASS_PATH}" in landed
    assert (
        '+    elif is_sm120_supported():\n+        overrides["attention_backend"] = "triton"\n'
        in landed
    )
    assert main(["-C", str(fork.root), "check"]) == 0, capsys.readouterr().out


NSA_TOML = """\
[[intent]]
patch = "0001-nsa.patch"
says = "NSA models are refused on SM12x"

[[intent.edit]]
model = "DeepseekV3ForCausalLM"
within = "is_deepseek_nsa(hf_config)"
refuse_at = "top"
code = '''
if is_sm120_supported():
    raise ValueError("NSA needs DeepGEMM, which SM12x lacks")
'''
"""
CONFIGS = "python/sglang/srt/configs/model_config.py"
NSA_CONFIGS = "def is_deepseek_nsa(config) -> bool:\n    return config.index_topk is not None\n"
NSA_ARGS = IMPORTS.replace("    is_hip,\n", "    is_hip,\n    is_sm120_supported,\n") + (
    """\
        from sglang.srt.configs.model_config import is_deepseek_nsa

        if model_arch in ["DeepseekV3ForCausalLM"]:
            if is_deepseek_nsa(hf_config):
                self.attention_backend = "nsa"
"""
)


def test_an_intent_follows_a_function_upstream_renamed(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """0.5.13 renamed is_deepseek_nsa to is_deepseek_dsa and rewrote the branch under it;
    the intent tests the renamed function, says so, and keeps the new name."""
    dsa_args = NSA_ARGS.replace("is_deepseek_nsa", "is_deepseek_dsa").replace('"nsa"', '"dsa"')
    versions = {
        "v0.5.9": {SA: NSA_ARGS, CONFIGS: NSA_CONFIGS},
        "v0.5.10": {SA: dsa_args, CONFIGS: NSA_CONFIGS.replace("_nsa", "_dsa")},
    }
    fork = fork_declaring(request, versions, NSA_TOML)
    result = fork.rebase("v0.5.10")
    assert result.returncode == 0, result.stderr
    [patch] = fork.report()["patches"]
    assert (patch["status"], patch["strategy"]) == ("resolved", "intent"), patch
    assert "followed upstream's rename is_deepseek_nsa() -> is_deepseek_dsa()" in patch["detail"]
    landed = fork.read("patches/0001-nsa.patch")
    assert (
        "             if is_deepseek_dsa(hf_config):\n+                if is_sm120_supported():\n"
        in landed
    )
    intents = fork.read("patches/intents.toml")
    assert 'within = "is_deepseek_dsa(hf_config)"' in intents and "_nsa" not in intents
    assert main(["-C", str(fork.root), "check"]) == 0, capsys.readouterr().out


def test_landing_marks_the_intents_that_no_longer_reproduce_their_patch(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """The patch applies unchanged, but upstream added a second `if is_sm100_supported():`
    to the override, so its intent is ambiguous there: the landing stands, marks the
    recipe stale and says so in the report, and `check` passes right after it, naming
    the stale intent instead of proving it."""
    second = (
        "            x = 1\n\n\n\n            if is_sm100_supported():\n                y = 2\n"
    )
    fork = fork_with_intent(request, ORIGINAL + second)
    result = fork.rebase("v0.5.10")
    assert result.returncode == 0, result.stderr
    assert fork.statuses() == {"0001-glm.patch": "clean"}
    assert "the intent of 0001-glm.patch is marked stale since 0.5.10" in result.stderr
    [stale] = fork.report()["stale_intents"]
    assert stale["patch"] == "0001-glm.patch" and "re-derive it" in stale["why"], stale
    assert "## Intents for a person" in fork.read("build/rebase/report.md")
    intents = tomllib.loads(fork.read("patches/intents.toml"))["intent"]
    assert intents[0]["stale"] == stale["why"]
    assert main(["-C", str(fork.root), "check"]) == 0
    assert "note: the intent of 0001-glm.patch is stale" in capsys.readouterr().out


def test_a_landing_clears_the_mark_of_an_intent_that_reproduces_again(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """A recipe marked stale that reproduces its patch on the new base is proven again."""
    fork = fork_with_intent(request, REFORMATTED)
    intents = fork.root / "patches/intents.toml"
    intents.write_text(
        intents.read_text().replace("[[intent]]\n", '[[intent]]\nstale = "an older landing"\n', 1)
    )
    git("commit", "-q", "-am", "an older landing marked it", cwd=fork.root)
    result = fork.rebase("v0.5.10")
    assert result.returncode == 0, result.stderr
    assert "stale" not in fork.read("patches/intents.toml")
    assert "stale_intents" not in fork.report()
    assert main(["-C", str(fork.root), "check"]) == 0, capsys.readouterr().out
