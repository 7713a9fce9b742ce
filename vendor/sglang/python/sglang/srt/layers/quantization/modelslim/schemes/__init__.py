# SPDX-License-Identifier: Apache-2.0

from .modelslim_scheme import ModelSlimLinearScheme, ModelSlimMoEScheme
from .modelslim_w4a4_int4 import ModelSlimW4A4Int4
from .modelslim_w4a8_int8_moe import ModelSlimW4A8Int8MoE
from .modelslim_w8a8_int8 import ModelSlimW8A8Int8
from .modelslim_w8a8_int8_moe import ModelSlimW8A8Int8MoE

__all__ = [
    "ModelSlimLinearScheme",
    "ModelSlimMoEScheme",
    "ModelSlimW8A8Int8",
    "ModelSlimW4A4Int4",
    "ModelSlimW4A8Int8MoE",
    "ModelSlimW8A8Int8MoE",
]
