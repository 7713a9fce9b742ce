from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
from sglang.srt.layers.moe.moe_runner.runner import MoeRunner, register_moe_runner_core

__all__ = ["MoeRunnerConfig", "MoeRunner", "register_moe_runner_core"]
