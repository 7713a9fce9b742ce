"""Tuned dispatch configs for device communicators."""
