# SPDX-License-Identifier: Apache-2.0

"""reusable session-scoped state implementations for realtime pipelines"""

from sglang.multimodal_gen.runtime.realtime.states.camera_control import (
    RealtimeCameraControlState,
)
from sglang.multimodal_gen.runtime.realtime.states.causal import (
    RealtimeCausalDecodeState,
    RealtimeCausalDiTState,
    get_realtime_causal_dit_state,
)

__all__ = [
    "RealtimeCameraControlState",
    "RealtimeCausalDecodeState",
    "RealtimeCausalDiTState",
    "get_realtime_causal_dit_state",
]
