# SPDX-License-Identifier: Apache-2.0

from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
    CausalAttentionKVView,
    CausalSelfAttentionKVCache,
    CrossAttentionKVCache,
)

__all__ = [
    "CausalAttentionKVView",
    "CausalSelfAttentionKVCache",
    "CrossAttentionKVCache",
]
