"""Backend implementations of stage-boundary fusion.

The boundary selects these candidates; compute kernels stay with their backend.
"""
