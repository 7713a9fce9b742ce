from sglang.srt.ray.engine import RayEngine

__all__ = ["RayEngine"]
