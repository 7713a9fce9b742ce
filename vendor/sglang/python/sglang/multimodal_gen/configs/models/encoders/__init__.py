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
from sglang.multimodal_gen.configs.models.encoders.gemma_3 import Gemma3Config
from sglang.multimodal_gen.configs.models.encoders.llama import LlamaConfig
from sglang.multimodal_gen.configs.models.encoders.qwen3 import Qwen3TextConfig
from sglang.multimodal_gen.configs.models.encoders.t5 import T5Config

__all__ = [
    "EncoderConfig",
    "TextEncoderConfig",
    "ImageEncoderConfig",
    "BaseEncoderOutput",
    "CLIPTextConfig",
    "CLIPVisionConfig",
    "LlamaConfig",
    "Qwen3TextConfig",
    "T5Config",
    "Gemma3Config",
]
