"""LMCache-backed KV cache integrations."""
