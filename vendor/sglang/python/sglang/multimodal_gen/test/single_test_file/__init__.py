"""Standalone multimodal_gen test files run as CI single-file suites."""
