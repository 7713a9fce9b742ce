# SPDX-License-Identifier: Apache-2.0
from .vmoba import (
    moba_attn_varlen as moba_attn_varlen,
    process_moba_input as process_moba_input,
    process_moba_output as process_moba_output,
)

__all__ = ["moba_attn_varlen", "process_moba_input", "process_moba_output"]
