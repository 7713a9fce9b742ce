from sglang.srt.environ import envs
from sglang.srt.layers.attention.tbo_backend import TboAttnBackend
from sglang.srt.layers.cp.utils import is_cp_active
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
    is_in_breakable_cuda_graph,
)
from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (
    is_in_tc_piecewise_cuda_graph,
)
from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
    AttnForwardMethod,
)
from sglang.srt.models.deepseek_common.utils import _is_hip
from sglang.srt.runtime_context import (
    get_exec,
    get_parallel,
    get_platform,
)
from sglang.srt.utils import (
    is_gfx95_supported,
    use_intel_amx_backend,
)

MHA_ONE_SHOT_SUPPORTED_BACKENDS = ["fa3", "flashinfer", "flashmla", "aiter"]

# ROCm runs dedicated MHA/MLA implementations (forward_mha_rocm.py /
# forward_mla_rocm.py) so the shared CUDA paths carry no AMD branches. Backend
# handlers keep returning the generic method; the platform swap happens here.
# MHA_CHUNKED_KV deliberately stays generic on ROCm. Its shared implementation
# selects the ROCm prepare/fetch helpers and the portable merge_state wrapper.
_ROCM_FORWARD_METHODS = {
    AttnForwardMethod.MHA: AttnForwardMethod.MHA_ROCM,
    AttnForwardMethod.MHA_ONE_SHOT: AttnForwardMethod.MHA_ONE_SHOT_ROCM,
    AttnForwardMethod.MHA_CHUNKED_KV: AttnForwardMethod.MHA_CHUNKED_KV_ROCM,
    AttnForwardMethod.MLA: AttnForwardMethod.MLA_ROCM,
}


def resolve_rocm_forward_method(method: AttnForwardMethod) -> AttnForwardMethod:
    if not _is_hip:
        return method
    return _ROCM_FORWARD_METHODS.get(method, method)


class AttentionBackendRegistry:
    _handlers = {}

    @classmethod
    def register(cls, backend_name, handler_func):
        cls._handlers[backend_name] = handler_func

    @classmethod
    def get_handler(cls, backend_name):
        return cls._handlers.get(backend_name, cls._handlers.get("triton"))


def _dispatch_mla_subtype(attn, forward_batch):
    if _is_hip:
        if (
            attn.rocm_fused_decode_mla
            and forward_batch.forward_mode.is_decode()
            and attn.current_attention_backend == "aiter"
        ):
            return AttnForwardMethod.MLA_FUSED_ROPE_ROCM
        else:
            return AttnForwardMethod.MLA
    else:
        if hasattr(attn, "fused_qkv_a_proj_with_mqa") and use_intel_amx_backend(attn):
            return AttnForwardMethod.MLA_FUSED_ROPE_CPU
        else:
            return AttnForwardMethod.MLA


def handle_attention_ascend(attn, forward_batch):
    if (
        forward_batch.forward_mode.is_extend()
        and not forward_batch.forward_mode.is_target_verify()
        and not forward_batch.forward_mode.is_draft_extend_v2()
    ):
        if hasattr(attn, "use_dsa") and attn.use_dsa:
            return AttnForwardMethod.DSA_NPU
        else:
            return AttnForwardMethod.MHA_NPU
    else:
        if hasattr(attn, "use_dsa") and attn.use_dsa:
            return AttnForwardMethod.DSA_NPU
        else:
            return AttnForwardMethod.MLA_NPU


def _get_sum_extend_prefix_lens(forward_batch):
    return (
        sum(forward_batch.extend_prefix_lens_cpu)
        if forward_batch.extend_prefix_lens_cpu is not None
        else 0
    )


def _support_mha_one_shot(attn, forward_batch, backend_name):
    attn_supported = backend_name in MHA_ONE_SHOT_SUPPORTED_BACKENDS
    sum_seq_lens = (
        sum(forward_batch.seq_lens_cpu) if forward_batch.seq_lens_cpu is not None else 0
    )
    return attn_supported and sum_seq_lens <= forward_batch.get_max_chunk_capacity()


def _handle_attention_backend(attn, forward_batch, backend_name):
    # Captured prefill (tc_piecewise or breakable) must keep a single attention
    # path: pin the absorbed MLA method — MHA one-shot/chunked shapes vary with
    # kv-len and cannot be captured.
    if is_in_tc_piecewise_cuda_graph() or is_in_breakable_cuda_graph():
        return AttnForwardMethod.MLA

    # Strategy CP gathers latent KV in the backend's absorbed MLA path;
    # normal MHA would write rank-local KV against full cache locations.
    if is_cp_active(forward_batch):
        return _dispatch_mla_subtype(attn, forward_batch)

    sum_extend_prefix_lens = _get_sum_extend_prefix_lens(forward_batch)
    disable_ragged = (backend_name in ["flashinfer", "flashmla"]) and (
        attn.flashinfer_mla_disable_ragged or attn.qk_rope_head_dim == 0
    )

    if (
        not disable_ragged
        and forward_batch.forward_mode.is_extend_without_speculative()
        and (
            (
                sum_extend_prefix_lens >= attn.chunked_prefix_cache_threshold
                and not attn.disable_chunked_prefix_cache
            )
            or sum_extend_prefix_lens == 0
        )
    ):
        if _support_mha_one_shot(attn, forward_batch, backend_name):
            return AttnForwardMethod.MHA_ONE_SHOT
        return AttnForwardMethod.MHA_CHUNKED_KV
    else:
        return _dispatch_mla_subtype(attn, forward_batch)


def handle_attention_flashinfer(attn, forward_batch):
    return _handle_attention_backend(attn, forward_batch, "flashinfer")


def handle_attention_fa3(attn, forward_batch):
    # when deterministic inference is enabled, use MLA
    if get_exec().deterministic.enable_deterministic_inference:
        return _dispatch_mla_subtype(attn, forward_batch)
    else:
        return _handle_attention_backend(attn, forward_batch, "fa3")


def handle_attention_flashmla(attn, forward_batch):
    return _handle_attention_backend(attn, forward_batch, "flashmla")


def handle_attention_fa4(attn, forward_batch):
    # FA4 absorbed MLA feeds q_nope through the qv argument, which
    # flash_attn.cute only implements on SM100/SM110 (not SM120); keep the
    # pre-existing MHA chunked-KV path elsewhere. Deterministic inference
    # requires MLA and rejects fa4 on other archs at startup (server_args).
    if not get_platform().is_sm100_or_sm110:
        return AttnForwardMethod.MHA_CHUNKED_KV
    if get_exec().deterministic.enable_deterministic_inference:
        return _dispatch_mla_subtype(attn, forward_batch)
    return _handle_attention_backend(attn, forward_batch, "fa4")


def handle_attention_trtllm_mla(attn, forward_batch):
    if is_in_tc_piecewise_cuda_graph() or is_in_breakable_cuda_graph():
        return AttnForwardMethod.MLA

    sum_extend_prefix_lens = _get_sum_extend_prefix_lens(forward_batch)
    if forward_batch.forward_mode.is_extend_without_speculative() and (
        not attn.disable_chunked_prefix_cache or sum_extend_prefix_lens == 0
    ):
        return AttnForwardMethod.MHA_CHUNKED_KV
    else:
        return _dispatch_mla_subtype(attn, forward_batch)


def handle_attention_aiter(attn, forward_batch):
    # During PCG/BCG capture on ROCm, aiter fp8 MLA prefill has no capture
    # kernels; route through the MHA path (radix_attention swaps attn_mqa for
    # its attn_mha companion) so capture/replay use valid head/dim metadata.
    if is_in_tc_piecewise_cuda_graph() or is_in_breakable_cuda_graph():
        return AttnForwardMethod.MHA
    if forward_batch.forward_mode.is_extend_without_speculative():
        if not _support_mha_one_shot(attn, forward_batch, "aiter"):
            return AttnForwardMethod.MHA_CHUNKED_KV
        if get_parallel().dcp_enabled:
            return AttnForwardMethod.MHA_ONE_SHOT
        return AttnForwardMethod.MHA
    else:
        return AttnForwardMethod.MLA


def handle_attention_dsa(attn, forward_batch):
    """
    Dispatch logic is centralized in DeepseekSparseAttnBackend.set_dsa_prefill_impl and executed
    in init_forward_metadata. Read the decision from backend.use_mha.
    """

    backend = get_attn_backend()
    if isinstance(backend, TboAttnBackend):  # if enable tbo, get primary backend
        backend = backend.primary
    if hasattr(backend, "use_mha") and backend.use_mha:
        return AttnForwardMethod.MHA_ONE_SHOT
    return AttnForwardMethod.MLA


def _can_use_triton_dense_fp8_prefill(attn, forward_batch) -> bool:
    prefix_lens = forward_batch.extend_prefix_lens_cpu
    return (
        _is_hip
        and is_gfx95_supported()
        and envs.SGLANG_TRITON_FP8_PREFILL_ATTN.get()
        and attn.kv_cache_dtype == "fp8_e4m3"
        and attn.num_local_heads == 12
        and attn.qk_nope_head_dim == 128
        and attn.qk_rope_head_dim == 64
        and attn.v_head_dim == 128
        and attn.kv_lora_rank == 512
        and not get_parallel().dcp_enabled
        and forward_batch.forward_mode.is_extend_without_speculative()
        and prefix_lens is not None
        and any(prefix_lens)
    )


def handle_attention_triton(attn, forward_batch):
    if is_in_tc_piecewise_cuda_graph() or is_in_breakable_cuda_graph():
        return AttnForwardMethod.MLA

    # when deterministic inference is enabled, use MLA
    if get_exec().deterministic.enable_deterministic_inference:
        return _dispatch_mla_subtype(attn, forward_batch)

    # Kimi-K3 with an FP8 latent cache uses dense 192/128 K/V for cached
    # prefixes. Always select chunked-KV here: its fast path packs the prefix
    # once and fuses it with the current chunk in the normal extend kernel.
    if _can_use_triton_dense_fp8_prefill(attn, forward_batch):
        return AttnForwardMethod.MHA_CHUNKED_KV

    if (
        forward_batch.forward_mode.is_extend_without_speculative()
        and sum(forward_batch.extend_prefix_lens_cpu) == 0
    ):
        return AttnForwardMethod.MHA
    return _dispatch_mla_subtype(attn, forward_batch)


def handle_attention_intel_xpu(attn, forward_batch):
    return _handle_attention_backend(attn, forward_batch, "intel_xpu")


AttentionBackendRegistry.register("ascend", handle_attention_ascend)
AttentionBackendRegistry.register("flashinfer", handle_attention_flashinfer)
AttentionBackendRegistry.register("fa3", handle_attention_fa3)
AttentionBackendRegistry.register("flashmla", handle_attention_flashmla)
AttentionBackendRegistry.register("fa4", handle_attention_fa4)
AttentionBackendRegistry.register("trtllm_mla", handle_attention_trtllm_mla)
AttentionBackendRegistry.register("aiter", handle_attention_aiter)
AttentionBackendRegistry.register("dsa", handle_attention_dsa)
AttentionBackendRegistry.register(
    "nsa", handle_attention_dsa
)  # Deprecated alias; use "dsa"
AttentionBackendRegistry.register("triton", handle_attention_triton)
AttentionBackendRegistry.register("intel_xpu", handle_attention_intel_xpu)
