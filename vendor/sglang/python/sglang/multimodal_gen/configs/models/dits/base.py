# Copied and adapted from: https://github.com/hao-ai-lab/FastVideo

# SPDX-License-Identifier: Apache-2.0
from dataclasses import dataclass, field
from typing import Any

from sglang.multimodal_gen.configs.models.base import ArchConfig, ModelConfig
from sglang.multimodal_gen.runtime.layers.quantization import QuantizationConfig


@dataclass
class DiTArchConfig(ArchConfig):
    """Static DiT architecture metadata and checkpoint mappings.

    This object is populated from the source model configuration. It must not
    contain runtime implementation capabilities or the backend selected for a
    particular deployment.
    """

    # convert weights name from HF-format to SGLang-dit-format
    param_names_mapping: dict = field(default_factory=dict)

    # convert weights name from misc-format to HF-format
    # usually applicable if the LoRA is trained with official repo implementation
    lora_param_names_mapping: dict = field(default_factory=dict)

    # Reverse mapping for saving checkpoints: custom -> hf
    reverse_param_names_mapping: dict = field(default_factory=dict)
    quant_ignore_remap: dict = field(default_factory=dict)
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_channels_latents: int = 0
    exclude_lora_layers: list[str] = field(default_factory=list)
    boundary_ratio: float | None = None

    def __post_init__(self) -> None:
        pass


@dataclass
class DiTConfig(ModelConfig):
    arch_config: DiTArchConfig = field(default_factory=DiTArchConfig)

    # sglang-diffusion DiT-specific parameters
    prefix: str = ""
    quant_config: QuantizationConfig | None = None
    torch_compile_mode: str = "max-autotune-no-cudagraphs"

    # torch._inductor.config overrides for this model, applied before compiling,
    # e.g. {"multi_kernel_hints": [64, 4096]}.
    torch_compile_inductor_config: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def add_cli_args(parser: Any, prefix: str = "dit-config") -> Any:
        """Add CLI arguments for DiTConfig fields"""
        parser.add_argument(
            f"--{prefix}.prefix",
            type=str,
            dest=f"{prefix.replace('-', '_')}.prefix",
            default=DiTConfig.prefix,
            help="Prefix for the DiT model",
        )

        parser.add_argument(
            f"--{prefix}.quant-config",
            type=str,
            dest=f"{prefix.replace('-', '_')}.quant_config",
            default=None,
            help="Quantization configuration for the DiT model",
        )
        parser.add_argument(
            f"--{prefix}.torch-compile-mode",
            type=str,
            dest=f"{prefix.replace('-', '_')}.torch_compile_mode",
            default=DiTConfig.torch_compile_mode,
            help="torch.compile mode for the DiT model",
        )

        return parser
