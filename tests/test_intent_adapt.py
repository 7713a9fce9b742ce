"""An intent's code adapted to where upstream's code went: written for a ServerArgs
method, landing in an override pass (passform.py); calling a function upstream
renamed (renames.py)."""

from __future__ import annotations

import ast
import textwrap

import pytest
from sm120fork.intent import passform, renames
from sm120fork.intent.model import Edit, Intent

OVERRIDE = textwrap.dedent("""\
    @_register_for("Olmo2ForCausalLM")
    def _olmo2_overrides(server_args, hf_config):
        cfg = resolving_view(server_args)
        overrides = {}
        if cfg.attention_backend is None:
            if is_sm100_supported():
                overrides["attention_backend"] = "trtllm_mha"
        return overrides
""")
LINE = 6  # inside the override


def _rewrite(code: str, module: str = OVERRIDE) -> passform.PassForm:
    return passform.rewrite(ast.parse(module), LINE, textwrap.dedent(code))


def test_fields_set_become_returned_entries_and_fields_read_come_from_its_view() -> None:
    form = _rewrite("""\
        elif is_sm120_supported() and self.page_size == 1:
            # self.page_size stays
            self.attention_backend = "triton"
    """)
    assert form.code == textwrap.dedent("""\
        elif is_sm120_supported() and cfg.page_size == 1:
            # self.page_size stays
            overrides["attention_backend"] = "triton"
    """)
    assert "entries of `overrides`" in form.note and "read from `cfg`" in form.note


def test_without_a_view_fields_are_read_from_the_first_parameter() -> None:
    module = OVERRIDE.replace("    cfg = resolving_view(server_args)\n", "").replace(
        "cfg.", "server_args."
    )
    form = _rewrite("if self.quantization is None:\n    self.x = 1\n", module)
    assert form.code == 'if server_args.quantization is None:\n    overrides["x"] = 1\n'


@pytest.mark.parametrize(
    ("code", "why"),
    [
        # 0.5.15's DeepSeek branch: the method read back what it had set.
        (
            "if self.quantization is None:\n    self.quantization = q\n"
            "if self.quantization == 'modelopt_fp4':\n    pass\n",
            "reads self.quantization after setting it",
        ),
        ("x = self.get_attention_backends()[0]\n", "other than to read or set a field"),
        ("self.page_size += 1\n", "other than to read or set a field"),
        ("self.items[0] = 1\n", "other than to read or set a field"),
        ("a = self.x = 1\n", "other than to read or set a field"),
        ("self.x: int = 1\n", "other than to read or set a field"),
    ],
)
def test_code_whose_meaning_would_change_is_left_for_a_person(code: str, why: str) -> None:
    form = _rewrite(code)
    assert form.code is None and why in form.note


def test_a_method_keeps_its_form() -> None:
    method = (
        "class ServerArgs:\n    def f(self):\n        overrides = {}\n        return overrides\n"
    )
    form = passform.rewrite(ast.parse(method), 3, "self.x = 1\n")
    assert form.code is None and "not inside a function that returns" in form.note


def test_a_function_returning_no_dict_is_not_an_override_pass() -> None:
    module = "def f(server_args):\n    x = 1\n    return x\n"
    assert passform.rewrite(ast.parse(module), 2, "self.x = 1\n").code is None


# Two releases of the module that defines the test, for renames.follow.
OLD = {"configs.py": "def is_nsa(config):\n    return config.x > 0\n\ndef other():\n    pass\n"}
RENAMED = {"configs.py": "def is_dsa(config):\n    return config.x > 0\n\ndef other():\n    pass\n"}
INTENT = Intent(
    "p.patch",
    "refuse NSA on SM12x",
    (Edit("model", "M", "refuse_at", "top", "raise ValueError('no')\n", within="is_nsa(c)"),),
)


def _release(files: dict[str, str]) -> tuple[renames.Defining, renames.Reader]:
    def defining(names: object) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for path, text in files.items():
            for node in ast.parse(text).body:
                if isinstance(node, ast.FunctionDef) and node.name in names:  # type: ignore[operator]
                    found.setdefault(node.name, []).append(path)
        return found

    return defining, files.get


def test_a_function_renamed_with_its_body_kept_is_followed() -> None:
    intent, found = renames.follow(INTENT, _release(OLD), _release(RENAMED))
    assert found == {"is_nsa": "is_dsa"}
    assert intent.edits[0].within == "is_dsa(c)"
    assert renames.said(found) == "followed upstream's rename is_nsa() -> is_dsa()"


@pytest.mark.parametrize(
    "new",
    [
        OLD,  # not renamed
        {"configs.py": RENAMED["configs.py"].replace("> 0", ">= 0")},  # the body changed too
        {"configs.py": RENAMED["configs.py"] + "\ndef is_sa(config):\n    return config.x > 0\n"},
        {"elsewhere.py": RENAMED["configs.py"]},  # not in the module that defined it
    ],
)
def test_no_rename_is_guessed(new: dict[str, str]) -> None:
    intent, found = renames.follow(INTENT, _release(OLD), _release(new))
    assert (intent, found) == (INTENT, {})


def test_a_chain_of_renames_ends_at_the_last_name() -> None:
    assert renames.renamed_text("a(x) or ab(x)", {"a": "b", "b": "c"}) == "c(x) or ab(x)"


def test_a_gate_rewritten_through_a_local_platform_name_still_matches() -> None:
    """Upstream binds `platform = get_platform()` and re-wraps the test over lines with
    comments: the same condition, so the intent's `add_elif_after` still finds it."""
    from sm120fork.intent.reapply import reapply

    module = textwrap.dedent("""\
        from sglang.srt.runtime_context import get_platform


        @_register_for("Olmo2ForCausalLM")
        def _olmo2_overrides(server_args, hf_config):
            overrides = {}
            platform = get_platform()
            if (
                platform.is_cuda  # a CUDA build
                and platform.is_sm100
            ):
                overrides["attention_backend"] = "trtllm_mha"
            else:
                overrides["attention_backend"] = "fa3"
            return overrides
    """)
    code = 'elif get_platform().is_sm120:\n    overrides["attention_backend"] = "triton"\n'
    edit = Edit(
        "model", "Olmo2ForCausalLM", "add_elif_after",
        "get_platform().is_cuda and get_platform().is_sm100", code,
    )  # fmt: skip
    intent = Intent("p.patch", "olmo2 on SM12x", (edit,))
    result = reapply(intent, {"m.py": module}.get, ["m.py"])
    assert result.status == "resolved", result.detail
    assert "elif get_platform().is_sm120:" in result.changes["m.py"]
