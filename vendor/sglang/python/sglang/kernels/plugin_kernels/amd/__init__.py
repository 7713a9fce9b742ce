"""The contract an AMD monokernel plugin implements (``spec``); SGLang's
integration lives in ``sglang.srt.kernel_plugins.amd``."""
