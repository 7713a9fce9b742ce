"""Common server test helpers."""
