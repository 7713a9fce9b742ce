"""Vision tower, image preprocessing and VL expert routing for DeepSeek-V4.1."""
