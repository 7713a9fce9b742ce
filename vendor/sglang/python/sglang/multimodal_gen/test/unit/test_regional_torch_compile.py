import os
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

import pytest
import torch
import torch.nn as nn

from sglang.multimodal_gen.runtime.models.dits.flux import (
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    FluxTransformerBlock,
)
from sglang.multimodal_gen.runtime.models.dits.ltx_2 import (
    LTX2VideoTransformer3DModel,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.decoding import DecodingStage
from sglang.multimodal_gen.runtime.pipelines_core.stages.denoising import (
    DenoisingStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.mova import (
    MOVADenoisingStage,
)
from sglang.multimodal_gen.runtime.utils.torch_compile import (
    CompiledModuleRegistry,
    build_torch_compile_kwargs,
    compile_matching_submodules,
)


class _CompilableModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.compile_calls = []

    def compile(self, **kwargs):
        self.compile_calls.append(kwargs)


class _RegionalModel(_CompilableModule):
    _compile_conditions = [
        lambda name, _module: (
            name.startswith("transformer_blocks.") and name.count(".") == 1
        )
    ]

    def __init__(self):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(
            [_CompilableModule(), _CompilableModule()]
        )
        self.transformer_blocks[0].inner = _CompilableModule()
        self.proj_out = _CompilableModule()


@pytest.mark.parametrize(
    ("backend", "options", "expected"),
    [
        (
            "custom_backend",
            {"pass_manager_config": {"persistent_buffers": ["weight"]}},
            {
                "backend": "custom_backend",
                "options": {"pass_manager_config": {"persistent_buffers": ["weight"]}},
            },
        ),
        (
            "inductor",
            {"max_autotune": True},
            {"backend": "inductor", "options": {"max_autotune": True}},
        ),
        (
            "inductor",
            None,
            {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"},
        ),
    ],
)
def test_out_of_tree_platform_controls_compile_kwargs(backend, options, expected):
    """Out-of-tree hooks select valid backend, mode, and option combinations."""
    module = _CompilableModule()
    with (
        patch(
            "sglang.multimodal_gen.runtime.utils.torch_compile."
            "current_platform.is_out_of_tree",
            return_value=True,
        ),
        patch(
            "sglang.multimodal_gen.runtime.utils.torch_compile."
            "current_platform.get_compile_backend",
            return_value=backend,
        ) as get_compile_backend,
        patch(
            "sglang.multimodal_gen.runtime.utils.torch_compile."
            "current_platform.get_compile_options",
            return_value=options,
        ) as get_compile_options,
    ):
        compile_kwargs = build_torch_compile_kwargs(
            mode="max-autotune-no-cudagraphs",
            module=module,
        )

    assert compile_kwargs == {
        "dynamic": None,
        "fullgraph": False,
        **expected,
    }
    get_compile_backend.assert_called_once_with("max-autotune-no-cudagraphs")
    get_compile_options.assert_called_once_with(module)


def test_mova_uses_platform_compile_kwargs():
    stage = MOVADenoisingStage.__new__(MOVADenoisingStage)
    module = _CompilableModule()
    server_args = SimpleNamespace(enable_torch_compile=True)
    module_path = (
        "sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.mova"
    )
    compile_path = "sglang.multimodal_gen.runtime.utils.torch_compile"

    with (
        # This test exercises the real mode resolver, which reads the env first.
        patch.dict(os.environ, {}, clear=False),
        patch(f"{module_path}.current_platform.is_hip", return_value=False),
        patch(f"{module_path}.current_platform.is_npu", return_value=False),
        patch(
            f"{compile_path}.current_platform.is_npu",
            return_value=False,
        ),
        patch(
            f"{compile_path}.current_platform.is_out_of_tree",
            return_value=True,
        ),
        patch(
            f"{compile_path}.current_platform.get_compile_backend",
            return_value="custom_backend",
        ) as get_compile_backend,
        patch(
            f"{compile_path}.current_platform.get_compile_options",
            return_value={"max_autotune": True},
        ) as get_compile_options,
    ):
        os.environ.pop("SGLANG_TORCH_COMPILE_MODE", None)
        stage._maybe_enable_torch_compile(module, server_args)

    get_compile_backend.assert_called_once_with("max-autotune-no-cudagraphs")
    get_compile_options.assert_called_once_with(module)
    assert module.compile_calls == [
        {
            "backend": "custom_backend",
            "dynamic": None,
            "fullgraph": False,
            "options": {"max_autotune": True},
        }
    ]


def test_vae_compile_options_receive_the_target_module():
    stage = DecodingStage.__new__(DecodingStage)
    vae = _CompilableModule()
    decode = MagicMock()
    compiled_callable = MagicMock(target_id=None, compiled_module=None)
    compiled_callable.get_or_compile.return_value = decode
    server_args = SimpleNamespace(enable_torch_compile=True)
    module_path = "sglang.multimodal_gen.runtime.pipelines_core.stages.decoding"

    with (
        patch(f"{module_path}.current_platform.is_npu", return_value=False),
        patch(
            f"{module_path}.resolve_torch_compile_kwargs",
            return_value=({"backend": "custom_backend"}, "default"),
        ) as resolve_compile_kwargs,
    ):
        result = stage._get_vae_decode_fn(
            vae,
            server_args,
            decode_fn=decode,
            compiled_callable=compiled_callable,
        )

    assert result is decode
    resolve_compile_kwargs.assert_called_once_with(
        "SGLANG_VAE_TORCH_COMPILE_MODE",
        "SGLANG_TORCH_COMPILE_MODE",
        default="default",
        module=vae,
    )


def test_ltx2_compile_conditions_match_only_direct_blocks():
    conditions = LTX2VideoTransformer3DModel._compile_conditions

    assert conditions
    assert any(condition("transformer_blocks.0", object()) for condition in conditions)
    assert not any(
        condition("transformer_blocks.0.attn1", object()) for condition in conditions
    )
    assert not any(
        condition("transformer_blocks", object()) for condition in conditions
    )


def test_flux_compile_conditions_match_both_block_types():
    def matches(module) -> bool:
        return any(
            condition("transformer_blocks.0", module)
            for condition in FluxTransformer2DModel._compile_conditions
        )

    assert matches(FluxTransformerBlock.__new__(FluxTransformerBlock))
    assert matches(FluxSingleTransformerBlock.__new__(FluxSingleTransformerBlock))
    assert not matches(nn.Linear(2, 2))


def test_diffusion_qknorm_is_an_opaque_op_for_torch_compile():
    # Importing the layer registers it; a bare JIT launch would graph-break.
    from sglang.multimodal_gen.runtime.layers import layernorm  # noqa: F401

    schema = torch.ops.sglang.fused_inplace_qknorm.default._schema
    args = {arg.name: arg for arg in schema.arguments}
    assert args["q"].alias_info.is_write and args["k"].alias_info.is_write


def test_compile_matching_submodules_matches_only_declared_regions():
    model = _RegionalModel()

    count = compile_matching_submodules(
        model,
        compile_kwargs={"mode": "default", "fullgraph": False},
    )

    assert count == 2
    assert [len(block.compile_calls) for block in model.transformer_blocks] == [1, 1]
    assert not model.transformer_blocks[0].inner.compile_calls
    assert not model.proj_out.compile_calls
    assert not model.compile_calls


def test_compile_matching_submodules_fails_when_no_region_matches():
    model = _RegionalModel()
    model._compile_conditions = [lambda _name, _module: False]

    with pytest.raises(ValueError, match="no matching submodules"):
        compile_matching_submodules(model, compile_kwargs={"mode": "default"})


def test_compiled_module_registry_installs_regions_once():
    model = _RegionalModel()
    registry = CompiledModuleRegistry()

    assert (
        registry.compile_regions_once(
            model,
            compile_kwargs={"mode": "default"},
        )
        == 2
    )
    assert (
        registry.compile_regions_once(
            model,
            compile_kwargs={"mode": "default"},
        )
        == 0
    )
    assert [len(block.compile_calls) for block in model.transformer_blocks] == [1, 1]


def test_denoising_stage_selects_regional_compile():
    model = _RegionalModel()
    compile_kwargs = {"backend": "custom_backend"}
    stage = DenoisingStage.__new__(DenoisingStage)
    stage.server_args = SimpleNamespace(
        enable_breakable_cuda_graph=False,
        enable_torch_compile=True,
        regional_compile=True,
        pipeline_config=SimpleNamespace(
            dit_config=SimpleNamespace(torch_compile_mode="default")
        ),
    )
    stage._cache_dit_enabled = False
    stage._torch_compile_registry = CompiledModuleRegistry()

    with (
        patch(
            "sglang.multimodal_gen.runtime.pipelines_core.stages.denoising."
            "current_platform.is_npu",
            return_value=False,
        ),
        patch(
            "sglang.multimodal_gen.runtime.pipelines_core.stages.denoising."
            "resolve_torch_compile_kwargs",
            return_value=(compile_kwargs, "default"),
        ) as resolve_compile_kwargs,
    ):
        stage._maybe_torch_compile(model)

    resolve_compile_kwargs.assert_called_once_with(
        "SGLANG_TORCH_COMPILE_MODE",
        config=stage.server_args.pipeline_config.dit_config,
        default="max-autotune-no-cudagraphs",
        module=model,
        enable_inductor_compute_comm_overlap=True,
    )
    assert [len(block.compile_calls) for block in model.transformer_blocks] == [1, 1]
    assert [block.compile_calls for block in model.transformer_blocks] == [
        [compile_kwargs],
        [compile_kwargs],
    ]
    assert not model.compile_calls
