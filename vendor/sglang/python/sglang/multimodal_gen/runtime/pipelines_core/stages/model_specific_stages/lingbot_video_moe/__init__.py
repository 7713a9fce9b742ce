# SPDX-License-Identifier: Apache-2.0
"""LingBot-Video MoE model-specific pipeline stages."""

from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.lingbot_video_moe.text_encoding import (  # noqa: F401
    LingBotVideoTextEncodingStage,
)
