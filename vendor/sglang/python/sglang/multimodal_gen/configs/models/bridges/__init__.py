# SPDX-License-Identifier: Apache-2.0

from sglang.multimodal_gen.configs.models.bridges.mova_dual_tower import (
    MOVADualTowerConfig,
)

__all__ = ["MOVADualTowerConfig"]
