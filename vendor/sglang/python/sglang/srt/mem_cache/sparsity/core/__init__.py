from sglang.srt.mem_cache.sparsity.core.sparse_coordinator import (
    RequestTrackers,
    SparseConfig,
    SparseCoordinator,
)

__all__ = [
    "RequestTrackers",
    "SparseConfig",
    "SparseCoordinator",
]
