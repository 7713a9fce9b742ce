"""The contract an NVIDIA megakernel plugin implements (``spec``); SGLang's
integration lives in ``sglang.srt.kernel_plugins.nvidia``."""
