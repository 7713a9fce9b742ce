"""Shared fixtures and TreeCore inspectors for the UnifiedRadixCache unit tests."""
