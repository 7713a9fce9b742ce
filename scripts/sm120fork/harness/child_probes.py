"""Child side of the gate harness: the probes, and the observation helpers they share.

Loaded by ``child.py`` (standalone script; this directory is its ``sys.path[0]``):
standard library and torch only, no imports from the harness package.

A probe finds its gate by capability, not by release: the module that holds it
(``_first_module``), the arguments its functions take (``inspect.signature``),
the way ServerArgs reach it (passed in, or published first). When no known
location offers the gate, every field of the probe reads ``unavailable:<why>``,
a value no expectation matches by accident (table.py never counts it as a
difference that tests a patch).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:
    from . import allreduce_probes, kernel_probes, load_probes
else:  # loaded by child.py as a script: this directory is sys.path[0]
    import allreduce_probes
    import kernel_probes
    import load_probes

Observation = dict[str, Any]
Probe = Callable[[Any], Observation]

MISSING = "<missing>"
UNAVAILABLE = "unavailable:"
DEEP_GEMM_FLAGS = ("ENABLE_JIT_DEEPGEMM", "DEEPGEMM_BLACKWELL", "DEEPGEMM_SCALE_UE8M0")


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


def _import(name: str) -> Any:
    return importlib.import_module(name)


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is gone
        return False


def _first_module(candidates: Sequence[str], attr: str) -> tuple[str, Any]:
    """The first of ``candidates`` that exists and defines ``attr`` (import errors raise)."""
    lacking = []
    for name in candidates:
        if module_exists(name):
            module = _import(name)
            if hasattr(module, attr):
                return name, module
            lacking.append(name)
    if lacking:
        raise Unavailable(f"no {attr} in {', '.join(lacking)}")
    raise Unavailable(f"no module {' or '.join(candidates)}")


def _publish(server_args: Any) -> None:
    """Install the scenario's ServerArgs as the process-wide config, as a scheduler does."""
    sa_mod = _import("sglang.srt.server_args")
    publish = getattr(sa_mod, "set_global_server_args_for_scheduler", None)
    if publish is None:
        raise Unavailable("sglang.srt.server_args has no set_global_server_args_for_scheduler")
    publish(server_args)


def _initialize(function: Callable[..., Any], server_args: Any) -> None:
    """Call an ``initialize_*_config``: with the args, or after publishing them."""
    if inspect.signature(function).parameters:
        function(server_args)
    else:
        _publish(server_args)
        function()


def _function_name(value: Any) -> str:
    """The name of a dispatched callable, looking through functools.partial."""
    return str(getattr(getattr(value, "func", value), "__name__", value))


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
    _publish(server_args)
    for module_name, function_name in FUSION_GATES:
        if module_exists(module_name):
            gate = getattr(_import(module_name), function_name, None)
            if gate is not None:
                return {
                    "communicator.apply_flashinfer_allreduce_fusion": bool(gate(128)),
                    "source.allreduce_fusion": f"{module_name}.{function_name}",
                    "flashinfer_comm_fusion.resolve_backend": _fusion_backend(),
                }
    raise Unavailable("no allreduce-fusion gate: " + ", ".join(".".join(g) for g in FUSION_GATES))


def _fusion_backend() -> Any:
    """The backend the workspace set-up resolves before CUDA-graph capture (later
    releases: the fusion is configured by a backend field, checked only here)."""
    try:
        _, module = _first_module(FUSION_BACKEND, "resolve_flashinfer_allreduce_fusion_backend")
    except Unavailable as exc:
        return f"{UNAVAILABLE}{exc}"
    try:
        return plain(module.resolve_flashinfer_allreduce_fusion_backend())
    except Exception as exc:
        return describe(exc)


def probe_fp8_gemm(server_args: Any) -> Observation:
    """Row 10: which block-FP8 GEMM the dispatcher picks for the scenario's args."""
    _, fp8_utils = _first_module(FP8_UTILS, "dispatch_w8a8_block_fp8_linear")
    _initialize(fp8_utils.initialize_fp8_gemm_config, server_args)
    chosen = fp8_utils.dispatch_w8a8_block_fp8_linear()
    obs: Observation = {"fp8_utils.dispatch_w8a8_block_fp8_linear": _function_name(chosen)}
    runner = getattr(fp8_utils, "get_fp8_gemm_runner_backend", None)
    obs["fp8_utils.fp8_gemm_runner_backend"] = (
        plain(runner()) if runner else f"{UNAVAILABLE}no get_fp8_gemm_runner_backend"
    )
    return obs


def probe_fp4_gemm(server_args: Any) -> Observation:
    """Row 12: the FP4 GEMM runner after fp4_utils has read the scenario's args."""
    _, fp4_utils = _first_module(FP4_UTILS, "get_fp4_gemm_runner_backend")
    _initialize(fp4_utils.initialize_fp4_gemm_config, server_args)
    return {"fp4_utils.fp4_gemm_runner_backend": plain(fp4_utils.get_fp4_gemm_runner_backend())}


# --------------------------------------------------------------------------- module-level gates

DEEP_GEMM = ("sglang.srt.layers.deep_gemm_wrapper.configurer",)


def probe_deep_gemm(_: Any) -> Observation:
    """Row 11: DeepGEMM module flags, frozen at import."""
    _, configurer = _first_module(DEEP_GEMM, "ENABLE_JIT_DEEPGEMM")
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
    _, utils = _first_module(MODEL_LOADER_UTILS, "should_deepgemm_weight_requant_ue8m0")
    requant = utils.should_deepgemm_weight_requant_ue8m0
    dense, grouped = ({"weight_block_size": [128, 128], "grouped_moe": g} for g in (False, True))
    return {
        UE8M0_REQUANT_FIELDS[0]: plain(_call_by_name(requant, dense)),
        UE8M0_REQUANT_FIELDS[1]: plain(_call_by_name(requant, grouped)),
    }


class _Launched(Exception):
    """Control flow: carries the constants of the caught kernel launch."""

    def __init__(self, constants: dict[str, Any]) -> None:
        super().__init__("launch caught")
        self.constants = constants


def _caught_launch(call: Callable[[], Any]) -> str:
    """Run ``call`` until its first Triton launch; return that launch's BLOCK_MxBLOCK_N."""
    jit = _import("triton.runtime.jit")
    original = jit.JITFunction.run

    def catch(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Launched(kwargs)

    jit.JITFunction.run = catch
    try:
        call()
    except _Launched as launched:
        return f"{launched.constants.get('BLOCK_M')}x{launched.constants.get('BLOCK_N')}"
    finally:
        jit.JITFunction.run = original
    return "no launch"


def _launch_tiles(call: Callable[[], Any]) -> Any:
    """BLOCK_MxBLOCK_N of ``call``'s first Triton launch, or the error raised before it."""
    try:
        return _caught_launch(call)
    except Unavailable as exc:
        return f"{UNAVAILABLE}{exc}"
    except Exception as exc:
        return describe(exc)


def _call_by_name(function: Callable[..., Any], known: Mapping[str, Any]) -> Any:
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


TRITON_OPS = "sglang.srt.layers.attention.triton_ops"  # 0.5.9
KERNEL_OPS = "sglang.kernels.ops.attention"  # 0.5.23 (double sparsity is gone there)
EXTEND = (f"{TRITON_OPS}.extend_attention", f"{KERNEL_OPS}.extend_attention")
PREFILL = (f"{TRITON_OPS}.prefill_attention", f"{KERNEL_OPS}.prefill_attention")
DOUBLE_SPARSITY = (f"{TRITON_OPS}.double_sparsity_attention",)


def _tiles_of(candidates: Sequence[str], function: str, call: Callable[[Any], Any]) -> Any:
    try:
        _, module = _first_module(candidates, function)
    except Unavailable as exc:
        return f"{UNAVAILABLE}{exc}"
    return _launch_tiles(lambda: call(getattr(module, function)))


def probe_triton_tiles(_: Any) -> Observation:
    """Row 13: Triton attention tile sizes chosen from CUDA_CAPABILITY (meta tensors)."""
    torch = _import("torch")

    def meta(*shape: int, dtype: Any = None) -> Any:
        return torch.empty(*shape, device="meta", dtype=dtype or torch.bfloat16)

    def idx(*shape: int) -> Any:
        return meta(*shape, dtype=torch.int32)

    out: Observation = {}
    for lq, lv in ((128, 128), (192, 128), (576, 512)):

        def extend_fwd(fwd: Callable[..., Any], lq: int = lq, lv: int = lv) -> Any:
            q, o, kbuf, vbuf = meta(16, 8, lq), meta(16, 8, lv), meta(64, 8, lq), meta(64, 8, lv)
            indptr, indices = idx(2), idx(16)
            args = {
                "q_extend": q,
                "k_extend": q,
                "v_extend": o,
                "o_extend": o,
                "k_buffer": kbuf,
                "v_buffer": vbuf,
                "qo_indptr": indptr,
                "kv_indptr": indptr,
                "kv_indices": indices,
                "custom_mask": None,
                "is_causal": True,
                "mask_indptr": None,
                "max_len_extend": 16,
                "k_scale": 1.0,
                "v_scale": 1.0,
            }
            return _call_by_name(fwd, args)

        out[f"triton.extend_attention[Lq={lq}]"] = _tiles_of(
            EXTEND, "extend_attention_fwd", extend_fwd
        )

    for lk in (128, 256):

        def prefill_fwd(fwd: Callable[..., Any], lk: int = lk) -> Any:
            x = meta(16, 8, lk)
            return fwd(x, x, x, x, idx(1), idx(1), 16)

        out[f"triton.prefill_attention[Lk={lk}]"] = _tiles_of(
            PREFILL, "context_attention_fwd", prefill_fwd
        )

    for lq in (128, 256):

        def sparse_fwd(fwd: Callable[..., Any], lq: int = lq) -> Any:
            x, buf = meta(16, 8, lq), meta(64, 8, lq)
            one = idx(1)
            return fwd(x, x, x, x, buf, buf, idx(1, 64), one, one, one, one, 16)

        out[f"triton.double_sparsity_extend[Lq={lq}]"] = _tiles_of(
            DOUBLE_SPARSITY, "extend_attention_fwd", sparse_fwd
        )
    return out


def probe_nvfp4_moe(server_args: Any) -> Observation:
    """The NVFP4 MoE runner chosen at model load (an ``auto`` left by ServerArgs)."""
    backend = load_probes.nvfp4_moe_runner(server_args, _publish, Unavailable)
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
            backend = load_probes.nvfp4_moe_runner(server_args, _publish, Unavailable, **layer)
        except Unavailable:
            raise
        except Exception as exc:
            out[field] = describe(exc)
        else:
            out[field] = plain(backend)
    return out


def probe_muse_spark_moe(server_args: Any) -> Observation:
    """The runner Muse Spark's packed-NVFP4 experts pick at model load."""
    backend = load_probes.muse_spark_moe_runner(server_args, _publish, Unavailable)
    return {"muse_spark_fp4_moe.moe_runner_backend": plain(backend)}


def probe_pcie_allreduce(_: Any) -> Observation:
    """The tensor-parallel group's allreduce backends on faked hosts (allreduce_probes.py)."""
    return allreduce_probes.pcie_allreduce(_first_module, _call_by_name, describe, plain)


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


# --------------------------------------------------------------------------- issue 13: LoRA, V4.1
# (appended; registered into PROBES below)

MOE_LORA_CUTEDSL = ("sglang.kernels.ops.lora.moe.cutedsl.api",)
V41_INDEXER = ("sglang.srt.layers.attention.dsv4.v41_indexer",)
JIT_DEEPGEMM_OFF = "v41_indexer[SGLANG_ENABLE_JIT_DEEPGEMM=0]"


def probe_moe_lora_cutedsl(_: Any) -> Observation:
    """The MoE-LoRA CuTe DSL base GEMM's kernel class for this device (no compile)."""
    _, api = _first_module(MOE_LORA_CUTEDSL, "_bf16_kernel_class_for")
    device = _import("torch").device("cuda", 0)
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


def _clear_caches(module: Any) -> None:
    """Let the module's functools.cache'd probes read the state afresh."""
    for value in vars(module).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def _v41_choices(v41: Any, prefix: str, *, candidates: bool) -> Observation:
    """What the V4.1 index layers' factories decide (no tensors are touched)."""
    _clear_caches(v41)
    full = v41.make_full_topk_indexer(token_to_kv_pool=None, req_to_token=None)
    obs: Observation = {
        f"{prefix}.use_deep_gemm_prefill": plain(full.use_deep_gemm_prefill),
        f"{prefix}.use_deep_gemm_decode": plain(full.use_deep_gemm_decode),
    }
    if candidates:
        try:
            prefill, decode = v41.make_candidate_indexer(
                token_to_kv_pool=None,
                req_to_token=None,
                page_size=64,
                candidate_topk_blocks=8,
                candidate_block_size=8,
            )
            obs[f"{prefix}.candidates"] = f"{type(prefill).__name__}/{type(decode).__name__}"
        except Exception as exc:
            obs[f"{prefix}.candidates"] = describe(exc)
    return obs


def probe_v41_indexer(_: Any) -> Observation:
    """The DeepSeek V4.1 indexer's DeepGEMM choices: as the installed DeepGEMM allows,
    and with the DeepGEMM configurer turned off (SGLANG_ENABLE_JIT_DEEPGEMM=0, the
    same answer a DeepGEMM build without SM120 kernels gets on SM12x)."""
    v41_name, v41 = _first_module(V41_INDEXER, "make_full_topk_indexer")
    name, configurer = _first_module(DEEP_GEMM, "ENABLE_JIT_DEEPGEMM")
    for lazy in ("dense_blocks", "sparse_table"):  # imported before the flags change
        if module_exists(f"{v41_name}.{lazy}"):
            _import(f"{v41_name}.{lazy}")
    os = _import("os")
    obs = _v41_choices(v41, "v41_indexer", candidates=False)
    before = os.environ.get("SGLANG_ENABLE_JIT_DEEPGEMM")
    os.environ["SGLANG_ENABLE_JIT_DEEPGEMM"] = "0"
    try:
        off = importlib.reload(configurer)
        obs[f"{JIT_DEEPGEMM_OFF}.ENABLE_JIT_DEEPGEMM"] = plain(off.ENABLE_JIT_DEEPGEMM)
        obs.update(_v41_choices(v41, JIT_DEEPGEMM_OFF, candidates=True))
    finally:
        if before is None:
            os.environ.pop("SGLANG_ENABLE_JIT_DEEPGEMM", None)
        else:
            os.environ["SGLANG_ENABLE_JIT_DEEPGEMM"] = before
        importlib.reload(_import(name))
        _clear_caches(v41)
    return obs


PROBES["check_server_args"] = (probe_check_server_args, ("server_args.check_server_args",))
PROBES["moe_lora_cutedsl"] = (
    probe_moe_lora_cutedsl,
    ("lora_moe_cutedsl.bf16_kernel_class", "lora_moe_cutedsl.fp8_kernel_class"),
)
PROBES["v41_indexer"] = (
    probe_v41_indexer,
    (
        "v41_indexer.use_deep_gemm_prefill",
        "v41_indexer.use_deep_gemm_decode",
        f"{JIT_DEEPGEMM_OFF}.use_deep_gemm_prefill",
        f"{JIT_DEEPGEMM_OFF}.use_deep_gemm_decode",
        f"{JIT_DEEPGEMM_OFF}.candidates",
    ),
)


def probe_kernel_fit(server_args: Any) -> Observation:
    """The Triton launches the scenario's SM12x decisions select, compiled for sm_120
    (kernel_probes.py; issue 28)."""

    def dispatch_fp8(args: Any, block: list[int]) -> str:
        _, fp8_utils = _first_module(FP8_UTILS, "dispatch_w8a8_block_fp8_linear")
        _initialize(fp8_utils.initialize_fp8_gemm_config, args)
        return _function_name(fp8_utils.dispatch_w8a8_block_fp8_linear(block))

    _publish(server_args)  # the MoE config lookup reads the published exec settings
    return kernel_probes.kernel_fit(server_args, dispatch_fp8)


PROBES["kernel_fit"] = (probe_kernel_fit, (kernel_probes.FIELD, kernel_probes.INPUTS))
