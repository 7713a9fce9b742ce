"""Gates between two releases: new, removed, changed, moved, unreviewed."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from sm120fork.cli import main
from sm120fork.errors import EXIT_FINDINGS, EXIT_OK
from sm120fork.gates import apply_policy, compare_trees, diff_inventories
from sm120fork.gates.answer import NO, YES
from sm120fork.gates.diff import GateDiff
from sm120fork.gates.model import Gate
from sm120fork.gates.policy import Policy, parse_policy
from test_gates_support import make_tree, scan

OLD = {
    "srt/server_args.py": """
        from sglang.srt.utils import check_pkg_version_at_least, is_sm100_supported

        class ServerArgs:
            def _handle_model_specific_adjustments(self, model_arch, hf_config):
                if model_arch in ["Qwen3MoeForCausalLM"]:
                    if is_sm100_supported():
                        self.moe_runner_backend = "flashinfer_trtllm"
                        logger.info("Use flashinfer_trtllm on sm100 for Qwen3MoeForCausalLM")
                elif model_arch in ["Glm4MoeForCausalLM"]:
                    if is_sm100_supported():
                        quantization_config = getattr(hf_config, "quantization_config", None)
                        quant_method = quantization_config.get("quant_method")
                        if self.quantization is None and quant_method is not None:
                            self.quantization = quant_method
                        if self.quantization == "modelopt_fp4" and self.moe_a2a_backend == "none":
                            self.moe_runner_backend = "flashinfer_trtllm"
                            logger.info("Use flashinfer_trtllm on sm100 for Glm4MoeForCausalLM")

            def _handle_deterministic_inference(self):
                if self.attention_backend is None:
                    if is_sm100_supported():
                        self.attention_backend = "flashinfer"
    """,
    "srt/layers/communicator.py": """
        from sglang.srt.utils import is_cuda, is_sm90_supported, is_sm100_supported

        _is_cuda = is_cuda()
        _is_sm90_supported = _is_cuda and is_sm90_supported()
        _is_sm100_supported = _is_cuda and is_sm100_supported()

        def apply_flashinfer_allreduce_fusion(batch_size):
            return (
                (_is_sm90_supported or _is_sm100_supported)
                and _is_flashinfer_available
                and batch_size > 0
                and batch_size <= FUSE_ALLREDUCE_MAX_BATCH_SIZE
            )
    """,
    "srt/layers/old_kernel.py": """
        from sglang.srt.utils import is_sm90_supported

        def swap_ab(m):
            return is_sm90_supported() and m < 64
    """,
}

NEW = {
    # The model overrides moved out of server_args, behind the platform object;
    # the deterministic-inference gate now lets SM120 in.
    "srt/server_args.py": """
        from sglang.srt.utils import is_sm100_supported, is_sm120_supported

        class ServerArgs:
            def _handle_deterministic_inference(self):
                if self.attention_backend is None:
                    if is_sm100_supported() or is_sm120_supported():
                        self.attention_backend = "flashinfer"

            def _handle_sparse(self):
                if is_sm120_supported():
                    raise ValueError("no sparse attention on SM120")
    """,
    "srt/arg_groups/model_overrides/glm4_moe.py": """
        from sglang.srt.runtime_context import get_platform

        @_register_for("Glm4MoeForCausalLM")
        def _glm4_moe_overrides(server_args, hf_config):
            cfg = resolving_view(server_args)
            overrides = {}
            if get_platform().is_sm100:
                quantization_config = getattr(hf_config, "quantization_config", None)
                quant_method = quantization_config.get("quant_method")
                quantization = cfg.quantization
                if quantization is None and quant_method is not None:
                    overrides["quantization"] = quant_method
                if quantization in {"modelopt_fp4", None} and cfg.moe_runner_backend == "auto":
                    overrides["moe_runner_backend"] = "flashinfer_trtllm"
                    logger.info("Use flashinfer_trtllm on sm100 for Glm4MoeForCausalLM")
            return overrides
    """,
    "srt/arg_groups/model_overrides/qwen3_moe.py": """
        from sglang.srt.runtime_context import get_platform

        @_register_for("Qwen3MoeForCausalLM")
        def _qwen3_moe_overrides(server_args, hf_config):
            overrides = {}
            if get_platform().is_sm100:
                overrides["moe_runner_backend"] = "flashinfer_trtllm"
                logger.info("Use flashinfer_trtllm on sm100 for Qwen3MoeForCausalLM")
            return overrides
    """,
    # The fusion gate moved to another module and function.
    "srt/layers/layer_boundary/residual/add_norm.py": """
        from sglang.srt.runtime_context import get_platform

        _is_cuda = get_platform().is_cuda
        _is_sm90_supported = _is_cuda and get_platform().is_sm90
        _is_sm100_supported = _is_cuda and get_platform().is_sm100

        def flashinfer_ar_fusion_applies(batch_size):
            return (
                (_is_sm90_supported or _is_sm100_supported)
                and _is_flashinfer_available
                and not is_dp_attention_enabled()
                and batch_size > 0
                and batch_size <= FUSE_ALLREDUCE_MAX_BATCH_SIZE
            )
    """,
}

POLICY = """
[[file]]
path = "python/sglang/srt/server_args.py"
decision = "excluded"
reason = "SM100-only paths"

[[file]]
path = "python/sglang/srt/layers/communicator.py"
decision = "excluded"
reason = "TRT-LLM comm kernels exist for majors 9 and 10 only"

[[file]]
path = "python/sglang/srt/layers/old_kernel.py"
decision = "upstream-ok"
reason = "Hopper tuning"
"""


def policy() -> Policy:
    import tomllib

    return parse_policy(tomllib.loads(textwrap.dedent(POLICY)))


def where(gate: Gate) -> tuple[str, str]:
    return (gate.file.removeprefix("python/sglang/"), gate.function)


@pytest.fixture
def diff(tmp_path: Path):  # type: ignore[no-untyped-def]
    old = apply_policy(scan(tmp_path / "old", OLD), policy())
    new = apply_policy(scan(tmp_path / "new", NEW), policy())
    return diff_inventories(old, new)


def test_moved_to_another_file_and_function(diff) -> None:  # type: ignore[no-untyped-def]
    moved = {(where(c.old), c.old.condition, where(c.new), c.new.condition) for c in diff.moved}
    assert (
        ("srt/server_args.py", "ServerArgs._handle_model_specific_adjustments"),
        "is_sm100_supported()",
        ("srt/arg_groups/model_overrides/glm4_moe.py", "_glm4_moe_overrides"),
        "get_platform().is_sm100",
    ) in moved
    assert (
        ("srt/server_args.py", "ServerArgs._handle_model_specific_adjustments"),
        "is_sm100_supported()",
        ("srt/arg_groups/model_overrides/qwen3_moe.py", "_qwen3_moe_overrides"),
        "get_platform().is_sm100",
    ) in moved
    fusion = [c for c in diff.moved if c.old.function == "apply_flashinfer_allreduce_fusion"]
    assert len(fusion) == 1
    assert where(fusion[0].new) == (
        "srt/layers/layer_boundary/residual/add_norm.py",
        "flashinfer_ar_fusion_applies",
    )
    assert fusion[0].archs == {}  # same answer everywhere: still excludes SM12x
    flags = {(c.old.condition, c.new.condition) for c in diff.moved if c.old.kind == "flag"}
    assert flags == {
        ("_is_cuda and is_sm90_supported()", "_is_cuda and get_platform().is_sm90"),
        ("_is_cuda and is_sm100_supported()", "_is_cuda and get_platform().is_sm100"),
    }


def test_changed_condition_now_admits_sm120(diff) -> None:  # type: ignore[no-untyped-def]
    (change,) = diff.changed
    assert where(change.new) == ("srt/server_args.py", "ServerArgs._handle_deterministic_inference")
    assert change.old.condition == "is_sm100_supported()"
    assert change.new.condition == "is_sm100_supported() or is_sm120_supported()"
    assert change.archs == {"sm120": (NO, YES), "sm121": (NO, YES)}
    assert change.note == "sm120: no -> yes; sm121: no -> yes"
    assert change.old.decision == "excluded"  # what the fork had decided before


def test_new_removed_and_unreviewed(diff) -> None:  # type: ignore[no-untyped-def]
    assert [(where(g), g.condition) for g in diff.removed] == [
        (("srt/layers/old_kernel.py", "swap_ab"), "is_sm90_supported() and m < 64")
    ]
    assert [(where(g), g.condition) for g in diff.new] == [
        (("srt/server_args.py", "ServerArgs._handle_sparse"), "is_sm120_supported()")
    ]
    # the moved gates live in files the policy does not know yet
    unreviewed = {where(g)[0] for g in diff.unreviewed}
    assert unreviewed == {
        "srt/arg_groups/model_overrides/glm4_moe.py",
        "srt/arg_groups/model_overrides/qwen3_moe.py",
        "srt/layers/layer_boundary/residual/add_norm.py",
    }
    data = diff.to_json()
    assert list(data) == ["new", "changed", "moved", "removed", "unreviewed"]
    json.dumps(data)  # plain JSON


def test_a_diff_reads_back_from_its_json(diff) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(json.dumps(diff.to_json()))  # as the rebase state keeps it
    again = GateDiff.from_json(data)
    assert again.to_json() == data
    assert [c.note for c in again.changed] == [c.note for c in diff.changed]
    assert GateDiff.from_json({}) == GateDiff.empty()


def test_unchanged_gates_are_not_reported(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "a", OLD)
    same = compare_trees(root, root, policy())
    assert (same.new, same.removed, same.changed, same.moved, same.unreviewed) == (
        (),
        (),
        (),
        (),
        (),
    )


def test_against_option_writes_the_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"
    make_tree(repo / "vendor" / "sglang", OLD)
    (repo / "patches").mkdir()
    (repo / "patches" / "gates.toml").write_text(textwrap.dedent(POLICY), encoding="utf-8")
    (repo / "patches" / "series").write_text("", encoding="utf-8")
    assert main(["-C", str(repo), "gates"]) == EXIT_OK
    upstream = make_tree(tmp_path / "upstream", NEW)
    assert main(["-C", str(repo), "gates", "--against", str(upstream)]) == EXIT_FINDINGS
    out = capsys.readouterr().out
    assert "1 new, 1 changed, 5 moved, 1 removed" in out
    data = json.loads((repo / "build" / "gates" / "diff.json").read_text())
    assert len(data["moved"]) == 5
    assert "## Moved" in (repo / "build" / "gates" / "diff.md").read_text()
