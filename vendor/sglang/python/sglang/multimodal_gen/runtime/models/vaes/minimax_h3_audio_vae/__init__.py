# SPDX-License-Identifier: Apache-2.0

from .audio_vae import DacAudioVAE

__all__ = ["DacAudioVAE"]
