"""Plugin kernel backend (``KernelBackend.PLUGIN``).

The contracts of external kernel libraries that load as SGLang plugins, by
hardware and then model. SGLang's integration of them lives in
``sglang.srt.kernel_plugins``.
"""
