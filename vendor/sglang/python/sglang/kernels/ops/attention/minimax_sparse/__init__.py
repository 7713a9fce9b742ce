"""MiniMax sparse-attention kernels (RFC #29630, Phase 2.5)."""
