# SPDX-License-Identifier: Apache-2.0
from sglang.multimodal_gen.runtime.layers.attention.backends.cube_sparse_attn.backend import (
    CubeSparseAttentionBackend,
    CubeSparseAttentionImpl,
    CubeSparseAttentionMetadata,
    CubeSparseAttentionMetadataBuilder,
    cube_sparse_attention,
)

__all__ = [
    "CubeSparseAttentionBackend",
    "CubeSparseAttentionImpl",
    "CubeSparseAttentionMetadata",
    "CubeSparseAttentionMetadataBuilder",
    "cube_sparse_attention",
]
