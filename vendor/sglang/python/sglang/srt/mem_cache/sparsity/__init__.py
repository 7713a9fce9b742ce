from sglang.srt.mem_cache.sparsity.algorithms import (
    BaseSparseAlgorithm,
    BaseSparseAlgorithmImpl,
    DeepSeekDSAAlgorithm,
    QuestAlgorithm,
)
from sglang.srt.mem_cache.sparsity.backend import BackendAdaptor, FlashAttentionAdaptor
from sglang.srt.mem_cache.sparsity.core import SparseConfig, SparseCoordinator
from sglang.srt.mem_cache.sparsity.factory import (
    create_sparse_coordinator,
    get_sparse_coordinator,
    parse_hisparse_config,
    register_sparse_coordinator,
)

__all__ = [
    "BaseSparseAlgorithm",
    "BaseSparseAlgorithmImpl",
    "QuestAlgorithm",
    "DeepSeekDSAAlgorithm",
    "BackendAdaptor",
    "FlashAttentionAdaptor",
    "SparseConfig",
    "SparseCoordinator",
    "create_sparse_coordinator",
    "get_sparse_coordinator",
    "parse_hisparse_config",
    "register_sparse_coordinator",
]
