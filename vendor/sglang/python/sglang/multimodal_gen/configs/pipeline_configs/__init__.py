# Copied and adapted from: https://github.com/hao-ai-lab/FastVideo

from sglang.multimodal_gen.configs.pipeline_configs.base import (
    PipelineConfig,
    SlidingTileAttnConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.diffusers_generic import (
    DiffusersGenericPipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.flux import (
    Flux2KleinPipelineConfig,
    Flux2PipelineConfig,
    FluxPipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.flux_finetuned import (
    Flux2FinetunedPipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.hunyuan import (
    FastHunyuanConfig,
    HunyuanConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.ltx_2 import LTX2PipelineConfig
from sglang.multimodal_gen.configs.pipeline_configs.mova import MOVAPipelineConfig
from sglang.multimodal_gen.configs.pipeline_configs.wan import (
    SelfForcingWanT2V480PConfig,
    WanI2V480PConfig,
    WanI2V720PConfig,
    WanT2V480PConfig,
    WanT2V720PConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.zimage import ZImagePipelineConfig

__all__ = [
    "DiffusersGenericPipelineConfig",
    "HunyuanConfig",
    "FastHunyuanConfig",
    "FluxPipelineConfig",
    "Flux2PipelineConfig",
    "Flux2KleinPipelineConfig",
    "Flux2FinetunedPipelineConfig",
    "PipelineConfig",
    "SlidingTileAttnConfig",
    "MOVAPipelineConfig",
    "WanT2V480PConfig",
    "WanI2V480PConfig",
    "WanT2V720PConfig",
    "WanI2V720PConfig",
    "SelfForcingWanT2V480PConfig",
    "ZImagePipelineConfig",
    "LTX2PipelineConfig",
]
