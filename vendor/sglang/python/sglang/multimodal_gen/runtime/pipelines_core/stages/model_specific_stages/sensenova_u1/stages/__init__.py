# SPDX-License-Identifier: Apache-2.0
"""Pipeline lifecycle stages for the native SenseNova-U1 implementation."""

from .generation import SenseNovaU1GenerationStage

__all__ = ["SenseNovaU1GenerationStage"]
