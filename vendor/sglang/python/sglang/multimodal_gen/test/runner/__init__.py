"""Shared helpers for multimodal_gen test runners."""
