from sglang.srt.models.inkling_common.quantization.config import (
    InklingModelOptNvfp4Config,
    InklingQuantizationConfigBase,
    get_quantization_config,
)
from sglang.srt.models.inkling_common.quantization.quant import (
    InklingMoEMethodBase,
    InklingNvfp4MoEMethod,
)

__all__ = [
    "InklingModelOptNvfp4Config",
    "InklingQuantizationConfigBase",
    "get_quantization_config",
    "InklingMoEMethodBase",
    "InklingNvfp4MoEMethod",
]
