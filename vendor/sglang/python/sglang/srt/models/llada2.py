# coding=utf-8
# Copyright 2023 Antgroup and The HuggingFace Inc. team. All rights reserved.
#
# This code is based on EleutherAI's GPT-NeoX library and the GPT-NeoX
# and OPT implementations in this library. It has been modified from its
# original forms to accommodate minor architectural differences compared
# to GPT-NeoX and OPT used by the Meta AI team that trained the model.
#
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
"""SGLang LLaDA2MoeModelLM model."""

import logging
from functools import partial
from typing import Iterable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn
from transformers import PretrainedConfig
from triton.language.extra import libdevice

from sglang.srt.environ import envs
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.eplb.expert_location import ModelConfigForExpertLocation
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.dp_attention import (
    is_dp_attention_enabled,
)
from sglang.srt.layers.layer_boundary import (
    append_stages,
    declare_attn,
    declare_ffn,
    is_dense_ffn_fully_dp,
)
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    LinearParallelGroup,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.moe import (
    get_deepep_mode,
    get_moe_a2a_backend,
)
from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.moe.token_dispatcher import DeepEPDispatcher
from sglang.srt.layers.moe.topk import (
    StandardTopKOutput,
    TopK,
    TritonKernelTopKOutput,
    capture_routed_experts_if_allowed,
)
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.utils import PPMissingLayer
from sglang.srt.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors
from sglang.srt.model_executor.runner import get_is_capture_mode
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.utils import (
    apply_qk_norm,
    create_fused_set_kv_buffer_arg,
    enable_fused_set_kv_buffer,
)
from sglang.srt.runtime_context import get_exec, get_parallel, get_stream
from sglang.srt.utils import (
    LazyValue,
    add_prefix,
    is_cuda,
    is_non_idle_and_non_empty,
    is_npu,
    make_pp_layers,
)
from sglang.srt.utils.hf_transformers_utils import get_rope_config

LoraConfig = None
logger = logging.getLogger(__name__)
_is_cuda = is_cuda()
_is_npu = is_npu()


def _require_block_routing_ep1(moe_ep_size: int) -> None:
    if moe_ep_size != 1:
        raise ValueError(
            "LLaDA2 block routing does not support expert parallelism; "
            f"expected moe_ep_size=1, got moe_ep_size={moe_ep_size}"
        )


def _require_block_routing_simulated_experts_compatibility() -> None:
    simulate_uniform_experts = envs.SGLANG_SIMULATE_UNIFORM_EXPERTS.get()
    simulate_round_robin_experts = envs.SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS.get()
    if simulate_uniform_experts and simulate_round_robin_experts:
        raise ValueError(
            "SGLANG_SIMULATE_UNIFORM_EXPERTS and "
            "SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS are mutually exclusive"
        )
    if simulate_uniform_experts:
        raise ValueError(
            "LLaDA2 block routing does not support SGLANG_SIMULATE_UNIFORM_EXPERTS"
        )
    if simulate_round_robin_experts:
        raise ValueError(
            "LLaDA2 block routing does not support SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS"
        )


def _require_block_routing_runner_compatibility(experts, top_k: int) -> None:
    backend = experts.runner_backend
    if backend is None:
        # Direct standard/local-ID kernels consume the block router's materialized output.
        return
    if backend.is_flashinfer_trtllm():
        raise ValueError(
            "LLaDA2 block routing does not support --moe-runner-backend "
            "flashinfer_trtllm; use a compatible runner instead"
        )
    if backend.is_triton_kernels() and top_k & (top_k - 1):
        raise ValueError(
            "LLaDA2 block routing with --moe-runner-backend "
            "triton_kernel requires num_experts_per_tok to be a "
            f"power of two, got {top_k}"
        )


def _make_block_routing_triton_output(
    ragged_metadata,
    combine_indx: torch.Tensor,
    gate_scal: torch.Tensor,
    n_expts_act: int,
) -> TritonKernelTopKOutput:
    """Pack block-routing metadata using the current five-field ABI."""
    gather_indx = torch.div(combine_indx, n_expts_act, rounding_mode="trunc")
    return TritonKernelTopKOutput(
        a_ragged_metadata=ragged_metadata,
        gather_indx=gather_indx,
        scatter_indx=combine_indx,
        gate_scal=gate_scal,
        n_expts_act=n_expts_act,
    )


@triton.jit
def _block_aggregation_kernel(
    router_logits_ptr,
    correction_bias_ptr,
    allowed_ids_ptr,
    num_tokens,
    num_experts_total: tl.constexpr,
    block_size: tl.constexpr,
    expert_capacity: tl.constexpr,
    stride_logits_n,
    stride_logits_e,
    stride_bias,
    BLOCK_SIZE_E: tl.constexpr,
    BLOCK_SIZE_T: tl.constexpr,
):
    """Select the block-level expert set and store compact expert IDs."""
    block_id = tl.program_id(0)
    block_start_token = block_id * block_size

    expert_offs = tl.arange(0, BLOCK_SIZE_E)
    expert_mask = expert_offs < num_experts_total
    bias = tl.load(
        correction_bias_ptr + expert_offs * stride_bias,
        mask=expert_mask,
        other=0.0,
    ).to(tl.float32)

    token_in_block = tl.arange(0, BLOCK_SIZE_T)
    token_offs = block_start_token + token_in_block[:, None]
    valid_2d = (
        (token_in_block[:, None] < block_size)
        & (token_offs < num_tokens)
        & expert_mask[None, :]
    )
    logits_ptrs = (
        router_logits_ptr
        + token_offs * stride_logits_n
        + expert_offs[None, :] * stride_logits_e
    )
    logits = tl.load(logits_ptrs, mask=valid_2d, other=0.0)
    # Keep this formula identical to _token_topk_kernel: a mismatch can change
    # the selected expert at the block-capacity cutoff.
    base_scores = tl.div_rn(
        1.0,
        1.0 + libdevice.exp(-logits.to(tl.float32)),
    )
    corrected_scores = tl.where(
        valid_2d,
        base_scores + bias[None, :],
        float("-inf"),
    )
    block_scores = tl.max(corrected_scores, axis=0)
    block_scores = tl.where(expert_mask, block_scores, float("-inf"))

    # Select on the unmodified score.  Expert IDs participate only when scores
    # are exactly tied, avoiding the old expert_id * 3e-7 ranking perturbation.
    sorted_scores = tl.sort(block_scores, descending=True)
    threshold = tl.sum(
        tl.where(
            expert_offs == expert_capacity - 1,
            sorted_scores,
            0.0,
        ),
        axis=0,
    )
    better = (block_scores > threshold) & expert_mask
    tied = (block_scores == threshold) & expert_mask
    num_better = tl.sum(better.to(tl.int32), axis=0)
    ties_needed = expert_capacity - num_better
    tie_rank = tl.cumsum(tied.to(tl.int32), axis=0)
    selected = better | (tied & (tie_rank <= ties_needed))

    # IDs are compact and ascending.  Phase 2 consequently scans capacity
    # candidates (normally 48, padded to 64) instead of every expert.
    selected_rank = tl.cumsum(selected.to(tl.int32), axis=0) - 1
    safe_rank = tl.where(selected, selected_rank, 0)
    tl.store(
        allowed_ids_ptr + block_id * expert_capacity + safe_rank,
        expert_offs,
        mask=selected,
    )


@triton.jit
def _token_topk_kernel(
    router_logits_ptr,
    correction_bias_ptr,
    allowed_ids_ptr,
    topk_ids_ptr,
    topk_weights_ptr,
    num_tokens,
    num_experts_total: tl.constexpr,
    expert_capacity: tl.constexpr,
    block_size: tl.constexpr,
    top_k: tl.constexpr,
    stride_logits_n,
    stride_logits_e,
    stride_bias,
    BLOCK_SIZE_C: tl.constexpr,
    TOPK_POW2: tl.constexpr,
):
    """Ordered per-token top-k over the compact block-level candidates."""
    token_idx = tl.program_id(0)
    if token_idx >= num_tokens:
        return

    block_id = token_idx // block_size
    candidate_offs = tl.arange(0, BLOCK_SIZE_C)
    candidate_mask = candidate_offs < expert_capacity
    expert_ids = tl.load(
        allowed_ids_ptr + block_id * expert_capacity + candidate_offs,
        mask=candidate_mask,
        other=0,
    ).to(tl.int32)
    bias = tl.load(
        correction_bias_ptr + expert_ids * stride_bias,
        mask=candidate_mask,
        other=0.0,
    ).to(tl.float32)
    logits = tl.load(
        router_logits_ptr + token_idx * stride_logits_n + expert_ids * stride_logits_e,
        mask=candidate_mask,
        other=float("-inf"),
    )

    # Keep this formula identical to _block_aggregation_kernel. Use Triton's
    # portable round-to-nearest division so this compiles on CUDA and HIP.
    base_scores = tl.div_rn(
        1.0,
        1.0 + libdevice.exp(-logits.to(tl.float32)),
    )
    remaining = tl.where(
        candidate_mask,
        base_scores + bias,
        float("-inf"),
    )

    out_offs = tl.arange(0, TOPK_POW2)
    out_ids = tl.zeros([TOPK_POW2], dtype=tl.int32)
    out_raw = tl.zeros([TOPK_POW2], dtype=tl.float32)
    raw_sum = 0.0
    for k in tl.static_range(0, top_k):
        # Compact candidates are ascending expert IDs, so leftmost argmax gives
        # the deterministic lower-ID tie break shared by the reference test.
        selected_pos = tl.argmax(remaining, axis=0, tie_break_left=True)
        selected_id = tl.sum(
            tl.where(candidate_offs == selected_pos, expert_ids, 0),
            axis=0,
        )
        selected_raw = tl.sum(
            tl.where(candidate_offs == selected_pos, base_scores, 0.0),
            axis=0,
        )
        out_ids = tl.where(out_offs == k, selected_id, out_ids)
        out_raw = tl.where(out_offs == k, selected_raw, out_raw)
        raw_sum += selected_raw
        remaining = tl.where(
            candidate_offs == selected_pos,
            float("-inf"),
            remaining,
        )

    out_mask = out_offs < top_k
    if top_k > 1:
        out_weights = tl.div_rn(out_raw, raw_sum + 1e-20)
    else:
        out_weights = out_raw

    tl.store(
        topk_ids_ptr + token_idx * top_k + out_offs,
        out_ids,
        mask=out_mask,
    )
    tl.store(
        topk_weights_ptr + token_idx * top_k + out_offs,
        out_weights,
        mask=out_mask,
    )


def block_topk_triton(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    block_size: int,
    expert_capacity: int,
    top_k: int,
):
    """Two-phase block routing with compact candidates and FP32 weights."""
    if not router_logits.is_cuda or not correction_bias.is_cuda:
        raise ValueError("block_topk_triton requires CUDA tensors")
    if router_logits.ndim != 2:
        raise ValueError(
            f"router_logits must be 2-D, got shape={tuple(router_logits.shape)}"
        )

    num_tokens, num_experts_total = router_logits.shape
    if correction_bias.shape != (num_experts_total,):
        raise ValueError(
            "correction_bias must have shape "
            f"({num_experts_total},), got {tuple(correction_bias.shape)}"
        )
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size <= 0
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"block_size must be a positive power of two, got {block_size!r}"
        )
    if not (0 < top_k <= expert_capacity <= num_experts_total):
        raise ValueError(
            "expected 0 < top_k <= expert_capacity <= num_experts, got "
            f"top_k={top_k}, expert_capacity={expert_capacity}, "
            f"num_experts={num_experts_total}"
        )

    device = router_logits.device
    if num_tokens == 0:
        return (
            torch.empty((0, top_k), dtype=torch.float32, device=device),
            torch.empty((0, top_k), dtype=torch.int32, device=device),
        )

    # Tail blocks are valid; invalid token lanes are masked inside phase 1.
    num_blocks = (num_tokens + block_size - 1) // block_size
    allowed_ids = torch.empty(
        (num_blocks, expert_capacity),
        dtype=torch.int32,
        device=device,
    )
    topk_ids = torch.empty(
        (num_tokens, top_k),
        dtype=torch.int32,
        device=device,
    )
    topk_weights = torch.empty(
        (num_tokens, top_k),
        dtype=torch.float32,
        device=device,
    )

    block_size_e = triton.next_power_of_2(num_experts_total)
    block_size_c = triton.next_power_of_2(expert_capacity)
    topk_pow2 = triton.next_power_of_2(top_k)

    _block_aggregation_kernel[(num_blocks,)](
        router_logits,
        correction_bias,
        allowed_ids,
        num_tokens,
        num_experts_total,
        block_size,
        expert_capacity,
        router_logits.stride(0),
        router_logits.stride(1),
        correction_bias.stride(0),
        BLOCK_SIZE_E=block_size_e,
        BLOCK_SIZE_T=block_size,
        num_warps=4,
        num_stages=1,
    )
    _token_topk_kernel[(num_tokens,)](
        router_logits,
        correction_bias,
        allowed_ids,
        topk_ids,
        topk_weights,
        num_tokens,
        num_experts_total,
        expert_capacity,
        block_size,
        top_k,
        router_logits.stride(0),
        router_logits.stride(1),
        correction_bias.stride(0),
        BLOCK_SIZE_C=block_size_c,
        TOPK_POW2=topk_pow2,
        num_warps=1,
        num_stages=1,
    )
    return topk_weights, topk_ids


split_qkv_rmsnorm_rope_pos_cache_half_npu = None
if _is_npu:
    try:
        from sgl_kernel_npu.norm.split_qkv_rmsnorm_rope_pos_cache_half_npu import (
            split_qkv_rmsnorm_rope_pos_cache_half_npu,
        )
    except (ImportError, OSError):
        pass


class LLaDA2MoeMLP(nn.Module):
    def __init__(
        self,
        intermediate_size: int,
        config: PretrainedConfig,
        quant_config: Optional[QuantizationConfig] = None,
        reduce_results: Optional[bool] = True,
        prefix: str = "",
        *,
        parallel_group: LinearParallelGroup = "tp",
    ) -> None:
        super().__init__()
        self.is_replicated = parallel_group == "replicated"

        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [intermediate_size] * 2,
            bias=config.use_bias,
            quant_config=quant_config,
            prefix=add_prefix("gate_up_proj", prefix),
            parallel_group=parallel_group,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            config.hidden_size,
            bias=config.use_bias,
            reduce_results=reduce_results,
            quant_config=quant_config,
            prefix=add_prefix("down_proj", prefix),
            parallel_group=parallel_group,
        )

        if config.hidden_act != "silu":
            raise ValueError("Unsupported activation. Only silu is supported for now.")
        self.act_fn = SiluAndMul()

    def forward(
        self,
        hidden_states: torch.Tensor,
        forward_batch: Optional[ForwardBatch] = None,
    ) -> torch.Tensor:
        if self.is_replicated and hidden_states.shape[0] == 0:
            return hidden_states

        gate_up, _ = self.gate_up_proj(hidden_states)
        hidden_states = self.act_fn(gate_up)
        hidden_states, _ = self.down_proj(hidden_states)
        return hidden_states


class LLaDA2MoeGate(nn.Module):
    def __init__(
        self,
        config,
        params_dtype: Optional[torch.dtype] = None,
        prefix: str = "",
    ):
        super().__init__()
        if params_dtype is None:
            params_dtype = torch.get_default_dtype()
        self.params_dtype = params_dtype
        self.weight = nn.Parameter(
            torch.empty(
                (config.num_experts, config.hidden_size),
                dtype=self.params_dtype,
            ),
        )
        if getattr(config, "moe_router_enable_expert_bias", False):
            self.expert_bias = nn.Parameter(
                torch.empty((config.num_experts,), dtype=torch.float32),
            )
        else:
            self.expert_bias = None

    def forward(self, hidden_states):
        # Keep router logits in the configured router/weight dtype. In
        # particular, router_dtype="fp32" must not be truncated back to the
        # BF16 activation dtype before block routing.
        return F.linear(hidden_states.to(self.weight.dtype), self.weight, None)


class LLaDA2MoeSparseMoeBlock(nn.Module):
    def __init__(
        self,
        layer_id: int,
        config: PretrainedConfig,
        quant_config: Optional[QuantizationConfig] = None,
        alt_stream: Optional[torch.cuda.Stream] = None,
        prefix: str = "",
    ):
        super().__init__()
        self.layer_id = layer_id
        self.alt_stream = alt_stream
        self.tp_size = get_parallel().tp_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_size = config.hidden_size
        self.num_shared_experts = config.num_shared_experts
        self.routed_scaling_factor = getattr(config, "routed_scaling_factor", 1.0)
        self.score_function = getattr(config, "score_function", None)

        # fused_topk_npu() conducting norm before scale with routed_scaling_factor by default
        # norm_topk_prob=True will renorm the routed_scaling_factor thus need to keep norm_topk_prob=False
        if _is_npu:
            self.norm_topk_prob = False

        self.use_block_routing = getattr(config, "expert_capacity", None) is not None
        if self.use_block_routing:
            _require_block_routing_simulated_experts_compatibility()
            _require_block_routing_ep1(get_parallel().moe_ep_size)
            if _is_npu:
                raise ValueError(
                    "LLaDA2 block routing is not supported on NPU; "
                    "expert_capacity must be unset"
                )
            self.block_size = config.block_size
            self.expert_capacity = config.expert_capacity

        if config.hidden_act != "silu":
            raise ValueError(
                f"Unsupported activation: {config.hidden_act}. "
                "Only silu is supported for now."
            )

        # Gate always runs at half / full precision for now.
        router_dtype = getattr(config, "router_dtype", None)
        if router_dtype is None:
            self.router_dtype = None
        elif router_dtype == "fp32":
            self.router_dtype = torch.float32
        else:
            self.router_dtype = torch.bfloat16

        # TODO global_server_args.ep_num_redundant_experts is used for eplb, not supported now
        assert get_exec().moe.ep_num_redundant_experts == 0
        # check group topk
        self.num_expert_group = getattr(config, "n_group", 0)
        self.topk_group = getattr(config, "topk_group", 0)
        if self.num_expert_group > 0 or self.topk_group > 0:
            assert (
                self.num_expert_group > 0
                and 0 < self.topk_group <= self.num_expert_group
            )
            self.use_grouped_topk = True
        else:
            self.num_expert_group = self.topk_group = None
            self.use_grouped_topk = False

        self.num_experts = config.num_experts + get_exec().moe.ep_num_redundant_experts

        self.gate = LLaDA2MoeGate(
            config=config,
            params_dtype=self.router_dtype,
            prefix=add_prefix("gate", prefix),
        )
        self.correction_bias = (
            self.gate.expert_bias.data if self.gate.expert_bias is not None else None
        )

        if self.use_block_routing:
            if get_moe_a2a_backend().is_deepep():
                raise ValueError(
                    "LLaDA2 block routing does not support --moe-a2a-backend deepep"
                )
            if self.correction_bias is None:
                raise ValueError(
                    "block routing requires moe_router_enable_expert_bias=True"
                )
            if self.score_function != "sigmoid":
                raise ValueError(
                    "block routing requires score_function='sigmoid', got "
                    f"{self.score_function!r}"
                )
            if (
                isinstance(self.block_size, bool)
                or not isinstance(self.block_size, int)
                or self.block_size <= 0
                or self.block_size & (self.block_size - 1)
            ):
                raise ValueError(
                    "block_size must be a positive power of two, got "
                    f"{self.block_size!r}"
                )
            if not (0 < self.top_k <= self.expert_capacity <= self.num_experts):
                raise ValueError(
                    "block routing requires "
                    "0 < num_experts_per_tok <= expert_capacity <= num_experts, "
                    f"got top_k={self.top_k}, "
                    f"expert_capacity={self.expert_capacity}, "
                    f"num_experts={self.num_experts}"
                )

        if self.score_function is not None:
            assert (
                self.score_function == "softmax" and self.correction_bias is None
            ) or (
                self.score_function == "sigmoid" and self.correction_bias is not None
            ), (
                "score_function and correction_bias should be in 2 combination (softmax, None) or (sigmoid, not None)"
            )

        self.topk = TopK(
            top_k=self.top_k,
            layer_id=self.layer_id,
            renormalize=self.norm_topk_prob,
            use_grouped_topk=self.use_grouped_topk,
            num_expert_group=self.num_expert_group,
            # num_fused_shared_experts=self.num_fused_shared_experts,
            topk_group=self.topk_group,
            correction_bias=self.correction_bias,
            scoring_func=self.score_function,
            routed_scaling_factor=self.routed_scaling_factor,
            apply_routed_scaling_factor_on_output=_is_npu,
        )

        self.experts = get_moe_impl_class(quant_config)(
            num_experts=self.num_experts,
            top_k=self.top_k,
            layer_id=self.layer_id,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            quant_config=quant_config,
            routed_scaling_factor=self.routed_scaling_factor,
            prefix=add_prefix("experts", prefix),
        )
        self.topk.topk_config.apply_routed_scaling_factor_on_output = (
            _is_npu or self.experts.should_fuse_routed_scaling_factor_in_topk
        )
        self.topk.bind_runner_backend(
            self.experts.runner_backend,
            routing_method_type=self.experts.routing_method_type,
        )
        if self.use_block_routing:
            _require_block_routing_runner_compatibility(self.experts, self.top_k)
        # shared expert
        if config.num_shared_experts is not None:
            if hasattr(config, "moe_shared_expert_intermediate_size"):
                intermediate_size = config.moe_shared_expert_intermediate_size
            else:
                intermediate_size = config.moe_intermediate_size
            intermediate_size *= config.num_shared_experts
            # disable tp for shared experts when enable deepep moe
            self.shared_experts = LLaDA2MoeMLP(
                intermediate_size=intermediate_size,
                config=config,
                quant_config=quant_config,
                reduce_results=False,
                prefix=add_prefix("shared_experts", prefix),
                parallel_group="replicated"
                if get_moe_a2a_backend().is_deepep()
                else "tp",
            )
        # dispatcher
        if get_moe_a2a_backend().is_deepep():
            self.deepep_dispatcher = DeepEPDispatcher(
                group=get_parallel().tp_group.device_group,
                router_topk=self.top_k,
                permute_fusion=True,
                num_experts=self.num_experts,
                num_local_experts=config.num_experts // self.tp_size,
                hidden_size=config.hidden_size,
                params_dtype=config.torch_dtype,
                deepep_mode=get_deepep_mode(),
                async_finish=True,  # TODO
                return_recv_hook=True,
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        forward_batch: Optional[ForwardBatch] = None,
    ) -> torch.Tensor:
        if not get_moe_a2a_backend().is_deepep():
            return self.forward_normal(hidden_states)
        else:
            return self.forward_deepep(hidden_states, forward_batch)

    def get_moe_weights(self):
        return [
            x.data
            for name, x in self.experts.named_parameters()
            if name not in ["correction_bias"]
        ]

    def _forward_shared_experts(self, hidden_states: torch.Tensor):
        shared_output = None
        if self.num_shared_experts > 0:
            shared_output = self.shared_experts(hidden_states)
        return shared_output

    def _block_topk(self, router_logits: torch.Tensor):
        """Block top-k routing via two-phase Triton kernel."""
        return block_topk_triton(
            router_logits,
            self.correction_bias,
            self.block_size,
            self.expert_capacity,
            self.top_k,
        )

    def _make_block_topk_output(
        self,
        router_logits: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ):
        """Convert block-routing results to the selected MoE runner format."""
        # Block routing computes its own top-k and therefore bypasses TopK.forward,
        # which normally invokes these diagnostics before producing runner output.
        capture_routed_experts_if_allowed(
            self.topk.topk_config, self.layer_id, topk_ids
        )
        get_global_expert_distribution_recorder().on_select_experts(topk_ids=topk_ids)

        runner_backend = self.experts.runner_backend
        if runner_backend is None or not runner_backend.is_triton_kernels():
            if (
                runner_backend is not None
                and runner_backend.is_aiter()
                or self.experts.should_fuse_routed_scaling_factor_in_topk
            ) and self.routed_scaling_factor is not None:
                topk_weights = topk_weights * self.routed_scaling_factor
            return StandardTopKOutput(
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                router_logits=router_logits,
            )

        # triton_kernels needs expert-sorted routing metadata. Reuse the
        # block router's selected expert ids via y_indx, but do not use the
        # values produced by triton_kernels_topk: block routing uses sigmoid
        # scores normalized over its own selected experts, not softmax scores.
        from triton_kernels.tensor import make_ragged_tensor_metadata
        from triton_kernels.topk import topk as triton_kernels_topk

        if topk_ids.numel() == 0:
            # Avoid launching the Triton top-k kernel with a zero-row grid.
            dispatch_indx = torch.empty((0,), dtype=torch.int32, device=topk_ids.device)
            combine_indx = torch.empty_like(dispatch_indx)
            expert_counts = torch.zeros(
                (self.num_experts,), dtype=torch.int32, device=topk_ids.device
            )
        else:
            sparse_logits = triton_kernels_topk(
                router_logits,
                self.top_k,
                apply_softmax=False,
                y_indx=topk_ids,
            )
            dispatch_indx = sparse_logits.mask_metadata.row_sorted_indx
            combine_indx = sparse_logits.mask_metadata.col_sorted_indx
            expert_counts = sparse_logits.mask_metadata.col_sum

        ragged_metadata = make_ragged_tensor_metadata(
            expert_counts,
            dispatch_indx.shape[0],
        )

        # combine_indx maps expert-major entries back to flattened token-major
        # top-k entries. Preserve block routing's FP32 weights while packing the
        # five-field triton_kernels output expected by the current MoE runner.
        gate_scal = topk_weights.flatten()[combine_indx]
        return _make_block_routing_triton_output(
            ragged_metadata,
            combine_indx,
            gate_scal,
            self.top_k,
        )

    def _forward_router_experts(self, hidden_states: torch.Tensor):
        # router_logits: (num_tokens, n_experts)
        router_logits = self.gate(hidden_states)

        if self.use_block_routing:
            topk_weights, topk_ids = self._block_topk(router_logits)
            topk_output = self._make_block_topk_output(
                router_logits, topk_weights, topk_ids
            )
        else:
            topk_output = self.topk(hidden_states, router_logits)

        return self.experts(hidden_states, topk_output)

    @torch.compiler.disable(recursive=False)
    def forward_normal_block_routing_dual_stream(
        self,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """Advanced dual stream: overlaps gate + block top-k with shared expert computation."""
        current_stream = torch.cuda.current_stream()
        self.alt_stream.wait_stream(current_stream)
        assert not (self.shared_experts.is_replicated and hidden_states.shape[0] == 0)
        router_logits = self.gate(hidden_states)
        with torch.cuda.stream(self.alt_stream):
            shared_gate_up, _ = self.shared_experts.gate_up_proj(hidden_states)
        current_stream.wait_stream(self.alt_stream)

        topk_weights, topk_ids = self._block_topk(router_logits)

        self.alt_stream.wait_stream(current_stream)
        with torch.cuda.stream(self.alt_stream):
            shared_hidden_states = self.shared_experts.act_fn(shared_gate_up)
            shared_output, _ = self.shared_experts.down_proj(shared_hidden_states)
        topk_output = self._make_block_topk_output(
            router_logits, topk_weights, topk_ids
        )
        router_output = self.experts(hidden_states, topk_output)
        current_stream.wait_stream(self.alt_stream)
        return router_output, shared_output

    def forward_normal_dual_stream(
        self,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        current_stream = torch.cuda.current_stream()
        self.alt_stream.wait_stream(current_stream)
        shared_output = self._forward_shared_experts(hidden_states.clone())

        with torch.cuda.stream(self.alt_stream):
            router_output = self._forward_router_experts(hidden_states)
        current_stream.wait_stream(self.alt_stream)

        return router_output, shared_output

    def forward_normal(
        self,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens, hidden_size = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_size)

        if (
            self.alt_stream is not None
            and hidden_states.shape[0] > 0
            and get_is_capture_mode()
        ):
            if self.use_block_routing:
                final_hidden_states, shared_output = (
                    self.forward_normal_block_routing_dual_stream(hidden_states)
                )
            else:
                final_hidden_states, shared_output = self.forward_normal_dual_stream(
                    hidden_states
                )
        else:
            shared_output = self._forward_shared_experts(hidden_states)
            final_hidden_states = self._forward_router_experts(hidden_states)

        if self.num_shared_experts > 0:
            final_hidden_states = final_hidden_states + shared_output

        return final_hidden_states.view(num_tokens, hidden_size)

    def forward_deepep(
        self, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        shared_output = None
        forward_mode = forward_batch.forward_mode
        if is_non_idle_and_non_empty(forward_mode, hidden_states):
            router_logits = self.gate(hidden_states)
            if self.num_shared_experts > 0:
                shared_output = self.shared_experts(hidden_states)

            topk_output = self.topk(
                hidden_states,
                router_logits,
            )
        else:
            topk_output = self.topk.empty_topk_output(hidden_states.device)

        final_hidden_states = self.experts(
            hidden_states=hidden_states,
            topk_output=topk_output,
        )

        if shared_output is not None:
            final_hidden_states += shared_output
        return final_hidden_states


class LLaDA2MoeAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int = 0,
        quant_config: Optional[QuantizationConfig] = None,
        reduce_results: bool = True,
        prefix: str = "",
        alt_stream: Optional[torch.cuda.Stream] = None,
    ):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.total_kv_heads = config.num_key_value_heads
        attn_tp_size = get_parallel().attn_tp_size

        assert self.total_num_heads % attn_tp_size == 0
        if self.total_kv_heads >= attn_tp_size:
            # Number of KV heads is greater than TP size, so we partition
            # the KV heads across multiple tensor parallel GPUs.
            assert self.total_kv_heads % attn_tp_size == 0
        else:
            # Number of KV heads is less than TP size, so we replicate
            # the KV heads across multiple tensor parallel GPUs.
            assert attn_tp_size % self.total_kv_heads == 0
        assert self.total_num_heads >= self.total_kv_heads

        self.num_heads = self.total_num_heads // attn_tp_size
        self.head_dim = config.head_dim or (self.hidden_size // self.total_num_heads)
        self.q_size = self.head_dim * self.num_heads

        self.num_kv_heads = max(1, self.total_kv_heads // attn_tp_size)
        self.kv_size = max(1, self.num_kv_heads * self.head_dim)

        self.scale = self.head_dim**-0.5

        self.use_qk_norm = getattr(config, "use_qk_norm", True)

        self.query_key_value = QKVParallelLinear(
            self.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_kv_heads,
            bias=(config.use_bias or config.use_qkv_bias),
            quant_config=quant_config,
            prefix=add_prefix("query_key_value", prefix),
            parallel_group="attn_tp",
        )

        if self.use_qk_norm:
            self.query_layernorm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

        self.dense = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            self.hidden_size,
            bias=config.use_bias,
            quant_config=quant_config,
            reduce_results=reduce_results,
            prefix=add_prefix("dense", prefix),
            parallel_group="attn_tp",
        )

        if hasattr(config, "partial_rotary_factor"):
            self.rotary_dim = int(self.head_dim * config.partial_rotary_factor)
        elif hasattr(config, "rotary_dim"):
            self.rotary_dim = config.rotary_dim
        else:
            self.rotary_dim = self.head_dim
        rope_theta, rope_scaling = get_rope_config(config)
        self.rotary_emb = get_rope(
            self.head_dim,
            rotary_dim=self.rotary_dim,
            max_position=config.max_position_embeddings,
            base=rope_theta,
            rope_scaling=rope_scaling,
        )

        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.scale,
            num_kv_heads=self.num_kv_heads,
            layer_id=layer_id,
            attn_type=AttentionType.ENCODER_ONLY,
            prefix=add_prefix("attn", prefix),
        )

        self.alt_stream = alt_stream

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if hidden_states.shape[0] == 0:
            return hidden_states
        qkv, _ = self.query_key_value(hidden_states)
        if _is_npu and split_qkv_rmsnorm_rope_pos_cache_half_npu is not None:
            q, k, v = split_qkv_rmsnorm_rope_pos_cache_half_npu(
                qkv,
                positions,
                self.rotary_emb.cos_sin_cache,
                self.q_size,
                self.kv_size,
                self.head_dim,
                eps=self.query_layernorm.variance_epsilon if self.use_qk_norm else None,
                q_weight=self.query_layernorm.weight if self.use_qk_norm else None,
                k_weight=self.key_layernorm.weight if self.use_qk_norm else None,
                q_bias=(
                    getattr(self.query_layernorm, "bias", None)
                    if self.use_qk_norm
                    else None
                ),
                k_bias=(
                    getattr(self.key_layernorm, "bias", None)
                    if self.use_qk_norm
                    else None
                ),
                rope_dim=self.rotary_dim,
            )
            can_fuse_set_kv = False
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.use_qk_norm:
                q, k = apply_qk_norm(
                    q=q,
                    k=k,
                    q_norm=self.query_layernorm,
                    k_norm=self.key_layernorm,
                    head_dim=self.head_dim,
                    alt_stream=self.alt_stream,
                )
            can_fuse_set_kv = (
                self.head_dim == self.rotary_emb.rotary_dim
                and enable_fused_set_kv_buffer(forward_batch)
            )
            q, k = self.rotary_emb(
                positions,
                q,
                k,
                fused_set_kv_buffer_arg=(
                    create_fused_set_kv_buffer_arg(
                        value=v,
                        layer=self.attn,
                        forward_batch=forward_batch,
                    )
                    if can_fuse_set_kv
                    else None
                ),
            )
        context_layer = self.attn(
            q,
            k,
            v,
            forward_batch,
            save_kv_cache=not can_fuse_set_kv,
        )
        attn_output, _ = self.dense(context_layer)
        return attn_output


class LLaDA2MoeBlock(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int = 0,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
        alt_stream: Optional[torch.cuda.Stream] = None,
    ):
        super().__init__()
        hidden_size = config.hidden_size

        self.input_layernorm = RMSNorm(hidden_size, eps=config.rms_norm_eps)
        self.attention = LLaDA2MoeAttention(
            config,
            layer_id,
            quant_config,
            reduce_results=False,
            prefix=add_prefix("attention", prefix),
            alt_stream=alt_stream,
        )
        self.layer_id = layer_id

        self.is_layer_sparse = self._is_layer_sparse(config, layer_id=layer_id)

        if self.is_layer_sparse:
            self.mlp = LLaDA2MoeSparseMoeBlock(
                layer_id=layer_id,
                config=config,
                quant_config=quant_config,
                alt_stream=alt_stream,
                prefix=add_prefix("mlp", prefix),
            )
        else:
            mlp_parallel_group = "replicated" if is_dense_ffn_fully_dp() else "tp"
            self.mlp = LLaDA2MoeMLP(
                intermediate_size=config.intermediate_size,
                config=config,
                quant_config=quant_config,
                prefix=add_prefix("mlp", prefix),
                parallel_group=mlp_parallel_group,
                reduce_results=False,
            )

        self.post_attention_layernorm = RMSNorm(hidden_size, eps=config.rms_norm_eps)

        attn, ffn = self.stage_facts(config, layer_id)
        self.attn_boundary, self.ffn_boundary = append_stages(
            (attn, self.input_layernorm),
            (ffn, self.post_attention_layernorm),
        )

    @classmethod
    def stage_facts(cls, config: PretrainedConfig, layer_id: int):
        """The stages the layer at ``layer_id`` declares, in order: the model's
        shared declaration function, which the layer declares with too (see
        make_layers)."""
        return (
            declare_attn(),
            declare_ffn(
                sparse=cls._is_layer_sparse(config, layer_id=layer_id),
                next_layer_sparse=cls._is_layer_sparse(config, layer_id=layer_id + 1),
            ),
        )

    @staticmethod
    def _is_layer_sparse(config: PretrainedConfig, layer_id: int) -> bool:
        return (
            config.num_experts is not None and layer_id >= config.first_k_dense_replace
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        hidden_states = self.attn_boundary.prepare(
            hidden_states=hidden_states, forward_batch=forward_batch
        )

        hidden_states = self.attention(
            positions=positions,
            hidden_states=hidden_states,
            forward_batch=forward_batch,
        )

        hidden_states = self.attn_boundary.finish(hidden_states, forward_batch)
        hidden_states = self.ffn_boundary.prepare(
            hidden_states=hidden_states,
            forward_batch=forward_batch,
        )

        hidden_states = self.mlp(hidden_states, forward_batch)
        hidden_states = self.ffn_boundary.finish(hidden_states, forward_batch)

        return hidden_states


class LLaDA2MoeModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        quant_config: Optional[QuantizationConfig] = None,
        alt_stream: Optional[torch.cuda.Stream] = None,
        prefix: str = "",
    ):
        super().__init__()
        self.pp_group = get_parallel().pp_group
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed_dim = config.hidden_size
        if self.pp_group.is_first_rank:
            self.word_embeddings = VocabParallelEmbedding(
                self.vocab_size,
                self.embed_dim,
                quant_config=quant_config,
                prefix=add_prefix("word_embeddings", prefix),
                use_attn_tp_group=is_dp_attention_enabled(),
            )
        else:
            self.word_embeddings = PPMissingLayer()

        self.embedding_dropout = torch.nn.Dropout(config.embedding_dropout)

        self.layers, self.start_layer, self.end_layer = make_pp_layers(
            config.num_hidden_layers,
            lambda idx, prefix: LLaDA2MoeBlock(
                layer_id=idx,
                config=config,
                quant_config=quant_config,
                prefix=prefix,
                alt_stream=alt_stream,
            ),
            prefix=add_prefix("layers", prefix),
            stage_facts=partial(LLaDA2MoeBlock.stage_facts, config),
        )
        if self.pp_group.is_last_rank:
            self.norm = RMSNorm(self.embed_dim, eps=config.rms_norm_eps)
        else:
            self.norm = PPMissingLayer(return_tuple=True)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor = None,
        pp_proxy_tensors: Optional[PPProxyTensors] = None,
    ) -> Union[torch.Tensor, PPProxyTensors]:
        if self.pp_group.is_first_rank:
            if input_embeds is None:
                hidden_states = self.word_embeddings(input_ids)
            else:
                hidden_states = input_embeds
            residual_batch.start(forward_batch)
        else:
            assert pp_proxy_tensors is not None
            hidden_states = self.layers[self.start_layer].attn_boundary.from_pp(
                pp_proxy_tensors, forward_batch
            )

        for i in range(self.start_layer, self.end_layer):
            with get_global_expert_distribution_recorder().with_current_layer(i):
                layer = self.layers[i]
                hidden_states = layer(positions, hidden_states, forward_batch)

        if not self.pp_group.is_last_rank:
            return residual_batch.to_pp(hidden_states, forward_batch)
        else:
            hidden_states = residual_batch.complete_output(hidden_states, forward_batch)
            if not forward_batch.forward_mode.is_idle():
                hidden_states = residual_batch.final_norm(
                    hidden_states, forward_batch, self.norm
                )
            return hidden_states


_EXPERT_PROJECTION_NAMES = frozenset({"gate_proj", "up_proj", "down_proj"})


def _prepare_llada2_language_weights(
    weights: Iterable[Tuple[str, torch.Tensor]],
    *,
    num_experts: int,
) -> Iterable[Tuple[str, torch.Tensor]]:
    """Normalize language-model prefixes and expand fused expert tensors."""
    for name, loaded_weight in weights:
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        elif name.startswith("model.lm_head."):
            name = "lm_head." + name.removeprefix("model.lm_head.")

        expert_prefix, separator, projection_name = name.rpartition(".")
        is_fused_expert = (
            separator
            and expert_prefix.endswith(".mlp.experts")
            and projection_name in _EXPERT_PROJECTION_NAMES
        )
        if not is_fused_expert:
            yield name, loaded_weight
            continue

        if loaded_weight.ndim != 3 or loaded_weight.shape[0] != num_experts:
            raise ValueError(
                f"Invalid fused expert weight {name!r}: expected first dimension "
                f"{num_experts}, got shape={tuple(loaded_weight.shape)}"
            )
        for expert_id in range(num_experts):
            yield (
                f"{expert_prefix}.{expert_id}.{projection_name}.weight",
                loaded_weight[expert_id],
            )


class LLaDA2MoeModelLM(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ):
        super().__init__()
        self.pp_group = get_parallel().pp_group
        self.config = config
        self.quant_config = quant_config
        alt_stream = get_stream("alt") if _is_cuda else None

        self.model = LLaDA2MoeModel(
            config,
            quant_config,
            alt_stream=alt_stream,
            prefix=add_prefix("model", ""),
        )

        if config.tie_word_embeddings:
            self.lm_head = self.model.word_embeddings
        else:
            # TODO something wrong with ParallelLMHead with DP attention enabled
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=quant_config,
                prefix=add_prefix("lm_head", prefix),
                use_attn_tp_group=get_parallel().enable_dp_lm_head,
            )
        self.logits_processor = LogitsProcessor(config, return_full_logits=True)

    @property
    def start_layer(self):
        return self.model.start_layer

    @property
    def end_layer(self):
        return self.model.end_layer

    def get_input_embeddings(self):
        return self.model.word_embeddings

    def get_embed_and_head(self):
        """Used by the eagle_worker."""
        return self.model.word_embeddings.weight, self.lm_head.weight

    def set_embed_and_head(self, embed, head):
        """Used by the eagle_worker."""
        del self.model.word_embeddings.weight
        del self.lm_head.weight
        self.model.word_embeddings.weight = embed
        self.lm_head.weight = head
        torch.cuda.empty_cache()
        torch.cuda.synchronize()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor = None,
        pp_proxy_tensors: Optional[PPProxyTensors] = None,
    ) -> torch.Tensor:
        hidden_states = self.model(
            input_ids,
            positions,
            forward_batch,
            input_embeds,
            pp_proxy_tensors=pp_proxy_tensors,
        )
        if self.pp_group.is_last_rank:
            return self.logits_processor(
                input_ids, hidden_states, self.lm_head, forward_batch
            )
        else:
            return hidden_states

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        stacked_params_mapping = [
            # (param_name, shard_name, shard_id)
            ("gate_up_proj", "gate_proj", 0),
            ("gate_up_proj", "up_proj", 1),
        ]

        # Params for weights, fp8 weight scales, fp8 activation scales
        # (param_name, weight_name, expert_id, shard_id)
        expert_params_mapping = FusedMoE.make_expert_params_mapping(
            ckpt_gate_proj_name="gate_proj",
            ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="up_proj",
            num_experts=self.config.num_experts,
        )

        params_dict = dict(self.named_parameters())
        for name, loaded_weight in _prepare_llada2_language_weights(
            weights, num_experts=self.config.num_experts
        ):
            if (
                ("v_head" in name)
                or ("inv_freq" in name)
                or (self.config.tie_word_embeddings and "lm_head" in name)
            ):
                continue

            if (
                hasattr(self.config, "norm_head")
                and self.config.norm_head
                and "lm_head.weight" in name
            ):
                import torch.nn.functional as F

                loaded_weight = F.normalize(loaded_weight, dim=0, p=2, eps=1e-7)

            for param_name, weight_name, shard_id in stacked_params_mapping:
                if weight_name not in name:
                    continue
                # We have mlp.experts[0].gate_proj in the checkpoint.
                # Since we handle the experts below in expert_params_mapping,
                # we need to skip here BEFORE we update the name, otherwise
                # name will be updated to mlp.experts[0].gate_up_proj, which
                # will then be updated below in expert_params_mapping
                # for mlp.experts[0].gate_gate_up_proj, which breaks load.
                if "mlp.experts" in name:
                    continue
                name = name.replace(weight_name, param_name)
                # Skip loading extra bias for GPTQ models.
                if name.endswith(".bias") and name not in params_dict:
                    continue
                if name not in params_dict:
                    continue

                param = params_dict[name]
                weight_loader = param.weight_loader
                weight_loader(param, loaded_weight, shard_id)
                break
            else:
                for mapping in expert_params_mapping:
                    param_name, weight_name, expert_id, shard_id = mapping
                    if weight_name not in name:
                        continue
                    name = name.replace(weight_name, param_name)
                    if name not in params_dict:
                        continue
                    param = params_dict[name]
                    weight_loader = param.weight_loader
                    weight_loader(
                        param,
                        loaded_weight,
                        name,
                        shard_id=shard_id,
                        expert_id=expert_id,
                    )
                    break
                else:
                    # Skip loading extra bias for GPTQ models.
                    if name.endswith(".bias") and name not in params_dict:
                        continue
                    if name not in params_dict:
                        continue

                    param = params_dict[name]
                    weight_loader = getattr(
                        param, "weight_loader", default_weight_loader
                    )
                    weight_loader(param, loaded_weight)

        # Lazy: get_moe_weights() snapshots x.data, and building the map here would
        # pin every expert weight's pre-process_weights_after_loading storage.
        if not hasattr(self, "routed_experts_weights_of_layer"):
            self.routed_experts_weights_of_layer = LazyValue(
                lambda: {
                    layer_id: layer.mlp.get_moe_weights()
                    for layer_id, layer in enumerate(self.model.layers)
                    if not isinstance(layer, PPMissingLayer)
                    and isinstance(layer.mlp, LLaDA2MoeSparseMoeBlock)
                }
            )

    @classmethod
    def get_model_config_for_expert_location(cls, config):
        num_groups = getattr(config, "n_group", 0)
        return ModelConfigForExpertLocation(
            num_layers=config.num_hidden_layers,
            num_logical_experts=config.num_experts,
            num_groups=None if num_groups == 0 else num_groups,
        )


EntryClass = LLaDA2MoeModelLM
