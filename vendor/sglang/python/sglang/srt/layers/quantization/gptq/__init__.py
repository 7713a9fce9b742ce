# SPDX-License-Identifier: Apache-2.0

from .gptq import (
    CPUGPTQConfig,
    GPTQAscendConfig,
    GPTQConfig,
    GPTQLinearMethod,
    GPTQMarlinConfig,
    GPTQMarlinLinearMethod,
    GPTQMarlinMoEMethod,
    GPTQMoEMethod,
    GPTQXPUConfig,
    check_marlin_format,
)
from .schemes import (
    GPTQAscendLinearScheme,
    GPTQIntelAMXLinearScheme,
    GPTQIntelAMXMoEScheme,
    GPTQLinearScheme,
    GPTQMarlinLinearScheme,
    GPTQMarlinMoEScheme,
    GPTQMoEAscendScheme,
    GPTQXPULinearScheme,
)

__all__ = [
    "GPTQConfig",
    "GPTQAscendConfig",
    "CPUGPTQConfig",
    "GPTQMarlinConfig",
    "GPTQLinearMethod",
    "GPTQMoEMethod",
    "GPTQMarlinLinearMethod",
    "GPTQMarlinMoEMethod",
    "GPTQLinearScheme",
    "GPTQAscendLinearScheme",
    "GPTQXPULinearScheme",
    "GPTQXPUConfig",
    "GPTQIntelAMXLinearScheme",
    "GPTQIntelAMXMoEScheme",
    "GPTQMarlinLinearScheme",
    "GPTQMoEAscendScheme",
    "GPTQMarlinMoEScheme",
    "check_marlin_format",
]
