# Copied and adapted from: https://github.com/hao-ai-lab/FastVideo

# SPDX-License-Identifier: Apache-2.0

from sglang.multimodal_gen.runtime.layers.attention.backends.attention_backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from sglang.multimodal_gen.runtime.layers.attention.layer import (
    DynamicVarlenMaskMeta,
    LocalAttention,
    UlyssesAttention,
    UlyssesAttention_VSA,
    USPAttention,
    build_varlen_mask_meta,
    build_varlen_mask_meta_from_lengths,
    build_varlen_mask_meta_from_ranges,
)
from sglang.multimodal_gen.runtime.layers.attention.selector import get_attn_backend
from sglang.multimodal_gen.runtime.layers.attention.turbo_layer import MinimalA2AAttnOp

__all__ = [
    "USPAttention",
    "LocalAttention",
    "DynamicVarlenMaskMeta",
    "UlyssesAttention",
    "UlyssesAttention_VSA",
    "MinimalA2AAttnOp",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    # "AttentionState",
    "get_attn_backend",
    "build_varlen_mask_meta",
    "build_varlen_mask_meta_from_lengths",
    "build_varlen_mask_meta_from_ranges",
]
