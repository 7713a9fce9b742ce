# SPDX-License-Identifier: Apache-2.0

from .awq_cpu import AWQIntelAMXLinearScheme, AWQIntelAMXMoEScheme
from .awq_linear import (
    AWQAscendLinearScheme,
    AWQLinearScheme,
    AWQXPULinearScheme,
)
from .awq_marlin import AWQMarlinLinearScheme
from .awq_moe import AWQAscendMoEScheme, AWQMoEScheme
from .awq_scheme import AWQLinearSchemeBase, AWQMoESchemeBase

__all__ = [
    "AWQLinearSchemeBase",
    "AWQMoESchemeBase",
    "AWQLinearScheme",
    "AWQAscendLinearScheme",
    "AWQXPULinearScheme",
    "AWQIntelAMXLinearScheme",
    "AWQMarlinLinearScheme",
    "AWQMoEScheme",
    "AWQAscendMoEScheme",
    "AWQIntelAMXMoEScheme",
]
