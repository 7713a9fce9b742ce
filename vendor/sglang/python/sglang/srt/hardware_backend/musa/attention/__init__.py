from .flashattention_backend import MusaFlashAttentionBackend

__all__ = ["MusaFlashAttentionBackend"]
