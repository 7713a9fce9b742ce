"""Runner orchestration helpers for attention backend unit tests."""
