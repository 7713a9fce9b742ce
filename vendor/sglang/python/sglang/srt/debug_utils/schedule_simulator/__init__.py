from sglang.srt.debug_utils.schedule_simulator.data_source import (
    generate_gsp_requests,
    generate_random_requests,
    load_from_request_logger,
)
from sglang.srt.debug_utils.schedule_simulator.entrypoint import create_arg_parser, main
from sglang.srt.debug_utils.schedule_simulator.gpu_state import GPUState, StepRecord
from sglang.srt.debug_utils.schedule_simulator.metrics import (
    AttentionComputeBalancednessRecorder,
    AvgBatchSizeRecorder,
    BatchSizeBalancednessRecorder,
    MetricRecorder,
)
from sglang.srt.debug_utils.schedule_simulator.request import SimRequest
from sglang.srt.debug_utils.schedule_simulator.routers import (
    RandomRouter,
    RoundRobinRouter,
    RouterPolicy,
    StickyRouter,
)
from sglang.srt.debug_utils.schedule_simulator.schedulers import (
    FIFOScheduler,
    SchedulerPolicy,
)
from sglang.srt.debug_utils.schedule_simulator.simulator import (
    SimulationResult,
    Simulator,
)

__all__ = [
    "SimRequest",
    "GPUState",
    "Simulator",
    "SimulationResult",
    "StepRecord",
    "RouterPolicy",
    "RandomRouter",
    "RoundRobinRouter",
    "StickyRouter",
    "SchedulerPolicy",
    "FIFOScheduler",
    "MetricRecorder",
    "BatchSizeBalancednessRecorder",
    "AttentionComputeBalancednessRecorder",
    "AvgBatchSizeRecorder",
    "load_from_request_logger",
    "generate_random_requests",
    "generate_gsp_requests",
    "create_arg_parser",
    "main",
]
