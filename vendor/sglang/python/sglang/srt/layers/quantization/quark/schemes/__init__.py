# SPDX-License-Identifier: Apache-2.0

from .quark_scheme import QuarkLinearScheme, QuarkMoEScheme
from .quark_w4a4_mxfp4 import QuarkW4A4MXFP4
from .quark_w4a4_mxfp4_moe import QuarkW4A4MXFp4MoE
from .quark_w4a8_mxfp4_moe import QuarkW4A8MXFp4MoE
from .quark_w8a8_fp8 import QuarkW8A8Fp8
from .quark_w8a8_fp8_moe import QuarkW8A8FP8MoE

__all__ = [
    "QuarkLinearScheme",
    "QuarkMoEScheme",
    "QuarkW4A4MXFP4",
    "QuarkW8A8Fp8",
    "QuarkW4A4MXFp4MoE",
    "QuarkW4A8MXFp4MoE",
    "QuarkW8A8FP8MoE",
]
