"""Re-applying a gate intent with libcst: across reformatting, moves and upstream fixes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from forkrepo import edit, make_fork, make_patch
from intentcase import INTENT, INTENTS_TOML, WITH_DEEPSEEK
from sm120fork.cli import main
from sm120fork.intent.reapply import reapply

ORIGINAL = WITH_DEEPSEEK


def run(files: dict[str, str]) -> tuple[str, str, dict[str, str]]:
    result = reapply(INTENT, files.get, sorted(files))
    return result.status, result.detail, result.changes


def test_rewrites_the_anchored_gate_only_and_imports_the_sibling() -> None:
    status, _, changes = run({"python/sglang/srt/server_args.py": ORIGINAL})
    assert status == "resolved"
    new = changes["python/sglang/srt/server_args.py"]
    assert "    is_sm100_supported,\n    is_sm120_supported,\n" in new
    deepseek, glm = new.split("elif model_arch")
    assert deepseek.count("flashinfer_cutlass") == 0  # the other model's gate is untouched
    assert "if is_sm100_supported() or is_sm120_supported():" in glm
    assert '("flashinfer_cutlass" if is_sm120_supported() else "flashinfer_trtllm")' in glm
    assert "# auto-detected" in glm  # comments and formatting kept


def test_survives_a_reformat_of_the_gate() -> None:
    reformatted = edit(
        ORIGINAL,
        '        elif model_arch in ["Glm4MoeForCausalLM"]:\n            if is_sm100_supported():',
        '        elif model_arch in [\n            "Glm4MoeForCausalLM",\n        ]:\n'
        "            if (\n                is_sm100_supported()\n            ):",
    )
    status, _, changes = run({"python/sglang/srt/server_args.py": reformatted})
    assert status == "resolved"
    assert "or is_sm120_supported()" in changes["python/sglang/srt/server_args.py"]


MOVED = textwrap.dedent("""\
    from sglang.srt.runtime_context import get_platform


    @_register_for("Glm4MoeForCausalLM")
    def _glm4_moe_overrides(server_args, hf_config):
        overrides = {}
        if get_platform().is_sm100:
            overrides["moe_runner_backend"] = "flashinfer_trtllm"
        return overrides
""")


def test_follows_the_gate_into_another_file_and_helper_form() -> None:
    files = {
        "python/sglang/srt/server_args.py": "class ServerArgs:\n    pass\n",
        "python/sglang/srt/arg_groups/model_overrides/glm4_moe.py": MOVED,
    }
    status, detail, changes = run(files)
    assert status == "resolved", detail
    new = changes["python/sglang/srt/arg_groups/model_overrides/glm4_moe.py"]
    assert "if get_platform().is_sm100 or get_platform().is_sm120:" in new
    assert '("flashinfer_cutlass" if get_platform().is_sm120 else "flashinfer_trtllm")' in new
    assert "import" in new and new.count("import") == 1  # nothing to import for attributes


def test_upstream_condition_that_admits_sm120_is_upstreamed() -> None:
    fixed = edit(MOVED, "if get_platform().is_sm100:", "if get_platform().is_blackwell:")
    status, detail, changes = run({"python/sglang/srt/glm4_moe.py": fixed})
    assert status == "upstreamed"
    assert "is_blackwell" in detail
    assert changes == {}


def test_gate_that_no_longer_exists_is_not_found() -> None:
    gone = edit(MOVED, "if get_platform().is_sm100:", "if server_args.fast:")
    status, detail, _ = run({"python/sglang/srt/glm4_moe.py": gone})
    assert status == "not-found"
    assert "Glm4MoeForCausalLM" in detail


def test_cached_flag_without_a_sibling_flag_uses_the_helper() -> None:
    flagged = edit(
        ORIGINAL,
        "class ServerArgs:",
        "_is_sm100_supported = is_sm100_supported()\n\n\nclass ServerArgs:",
    )
    flagged = edit(
        flagged,
        '"Glm4MoeForCausalLM"]:\n            if is_sm100_supported():',
        '"Glm4MoeForCausalLM"]:\n            if _is_sm100_supported and self.x:',
    )
    status, _, changes = run({"python/sglang/srt/server_args.py": flagged})
    assert status == "resolved"
    new = changes["python/sglang/srt/server_args.py"]
    assert "if (_is_sm100_supported and self.x) or is_sm120_supported():" in new
    assert "is_sm120_supported,\n" in new


def _fork_with_recipe_patch(root: Path) -> None:
    base = {"python/sglang/srt/server_args.py": ORIGINAL}
    _, _, changes = run(dict(base))
    make_fork(root, {"0001-glm.patch": make_patch("glm on sm120", base, changes)}, base=base)
    (root / "patches" / "intents.toml").write_text(INTENTS_TOML)


def test_check_proves_the_recipe_reproduces_its_patch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fork_with_recipe_patch(tmp_path)
    assert main(["-C", str(tmp_path), "check"]) == 0
    recipe = tmp_path / "patches" / "intents.toml"
    recipe.write_text(edit(INTENTS_TOML, 'new = "flashinfer_cutlass"', 'new = "flashinfer_cutlas"'))
    assert main(["-C", str(tmp_path), "check"]) == 1
    assert "does not reproduce the patch" in capsys.readouterr().out


def test_check_flags_an_intent_for_a_patch_not_in_the_series(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fork_with_recipe_patch(tmp_path)
    recipe = tmp_path / "patches" / "intents.toml"
    recipe.write_text(INTENTS_TOML.replace("0001-glm.patch", "0009-gone.patch"))
    assert main(["-C", str(tmp_path), "check"]) == 1
    assert "intent for 0009-gone.patch, which is not in the series" in capsys.readouterr().out
