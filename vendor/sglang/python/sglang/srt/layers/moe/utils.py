from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import NamedTuple

import torch

from sglang.srt.configs.shared_experts import SharedExpertsConfig
from sglang.srt.environ import envs
from sglang.srt.layers.dp_attention import (
    is_dp_attention_enabled,
)
from sglang.srt.runtime_context import (
    get_exec,
    get_flags,
    get_forward,
    get_lora,
    get_model,
    get_parallel,
    get_server_args,
    get_spec,
)
from sglang.srt.utils import is_cuda, is_npu

_is_npu = is_npu()

from sglang.srt.utils.common import log_info_on_rank0

logger = logging.getLogger(__name__)


class MoeA2ABackend(Enum):
    NONE = "none"
    DEEPEP = "deepep"
    MOONCAKE = "mooncake"
    NIXL = "nixl"
    MORI = "mori"
    ASCEND_FUSEEP = "ascend_fuseep"
    ASCEND_TP = "ascend_tp"
    FLASHINFER = "flashinfer"
    MEGAMOE = "megamoe"
    DEEPEP_V2 = "deepep_v2"
    PPLX = "pplx"
    FLASHINFER_MEGAMOE = "flashinfer_megamoe"
    CUSTOMIZED = "customized"

    @classmethod
    def _missing_(cls, value):
        if value is None:
            return cls.NONE
        for member in cls:
            if value == member.value:
                return member
        raise ValueError(f"No {cls.__name__} member for value {value}")

    def is_none(self):
        return self == MoeA2ABackend.NONE

    def is_deepep(self):
        return self == MoeA2ABackend.DEEPEP

    def is_mooncake(self):
        return self == MoeA2ABackend.MOONCAKE

    def is_nixl(self):
        return self == MoeA2ABackend.NIXL

    def is_flashinfer(self):
        return self == MoeA2ABackend.FLASHINFER

    def is_ascend_fuseep(self):
        return self == MoeA2ABackend.ASCEND_FUSEEP

    def is_ascend_tp(self):
        return self == MoeA2ABackend.ASCEND_TP

    def is_mori(self):
        return self == MoeA2ABackend.MORI

    def is_mori_epv2(self):
        return self.is_mori() and envs.SGLANG_MORI_EP_V2.get()

    def is_megamoe(self):
        return self == MoeA2ABackend.MEGAMOE

    def is_deepep_v2(self):
        return self == MoeA2ABackend.DEEPEP_V2

    def is_pplx(self):
        return self == MoeA2ABackend.PPLX

    def is_flashinfer_megamoe(self):
        return self == MoeA2ABackend.FLASHINFER_MEGAMOE

    def is_customized(self):
        return self == MoeA2ABackend.CUSTOMIZED

    def supports_aiter(self) -> bool:
        return self in (
            MoeA2ABackend.NONE,
            MoeA2ABackend.DEEPEP,
            MoeA2ABackend.MOONCAKE,
            MoeA2ABackend.NIXL,
            MoeA2ABackend.MORI,
        )


class _MoeRunnerBackendPredicates:
    value: str

    def is_auto(self):
        return self.value == MoeRunnerBackend.AUTO.value

    def is_hpc_ops(self):
        return self.value == MoeRunnerBackend.HPC_OPS.value

    def is_deep_gemm(self):
        return self.value == MoeRunnerBackend.DEEP_GEMM.value

    def is_triton(self):
        return self.value == MoeRunnerBackend.TRITON.value

    def is_ascend(self):
        return self.value == MoeRunnerBackend.ASCEND.value

    def is_triton_kernels(self):
        return self.value == MoeRunnerBackend.TRITON_KERNELS.value

    def is_flashinfer_trtllm(self):
        # experimental_sgl_trtllm shares the TRT-LLM FP8 kernels + layout, so it inherits
        # trtllm weight-prep here; divergent sites check is_experimental_sgl_trtllm() first.
        return self.value in (
            MoeRunnerBackend.FLASHINFER_TRTLLM.value,
            MoeRunnerBackend.EXPERIMENTAL_SGL_TRTLLM.value,
        )

    def is_experimental_sgl_trtllm(self):
        return self.value == MoeRunnerBackend.EXPERIMENTAL_SGL_TRTLLM.value

    def is_flashinfer_trtllm_routed(self):
        return self.value == MoeRunnerBackend.FLASHINFER_TRTLLM_ROUTED.value

    def is_flashinfer_cutlass(self):
        return self.value == MoeRunnerBackend.FLASHINFER_CUTLASS.value

    def is_flashinfer_cutedsl(self):
        return self.value == MoeRunnerBackend.FLASHINFER_CUTEDSL.value

    def is_flashinfer_megamoe(self):
        return self.value == MoeRunnerBackend.FLASHINFER_MEGAMOE.value

    def is_flashinfer_mxfp4(self):
        return self.value == MoeRunnerBackend.FLASHINFER_MXFP4.value

    def is_cutlass(self):
        return self.value == MoeRunnerBackend.CUTLASS.value

    def is_marlin(self):
        # experimental_sgl_marlin shares the marlin weight repack, quant-method
        # selection, and base fused path; divergent sites (the LoRA MoE dispatch)
        # check is_experimental_sgl_marlin() first.
        return self.value in (
            MoeRunnerBackend.MARLIN.value,
            MoeRunnerBackend.EXPERIMENTAL_SGL_MARLIN.value,
        )

    def is_experimental_sgl_marlin(self):
        return self.value == MoeRunnerBackend.EXPERIMENTAL_SGL_MARLIN.value

    def is_lora(self):
        return self.value in (
            MoeRunnerBackend.LORA_CUTEDSL.value,
            MoeRunnerBackend.LORA_TRITON.value,
            MoeRunnerBackend.LORA_MARLIN.value,
        )

    def is_lora_marlin(self):
        return self.value == MoeRunnerBackend.LORA_MARLIN.value

    def is_humming(self):
        return self.value == MoeRunnerBackend.HUMMING.value

    def is_aiter(self):
        return self.value == MoeRunnerBackend.AITER.value

    def is_intel_xpu(self):
        return self.value == MoeRunnerBackend.INTEL_XPU.value


class MoeRunnerBackend(_MoeRunnerBackendPredicates, Enum):
    AUTO = "auto"
    DEEP_GEMM = "deep_gemm"
    TRITON = "triton"
    TRITON_KERNELS = "triton_kernel"
    ASCEND = "ascend"
    FLASHINFER_TRTLLM = "flashinfer_trtllm"
    EXPERIMENTAL_SGL_TRTLLM = "experimental_sgl_trtllm"
    FLASHINFER_TRTLLM_ROUTED = "flashinfer_trtllm_routed"
    FLASHINFER_CUTLASS = "flashinfer_cutlass"
    FLASHINFER_MXFP4 = "flashinfer_mxfp4"
    FLASHINFER_CUTEDSL = "flashinfer_cutedsl"
    FLASHINFER_MEGAMOE = "flashinfer_megamoe"
    CUTLASS = "cutlass"
    MARLIN = "marlin"
    HUMMING = "humming"
    EXPERIMENTAL_SGL_MARLIN = "experimental_sgl_marlin"
    LORA_CUTEDSL = "lora_cutedsl"
    LORA_TRITON = "lora_triton"
    LORA_MARLIN = "lora_marlin"
    AITER = "aiter"
    HPC_OPS = "hpc_ops"
    INTEL_XPU = "intel_xpu"


@dataclass(frozen=True)
class RegisteredMoeRunnerBackend(_MoeRunnerBackendPredicates):
    """Identifier for an MoE runner backend supplied by an extension."""

    value: str


MoeRunnerBackendLike = MoeRunnerBackend | RegisteredMoeRunnerBackend
_REGISTERED_MOE_RUNNER_BACKEND_NAMES: set[str] = set()


def register_moe_runner_backend_name(name: str) -> None:
    """Register a backend name supplied by an out-of-tree extension."""

    if not name:
        raise ValueError("MoE runner backend name must not be empty")
    try:
        MoeRunnerBackend(name)
    except ValueError:
        _REGISTERED_MOE_RUNNER_BACKEND_NAMES.add(name)
    else:
        raise ValueError(f"MoE runner backend {name!r} is already built in")


def resolve_moe_runner_backend(
    backend: str | MoeRunnerBackendLike,
) -> MoeRunnerBackendLike:
    """Resolve a built-in or registered backend identifier."""

    if isinstance(backend, (MoeRunnerBackend, RegisteredMoeRunnerBackend)):
        return backend
    try:
        return MoeRunnerBackend(backend)
    except ValueError:
        if backend in _REGISTERED_MOE_RUNNER_BACKEND_NAMES:
            return RegisteredMoeRunnerBackend(backend)
        raise ValueError(
            f"MoE runner backend {backend!r} is neither built in nor registered"
        ) from None


class DeepEPv2Fp8ScaleFormat(NamedTuple):
    """DeepGEMM FP8 activation-scale layout expected from DeepEP v2."""

    tma_aligned: bool
    ue8m0: bool


class DeepEPMode(Enum):
    NORMAL = "normal"
    LOW_LATENCY = "low_latency"
    AUTO = "auto"

    def enable_normal(self) -> bool:
        return self in [DeepEPMode.NORMAL, DeepEPMode.AUTO]

    def enable_low_latency(self) -> bool:
        return self in [DeepEPMode.LOW_LATENCY, DeepEPMode.AUTO]

    def resolve(self, is_extend_in_batch: bool) -> DeepEPMode:
        if self != DeepEPMode.AUTO:
            return self

        if is_extend_in_batch:
            return DeepEPMode.NORMAL
        else:
            return DeepEPMode.LOW_LATENCY

    def is_normal(self) -> bool:
        return self == DeepEPMode.NORMAL

    def is_low_latency(self) -> bool:
        return self == DeepEPMode.LOW_LATENCY

    def is_auto(self) -> bool:
        return self == DeepEPMode.AUTO


class DispatcherOutputDtype(Enum):
    """
    Describes the dispatch output data type for DeepEP.

    - BF16: dispatch hidden states in bf16
    - FP8: dispatch hidden states in fp8
    - INT8: dispatch hidden states in int8
    - NVFP4: dispatch hidden states in nvfp4
    - MXFP4: dispatch hidden states in mxfp4 (fp4_e2m1 + e8m0 block scale)
    - MXFP8: dispatch hidden states in mxfp8 (fp8_e4m3 + e8m0 block scale)
    """

    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"
    MXFP8 = "mxfp8"


class FlashinferA2ADispatchType(Enum):
    BF16 = "bf16"
    NVFP4 = "nvfp4"
    MXFP8 = "mxfp8"


def get_flashinfer_a2a_dispatch_type() -> FlashinferA2ADispatchType:
    dispatch_type = get_exec().moe.flashinfer_a2a_dispatch_type

    if dispatch_type is None:
        if envs.SGLANG_MOE_NVFP4_DISPATCH.is_set():
            return (
                FlashinferA2ADispatchType.NVFP4
                if envs.SGLANG_MOE_NVFP4_DISPATCH.get()
                else FlashinferA2ADispatchType.BF16
            )
        return FlashinferA2ADispatchType.BF16

    if dispatch_type != "auto":
        return FlashinferA2ADispatchType(dispatch_type)

    raise RuntimeError(
        "flashinfer_a2a_dispatch_type='auto' reached the published runtime "
        "configuration; ServerArgs must resolve it before publication"
    )


def get_deepep_output_dtype(self) -> DispatcherOutputDtype:
    """
    Automatically choose the dispatch output dtype for DeepEP.

    The decision follows several checks in priority order:
    0. Parse server argument.
    1. Parse deprecated environment variables.
    2. If quant_config contains input_global_scale → NVFP4 path.
    3. Parse a mode-specific dtype from quant_config.
    4. Parse a generic dtype from quant_config.
    5. If flashinfer_cutedsl or is_cutlass backend is active → BF16 (it quantizes hidden_states internally).
    6. Otherwise default for NPU → BF16 (the default for NPU).
    7. Otherwise → FP8 (the default for most models like DeepSeek-V3).
    """

    # 0. Parse server argument.
    server_args = get_server_args()
    if server_args and get_exec().moe.deepep_dispatcher_output_dtype != "auto":
        return DispatcherOutputDtype(get_exec().moe.deepep_dispatcher_output_dtype)

    # 1. Parse deprecated environment variables.
    if envs.SGLANG_DEEPEP_BF16_DISPATCH.get():
        logger.warning_once(
            "Warning: The env variable SGLANG_DEEPEP_BF16_DISPATCH deprecated "
            "and will be removed in future releases. Please use a new "
            "`--deepep-dispatcher-output-dtype bf16` argument instead."
        )
        return DispatcherOutputDtype.BF16

    # 2. NVFP4 is detected inside dispatch_a / _dispatch_core via quant_config; no need to infer here.
    if self.quant_config is not None:
        input_global_scale = self.quant_config.get("input_global_scale", None)
        if input_global_scale is not None:
            return DispatcherOutputDtype.NVFP4

        # 3. Some MoE kernels require different wire formats for prefill and
        # decode. Prefer a mode-specific override when the dispatcher exposes
        # its concrete mode (normal or low_latency).
        dispatch_mode = getattr(self, "dispatch_mode", None)
        if dispatch_mode is not None:
            mode_dispatcher_output_dtype = self.quant_config.get(
                f"{dispatch_mode.value}_dispatcher_output_dtype", None
            )
            if mode_dispatcher_output_dtype is not None:
                return DispatcherOutputDtype(mode_dispatcher_output_dtype)

        # 4. Parse quant config to determine the output dtype of dispatcher
        dispatcher_output_dtype = self.quant_config.get("dispatcher_output_dtype", None)
        if dispatcher_output_dtype is not None:
            return DispatcherOutputDtype(dispatcher_output_dtype)

    backend = self.runner_backend
    if backend is not None and (
        backend.is_flashinfer_cutedsl() or backend.is_cutlass() or backend.is_humming()
    ):
        return DispatcherOutputDtype.BF16

    # 6. Default on NPU → BF16
    if _is_npu:
        return DispatcherOutputDtype.BF16

    # 7. Default → FP8
    return DispatcherOutputDtype.FP8


def get_ascend_dispatcher_output_dtype(dispatcher):
    """
    Automatically choose the dispatch output dtype for Ascend.
    """

    # 1. Parse quant config to determine the output dtype of dispatcher
    if dispatcher.quant_config is not None:
        dispatcher_output_dtype = dispatcher.quant_config.get(
            "dispatcher_output_dtype", None
        )
        if dispatcher_output_dtype is not None:
            return DispatcherOutputDtype(dispatcher_output_dtype)

    # 2. Ascend dispatch defaults to BF16
    return DispatcherOutputDtype.BF16


def get_deepep_v2_dispatcher_output_dtype(
    experts_are_fp8: bool,
) -> DispatcherOutputDtype:
    """Match the dispatch dtype to the expert weights consumed by DeepGEMM."""
    required = (
        DispatcherOutputDtype.FP8 if experts_are_fp8 else DispatcherOutputDtype.BF16
    )
    requested = get_exec().moe.deepep_dispatcher_output_dtype
    if requested != "auto" and DispatcherOutputDtype(requested) is not required:
        raise ValueError(
            f"--deepep-dispatcher-output-dtype {requested} contradicts this "
            f"checkpoint: --moe-a2a-backend deepep_v2 dispatches "
            f"{required.value} for "
            f"{'FP8 blockwise' if experts_are_fp8 else 'BF16'} experts. Drop "
            "the flag to let it follow the checkpoint."
        )
    return required


def get_deepep_v2_fp8_scale_format() -> DeepEPv2Fp8ScaleFormat:
    """Resolve the FP8 scale layout DeepEP v2 must pre-quantize into."""
    from sglang.srt.layers import deep_gemm_wrapper

    return DeepEPv2Fp8ScaleFormat(
        tma_aligned=(
            deep_gemm_wrapper.DEEPGEMM_NEED_TMA_ALIGNED_SCALES
            or deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0
        ),
        ue8m0=deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0,
    )


# Only flashinfer_megamoe is special-cased: its global-expert-id dispatch
# assumes quantized layers, which draft (MTP/NextN) layers typically are not.
# DeepGEMM megamoe (a2a "megamoe") falls back per-layer when its weights
# are not prepared, so drafts can inherit it. A quantized draft that wants
# flashinfer_megamoe must set the --speculative-moe-* flags explicitly.
def _default_speculative_a2a_backend(
    target_a2a_backend: MoeA2ABackend,
) -> MoeA2ABackend:
    if target_a2a_backend.is_flashinfer_megamoe():
        return MoeA2ABackend.NONE
    return target_a2a_backend


def _default_speculative_moe_runner_backend(
    target_runner_backend: MoeRunnerBackendLike,
) -> MoeRunnerBackendLike:
    if target_runner_backend.is_flashinfer_megamoe():
        return MoeRunnerBackend.FLASHINFER_TRTLLM
    return target_runner_backend


def initialize_moe_config():
    """Seed the MoE runtime flags from the published configuration.

    Reads the bags: `moe_a2a_backend` and its siblings are resolution's
    answers, and the record carries the operator's input. Called once per
    process after publish
    (scheduler init, the benchmark work functions).
    """
    exec_moe = get_exec().moe
    overlap = get_exec().overlap
    spec = get_spec()
    moe = get_flags().moe
    moe.a2a_backend = MoeA2ABackend(exec_moe.moe_a2a_backend)
    moe.runner_backend = resolve_moe_runner_backend(exec_moe.moe_runner_backend)
    moe.speculative_runner_backend = (
        resolve_moe_runner_backend(spec.speculative_moe_runner_backend)
        if spec.speculative_moe_runner_backend is not None
        else _default_speculative_moe_runner_backend(moe.runner_backend)
    )
    moe.speculative_a2a_backend = (
        MoeA2ABackend(spec.speculative_moe_a2a_backend)
        if spec.speculative_moe_a2a_backend is not None
        else _default_speculative_a2a_backend(moe.a2a_backend)
    )
    moe.deepep_mode = DeepEPMode(exec_moe.deepep_mode)
    moe.deepep_config = exec_moe.deepep_config or ""
    moe.tbo_enabled = overlap.enable_two_batch_overlap
    moe.sbo_enabled = overlap.enable_single_batch_overlap
    if moe.sbo_enabled and is_cuda():
        if torch.cuda.get_device_capability()[0] == 9:
            raise ValueError(
                "SBO (single batch overlap) is not supported on SM90 GPUs with latest sgl-deep-gemm wheel. Please try removing --enable-single-batch-overlap argument."
            )
    moe.tbo_token_distribution_threshold = overlap.tbo_token_distribution_threshold
    moe.disable_fp4_allgather = exec_moe.disable_flashinfer_cutlass_moe_fp4_allgather
    moe.quantization = get_model().quantization


def get_moe_a2a_backend() -> MoeA2ABackend:
    moe = get_flags().moe
    if moe.a2a_backend is None:
        moe.a2a_backend = MoeA2ABackend.NONE
    return moe.a2a_backend


def get_moe_runner_backend() -> MoeRunnerBackendLike:
    moe = get_flags().moe
    if moe.runner_backend is None:
        moe.runner_backend = MoeRunnerBackend.AUTO
    return moe.runner_backend


def get_speculative_moe_runner_backend() -> MoeRunnerBackendLike:
    moe = get_flags().moe
    if moe.speculative_runner_backend is None:
        logger.warning(
            "SPECULATIVE_MOE_RUNNER_BACKEND is not initialized, using auto backend"
        )
        moe.speculative_runner_backend = MoeRunnerBackend.AUTO
    return moe.speculative_runner_backend


def get_speculative_moe_a2a_backend() -> MoeA2ABackend:
    moe = get_flags().moe
    if moe.speculative_a2a_backend is None:
        logger.warning(
            "SPECULATIVE_MOE_A2A_BACKEND is not initialized, using none backend"
        )
        moe.speculative_a2a_backend = MoeA2ABackend.NONE
    return moe.speculative_a2a_backend


def is_shared_experts_fusion_disabled() -> bool:
    return get_model().shared_experts.fusion_disabled


def get_num_fused_shared_experts() -> int:
    return get_model().shared_experts.num_fused_shared_experts


@contextmanager
def draft_model_build_scope():
    """Brackets a draft model's CONSTRUCTION with the draft's construction-time
    settings; every value below returns to the target's on exit, including on
    error.

    - ``boundary_reduction`` is ``--speculative-boundary-reduction``.
      Boundaries built here keep the resolved value after exit.
    - ``enable_w4a4_mxfp4_megamoe`` is ``--speculative-enable-w4a4-mxfp4-megamoe``
      when set, else inherited. ``FusedMoE`` layers built here keep the
      draft's MegaMoE MMA type after exit.

    Deliberately does not touch ``runner_backend`` — swapping that is
    ``speculative_moe_backend_context``'s job and has to bracket the draft's
    whole lifecycle (build + capture + forward), which not every worker does.
    """
    moe = get_flags().moe
    original_scope = moe.in_speculative_scope
    try:
        moe.in_speculative_scope = True
        # Boundaries capture this resolved preference while the draft builds.
        # Restoring it cannot change an already constructed target plan.
        with (
            get_exec().comm.override(
                boundary_reduction=get_spec().speculative_boundary_reduction
            ),
            _draft_w4a4_mxfp4_megamoe_override(),
        ):
            yield
    finally:
        moe.in_speculative_scope = original_scope


def _draft_w4a4_mxfp4_megamoe_override() -> AbstractContextManager:
    # FusedMoE pins its MegaMoE MMA type at construction, so the draft's layers
    # keep this value after the scope exits.
    draft_w4a4 = get_spec().speculative_enable_w4a4_mxfp4_megamoe
    if draft_w4a4 is None:
        return nullcontext()
    return get_exec().moe.override(enable_w4a4_mxfp4_megamoe=draft_w4a4)


def resolve_shared_experts_config(
    model_class, hf_config, quant_config
) -> SharedExpertsConfig:
    """Resolve a model layout before construction; fusion requires both hooks."""
    disabled = get_exec().moe.disable_shared_experts_fusion
    gate = getattr(model_class, "shared_experts_fusion_disable_reason", None)
    if not disabled:
        reason = gate(hf_config, quant_config) if gate is not None else None
        if reason:
            log_info_on_rank0(
                logger, f"{reason} Shared experts fusion optimization is disabled."
            )
            disabled = True
    count_fusable = getattr(model_class, "num_fusable_shared_experts", None)
    if disabled or gate is None or count_fusable is None:
        num_fused = 0
    else:
        num_fused = count_fusable(hf_config)
    return SharedExpertsConfig(
        fusion_disabled=disabled,
        num_fused_shared_experts=num_fused,
        use_waterfill=num_fused > 0 and get_exec().moe.enable_waterfill,
    )


def get_deepep_mode() -> DeepEPMode:
    moe = get_flags().moe
    if moe.deepep_mode is None:
        logger.warning("DEEPEP_MODE is not initialized, using auto mode")
        moe.deepep_mode = DeepEPMode.AUTO
    return moe.deepep_mode


def get_deepep_config() -> str:
    moe = get_flags().moe
    if moe.deepep_config is None:
        logger.warning("DEEPEP_CONFIG is not initialized, using default config")
        moe.deepep_config = ""
    return moe.deepep_config


def is_tbo_enabled() -> bool:
    moe = get_flags().moe
    if moe.tbo_enabled is None:
        moe.tbo_enabled = False
    return moe.tbo_enabled


def is_sbo_enabled() -> bool:
    moe = get_flags().moe
    if moe.sbo_enabled is None:
        moe.sbo_enabled = False
    return moe.sbo_enabled


def is_deepep_class_backend() -> bool:
    """Return whether A2A combine occurs inside a DeepEP-family dispatcher."""
    b = get_moe_a2a_backend()
    return (
        b.is_deepep()
        or b.is_deepep_v2()
        or b.is_mooncake()
        or b.is_mori()
        or b.is_pplx()
    )


def uses_per_rank_fused_shared_slots() -> bool:
    """Check whether fused shared experts use per-rank physical slots."""
    return is_deepep_class_backend() or get_moe_a2a_backend().is_megamoe()


def has_per_rank_fused_shared_slots(num_shared: int) -> bool:
    """Whether the backend gives each rank its own fused shared-expert slots."""
    return num_shared > 0 and uses_per_rank_fused_shared_slots()


def is_flashinfer_cutedsl_v1_path() -> bool:
    """CuteDSL v1 + DeepEP low-latency path (no MoeRunner, no autotune)."""
    return (
        get_moe_runner_backend().is_flashinfer_cutedsl()
        and get_moe_a2a_backend().is_deepep()
    )


def get_tbo_token_distribution_threshold() -> float:
    moe = get_flags().moe
    if moe.tbo_token_distribution_threshold is None:
        logger.warning(
            "TBO_TOKEN_DISTRIBUTION_THRESHOLD is not initialized, using 0.48"
        )
        moe.tbo_token_distribution_threshold = 0.48
    return moe.tbo_token_distribution_threshold


def filter_moe_weight_param_global_expert(name, x, num_local_experts):
    """
    Filter out for MoE expert parameters that requires global expert.
    """
    return (
        not getattr(x, "_sglang_require_global_experts", False)
        and x.data.ndim > 0
        and x.data.shape[0] == num_local_experts
    )


def should_use_flashinfer_cutlass_moe_fp4_allgather():
    """
    Perform FP4 quantize before all-gather for flashinfer cutlass moe to reduce communication cost for high-throughput serving.
    """
    return (
        not get_flags().moe.disable_fp4_allgather
        and get_moe_a2a_backend().is_none()
        and get_moe_runner_backend().is_flashinfer_cutlass()
        and is_dp_attention_enabled()
        and get_flags().moe.quantization == "modelopt_fp4"
        and get_parallel().moe_ep_size == get_parallel().attn_dp_size
    )


def is_moe_input_scattered_across_dp_ranks() -> bool:
    """Whether sparse MoE routing runs on a DP-local token shard."""
    return (
        not get_moe_a2a_backend().is_none()
        or should_use_flashinfer_cutlass_moe_fp4_allgather()
        or get_parallel().dwdp_size > 1
    )


def should_use_dp_reduce_scatterv():
    """
    Whether the parallel configuration allows reduce_scatterv for returning an
    FFN output over attention DP (DP attention with EP), replacing the default
    all-reduce + dp_scatter path; a stage boundary also needs boundary_reduction
    rsv or rs+rsv. Only that post-expert return changes; dispatch is unchanged.

    The reduce_scatterv group is the global TP group, while its variable split
    sizes are one entry per attention-DP rank. Therefore this optimization is
    valid only when each attention-DP shard has a single rank (attention TP=1).
    Configurations with partial attention TP fall back to all-reduce + dp_scatter.
    """
    return (
        not should_use_flashinfer_cutlass_moe_fp4_allgather()
        and get_moe_a2a_backend().is_none()
        and is_dp_attention_enabled()
        and get_parallel().attn_dp_size > 1
        and get_parallel().tp_size == get_parallel().attn_dp_size
        and get_parallel().moe_ep_size == get_parallel().attn_dp_size
    )


def should_skip_mlp_all_reduce() -> bool:
    """Whether dense MLP / row-parallel projections should skip their all-reduce.

    True when the decoder published ``mlp_reduce_scatter`` (postprocess will
    reduce-scatter) on ``get_forward()``.
    """
    return get_forward().mlp_reduce_scatter


def post_experts_output_is_complete(*, is_tp_path: bool) -> bool:
    """Whether the experts' output owes no sum over the MoE-TP group
    (``is_tp_path=True``) or the EP group: the combine already summed it, or each
    rank computed its own tokens in full.

    This is a property of the MoE configuration. Whether the MoE block or a later
    step runs a sum that is still owed is decided separately.
    """
    if get_parallel().dwdp_size > 1:
        return True
    if should_use_flashinfer_cutlass_moe_fp4_allgather():
        # The standard dispatcher all-gathers tokens and reduce-scatters the
        # expert outputs over _TP, which spans the whole EP group
        # (moe_ep_size == attn_dp_size), so both post-experts sums are already
        # done. An extra EP all-reduce would reduce DP-local outputs of
        # different tokens, and mismatched token counts across ranks crash or
        # hang the collective.
        return True
    a2a = get_moe_a2a_backend()
    # The flashinfer and pplx combines, and the megamoe kernel's internal
    # combine, sum each token's expert outputs back to its source rank.
    return a2a.is_flashinfer() or a2a.is_pplx() or a2a.is_flashinfer_megamoe()


def should_skip_post_experts_all_reduce(*, is_tp_path: bool) -> bool:
    """Whether the MoE block should leave out its post-experts all-reduce: a later
    step runs it (fused into the next norm, or as the reduce-scatter back to the
    local tokens), or there is nothing to sum.

    Pass ``is_tp_path=True`` for the TP all-reduce, ``False`` for the EP one.
    """
    return should_skip_mlp_all_reduce() or post_experts_output_is_complete(
        is_tp_path=is_tp_path
    )


def reduce_moe_output(hidden_states: torch.Tensor) -> torch.Tensor:
    """All-reduce a MoE block's output (routed plus shared experts) over TP,
    unless a later step does it or there is nothing to sum."""
    from sglang.srt.distributed.communication_op import (
        tensor_model_parallel_all_reduce,
    )

    if get_parallel().tp_size > 1 and not should_skip_post_experts_all_reduce(
        is_tp_path=True
    ):
        return tensor_model_parallel_all_reduce(hidden_states)
    return hidden_states


def should_add_replicated_moe_output() -> bool:
    """Whether this rank adds an output every TP rank holds in full, such as a
    shared expert replicated with tp_size=1, to its MoE output.

    Call it after the MoE block's own reduction. When a later step still sums
    the output over TP, only TP rank 0 adds it, so the sum counts it once.
    """
    parallel = get_parallel()
    summed_later = should_skip_post_experts_all_reduce(
        is_tp_path=True
    ) and not post_experts_output_is_complete(is_tp_path=True)
    return not (parallel.tp_size > 1 and summed_later and parallel.tp_rank != 0)


def adds_replicated_output_to_partial() -> bool:
    """For a MoE block whose stage boundary completes its sum: whether this rank
    adds an output every TP rank holds in full, such as a shared expert
    replicated with tp_size=1, to its MoE output. While the output still owes a
    TP sum, only TP rank 0 adds it, so the sum counts it once."""
    parallel = get_parallel()
    owes_sum = parallel.tp_size > 1 and not post_experts_output_is_complete(
        is_tp_path=True
    )
    return not owes_sum or parallel.tp_rank == 0


def can_merge_post_experts_all_reduce() -> bool:
    """Whether the EP and MoE-TP reductions can collapse into one _TP all-reduce.

    True when moe_dp_size == 1: the two groups are an orthogonal decomposition
    of _TP, so reducing over each in turn equals one _TP reduction.
    """
    parallel = get_parallel()
    return (
        parallel.moe_ep_size > 1
        and parallel.moe_tp_size > 1
        and parallel.moe_dp_size == 1
    )


def post_experts_all_reduce(hidden_states: torch.Tensor) -> torch.Tensor:
    """Reduce the post-experts MoE output across the EP and MoE-TP groups.

    When both are live and mergeable, issues one _TP all-reduce instead of two
    sequential ones, which also restores the invariant the fused residual+LN path
    depends on.
    """
    parallel = get_parallel()
    return _post_experts_sum(
        hidden_states,
        reduce_ep=parallel.moe_ep_size > 1
        and not should_skip_post_experts_all_reduce(is_tp_path=False),
        reduce_tp=parallel.moe_tp_size > 1
        and not should_skip_post_experts_all_reduce(is_tp_path=True),
    )


def sum_post_experts_output(hidden_states: torch.Tensor) -> torch.Tensor:
    """Complete the sum a MoE output owes over the EP and MoE-TP groups, for the
    boundary that owns it; a path the combine already summed is left alone."""
    parallel = get_parallel()
    return _post_experts_sum(
        hidden_states,
        reduce_ep=parallel.moe_ep_size > 1
        and not post_experts_output_is_complete(is_tp_path=False),
        reduce_tp=parallel.moe_tp_size > 1
        and not post_experts_output_is_complete(is_tp_path=True),
    )


def _post_experts_sum(
    hidden_states: torch.Tensor, *, reduce_ep: bool, reduce_tp: bool
) -> torch.Tensor:
    from sglang.srt.distributed.communication_op import (
        moe_expert_parallel_all_reduce,
        moe_tensor_model_parallel_all_reduce,
        tensor_model_parallel_all_reduce,
    )

    if reduce_ep and reduce_tp and can_merge_post_experts_all_reduce():
        return tensor_model_parallel_all_reduce(hidden_states)

    if reduce_ep:
        hidden_states = moe_expert_parallel_all_reduce(hidden_states)
    if reduce_tp:
        hidden_states = moe_tensor_model_parallel_all_reduce(hidden_states)
    return hidden_states


def post_experts_reduction_group():
    """The group one all-reduce of an MoE output runs over: TP when the EP and
    MoE-TP reductions merge, otherwise EP, otherwise MoE-TP. The same group
    ``resolve_fusion_group`` builds the fused workspace on."""
    parallel = get_parallel()
    if can_merge_post_experts_all_reduce():
        return parallel.tp_group
    if parallel.moe_ep_size > 1:
        return parallel.moe_ep_group
    return parallel.moe_tp_group


def post_experts_sum_is_one_all_reduce() -> bool:
    """Whether the sum an FFN leaves out when it skips its post-experts (or
    down-projection) all-reduce is one full-precision all-reduce over the TP
    group itself, on a plain partial sum: the all-reduce a later step can run
    instead. Not when the combine already summed the output, the reduction is
    quantized, a replicated shared expert is added after it, LoRA-B runs on
    the unreduced activations, or the EP and MoE-TP sums run in two steps or
    over another group."""
    parallel = get_parallel()
    return (
        get_moe_a2a_backend().is_none()
        and not post_experts_output_is_complete(is_tp_path=True)
        and not get_exec().comm.enable_quant_communications
        and not envs.SGLANG_SHARED_EXPERT_TP1.get()
        and not get_lora().enable_lora
        # Some MoE blocks reduce EP and MoE-TP in two steps instead of merging.
        and not (parallel.moe_ep_size > 1 and parallel.moe_tp_size > 1)
        and post_experts_reduction_group() is parallel.tp_group
    )


def deferred_post_experts_all_reduce(hidden_states: torch.Tensor) -> torch.Tensor:
    """Run the post-experts reduction that was deferred to allreduce fusion.

    Called when the fused residual+LN kernel cannot service the shape.
    """
    return post_experts_reduction_group().all_reduce(hidden_states)


@contextmanager
def speculative_moe_backend_context():
    """
    Context manager to temporarily use the speculative MoE backend for draft model operations.
    This ensures that draft models in speculative decoding use the configured speculative backend.

    """
    moe = get_flags().moe
    original_backend = moe.runner_backend
    try:
        moe.runner_backend = get_speculative_moe_runner_backend()
        yield
    finally:
        moe.runner_backend = original_backend


@contextmanager
def speculative_moe_a2a_backend_context():
    """
    Context manager to temporarily use the speculative MoE A2A backend for draft model operations.
    This ensures that draft models in speculative decoding use the configured speculative A2A backend.
    """
    moe = get_flags().moe
    original_backend = moe.a2a_backend
    original_disable_fp4_allgather = moe.disable_fp4_allgather
    original_speculative_context = moe.speculative_context
    try:
        moe.a2a_backend = get_speculative_moe_a2a_backend()
        # Disable FP4 allgather for spec decode since MTP layers are unquantized
        moe.disable_fp4_allgather = True
        moe.speculative_context = True
        yield
    finally:
        moe.a2a_backend = original_backend
        moe.disable_fp4_allgather = original_disable_fp4_allgather
        moe.speculative_context = original_speculative_context


# The type of method in top-K routing, for use in torch custom op
# Please keep this in sync with the counterpart defined in https://github.com/flashinfer-ai/flashinfer/blob/main/include/flashinfer/trtllm/fused_moe/runner.h
class RoutingMethodType(IntEnum):
    # Default: Softmax -> TopK
    Default = (0,)
    # Renormalize: TopK -> Softmax
    Renormalize = (1,)
    # DeepSeekV3: Sigmoid -> RoutingBiasAdd -> Top2 in group -> Top4 groups -> Top8 experts from the Top4 groups
    DeepSeekV3 = (2,)
    # Llama4: Top1 -> Sigmoid
    Llama4 = (3,)
    # Qwen3: Softmax -> TopK -> Renormalize
    RenormalizeNaive = (4,)
    # TopK only (no softmax)
    TopK = (5,)
    # SigmoidRenorm: Sigmoid -> TopK -> Renormalize
    SigmoidRenorm = (6,)
    # MiniMax2
    MiniMax2 = (7,)
    # Sigmoid: Sigmoid -> TopK (no renormalize)
    Sigmoid = (8,)
    # Unspecified
    Unspecified = 9


AITER_PADDING_SIZE = 128
TRITON_PADDING_SIZE = 128

# Row-stride padding, in bytes, applied to XPU MoE expert weights whose K dim
# lands on an L3 aliasing stride (see xpu_moe_ld_padding_elems). 64B matches
# the 32 bf16 elements used by the sgl-kernel-xpu MoE benchmark. Expressed in
# bytes because the aliasing is a property of the row's byte size, so this
# stays correct if the path ever carries a non-bf16 weight dtype.
#
# Measured on BMG: halving this to 32B still clears the aliasing but runs ~6%
# slower than not padding at all on hidden=7168 shapes (0.94x), presumably by
# misaligning the grouped GEMM's row loads. Doubling it to 128B gains nothing
# over 64B. Re-measure before changing.
XPU_MOE_LD_PADDING_BYTES = 64


def xpu_moe_ld_padding_elems(k_dim: int, itemsize: int) -> int:
    """Extra elements to add to an XPU MoE weight's row stride (leading dim).

    The Xe20 grouped GEMM walks B row-by-row over the K dim, so the row stride
    in bytes decides which L3 set each row lands in. The L3 set index is
    derived by XOR-folding address bits; when the row byte size is a multiple
    of 2048 with an odd cofactor >= 3 (K = 3072, 7168, ... in bf16) successive
    rows collapse onto a small number of sets and thrash. Padding the stride
    (without changing the logical shape) breaks the aliasing.

    Returns 0 when the shape is already well distributed, so callers can use
    this to decide whether to allocate a padded buffer at all.
    """
    row_bytes = k_dim * itemsize
    if row_bytes <= 0 or XPU_MOE_LD_PADDING_BYTES % itemsize != 0:
        return 0
    trailing_zeros = (row_bytes & -row_bytes).bit_length() - 1
    odd_cofactor = row_bytes >> trailing_zeros
    if trailing_zeros >= 11 and odd_cofactor >= 3:
        return XPU_MOE_LD_PADDING_BYTES // itemsize
    return 0


# Unit of padding - context dependent
def get_moe_padding_size(is_aiter_moe):
    if is_aiter_moe:
        return AITER_PADDING_SIZE
    else:
        return (
            TRITON_PADDING_SIZE
            if bool(int(os.getenv("SGLANG_MOE_PADDING", "0")))
            else 0
        )


def get_moe_weight_sizes(inter_dim, is_concat, is_packed, is_aiter_moe):
    """
    Calculate dimensions for MoE weight tensors.

    Args:
        inter_dim: Base intermediate dimension.
        is_concat: If True, fusions W1 (gate) and W3 (up) projections.
        is_packed: If True, uses 4-bit quantization (two FP4 elements per byte).
        is_aiter_moe: If True, applies Aiter-specific kernel padding alignment.
    """
    # w2_down_dim is the packing rank, but w13_up_dim not (of matrix to matmul)
    w13_up_dim = 2 * inter_dim if is_concat else inter_dim
    w2_down_dim = inter_dim // 2 if is_packed else inter_dim

    if is_aiter_moe:
        padding_size = get_moe_padding_size(True)
        align_aiter = lambda n: ((n + padding_size - 1) // padding_size) * padding_size
        is_padded = (w2_down_dim % padding_size) > 0
        if is_padded:
            # w2_down_dim, padding & aligned, unit: parameter dtype
            w2_down_dim = align_aiter(w2_down_dim)
        # up proj + gate fusion : 2x
        if is_concat:
            w13_up_dim = w2_down_dim * 2
        # packed
        if hasattr(torch, "float4_e2m1fn_x2") and is_packed:
            # w13_up_dim (row rank of matmul matrix) is not packing dim, *2 to recover
            w13_up_dim *= 2

    return (w13_up_dim, w2_down_dim, False if not is_aiter_moe else is_padded)
