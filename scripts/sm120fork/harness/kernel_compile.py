"""Child side: compile a caught Triton launch for sm_120 on the CPU and read the
shared memory the compiled kernel needs (no GPU, nothing runs).

Inside ``Compiler.catching()`` every ``JITFunction.run`` is bound with Triton's own
binder (the specialization a real launch gets), compiled with ``triton.compile`` for
GPUTarget("cuda", 120, 32) and recorded; the launcher goes on as if it had launched.
Standard library only at import; torch and Triton inside.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

TARGET_CAPABILITY = 120  # SM120 and SM121 share the 101376-byte per-block limit
_SHARED: dict[str, int] = {}  # compiled launch -> shared memory bytes, per child


def imp(name: str) -> Any:
    return importlib.import_module(name)


class Compiler:
    """Replaces JITFunction.run: binds the launch as Triton would, compiles it for
    sm_120 (once per distinct specialization) and records its shared memory."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self.case = ""
        # Set while a launcher that steps down on OutOfResources runs: a launch over
        # this many bytes then fails as the real launch would (see dsa_launches).
        self.raise_over: int | None = None
        compiler, backends = imp("triton.compiler"), imp("triton.backends.compiler")
        self.target = backends.GPUTarget("cuda", TARGET_CAPABILITY, 32)
        self.backend = compiler.make_backend(self.target)

    def run(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        triton, knobs = imp("triton"), imp("triton.knobs")
        jit = imp("triton.runtime.jit")
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = jit.create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(
            self.backend, kwargs, bound, specialization, options
        )
        names = [p.name for p in fn.params]
        tiles = {
            names[path[0]]: value
            for path, value in constexprs.items()
            if len(path) == 1 and isinstance(value, int | bool) and "BLOCK" in names[path[0]]
        }
        kernel = f"{fn.module}.{fn.fn.__qualname__}"
        # One compile per tile configuration: the integer arguments' divisibility
        # (attrs) follows the probe's made-up shapes, not the configuration.
        key = repr((kernel, sorted(signature.items()), sorted(constexprs.items()),
                    options.num_warps, options.num_stages))  # fmt: skip
        if key in self.records:
            self.records[key]["cases"].append(self.case)
        else:
            if key not in _SHARED:  # compiled once per child, for all its scenarios
                src = imp("triton.compiler").ASTSource(fn, signature, constexprs, attrs)
                compiled = triton.compile(src, target=self.target, options=options.__dict__)
                _SHARED[key] = int(compiled.metadata.shared)
            self.records[key] = {
                "kernel": kernel,
                "tiles": tiles,
                "num_warps": options.num_warps,
                "num_stages": options.num_stages,
                "shared": _SHARED[key],
                "cases": [self.case],
            }
        if self.raise_over is not None and _SHARED[key] > self.raise_over:
            errors = imp("triton.runtime.errors")
            raise errors.OutOfResources(_SHARED[key], self.raise_over, "shared memory")

    @contextmanager
    def catching(self) -> Iterator[None]:
        jit = imp("triton.runtime.jit")
        original = jit.JITFunction.run
        compiler = self

        def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> None:
            compiler.run(self, args, kwargs)

        jit.JITFunction.run = run
        try:
            yield
        finally:
            jit.JITFunction.run = original


def meta(*shape: int, dtype: Any = None) -> Any:
    torch = imp("torch")
    return torch.empty(*shape, device="meta", dtype=dtype or torch.bfloat16)


def idx(*shape: int) -> Any:
    return meta(*shape, dtype=imp("torch").int32)


def call_by_name(function: Callable[..., Any], known: dict[str, Any]) -> Any:
    params = inspect.signature(function).parameters
    return function(**{name: value for name, value in known.items() if name in params})
