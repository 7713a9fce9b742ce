"""Attention-method fixtures for attention backend unit tests."""
