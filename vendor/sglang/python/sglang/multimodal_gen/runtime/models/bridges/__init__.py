# SPDX-License-Identifier: Apache-2.0

from sglang.multimodal_gen.runtime.models.bridges.mova_dual_tower import (
    DualTowerConditionalBridge,
)

__all__ = ["DualTowerConditionalBridge"]
