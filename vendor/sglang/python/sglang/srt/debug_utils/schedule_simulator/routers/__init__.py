from sglang.srt.debug_utils.schedule_simulator.routers.base import RouterPolicy
from sglang.srt.debug_utils.schedule_simulator.routers.random_router import RandomRouter
from sglang.srt.debug_utils.schedule_simulator.routers.round_robin_router import (
    RoundRobinRouter,
)
from sglang.srt.debug_utils.schedule_simulator.routers.sticky_router import StickyRouter

__all__ = ["RouterPolicy", "RandomRouter", "RoundRobinRouter", "StickyRouter"]
