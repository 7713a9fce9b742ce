"""Activation-function fusions (SiLU/GLU/GELU epilogues)."""
