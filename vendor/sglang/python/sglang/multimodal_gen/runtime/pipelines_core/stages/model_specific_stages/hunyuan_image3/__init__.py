"""HunyuanImage-3 native pipeline stages."""

from .ar_stage import HunyuanImage3AR
from .decoding import HunyuanImage3DecodingStage

__all__ = ["HunyuanImage3AR", "HunyuanImage3DecodingStage"]
