"""Fallback operations for sliding-window MLA attention paths."""
