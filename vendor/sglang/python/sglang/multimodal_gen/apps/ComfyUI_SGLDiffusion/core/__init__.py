"""
Core components for SGLang Diffusion ComfyUI integration.
Provides generator, model patcher, and server API client.
"""

from .generator import SGLDiffusionGenerator
from .model_patcher import SGLDModelPatcher
from .server_api import SGLDiffusionServerAPI

__all__ = [
    "SGLDiffusionGenerator",
    "SGLDModelPatcher",
    "SGLDiffusionServerAPI",
]
