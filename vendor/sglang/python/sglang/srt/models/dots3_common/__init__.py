"""Shared implementation modules for Dots3 models."""
