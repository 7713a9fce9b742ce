"""Model-specific helpers and stages for diffusion pipeline components."""
