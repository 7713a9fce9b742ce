"""The review policy: identity, decisions, wrongly included gates, the command."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from sm120fork.cli import main
from sm120fork.errors import EXIT_BAD_INPUT, EXIT_FINDINGS, EXIT_OK, FatalError
from sm120fork.gates import apply_policy, load_policy
from sm120fork.gates.policy import parse_policy, unmatched_added
from test_gates_support import make_tree, scan

SERVER_ARGS = """
from sglang.srt.utils import is_blackwell_supported, is_sm100_supported, is_sm120_supported


class ServerArgs:
    def _handle_model_specific_adjustments(self, model_arch):
        if model_arch in ["DeepseekV3ForCausalLM"]:
            if is_sm100_supported():
                self.moe_runner_backend = "flashinfer_trtllm"
        elif model_arch in ["Glm4MoeForCausalLM"]:
            if is_sm100_supported():
                self.moe_runner_backend = "flashinfer_trtllm"

    def _handle_attention_backend_compatibility(self):
        if self.attention_backend == "trtllm_mla":
            if not is_blackwell_supported():
                raise ValueError("TRTLLM MLA backend is only supported on Blackwell GPUs.")
        if self.attention_backend == "trtllm_mha":
            if not is_sm100_supported():
                raise ValueError("TRTLLM MHA backend is only supported on SM100.")
"""

# The same code shifted down by three lines and reformatted.
SERVER_ARGS_REFORMATTED = '''
"""Server arguments."""
from sglang.srt.utils import is_blackwell_supported, is_sm100_supported, is_sm120_supported


class ServerArgs:
    def _handle_model_specific_adjustments(self, model_arch):
        if model_arch in [
            "DeepseekV3ForCausalLM",
        ]:
            if (is_sm100_supported()):
                self.moe_runner_backend = "flashinfer_trtllm"
        elif model_arch in ['Glm4MoeForCausalLM']:
            if is_sm100_supported(
            ):
                self.moe_runner_backend = "flashinfer_trtllm"

    def _handle_attention_backend_compatibility(self):
        if self.attention_backend == "trtllm_mla":
            if not (is_blackwell_supported()):
                raise ValueError("TRTLLM MLA backend is only supported on Blackwell GPUs.")
        if self.attention_backend == "trtllm_mha":
            if not is_sm100_supported():
                raise ValueError("TRTLLM MHA backend is only supported on SM100.")
'''

POLICY = """
[wrongly_included]
tokens = ["trtllm", "deep_gemm"]

[[file]]
path = "python/sglang/srt/server_args.py"

[[file.gate]]
function = "ServerArgs._handle_model_specific_adjustments"
condition = "is_sm100_supported()"
within = "model_arch in ['DeepseekV3ForCausalLM']"
decision = "excluded"
reason = "trtllm-gen MoE is SM100-only"

[[file.gate]]
function = "ServerArgs._handle_model_specific_adjustments"
condition = "is_sm100_supported()"
occurrence = 1
decision = "patched"
patch = "sm120-glm4-moe-runner.patch"
reason = "SM12x gets flashinfer_cutlass"
evidence = ["https://github.com/sgl-project/sglang/issues/31864"]

[[file.gate]]
function = "ServerArgs._handle_attention_backend_compatibility"
condition = "not is_blackwell_supported()"
decision = "patched"
patch = "sm120-trtllm-mla-guard.patch"
reason = "TRT-LLM MLA prefill is SM100-only"

[[file.function]]
name = "ServerArgs._handle_attention_backend_compatibility"
decision = "excluded"
reason = "validation refusing SM100-only backends"
"""


def reviewed(root: Path, source: str, policy: str = POLICY):  # type: ignore[no-untyped-def]
    inventory = scan(root, {"srt/server_args.py": source})
    return apply_policy(inventory, parse_policy(_toml(policy)))


def _toml(text: str) -> dict:  # type: ignore[type-arg]
    import tomllib

    return tomllib.loads(textwrap.dedent(text))


def test_every_gate_gets_its_decision(tmp_path: Path) -> None:
    inventory = reviewed(tmp_path, SERVER_ARGS)
    decided = {(g.line, g.decision, g.patch) for g in inventory.gates}
    assert decided == {
        (7, "excluded", None),
        (10, "patched", "sm120-glm4-moe-runner.patch"),
        (15, "patched", "sm120-trtllm-mla-guard.patch"),
        (18, "excluded", None),  # the function's default
    }
    assert inventory.unreviewed == ()
    assert inventory.stale_policy == ()


def test_identity_survives_a_line_shift_and_a_reformat(tmp_path: Path) -> None:
    before = reviewed(tmp_path / "a", SERVER_ARGS)
    after = reviewed(tmp_path / "b", SERVER_ARGS_REFORMATTED)
    assert [g.line for g in before.gates] != [g.line for g in after.gates]
    assert [g.id for g in before.gates] == [g.id for g in after.gates]
    assert [(g.decision, g.patch) for g in before.gates] == [
        (g.decision, g.patch) for g in after.gates
    ]


def test_a_gate_without_entry_is_unreviewed(tmp_path: Path) -> None:
    source = SERVER_ARGS + textwrap.dedent(
        """
        def fusion_applies():
            return is_sm100_supported() or is_sm120_supported()
        """
    )
    inventory = reviewed(tmp_path, source)
    assert [g.condition for g in inventory.unreviewed] == [
        "is_sm100_supported() or is_sm120_supported()"
    ]


def test_wrongly_included_gates_are_flagged(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/layers/choose.py": """
                import torch
                from sglang.srt.utils import is_blackwell_supported, is_sm100_supported

                def backend():
                    major, _ = torch.cuda.get_device_capability()
                    if major >= 10:
                        return "trtllm_mha"  # admits 12.x: wrong
                    return "triton"

                def moe():
                    if is_sm100_supported():
                        return "flashinfer_trtllm"  # SM100 only: right
                    if not is_blackwell_supported():
                        return "triton"
                    return "deep_gemm"  # Blackwell but not SM100: 12.x, wrong

                def validate(backend):
                    if backend == "trtllm_mla":
                        if not is_blackwell_supported():  # a guard SM12x passes: wrong
                            raise ValueError("trtllm_mla needs Blackwell")
                    if not is_sm100_supported():  # refuses SM12x: right
                        raise ValueError("needs SM100")
            """
        },
    )
    policy = parse_policy(_toml('[wrongly_included]\ntokens = ["trtllm", "deep_gemm"]'))
    flagged = {
        (g.function, g.condition, g.wrongly_included_token)
        for g in apply_policy(inventory, policy).gates
        if g.wrongly_included
    }
    assert flagged == {
        ("backend", "major >= 10", "trtllm"),
        ("validate", "not is_blackwell_supported()", "trtllm"),
    }
    # `not is_blackwell_supported()` in moe(): SM12x falls through to deep_gemm,
    # which is not an `else` of the gate; only direct branches are judged.


def test_false_positive_silences_a_flag(tmp_path: Path) -> None:
    policy = POLICY.replace(
        'reason = "TRT-LLM MLA prefill is SM100-only"',
        'reason = "TRT-LLM MLA prefill is SM100-only"\nfalse_positive = "decode only"',
    )
    flagged = [g for g in reviewed(tmp_path, SERVER_ARGS, policy).gates if g.wrongly_included]
    assert flagged == []
    assert any(g.wrongly_included for g in reviewed(tmp_path / "b", SERVER_ARGS).gates)


def test_globs_and_stale_entries(tmp_path: Path) -> None:
    policy = """
    [[file]]
    path = "python/sglang/srt/**"
    decision = "upstream-ok"
    reason = "everything"

    [[file]]
    path = "python/sglang/srt/gone.py"
    decision = "excluded"
    reason = "a file upstream removed"
    """
    inventory = reviewed(tmp_path, SERVER_ARGS, policy)
    assert {g.decision for g in inventory.gates} == {"upstream-ok"}
    assert len(inventory.stale_policy) == 1
    assert "gone.py" in inventory.stale_policy[0]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('decision = "patched"\nreason = "x"', "only with, decision patched"),
        ('decision = "excluded"\npatch = "a.patch"\nreason = "x"', "only with, decision patched"),
        ('decision = "maybe"\nreason = "x"', "is not one of"),
        ('decision = "excluded"', "needs a reason"),
        ('decision = "excluded"\nreason = "x"\nline = 3', "unknown key"),
        ('decision = "excluded"\nreason = "x"\nadded = true', "true only with patched"),
        ('decision = "patched"\npatch = "a.patch"\nreason = "x"\nadded = 1', "true or false"),
    ],
)
def test_bad_policies_are_user_errors(entry: str, message: str) -> None:
    text = (
        '[[file]]\npath = "python/sglang/x.py"\n[[file.gate]]\n'
        f'function = "f"\ncondition = "is_sm100_supported()"\n{entry}\n'
    )
    with pytest.raises(FatalError, match=message):
        parse_policy(_toml(text))


ADDED = """
[[file]]
path = "python/sglang/srt/pcie.py"

[[file.gate]]
function = "fork_default"
condition = "not get_platform().is_sm120"
added = true
decision = "patched"
patch = "sm120-pcie.patch"
reason = "the patch gives SM12x a default where upstream tests no architecture"
"""

PATCHED_PCIE = """
from sglang.srt.runtime_context import get_platform


def fork_default():
    if not get_platform().is_sm120:
        return False
    return True
"""


def test_an_added_gate_is_looked_for_in_the_patched_tree_not_upstream(tmp_path: Path) -> None:
    inventory = reviewed(tmp_path, SERVER_ARGS, POLICY + ADDED)
    assert inventory.stale_policy == ()  # upstream has no such gate, and need not
    policy = parse_policy(_toml(POLICY + ADDED))
    (rule,) = policy.added

    def patched(text: str | None) -> Callable[[str], str | None]:
        return lambda path: text if path == rule.file else None

    assert unmatched_added(policy, patched(PATCHED_PCIE)) == []
    assert unmatched_added(policy, patched(None)) == [rule.decision.origin]  # file gone
    reworded = PATCHED_PCIE.replace("is_sm120", "is_blackwell")
    assert unmatched_added(policy, patched(reworded)) == [rule.decision.origin]


# -- the command ---------------------------------------------------------------


def make_repo(root: Path, source: str, policy: str = POLICY, series: str | None = None) -> Path:
    make_tree(root / "vendor" / "sglang", {"srt/server_args.py": source})
    patches = root / "patches"
    patches.mkdir(parents=True, exist_ok=True)
    (patches / "gates.toml").write_text(textwrap.dedent(policy), encoding="utf-8")
    (patches / "series").write_text(
        series or "sm120-glm4-moe-runner.patch\nsm120-trtllm-mla-guard.patch\n", encoding="utf-8"
    )
    return root


def test_command_exits_0_when_all_reviewed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = make_repo(tmp_path, SERVER_ARGS)
    assert main(["-C", str(repo), "gates"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "4 gates in 1 files" in out
    gates = json.loads((repo / "build" / "gates" / "gates.json").read_text())
    assert len(gates) == 4
    first = gates[0]
    assert list(first)[:10] == [
        "id", "file", "line", "function", "kind", "condition", "occurrence", "within", "archs",
        "decision",
    ]  # fmt: skip
    assert first["archs"] == {
        "sm80": False, "sm89": False, "sm90": False, "sm100": True, "sm103": True,
        "sm120": False, "sm121": False,
    }  # fmt: skip
    markdown = (repo / "build" / "gates" / "gates.md").read_text()
    assert markdown.index("| decision | gates |") < markdown.index("## All gates")


def test_command_exits_1_on_unreviewed_gates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = SERVER_ARGS + "\nFLAG = is_sm120_supported()\n"
    repo = make_repo(tmp_path, source)
    assert main(["-C", str(repo), "gates"]) == EXIT_FINDINGS
    out = capsys.readouterr().out
    assert "server_args.py:21: unreviewed gate in <module>: is_sm120_supported()" in out
    summary = json.loads((repo / "build" / "gates" / "summary.json").read_text())
    assert summary["decisions"]["unreviewed"] == 1


def test_command_exits_1_when_a_decision_names_a_patch_not_in_the_series(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = make_repo(tmp_path, SERVER_ARGS, series="sm120-trtllm-mla-guard.patch\n")
    assert main(["-C", str(repo), "gates"]) == EXIT_FINDINGS
    assert "sm120-glm4-moe-runner.patch, which patches/series does not list" in (
        capsys.readouterr().out
    )


def test_command_fails_on_a_wrongly_included_gate_left_included(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SM12x reaching code it cannot run is a finding, not a note: exit 1 without --strict."""
    policy = POLICY.replace(
        'decision = "patched"\npatch = "sm120-trtllm-mla-guard.patch"',
        'decision = "included"',
    )
    repo = make_repo(tmp_path, SERVER_ARGS, policy)
    assert main(["-C", str(repo), "gates"]) == EXIT_FINDINGS
    assert "wrongly included (trtllm), decision included" in capsys.readouterr().out
    markdown = (repo / "build" / "gates" / "gates.md").read_text()
    assert "## Wrongly included, not patched or excluded (1)" in markdown


def test_command_fails_on_an_open_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = POLICY.replace(
        'decision = "patched"\npatch = "sm120-trtllm-mla-guard.patch"',
        'decision = "open"',
    )
    repo = make_repo(tmp_path, SERVER_ARGS, policy)
    assert main(["-C", str(repo), "gates"]) == EXIT_FINDINGS
    assert "open gate (SM12x is wrong here, no fix yet)" in capsys.readouterr().out


def test_an_open_reason_needs_the_open_decision(tmp_path: Path) -> None:
    """An "Open:" reason under another decision would hide the finding in prose."""
    policy = POLICY.replace(
        'decision = "patched"\npatch = "sm120-trtllm-mla-guard.patch"\nreason = "',
        'decision = "included"\nreason = "Open: ',
    )
    assert 'reason = "Open: ' in policy
    repo = make_repo(tmp_path, SERVER_ARGS, policy)
    assert main(["-C", str(repo), "gates"]) == EXIT_BAD_INPUT


def test_command_reports_parse_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = make_repo(tmp_path, SERVER_ARGS)
    broken = repo / "vendor" / "sglang" / "python" / "sglang" / "srt" / "broken.py"
    broken.write_text("is_sm100_supported(\n", encoding="utf-8")
    assert main(["-C", str(repo), "gates"]) == EXIT_FINDINGS
    assert "python/sglang/srt/broken.py: scan problem: cannot parse" in capsys.readouterr().out


def test_command_refuses_a_bad_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = make_repo(tmp_path, SERVER_ARGS, "[[file]]\nline = 1\n")
    assert main(["-C", str(repo), "gates"]) == EXIT_BAD_INPUT
    assert "no path" in capsys.readouterr().err


def test_loading_the_policy_file(tmp_path: Path) -> None:
    path = tmp_path / "gates.toml"
    path.write_text(textwrap.dedent(POLICY), encoding="utf-8")
    policy = load_policy(path)
    assert policy.tokens == ("trtllm", "deep_gemm")
    assert policy.patches == {"sm120-glm4-moe-runner.patch", "sm120-trtllm-mla-guard.patch"}
