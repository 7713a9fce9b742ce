"""MoE LoRA execution plans, runner, and base-GEMM providers."""
