# SPDX-License-Identifier: Apache-2.0
"""Audio codec building blocks; the registry entry lives in ../kandinsky6_audio.py."""

from .bigvgan import BigVGANV2
from .mel_converter import MelConverter
from .mmaudio_vae import DiagonalGaussianDistribution, MMAudioVAE

__all__ = ["BigVGANV2", "DiagonalGaussianDistribution", "MMAudioVAE", "MelConverter"]
