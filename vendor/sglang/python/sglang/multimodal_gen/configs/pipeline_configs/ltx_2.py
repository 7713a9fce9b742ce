import dataclasses
from dataclasses import field
from typing import Callable, Optional

import torch

from sglang.multimodal_gen.configs.models.dits.ltx_2 import LTX2Config
from sglang.multimodal_gen.configs.models.encoders import (
    BaseEncoderOutput,
    EncoderConfig,
)
from sglang.multimodal_gen.configs.models.encoders.gemma_3 import Gemma3Config
from sglang.multimodal_gen.configs.models.vaes.ltx_audio import LTXAudioVAEConfig
from sglang.multimodal_gen.configs.models.vaes.ltx_video import (
    LTXVideoVAEConfig,
    get_ltx_video_decode_scale_and_shift,
)
from sglang.multimodal_gen.configs.pipeline_configs.base import (
    ModelTaskType,
    PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.model_deployment_config import (
    ModelDeploymentConfig,
)
from sglang.multimodal_gen.runtime.distributed import (
    get_sp_parallel_rank,
    get_sp_world_size,
)

# Distilled 3-step stage-2 sigma schedule. Single source of truth shared by
# LTX2TwoStagePipeline and the SANA-WM refiner stages (matches NVlabs
# `inference_sana_wm.py` / the LTX-2 distilled refiner).
STAGE_2_DISTILLED_SIGMA_VALUES: tuple[float, ...] = (0.909375, 0.725, 0.421875, 0.0)


def pack_text_embeds(
    text_hidden_states: torch.Tensor,
    sequence_lengths: torch.Tensor,
    padding_side: str = "left",
    scale_factor: int = 8,
    eps: float = 1e-6,
) -> torch.Tensor:
    """
    Packs and normalizes text encoder hidden states, respecting padding. Normalization is performed per-batch and
    per-layer in a masked fashion (only over non-padded positions).

    Args:
        text_hidden_states (`torch.Tensor` of shape `(batch_size, seq_len, hidden_dim, num_layers)`):
            Per-layer hidden_states from a text encoder (e.g. `Gemma3ForConditionalGeneration`).
        sequence_lengths (`torch.Tensor of shape `(batch_size,)`):
            The number of valid (non-padded) tokens for each batch instance.
        device: (`str` or `torch.device`, *optional*):
            torch device to place the resulting embeddings on
        padding_side: (`str`, *optional*, defaults to `"left"`):
            Whether the text tokenizer performs padding on the `"left"` or `"right"`.
        scale_factor (`int`, *optional*, defaults to `8`):
            Scaling factor to multiply the normalized hidden states by.
        eps (`float`, *optional*, defaults to `1e-6`):
            A small positive value for numerical stability when performing normalization.

    Returns:
        `torch.Tensor` of shape `(batch_size, seq_len, hidden_dim * num_layers)`:
            Normed and flattened text encoder hidden states.
    """
    batch_size, seq_len, hidden_dim, num_layers = text_hidden_states.shape
    original_dtype = text_hidden_states.dtype
    device = text_hidden_states.device

    # Create padding mask
    token_indices = torch.arange(seq_len, device=device).unsqueeze(0)
    if padding_side == "right":
        mask = token_indices < sequence_lengths[:, None]
    elif padding_side == "left":
        start_indices = seq_len - sequence_lengths[:, None]
        mask = token_indices >= start_indices
    else:
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side}")
    mask = mask[:, :, None, None]  # [batch_size, seq_len, 1, 1]

    masked_text_hidden_states = text_hidden_states.masked_fill(~mask, 0.0)
    num_valid_positions = (sequence_lengths * hidden_dim).view(batch_size, 1, 1, 1)
    masked_mean = masked_text_hidden_states.sum(dim=(1, 2), keepdim=True) / (
        num_valid_positions + eps
    )

    x_min = text_hidden_states.masked_fill(~mask, float("inf")).amin(
        dim=(1, 2), keepdim=True
    )
    x_max = text_hidden_states.masked_fill(~mask, float("-inf")).amax(
        dim=(1, 2), keepdim=True
    )

    normalized_hidden_states = (text_hidden_states - masked_mean) / (
        x_max - x_min + eps
    )
    normalized_hidden_states = normalized_hidden_states * scale_factor

    normalized_hidden_states = normalized_hidden_states.flatten(2)
    mask_flat = mask.squeeze(-1).expand(-1, -1, hidden_dim * num_layers)
    normalized_hidden_states = normalized_hidden_states.masked_fill(~mask_flat, 0.0)
    normalized_hidden_states = normalized_hidden_states.to(dtype=original_dtype)

    return normalized_hidden_states


def pack_text_embeds_v2(
    text_hidden_states: torch.Tensor,
    attention_mask: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """
    LTX-2.3 feature extractor pre-processing.

    Upstream `FeatureExtractorV2` applies per-token RMS normalization on each
    Gemma layer and then flattens `[hidden_dim, num_layers]` into the channel
    dimension, zeroing out padded positions afterwards.
    """

    variance = torch.mean(text_hidden_states**2, dim=2, keepdim=True)
    normalized_hidden_states = text_hidden_states * torch.rsqrt(variance + eps)
    normalized_hidden_states = normalized_hidden_states.flatten(2)
    mask = attention_mask.bool().unsqueeze(-1)
    return torch.where(
        mask, normalized_hidden_states, torch.zeros_like(normalized_hidden_states)
    )


def is_ltx23_native_variant(arch_config: object) -> bool:
    return str(getattr(arch_config, "ltx_variant", "ltx_2")) == "ltx_2_3"


def sync_ltx23_runtime_vae_markers(
    arch_config: object,
    loaded_vae_config: object | None,
) -> None:
    if loaded_vae_config is None:
        return
    source = getattr(loaded_vae_config, "arch_config", loaded_vae_config)
    for key in (
        "ltx_variant",
        "condition_encoder_subdir",
        "video_encoder_variant",
        "video_encoder_config",
        "video_decoder_variant",
        "video_decoder_config",
    ):
        value = getattr(source, key, None)
        if value is not None:
            setattr(arch_config, key, value)


def _gemma_postprocess_func(
    outputs: BaseEncoderOutput,
    text_inputs: dict,
    pipeline_config: Optional["LTX2PipelineConfig"] = None,
) -> torch.Tensor:
    # LTX-2 requires all hidden states concatenated for the connector
    if hasattr(outputs, "hidden_states") and outputs.hidden_states is not None:
        hidden_states = torch.stack(outputs.hidden_states, dim=-1)
        attention_mask = text_inputs["attention_mask"]
        if (
            pipeline_config is not None
            and pipeline_config.dit_config.arch_config.caption_proj_before_connector
        ):
            return pack_text_embeds_v2(hidden_states, attention_mask)

        sequence_lengths = attention_mask.sum(dim=-1)
        return pack_text_embeds(hidden_states, sequence_lengths, padding_side="left")
    else:
        raise AttributeError(
            "Unsupported text encoder output: expected `hidden_states`."
        )


@dataclasses.dataclass
class LTX2PipelineConfig(PipelineConfig):
    """Configuration for LTX-Video pipeline."""

    task_type: ModelTaskType = ModelTaskType.TI2V
    skip_input_image_preprocess: bool = True
    generator_device: str = "cpu"
    dit_config: LTX2Config = field(default_factory=LTX2Config)

    # Distilled checkpoints are trained against one fixed sigma schedule rather
    # than a step count. When set, it replaces the derived schedule.
    default_sigmas: tuple[float, ...] | None = None

    # Model architecture
    in_channels: int = 128
    out_channels: int = 128
    patch_size: int = 1
    patch_size_t: int = 1

    # Audio VAE configuration
    vae_config: LTXVideoVAEConfig = field(default_factory=LTXVideoVAEConfig)
    vae_precision: str = "bf16"
    audio_vae_config: LTXAudioVAEConfig = field(default_factory=LTXAudioVAEConfig)
    audio_vae_precision: str = "bf16"

    @property
    def vae_scale_factor(self):
        return self.vae_config.arch_config.spatial_compression_ratio

    @property
    def vae_temporal_compression(self):
        return self.vae_config.arch_config.temporal_compression_ratio

    def get_model_deployment_config(self) -> ModelDeploymentConfig:
        return ModelDeploymentConfig(
            keep_resident_min_available_gb=70,
            keep_resident_components=("dit",),
            auto_cfg_parallel_degree_by_num_gpus=((4, 1), (8, 1)),
            bcg_default_pipeline_class_names=("LTX2TwoStagePipeline",),
        )

    def prepare_latent_shape(self, batch, batch_size, num_frames):
        """Return unpacked latent shape [B, C, F, H, W]."""
        height = batch.height // self.vae_scale_factor
        width = batch.width // self.vae_scale_factor
        return (batch_size, self.in_channels, num_frames, height, width)

    def prepare_audio_latent_shape(self, batch, batch_size, num_frames):
        # Adapted from diffusers pipeline prepare_audio_latents
        duration_s = num_frames / batch.fps

        sample_rate = self.audio_vae_config.arch_config.sample_rate
        hop_length = self.audio_vae_config.arch_config.mel_hop_length
        temporal_compression = (
            self.audio_vae_config.arch_config.temporal_compression_ratio
        )

        latents_per_second = (
            float(sample_rate) / float(hop_length) / float(temporal_compression)
        )
        latent_length = round(duration_s * latents_per_second)

        num_mel_bins = self.audio_vae_config.arch_config.mel_bins
        mel_compression_ratio = self.audio_vae_config.arch_config.mel_compression_ratio
        latent_mel_bins = num_mel_bins // mel_compression_ratio

        # Default to 8
        num_channels_latents = self.audio_vae_config.arch_config.latent_channels

        return (batch_size, num_channels_latents, latent_length, latent_mel_bins)

    # Text encoding stage (Gemma)
    # LTX-2 needs separate contexts for video/audio streams. We model this as
    # two logical encoders sharing the same underlying `text_encoder` module.
    text_encoder_configs: tuple[EncoderConfig, ...] = field(
        default_factory=lambda: (Gemma3Config(),)
    )
    text_encoder_precisions: tuple[str, ...] = field(default_factory=lambda: ("bf16",))
    text_encoder_extra_args: list[dict] = field(default_factory=lambda: [{}])

    preprocess_text_funcs: tuple[Callable[[str], str] | None, ...] = field(
        default_factory=lambda: (None,)
    )
    postprocess_text_funcs: tuple[
        Callable[[BaseEncoderOutput, dict], torch.Tensor], ...
    ] = field(default_factory=lambda: (_gemma_postprocess_func,))

    def prepare_sigmas(self, sigmas, num_inference_steps):
        if sigmas is None:
            steps = int(num_inference_steps)
            if steps <= 0:
                raise ValueError(f"num_inference_steps must be positive, got {steps}")
            return [1.0 - i / steps for i in range(steps)]
        return sigmas

    def tokenize_prompt(self, prompt: list[str], tokenizer, tok_kwargs) -> dict:
        # Adapted from diffusers_pipeline.py _get_gemma_prompt_embeds
        # But we only need tokenization here, the embedding happens in TextEncodingStage
        # Official LTX Gemma tokenizer trims surrounding whitespace before
        # tokenization.
        prompt = [text.strip() for text in prompt]

        # Gemma expects left padding for chat-style prompts
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token

        max_sequence_length = tok_kwargs.get(
            "max_length", 1024
        )  # Default from diffusers pipeline

        text_inputs = tokenizer(
            prompt,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        return text_inputs

    def maybe_pack_latents(self, latents, batch_size, batch):
        # If already packed (3D shape [B, seq, C]), skip packing
        if latents.dim() == 3:
            return latents

        # Unpacked latents of shape are [B, C, F, H, W] are patched into tokens of shape [B, C, F // p_t, p_t, H // p, p, W // p, p].
        # The patch dimensions are then permuted and collapsed into the channel dimension of shape:
        # [B, F // p_t * H // p * W // p, C * p_t * p * p] (an ndim=3 tensor).
        # dim=0 is the batch size, dim=1 is the effective video sequence length, dim=2 is the effective number of input features
        batch_size, num_channels, num_frames, height, width = latents.shape
        post_patch_num_frames = num_frames // self.patch_size_t
        post_patch_height = height // self.patch_size
        post_patch_width = width // self.patch_size
        latents = latents.reshape(
            batch_size,
            -1,
            post_patch_num_frames,
            self.patch_size_t,
            post_patch_height,
            self.patch_size,
            post_patch_width,
            self.patch_size,
        )
        latents = latents.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)
        # Deliberately left non-contiguous: both flattens are views, so this
        # keeps the permuted strides. Normalising here would change which GEMM
        # kernel runs and move bf16 output. The fp8 path makes its own copy.
        return latents

    def _infer_video_latent_frames_and_tokens_per_frame(
        self, batch, seq_len: int
    ) -> tuple[int, int]:
        """Infer latent-frame count and tokens-per-frame for packed token latents [B, S, D].

        Notes:
        - This assumes `patch_size_t == 1` (no temporal patching).
        - Tokens are ordered as (frame, height, width) after packing.
        """
        if int(self.patch_size_t) != 1:
            raise ValueError(
                "LTX-2 SP time-sharding for packed token latents currently requires "
                f"{self.patch_size_t=}. (Expected 1)"
            )
        if int(seq_len) <= 0:
            raise ValueError(f"Expected {seq_len=} > 0 for packed token latents.")
        if int(self.vae_scale_factor) <= 0:
            raise ValueError(f"Invalid {self.vae_scale_factor=}. Must be > 0.")
        if int(self.patch_size) <= 0:
            raise ValueError(f"Invalid {self.patch_size=}. Must be > 0.")

        latent_height = int(batch.height) // int(self.vae_scale_factor)
        latent_width = int(batch.width) // int(self.vae_scale_factor)
        if latent_height <= 0 or latent_width <= 0:
            raise ValueError(
                "Invalid latent H/W computed from batch.height/width: "
                f"{batch.height=} {batch.width=} {self.vae_scale_factor=}"
            )
        if (latent_height % int(self.patch_size)) != 0 or (
            latent_width % int(self.patch_size)
        ) != 0:
            raise ValueError(
                "Invalid spatial patching for packed token latents. Expected latent H/W "
                "to be divisible by patch_size, got "
                f"{latent_height=} {latent_width=} {self.patch_size=}."
            )

        post_patch_h = latent_height // int(self.patch_size)
        post_patch_w = latent_width // int(self.patch_size)
        tokens_per_frame = int(post_patch_h) * int(post_patch_w)
        if tokens_per_frame <= 0:
            raise ValueError(
                f"Invalid tokens_per_frame={tokens_per_frame} from "
                f"{latent_height=} {latent_width=} {self.patch_size=}"
            )
        if int(seq_len) % int(tokens_per_frame) != 0:
            raise ValueError(
                f"LTX-2 token latents seq_len={seq_len} is not divisible by "
                f"tokens_per_frame={tokens_per_frame}. Cannot time-shard for SP."
            )
        latent_num_frames = int(seq_len) // int(tokens_per_frame)
        return int(latent_num_frames), int(tokens_per_frame)

    def shard_latents_for_sp(self, batch, latents):
        """Shard LTX-2 packed token latents across SP ranks by latent time (frame) dimension."""
        sp_world_size = get_sp_world_size()
        if sp_world_size <= 1:
            return latents, False

        # Default behavior for 5D latents.
        if isinstance(latents, torch.Tensor) and latents.ndim == 5:
            return super().shard_latents_for_sp(batch, latents)

        # LTX-2 packed token latents [B, S, D]
        if not (isinstance(latents, torch.Tensor) and latents.ndim == 3):
            return latents, False

        sp_rank = get_sp_parallel_rank()
        seq_len = int(latents.shape[1])
        latent_frames, tokens_per_frame = (
            self._infer_video_latent_frames_and_tokens_per_frame(batch, seq_len)
        )
        orig_latent_frames = int(latent_frames)

        # Pad whole frames so `latent_frames` is divisible by `sp_world_size`.
        pad_frames = (sp_world_size - (latent_frames % sp_world_size)) % sp_world_size
        batch.sp_video_has_padding = pad_frames > 0
        if pad_frames:
            pad_tokens = int(pad_frames) * int(tokens_per_frame)
            pad = torch.zeros(
                (latents.shape[0], pad_tokens, latents.shape[2]),
                device=latents.device,
                dtype=latents.dtype,
            )
            latents = torch.cat([latents, pad], dim=1)
            latent_frames = int(latent_frames) + int(pad_frames)

        local_frames = int(latent_frames) // int(sp_world_size)
        start_frame = int(sp_rank) * int(local_frames)
        valid_local_frames = max(
            min(int(orig_latent_frames) - int(start_frame), int(local_frames)), 0
        )
        start = int(start_frame) * int(tokens_per_frame)
        end = int(start) + int(local_frames) * int(tokens_per_frame)
        latents = latents[:, start:end, :]

        # Store SP metadata for denoising (TI2V gating) and model-side RoPE shift.
        batch.sp_video_latent_num_frames = int(local_frames)
        batch.sp_video_start_frame = int(start_frame)
        batch.sp_video_tokens_per_frame = int(tokens_per_frame)
        batch.sp_video_valid_token_count = int(valid_local_frames) * int(
            tokens_per_frame
        )

        return latents, True

    def gather_latents_for_sp(self, latents, batch=None):
        """Gather latents after SP. For packed token latents [B, S_local, D], gather on dim=1."""
        if get_sp_world_size() <= 1:
            return latents
        if isinstance(latents, torch.Tensor) and latents.ndim == 3:
            return self._gather_sp_tensor(latents, dim=1)
        return super().gather_latents_for_sp(latents, batch=batch)

    def shard_audio_latents_for_sp(self, batch, audio_latents):
        sp_world_size = get_sp_world_size()
        if sp_world_size <= 1:
            return audio_latents, False
        if not (isinstance(audio_latents, torch.Tensor) and audio_latents.ndim == 3):
            return audio_latents, False

        sp_rank = get_sp_parallel_rank()
        seq_len = int(audio_latents.shape[1])
        batch.sp_audio_orig_num_frames = int(seq_len)

        pad_frames = (sp_world_size - (seq_len % sp_world_size)) % sp_world_size
        batch.sp_audio_has_padding = pad_frames > 0
        if pad_frames:
            pad = torch.zeros(
                (audio_latents.shape[0], pad_frames, audio_latents.shape[2]),
                device=audio_latents.device,
                dtype=audio_latents.dtype,
            )
            audio_latents = torch.cat([audio_latents, pad], dim=1)
            seq_len += int(pad_frames)

        local_frames = seq_len // sp_world_size
        start_frame = sp_rank * local_frames
        end_frame = start_frame + local_frames
        valid_local_frames = max(
            min(
                int(batch.sp_audio_orig_num_frames) - int(start_frame),
                int(local_frames),
            ),
            0,
        )
        audio_latents = audio_latents[:, start_frame:end_frame, :]

        batch.sp_audio_latent_num_frames = int(local_frames)
        batch.sp_audio_start_frame = int(start_frame)
        batch.sp_audio_valid_token_count = int(valid_local_frames)
        return audio_latents, True

    def can_shard_audio_latents_for_sp(self, audio_latents) -> bool:
        return (
            get_sp_world_size() > 1
            and isinstance(audio_latents, torch.Tensor)
            and audio_latents.ndim == 3
        )

    def gather_audio_latents_for_sp(self, audio_latents, batch):
        """Gather packed audio latents after SP and trim any pad-only tail tokens."""
        if get_sp_world_size() <= 1:
            return audio_latents
        if not (isinstance(audio_latents, torch.Tensor) and audio_latents.ndim == 3):
            return audio_latents

        audio_latents = self._gather_sp_tensor(
            audio_latents,
            dim=1,
        )
        return self._trim_sp_gather_padding(
            audio_latents,
            orig_len=getattr(batch, "sp_audio_orig_num_frames", None),
            dim=1,
        )

    def prepare_video_rope_coords_for_sp(
        self,
        model,
        batch,
        latent_model_input,
        *,
        num_frames,
        height,
        width,
    ):
        if not batch.did_sp_shard_latents:
            return None
        return model.rope.prepare_video_coords(
            batch_size=int(latent_model_input.shape[0]),
            num_frames=num_frames,
            height=height,
            width=width,
            device=latent_model_input.device,
            fps=batch.fps,
            start_frame=int(batch.sp_video_start_frame),
        )

    def prepare_audio_rope_coords_for_sp(
        self,
        model,
        batch,
        audio_latent_model_input,
        *,
        num_frames,
    ):
        if not batch.did_sp_shard_audio_latents:
            return None
        return model.audio_rope.prepare_audio_coords(
            batch_size=int(audio_latent_model_input.shape[0]),
            num_frames=num_frames,
            device=audio_latent_model_input.device,
            start_frame=int(batch.sp_audio_start_frame),
        )

    def maybe_pack_audio_latents(self, latents, batch_size, batch):
        # If already packed (3D shape [B, T, C*F]), skip packing
        if latents.dim() == 3:
            return latents

        # Audio latents shape: [B, C, L, M], where L is the latent audio length and M is the number of mel bins
        # We need to pack them if patch_size/patch_size_t are defined for audio (not standard DiT patch size)

        # So for LTX-2 (unless we change patch sizes), we just do:
        latents = latents.transpose(1, 2).flatten(
            2, 3
        )  # [B, C, L, M] --> [B, L, C * M]
        return latents

    def get_pos_prompt_embeds(self, batch):
        # LTX-2 returns multiple prompt embed tensors (video/audio contexts).
        return (
            batch.prompt_embeds[0]
            if isinstance(batch.prompt_embeds, list)
            else batch.prompt_embeds
        )

    def get_neg_prompt_embeds(self, batch):
        return (
            batch.negative_prompt_embeds[0]
            if isinstance(batch.negative_prompt_embeds, list)
            else batch.negative_prompt_embeds
        )

    def get_decode_scale_and_shift(self, device, dtype, vae):
        return get_ltx_video_decode_scale_and_shift(
            device, dtype, vae, self.vae_config.arch_config
        )

    @staticmethod
    def _unpack_latents(
        latents: torch.Tensor,
        num_frames: int,
        height: int,
        width: int,
        patch_size: int = 1,
        patch_size_t: int = 1,
    ) -> torch.Tensor:
        # Packed latents of shape [B, S, D] (S is the effective video sequence length, D is the effective feature dimensions)
        # are unpacked and reshaped into a video tensor of shape [B, C, F, H, W]. This is the inverse operation of
        # what happens in the `_pack_latents` method.
        batch_size = latents.size(0)
        latents = latents.reshape(
            batch_size,
            num_frames,
            height,
            width,
            -1,
            patch_size_t,
            patch_size,
            patch_size,
        )
        latents = (
            latents.permute(0, 4, 1, 5, 2, 6, 3, 7)
            .flatten(6, 7)
            .flatten(4, 5)
            .flatten(2, 3)
        )
        return latents

    @staticmethod
    def _unpack_audio_latents(
        latents: torch.Tensor,
        latent_length: int,
        num_mel_bins: int,
        patch_size: int | None = None,
        patch_size_t: int | None = None,
    ) -> torch.Tensor:
        # Unpacks an audio patch sequence of shape [B, S, D] into a latent spectrogram tensor of shape [B, C, L, M],
        # where L is the latent audio length and M is the number of mel bins.
        if patch_size is not None and patch_size_t is not None:
            batch_size = latents.size(0)
            latents = latents.reshape(
                batch_size, latent_length, num_mel_bins, -1, patch_size_t, patch_size
            )
            latents = latents.permute(0, 3, 1, 4, 2, 5).flatten(4, 5).flatten(2, 3)
        else:
            # Assume [B, S, D] = [B, L, C * M], which implies that patch_size = M and patch_size_t = 1.
            latents = latents.unflatten(2, (-1, num_mel_bins)).transpose(1, 2)
        return latents

    def _unpad_and_unpack_latents(self, latents, audio_latents, batch, vae, audio_vae):
        # Calculate latent dimensions
        # Assuming batch has height, width, num_frames
        height = batch.height
        width = batch.width
        num_frames = batch.num_frames

        # Get compression ratios
        # Default LTX-2 values if not present in config
        vae_spatial_compression_ratio = getattr(
            self.vae_config.arch_config, "spatial_compression_ratio", 32
        )
        vae_temporal_compression_ratio = getattr(
            self.vae_config.arch_config, "temporal_compression_ratio", 8
        )

        latent_height = height // vae_spatial_compression_ratio
        latent_width = width // vae_spatial_compression_ratio
        latent_num_frames = (num_frames - 1) // vae_temporal_compression_ratio + 1

        latents = self._unpack_latents(
            latents,
            latent_num_frames,
            latent_height,
            latent_width,
            self.patch_size,
            self.patch_size_t,
        )

        sample_rate = self.audio_vae_config.arch_config.sample_rate
        hop_length = self.audio_vae_config.arch_config.mel_hop_length
        temporal_compression = (
            self.audio_vae_config.arch_config.temporal_compression_ratio
        )
        duration_s = num_frames / batch.fps

        latents_per_second = (
            float(sample_rate) / float(hop_length) / float(temporal_compression)
        )
        audio_num_frames = round(duration_s * latents_per_second)

        num_mel_bins = self.audio_vae_config.arch_config.mel_bins
        mel_compression_ratio = self.audio_vae_config.arch_config.mel_compression_ratio
        latent_mel_bins = num_mel_bins // mel_compression_ratio

        audio_latents = self._unpack_audio_latents(
            audio_latents, audio_num_frames, num_mel_bins=latent_mel_bins
        )

        return latents, audio_latents


@dataclasses.dataclass
class LTX23PipelineConfig(LTX2PipelineConfig):
    """Configuration overrides for LTX-2.3."""

    # original-mode lora swaps invalidate post-warmup timing calibration
    supports_auto_residency: bool = False


def register():
    from sglang.multimodal_gen.configs.sample.ltx_2 import (
        LTX2SamplingParams,
        LTX23HQSamplingParams,
        LTX23SamplingParams,
    )
    from sglang.multimodal_gen.registry import register_configs

    register_configs(
        sampling_param_cls=LTX2SamplingParams,
        pipeline_config_cls=LTX2PipelineConfig,
        hf_model_paths=["Lightricks/LTX-2"],
        model_detectors=[
            lambda path: "ltx" in path.lower() and "video" in path.lower(),
            lambda path: (
                "ltx-2" in path.lower()
                and "ltx-2.3" not in path.lower()
                and "ltx-2.5" not in path.lower()
            ),
        ],
    )
    register_configs(
        sampling_param_cls=LTX23SamplingParams,
        pipeline_config_cls=LTX23PipelineConfig,
        hf_model_paths=["Lightricks/LTX-2.3"],
        model_detectors=[
            lambda path: "ltx-2.3" in path.lower(),
        ],
        pipeline_config_registry_entries={
            "LTX2TwoStageHQPipeline": (LTX2PipelineConfig, LTX23HQSamplingParams),
        },
    )
