# Copied and adapted from: https://github.com/hao-ai-lab/FastVideo

from sglang.multimodal_gen.configs.models.encoders.base import (
    BaseEncoderOutput,
    EncoderConfig,
    ImageEncoderConfig,
    TextEncoderConfig,
)
from sglang.multimodal_gen.configs.models.encoders.clip import (
    CLIPTextConfig,
    CLIPVisionConfig,
)
from sglang.multimodal_gen.configs.models.encoders.flux_2 import (
    FLUX_2_SYSTEM_MESSAGE,
    Flux2MistralTextConfig,
    build_flux2_text_messages,
)
from sglang.multimodal_gen.configs.models.encoders.gemma2 import Gemma2Config
from sglang.multimodal_gen.configs.models.encoders.gemma_3 import Gemma3Config
from sglang.multimodal_gen.configs.models.encoders.gemma_4_unified import (
    Gemma4UnifiedConfig,
)
from sglang.multimodal_gen.configs.models.encoders.ideogram import (
    Ideogram4TextEncoderConfig,
)
from sglang.multimodal_gen.configs.models.encoders.llama import LlamaConfig
from sglang.multimodal_gen.configs.models.encoders.minimax_h3_qwen3vl import (
    MiniMaxH3Qwen3VLArchConfig,
    MiniMaxH3Qwen3VLConfig,
)
from sglang.multimodal_gen.configs.models.encoders.qwen3 import Qwen3TextConfig
from sglang.multimodal_gen.configs.models.encoders.qwen3vl import Qwen3VLConfig
from sglang.multimodal_gen.configs.models.encoders.t5 import T5Config

__all__ = [
    "EncoderConfig",
    "TextEncoderConfig",
    "ImageEncoderConfig",
    "BaseEncoderOutput",
    "CLIPTextConfig",
    "CLIPVisionConfig",
    "FLUX_2_SYSTEM_MESSAGE",
    "Flux2MistralTextConfig",
    "build_flux2_text_messages",
    "LlamaConfig",
    "MiniMaxH3Qwen3VLArchConfig",
    "MiniMaxH3Qwen3VLConfig",
    "Qwen3TextConfig",
    "Qwen3VLConfig",
    "T5Config",
    "Gemma2Config",
    "Gemma3Config",
    "Gemma4UnifiedConfig",
    "Ideogram4TextEncoderConfig",
]
