"""Kernel wrappers for sparse attention quantized cache operations."""
