from .lora_ops import sgemm_lora_a_fwd, sgemm_lora_b_fwd

__all__ = [
    "sgemm_lora_a_fwd",
    "sgemm_lora_b_fwd",
]
