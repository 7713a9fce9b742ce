from .forward_methods import AttnForwardMethod
from .forward_mha import DeepseekMHAForwardMixin

__all__ = [
    "AttnForwardMethod",
    "DeepseekMHAForwardMixin",
]
