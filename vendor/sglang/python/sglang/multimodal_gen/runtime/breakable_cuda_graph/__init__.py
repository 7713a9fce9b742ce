"""Diffusion breakable CUDA graph runtime helpers."""
