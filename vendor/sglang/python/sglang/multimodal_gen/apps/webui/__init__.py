from .main import run_sgl_diffusion_webui

__all__ = ["run_sgl_diffusion_webui"]
