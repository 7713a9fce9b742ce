from sglang.srt.configs.afmoe import AfmoeConfig
from sglang.srt.configs.bailing_hybrid import BailingHybridConfig, BailingMoeV3VLConfig
from sglang.srt.configs.bailing_moe_v2 import BailingMM2Config
from sglang.srt.configs.beam import BeamConfig
from sglang.srt.configs.chatglm import ChatGLMConfig
from sglang.srt.configs.cohere2_moe import Cohere2MoeConfig
from sglang.srt.configs.cosmos3 import (
    Cosmos3Config,
    Cosmos3EdgeConfig,
    Cosmos3EdgeProjectorConfig,
    Cosmos3EdgeTextConfig,
    Cosmos3EdgeVisionConfig,
)
from sglang.srt.configs.dbrx import DbrxConfig
from sglang.srt.configs.deepseekvl2 import DeepseekVL2Config
from sglang.srt.configs.dots3 import Dots3Config
from sglang.srt.configs.dots_ocr import DotsOCRConfig
from sglang.srt.configs.dots_vlm import DotsVLMConfig
from sglang.srt.configs.exaone import ExaoneConfig
from sglang.srt.configs.falcon_h1 import FalconH1Config
from sglang.srt.configs.gigachat35 import GigaChat35Config
from sglang.srt.configs.glm5_next import Glm5NextConfig, Glm5NextTextConfig
from sglang.srt.configs.granitemoehybrid import GraniteMoeHybridConfig
from sglang.srt.configs.hy_v4 import HYV4Config
from sglang.srt.configs.inkling import (
    InklingAudioConfig,
    InklingMMConfig,
    InklingModelConfig,
    InklingVisionConfig,
)
from sglang.srt.configs.interns2_mobius import (
    InternS2MobiusConfig,
    InternS2MobiusTextConfig,
    InternS2MobiusVisionConfig,
)
from sglang.srt.configs.interns2preview import InternS2PreviewConfig
from sglang.srt.configs.iquest_q1 import (
    IQuestQ1Config,
    IQuestQ1MTPConfig,
)
from sglang.srt.configs.janus_pro import MultiModalityConfig
from sglang.srt.configs.jet_nemotron import JetNemotronConfig
from sglang.srt.configs.jet_vlm import JetVLMConfig
from sglang.srt.configs.k2_horizon import K2HorizonConfig, XllmConfig
from sglang.srt.configs.kimi_k3 import KimiK3Config
from sglang.srt.configs.kimi_k25 import KimiK25Config
from sglang.srt.configs.kimi_linear import KimiLinearConfig
from sglang.srt.configs.kimi_vl import KimiVLConfig
from sglang.srt.configs.kimi_vl_moonvit import MoonViTConfig
from sglang.srt.configs.laguna import LagunaConfig
from sglang.srt.configs.lfm2 import Lfm2Config
from sglang.srt.configs.lfm2_moe import Lfm2MoeConfig
from sglang.srt.configs.lfm2_vl import Lfm2VlConfig
from sglang.srt.configs.locate_anything import LocateAnythingConfig
from sglang.srt.configs.longcat_flash import LongcatFlashConfig
from sglang.srt.configs.mamba import FalconMambaConfig, MambaConfig
from sglang.srt.configs.mamba2 import Mamba2Config
from sglang.srt.configs.minicpm import MiniCPMHybridConfig
from sglang.srt.configs.minicpmv4_6 import MiniCPMV4_6Config, MiniCPMV4_6VisionConfig
from sglang.srt.configs.minicpmv4_7 import MiniCPMV4_7Config
from sglang.srt.configs.minimax_vl import MiniMaxM3VLConfig
from sglang.srt.configs.muse_glimmer import (
    MuseGlimmerAssistantConfig,
    MuseGlimmerConfig,
)
from sglang.srt.configs.muse_spark import (
    MuseSparkConfig,
    MuseSparkTextConfig,
)
from sglang.srt.configs.nanbeige import NanbeigeConfig
from sglang.srt.configs.nano_nemotron_vl import (
    NemotronH_Nano_Omni_Reasoning_V3_Config,
    NemotronH_Nano_VL_V2_Config,
    NemotronH_Omni_Reasoning_V3_Config,
)
from sglang.srt.configs.nemotron_h import NemotronHConfig, NemotronHPuzzleConfig
from sglang.srt.configs.olmo3 import Olmo3Config
from sglang.srt.configs.qwen3_5 import (
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)
from sglang.srt.configs.qwen3_asr import Qwen3ASRConfig
from sglang.srt.configs.qwen3_next import Qwen3NextConfig
from sglang.srt.configs.qwen4_exp import Qwen4ExpConfig, Qwen4ExpTextConfig
from sglang.srt.configs.spark2_5 import Spark2_5Config
from sglang.srt.configs.step3_vl import (
    Step3TextConfig,
    Step3VisionEncoderConfig,
    Step3VLConfig,
)
from sglang.srt.configs.step3p5 import Step3p5Config
from sglang.srt.configs.step3p7 import Step3p7Config
from sglang.srt.configs.unlimited_ocr import UnlimitedVLConfig
from sglang.srt.configs.zaya import ZayaConfig

__all__ = [
    "AfmoeConfig",
    "BailingHybridConfig",
    "BailingMM2Config",
    "BailingMoeV3VLConfig",
    "BeamConfig",
    "ExaoneConfig",
    "ChatGLMConfig",
    "Cosmos3Config",
    "Cosmos3EdgeConfig",
    "Cosmos3EdgeTextConfig",
    "Cosmos3EdgeVisionConfig",
    "Cosmos3EdgeProjectorConfig",
    "DbrxConfig",
    "DeepseekVL2Config",
    "LongcatFlashConfig",
    "MultiModalityConfig",
    "KimiVLConfig",
    "MoonViTConfig",
    "K2HorizonConfig",
    "XllmConfig",
    "Step3VLConfig",
    "Step3TextConfig",
    "Step3VisionEncoderConfig",
    "Olmo3Config",
    "MuseGlimmerConfig",
    "MuseGlimmerAssistantConfig",
    "MuseSparkConfig",
    "MuseSparkTextConfig",
    "Glm5NextConfig",
    "Glm5NextTextConfig",
    "KimiLinearConfig",
    "KimiK3Config",
    "KimiK25Config",
    "LagunaConfig",
    "Qwen3NextConfig",
    "Qwen4ExpConfig",
    "Qwen4ExpTextConfig",
    "Qwen3_5Config",
    "Qwen3_5MoeConfig",
    "Qwen3_5TextConfig",
    "Qwen3_5MoeTextConfig",
    "InternS2PreviewConfig",
    "IQuestQ1Config",
    "IQuestQ1MTPConfig",
    "InternS2MobiusConfig",
    "InternS2MobiusTextConfig",
    "InternS2MobiusVisionConfig",
    "DotsVLMConfig",
    "DotsOCRConfig",
    "Dots3Config",
    "FalconH1Config",
    "FalconMambaConfig",
    "GigaChat35Config",
    "GraniteMoeHybridConfig",
    "HYV4Config",
    "MambaConfig",
    "Mamba2Config",
    "Lfm2Config",
    "Lfm2MoeConfig",
    "Lfm2VlConfig",
    "LocateAnythingConfig",
    "MiniCPMV4_6Config",
    "MiniCPMV4_6VisionConfig",
    "MiniCPMV4_7Config",
    "NemotronHConfig",
    "NemotronHPuzzleConfig",
    "NemotronH_Nano_VL_V2_Config",
    "NemotronH_Nano_Omni_Reasoning_V3_Config",
    "NemotronH_Omni_Reasoning_V3_Config",
    "NanbeigeConfig",
    "JetNemotronConfig",
    "JetVLMConfig",
    "MiniCPMHybridConfig",
    "Step3p5Config",
    "MiniMaxM3VLConfig",
    "Spark2_5Config",
    "Step3p7Config",
    "Qwen3ASRConfig",
    "InklingAudioConfig",
    "InklingMMConfig",
    "InklingModelConfig",
    "InklingVisionConfig",
    "UnlimitedVLConfig",
    "ZayaConfig",
]
