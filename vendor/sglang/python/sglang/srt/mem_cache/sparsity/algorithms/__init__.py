from sglang.srt.mem_cache.sparsity.algorithms.base_algorithm import (
    BaseSparseAlgorithm,
    BaseSparseAlgorithmImpl,
)
from sglang.srt.mem_cache.sparsity.algorithms.deepseek_dsa import DeepSeekDSAAlgorithm
from sglang.srt.mem_cache.sparsity.algorithms.quest_algorithm import QuestAlgorithm

__all__ = [
    "BaseSparseAlgorithm",
    "BaseSparseAlgorithmImpl",
    "DeepSeekDSAAlgorithm",
    "QuestAlgorithm",
]
