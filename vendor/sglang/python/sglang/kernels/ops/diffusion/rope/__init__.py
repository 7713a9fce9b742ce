"""Rotary embeddings and the QK-norm chains fused around them."""
