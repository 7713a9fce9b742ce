# SPDX-License-Identifier: Apache-2.0

from sglang.multimodal_gen.configs.models.decoders.ltx_2_5_diffusion_decoder import (
    LTX25DiffusionDecoderArchConfig,
    LTX25DiffusionDecoderConfig,
)

__all__ = [
    "LTX25DiffusionDecoderArchConfig",
    "LTX25DiffusionDecoderConfig",
]
