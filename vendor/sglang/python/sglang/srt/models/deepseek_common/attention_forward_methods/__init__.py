from .forward_methods import AttnForwardMethod
from .forward_mha import DeepseekMHAForwardMixin
from .forward_mha_rocm import DeepseekMHARocmForwardMixin
from .forward_mla import DeepseekMLAForwardMixin
from .forward_mla_fused_rope_cpu import DeepseekMLACpuForwardMixin
from .forward_mla_fused_rope_rocm import DeepseekMLAFusedRopeRocmForwardMixin
from .forward_mla_rocm import DeepseekMLARocmForwardMixin

__all__ = [
    "AttnForwardMethod",
    "DeepseekMHAForwardMixin",
    "DeepseekMHARocmForwardMixin",
    "DeepseekMLACpuForwardMixin",
    "DeepseekMLAForwardMixin",
    "DeepseekMLAFusedRopeRocmForwardMixin",
    "DeepseekMLARocmForwardMixin",
]
