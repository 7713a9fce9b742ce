from aiter.ops.triton.batched_gemm_afp4wfp4_pre_quant import (
    batched_gemm_afp4wfp4_pre_quant,
)
from aiter.ops.triton.fused_mxfp4_quant import (
    fused_flatten_mxfp4_quant,
    fused_rms_mxfp4_quant,
)

__all__ = [
    "fused_rms_mxfp4_quant",
    "fused_flatten_mxfp4_quant",
    "batched_gemm_afp4wfp4_pre_quant",
]
