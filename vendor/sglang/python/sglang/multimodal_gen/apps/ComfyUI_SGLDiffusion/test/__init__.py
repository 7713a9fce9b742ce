"""
Test suite for ComfyUI SGLDiffusion pipelines.

This package contains tests for each ComfyUI pipeline integration:
- ZImagePipeline
- FluxPipeline
- QwenImagePipeline
- QwenImageEditPipeline
"""
