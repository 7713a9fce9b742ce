from dataclasses import dataclass, field
from functools import lru_cache

import torch
from diffusers.image_processor import VaeImageProcessor

from sglang.multimodal_gen.configs.models import DiTConfig, VAEConfig
from sglang.multimodal_gen.configs.models.dits.glmimage import GlmImageDitConfig
from sglang.multimodal_gen.configs.models.encoders.base import EncoderConfig
from sglang.multimodal_gen.configs.models.encoders.t5 import T5ArchConfig, T5Config
from sglang.multimodal_gen.configs.models.vaes.glmimage import GlmImageVAEConfig
from sglang.multimodal_gen.configs.pipeline_configs.base import (
    ModelTaskType,
    SpatialImagePipelineConfig,
    shard_rotary_emb_for_sp,
)
from sglang.multimodal_gen.runtime.platforms import current_platform
from sglang.multimodal_gen.runtime.server_args import get_global_server_args


@lru_cache(maxsize=4)
def _decode_scale_and_shift(latents_mean, latents_std, channels, device, dtype):
    # uploaded once per (device, dtype): a per-request upload blocks the host
    mean = torch.tensor(latents_mean).reshape(1, channels, 1, 1).to(device, dtype)
    std = torch.tensor(latents_std).reshape(1, channels, 1, 1).to(device, dtype)
    return 1.0 / std, mean


@dataclass
class GlmImagePipelineConfig(SpatialImagePipelineConfig):
    """Configuration for the GlmImage pipeline."""

    vae_precision: str = "bf16"

    should_use_guidance: bool = False
    task_type: ModelTaskType = ModelTaskType.TI2I

    vae_tiling: bool = False

    vae_sp: bool = False

    text_encoder_configs: tuple[EncoderConfig, ...] = field(
        default_factory=lambda: (T5Config(),)
    )

    dit_config: DiTConfig = field(default_factory=GlmImageDitConfig)
    # VAE
    vae_config: VAEConfig = field(default_factory=GlmImageVAEConfig)

    # GLM-Image uses T5 text encoder; base default is EncoderConfig() which lacks
    # parallel_folding and causes AttributeError + fallback to native T5 with missing weights.
    text_encoder_configs: tuple[EncoderConfig, ...] = field(
        default_factory=lambda: (T5Config(T5ArchConfig(num_heads=6)),)
    )

    enable_autocast: bool = False

    def __post_init__(self):
        self.vae_scale_factor = self.vae_config.get_vae_scale_factor()
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)

    def supports_dynamic_batching(self):
        server_args = get_global_server_args()
        return server_args.srt_encoder_url is not None

    def supports_native_grouped_requests(self):
        return True

    def supports_sequential_dit_inference(self):
        return True

    def supports_sequential_multi_output_inference(self):
        return current_platform.is_npu()

    def get_freqs_cis(self, batch, device, rotary_emb, dtype):
        height = batch.height // self.vae_scale_factor
        width = batch.width // self.vae_scale_factor
        hidden_states = torch.empty(1, 1, height, width, device=device, dtype=dtype)
        cos, sin = rotary_emb(hidden_states)
        cos = shard_rotary_emb_for_sp(cos)
        sin = shard_rotary_emb_for_sp(sin)
        return cos, sin

    def prepare_pos_cond_kwargs(self, batch, device, rotary_emb, dtype):
        kwargs = {
            "prior_token_id": batch.prior_token_id,
            "prior_token_drop": batch.prior_token_drop_cond,
            "crop_coords": batch.crop_coords,
            "target_size": batch.target_size,
            "freqs_cis": self.get_freqs_cis(batch, device, rotary_emb, dtype),
        }
        if getattr(batch, "prior_token_image_ids", None) is not None:
            kwargs["kv_caches"] = batch.kv_caches
            kwargs["kv_caches_mode"] = "read"
        return kwargs

    def prepare_neg_cond_kwargs(self, batch, device, rotary_emb, dtype):
        kwargs = {
            "prior_token_id": batch.prior_token_id,
            "prior_token_drop": batch.prior_token_drop_uncond,
            "crop_coords": batch.crop_coords,
            "target_size": batch.target_size,
            "freqs_cis": self.get_freqs_cis(batch, device, rotary_emb, dtype),
        }
        if getattr(batch, "prior_token_image_ids", None) is not None:
            kwargs["kv_caches"] = batch.kv_caches
            kwargs["kv_caches_mode"] = "skip"
        return kwargs

    def get_decode_scale_and_shift(self, device, dtype, vae):
        return _decode_scale_and_shift(
            tuple(self.vae_config.latents_mean),
            tuple(self.vae_config.latents_std),
            self.vae_config.latent_channels,
            device,
            dtype,
        )

    def post_denoising_loop(self, latents, batch):
        if getattr(batch, "kv_caches", None) is not None:
            batch.kv_caches.clear()
        return latents.bfloat16()

    def post_decoding(self, frames, server_args):
        return self.image_processor.postprocess(frames, output_type="latent")


def register():
    from sglang.multimodal_gen.configs.sample.glmimage import (
        GlmImageSamplingParams,
    )
    from sglang.multimodal_gen.registry import register_configs

    register_configs(
        sampling_param_cls=GlmImageSamplingParams,
        pipeline_config_cls=GlmImagePipelineConfig,
        model_detectors=[lambda hf_id: "glm-image" in hf_id.lower()],
    )
