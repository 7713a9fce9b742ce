"""Experimental Marlin LoRA implementation."""
