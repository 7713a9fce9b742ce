"""Child-side probes of load-time decisions: what a layer picks once ServerArgs are published.

ServerArgs fix the MoE runner only when resolution chose one; an ``auto`` that
survives is resolved by the quantization method while the model loads. These
probes call that resolution on a bare method object, without weights or a GPU,
and read the choice before any kernel is built. Standalone like child_probes.py.
"""

from __future__ import annotations

import importlib
from typing import Any

NVFP4_MOE = "sglang.srt.layers.quantization.modelopt_quant"
MOE_UTILS = "sglang.srt.layers.moe.utils"
MOE_RUNNER_BASE = "sglang.srt.layers.moe.moe_runner.base"


class _BareLayer:
    """Stands for the FusedMoE layer: create_moe_runner only sets attributes on it."""


def nvfp4_moe_runner(
    server_args: Any, publish: Any, unavailable: type[Exception], **layer: Any
) -> Any:
    """The runner ModelOptNvFp4FusedMoEMethod.create_moe_runner resolves (``auto`` included)
    for a layer of the given MoeRunnerConfig fields (default: a SiLU layer).

    The choice is stored before the runner is built; building it may fail without
    a GPU, so an error after the choice is kept out of the observation.
    """
    quant = importlib.import_module(NVFP4_MOE)
    method_cls = getattr(quant, "ModelOptNvFp4FusedMoEMethod", None)
    if method_cls is None or not hasattr(method_cls, "create_moe_runner"):
        raise unavailable(f"{NVFP4_MOE} has no ModelOptNvFp4FusedMoEMethod.create_moe_runner")
    _published_moe_config(server_args, publish, unavailable)
    config = importlib.import_module(MOE_RUNNER_BASE).MoeRunnerConfig(**layer)
    method = method_cls.__new__(method_cls)
    try:
        method.create_moe_runner(_BareLayer(), config)
    except Exception:
        if not hasattr(method, "_moe_runner_backend"):
            raise
    return method._moe_runner_backend


MUSE_SPARK_MOE = "sglang.srt.layers.muse_spark.muse_spark_fp4_moe"


def muse_spark_moe_runner(server_args: Any, publish: Any, unavailable: type[Exception]) -> Any:
    """The runner Muse Spark's packed-NVFP4 experts resolve from the published MoE config."""
    try:
        module = importlib.import_module(MUSE_SPARK_MOE)
    except ModuleNotFoundError as exc:
        raise unavailable(f"no module {MUSE_SPARK_MOE}") from exc
    resolve = getattr(module, "_resolve_moe_runner_backend", None)
    if resolve is None:
        raise unavailable(f"{MUSE_SPARK_MOE} has no _resolve_moe_runner_backend")
    _published_moe_config(server_args, publish, unavailable)
    return resolve()


def _published_moe_config(server_args: Any, publish: Any, unavailable: type[Exception]) -> None:
    """Publish the args and seed the MoE flags from them, as a scheduler does at start."""
    initialize = getattr(importlib.import_module(MOE_UTILS), "initialize_moe_config", None)
    if initialize is None:
        raise unavailable(f"{MOE_UTILS} has no initialize_moe_config")
    publish(server_args)
    initialize()
