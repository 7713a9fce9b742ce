"""SGLang's integration of out-of-tree kernel plugins, per hardware: startup checks,
the build and the model-forward dispatch. The contracts the plugins implement live
in ``sglang.kernels.plugin_kernels``."""
