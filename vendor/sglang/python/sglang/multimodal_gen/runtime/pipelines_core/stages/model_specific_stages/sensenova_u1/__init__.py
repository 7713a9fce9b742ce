# SPDX-License-Identifier: Apache-2.0
"""Model-specific helpers and stages for SenseNova-U1."""

from .stages import SenseNovaU1GenerationStage

__all__ = ["SenseNovaU1GenerationStage"]
