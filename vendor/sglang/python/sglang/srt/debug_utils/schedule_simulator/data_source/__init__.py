from sglang.srt.debug_utils.schedule_simulator.data_source.data_loader import (
    load_from_request_logger,
)
from sglang.srt.debug_utils.schedule_simulator.data_source.data_synthesis import (
    generate_gsp_requests,
    generate_random_requests,
)

__all__ = [
    "load_from_request_logger",
    "generate_random_requests",
    "generate_gsp_requests",
]
