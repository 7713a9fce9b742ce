# SPDX-License-Identifier: Apache-2.0
"""Cosmos3 pipeline configuration.

A single config serves T2V, I2V, and T2I — same checkpoint, same DiT, same
VAE. ``task_type`` is ``TI2V`` so the request validator accepts an optional
``image_path`` (for I2V) without requiring it. Per-modality dispatch happens
in the stages from ``num_frames`` and ``image_path``; T2I overrides
``data_type`` to ``IMAGE`` in :meth:`SamplingParams._adjust`.
"""

import functools
import os
from dataclasses import dataclass, field
from typing import ClassVar

from sglang.multimodal_gen.configs.models import DiTConfig, VAEConfig
from sglang.multimodal_gen.configs.models.dits.cosmos3video import Cosmos3VideoConfig
from sglang.multimodal_gen.configs.models.vaes import WanVAEConfig
from sglang.multimodal_gen.configs.pipeline_configs.base import (
    ModelTaskType,
    PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.model_deployment_config import (
    ModelDeploymentConfig,
)

COSMOS3_EDGE_BACKBONE_TYPE = "cosmos3_edge_nemotron_dense"
COSMOS3_NANO_ARCH_SIGNATURE = (4096, 36, 32)
COSMOS3_NANO_KEEP_RESIDENT_MIN_AVAILABLE_GB = 90
COSMOS3_DEFAULT_KEEP_RESIDENT_MIN_AVAILABLE_GB = 120


@functools.lru_cache(maxsize=None)
def _transformer_config(model_path: str) -> dict:
    from sglang.multimodal_gen.runtime.utils.hf_diffusers_utils import (
        get_diffusers_component_config,
    )

    return get_diffusers_component_config(
        component_path=os.path.join(model_path, "transformer")
    )


@functools.lru_cache(maxsize=None)
def is_edge_checkpoint(model_path: str) -> bool:
    """Whether the checkpoint is the Edge (dense) variant.

    Read from the transformer config rather than the loaded arch so the answer
    is available before the weights are on device (e.g. when resolving sampling
    defaults in the client process).
    """
    config = _transformer_config(model_path)
    return (
        config.get("backbone_type") == COSMOS3_EDGE_BACKBONE_TYPE
        or config.get("hidden_act") == "relu2"
    )


@functools.lru_cache(maxsize=None)
def is_nano_checkpoint(model_path: str) -> bool:
    """Whether the checkpoint uses the Nano transformer architecture."""
    config = _transformer_config(model_path)
    signature = (
        config.get("hidden_size"),
        config.get("num_hidden_layers"),
        config.get("num_attention_heads"),
    )
    return signature == COSMOS3_NANO_ARCH_SIGNATURE


@functools.lru_cache(maxsize=None)
def _distilled_sampler_config(model_path: str) -> dict | None:
    """The fixed-step sampler config for a distilled checkpoint, else ``None``.

    Distillation is a scheduler-only change: the checkpoint ships a
    ``FlowMatchEulerDiscreteScheduler`` with an explicit fixed-step sigma
    schedule instead of the multi-step FlowUniPC the other variants use.
    """
    from sglang.multimodal_gen.runtime.utils.hf_diffusers_utils import (
        get_diffusers_component_config,
    )

    config = get_diffusers_component_config(
        component_path=os.path.join(model_path, "scheduler")
    )
    if config.get("_class_name") != "FlowMatchEulerDiscreteScheduler":
        return None
    sampler = config.get("fixed_step_sampler_config")
    if not sampler or not sampler.get("t_list"):
        return None
    return sampler


def get_distilled_sigmas(model_path: str) -> list[float] | None:
    """The explicit fixed-step sigma schedule for a distilled checkpoint."""
    sampler = _distilled_sampler_config(model_path)
    return list(sampler["t_list"]) if sampler is not None else None


@dataclass
class Cosmos3Config(PipelineConfig):
    """Cosmos3 unified pipeline config.

    Cosmos3 reuses the Wan VAE (48 latent channels, 4× temporal, 16× spatial),
    a UniPC rectified-flow sampler, and a ~15B-parameter dual-pathway DiT.
    There is no separate text encoder — text is tokenized and embedded inside
    the transformer.
    """

    # TI2V (text + image → video) so the request validator accepts ``image_path``
    # without requiring it. T2V ignores it; I2V uses it; T2I disregards it.
    task_type: ModelTaskType = ModelTaskType.TI2V
    supported_task_types: ClassVar[tuple[ModelTaskType, ...]] = (
        ModelTaskType.TI2V,
        ModelTaskType.T2I,
        ModelTaskType.V2V,
    )

    dit_config: DiTConfig = field(default_factory=Cosmos3VideoConfig)

    # Wan VAE with 48 latent channels (overridden in __post_init__ below).
    vae_config: VAEConfig = field(default_factory=WanVAEConfig)
    vae_tiling: bool = False
    vae_sp: bool = False

    # Cosmos3 reference inference uses FlowUniPC even when the checkpoint
    # scheduler_config.json advertises a different scheduler class.
    scheduler_class_override: str | None = "FlowUniPCMultistepScheduler"

    # Per-request mode defaults are applied in Cosmos3TimestepPreparationStage.
    flow_shift: float | None = None

    precision: str = "bf16"
    vae_precision: str = "bf16"

    # Pipeline-level (not sampling) knobs.
    max_sequence_length: int = 4096
    use_duration_template: bool = True
    use_system_prompt: bool = False

    # Filesystem path to dataset-derived action stats (JSON) for action
    # (de)normalization. Set at server launch rather than per request, since it
    # names a server-side file. ``None`` disables normalization.
    action_stats_path: str | None = None

    # Pre-computed once in update_config_from_dict from the resolved model_path.
    # None until that point (e.g. in unit-test mocks that never call update_config_from_dict).
    is_edge: bool | None = None
    is_nano: bool | None = None
    distilled_sigmas: list[float] | None = None

    def __post_init__(self):
        self.vae_config.arch_config.z_dim = 48
        # Encoder is needed for I2V; T2V/T2I never invoke it.
        self.vae_config.load_encoder = True
        self.vae_config.load_decoder = True
        # keep WanVAE encode replicated because parallel encode changes I2V
        # conditioning latents when sp_world_size > 1
        self.vae_config.use_parallel_encode = False
        self.vae_config.use_parallel_decode = True

    def update_config_from_dict(self, args, prefix: str = "") -> None:
        super().update_config_from_dict(args, prefix)
        # model_path is only populated here, after construction. Compute
        # checkpoint variant flags once so per-request code reads them from the
        # config rather than re-downloading the scheduler subfolder each time.
        if self.model_path:
            self.distilled_sigmas = get_distilled_sigmas(self.model_path)
            self.is_edge = is_edge_checkpoint(self.model_path)
            self.is_nano = is_nano_checkpoint(self.model_path)
            if self.distilled_sigmas is not None:
                self.scheduler_class_override = None

    def adjust_num_frames(self, num_frames: int, *, log_adjustment: bool = True) -> int:
        """Round ``num_frames`` so ``(n - 1) % 4 == 0`` for the VAE.

        Skips rounding when ``num_frames == 1`` (T2I path) so the single
        frame survives untouched.
        """
        if num_frames == 1:
            return 1
        vae_scale_factor_temporal = 4
        if (num_frames - 1) % vae_scale_factor_temporal != 0:
            num_frames = (
                (num_frames - 1) // vae_scale_factor_temporal
            ) * vae_scale_factor_temporal + 1
        return num_frames

    def supports_action_endpoint(self) -> bool:
        # The public Cosmos3 family shares one pipeline/config across visual-only
        # and action-capable checkpoints. The loaded transformer validates that
        # an action head is actually present when an action request is submitted.
        return True

    def get_model_deployment_config(self) -> ModelDeploymentConfig:
        # Keep the DiT and VAE resident when the GPUs have the headroom.
        is_nano = self.is_nano
        if is_nano is None:
            # Directly constructed configs in callers/tests have not resolved
            # checkpoint metadata yet; registered model IDs remain unambiguous.
            is_nano = "cosmos3-nano" in (self.model_path or "").lower()
        threshold_gb = (
            COSMOS3_NANO_KEEP_RESIDENT_MIN_AVAILABLE_GB
            if is_nano
            else COSMOS3_DEFAULT_KEEP_RESIDENT_MIN_AVAILABLE_GB
        )
        return ModelDeploymentConfig(
            keep_resident_min_available_gb=threshold_gb,
            keep_resident_components=("dit", "vae"),
        )


def register():
    from sglang.multimodal_gen.configs.sample.cosmos3 import (
        Cosmos3SamplingParams,
    )
    from sglang.multimodal_gen.registry import register_configs

    register_configs(
        sampling_param_cls=Cosmos3SamplingParams,
        pipeline_config_cls=Cosmos3Config,
        hf_model_paths=[
            "nvidia/Cosmos3-Nano",
            "nvidia/Cosmos3-Nano-Policy-DROID",
            "nvidia/Cosmos3-Super",
            "nvidia/Cosmos3-Super-Text2Image",
            "nvidia/Cosmos3-Super-Image2Video",
            "nvidia/Cosmos3-Edge",
        ],
        model_detectors=[lambda hf_id: "cosmos3omni" in hf_id.lower()],
    )
