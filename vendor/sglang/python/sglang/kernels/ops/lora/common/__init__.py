"""Shared LoRA routing, shrink and expand kernels."""
