"""
ComfyUI SGLang Diffusion executors package.
Provides executor classes for different model types.
"""

from .base import SGLDiffusionExecutor
from .flux import FluxExecutor
from .qwen_image import QwenImageEditExecutor, QwenImageExecutor
from .zimage import ZImageExecutor

__all__ = [
    "SGLDiffusionExecutor",
    "FluxExecutor",
    "ZImageExecutor",
    "QwenImageExecutor",
    "QwenImageEditExecutor",
]
