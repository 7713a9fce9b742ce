from sglang.srt.debug_utils.comparator.visualizer.figure import (  # noqa: F401
    generate_comparison_figure,
)
