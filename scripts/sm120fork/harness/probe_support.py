"""Child side: what every probe shares: the observation form of a value or an error,
the marker of a gate the tested release lacks, and finding a gate by capability (the
module that holds it, the arguments its functions take, the ServerArgs it reads).

Standard library only (imported by the child, ``child.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Observation = dict[str, Any]
Probe = Callable[[Any], Observation]

MISSING = "<missing>"
UNAVAILABLE = "unavailable:"
# The DeepGEMM configurer, whose module-level flags two probes read.
DEEP_GEMM = ("sglang.srt.layers.deep_gemm_wrapper.configurer",)


class Unavailable(Exception):
    """The tested release offers no equivalent of a probed gate; the message says why."""


def describe(exc: BaseException) -> dict[str, str]:
    """An observed error: ``{"raises": "<Type>: <first line of the message>"}``."""
    lines = str(exc).strip().splitlines()
    return {"raises": f"{type(exc).__name__}: {lines[0] if lines else ''}"}


def plain(value: Any) -> Any:
    """JSON-able, comparable form of an observed value."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "value") and isinstance(value.value, str):  # an Enum
        return value.value
    return str(value)


def imp(name: str) -> Any:
    return importlib.import_module(name)


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is gone
        return False


def first_module(candidates: Sequence[str], attr: str) -> tuple[str, Any]:
    """The first of ``candidates`` that exists and defines ``attr`` (import errors raise)."""
    lacking = []
    for name in candidates:
        if module_exists(name):
            module = imp(name)
            if hasattr(module, attr):
                return name, module
            lacking.append(name)
    if lacking:
        raise Unavailable(f"no {attr} in {', '.join(lacking)}")
    raise Unavailable(f"no module {' or '.join(candidates)}")


def publish(server_args: Any) -> None:
    """Install the scenario's ServerArgs as the process-wide config, as a scheduler does."""
    sa_mod = imp("sglang.srt.server_args")
    publish = getattr(sa_mod, "set_global_server_args_for_scheduler", None)
    if publish is None:
        raise Unavailable("sglang.srt.server_args has no set_global_server_args_for_scheduler")
    publish(server_args)


def initialize(function: Callable[..., Any], server_args: Any) -> None:
    """Call an ``initialize_*_config``: with the args, or after publishing them."""
    if inspect.signature(function).parameters:
        function(server_args)
    else:
        publish(server_args)
        function()


def function_name(value: Any) -> str:
    """The name of a dispatched callable, looking through functools.partial."""
    return str(getattr(getattr(value, "func", value), "__name__", value))


def call_by_name(function: Callable[..., Any], known: Mapping[str, Any]) -> Any:
    """Call ``function`` with the ``known`` arguments it declares; refuse unknown required ones."""
    params = inspect.signature(function).parameters
    unknown = [
        name
        for name, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and name not in known
    ]
    if unknown:
        raise Unavailable(f"{function.__qualname__} requires unknown arguments {unknown}")
    return function(**{name: value for name, value in known.items() if name in params})
