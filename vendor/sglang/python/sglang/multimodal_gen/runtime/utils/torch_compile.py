# SPDX-License-Identifier: Apache-2.0

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from sglang.multimodal_gen.runtime.platforms import current_platform
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

logger = init_logger(__name__)


def maybe_enable_inductor_compute_comm_overlap() -> None:
    try:
        import torch._inductor.config as _inductor_cfg

        _inductor_cfg.reorder_for_compute_comm_overlap = True
    except ImportError:
        pass


def apply_inductor_config(overrides: dict[str, Any]) -> None:
    """Apply a model's torch._inductor.config overrides before it is compiled."""
    import torch._inductor.config as _inductor_cfg

    for name, value in overrides.items():
        if not hasattr(_inductor_cfg, name):
            logger.warning("Unknown torch._inductor.config option %r, ignoring", name)
            continue
        setattr(_inductor_cfg, name, value)
    if overrides.get("multi_kernel_hints"):
        # torch reads its saved multi-kernel pick through sub-kernels an
        # FX-graph cache hit has not restored yet (triton _hash_lock is None),
        # so every warm restart fails the compile -- under TP on one rank only,
        # which deadlocks the others. Without the saved pick, each process
        # re-picks during warmup.
        os.environ.setdefault("TORCHINDUCTOR_DISABLE_MULTI_KERNEL_CACHE", "1")


def build_torch_compile_kwargs(
    *,
    mode: str | None,
    module: nn.Module | None = None,
    enable_inductor_compute_comm_overlap: bool = False,
) -> dict[str, object]:
    compile_kwargs: dict[str, object] = {"fullgraph": False, "dynamic": None}
    if current_platform.is_out_of_tree():
        backend = current_platform.get_compile_backend(mode)
        compile_kwargs["backend"] = backend
        if module is not None:
            options = current_platform.get_compile_options(module)
            if options is not None:
                compile_kwargs["options"] = options
        if (
            "options" not in compile_kwargs
            and backend == "inductor"
            and mode is not None
        ):
            compile_kwargs["mode"] = mode
    elif current_platform.is_npu():
        from sglang.srt.utils.common import get_compiler_backend

        compile_kwargs["backend"] = get_compiler_backend()
        compile_kwargs["dynamic"] = False
    elif mode is not None:
        compile_kwargs["mode"] = mode
    if (
        enable_inductor_compute_comm_overlap
        and compile_kwargs.get("backend", "inductor") == "inductor"
    ):
        maybe_enable_inductor_compute_comm_overlap()
    return compile_kwargs


def resolve_torch_compile_mode(
    *env_names: str,
    config: object | None = None,
    default: str,
) -> str:
    for env_name in env_names:
        mode = os.environ.get(env_name)
        if mode:
            return mode
    mode = getattr(config, "torch_compile_mode", None)
    if mode:
        return mode
    return default


def resolve_torch_compile_kwargs(
    *env_names: str,
    config: object | None = None,
    default: str,
    module: nn.Module | None = None,
    enable_inductor_compute_comm_overlap: bool = False,
) -> tuple[dict[str, object], str | None]:
    mode = None
    if not current_platform.is_npu():
        mode = resolve_torch_compile_mode(*env_names, config=config, default=default)
    compile_kwargs = build_torch_compile_kwargs(
        mode=mode,
        module=module,
        enable_inductor_compute_comm_overlap=enable_inductor_compute_comm_overlap,
    )
    return compile_kwargs, mode


def compile_matching_submodules(
    module: nn.Module,
    *,
    compile_kwargs: dict[str, object],
) -> int:
    conditions = getattr(module, "_compile_conditions", ())
    matches = [
        submodule
        for name, submodule in module.named_modules()
        if name and any(condition(name, submodule) for condition in conditions)
    ]
    if not matches:
        raise ValueError(
            "regional compile found no matching submodules; "
            f"check {type(module).__name__}._compile_conditions"
        )

    for submodule in matches:
        submodule.compile(**compile_kwargs)
    return len(matches)


@dataclass
class CompiledModuleRegistry:
    module_ids: set[int] = field(default_factory=set)

    def is_compiled(self, module: nn.Module) -> bool:
        return id(module) in self.module_ids

    def compile_once(
        self,
        module: nn.Module,
        *,
        compile_kwargs: dict[str, object],
    ) -> bool:
        module_id = id(module)
        if module_id in self.module_ids:
            return False
        module.compile(**compile_kwargs)
        self.module_ids.add(module_id)
        return True

    def compile_regions_once(
        self,
        module: nn.Module,
        *,
        compile_kwargs: dict[str, object],
    ) -> int:
        module_id = id(module)
        if module_id in self.module_ids:
            return 0
        compiled_count = compile_matching_submodules(
            module,
            compile_kwargs=compile_kwargs,
        )
        self.module_ids.add(module_id)
        return compiled_count


class CallableModule(nn.Module):
    """Module wrapper for compiling non-forward callables with module.compile"""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


@dataclass
class ActiveTargetCompiledCallable:
    """Cache one compiled callable module for the currently active target object"""

    target_id: int | None = None
    compiled_module: CallableModule | None = None

    def get_or_compile(
        self,
        target: object,
        fn: Callable[..., Any],
        *,
        compile_kwargs: dict[str, object],
    ) -> Callable[..., Any]:
        target_id = id(target)
        if self.target_id == target_id and self.compiled_module is not None:
            return self.compiled_module

        module = CallableModule(fn)
        module.compile(**compile_kwargs)
        self.target_id = target_id
        self.compiled_module = module
        return module
