"""SGLang-owned FlashAttention-4 kernels and launch policy for SM120."""
