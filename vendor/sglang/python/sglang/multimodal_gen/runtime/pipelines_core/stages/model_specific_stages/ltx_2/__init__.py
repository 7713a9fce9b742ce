# SPDX-License-Identifier: Apache-2.0

"""LTX-2-specific pipeline stages"""

from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.ltx_2.decoding_av import (
    LTX2AVDecodingStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.ltx_2.denoising import (
    LTX2DenoisingStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.ltx_2.denoising_av import (
    LTX2AVDenoisingStage,
    LTX2RefinementStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.ltx_2.duration import (
    LTX2DurationStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.ltx_2.latent_preparation_av import (
    LTX2AVLatentPreparationStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.ltx_2.text_connector import (
    LTX2TextConnectorStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.ltx_2.upsampling import (
    LTX2HalveResolutionStage,
    LTX2LoRASwitchStage,
    LTX2UpsampleStage,
)

__all__ = [
    "LTX2AVDecodingStage",
    "LTX2DurationStage",
    "LTX2AVDenoisingStage",
    "LTX2AVLatentPreparationStage",
    "LTX2DenoisingStage",
    "LTX2HalveResolutionStage",
    "LTX2LoRASwitchStage",
    "LTX2RefinementStage",
    "LTX2TextConnectorStage",
    "LTX2UpsampleStage",
]
