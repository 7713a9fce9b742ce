# SPDX-License-Identifier: Apache-2.0
"""JoyEcho-specific pipeline stages."""

from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.joy_echo.denoising import (
    JoyEchoDMDDenoisingStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.joy_echo.memory import (
    JoyEchoAVDecodingStage,
    JoyEchoMemoryBankFetchStage,
    PairedAudioVideoMemoryBank,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.joy_echo.setup import (
    JoyEchoMultishotSetupStage,
    JoyEchoSigmaPreparationStage,
)

__all__ = [
    "JoyEchoAVDecodingStage",
    "JoyEchoDMDDenoisingStage",
    "JoyEchoMemoryBankFetchStage",
    "JoyEchoMultishotSetupStage",
    "JoyEchoSigmaPreparationStage",
    "PairedAudioVideoMemoryBank",
]
