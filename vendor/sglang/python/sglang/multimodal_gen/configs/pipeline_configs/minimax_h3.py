# SPDX-License-Identifier: Apache-2.0
import os
from dataclasses import dataclass, field

import torch

from sglang.multimodal_gen.configs.models.dits.minimax_h3 import MiniMaxH3DiTConfig
from sglang.multimodal_gen.configs.models.encoders.minimax_h3_qwen3vl import (
    MiniMaxH3Qwen3VLConfig,
)
from sglang.multimodal_gen.configs.models.vaes.minimax_h3_audio import (
    MiniMaxH3AudioVAEConfig,
)
from sglang.multimodal_gen.configs.models.vaes.minimax_h3_video import (
    MiniMaxH3VideoVAEConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.base import (
    ModelTaskType,
    PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.model_deployment_config import (
    ModelDeploymentConfig,
)
from sglang.multimodal_gen.runtime.managers.memory_managers.component_residency import (
    LAYERWISE_OFFLOAD,
)
from sglang.multimodal_gen.runtime.platforms import (
    AttentionBackendEnum,
    current_platform,
)
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

logger = init_logger(__name__)


@dataclass
class MiniMaxH3PipelineConfig(PipelineConfig):
    """MiniMax H3 native audio-video pipeline configuration."""

    # Canonical H3 materials are prepared by the model-specific stages. The
    # generic TI2V image resize would both duplicate that work and overwrite
    # the already-resolved target canvas.
    skip_input_image_preprocess: bool = True
    native_only_components: tuple[str, ...] = (
        "text_encoder",
        "transformer",
        "video_vae",
        "audio_vae",
    )
    task_type: ModelTaskType = ModelTaskType.TI2V
    dit_config: MiniMaxH3DiTConfig = field(default_factory=MiniMaxH3DiTConfig)
    vae_config: MiniMaxH3VideoVAEConfig = field(default_factory=MiniMaxH3VideoVAEConfig)
    audio_vae_config: MiniMaxH3AudioVAEConfig = field(
        default_factory=MiniMaxH3AudioVAEConfig
    )
    dit_precision: str = "bf16"
    # The video VAE remains fp32-resident because it also encodes keyframes.
    # Decode follows the released fp16-autocast recipe unless the user
    # explicitly disables autocast.
    vae_precision: str = "fp32"
    vae_decode_precision: str = "fp16"
    audio_vae_precision: str = "fp32"
    # Default VSA-H3 sparsity, tile size and reference-video keep rate;
    # --attention-backend-config VSA_sparsity / vsa_tile_size /
    # vsa_ref_keep_rate override them.
    vsa_sparsity: float = 0.9
    vsa_tile_size: int = 64
    vsa_ref_keep_rate: float | None = None
    text_encoder_configs: tuple[MiniMaxH3Qwen3VLConfig, ...] = field(
        default_factory=lambda: (MiniMaxH3Qwen3VLConfig(),)
    )
    text_encoder_precisions: tuple[str, ...] = field(default_factory=lambda: ("bf16",))
    text_encoder_extra_args: list[dict] = field(default_factory=lambda: [{}])
    # The released checkpoint is CFG-distilled and has one positive branch.
    should_use_guidance: bool = False
    output_audio_sample_rate: int | None = 32000
    output_audio_channels: int | None = 2
    output_av_drift_tolerance_s: float | None = 0.25

    def supports_disaggregation(self) -> bool:
        return False

    def get_model_deployment_config(self) -> ModelDeploymentConfig:
        return ModelDeploymentConfig(
            speed_mode_enable_torch_compile_by_default=False,
            # 61.73 GB of DiT weights. Every card that is not part of a
            # 4xH200 set has to stream them, so the DiT has to be eligible for
            # automatic layerwise offload -- the default here is an empty tuple,
            # which makes the gate in _should_auto_enable_dit_layerwise_offload
            # always false and leaves the DiT resident until it fails to load.
            dit_layerwise_offload_modes=("auto", "memory"),
            keep_resident_min_available_gb=120,
            keep_resident_components=("dit", "text_encoder", "vae"),
            auto_enable_cfg_parallel=False,
            supports_cfg_parallel=False,
        )

    @staticmethod
    def _server_arg_value(value):
        return getattr(value, "value", value)

    def resolve_transformer_attention_backend(
        self, server_args
    ) -> AttentionBackendEnum | None:
        """Resolve the H3 DiT backend using the selector's precedence."""
        from sglang.multimodal_gen.runtime.layers.attention.selector import (
            get_global_forced_attn_backend,
        )

        selected_backend = get_global_forced_attn_backend()
        if selected_backend is None:
            selected_backend, _ = server_args.resolve_component_attention_backend(
                "transformer"
            )
        if selected_backend is not None:
            return selected_backend
        attention_backend = server_args.attention_backend
        if attention_backend is None or isinstance(
            attention_backend, AttentionBackendEnum
        ):
            return attention_backend
        attention_backend = self._server_arg_value(attention_backend)
        return AttentionBackendEnum[str(attention_backend).strip().upper()]

    def uses_subblock_attention(self, server_args) -> bool:
        """Return whether H3 must build SubBlock-only request metadata."""
        return (
            self.resolve_transformer_attention_backend(server_args)
            is AttentionBackendEnum.SUBBLOCK_SPARSE_ATTN
        )

    def validate_quality_deployment(self, server_args) -> None:
        """Fail closed unless the resident server matches the deployment
        audited for quality="high"."""

        attention_backend = self._server_arg_value(server_args.attention_backend)
        attention_backend = (
            str(attention_backend).strip().lower()
            if attention_backend is not None
            else None
        )
        capability = current_platform.get_device_capability()
        capability_int = capability.to_int() if capability is not None else None
        device_name = (
            current_platform.get_device_name()
            if current_platform.is_cuda()
            else type(current_platform).__name__
        )
        model_variant = str(server_args.model_variant or "fl2va").lower()
        resolved_quant_config = self.text_encoder_configs[0].quant_config
        text_encoder_quantization = (
            resolved_quant_config.get_name()
            if resolved_quant_config is not None
            else None
        )
        actual = {
            "attention_backend": attention_backend,
            "backend": self._server_arg_value(server_args.backend),
            "component_attention_backends": {},
            "enable_breakable_cuda_graph": server_args.enable_breakable_cuda_graph,
            "enable_torch_compile": server_args.enable_torch_compile,
            "is_dit_layerwise_offload_selected": (
                server_args.is_dit_layerwise_offload_selected
            ),
            "lora_path": server_args.lora_path,
            "model_variant": model_variant,
            "num_gpus": server_args.num_gpus,
            "performance_mode": server_args.performance_mode,
            "quantization": server_args.quantization,
            "transformer_weights_path": server_args.transformer_weights_path,
            "text_encoder_quantization": text_encoder_quantization,
            "regional_compile": server_args.regional_compile,
            "ring_degree": server_args.ring_degree,
            "sp_degree": server_args.sp_degree,
            "tp_size": server_args.tp_size,
            "transformer_weights_path": server_args.transformer_weights_path,
            "ulysses_degree": server_args.ulysses_degree,
            "use_fsdp_inference": server_args.use_fsdp_inference,
        }
        actual["component_attention_backends"] = dict(
            server_args.component_attention_backends or {}
        )
        expected = {
            "attention_backend": {None, "fa"},
            "backend": {"auto", "sglang"},
            "component_attention_backends": {},
            "enable_breakable_cuda_graph": False,
            "enable_torch_compile": False,
            "is_dit_layerwise_offload_selected": False,
            "lora_path": None,
            "model_variant": "fl2va",
            "num_gpus": 4,
            "performance_mode": "speed",
            "quantization": None,
            "transformer_weights_path": None,
            "text_encoder_quantization": None,
            "regional_compile": False,
            "ring_degree": 1,
            "sp_degree": 4,
            "tp_size": 1,
            "transformer_weights_path": None,
            "ulysses_degree": 4,
            "use_fsdp_inference": False,
        }
        mismatches = {
            name: {"expected": wanted, "actual": actual[name]}
            for name, wanted in expected.items()
            if (
                actual[name] not in wanted
                if isinstance(wanted, set)
                else actual[name] != wanted
            )
        }
        if (
            not current_platform.is_cuda()
            or "H200" not in device_name.upper()
            or capability_int != 90
        ):
            mismatches["device"] = {
                "expected": "NVIDIA H200 (compute capability 9.0)",
                "actual": f"{device_name} (compute capability {capability_int})",
            }
        if mismatches:
            raise ValueError(
                'MiniMax-H3 quality="high" is validated only for '
                f"the strict 4xH200 fl2va deployment; mismatches: {mismatches}"
            )

    def validate_server_args(self, server_args) -> None:
        # Reject known-inexact VAE modes before any large component download.
        self.vae_config.resolved_parallel_decode_mode()
        if server_args.performance_mode == "memory":
            # Batched decoder tiles add activations on top of the resident
            # decoder; memory mode keeps the one-tile recipe at every tier.
            self.vae_config.decoder_tile_batch = 1
            self.vae_config.window_batch = 1
        if current_platform.is_mps():
            required_components = (
                "transformer",
                "text_encoder",
                "video_vae",
                "audio_vae",
            )
            missing_components = [
                component
                for component in required_components
                if server_args.residency_mode(component) != LAYERWISE_OFFLOAD
            ]
            if missing_components:
                raise ValueError(
                    "MiniMax-H3 on MPS requires synchronous layerwise offload for "
                    f"{missing_components}; pass --layerwise-offload-components "
                    "transformer text_encoder video_vae audio_vae"
                )
            if server_args.enable_torch_compile:
                raise ValueError(
                    "MiniMax-H3 MPS execution does not support torch.compile; "
                    "pass --enable-torch-compile false"
                )
        selected_backend = self.resolve_transformer_attention_backend(server_args)
        if (
            int(server_args.ring_degree or 1) > 1
            and selected_backend is not AttentionBackendEnum.FA
        ):
            raise ValueError(
                "MiniMax-H3 ring parallelism requires the FlashAttention "
                "backend for the transformer"
            )
        if selected_backend is None:
            return
        if selected_backend is AttentionBackendEnum.SUBBLOCK_SPARSE_ATTN:
            attention_config = server_args.attention_backend_config or {}
            compute_mode = str(attention_config.get("compute_mode", "bf16"))
            if compute_mode not in ("bf16", "sage_fp8"):
                raise ValueError(
                    "SubBlock compute_mode must be 'bf16' or 'sage_fp8', got "
                    f"{compute_mode!r}."
                )
            if compute_mode == "sage_fp8":
                capability = current_platform.get_device_capability()
                if capability is None or capability.to_int() not in (90, 120):
                    found = (
                        capability.as_version_str()
                        if capability is not None
                        else "unknown"
                    )
                    raise ValueError(
                        "MiniMax-H3 SubBlock compute_mode='sage_fp8' currently "
                        "requires SM90 or SM120 (compute capability 9.0 or 12.0); "
                        f"found {found}."
                    )
                if capability.to_int() == 90:
                    from sglang.kernels.ops.attention.subblock_sage_fp8_sm90 import (
                        _load_sparge_attention_sm90_ops,
                    )

                    _load_sparge_attention_sm90_ops()
                else:
                    from sglang.multimodal_gen.runtime.layers.attention.backends.subblock_sparse_attn import (
                        _load_sm120_sage_ops,
                    )

                    _load_sm120_sage_ops()
        if selected_backend is AttentionBackendEnum.VIDEO_SPARSE_ATTN_H3:
            if server_args.ring_degree > 1:
                raise ValueError(
                    "VSA-H3 does not support --ring-degree > 1; use Ulysses "
                    "sequence parallelism."
                )
            if (
                server_args.enable_torch_compile
                or server_args.enable_breakable_cuda_graph
            ):
                raise ValueError(
                    "VSA-H3 builds per-step tile metadata eagerly and is not "
                    "validated under torch.compile or the breakable CUDA "
                    "graph; disable them or use --attention-backend fa."
                )
        from sglang.multimodal_gen.runtime.layers.attention.backends.attention_backend import (
            AttentionRequirements,
        )
        from sglang.multimodal_gen.runtime.layers.attention.selector import (
            get_attn_backend,
        )

        get_attn_backend(
            self.dit_config.arch_config.attention_head_dim,
            torch.bfloat16,
            selected_attention_backend=selected_backend,
            attention_requirements=AttentionRequirements(packed_varlen=True),
        )

    def select_vae_weight_files(
        self,
        safetensors_list: list[str],
        component_model_path: str,
        component_name: str,
        vae_precision: str,
    ) -> list[str]:
        if component_name == "video_vae":
            return [os.path.join(component_model_path, "source", "model.safetensors")]
        return safetensors_list


@dataclass
class FastH3PipelineConfig(MiniMaxH3PipelineConfig):
    """FastH3 8-Step V2: VSA-distilled MiniMax-H3, t2va only."""

    # The checkpoint's trained sparsity (fastvideo_inference.json).
    vsa_sparsity: float = 0.8

    def __post_init__(self) -> None:
        self.dit_config.arch_config.has_gate_compress = True
        # FastVideo's recipe decodes each rank's tiles in one call.
        self.vae_config.decoder_tile_batch = 0

    def validate_quality_deployment(self, server_args) -> None:
        raise ValueError(
            'quality="high" is audited only for the base MiniMax-H3 50-step '
            "4xH200 deployment; FastH3 has no audited high-quality deployment. "
            'Use quality="exact", or the default "lossless".'
        )

    def validate_server_args(self, server_args) -> None:
        if server_args.model_variant is not None:
            raise ValueError(
                "FastH3 ships one t2va-distilled weight partition; "
                "--model-variant does not apply. FL2VA and Ref2VA tasks were "
                "not distilled; use MiniMaxAI/MiniMax-H3 for those."
            )
        self._default_to_trained_sparse_attention(server_args)
        super().validate_server_args(server_args)

    def _default_to_trained_sparse_attention(self, server_args) -> None:
        # The checkpoint was distilled with VSA-H3; dense attention skips its
        # trained compression gate and runs slower.
        if self.resolve_transformer_attention_backend(server_args) is not None:
            return
        if not current_platform.is_cuda():
            return
        from sglang.multimodal_gen.runtime.platforms.cuda import VSA_H3_CAPABILITIES

        capability = current_platform.get_device_capability()
        if (
            capability is None
            or (capability.major, capability.minor) not in VSA_H3_CAPABILITIES
        ):
            return
        if (
            server_args.enable_torch_compile
            or server_args.enable_breakable_cuda_graph
            or int(server_args.ring_degree or 1) > 1
        ):
            logger.info(
                "FastH3 runs dense attention: VSA-H3 does not serve torch.compile, "
                "the breakable CUDA graph or ring attention"
            )
            return
        server_args.set_automatic_component_attention_backend(
            "transformer", AttentionBackendEnum.VIDEO_SPARSE_ATTN_H3.name.lower()
        )
        logger.info(
            "Automatically set video_sparse_attn_h3 for the FastH3 transformer, the "
            "attention it was distilled with; --component-attention-backends "
            "transformer=fa selects dense attention"
        )


@dataclass
class FastH3OmniPipelineConfig(FastH3PipelineConfig):
    """FastH3 Omni 8-Step V1: PDD + VSA-distilled MiniMax-H3, ref2va only."""

    # The checkpoint's trained VSA (fastvideo_inference.json).
    vsa_sparsity: float = 0.9
    vsa_tile_size: int = 128
    vsa_ref_keep_rate: float | None = 0.1

    def __post_init__(self) -> None:
        self.dit_config.arch_config.has_gate_compress = True
        # Omni also encodes reference videos. The encoder runs one tile per
        # forward regardless, and the decoder keeps the base
        # ``decoder_tile_batch`` cap instead of FastH3's all-tiles recipe.

    def validate_server_args(self, server_args) -> None:
        if server_args.model_variant is not None:
            raise ValueError(
                "FastH3 Omni ships one ref2va-distilled weight partition; "
                "--model-variant does not apply."
            )
        self._default_to_trained_sparse_attention(server_args)
        MiniMaxH3PipelineConfig.validate_server_args(self, server_args)


__all__ = [
    "FastH3OmniPipelineConfig",
    "FastH3PipelineConfig",
    "MiniMaxH3PipelineConfig",
]


def register():
    from sglang.multimodal_gen.configs.sample.minimax_h3 import (
        FastH3OmniSamplingParams,
        FastH3SamplingParams,
        MiniMaxH3SamplingParams,
    )
    from sglang.multimodal_gen.registry import register_configs

    register_configs(
        sampling_param_cls=MiniMaxH3SamplingParams,
        pipeline_config_cls=MiniMaxH3PipelineConfig,
        hf_model_paths=[
            "MiniMaxAI/MiniMax-H3",
            "MiniMax/MiniMax-H3",
        ],
        model_detectors=[
            lambda model_id: (
                "minimaxh3" in model_id.lower().replace("-", "").replace("_", "")
                and "vdn" not in model_id.lower()
            )
        ],
    )
    register_configs(
        sampling_param_cls=FastH3SamplingParams,
        pipeline_config_cls=FastH3PipelineConfig,
        hf_model_paths=[
            "FastVideo/FastVideo-FastH3-8-Step-V2",
        ],
        model_detectors=[
            lambda model_id: (
                "fasth3" in model_id.lower().replace("-", "").replace("_", "")
                and "omni" not in model_id.lower()
            )
        ],
    )
    register_configs(
        sampling_param_cls=FastH3OmniSamplingParams,
        pipeline_config_cls=FastH3OmniPipelineConfig,
        hf_model_paths=[
            "FastVideo/FastVideo-FastH3-Omni-8-Step-V1",
        ],
        model_detectors=[
            lambda model_id: (
                "fasth3omni" in model_id.lower().replace("-", "").replace("_", "")
            )
        ],
    )
