from sglang.srt.debug_utils.schedule_simulator.schedulers.base import SchedulerPolicy
from sglang.srt.debug_utils.schedule_simulator.schedulers.fifo_scheduler import (
    FIFOScheduler,
)

__all__ = ["SchedulerPolicy", "FIFOScheduler"]
