from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
from sglang.srt.layers.moe.moe_runner.runner import MoeRunner

__all__ = ["MoeRunnerConfig", "MoeRunner"]
