# SPDX-License-Identifier: Apache-2.0

from sglang.multimodal_gen.configs.models.upsamplers.kandinsky6_sr import (
    Kandinsky6SRLatentUpscalerEntryConfig,
)

__all__ = ["Kandinsky6SRLatentUpscalerEntryConfig"]
