"""Multimodal input-processing kernels."""

from sglang.kernels.ops.mm.process.image import normalize_and_patchify
from sglang.kernels.ops.mm.process.lanczos import lanczos_resize

__all__ = ["normalize_and_patchify", "lanczos_resize"]
