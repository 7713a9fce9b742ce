"""Re-applying a gate intent found with libcst: across reformatting, moves and upstream
fixes (each operation on its own: test_intent_ops.py; the real series:
test_intent_real.py)."""

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
        "        elif model_arch in [\n            'Glm4MoeForCausalLM',\n        ]:\n"
        "            if (\n                is_sm100_supported()\n            ):",
    )
    reformatted = reformatted.replace(
        'self.moe_runner_backend = "flashinfer_trtllm"\n',
        "self.moe_runner_backend = (\n                'flashinfer_trtllm'\n            )\n",
    )
    status, detail, changes = run({"python/sglang/srt/server_args.py": reformatted})
    assert status == "resolved", detail
    new = changes["python/sglang/srt/server_args.py"]
    assert "if (\n                is_sm100_supported() or is_sm120_supported()\n" in new
    assert '(\n                ("flashinfer_cutlass" if is_sm120_supported() else' in new


MOVED = textwrap.dedent("""\
    from sglang.srt.utils import is_sm100_supported


    @_register_for("Glm4MoeForCausalLM")
    def _glm4_moe_overrides(server_args, hf_config):
        overrides = {}
        if is_sm100_supported():
            overrides["moe_runner_backend"] = "flashinfer_trtllm"
        return overrides
""")


def test_follows_the_gate_into_another_file() -> None:
    files = {
        "python/sglang/srt/server_args.py": "class ServerArgs:\n    pass\n",
        "python/sglang/srt/arg_groups/model_overrides/glm4_moe.py": MOVED,
    }
    status, detail, changes = run(files)
    assert status == "resolved", detail
    new = changes["python/sglang/srt/arg_groups/model_overrides/glm4_moe.py"]
    assert "if is_sm100_supported() or is_sm120_supported():" in new
    assert '("flashinfer_cutlass" if is_sm120_supported() else "flashinfer_trtllm")' in new
    assert "from sglang.srt.utils import is_sm100_supported, is_sm120_supported\n" in new


def test_upstream_condition_that_admits_sm120_is_upstreamed() -> None:
    fixed = edit(MOVED, "if is_sm100_supported():", "if is_blackwell_supported():")
    fixed = edit(fixed, "import is_sm100_supported", "import is_blackwell_supported")
    fixed = fixed.replace(
        "import is_blackwell_supported",
        "import (\n    is_blackwell_supported,\n    is_sm120_supported,\n)",
    )
    status, detail, changes = run({"python/sglang/srt/glm4_moe.py": fixed})
    assert status == "not-found", detail  # the switched choice has no gate left to sit in
    fixed = edit(
        fixed,
        '"flashinfer_trtllm"',
        '("flashinfer_cutlass" if is_sm120_supported() else "flashinfer_trtllm")',
    )
    status, detail, changes = run({"python/sglang/srt/glm4_moe.py": fixed})
    assert status == "upstreamed", detail
    assert "is_blackwell_supported()" in detail and "admits" in detail
    assert changes == {}


def test_gate_that_no_longer_exists_is_not_found() -> None:
    gone = edit(MOVED, "if is_sm100_supported():", "if server_args.fast:")
    status, detail, _ = run({"python/sglang/srt/glm4_moe.py": gone})
    assert status == "not-found"
    assert "Glm4MoeForCausalLM" in detail


def test_a_model_the_tree_lacks_is_not_found() -> None:
    status, detail, _ = run({"python/sglang/srt/server_args.py": "x = 1\n"})
    assert (status, detail) == ("not-found", "the override for Glm4MoeForCausalLM: not in the tree")


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
    recipe.write_text(edit(INTENTS_TOML, '("flashinfer_cutlass" if', '("flashinfer_cutlas" if'))
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
