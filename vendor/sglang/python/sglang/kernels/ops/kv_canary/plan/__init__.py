from sglang.kernels.ops.kv_canary.plan.api import launch_canary_plan_kernels
