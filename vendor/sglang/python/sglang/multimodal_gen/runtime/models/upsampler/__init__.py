from sglang.multimodal_gen.runtime.models.upsampler.latent_upsampler import (
    LatentUpsampler,
)

__all__ = ["LatentUpsampler"]
