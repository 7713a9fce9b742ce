"""LoRA loading and pipeline integration."""
