from sglang.srt.mem_cache.sparsity.backend.backend_adaptor import (
    BackendAdaptor,
    FlashAttentionAdaptor,
    NSABackendAdaptor,
)

__all__ = ["BackendAdaptor", "FlashAttentionAdaptor", "NSABackendAdaptor"]
