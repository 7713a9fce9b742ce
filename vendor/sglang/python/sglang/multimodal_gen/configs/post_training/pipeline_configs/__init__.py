# SPDX-License-Identifier: Apache-2.0
"""Rollout / RL hooks mixed into multimodal pipeline configs."""

from sglang.multimodal_gen.configs.post_training.pipeline_configs.qwen_image_rollout_pipeline_mixin import (
    QwenImageRolloutPipelineMixin,
)
from sglang.multimodal_gen.configs.post_training.pipeline_configs.zimage_rollout_pipeline_mixin import (
    ZImageRolloutPipelineMixin,
)

__all__ = [
    "QwenImageRolloutPipelineMixin",
    "ZImageRolloutPipelineMixin",
]
