"""Opt-in KPool metadata kernels; ordinary DSA kernels remain unchanged."""
