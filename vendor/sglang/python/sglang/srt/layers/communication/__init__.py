"""Runtime integration and state for fused communication operators."""
