from sglang.srt.mem_cache.sparsity.backend.backend_adaptor import (
    BackendAdaptor,
    DSABackendAdaptor,
    FlashAttentionAdaptor,
)

__all__ = ["BackendAdaptor", "FlashAttentionAdaptor", "DSABackendAdaptor"]
