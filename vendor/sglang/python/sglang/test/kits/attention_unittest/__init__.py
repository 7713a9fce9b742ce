"""Shared fixtures for manual attention backend unit tests."""
