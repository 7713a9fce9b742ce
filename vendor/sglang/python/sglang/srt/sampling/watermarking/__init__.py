from .detector import (
    WatermarkDetection,
    WatermarkDetector,
    WatermarkStatistics,
    detect,
)

__all__ = [
    "WatermarkDetection",
    "WatermarkDetector",
    "WatermarkStatistics",
    "detect",
]
