# SPDX-License-Identifier: Apache-2.0

from .klvae import AutoencoderKLLegacy

__all__ = ["AutoencoderKLLegacy"]
