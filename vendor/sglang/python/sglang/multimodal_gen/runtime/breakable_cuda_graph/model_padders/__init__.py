"""Model-specific prompt padders for diffusion breakable CUDA graph."""
