"""SM90/SM100 grouped GEMMs for BF16 and FP8, with masked or contiguous rows.

Mainloops derive from the CUTLASS dense persistent examples (NVIDIA BSD-3).
"""
