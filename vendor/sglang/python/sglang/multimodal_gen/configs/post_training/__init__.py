# SPDX-License-Identifier: Apache-2.0

"""Configuration for post-training and RL-related features (e.g. rollout)."""

from sglang.multimodal_gen.configs.post_training.rl_rollout import RLRolloutArgs

__all__ = ["RLRolloutArgs"]
