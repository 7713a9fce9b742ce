"""Child side of the gate harness: the probes by name (``PROBES``, ``run_probe``) and
the ServerArgs-level gates they read.

Imported by ``child.py``: standard library, torch and its probe siblings only.

A probe finds its gate by capability, not by release (``probe_support.py``). When no
known location offers the gate, every field of the probe reads ``unavailable:<why>``,
a value no expectation matches by accident (table.py never counts it as a
difference that tests a patch).
"""

from __future__ import annotations

from typing import Any

from . import allreduce_probes, kernel_probes, load_probes, situ_forward, v41_probes
from .probe_support import (
    DEEP_GEMM,
    MISSING,
    UNAVAILABLE,
    Observation,
    Probe,
    Unavailable,
    call_by_name,
    describe,
    first_module,
    function_name,
    imp,
    initialize,
    module_exists,
    plain,
    publish,
)
from .tile_probes import probe_triton_tiles

DEEP_GEMM_FLAGS = ("ENABLE_JIT_DEEPGEMM", "DEEPGEMM_BLACKWELL", "DEEPGEMM_SCALE_UE8M0")


# --------------------------------------------------------------------------- ServerArgs gates


FUSION_GATES = (
    ("sglang.srt.layers.communicator", "apply_flashinfer_allreduce_fusion"),
    ("sglang.srt.layers.layer_boundary.residual.add_norm", "flashinfer_ar_fusion_applies"),
)
FUSION_BACKEND = ("sglang.srt.layers.flashinfer_comm_fusion",)
FP8_UTILS = ("sglang.srt.layers.quantization.fp8_utils",)
FP4_UTILS = ("sglang.srt.layers.quantization.fp4_utils",)


def probe_allreduce_fusion(server_args: Any) -> Observation:
    """Row 1: the runtime gate, asked with the scenario's ServerArgs installed.

    The field keeps its 0.5.9 name; ``source.allreduce_fusion`` names the function
    that answered (communicator.py up to 0.5.20, layer_boundary's add_norm.py later).
    """
    publish(server_args)
    for module_name, gate_name in FUSION_GATES:
        if module_exists(module_name):
            gate = getattr(imp(module_name), gate_name, None)
            if gate is not None:
                return {
                    "communicator.apply_flashinfer_allreduce_fusion": bool(gate(128)),
                    "source.allreduce_fusion": f"{module_name}.{gate_name}",
                    "flashinfer_comm_fusion.resolve_backend": _fusion_backend(),
                }
    raise Unavailable("no allreduce-fusion gate: " + ", ".join(".".join(g) for g in FUSION_GATES))


def _fusion_backend() -> Any:
    """The backend the workspace set-up resolves before CUDA-graph capture (later
    releases: the fusion is configured by a backend field, checked only here)."""
    try:
        _, module = first_module(FUSION_BACKEND, "resolve_flashinfer_allreduce_fusion_backend")
    except Unavailable as exc:
        return f"{UNAVAILABLE}{exc}"
    try:
        return plain(module.resolve_flashinfer_allreduce_fusion_backend())
    except Exception as exc:
        return describe(exc)


def probe_fp8_gemm(server_args: Any) -> Observation:
    """Row 10: which block-FP8 GEMM the dispatcher picks for the scenario's args."""
    _, fp8_utils = first_module(FP8_UTILS, "dispatch_w8a8_block_fp8_linear")
    initialize(fp8_utils.initialize_fp8_gemm_config, server_args)
    chosen = fp8_utils.dispatch_w8a8_block_fp8_linear()
    obs: Observation = {"fp8_utils.dispatch_w8a8_block_fp8_linear": function_name(chosen)}
    runner = getattr(fp8_utils, "get_fp8_gemm_runner_backend", None)
    obs["fp8_utils.fp8_gemm_runner_backend"] = (
        plain(runner()) if runner else f"{UNAVAILABLE}no get_fp8_gemm_runner_backend"
    )
    return obs


def probe_fp4_gemm(server_args: Any) -> Observation:
    """Row 12: the FP4 GEMM runner after fp4_utils has read the scenario's args."""
    _, fp4_utils = first_module(FP4_UTILS, "get_fp4_gemm_runner_backend")
    initialize(fp4_utils.initialize_fp4_gemm_config, server_args)
    return {"fp4_utils.fp4_gemm_runner_backend": plain(fp4_utils.get_fp4_gemm_runner_backend())}


# --------------------------------------------------------------------------- module-level gates


def probe_deep_gemm(_: Any) -> Observation:
    """Row 11: DeepGEMM module flags, frozen at import."""
    _, configurer = first_module(DEEP_GEMM, "ENABLE_JIT_DEEPGEMM")
    return {
        f"deep_gemm.{flag}": plain(getattr(configurer, flag, MISSING)) for flag in DEEP_GEMM_FLAGS
    }


MODEL_LOADER_UTILS = ("sglang.srt.model_loader.utils",)
UE8M0_REQUANT_FIELDS = (
    "model_loader.requant_ue8m0[dense 128x128]",
    "model_loader.requant_ue8m0[grouped MoE 128x128]",
)


def probe_ue8m0_requant(_: Any) -> Observation:
    """Whether block-FP8 weights are requantized at load into DeepGEMM's packed UE8M0
    scales (model_loader.utils.should_deepgemm_weight_requant_ue8m0), for a dense
    layer and for the grouped MoE GEMM: the GEMM that runs must read that layout."""
    _, utils = first_module(MODEL_LOADER_UTILS, "should_deepgemm_weight_requant_ue8m0")
    requant = utils.should_deepgemm_weight_requant_ue8m0
    dense, grouped = ({"weight_block_size": [128, 128], "grouped_moe": g} for g in (False, True))
    return {
        UE8M0_REQUANT_FIELDS[0]: plain(call_by_name(requant, dense)),
        UE8M0_REQUANT_FIELDS[1]: plain(call_by_name(requant, grouped)),
    }


def probe_nvfp4_moe(server_args: Any) -> Observation:
    """The NVFP4 MoE runner chosen at model load (an ``auto`` left by ServerArgs)."""
    backend = load_probes.nvfp4_moe_runner(server_args, publish, Unavailable)
    return {"modelopt_quant.nvfp4_moe_runner_backend": plain(backend)}


# Layers an NVFP4 MoE runner may not serve: field suffix -> MoeRunnerConfig fields.
NVFP4_MOE_LAYERS: dict[str, dict[str, Any]] = {
    "situ": {"activation": "situ"},
    "router_on_input": {"apply_router_weight_on_input": True},
}


def probe_nvfp4_moe_layers(server_args: Any) -> Observation:
    """The load-time NVFP4 MoE runner for layers a runner may not serve (each field
    its own choice or error)."""
    out: Observation = {}
    for name, layer in NVFP4_MOE_LAYERS.items():
        field = f"modelopt_quant.nvfp4_moe_runner_backend[{name}]"
        try:
            backend = load_probes.nvfp4_moe_runner(server_args, publish, Unavailable, **layer)
        except Unavailable:
            raise
        except Exception as exc:
            out[field] = describe(exc)
        else:
            out[field] = plain(backend)
    return out


def probe_muse_spark_moe(server_args: Any) -> Observation:
    """The runner Muse Spark's packed-NVFP4 experts pick at model load."""
    backend = load_probes.muse_spark_moe_runner(server_args, publish, Unavailable)
    return {"muse_spark_fp4_moe.moe_runner_backend": plain(backend)}


def probe_pcie_allreduce(_: Any) -> Observation:
    """The tensor-parallel group's allreduce backends on faked hosts (allreduce_probes.py)."""
    return allreduce_probes.pcie_allreduce(first_module, call_by_name, describe, plain)


# --------------------------------------------------------------------------- issue 13: LoRA

MOE_LORA_CUTEDSL = ("sglang.kernels.ops.lora.moe.cutedsl.api",)


def probe_moe_lora_cutedsl(_: Any) -> Observation:
    """The MoE-LoRA CuTe DSL base GEMM's kernel class for this device (no compile)."""
    _, api = first_module(MOE_LORA_CUTEDSL, "_bf16_kernel_class_for")
    device = imp("torch").device("cuda", 0)
    obs: Observation = {}
    for dtype in ("bf16", "fp8"):
        pick = getattr(api, f"_{dtype}_kernel_class_for", None)
        field = f"lora_moe_cutedsl.{dtype}_kernel_class"
        if pick is None:
            obs[field] = f"{UNAVAILABLE}no _{dtype}_kernel_class_for"
            continue
        try:
            obs[field] = getattr(pick(device), "__name__", str(pick))
        except Exception as exc:
            obs[field] = describe(exc)
    return obs


def probe_check_server_args(server_args: Any) -> Observation:
    """The launch-time validation (engine.py calls it after resolution, before
    publishing the args): where the LoRA flags are checked and resolved."""
    check = getattr(server_args, "check_server_args", None)
    if not callable(check):
        raise Unavailable("ServerArgs has no check_server_args()")
    check()
    return {"server_args.check_server_args": "ok"}


def probe_kernel_fit(server_args: Any) -> Observation:
    """The Triton launches the scenario's SM12x decisions select, compiled for sm_120
    (kernel_probes.py; issue 28)."""

    def dispatch_fp8(args: Any, block: list[int]) -> str:
        _, fp8_utils = first_module(FP8_UTILS, "dispatch_w8a8_block_fp8_linear")
        initialize(fp8_utils.initialize_fp8_gemm_config, args)
        return function_name(fp8_utils.dispatch_w8a8_block_fp8_linear(block))

    publish(server_args)  # the MoE config lookup reads the published exec settings
    return kernel_probes.kernel_fit(server_args, dispatch_fp8)


# name -> (probe, the fields it reports: all of them record the error if it raises)
PROBES: dict[str, tuple[Probe, tuple[str, ...]]] = {
    "allreduce_fusion": (
        probe_allreduce_fusion,
        (
            "communicator.apply_flashinfer_allreduce_fusion",
            "flashinfer_comm_fusion.resolve_backend",
        ),
    ),
    "fp8_gemm": (
        probe_fp8_gemm,
        ("fp8_utils.dispatch_w8a8_block_fp8_linear", "fp8_utils.fp8_gemm_runner_backend"),
    ),
    "fp4_gemm": (probe_fp4_gemm, ("fp4_utils.fp4_gemm_runner_backend",)),
    "deep_gemm": (probe_deep_gemm, tuple(f"deep_gemm.{f}" for f in DEEP_GEMM_FLAGS)),
    "ue8m0_requant": (probe_ue8m0_requant, UE8M0_REQUANT_FIELDS),
    "triton_tiles": (probe_triton_tiles, ()),
    "nvfp4_moe": (probe_nvfp4_moe, ("modelopt_quant.nvfp4_moe_runner_backend",)),
    "nvfp4_moe_layers": (
        probe_nvfp4_moe_layers,
        tuple(f"modelopt_quant.nvfp4_moe_runner_backend[{n}]" for n in NVFP4_MOE_LAYERS),
    ),
    "muse_spark_moe": (probe_muse_spark_moe, ("muse_spark_fp4_moe.moe_runner_backend",)),
    "pcie_allreduce": (probe_pcie_allreduce, allreduce_probes.FIELDS),
    "check_server_args": (probe_check_server_args, ("server_args.check_server_args",)),
    "moe_lora_cutedsl": (
        probe_moe_lora_cutedsl,
        ("lora_moe_cutedsl.bf16_kernel_class", "lora_moe_cutedsl.fp8_kernel_class"),
    ),
    "v41_indexer": (v41_probes.probe_v41_indexer, v41_probes.FIELDS),
    "kernel_fit": (probe_kernel_fit, (kernel_probes.FIELD, kernel_probes.INPUTS)),
    "nvfp4_moe_situ_forward": (
        lambda args: {situ_forward.FIELD: situ_forward.situ_first_forward(args, publish)},
        (situ_forward.FIELD,),
    ),
}


def run_probe(name: str, server_args: Any) -> Observation:
    """One probe's fields; an error or an unavailable gate is recorded in each of them."""
    probe, fields = PROBES[name]
    try:
        return probe(server_args)
    except Unavailable as exc:
        why = f"{UNAVAILABLE}{exc}"
        return {**dict.fromkeys(fields, why), f"probe.{name}": why}
    except Exception as exc:
        return {**{field: describe(exc) for field in fields}, f"probe.{name}": describe(exc)}
