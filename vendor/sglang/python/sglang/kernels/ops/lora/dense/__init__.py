"""Triton LoRA GEMM kernels (SGMV, chunked SGMV, absorbed-MLA correction) and the
CSGMV tuning-config loader with its ``csgmv_configs/`` data."""
