# SPDX-License-Identifier: Apache-2.0

"""Kandinsky6-specific pipeline stages."""

from .decoding import Kandinsky6AudioDecodingStage, Kandinsky6DecodingStage
from .denoising import Kandinsky6DenoisingStage
from .image_encoding import Kandinsky6ImageEncodingStage
from .latent_preparation import Kandinsky6LatentPreparationStage

__all__ = [
    "Kandinsky6AudioDecodingStage",
    "Kandinsky6DecodingStage",
    "Kandinsky6DenoisingStage",
    "Kandinsky6ImageEncodingStage",
    "Kandinsky6LatentPreparationStage",
]
