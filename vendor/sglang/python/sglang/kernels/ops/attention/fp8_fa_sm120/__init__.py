# SPDX-License-Identifier: Apache-2.0
"""SM120 FP8 attention: CuTe-DSL kernel, fused Triton prep and the per-call entry point."""

from sglang.kernels.ops.attention.fp8_fa_sm120.plan import (
    HEAD_DIM,
    Workspace,
    fp8_attention,
    kernel_key,
    validate_inputs,
)

__all__ = ["HEAD_DIM", "Workspace", "fp8_attention", "kernel_key", "validate_inputs"]
