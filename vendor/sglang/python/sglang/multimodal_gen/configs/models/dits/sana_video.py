# SPDX-License-Identifier: Apache-2.0
"""Architecture configuration for the SANA-Video 3D transformer."""

from dataclasses import dataclass, field

from sglang.multimodal_gen.configs.models.dits.base import DiTArchConfig, DiTConfig


@dataclass
class SanaVideoArchConfig(DiTArchConfig):
    patch_size: tuple[int, int, int] = (1, 2, 2)
    in_channels: int = 16
    out_channels: int = 16
    num_layers: int = 20
    attention_head_dim: int = 112
    num_attention_heads: int = 20
    num_cross_attention_heads: int = 20
    cross_attention_head_dim: int = 112
    cross_attention_dim: int = 2240
    caption_channels: int = 2304
    mlp_ratio: float = 3.0
    dropout: float = 0.0
    attention_bias: bool = False
    sample_size: int = 30
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    guidance_embeds: bool = False
    guidance_embeds_scale: float = 0.1
    qk_norm: str = "rms_norm_across_heads"
    rope_max_seq_len: int = 1024

    param_names_mapping: dict = field(
        default_factory=lambda: {
            # Self-attention q/k/v share the same input.
            r"^(transformer_blocks\.\d+\.attn1)\.to_q\.(.*)$": (
                r"\1.to_qkv.\2",
                0,
                3,
            ),
            r"^(transformer_blocks\.\d+\.attn1)\.to_k\.(.*)$": (
                r"\1.to_qkv.\2",
                1,
                3,
            ),
            r"^(transformer_blocks\.\d+\.attn1)\.to_v\.(.*)$": (
                r"\1.to_qkv.\2",
                2,
                3,
            ),
            # Cross-attention k/v share the text input.
            r"^(transformer_blocks\.\d+\.attn2)\.to_k\.(.*)$": (
                r"\1.to_kv.\2",
                0,
                2,
            ),
            r"^(transformer_blocks\.\d+\.attn2)\.to_v\.(.*)$": (
                r"\1.to_kv.\2",
                1,
                2,
            ),
            r"^transformer\.(.*)$": r"\1",
        }
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.patch_size = tuple(self.patch_size)
        self.hidden_size = self.num_attention_heads * self.attention_head_dim
        self.num_channels_latents = self.out_channels


@dataclass
class SanaVideoConfig(DiTConfig):
    arch_config: DiTArchConfig = field(default_factory=SanaVideoArchConfig)
    prefix: str = "SanaVideo"
