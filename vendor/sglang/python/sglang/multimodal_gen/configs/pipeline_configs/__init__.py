# Copied and adapted from: https://github.com/hao-ai-lab/FastVideo

from sglang.multimodal_gen.configs.pipeline_configs.base import (
    PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.cosmos3 import Cosmos3Config
from sglang.multimodal_gen.configs.pipeline_configs.cosmos3_multiview import (
    Cosmos3MultiviewConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.cosmos_dreams import (
    CosmosDreamsConfig,
    CosmosDreamsRealtimeConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.cosmos_dreams_transfer import (
    CosmosDreamsTransferConfig,
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
from sglang.multimodal_gen.configs.pipeline_configs.helios import (
    HeliosDistilledConfig,
    HeliosMidConfig,
    HeliosT2VConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.hunyuan import (
    FastHunyuanConfig,
    HunyuanConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.hunyuan3d import (
    Hunyuan3D2PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.hunyuan_image3 import (
    HunyuanImage3PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.ideogram import (
    Ideogram4DistilledPipelineConfig,
    Ideogram4PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.lingbot_video_moe import (
    LingBotVideoMoEPipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.lingbot_world import (
    LingBotWorldCausalDMDConfig,
    LingBotWorldV2CausalDMDConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.llada_image import (
    LLaDAImagePipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.ltx_2 import (
    LTX2PipelineConfig,
    LTX23PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.minimax_h3 import (
    FastH3PipelineConfig,
    MiniMaxH3PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.mova import MOVAPipelineConfig
from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig
from sglang.multimodal_gen.configs.pipeline_configs.sana import SanaPipelineConfig
from sglang.multimodal_gen.configs.pipeline_configs.sana_video import (
    SanaVideoPipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.sensenova_u1 import (
    SenseNovaU1PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.stablediffusion3 import (
    StableDiffusion3PipelineConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.wan import (
    SelfForcingWanT2V480PConfig,
    WanI2V480PConfig,
    WanI2V720PConfig,
    WanT2V480PConfig,
    WanT2V720PConfig,
)
from sglang.multimodal_gen.configs.pipeline_configs.zimage import ZImagePipelineConfig

__all__ = [
    "Cosmos3Config",
    "Cosmos3MultiviewConfig",
    "CosmosDreamsConfig",
    "CosmosDreamsRealtimeConfig",
    "CosmosDreamsTransferConfig",
    "DiffusersGenericPipelineConfig",
    "HeliosDistilledConfig",
    "HeliosMidConfig",
    "HeliosT2VConfig",
    "HunyuanConfig",
    "FastHunyuanConfig",
    "Hunyuan3D2PipelineConfig",
    "HunyuanImage3PipelineConfig",
    "Ideogram4PipelineConfig",
    "Ideogram4DistilledPipelineConfig",
    "LLaDAImagePipelineConfig",
    "FluxPipelineConfig",
    "Flux2PipelineConfig",
    "Flux2KleinPipelineConfig",
    "Flux2FinetunedPipelineConfig",
    "PipelineConfig",
    "SanaPipelineConfig",
    "SanaVideoPipelineConfig",
    "SenseNovaU1PipelineConfig",
    "MOVAPipelineConfig",
    "Pi05PipelineConfig",
    "StableDiffusion3PipelineConfig",
    "WanT2V480PConfig",
    "WanI2V480PConfig",
    "WanT2V720PConfig",
    "WanI2V720PConfig",
    "SelfForcingWanT2V480PConfig",
    "ZImagePipelineConfig",
    "LTX2PipelineConfig",
    "LTX23PipelineConfig",
    "LingBotWorldCausalDMDConfig",
    "LingBotWorldV2CausalDMDConfig",
    "LingBotVideoMoEPipelineConfig",
    "FastH3PipelineConfig",
    "MiniMaxH3PipelineConfig",
]
