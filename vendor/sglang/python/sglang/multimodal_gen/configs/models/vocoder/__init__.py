from sglang.multimodal_gen.configs.models.vocoder.ltx_vocoder import LTXVocoderConfig

__all__ = ["LTXVocoderConfig"]
