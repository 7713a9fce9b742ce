# SPDX-License-Identifier: Apache-2.0

from .gptq_cpu import GPTQIntelAMXLinearScheme, GPTQIntelAMXMoEScheme
from .gptq_linear import (
    GPTQAscendLinearScheme,
    GPTQLinearScheme,
    GPTQXPULinearScheme,
)
from .gptq_marlin import GPTQMarlinLinearScheme
from .gptq_moe import GPTQMarlinMoEScheme, GPTQMoEAscendScheme
from .gptq_scheme import GPTQLinearSchemeBase, GPTQMoESchemeBase

__all__ = [
    "GPTQLinearSchemeBase",
    "GPTQMoESchemeBase",
    "GPTQLinearScheme",
    "GPTQAscendLinearScheme",
    "GPTQXPULinearScheme",
    "GPTQIntelAMXLinearScheme",
    "GPTQMarlinLinearScheme",
    "GPTQMoEAscendScheme",
    "GPTQIntelAMXMoEScheme",
    "GPTQMarlinMoEScheme",
]
