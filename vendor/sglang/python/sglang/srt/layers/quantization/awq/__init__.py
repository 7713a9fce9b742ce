# SPDX-License-Identifier: Apache-2.0

from sglang.kernels.ops.quantization.awq_triton import (
    awq_dequantize_decomposition,
    awq_dequantize_triton,
)

from .awq import (
    AWQConfig,
    AWQCPUConfig,
    AWQLinearMethod,
    AWQMarlinConfig,
    AWQMoEMethod,
    AWQXPUConfig,
)
from .schemes import (
    AWQAscendLinearScheme,
    AWQAscendMoEScheme,
    AWQLinearScheme,
    AWQMarlinLinearScheme,
    AWQMoEScheme,
)

__all__ = [
    "AWQConfig",
    "AWQCPUConfig",
    "AWQMarlinConfig",
    "AWQXPUConfig",
    "AWQLinearMethod",
    "AWQMoEMethod",
    "AWQLinearScheme",
    "AWQMarlinLinearScheme",
    "AWQAscendLinearScheme",
    "AWQMoEScheme",
    "AWQAscendMoEScheme",
    "awq_dequantize_triton",
    "awq_dequantize_decomposition",
]
