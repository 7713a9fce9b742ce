# SPDX-License-Identifier: Apache-2.0
"""
Generic pipeline configuration for diffusers backend.

This module provides a minimal pipeline configuration that works with the diffusers backend.
Since diffusers handles its own model loading and configuration, this config is intentionally minimal.
"""

from dataclasses import dataclass, field
from typing import Any

from sglang.multimodal_gen.configs.models import DiTConfig, EncoderConfig, VAEConfig
from sglang.multimodal_gen.configs.pipeline_configs.base import (
    ModelTaskType,
    PipelineConfig,
)


@dataclass
class DiffusersGenericPipelineConfig(PipelineConfig):
    """
    Generic pipeline configuration for diffusers backend.

    This is a minimal configuration since the diffusers backend handles most
    configuration internally. It provides sensible defaults for the required fields.
    """

    # default to T2I since it's the most common
    task_type: ModelTaskType = ModelTaskType.T2I

    dit_precision: str = "bf16"
    vae_precision: str = "bf16"

    should_use_guidance: bool = True
    embedded_cfg_scale: float = 1.0
    flow_shift: float | None = None
    disable_autocast: bool = True  # let diffusers handle dtype

    # diffusers handles its own loading
    dit_config: DiTConfig = field(default_factory=DiTConfig)
    vae_config: VAEConfig = field(default_factory=VAEConfig)
    image_encoder_config: EncoderConfig = field(default_factory=EncoderConfig)
    text_encoder_configs: tuple[EncoderConfig, ...] = field(
        default_factory=lambda: (EncoderConfig(),)
    )
    text_encoder_precisions: tuple[str, ...] = field(default_factory=lambda: ("fp16",))

    # VAE settings
    vae_tiling: bool = False  # diffusers handles this
    vae_slicing: bool = False  # slice VAE decode for lower memory usage
    vae_sp: bool = False

    # Quantization config for pipeline-level quantization
    # See: https://huggingface.co/docs/diffusers/main/en/quantization/overview
    # Use PipelineQuantizationConfig for component-level control:
    #   from diffusers.quantizers import PipelineQuantizationConfig
    #   quantization_config = PipelineQuantizationConfig(
    #       quant_backend="bitsandbytes_4bit",
    #       quant_kwargs={"load_in_4bit": True, "bnb_4bit_compute_dtype": torch.bfloat16},
    #       components_to_quantize=["transformer", "text_encoder_2"],
    #   )
    quantization_config: Any = None

    def check_pipeline_config(self) -> None:
        """
        Override to skip most validation since diffusers handles its own config.
        """
        pass


# Static subclasses for each non-default task type.
# These exist so that _get_diffusers_model_info() can swap the task_type without
# dynamically creating a class via make_dataclass -- dynamic classes break pickle
# when multiprocessing uses the 'spawn' start method (see #21453).


@dataclass
class DiffusersT2VPipelineConfig(DiffusersGenericPipelineConfig):
    task_type: ModelTaskType = ModelTaskType.T2V


@dataclass
class DiffusersI2VPipelineConfig(DiffusersGenericPipelineConfig):
    task_type: ModelTaskType = ModelTaskType.I2V


@dataclass
class DiffusersTI2VPipelineConfig(DiffusersGenericPipelineConfig):
    task_type: ModelTaskType = ModelTaskType.TI2V


@dataclass
class DiffusersI2IPipelineConfig(DiffusersGenericPipelineConfig):
    task_type: ModelTaskType = ModelTaskType.I2I


@dataclass
class DiffusersTI2IPipelineConfig(DiffusersGenericPipelineConfig):
    task_type: ModelTaskType = ModelTaskType.TI2I


@dataclass
class DiffusersI2MPipelineConfig(DiffusersGenericPipelineConfig):
    task_type: ModelTaskType = ModelTaskType.I2M


DIFFUSERS_TASK_TYPE_TO_CONFIG: dict[
    ModelTaskType, type[DiffusersGenericPipelineConfig]
] = {
    ModelTaskType.T2I: DiffusersGenericPipelineConfig,
    ModelTaskType.T2V: DiffusersT2VPipelineConfig,
    ModelTaskType.I2V: DiffusersI2VPipelineConfig,
    ModelTaskType.TI2V: DiffusersTI2VPipelineConfig,
    ModelTaskType.I2I: DiffusersI2IPipelineConfig,
    ModelTaskType.TI2I: DiffusersTI2IPipelineConfig,
    ModelTaskType.I2M: DiffusersI2MPipelineConfig,
}
