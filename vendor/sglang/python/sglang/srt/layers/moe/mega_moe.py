# Copyright 2023-2024 SGLang Team
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""Mega-MoE forward path and expert-weight prep shared by Deepseek V2/V4."""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from sglang.kernels.ops.moe.dsv4 import mega_moe_pre_dispatch
from sglang.srt.environ import envs
from sglang.srt.layers.attention.dsa.utils import is_dsa_enable_prefill_cp
from sglang.srt.layers.dp_attention import get_dp_global_num_tokens
from sglang.srt.layers.moe.mega_gate import run_mega_gate, should_use_mega_gate
from sglang.srt.layers.moe.mega_moe_sm90 import (
    is_sm90_fp8_mega_moe_available,
    run_sm90_mega_routed,
)
from sglang.srt.layers.moe.utils import get_moe_a2a_backend
from sglang.srt.model_executor.runner import get_is_capture_mode
from sglang.srt.models.deepseek_common.utils import _device_sm
from sglang.srt.multimodal.dsv41.vl_routing import vision_topk
from sglang.srt.utils import is_hip, is_sm100_supported

if TYPE_CHECKING:
    from deep_gemm import SymmBuffer

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE


_MEGA_MOE_SYMM_BUFFER: dict = {}
_is_hip = is_hip()


def _use_amd_flydsl_mega_moe() -> bool:
    # aiter MegaMoEv2 exists only on ROCm; the platform check keeps the env from
    # diverting a CUDA run into a path whose kernels it does not have.
    return _is_hip and envs.SGLANG_AMD_USE_FLYDSL_MEGA_MOE.get()


def _mega_moe_mma_type(experts) -> str:
    if experts._mega_moe_nvfp4:
        return "nvfp4xnvfp4"
    # Per layer: a draft may differ from the target (draft_model_build_scope).
    return "mxf4xmxf4" if experts._mega_moe_w4a4 else "fp8xfp4"


@functools.lru_cache(maxsize=1)
def _mega_moe_max_num_sms() -> Optional[int]:
    if _device_sm < 100:
        # The SM90 MegaMoE implementation does not use the whole-grid clustered
        # launch that needs a residency margin.
        return None

    # Physical count, not deep_gemm.get_num_sms(): two-batch overlap and the DSA
    # indexer reconfigure that process-wide, so reserving on top would compound.
    num_sms = torch.cuda.get_device_properties(device="cuda").multi_processor_count
    reserved_num_sms = max(envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.get(), 0)
    return max(2, num_sms - reserved_num_sms)


@contextmanager
def _configure_mega_moe_deep_gemm_num_sms(deep_gemm):
    max_num_sms = _mega_moe_max_num_sms()
    if max_num_sms is None:
        yield
        return

    current_num_sms = deep_gemm.get_num_sms()
    # Stay under an outer context's budget instead of claiming SMs back from it.
    target_num_sms = min(max_num_sms, current_num_sms)
    # Round down: the clustered launch needs an even CTA count.
    target_num_sms -= target_num_sms % 2
    if target_num_sms == current_num_sms:
        yield
        return

    deep_gemm.set_num_sms(target_num_sms)
    try:
        yield
    finally:
        deep_gemm.set_num_sms(current_num_sms)


def check_mega_moe_shapes(hidden: int, intermediate: int, mma_type: str) -> None:
    # SGLang's pre-dispatch requires 16-byte input SF rows (hidden % 512).
    # The pinned DeepGEMM FP8/FP4 path copies intermediate scales separately
    # from token TMA loads, so intermediate % 128 suffices, including V4.1
    # Flash's 2304-wide intermediate dimension.
    # Keep the existing restrictions on the other MMA paths.
    scale_group = 16 if mma_type == "nvfp4xnvfp4" else 32
    align = 128 if mma_type == "fp8xfp4" else 16 * scale_group
    hidden_align = 16 * scale_group
    if hidden % hidden_align != 0 or intermediate % align != 0:
        raise ValueError(
            f"DeepGEMM MegaMoE ({mma_type}) needs hidden_size to be a multiple "
            f"of {hidden_align} and moe_intermediate_size to be a multiple of "
            f"{align}; got "
            f"hidden_size={hidden}, moe_intermediate_size={intermediate}. "
            "Use another --moe-a2a-backend for this model."
        )


def _get_mega_moe_symm_buffer(
    group,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate_hidden: int,
    num_shared_experts: int = 0,
    *,
    mma_type: str,
    activation: str = "swiglu",
) -> SymmBuffer:
    import deep_gemm

    with _configure_mega_moe_deep_gemm_num_sms(deep_gemm):
        key = (
            id(group),
            num_max_tokens_per_rank,
            num_experts,
            num_topk,
            hidden,
            intermediate_hidden,
            mma_type,
            activation,
            num_shared_experts,
            deep_gemm.get_num_sms(),
        )
        buf = _MEGA_MOE_SYMM_BUFFER.get(key)
        if buf is None:
            buf = deep_gemm.get_symm_buffer_for_mega_moe(
                group,
                num_experts,
                num_max_tokens_per_rank,
                num_topk,
                hidden,
                intermediate_hidden,
                num_shared_experts=num_shared_experts,
                mma_type=mma_type,
                activation=activation,
            )
            _MEGA_MOE_SYMM_BUFFER[key] = buf
    return buf


def is_mega_moe_experts_ready(experts) -> bool:
    if not experts._mega_moe_weights_built:
        return False
    if _device_sm == 90:
        return is_sm90_fp8_mega_moe_available(experts)
    # The SM100 mega kernels exist for compute capability 10.x only.
    return _device_sm // 10 == 10


def should_use_mega_moe(moe: DeepseekV2MoE, hidden_states: torch.Tensor) -> bool:
    if _use_amd_flydsl_mega_moe():
        from sglang.srt.layers.moe.mega_moe_flydsl import (
            should_use_mega_moe as should_use_flydsl_mega_moe,
        )

        return should_use_flydsl_mega_moe(moe, hidden_states)

    if not get_moe_a2a_backend().is_megamoe():
        return False
    if not is_mega_moe_experts_ready(moe.experts):
        return False
    if get_is_capture_mode():
        return True

    global_num_tokens = get_dp_global_num_tokens()
    if global_num_tokens and not is_dsa_enable_prefill_cp():
        max_tokens_per_rank = max(global_num_tokens)
    else:
        max_tokens_per_rank = hidden_states.shape[0]
    cap = envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.get()
    return max_tokens_per_rank <= cap


def should_fuse_mega_moe_shared_experts(moe: DeepseekV2MoE) -> bool:
    # DeepGEMM's in-kernel shared expert takes FP8 weights on SM100 fp8xfp4 only.
    return (
        envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_FUSE_SHARED_EXPERTS.get()
        and get_moe_a2a_backend().is_megamoe()
        and getattr(moe.experts, "_mega_moe_weights_built", False)
        and is_sm100_supported()
        and _mega_moe_mma_type(moe.experts) == "fp8xfp4"
        and moe.shared_experts_is_fp8
        and moe.shared_experts_weight_block_size is not None
        and moe.shared_experts_weight_block_size[1] % 32 == 0
    )


def forward_mega_moe(
    moe: DeepseekV2MoE,
    hidden_states: torch.Tensor,
    forward_batch: Optional[ForwardBatch] = None,
    input_ids_global: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    if _use_amd_flydsl_mega_moe():
        from sglang.srt.layers.moe.mega_moe_flydsl import (
            forward_mega_moe as forward_flydsl_mega_moe,
        )

        return forward_flydsl_mega_moe(
            moe, hidden_states, forward_batch, input_ids_global
        )

    num_tokens = hidden_states.shape[0]
    fused_shared = moe.mega_shared_l1_weights is not None
    fork_mega_moe = (
        moe.alt_stream is not None
        and (fused_shared or moe.num_fused_shared_experts == 0)
        and num_tokens > 0
        and get_is_capture_mode()
    )

    if fork_mega_moe:
        current_stream = torch.cuda.current_stream()
        moe.alt_stream.wait_stream(current_stream)
        mega_stream_ctx = torch.cuda.stream(moe.alt_stream)
    else:
        mega_stream_ctx = nullcontext()

    shared_output = None if fused_shared else moe._forward_shared_experts(hidden_states)

    with mega_stream_ctx:
        y = _run_mega_routed(
            moe, hidden_states, forward_batch, input_ids_global, num_tokens
        )

    if fork_mega_moe:
        current_stream.wait_stream(moe.alt_stream)

    if shared_output is not None:
        y.add_(shared_output)
    return y


def _mega_moe_buffer(moe: DeepseekV2MoE):
    from sglang.srt.runtime_context import get_parallel

    return _get_mega_moe_symm_buffer(
        get_parallel().moe_ep_group.device_group,
        num_experts=moe.experts.num_experts,
        num_max_tokens_per_rank=(
            envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.get()
        ),
        num_topk=moe.config.num_experts_per_tok + moe.num_fused_shared_experts,
        hidden=moe.config.hidden_size,
        intermediate_hidden=moe.config.moe_intermediate_size,
        num_shared_experts=(
            0 if moe.mega_shared_l1_weights is None else moe.n_shared_experts
        ),
        mma_type=_mega_moe_mma_type(moe.experts),
    )


MEGA_MOE_INPUT_TAG = "_mega_moe_input_in_buffer"


class MegaMoeInput(NamedTuple):
    buf: SymmBuffer
    num_tokens: int
    x: torch.Tensor
    routed_sf: torch.Tensor
    shared_sf: torch.Tensor
    shared_block_m: int

    def views(self):
        return (self.x, self.routed_sf, self.shared_sf, self.shared_block_m)

    def mark(self, rows: torch.Tensor) -> None:
        setattr(rows, MEGA_MOE_INPUT_TAG, (self.buf, self.num_tokens))


def _mega_moe_input_in_buffer(rows: torch.Tensor, buf, num_tokens: int) -> bool:
    tag = getattr(rows, MEGA_MOE_INPUT_TAG, None)
    return tag is not None and tag[0] is buf and tag[1] == num_tokens


def mega_moe_input_target(
    moe: DeepseekV2MoE, hidden_states: torch.Tensor, forward_batch
) -> Optional[MegaMoeInput]:
    if not (
        should_use_mega_gate(moe, hidden_states, forward_batch)
        and get_moe_a2a_backend().is_megamoe()
        and is_mega_moe_experts_ready(moe.experts)
        and moe.mega_shared_l1_weights is not None
        and _mega_moe_mma_type(moe.experts) == "fp8xfp4"
    ):
        return None
    import deep_gemm

    buf = _mega_moe_buffer(moe)
    num_tokens = hidden_states.shape[0]
    x = buf.x[:num_tokens]
    if x.dtype != torch.float8_e4m3fn:
        x = x.view(torch.float8_e4m3fn)
    routed_sf = buf.x_sf[:num_tokens]
    if not routed_sf.is_contiguous():
        return None
    shared_block_m = deep_gemm.get_block_m_for_mega_moe(
        num_ranks=buf.group.size(),
        num_experts=buf.num_experts,
        num_max_tokens_per_rank=buf.num_max_tokens_per_rank,
        num_tokens=num_tokens,
        num_topk=buf.num_topk,
        mma_type=buf.mma_type,
    )
    return MegaMoeInput(
        buf,
        num_tokens,
        x,
        routed_sf,
        buf.shared_l1_acts_sf[:num_tokens],
        shared_block_m,
    )


def _run_mega_routed(
    moe: DeepseekV2MoE,
    hidden_states: torch.Tensor,
    forward_batch: Optional[ForwardBatch],
    input_ids_global: Optional[torch.Tensor],
    num_tokens: int,
) -> torch.Tensor:
    hidden_size = moe.config.hidden_size

    routing = None
    if should_use_mega_gate(moe, hidden_states, forward_batch):
        import deep_gemm

        # Only the fp8xfp4 pre-dispatch can skip its top-k copy (kCopyTopk).
        buf = (
            _mega_moe_buffer(moe)
            if _mega_moe_mma_type(moe.experts) == "fp8xfp4"
            else None
        )
        with _configure_mega_moe_deep_gemm_num_sms(deep_gemm):
            routing = run_mega_gate(
                moe, hidden_states, input_ids_global, buf, forward_batch
            )

    if routing is not None:
        topk_ids = routing.topk_ids
        topk_weights = routing.topk_weights
        routed_scaling_factor = routing.routed_scaling_factor
    elif num_tokens > 0:
        router_logits = moe.gate(hidden_states, forward_batch=forward_batch)
        topk_kwargs = {"input_ids": input_ids_global} if moe.is_hash else {}
        if (
            not moe.is_hash
            and getattr(moe.gate, "e_score_correction_bias_vl", None) is not None
        ):
            topk_output = vision_topk(
                moe,
                router_logits,
                input_ids_global,
            )
        else:
            topk_output = moe.topk(
                hidden_states,
                router_logits,
                **topk_kwargs,
            )
        topk_ids = topk_output.topk_ids
        topk_weights = topk_output.topk_weights
    else:
        topk_ids = None
        topk_weights = None
    if routing is None:
        routed_scaling_factor = (
            1.0
            if moe.routed_scaling_factor_fused_in_topk
            else float(moe.routed_scaling_factor)
        )

    return run_mega_routed_experts(
        moe.experts,
        hidden_states,
        topk_ids,
        topk_weights,
        hidden_size=hidden_size,
        intermediate_size=moe.config.moe_intermediate_size,
        top_k=moe.config.num_experts_per_tok + moe.num_fused_shared_experts,
        num_tokens=num_tokens,
        activation_clamp=moe.experts.moe_runner_config.swiglu_limit,
        routed_scaling_factor=routed_scaling_factor,
        num_shared_experts=(
            0 if moe.mega_shared_l1_weights is None else moe.n_shared_experts
        ),
        shared_l1_weights=moe.mega_shared_l1_weights,
        shared_l2_weights=moe.mega_shared_l2_weights,
        routing_in_buffer=routing is not None and routing.in_buffer,
    )


def run_mega_routed_experts(
    experts,
    hidden_states: torch.Tensor,
    topk_ids: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    *,
    hidden_size: int,
    intermediate_size: int,
    top_k: int,
    num_tokens: int,
    activation_clamp: Optional[float] = None,
    routed_scaling_factor: float = 1.0,
    activation: str = "swiglu",
    num_shared_experts: int = 0,
    shared_l1_weights=None,
    shared_l2_weights=None,
    routing_in_buffer: bool = False,
) -> torch.Tensor:
    # Rows are this rank's tokens; the returned rows are fully combined.
    import deep_gemm

    from sglang.srt.runtime_context import get_parallel

    ep_group = get_parallel().moe_ep_group.device_group
    num_experts = experts.num_experts
    num_max_tokens_per_rank = (
        envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.get()
    )
    assert num_tokens <= num_max_tokens_per_rank, (
        f"mega MoE: num_tokens={num_tokens} exceeds cap "
        f"SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK="
        f"{num_max_tokens_per_rank}; raise the env var or lower "
        f"--cuda-graph-max-bs-decode / --chunked-prefill-size accordingly"
    )

    mma_type = _mega_moe_mma_type(experts)
    buf = _get_mega_moe_symm_buffer(
        ep_group,
        num_experts=num_experts,
        num_max_tokens_per_rank=num_max_tokens_per_rank,
        num_topk=top_k,
        hidden=hidden_size,
        intermediate_hidden=intermediate_size,
        num_shared_experts=num_shared_experts,
        mma_type=mma_type,
        activation=activation,
    )

    if routing_in_buffer:
        assert num_tokens > 0 and _device_sm != 90 and mma_type == "fp8xfp4"
        topk_ids_in = topk_weights_in = None
    elif num_tokens > 0:
        topk_ids_in = topk_ids.to(torch.int32)
        topk_weights_in = topk_weights.to(torch.float32)
    else:
        topk_ids_in = hidden_states.new_empty((0, top_k), dtype=torch.int32)
        topk_weights_in = hidden_states.new_empty((0, top_k), dtype=torch.float32)

    if _device_sm == 90:
        return run_sm90_mega_routed(
            experts,
            hidden_states,
            topk_ids_in,
            topk_weights_in,
            buf,
            num_tokens,
            hidden_size=hidden_size,
            activation_clamp=activation_clamp,
            routed_scaling_factor=routed_scaling_factor,
        )

    if routed_scaling_factor != 1.0:
        assert not routing_in_buffer
        topk_weights_in = topk_weights_in * routed_scaling_factor

    mega_kwargs = {"recipe": (1, 1, 32)}
    if mma_type == "nvfp4xnvfp4":
        # Per-token outer scales go to buf.x_scales; the kernel folds them with
        # the per-expert alphas in the L1 / L2 epilogues.
        deep_gemm.mega_moe_pre_dispatch(
            hidden_states,
            topk_ids_in,
            topk_weights_in,
            buf.x,
            buf.x_sf,
            buf.topk_idx,
            buf.topk_weights,
            num_tokens=num_tokens,
            group_size=16,
            mma_type=mma_type,
            buf_x_scales=buf.x_scales,
        )
        mega_kwargs = {
            "recipe": (1, 1, 16),
            "use_x_scales": True,
            "l1_alphas": experts.mega_l1_alphas,
            "l2_alphas": experts.mega_l2_alphas,
            "l2_act_scales": experts.mega_l2_act_scales,
        }
        if experts._mega_moe_trtllm_layout:
            mega_kwargs["weight_layout"] = "trtllm"
    elif mma_type == "mxf4xmxf4":
        # FP4 path goes through DeepGEMM's mega_moe_pre_dispatch which
        # handles the E2M1 packing variant. The jit implementation
        # only emits FP8.
        deep_gemm.mega_moe_pre_dispatch(
            hidden_states,
            topk_ids_in,
            topk_weights_in,
            buf.x,
            buf.x_sf,
            buf.topk_idx,
            buf.topk_weights,
            num_tokens=num_tokens,
            group_size=32,
            mma_type=mma_type,
        )
    else:
        shared_block_m = 0
        if shared_l1_weights is not None:
            shared_block_m = deep_gemm.get_block_m_for_mega_moe(
                num_ranks=buf.group.size(),
                num_experts=buf.num_experts,
                # DeepGEMM rounds the requested capacity up for its buffer.
                num_max_tokens_per_rank=buf.num_max_tokens_per_rank,
                # Match the non-null output allocation passed to DeepGEMM.
                num_tokens=max(num_tokens, 1),
                num_topk=buf.num_topk,
                mma_type=buf.mma_type,
            )
        if not (
            routing_in_buffer
            and _mega_moe_input_in_buffer(hidden_states, buf, num_tokens)
        ):
            mega_moe_pre_dispatch(
                hidden_states,
                buf.topk_idx if routing_in_buffer else topk_ids_in,
                buf.topk_weights if routing_in_buffer else topk_weights_in,
                buf.x,
                buf.x_sf,
                buf.topk_idx,
                buf.topk_weights,
                quant_group_size=32,
                shared_x_sf=(
                    buf.shared_l1_acts_sf if shared_l1_weights is not None else None
                ),
                shared_block_m=shared_block_m,
                copy_topk=not routing_in_buffer,
            )

    # Allocate at least one row so y has a non-null CUDA data_ptr;
    # the DeepGEMM tvm-ffi binding rejects nullptr in convert_to_torch_tensor().
    y = torch.empty(
        (max(num_tokens, 1), hidden_size),
        dtype=torch.bfloat16,
        device=hidden_states.device,
    )
    with _configure_mega_moe_deep_gemm_num_sms(deep_gemm):
        deep_gemm.fp8_fp4_mega_moe(
            y,
            experts.mega_l1_weights,
            experts.mega_l2_weights,
            buf,
            shared_l1_weights=shared_l1_weights,
            shared_l2_weights=shared_l2_weights,
            activation=activation,
            activation_clamp=activation_clamp,
            fast_math=True,
            **mega_kwargs,
        )
    return y[:num_tokens]


def _interleave_mega_moe_gate_up(t: torch.Tensor, gran: int = 8) -> torch.Tensor:
    # Match DeepGEMM's L1 gate/up layouts. FP8 activations use contiguous
    # gran-8 chunks; packed MXFP4 activations use even/odd gran-16 chunks.
    num_groups, n, *rest = t.shape
    half = n // 2
    gate = t[:, :half].reshape(num_groups, half // gran, gran, *rest)
    up = t[:, half:].reshape(num_groups, half // gran, gran, *rest)
    if gran == 16:
        result = torch.cat(
            [gate[:, :, 0::2], up[:, :, 0::2], gate[:, :, 1::2], up[:, :, 1::2]],
            dim=2,
        ).reshape(num_groups, n, *rest)
    else:
        result = torch.stack([gate, up], dim=2).reshape(num_groups, n, *rest)
    return torch.empty_like(t).copy_(result)


def _interleave_mega_moe_l1_weights(
    l1_weights: tuple[torch.Tensor, torch.Tensor],
    mma_type: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    gran = 16 if mma_type == "mxf4xmxf4" else 8
    return (
        _interleave_mega_moe_gate_up(l1_weights[0], gran=gran),
        _interleave_mega_moe_gate_up(l1_weights[1], gran=gran),
    )


def _transpose_mega_moe_sf_for_utccp(sf: torch.Tensor) -> torch.Tensor:
    num_groups, mn, packed_sf_k = sf.shape
    assert sf.dtype == torch.int and mn % 128 == 0
    result = (
        sf.reshape(num_groups, -1, 4, 32, packed_sf_k)
        .transpose(2, 3)
        .reshape(num_groups, mn, packed_sf_k)
    )
    return torch.empty_like(sf).copy_(result)


def build_mega_moe_experts_weights(experts) -> None:
    if _use_amd_flydsl_mega_moe():
        from sglang.srt.layers.moe.mega_moe_flydsl import (
            build_mega_moe_experts_weights as build_flydsl_mega_moe_weights,
        )

        build_flydsl_mega_moe_weights(experts)
        return

    from deep_gemm import (
        transform_sf_into_required_layout,
    )

    if getattr(experts, "_mega_moe_weights_built", False):
        return

    mma_type = _mega_moe_mma_type(experts)
    w13 = experts.w13_weight.data
    w13_sf_fp32 = experts.w13_weight_scale_inv.data
    w2 = experts.w2_weight.data
    w2_sf_fp32 = experts.w2_weight_scale_inv.data

    num_groups, n1, half_k1 = w13.shape
    k1 = half_k1 * 2
    check_mega_moe_shapes(hidden=k1, intermediate=n1 // 2, mma_type=mma_type)
    _, n2, half_k2 = w2.shape
    k2 = half_k2 * 2

    w13_sf = transform_sf_into_required_layout(
        w13_sf_fp32,
        mn=n1,
        k=k1,
        recipe=(1, 32),
        num_groups=num_groups,
        disable_ue8m0_cast=False,
    )
    w2_sf = transform_sf_into_required_layout(
        w2_sf_fp32,
        mn=n2,
        k=k2,
        recipe=(1, 32),
        num_groups=num_groups,
        disable_ue8m0_cast=False,
    )

    # Build the interleaved L1 weight + scale once; share the weight buffer
    # between `w13_weight.data` (normal deep-ep path) and `mega_l1_weights[0]`
    # (mega moe path). Mega moe additionally needs a UTCCP-transposed scale;
    # the deep-ep path consumes the non-transposed interleaved scale and a
    # swizzle-aware activation kernel. L2 weight is untouched by the mega
    # transform, so the existing `w2_weight.data` is shared directly.
    w13_interleaved, w13_sf_interleaved = _interleave_mega_moe_l1_weights(
        (w13, w13_sf), mma_type
    )
    w13_sf_utccp = _transpose_mega_moe_sf_for_utccp(w13_sf_interleaved)
    w2_sf_utccp = _transpose_mega_moe_sf_for_utccp(w2_sf)

    experts.w13_weight.data = w13_interleaved
    experts.w13_weight_scale_inv.data = w13_sf_interleaved
    experts.w2_weight_scale_inv.data = w2_sf
    experts.w13_weight_scale_inv.format_ue8m0 = True
    experts.w2_weight_scale_inv.format_ue8m0 = True

    experts.mega_l1_weights = (experts.w13_weight.data, w13_sf_utccp)
    experts.mega_l2_weights = (experts.w2_weight.data, w2_sf_utccp)
    # EPLB moves each expert's slice of every parameter, so the UTCCP copies
    # move with the scales they are transposed from.
    experts.register_parameter(
        "mega_w13_weight_scale_utccp",
        torch.nn.Parameter(w13_sf_utccp, requires_grad=False),
    )
    experts.register_parameter(
        "mega_w2_weight_scale_utccp",
        torch.nn.Parameter(w2_sf_utccp, requires_grad=False),
    )

    experts._mega_moe_weights_built = True


def build_mega_moe_shared_weights(
    shared_experts,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    from deep_gemm import transform_weights_for_mega_moe

    gate_up_proj, down_proj = shared_experts.gate_up_proj, shared_experts.down_proj
    # L1 is copied interleaved (2*moe_intermediate*hidden FP8 bytes per layer);
    # the original stays for the forward_normal fallback above the token cap.
    return transform_weights_for_mega_moe(
        (gate_up_proj.weight.data, _transform_mega_moe_shared_sf(gate_up_proj)),
        (down_proj.weight.data, _transform_mega_moe_shared_sf(down_proj)),
    )


def _transform_mega_moe_shared_sf(linear) -> torch.Tensor:
    from deep_gemm import transform_sf_into_required_layout

    from sglang.srt.layers.quantization.fp8_utils import inverse_transform_scale_ue8m0

    n, k = linear.weight.shape
    sf = linear.weight_scale_inv.data
    if sf.dtype == torch.int32:
        # Requantized for the DeepGEMM linear runner.
        sf = inverse_transform_scale_ue8m0(sf, mn=n)[:, : k // 128]
        block_m, block_k = 128, 128
    else:
        block_m, block_k = linear.quant_method.quant_config.weight_block_size
    sf = sf.repeat_interleave(block_k // 32, dim=-1)
    if block_m == 128:
        return transform_sf_into_required_layout(
            sf, mn=n, k=k, recipe=(128, 32), disable_ue8m0_cast=False
        )
    if block_m != 1:
        sf = sf.repeat_interleave(block_m, dim=0)
    return transform_sf_into_required_layout(
        sf.unsqueeze(0).contiguous(),
        mn=n,
        k=k,
        recipe=(1, 32),
        num_groups=1,
        disable_ue8m0_cast=False,
    ).squeeze(0)
