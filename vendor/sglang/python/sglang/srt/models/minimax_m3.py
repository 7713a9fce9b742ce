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

# Adapted from DeepSeek and Mixtral implementation
"""Inference-only MiniMax M3 model compatible with HuggingFace weights."""

import logging
from contextlib import nullcontext
from functools import partial
from typing import Iterable, List, Optional, Set, Tuple, Union

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.kernels.ops.activation.swiglu_mxfp8_swizzled import (
    can_use_silu_mul_mxfp8,
    swiglu_oai_mxfp8,
    swiglu_oai_mxfp8_deepgemm,
)
from sglang.srt.batch_overlap.two_batch_overlap import model_forward_stages
from sglang.srt.configs.model_config import (
    get_minimax_sparse_disable_value_layer_ids,
    get_minimax_sparse_layer_ids,
    uses_minimax_m3_nvfp4_native_stack,
)
from sglang.srt.environ import envs
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.aux_hidden_states import (
    AuxHiddenStateAccumulator,
    AuxHiddenStateList,
)
from sglang.srt.layers.dp_attention import (
    is_dp_attention_enabled,
)
from sglang.srt.layers.layer_boundary import (
    append_stages,
    declare_attn,
    declare_ffn,
    is_dense_ffn_fully_dp,
)
from sglang.srt.layers.layer_boundary.fusions.moe_finalize import MoeDeferredFinalize
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm
from sglang.srt.layers.linear import (
    LinearParallelGroup,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    ReplicatedParallelGroup,
    RowParallelLinear,
)
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.moe.topk import TopK
from sglang.srt.layers.moe.utils import (
    get_moe_a2a_backend,
    get_moe_runner_backend,
    get_num_fused_shared_experts,
)
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.quantization.mxfp8_input import (
    Mxfp8SwizzledInput,
    accepts_mxfp8_deepgemm_input,
    accepts_mxfp8_swizzled_input,
)
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.utils import PPMissingLayer
from sglang.srt.layers.utils.common import get_layer_id
from sglang.srt.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from sglang.srt.model_executor.cuda_graph_config import (
    Backend,
    Phase,
    check_cuda_graph_backend,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors
from sglang.srt.model_executor.forward_context import (
    get_forward_context,
    has_forward_context,
)
from sglang.srt.model_executor.runner import get_is_capture_mode
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
    is_in_breakable_cuda_graph,
)
from sglang.srt.model_loader.weight_utils import (
    default_weight_loader,
    maybe_remap_kv_scale_name,
)
from sglang.srt.models.deepseek_common.utils import tiny_router_gemm_max_tokens
from sglang.srt.models.minimax_m2 import MiniMaxM2RMSNormTP
from sglang.srt.models.utils import WeightsMapper
from sglang.srt.runtime_context import (
    get_exec,
    get_forward,
    get_parallel,
    get_platform,
    get_stream,
)
from sglang.srt.utils import (
    add_prefix,
    get_device_sm,
    is_cuda,
    is_gfx95_supported,
    is_hip,
    is_npu,
    log_info_on_rank0,
    make_pp_layers,
)
from sglang.srt.utils.hf_transformers_utils import get_rope_config

_is_cuda = is_cuda()
_is_hip = is_hip()
_is_npu = is_npu()
_is_gfx95_supported = _is_hip and is_gfx95_supported()
_device_sm = get_device_sm()

if _is_gfx95_supported:
    from sglang.kernels.ops.gemm.router_gemv import (
        router_gemv,
        router_gemv_supported,
    )
else:
    router_gemv = router_gemv_supported = None

# Import-time CUDA kernels would block processor imports on CPU CI.
if _is_cuda:
    from sglang.kernels.ops.gemm.tiny_gemm import tiny_gemm_bf16
else:
    tiny_gemm_bf16 = None

_FP8_KV_DTYPES = (
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
)

# rotary_dim required by the fused qknorm+rope JIT kernel: rotary_dim/2 must
# equal the CUDA warp size (32) so each warp norms+ropes one head in one pass.
_M3_FUSED_QKNORM_ROPE_ROTARY_DIM = 64
# Positions in the group list built by `_qknorm_groups`.
_QKNORM_GROUP_MAIN_Q = 0
_QKNORM_GROUP_INDEX_Q = 2

_has_rocm_qk_norm_rope = False
if _is_hip:
    try:
        from sglang.kernels.ops.attention.minimax_m3_qk_norm_rope import (
            qk_gemma_rmsnorm_rope,
            sparse_qk_index_gemma_rmsnorm_rope,
            sparse_qk_index_gemma_rmsnorm_rope_cache,
        )

        _has_rocm_qk_norm_rope = True
    except ImportError:
        _has_rocm_qk_norm_rope = False

if _is_npu:
    from sgl_kernel_npu.norm.split_qkv_rmsnorm_rope_pos_cache_half_npu import (
        split_qkv_rmsnorm_rope_pos_cache_half_npu,
    )

    from sglang.srt.hardware_backend.npu.utils import (
        process_shared_expert,
        wait_share_stream,
    )

_aiter = None
_has_aiter_fused_qknorm = False
if _is_hip and envs.SGLANG_USE_AITER.get():
    try:
        import aiter as _aiter

        _has_aiter_fused_qknorm = hasattr(_aiter, "fused_qknorm_idxrqknorm")
    except ImportError:
        _aiter = None
        _has_aiter_fused_qknorm = False

logger = logging.getLogger(__name__)


class MultiHeadRMSNorm(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        eps: float = 1e-6,
        apply_layernorm_1p: bool = False,
    ) -> None:
        super().__init__()
        self.tp_world = get_parallel().attn_tp_size
        self.tp_rank = get_parallel().attn_tp_rank
        self.num_heads = num_heads
        self.num_heads_per_tp = num_heads // self.tp_world
        self.head_dim = head_dim
        self.weight = nn.Parameter(
            torch.ones(self.num_heads_per_tp, self.head_dim, dtype=torch.float32)
        )
        self.weight.weight_loader = self.weight_loader
        self.apply_layernorm_1p = apply_layernorm_1p
        self.variance_epsilon = eps

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
    ) -> None:
        shard_size = loaded_weight.shape[0] // self.tp_world
        shard = slice(self.tp_rank * shard_size, (self.tp_rank + 1) * shard_size)
        param.data.copy_(loaded_weight[shard].reshape_as(param))

    def forward(
        self,
        x: torch.Tensor,
    ) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.view(-1, self.num_heads_per_tp, self.head_dim).to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True, dtype=torch.float32)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        if self.apply_layernorm_1p:
            x = x * (self.weight + 1)[None, ...]
        else:
            x = x * self.weight[None, ...]
        x = x.view(-1, self.num_heads_per_tp * self.head_dim)
        return x.to(orig_dtype)


class _FusedQKVIndexProj(nn.Module):
    def __init__(
        self,
        quant_method,
        weight: torch.Tensor,
        weight_scale_inv: Optional[torch.Tensor],
        input_size_per_partition: int,
        logical_widths: List[int],
        orig_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        # Named ``_qm`` (not ``quant_method``) so the loader's post-process loop
        # skips this module; the backend scale layout is derived once below.
        self._qm = quant_method
        self.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = weight.shape[0]
        self.logical_widths = logical_widths
        self.orig_dtype = orig_dtype
        self.input_scale = None
        if weight_scale_inv is not None:
            self.register_parameter(
                "weight_scale_inv", nn.Parameter(weight_scale_inv, requires_grad=False)
            )
            self.weight_scale_inv.format_ue8m0 = True
            # The loader skips this module (see ``_qm``), so run the weight
            # post-process here instead of process_weights_after_loading.
            if getattr(quant_method, "convert_mxfp8_to_block", False):
                # Block-fp8 (gfx942/gfx950): convert the concatenated MXFP8 weight
                # to block-fp8 [128,128] and run the same fnuz/scale/preshuffle
                # steps as the per-linear path (this also flips quant_method into
                # block-fp8 state). q/kv and index output sizes are 128-aligned, so
                # converting the concatenation equals converting each proj alone.
                quant_method.process_weights_after_loading_block_quant(self)
            else:
                # Derive the backend scale layout for the native MXFP8 GEMM.
                quant_method._process_mxfp8_linear_weight_scale(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._qm.apply(self, x, None)


def build_minimax_fused_qkv_index(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, MiniMaxM3Attention):
            module.maybe_build_fused_qkv_index()


class MiniMaxM3MLP(nn.Module):
    @staticmethod
    def _swigluoai_fused(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """swiglu_oai using fused Triton kernel (sgl_kernel_npu), no quant."""
        from sgl_kernel_npu.activation.swiglu_oai_quant import swiglu_oai_quant

        out, _ = swiglu_oai_quant(x, alpha, limit, need_quant=False)
        return out

    def __init__(
        self,
        config: PretrainedConfig,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
        reduce_results: bool = True,
        intermediate_size: int = None,
        *,
        parallel_group: LinearParallelGroup = "tp",
    ) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        hidden_act = config.hidden_act
        self.fuse_swiglu_oai_mxfp8 = hidden_act == "swigluoai"

        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=add_prefix("gate_up_proj", prefix),
            parallel_group=parallel_group,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=False,
            quant_config=quant_config,
            reduce_results=reduce_results,
            prefix=add_prefix("down_proj", prefix),
            parallel_group=parallel_group,
        )
        if hidden_act == "silu":
            self.act_fn = SiluAndMul()
        elif hidden_act == "swigluoai":
            self.swiglu_alpha = float(config.swiglu_alpha)
            self.swiglu_limit = float(config.swiglu_limit)
            if _is_npu:
                self.act_fn = lambda x: self._swigluoai_fused(
                    x, self.swiglu_alpha, self.swiglu_limit
                )
            else:
                from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import (
                    swiglu_no_interleaved_with_alpha_and_limit,
                )

                self.act_fn = lambda x: swiglu_no_interleaved_with_alpha_and_limit(
                    x, self.swiglu_alpha, self.swiglu_limit
                )
        else:
            raise ValueError(
                f"Unsupported activation: {hidden_act}. Only silu is supported for now."
            )

    def _swiglu_oai_mxfp8(self, gate_up: torch.Tensor):
        if not (
            self.fuse_swiglu_oai_mxfp8
            and gate_up.shape[0] > 0
            and not get_forward().sp_active
            and can_use_silu_mul_mxfp8(gate_up)
        ):
            return None
        if accepts_mxfp8_swizzled_input(self.down_proj):
            return Mxfp8SwizzledInput(
                *swiglu_oai_mxfp8(gate_up, self.swiglu_alpha, self.swiglu_limit)
            )
        if accepts_mxfp8_deepgemm_input(self.down_proj):
            return swiglu_oai_mxfp8_deepgemm(
                gate_up, self.swiglu_alpha, self.swiglu_limit
            )
        return None

    def forward(
        self,
        x,
        forward_batch: Optional[ForwardBatch] = None,
    ):
        gate_up, _ = self.gate_up_proj(x)
        x = self._swiglu_oai_mxfp8(gate_up)
        if x is None:
            x = self.act_fn(gate_up)
        x, _ = self.down_proj(x)
        return x


class MiniMaxM3MoE(nn.Module):
    """MiniMax MoE implementation using DeepEP for Expert Parallel support."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        quant_config: Optional[QuantizationConfig] = None,
        alt_stream: Optional[torch.cuda.Stream] = None,
        prefix: str = "",
    ):
        super().__init__()
        self.tp_size = get_parallel().tp_size
        self.config = config
        self.alt_stream = alt_stream
        self.n_shared_experts = getattr(config, "n_shared_experts", None)
        self.num_fused_shared_experts = get_num_fused_shared_experts()

        if self.tp_size > config.num_local_experts:
            raise ValueError(
                f"Tensor parallel size {self.tp_size} is greater than "
                f"the number of experts {config.num_local_experts}."
            )
        self.routed_scaling_factor = getattr(config, "routed_scaling_factor", 1.0)
        self.use_routing_bias = getattr(config, "use_routing_bias", False)
        if self.use_routing_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(config.num_local_experts, dtype=torch.float32)
            )
            self.e_score_correction_bias.weight_loader = (
                MiniMaxM3MoE.ebias_weight_loader
            )
        else:
            self.e_score_correction_bias = None

        self.experts = get_moe_impl_class(quant_config)(
            num_experts=config.num_local_experts
            + self.num_fused_shared_experts
            + get_exec().moe.ep_num_redundant_experts,
            num_fused_shared_experts=self.num_fused_shared_experts,
            top_k=config.num_experts_per_tok + self.num_fused_shared_experts,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            layer_id=layer_id,
            quant_config=quant_config,
            activation="silu",
            is_gated=True,
            gemm1_alpha=config.swiglu_alpha,
            gemm1_beta=1.0,
            gemm1_clamp_limit=config.swiglu_limit,
            prefix=add_prefix("experts", prefix),
            gate_up_interleaved=False,
        )
        self.experts._minimax_activation = (
            "swigluoai" if config.hidden_act == "swigluoai" else "swiglu"
        )
        self.topk = TopK(
            top_k=config.num_experts_per_tok,
            renormalize=True,
            layer_id=layer_id,
            scoring_func=config.scoring_func,
            correction_bias=self.e_score_correction_bias,
            routed_scaling_factor=self.routed_scaling_factor,
            apply_routed_scaling_factor_on_output=True,
        )
        self.topk.bind_runner_backend(self.experts.runner_backend)

        if self.n_shared_experts is not None and self.num_fused_shared_experts == 0:
            intermediate_size = config.intermediate_size * self.n_shared_experts
            # DeepEP all-gathers (not all-reduces) the layer output, so a TP-sharded
            # shared MLP would leave an unreduced partial; replicate (tp_size=1), like GLM4 / DSV2.
            shared_experts_tp1 = (
                get_moe_a2a_backend().is_deepep() or get_moe_a2a_backend().is_megamoe()
            )
            self.shared_experts = MiniMaxM3MLP(
                config=config,
                quant_config=quant_config,
                prefix=add_prefix("shared_experts", prefix),
                reduce_results=False,
                intermediate_size=intermediate_size,
                parallel_group="replicated" if shared_experts_tp1 else "tp",
            )
        else:
            self.shared_experts = None

        self.bf16_router_gemm = envs.SGLANG_OPT_USE_BF16_ROUTER_GEMM.get()
        self.gate = ReplicatedLinear(
            config.hidden_size,
            config.num_local_experts,
            bias=False,
            params_dtype=torch.bfloat16 if self.bf16_router_gemm else torch.float32,
            quant_config=None,
            prefix=add_prefix("gate", prefix),
        )
        self.tiny_router_gemm_max_tokens = tiny_router_gemm_max_tokens(
            num_experts=config.num_local_experts,
            hidden_size=config.hidden_size,
            weight_dtype=self.gate.weight.dtype,
        )

        self.layer_id = layer_id
        self.trtllm_decode_with_mega_moe = (
            get_moe_a2a_backend().is_megamoe()
            and get_moe_runner_backend().is_flashinfer_trtllm_routed()
        )
        if self.trtllm_decode_with_mega_moe and (
            get_parallel().attn_tp_group.ranks != get_parallel().moe_ep_group.ranks
        ):
            raise ValueError(
                "M3.1 hybrid MoE requires matching attention TP and MoE EP groups"
            )

        if get_moe_a2a_backend().is_deepep():
            self.top_k = config.num_experts_per_tok

        # The finalize kernels never rescale: the routed scaling factor is already
        # in the top-k weights (apply_routed_scaling_factor_on_output).
        self.supports_deferred_finalize = (
            self.tp_size > 1
            and self.shared_experts is not None
            and get_moe_a2a_backend().is_none()
            and get_moe_runner_backend().is_flashinfer_trtllm_routed()
            and self.experts.supports_deferred_finalize
        )

    @staticmethod
    def ebias_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        assert param.size() == loaded_weight.size()
        param.data.copy_(loaded_weight.to(torch.float32))

    def forward(
        self,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if get_moe_a2a_backend().is_megamoe():
            return self.forward_mega_moe(hidden_states, forward_batch)
        if get_moe_a2a_backend().is_deepep():
            return self.forward_deepep(hidden_states, forward_batch)
        else:
            return self.forward_normal(hidden_states)

    def forward_mega_moe(
        self, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ):
        from sglang.srt.layers.moe.mega_moe import (
            is_mega_moe_experts_ready,
            run_mega_routed_experts,
        )

        if not is_mega_moe_experts_ready(self.experts):
            raise RuntimeError(
                "M3.1 NVFP4 MegaMoE weights are not ready on this device"
            )
        num_tokens = hidden_states.shape[0]
        shared = self._forward_shared_experts(hidden_states) if num_tokens else None
        topk_ids = topk_weights = None
        if num_tokens:
            output = self.topk(
                hidden_states,
                self._compute_router_logits(hidden_states),
                num_token_non_padded=forward_batch.num_token_non_padded,
                expert_location_dispatch_info=(
                    ExpertLocationDispatchInfo.init_new(layer_id=self.layer_id)
                    if get_exec().moe.enable_eplb
                    else None
                ),
            )
            topk_ids, topk_weights = output.topk_ids, output.topk_weights
        if self.trtllm_decode_with_mega_moe and forward_batch.forward_mode.is_decode():
            if not num_tokens:
                return hidden_states
            output = self._forward_trtllm_decode(hidden_states, topk_ids, topk_weights)
            return output + shared if shared is not None else output
        output = run_mega_routed_experts(
            self.experts,
            hidden_states,
            topk_ids,
            topk_weights,
            hidden_size=self.config.hidden_size,
            intermediate_size=self.config.intermediate_size,
            top_k=self.config.num_experts_per_tok,
            num_tokens=num_tokens,
            activation=self.experts._minimax_activation,
            activation_clamp=self.config.swiglu_limit,
        )
        return output + shared if shared is not None else output

    def _forward_trtllm_decode(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        from sglang.srt.layers.moe.token_dispatcher.standard import (
            StandardDispatchOutput,
        )
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        group = get_parallel().attn_tp_group

        def gather(t: torch.Tensor) -> torch.Tensor:
            out = t.new_empty((t.shape[0] * group.world_size, *t.shape[1:]))
            group.all_gather_into_tensor(out, t)
            return out

        dispatch_output = StandardDispatchOutput(
            hidden_states=gather(hidden_states),
            hidden_states_scale=None,
            topk_output=StandardTopKOutput(
                topk_weights=gather(topk_weights),
                topk_ids=gather(topk_ids),
                router_logits=None,
            ),
        )
        partial = self.experts.quant_method.apply(self.experts, dispatch_output)
        output = torch.empty_like(hidden_states)
        group.reduce_scatter_tensor(output, partial.hidden_states)
        return output

    def forward_normal(
        self, hidden_states: torch.Tensor
    ) -> Union[torch.Tensor, MoeDeferredFinalize]:
        defer_finalize = get_forward().defer_moe_finalize
        if hidden_states.shape[0] > 0:
            if (
                self.alt_stream is not None
                and self.shared_experts is not None
                and get_is_capture_mode()
                and not is_in_breakable_cuda_graph()
            ):
                current_stream = torch.cuda.current_stream()
                self.alt_stream.wait_stream(current_stream)
                shared_output = self._forward_shared_experts(hidden_states)
                with torch.cuda.stream(self.alt_stream):
                    final_hidden_states = self._forward_router_experts(
                        hidden_states, defer_finalize=defer_finalize
                    )
                current_stream.wait_stream(self.alt_stream)
            else:
                shared_output = self._forward_shared_experts(hidden_states)
                final_hidden_states = self._forward_router_experts(
                    hidden_states, defer_finalize=defer_finalize
                )
        else:
            shared_output = None
            topk_output = self.topk.empty_topk_output(hidden_states.device)
            final_hidden_states = self.experts(hidden_states, topk_output)

        if defer_finalize:
            from sglang.srt.layers.moe.utils import sum_post_experts_output

            return MoeDeferredFinalize.from_flashinfer(
                final_hidden_states,
                gated_shared_output=shared_output,
                m=hidden_states.shape[0],
                reduce=sum_post_experts_output,
            )
        if shared_output is not None:
            final_hidden_states = final_hidden_states + shared_output
        return final_hidden_states

    def _forward_router_experts(
        self, hidden_states: torch.Tensor, *, defer_finalize: bool = False
    ):
        router_logits = self._compute_router_logits(hidden_states)
        topk_output = self.topk(hidden_states, router_logits)
        if defer_finalize:
            return self.experts.forward_deferred_finalize(hidden_states, topk_output)
        return self.experts(hidden_states, topk_output)

    def forward_deepep(
        self, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """DeepEP MoE forward: routed experts via a2a, shared experts replicated."""
        shared_output = None
        enable_npu_dual_stream = _is_npu and (
            forward_batch.forward_mode.is_extend()
            or forward_batch.forward_mode.is_target_verify()
            or forward_batch.forward_mode.is_decode()
        )
        if hidden_states.shape[0] > 0:
            router_logits = self._compute_router_logits(hidden_states)
            if enable_npu_dual_stream:
                # Overlap shared experts with router/experts on a separate stream.
                shared_output = process_shared_expert(
                    hidden_states, self._forward_shared_experts
                )
            else:
                shared_output = self._forward_shared_experts(hidden_states)
            topk_output = self.topk(
                hidden_states,
                router_logits,
            )
        else:
            topk_output = self.topk.empty_topk_output(hidden_states.device)

        # DeepEP returns the complete per-token routed result (no TP all-reduce here);
        # shared experts are replicated (tp_size=1), so both add directly.
        final_hidden_states = self.experts(hidden_states, topk_output)

        if enable_npu_dual_stream:
            wait_share_stream()

        if shared_output is not None:
            final_hidden_states = final_hidden_states + shared_output

        return final_hidden_states

    def _compute_router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.bf16_router_gemm:
            if router_gemv is not None and router_gemv_supported(
                hidden_states, self.gate.weight
            ):
                return router_gemv(hidden_states, self.gate.weight)
            if _is_npu:
                # NPU lacks aten::mm.dtype; bf16 mm then cast keeps topk semantics.
                return torch.mm(hidden_states, self.gate.weight.t()).float()
            if (
                not get_exec().deterministic.enable_deterministic_inference
                and hidden_states.shape[0] <= self.tiny_router_gemm_max_tokens
            ):
                # N is num_local_experts, so cuBLAS splits K and runs the
                # projection as two launches; the tiny GEMM does it in one.
                return tiny_gemm_bf16(
                    hidden_states,
                    self.gate.weight,
                    out_dtype=torch.float32,
                    max_m=self.tiny_router_gemm_max_tokens,
                )
            return torch.mm(
                hidden_states, self.gate.weight.t(), out_dtype=torch.float32
            )
        router_logits, _ = self.gate(hidden_states.to(torch.float32))
        return router_logits

    def _forward_shared_experts(self, hidden_states: torch.Tensor):
        if (hidden_states.shape[0] > 0) and (self.num_fused_shared_experts == 0):
            return self.shared_experts(hidden_states)
        else:
            return None


class MiniMaxM3Attention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int = 0,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
        is_sparse_attention_layer: bool = False,
        disable_index_value: bool = False,
    ) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.is_sparse_attention_layer = is_sparse_attention_layer
        self.disable_index_value = is_sparse_attention_layer and disable_index_value

        attn_tp_rank = get_parallel().attn_tp_rank
        attn_tp_size = get_parallel().attn_tp_size
        self.attn_tp_size = attn_tp_size

        self.total_num_heads = config.num_attention_heads
        assert self.total_num_heads % attn_tp_size == 0
        self.num_heads = self.total_num_heads // attn_tp_size
        self.total_num_kv_heads = config.num_key_value_heads

        if self.total_num_kv_heads >= attn_tp_size:
            # Number of KV heads is greater than TP size, so we partition
            # the KV heads across multiple tensor parallel GPUs.
            assert self.total_num_kv_heads % attn_tp_size == 0
        else:
            # Number of KV heads is less than TP size, so we replicate
            # the KV heads across multiple tensor parallel GPUs.
            assert attn_tp_size % self.total_num_kv_heads == 0
        self.num_kv_heads = max(1, self.total_num_kv_heads // attn_tp_size)

        self.head_dim = getattr(
            config, "head_dim", self.hidden_size // self.total_num_heads
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5

        self.rope_theta, self.rope_scaling = get_rope_config(config)
        self.max_position_embeddings = getattr(config, "max_position_embeddings", 8192)
        self.rotary_dim = getattr(config, "rotary_dim", self.head_dim)

        self.use_qk_norm = getattr(config, "use_qk_norm", False)
        self.qk_norm_type = getattr(config, "qk_norm_type", "per_layer")
        self.use_gemma_norm = getattr(config, "use_gemma_norm", False)

        if self.is_sparse_attention_layer:
            assert self.qk_norm_type == "per_head", (
                f"sparse attention only supports qk_norm_type='per_head', "
                f"got {self.qk_norm_type!r}"
            )
            sparse_cfg = config.sparse_attention_config
            self.total_idx_heads = sparse_cfg["sparse_num_index_heads"]
            self.idx_head_dim = sparse_cfg["sparse_index_dim"]
            # idx_replica_size ranks share one idx head; pre-divide idx_o on the activation
            # (not the weight) so the TP all-reduce sums right and stays FP8-quant-safe.
            if self.total_idx_heads >= attn_tp_size:
                assert self.total_idx_heads % attn_tp_size == 0
            else:
                assert attn_tp_size % self.total_idx_heads == 0
            self.idx_head_tp_size = min(attn_tp_size, self.total_idx_heads)
            self.idx_replica_size = attn_tp_size // self.idx_head_tp_size
            self.idx_head_rank = attn_tp_rank // self.idx_replica_size
            self.num_idx_heads = self.total_idx_heads // self.idx_head_tp_size
            index_parallel_group = ReplicatedParallelGroup(
                "attn_tp", self.idx_replica_size
            )

        self.qkv_proj = QKVParallelLinear(
            self.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=False,
            quant_config=quant_config,
            parallel_group="attn_tp",
            prefix=add_prefix("qkv_proj", prefix),
        )

        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            self.hidden_size,
            bias=False,
            reduce_results=False,
            quant_config=quant_config,
            parallel_group="attn_tp",
            prefix=add_prefix("o_proj", prefix),
        )

        self.rotary_emb = get_rope(
            self.head_dim,
            rotary_dim=self.rotary_dim,
            max_position=self.max_position_embeddings,
            base=self.rope_theta,
            rope_scaling=self.rope_scaling,
        )

        if self.is_sparse_attention_layer:
            self.index_qkv_proj = QKVParallelLinear(
                self.hidden_size,
                self.idx_head_dim,
                self.total_idx_heads,
                total_num_kv_heads=1,
                bias=False,
                quant_config=quant_config,
                v_head_size=(0 if self.disable_index_value else self.idx_head_dim),
                parallel_group=index_parallel_group,
                prefix=add_prefix("index_qkv_proj", prefix),
            )

            if self.disable_index_value:
                self.index_o_proj = None
            else:
                self.index_o_proj = RowParallelLinear(
                    self.total_idx_heads * self.idx_head_dim,
                    self.hidden_size,
                    bias=False,
                    input_is_parallel=True,
                    reduce_results=False,
                    quant_config=quant_config,
                    prefix=add_prefix("index_o_proj", prefix),
                    parallel_group=index_parallel_group,
                )
            self.index_rotary_emb = self.rotary_emb

        if self.qk_norm_type == "per_layer":
            if attn_tp_size > 1:
                self.q_norm = MiniMaxM2RMSNormTP(
                    self.total_num_heads * self.head_dim, eps=config.rms_norm_eps
                )
                self.k_norm = MiniMaxM2RMSNormTP(
                    self.total_num_kv_heads * self.head_dim, eps=config.rms_norm_eps
                )
            else:
                self.q_norm = RMSNorm(
                    self.total_num_heads * self.head_dim, eps=config.rms_norm_eps
                )
                self.k_norm = RMSNorm(
                    self.total_num_kv_heads * self.head_dim, eps=config.rms_norm_eps
                )
        elif self.qk_norm_type == "per_head":
            if self.use_gemma_norm:
                self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
                self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            else:
                self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
                self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            if self.is_sparse_attention_layer:
                if self.use_gemma_norm:
                    self.index_q_norm = GemmaRMSNorm(
                        self.idx_head_dim, eps=config.rms_norm_eps
                    )
                    self.index_k_norm = GemmaRMSNorm(
                        self.idx_head_dim, eps=config.rms_norm_eps
                    )
                else:
                    self.index_q_norm = RMSNorm(
                        self.idx_head_dim, eps=config.rms_norm_eps
                    )
                    self.index_k_norm = RMSNorm(
                        self.idx_head_dim, eps=config.rms_norm_eps
                    )
        elif self.qk_norm_type == "multi_head":
            self.q_norm = MultiHeadRMSNorm(
                self.total_num_heads,
                self.head_dim,
                eps=config.rms_norm_eps,
                apply_layernorm_1p=self.use_gemma_norm,
            )
            self.k_norm = MultiHeadRMSNorm(
                self.total_num_kv_heads,
                self.head_dim,
                eps=config.rms_norm_eps,
                apply_layernorm_1p=self.use_gemma_norm,
            )
        else:
            raise ValueError(f"Invalid qk_norm_type: {self.qk_norm_type}")

        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            layer_id=layer_id,
            quant_config=quant_config,
            prefix=add_prefix("attn", prefix),
        )

        self._use_fused_qknorm_rope = (
            _is_cuda
            and self.qk_norm_type == "per_head"
            and self.use_gemma_norm
            and self.head_dim == 128
            and self.rotary_dim == _M3_FUSED_QKNORM_ROPE_ROTARY_DIM
            and getattr(self.rotary_emb, "is_neox_style", False)
        )

        self._fuse_qkv_index_enabled = self.is_sparse_attention_layer and (
            _is_cuda or _is_hip
        )
        self._fused_qkv_index = None
        self._fused_main_size = self.q_size + 2 * self.kv_size

        self._combined_qknorm_ok = (
            self.is_sparse_attention_layer
            and self._use_fused_qknorm_rope
            and self.idx_head_dim == 128
            and self.rotary_emb.cos_sin_cache.dtype == torch.float32
        )
        # Only the NVFP4 backend consumes FP8 Q; gate on the predicate that
        # selects it and its KV pool, so the three cannot disagree.
        self._fp8_q_epilogue_ok = (
            self._combined_qknorm_ok
            and envs.SGLANG_OPT_USE_MINIMAX_FP8_Q_EPILOGUE.get()
            and uses_minimax_m3_nvfp4_native_stack(
                quant_config.get_name() if quant_config is not None else None
            )
        )
        if self.is_sparse_attention_layer and layer_id == 0:
            logger.info(
                "MiniMax M3.1 grouped QK norm/RoPE: FP8 Q epilogue %s",
                "on" if self._fp8_q_epilogue_ok else "off",
            )
        if self.is_sparse_attention_layer:
            off_iq = self.num_heads + 2 * self.num_kv_heads
            off_ik = off_iq + self.num_idx_heads
            self._qknorm_group_meta = (
                (0, self.num_heads),
                (self.num_heads, self.num_kv_heads),
                (off_iq, self.num_idx_heads),
                (off_ik, 1),
            )

        self._can_use_rocm_qk_norm_rope_static = (
            _has_rocm_qk_norm_rope
            and self.qk_norm_type == "per_head"
            and self.use_gemma_norm
            and self.q_norm.variance_epsilon == self.k_norm.variance_epsilon
            and hasattr(self.rotary_emb, "cos_sin_cache")
            and self.rotary_emb.rotary_dim == self.rotary_dim
            and self.rotary_dim <= self.head_dim
        )
        self._can_use_rocm_index_qk_norm_rope_static = (
            self.is_sparse_attention_layer
            and _has_rocm_qk_norm_rope
            and self.use_gemma_norm
            and self.index_q_norm.variance_epsilon == self.index_k_norm.variance_epsilon
            and hasattr(self.index_rotary_emb, "cos_sin_cache")
            and self.index_rotary_emb.rotary_dim == self.rotary_dim
            and self.rotary_dim <= self.idx_head_dim
        )
        self._can_use_rocm_sparse_qk_index_norm_rope_static = (
            self.is_sparse_attention_layer
            and self._can_use_rocm_qk_norm_rope_static
            and self._can_use_rocm_index_qk_norm_rope_static
            and self.idx_head_dim == self.head_dim
            and self.index_q_norm.variance_epsilon == self.q_norm.variance_epsilon
            and self.index_k_norm.variance_epsilon == self.q_norm.variance_epsilon
            and self.index_rotary_emb is self.rotary_emb
        )
        self._aiter_cos_sin_cache = None
        self._can_use_aiter_fused_qknorm_static = (
            self.is_sparse_attention_layer
            and self.disable_index_value
            and _has_aiter_fused_qknorm
            and envs.SGLANG_M3_USE_AITER_FUSED_QKNORM.get()
            and self.qk_norm_type == "per_head"
            and self.use_gemma_norm
            and self.head_dim == 128
            and self.idx_head_dim == 128
            and self.rotary_dim <= self.head_dim
            and getattr(self.rotary_emb, "is_neox_style", False)
            and self.index_rotary_emb is self.rotary_emb
            and self.q_norm.variance_epsilon == self.k_norm.variance_epsilon
            and self.index_q_norm.variance_epsilon == self.q_norm.variance_epsilon
            and self.index_k_norm.variance_epsilon == self.q_norm.variance_epsilon
        )

    def _can_use_rocm_qk_norm_rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> bool:
        return (
            self._can_use_rocm_qk_norm_rope_static
            and positions.dim() == 1
            and q.dim() == 2
            and k.dim() == 2
            and q.dtype in (torch.bfloat16, torch.float16)
            and k.dtype == q.dtype
        )

    def _qk_norm_rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._can_use_rocm_qk_norm_rope(positions, q, k):
            return qk_gemma_rmsnorm_rope(
                q,
                k,
                self.q_norm.weight.data,
                self.k_norm.weight.data,
                positions,
                self.rotary_emb.cos_sin_cache,
                self.q_norm.variance_epsilon,
                self.head_dim,
                self.rotary_dim,
                self.rotary_emb.is_neox_style,
            )
        q, k = self._qk_norm(q, k)
        return self.rotary_emb(positions, q, k)

    def _qk_norm(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.qk_norm_type == "per_layer":
            if self.attn_tp_size > 1:
                q, k = MiniMaxM2RMSNormTP.forward_qk(
                    self.q_norm, self.k_norm, q.contiguous(), k.contiguous()
                )
            else:
                q = self.q_norm(q.contiguous())
                k = self.k_norm(k.contiguous())
        elif self.qk_norm_type == "per_head":
            q_shape = q.shape
            k_shape = k.shape
            q = q.reshape(-1, self.head_dim).contiguous()
            k = k.reshape(-1, self.head_dim).contiguous()
            q = self.q_norm(q).reshape(q_shape)
            k = self.k_norm(k).reshape(k_shape)
        elif self.qk_norm_type == "multi_head":
            q = self.q_norm(q.contiguous())
            k = self.k_norm(k.contiguous())
        else:
            raise ValueError(f"Invalid qk_norm_type: {self.qk_norm_type}")
        return q, k

    def _index_qk_norm_rope(
        self, positions: torch.Tensor, idx_q: torch.Tensor, idx_k: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if (
            self._can_use_rocm_index_qk_norm_rope_static
            and positions.dim() == 1
            and idx_q.dim() == 2
            and idx_k.dim() == 2
            and idx_q.dtype in (torch.bfloat16, torch.float16)
            and idx_k.dtype == idx_q.dtype
        ):
            return qk_gemma_rmsnorm_rope(
                idx_q,
                idx_k,
                self.index_q_norm.weight.data,
                self.index_k_norm.weight.data,
                positions,
                self.index_rotary_emb.cos_sin_cache,
                self.index_q_norm.variance_epsilon,
                self.idx_head_dim,
                self.rotary_dim,
                self.index_rotary_emb.is_neox_style,
            )
        idx_q, idx_k = self._index_qk_norm(idx_q, idx_k)
        return self.index_rotary_emb(positions, idx_q, idx_k)

    def _index_qk_norm(
        self, idx_q: torch.Tensor, idx_k: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        idx_q_shape = idx_q.shape
        idx_k_shape = idx_k.shape
        idx_q = idx_q.reshape(-1, self.idx_head_dim)
        idx_k = idx_k.reshape(-1, self.idx_head_dim)
        idx_q = self.index_q_norm(idx_q).reshape(idx_q_shape)
        idx_k = self.index_k_norm(idx_k).reshape(idx_k_shape)
        return idx_q, idx_k

    def _split_index_qkv(
        self, idx_qkv: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        q_size = self.num_idx_heads * self.idx_head_dim
        if self.disable_index_value:
            idx_q, idx_k = idx_qkv.split([q_size, self.idx_head_dim], dim=-1)
            idx_v = None
        else:
            idx_q, idx_k, idx_v = idx_qkv.split(
                [q_size, self.idx_head_dim, self.idx_head_dim], dim=-1
            )
        return idx_q, idx_k, idx_v

    def maybe_build_fused_qkv_index(self) -> None:
        if not self._fuse_qkv_index_enabled or self._fused_qkv_index is not None:
            return
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

        qp, ip = self.qkv_proj, self.index_qkv_proj
        qm = qp.quant_method
        if type(ip.quant_method) is not type(qm):
            return

        is_unquant = isinstance(qm, UnquantizedLinearMethod)
        use_mxfp8 = getattr(qm, "use_mxfp8", False) and hasattr(qp, "weight_scale_inv")
        if not (is_unquant or use_mxfp8):
            return

        weight = torch.cat([qp.weight.data, ip.weight.data], dim=0).contiguous()
        if is_unquant:
            scale = None
        else:
            scale = torch.cat(
                [qp.weight_scale_inv.data, ip.weight_scale_inv.data], dim=0
            ).contiguous()

        holder = _FusedQKVIndexProj(
            qm,
            weight,
            scale,
            getattr(qp, "input_size_per_partition", qp.input_size),
            [qp.output_size_per_partition, ip.output_size_per_partition],
            getattr(qp, "orig_dtype", qp.params_dtype),
        )
        self.add_module("fused_qkv_index_proj", holder)
        self._fused_qkv_index = holder

        # Free the dead originals and drop their quant_method so the loader's
        # post-process loop ignores them (see ``_qm``).
        for m in (qp, ip):
            m.quant_method = None
            for attr in ("weight", "weight_scale_inv"):
                p = getattr(m, attr, None)
                if isinstance(p, nn.Parameter):
                    p.data = torch.empty(0, dtype=p.dtype, device=p.data.device)

    def _qknorm_groups(self):
        weights = (
            self.q_norm.weight,
            self.k_norm.weight,
            self.index_q_norm.weight,
            self.index_k_norm.weight,
        )
        return [
            (w, off, cnt) for w, (off, cnt) in zip(weights, self._qknorm_group_meta)
        ]

    def _can_use_rocm_sparse_qk_index_norm_rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        idx_q: torch.Tensor,
        idx_k: torch.Tensor,
    ) -> bool:
        return (
            self._can_use_rocm_sparse_qk_index_norm_rope_static
            and positions.dim() == 1
            and q.dim() == 2
            and k.dim() == 2
            and idx_q.dim() == 2
            and idx_k.dim() == 2
            and q.dtype in (torch.bfloat16, torch.float16)
            and k.dtype == q.dtype
            and idx_q.dtype == q.dtype
            and idx_k.dtype == q.dtype
        )

    def _sparse_qk_index_norm_rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        idx_q: torch.Tensor,
        idx_k: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._can_use_rocm_sparse_qk_index_norm_rope(positions, q, k, idx_q, idx_k):
            return sparse_qk_index_gemma_rmsnorm_rope(
                q,
                k,
                idx_q,
                idx_k,
                self.q_norm.weight.data,
                self.k_norm.weight.data,
                self.index_q_norm.weight.data,
                self.index_k_norm.weight.data,
                positions,
                self.rotary_emb.cos_sin_cache,
                self.q_norm.variance_epsilon,
                self.head_dim,
                self.rotary_dim,
                self.rotary_emb.is_neox_style,
            )
        q, k = self._qk_norm_rope(positions, q, k)
        idx_q, idx_k = self._index_qk_norm_rope(positions, idx_q, idx_k)
        return q, k, idx_q, idx_k

    @staticmethod
    def _mark_sparse_kv_cached_by_fusion(
        forward_batch: ForwardBatch, layer_id: int
    ) -> None:
        layer_ids = forward_batch.minimax_m3_precached_sparse_layers
        if layer_ids is None:
            layer_ids = set()
            forward_batch.minimax_m3_precached_sparse_layers = layer_ids
        layer_ids.add(layer_id)

    @staticmethod
    def _get_sparse_kv_pool():
        if not has_forward_context():
            return None
        attn_backend = get_forward_context().attn_backend
        sparse_backend = getattr(attn_backend, "sparse", None)
        return getattr(sparse_backend, "kv_pool", None)

    def _get_aiter_cos_sin_cache(self, packed_qkv: torch.Tensor) -> torch.Tensor:
        source = self.rotary_emb.cos_sin_cache
        cached = self._aiter_cos_sin_cache
        if (
            cached is not None
            and cached.dtype == packed_qkv.dtype
            and cached.device == packed_qkv.device
            and cached.shape == source.shape
        ):
            return cached

        cached = source.to(
            device=packed_qkv.device, dtype=packed_qkv.dtype
        ).contiguous()
        if not torch.compiler.is_compiling():
            self._aiter_cos_sin_cache = cached
        return cached

    def _aiter_sparse_qknorm_cache(
        self,
        packed_qkv: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> Optional[
        Tuple[
            torch.Tensor,
            torch.Tensor,
            torch.Tensor,
            torch.Tensor,
            torch.Tensor,
            Optional[torch.Tensor],
        ]
    ]:
        """Run AITER's packed MiniMax-M3 producer with SGLang cache semantics.

        The SGLang contract is page-major NHD storage, unit-scale main FP8, and
        a BF16 index-K cache. The sparse attention consumer reads those caches
        directly, so K/V/index-K tensor outputs are intentionally left raw and
        must not be stored a second time by the backend.
        """
        if not self._can_use_aiter_fused_qknorm_static:
            return None

        kv_pool = self._get_sparse_kv_pool()
        main_pool = getattr(kv_pool, "main_pool", None)
        out_cache_loc = getattr(forward_batch, "out_cache_loc", None)
        if (
            kv_pool is None
            or main_pool is None
            or getattr(main_pool, "kv_cache_layout", None) != "nhd"
            or out_cache_loc is None
            or positions.dim() != 1
            or positions.dtype != torch.int64
            or not positions.is_contiguous()
            or out_cache_loc.dim() != 1
            or out_cache_loc.dtype != torch.int64
            or not out_cache_loc.is_contiguous()
            or packed_qkv.dim() != 2
            or packed_qkv.dtype not in (torch.bfloat16, torch.float16)
        ):
            return None

        num_tokens = packed_qkv.shape[0]
        expected_width = (
            self.num_heads + 2 * self.num_kv_heads + self.num_idx_heads + 1
        ) * self.head_dim
        if (
            packed_qkv.shape[1] != expected_width
            or positions.shape[0] < num_tokens
            or out_cache_loc.shape[0] < num_tokens
        ):
            return None

        layer_id = self.attn.layer_id
        k_cache, v_cache = kv_pool.get_kv_buffer(layer_id)
        idx_k_cache = kv_pool.get_index_k_buffer(layer_id)
        page_size = int(kv_pool.page_size)
        if (
            page_size <= 0
            or k_cache.dim() != 3
            or v_cache.dim() != 3
            or idx_k_cache.dim() != 3
            or not k_cache.is_contiguous()
            or not v_cache.is_contiguous()
            or not idx_k_cache.is_contiguous()
            or k_cache.shape != v_cache.shape
            or k_cache.shape[1:] != (self.num_kv_heads, self.head_dim)
            or idx_k_cache.shape[1:] != (1, self.idx_head_dim)
            or k_cache.shape[0] % page_size != 0
            or idx_k_cache.dtype != packed_qkv.dtype
        ):
            return None

        fp8_e4m3_dtypes = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
        if k_cache.dtype in fp8_e4m3_dtypes:
            kv_cache_dtype = "fp8_e4m3_unit"
        elif k_cache.dtype == packed_qkv.dtype:
            kv_cache_dtype = "auto"
        else:
            return None

        num_blocks = k_cache.shape[0] // page_size
        k_cache_pages = k_cache.view(
            num_blocks, page_size, self.num_kv_heads, self.head_dim
        )
        v_cache_pages = v_cache.view(
            num_blocks, page_size, self.num_kv_heads, self.head_dim
        )
        q_out = torch.empty(
            (num_tokens, self.q_size),
            dtype=packed_qkv.dtype,
            device=packed_qkv.device,
        )
        idx_q_out = torch.empty(
            (num_tokens, self.num_idx_heads * self.idx_head_dim),
            dtype=packed_qkv.dtype,
            device=packed_qkv.device,
        )

        _aiter.fused_qknorm_idxrqknorm(
            packed_qkv.contiguous(),
            self.q_norm.weight.data,
            self.k_norm.weight.data,
            self._get_aiter_cos_sin_cache(packed_qkv),
            positions,
            self.num_heads,
            self.num_kv_heads,
            self.rotary_dim,
            self.q_norm.variance_epsilon,
            self.index_q_norm.weight.data,
            self.index_k_norm.weight.data,
            self.num_idx_heads,
            out_cache_loc,
            k_cache_pages,
            v_cache_pages,
            idx_k_cache,
            page_size,
            q_out,
            idx_q_out,
            out_cache_loc,
            kv_cache_dtype=kv_cache_dtype,
            index_cache_dtype="auto",
            asm_layout=False,
        )

        main_qkv = packed_qkv[:, : self._fused_main_size]
        _, k, v = main_qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        idx_qkv = packed_qkv[:, self._fused_main_size :]
        _, idx_k, idx_v = self._split_index_qkv(idx_qkv)
        self._mark_sparse_kv_cached_by_fusion(forward_batch, layer_id)
        return q_out, k, v, idx_q_out, idx_k, idx_v

    def _sparse_qk_index_norm_rope_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        idx_q: torch.Tensor,
        idx_k: torch.Tensor,
        idx_v: Optional[torch.Tensor],
        forward_batch: ForwardBatch,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        kv_pool = self._get_sparse_kv_pool()
        # The fused kernel writes normed bf16 K/V straight into the paged cache, so an
        # fp8 main K/V cache (--kv-cache-dtype fp8_*) can't use it; fall back to norm+rope.
        main_kv_is_fp8 = kv_pool is not None and kv_pool.dtype in _FP8_KV_DTYPES
        can_use_cache_fusion = (
            not main_kv_is_fp8
            and idx_v is None
            and self._can_use_rocm_sparse_qk_index_norm_rope(
                positions, q, k, idx_q, idx_k
            )
            and getattr(forward_batch, "out_cache_loc", None) is not None
            # V agreeing with K on rank and shape is the kernel's contract, which
            # `sparse_qk_index_gemma_rmsnorm_rope_cache` asserts.
            and v.dtype == q.dtype
        )
        if can_use_cache_fusion and kv_pool is not None:
            layer_id = self.attn.layer_id
            k_cache, v_cache = kv_pool.get_kv_buffer(layer_id)
            idx_k_cache = kv_pool.get_index_k_buffer(layer_id)
            q, k, idx_q, idx_k = sparse_qk_index_gemma_rmsnorm_rope_cache(
                q,
                k,
                v,
                idx_q,
                idx_k,
                k_cache,
                v_cache,
                idx_k_cache,
                forward_batch.out_cache_loc,
                self.q_norm.weight.data,
                self.k_norm.weight.data,
                self.index_q_norm.weight.data,
                self.index_k_norm.weight.data,
                positions,
                self.rotary_emb.cos_sin_cache,
                self.q_norm.variance_epsilon,
                self.head_dim,
                self.rotary_dim,
                self.rotary_emb.is_neox_style,
            )
            self._mark_sparse_kv_cached_by_fusion(forward_batch, layer_id)
            return q, k, idx_q, idx_k
        return self._sparse_qk_index_norm_rope(positions, q, k, idx_q, idx_k)

    def forward_prepare_npu(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ):
        """NPU qkv projection + fused norm/RoPE/split; returns (None, fb, inner_state)."""
        if hidden_states.shape[0] == 0:
            assert not self.o_proj.reduce_results, (
                "short-circuiting allreduce will lead to hangs"
            )
            return hidden_states, forward_batch, None

        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = split_qkv_rmsnorm_rope_pos_cache_half_npu(
            input_tensor=qkv,
            positions=positions.reshape(-1),
            cos_sin_cache=self.rotary_emb.cos_sin_cache,
            q_hidden_size=self.q_size,
            kv_hidden_size=self.kv_size,
            head_dim=self.head_dim,
            eps=self.q_norm.variance_epsilon,
            q_weight=self.q_norm.gemma_weight,
            k_weight=self.k_norm.gemma_weight,
            rope_dim=self.rotary_dim,
            cast_norm_to_bf16=True,
        )
        if self.is_sparse_attention_layer:
            idx_qkv, _ = self.index_qkv_proj(hidden_states)
            # Index attention disables the V head on all M3 sparse layers, so
            # index_qkv_proj emits a 2-way [q|k] tensor.
            idx_q, idx_k, idx_v = self._split_index_qkv(idx_qkv)
            idx_q, idx_k = self._index_qk_norm_rope(positions, idx_q, idx_k)
            inner_state = (q, k, v, idx_q, idx_k, idx_v, forward_batch)
        else:
            inner_state = (q, k, v, forward_batch)
        return None, forward_batch, inner_state

    def forward_prepare(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ):
        fused_out = None
        if self._fused_qkv_index is not None:
            fused_out = self.fused_qkv_index_proj(hidden_states)
            qkv = fused_out[:, : self._fused_main_size]

            aiter_prepared = self._aiter_sparse_qknorm_cache(
                fused_out, positions, forward_batch
            )
            if aiter_prepared is not None:
                q, k, v, idx_q, idx_k, idx_v = aiter_prepared
                inner_state = (q, k, v, idx_q, idx_k, idx_v, forward_batch)
                return None, forward_batch, inner_state

            if self._combined_qknorm_ok:
                groups = self._qknorm_groups()
                if self._fp8_q_epilogue_ok:
                    from sglang.kernels.ops.attention.minimax_qknorm_rope import (
                        minimax_qknorm_rope_grouped_fp8,
                    )

                    num_tokens = fused_out.shape[0]
                    fp8_q = fused_out.new_empty(
                        (num_tokens, self.num_heads, self.head_dim),
                        dtype=torch.float8_e4m3fn,
                    )
                    fp8_idx_q = fused_out.new_empty(
                        (num_tokens, self.num_idx_heads, self.idx_head_dim),
                        dtype=torch.float8_e4m3fn,
                    )
                    minimax_qknorm_rope_grouped_fp8(
                        fused_out,
                        groups,
                        self.rotary_emb.cos_sin_cache,
                        positions,
                        self.q_norm.variance_epsilon,
                        fp8_a=fp8_q,
                        group_a=_QKNORM_GROUP_MAIN_Q,
                        fp8_b=fp8_idx_q,
                        group_b=_QKNORM_GROUP_INDEX_Q,
                    )
                else:
                    from sglang.kernels.ops.attention.minimax_qknorm_rope import (
                        minimax_qknorm_rope_grouped,
                    )

                    minimax_qknorm_rope_grouped(
                        fused_out,
                        groups,
                        self.rotary_emb.cos_sin_cache,
                        positions,
                        self.q_norm.variance_epsilon,
                    )
                    fp8_q = fp8_idx_q = None
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                idx_qkv = fused_out[:, self._fused_main_size :]
                idx_q, idx_k, idx_v = self._split_index_qkv(idx_qkv)
                if fp8_q is not None:
                    # The backend's `.to(float8_e4m3fn)` is a no-op on these, so
                    # the two Q cast kernels disappear without a backend change.
                    q, idx_q = fp8_q, fp8_idx_q
                inner_state = (q, k, v, idx_q, idx_k, idx_v, forward_batch)
                return None, forward_batch, inner_state
        else:
            qkv, _ = self.qkv_proj(hidden_states)

        if self._use_fused_qknorm_rope:
            from sglang.kernels.ops.attention.minimax_qknorm_rope import (
                minimax_qknorm_rope,
            )

            minimax_qknorm_rope(
                qkv,
                self.q_norm.weight,
                self.k_norm.weight,
                self.rotary_emb.cos_sin_cache,
                positions,
                self.num_heads,
                self.num_kv_heads,
                self.num_kv_heads,
                self.q_norm.variance_epsilon,
            )
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            main_qk_already_normed = True
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            main_qk_already_normed = False

        if self.is_sparse_attention_layer:
            if fused_out is not None:
                idx_qkv = fused_out[:, self._fused_main_size :]
            else:
                idx_qkv, _ = self.index_qkv_proj(hidden_states)

            if main_qk_already_normed:
                use_fused_index_norm_rope = (
                    self._use_fused_qknorm_rope
                    and self.idx_head_dim == 128
                    and self.index_rotary_emb.cos_sin_cache.dtype == torch.float32
                )
                if use_fused_index_norm_rope:
                    from sglang.kernels.ops.attention.minimax_qknorm_rope import (
                        minimax_qknorm_rope,
                    )

                    minimax_qknorm_rope(
                        idx_qkv,
                        self.index_q_norm.weight,
                        self.index_k_norm.weight,
                        self.index_rotary_emb.cos_sin_cache,
                        positions,
                        self.num_idx_heads,
                        1,
                        0 if self.disable_index_value else 1,
                        self.index_q_norm.variance_epsilon,
                    )
                    idx_q, idx_k, idx_v = self._split_index_qkv(idx_qkv)
                else:
                    idx_q, idx_k, idx_v = self._split_index_qkv(idx_qkv)
                    idx_q, idx_k = self._index_qk_norm_rope(positions, idx_q, idx_k)
            else:
                idx_q, idx_k, idx_v = self._split_index_qkv(idx_qkv)
                q, k, idx_q, idx_k = self._sparse_qk_index_norm_rope_cache(
                    positions, q, k, v, idx_q, idx_k, idx_v, forward_batch
                )

            inner_state = (q, k, v, idx_q, idx_k, idx_v, forward_batch)
        else:
            if not main_qk_already_normed:
                q, k = self._qk_norm_rope(positions, q, k)
            inner_state = (q, k, v, forward_batch)
        return None, forward_batch, inner_state

    def forward_core(self, intermediate_state):
        _, _, inner_state = intermediate_state

        if self.is_sparse_attention_layer:
            q, k, v, idx_q, idx_k, idx_v, forward_batch = inner_state
            q = q.view(q.shape[0], self.num_heads, self.head_dim)
            k = k.view(k.shape[0], self.num_kv_heads, self.head_dim)
            v = v.view(v.shape[0], self.num_kv_heads, self.head_dim)
            idx_q = idx_q.reshape(idx_q.shape[0], self.num_idx_heads, self.idx_head_dim)
            idx_k = idx_k.reshape(idx_k.shape[0], 1, self.idx_head_dim)
            if idx_v is not None:
                idx_v = idx_v.reshape(idx_v.shape[0], 1, self.idx_head_dim)
            idx_o, attn_output = self.attn(
                q, k, v, forward_batch, idx_q=idx_q, idx_k=idx_k, idx_v=idx_v
            )
            output, _ = self.o_proj(attn_output)
            if self.disable_index_value:
                return output
            # Pre-divide idx_o (not the weight) so the TP all-reduce sums right.
            if self.idx_replica_size > 1:
                idx_o = idx_o / self.idx_replica_size
            idx_output, _ = self.index_o_proj(idx_o)
            return output + idx_output

        q, k, v, forward_batch = inner_state
        attn_output = self.attn(q, k, v, forward_batch)
        output, _ = self.o_proj(attn_output)
        return output

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if _is_npu:
            s = self.forward_prepare_npu(
                positions=positions,
                hidden_states=hidden_states,
                forward_batch=forward_batch,
            )
        else:
            s = self.forward_prepare(
                positions=positions,
                hidden_states=hidden_states,
                forward_batch=forward_batch,
            )
        return self.forward_core(s)


def _uses_push_plane_fusion() -> bool:
    """Fuse each TP boundary into one push-plane kernel (cluster launch: SM90+)."""
    parallel = get_parallel()
    return bool(
        _is_cuda
        and get_platform().device_sm >= 90
        and parallel.attn_tp_size == parallel.tp_size
        and parallel.attn_cp_size == 1
        and parallel.pp_size == 1
        and not is_dp_attention_enabled()
        and not is_dense_ffn_fully_dp()
        and get_moe_a2a_backend().is_none()
    )


class MiniMaxM3DecoderLayer(nn.Module):
    attention_cls = MiniMaxM3Attention

    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        quant_config: Optional[QuantizationConfig] = None,
        alt_stream: Optional[torch.cuda.Stream] = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.layer_id = layer_id

        sparse_attention_config = getattr(config, "sparse_attention_config", None)
        if sparse_attention_config is not None:
            _, sparse_layer_ids = get_minimax_sparse_layer_ids(sparse_attention_config)
            is_sparse_attention_layer = layer_id in sparse_layer_ids
            disable_value_layer_ids = set(
                get_minimax_sparse_disable_value_layer_ids(sparse_attention_config)
            )
            disable_index_value = layer_id in disable_value_layer_ids
        else:
            is_sparse_attention_layer = False
            disable_index_value = False

        self.self_attn = self.attention_cls(
            config=config,
            layer_id=layer_id,
            quant_config=quant_config,
            prefix=add_prefix("self_attn", prefix),
            is_sparse_attention_layer=is_sparse_attention_layer,
            disable_index_value=disable_index_value,
        )

        # Means "MLP is a sparse MoE", not attention sparsity. Kept as ``is_layer_sparse``
        # because model construction and downstream integrations read this attr.
        self.is_layer_sparse = self._is_layer_sparse(config, layer_id)

        if self.is_layer_sparse:
            self.mlp = MiniMaxM3MoE(
                config=config,
                layer_id=layer_id,
                quant_config=quant_config,
                alt_stream=alt_stream,
                prefix=add_prefix("mlp", prefix),
            )
        else:
            mlp_parallel_group = "replicated" if is_dense_ffn_fully_dp() else "tp"
            self.mlp = MiniMaxM3MLP(
                config=config,
                quant_config=quant_config,
                prefix=add_prefix("mlp", prefix),
                intermediate_size=config.dense_intermediate_size,
                parallel_group=mlp_parallel_group,
                reduce_results=False,
            )

        self.use_gemma_norm = getattr(config, "use_gemma_norm", False)
        if self.use_gemma_norm:
            self.input_layernorm = GemmaRMSNorm(
                config.hidden_size, eps=config.rms_norm_eps
            )
            self.post_attention_layernorm = GemmaRMSNorm(
                config.hidden_size, eps=config.rms_norm_eps
            )
        else:
            self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(
                config.hidden_size, eps=config.rms_norm_eps
            )

        options = {}
        if _uses_push_plane_fusion():
            from sglang.srt.layers.layer_boundary.fusions.custom_all_reduce_fusion import (
                CustomAllReduceFusion,
            )

            options["fusions"] = CustomAllReduceFusion(
                hidden_size=config.hidden_size,
                defers_finalize=self.is_layer_sparse
                and self.mlp.supports_deferred_finalize,
            )
        attn, ffn = self.stage_facts(config, layer_id)
        self.attn_boundary, self.ffn_boundary = append_stages(
            (attn, self.input_layernorm, options),
            (ffn, self.post_attention_layernorm, options),
        )

    @classmethod
    def stage_facts(cls, config: PretrainedConfig, layer_id: int):
        """The stages the layer at ``layer_id`` declares, in order: the model's
        shared declaration function, which the layer declares with too (see
        make_layers)."""
        return (
            declare_attn(),
            declare_ffn(
                sparse=cls._is_layer_sparse(config, layer_id),
                next_layer_sparse=cls._is_next_layer_sparse(config, layer_id),
            ),
        )

    @staticmethod
    def _is_layer_sparse(config: PretrainedConfig, layer_id: int) -> bool:
        moe_layer_freq = getattr(config, "moe_layer_freq", None)
        return moe_layer_freq[layer_id] != 0 if moe_layer_freq is not None else True

    @staticmethod
    def _is_next_layer_sparse(config: PretrainedConfig, layer_id: int) -> bool:
        moe_layer_freq = getattr(config, "moe_layer_freq", None)
        lid = layer_id + 1
        if moe_layer_freq is None:
            return True
        if lid < 0 or lid >= config.num_hidden_layers:
            return True
        return moe_layer_freq[lid] != 0

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        captured_last_layer_outputs: Optional[AuxHiddenStateAccumulator] = None,
        **kwargs,
    ) -> torch.Tensor:
        hidden_states = self.attn_boundary.prepare(
            hidden_states,
            forward_batch,
            capture_gathered=captured_last_layer_outputs,
            **kwargs,
        )

        if hidden_states.shape[0] != 0:
            hidden_states = self.self_attn(
                positions=positions,
                hidden_states=hidden_states,
                forward_batch=forward_batch,
            )

        hidden_states = self.attn_boundary.finish(hidden_states, forward_batch)
        hidden_states = self.ffn_boundary.prepare(hidden_states, forward_batch)

        with self.ffn_boundary.exit(forward_batch) as ffn_exit:
            if self.is_layer_sparse or hidden_states.shape[0] != 0:
                hidden_states = self.mlp(hidden_states, forward_batch=forward_batch)
        return ffn_exit.finish(hidden_states)


class MiniMaxM3Model(nn.Module):
    """MiniMax Model implementation."""

    fall_back_to_pt_during_load = False

    def __init__(
        self,
        config: PretrainedConfig,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ) -> None:
        super().__init__()

        self.padding_idx = getattr(config, "pad_token_id", 0)
        self.vocab_size = config.vocab_size
        self.pp_group = get_parallel().pp_group
        self.use_gemma_norm = getattr(config, "use_gemma_norm", False)

        if self.pp_group.is_first_rank:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                use_attn_tp_group=is_dp_attention_enabled(),
                prefix=add_prefix("embed_tokens", prefix),
            )
        else:
            self.embed_tokens = PPMissingLayer()

        alt_stream = get_stream("alt") if _is_cuda else None

        def layer_fn(idx, prefix: str) -> nn.Module:
            return MiniMaxM3DecoderLayer(
                config=config,
                layer_id=idx,
                quant_config=quant_config,
                alt_stream=alt_stream,
                prefix=prefix,
            )

        self.layers, self.start_layer, self.end_layer = make_pp_layers(
            config.num_hidden_layers,
            layer_fn,
            prefix=add_prefix("layers", prefix),
            stage_facts=partial(MiniMaxM3DecoderLayer.stage_facts, config),
        )
        if self.pp_group.is_last_rank:
            if self.use_gemma_norm:
                self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            else:
                self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.norm = PPMissingLayer(return_tuple=True)
        self.finalize_norm = None
        if _uses_push_plane_fusion():
            from sglang.srt.layers.layer_boundary.fusions.custom_all_reduce_fusion import (
                install_terminal_finalize,
            )

            self.finalize_norm = install_terminal_finalize(self.layers, self.norm)

        self.layers_to_capture = []

    def get_input_embeddings(self) -> torch.Tensor:
        return self.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor = None,
        pp_proxy_tensors: Optional[PPProxyTensors] = None,
    ) -> Union[torch.Tensor, PPProxyTensors, Tuple[torch.Tensor, list[torch.Tensor]]]:
        if self.pp_group.is_first_rank:
            if input_embeds is None:
                embeds = self.get_input_embeddings()
                hidden_states = embeds(input_ids)
            else:
                hidden_states = input_embeds
            residual_batch.start(forward_batch)
        else:
            assert pp_proxy_tensors is not None
            hidden_states = self.layers[self.start_layer].attn_boundary.from_pp(
                pp_proxy_tensors, forward_batch
            )

        aux_hidden_states = AuxHiddenStateList()
        if forward_batch.can_run_tbo:
            hidden_states = model_forward_stages(
                layers=self.layers,
                enable_tbo=True,
                positions=positions,
                forward_batch=forward_batch,
                hidden_states=hidden_states,
            )
        else:
            for i in range(self.start_layer, self.end_layer):
                # NOTE: torch dynamo does not support graph break in context manager
                ctx = (
                    nullcontext()
                    if (
                        check_cuda_graph_backend(Phase.PREFILL, Backend.TC_PIECEWISE)
                        or is_in_breakable_cuda_graph()
                    )
                    else get_global_expert_distribution_recorder().with_current_layer(i)
                )
                with ctx:
                    layer = self.layers[i]
                    hidden_states = layer(
                        positions=positions,
                        forward_batch=forward_batch,
                        hidden_states=hidden_states,
                        captured_last_layer_outputs=aux_hidden_states
                        if getattr(layer, "_is_layer_to_capture", False)
                        else None,
                    )

        if not self.pp_group.is_last_rank:
            return residual_batch.to_pp(hidden_states, forward_batch)
        hidden_states = residual_batch.final_norm(
            hidden_states,
            forward_batch,
            self.norm,
            finalize_norm=self.finalize_norm,
            # The DSpark draft reads the last layer's updated residual.
            capture=aux_hidden_states.capture
            if self.end_layer in self.layers_to_capture
            else None,
            skip_empty=True,
        )

        if len(aux_hidden_states) == 0:
            return hidden_states
        return hidden_states, aux_hidden_states


class MiniMaxM3SparseForCausalLM(nn.Module):
    hf_to_sglang_mapper = WeightsMapper(
        orig_to_new_substr={".block_sparse_moe.": ".mlp."}
    )
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        # no index_v_proj in the M3 checkpoint
        "index_qkv_proj": ["index_q_proj", "index_k_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(
        self,
        config: PretrainedConfig,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ) -> None:
        super().__init__()

        self.config = config
        self.quant_config = quant_config
        self.pp_group = get_parallel().pp_group

        # The weight loader reads this after the build.
        self.num_fused_shared_experts = get_num_fused_shared_experts()
        if self.num_fused_shared_experts:
            log_info_on_rank0(logger, "Shared experts fusion optimization enabled.")

        self.model = MiniMaxM3Model(
            config, quant_config, prefix=add_prefix("model", prefix)
        )

        if self.pp_group.is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=quant_config,
                prefix=add_prefix("lm_head", prefix),
                use_attn_tp_group=get_parallel().enable_dp_lm_head,
            )

            self.logits_processor = LogitsProcessor(config)
        else:
            self.lm_head = PPMissingLayer()

        self.capture_aux_hidden_states = False

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    @classmethod
    def shared_experts_fusion_disable_reason(cls, hf_config, quant_config):
        """Why this checkpoint cannot fuse its shared expert, or None. Asked by
        the loader before any layer is built."""
        if not getattr(hf_config, "n_shared_experts", None):
            return "No shared experts are defined in the config."
        if quant_config is not None and quant_config.get_name() in (
            "modelopt_mixed",
            "minimax_m3_nvfp4",
        ):
            return (
                "Shared and routed experts may use different quantization formats "
                "in mixed-precision checkpoints."
            )
        if not (_is_cuda or _is_hip):
            return "Shared experts fusion currently requires CUDA or ROCm devices."
        if _is_cuda and (_device_sm is not None) and (_device_sm < 80):
            return "Shared experts fusion requires SM80 or newer GPUs."
        if _is_hip and not _is_gfx95_supported:
            return "Shared experts fusion on ROCm is validated on gfx950 only."
        if get_parallel().moe_ep_size > 1:
            return "Shared experts fusion is not supported together with expert parallelism yet."
        if get_moe_a2a_backend().is_deepep():
            return "Shared experts fusion is not supported when Deepep MoE backend is enabled."
        return None

    @classmethod
    def num_fusable_shared_experts(cls, hf_config) -> int:
        """Shared experts fused as routed slots when fusion is on."""
        assert hf_config.n_shared_experts == 1, (
            "Only 1 fused shared expert is supported for MiniMax-M3"
        )
        return hf_config.n_shared_experts

    def set_eagle3_layers_to_capture(self, layer_ids: Optional[list[int]] = None):
        if not self.pp_group.is_last_rank:
            return

        self.capture_aux_hidden_states = True
        if layer_ids is None:
            num_layers = self.config.num_hidden_layers
            self.model.layers_to_capture = [
                2,
                num_layers // 2,
                num_layers - 3,
            ]
        else:
            self.model.layers_to_capture = [val + 1 for val in layer_ids]

        # forward checks the per-layer ``_is_layer_to_capture`` flag, not the id
        # list, so set it explicitly (mirrors qwen3_next/qwen2_moe).
        for layer_id in self.model.layers_to_capture:
            if 0 <= layer_id < len(self.model.layers):
                setattr(self.model.layers[layer_id], "_is_layer_to_capture", True)

    def get_embed_and_head(self):
        return self.model.embed_tokens.weight, self.lm_head.weight

    def precompile_kernels_after_loading(self) -> None:
        if _uses_push_plane_fusion():
            from sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe import (
                register_fused_all_reduce_comm,
            )

            # Decode and verify batches up to 341 rows at hidden 6144.
            register_fused_all_reduce_comm(
                max_push_size=4 * 1024 * 1024, max_push_blocks=512
            )

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
            input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors
        )

        aux_hidden_states = None
        if self.capture_aux_hidden_states:
            hidden_states, aux_hidden_states = hidden_states

        if self.pp_group.is_last_rank:
            return self.logits_processor(
                input_ids, hidden_states, self.lm_head, forward_batch, aux_hidden_states
            )
        else:
            return hidden_states

    @property
    def start_layer(self):
        return self.model.start_layer

    @property
    def end_layer(self):
        return self.model.end_layer

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        """Load model weights with proper mapping for MiniMax architecture."""

        stacked_params_mapping = [
            # Leading "." on ".qkv_proj" prevents it from falsely matching the sparse
            # index_q/k/v_proj weights (remapped separately below).
            (".qkv_proj", ".q_proj", "q"),
            (".qkv_proj", ".k_proj", "k"),
            (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0),
            (".gate_up_proj", ".up_proj", 1),
        ]

        # Value-disabled layers have no ".index_v_proj" weight, so that entry never matches.
        if getattr(self.config, "sparse_attention_config", None) is not None:
            stacked_params_mapping += [
                (".index_qkv_proj", ".index_q_proj", "q"),
                (".index_qkv_proj", ".index_k_proj", "k"),
                (".index_qkv_proj", ".index_v_proj", "v"),
            ]

        expert_params_mapping = FusedMoE.make_expert_params_mapping(
            ckpt_gate_proj_name="w1",
            ckpt_down_proj_name="w2",
            ckpt_up_proj_name="w3",
            num_experts=self.config.num_local_experts + self.num_fused_shared_experts,
        )

        params_dict = dict(self.named_parameters())
        loaded_params: Set[str] = set()
        for name, loaded_weight in weights:
            layer_id = get_layer_id(name)
            if layer_id is not None and (
                layer_id < self.model.start_layer or layer_id >= self.model.end_layer
            ):
                continue

            name = name.replace(".block_sparse_moe", ".mlp")

            if self.num_fused_shared_experts > 0 and "mlp.shared_experts" in name:
                name = name.replace(
                    "mlp.shared_experts",
                    f"mlp.experts.{self.config.num_local_experts}",
                )
                name = name.replace("gate_proj", "w1")
                name = name.replace("down_proj", "w2")
                name = name.replace("up_proj", "w3")

            if "rotary_emb.inv_freq" in name:
                continue

            spec_layer = get_spec_layer_idx_from_weight_name(self.config, name)
            if spec_layer is not None:
                continue

            for param_name, weight_name, shard_id in stacked_params_mapping:
                if weight_name not in name:
                    continue
                # Must skip experts before the name.replace below, else gate_proj ->
                # gate_up_proj -> gate_gate_up_proj double-remap breaks load.
                if "mlp.experts." in name:
                    continue
                name = name.replace(weight_name, param_name)
                if name.endswith(".bias") and name not in params_dict:
                    continue
                if name not in params_dict:
                    continue

                param = params_dict[name]
                weight_loader = param.weight_loader
                weight_loader(param, loaded_weight, shard_id)
                break
            else:
                is_expert_weight = False

                for mapping in expert_params_mapping:
                    param_name, weight_name, expert_id, shard_id = mapping
                    if weight_name not in name:
                        continue

                    is_expert_weight = True

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
                    if is_expert_weight:
                        continue

                    if name.endswith(".bias") and name not in params_dict:
                        continue

                    name = maybe_remap_kv_scale_name(name, params_dict)
                    if name is None:
                        continue

                    if name in params_dict:
                        param = params_dict[name]
                        weight_loader = getattr(
                            param, "weight_loader", default_weight_loader
                        )
                        try:
                            weight_loader(param, loaded_weight)
                        except Exception as e:
                            logger.warning(f"Error loading weight {name}: {e}")
                            continue
                    else:
                        logger.warning(f"Parameter {name} not found in params_dict")
            loaded_params.add(name)

        # Run before the loader's process pass: the raw fp8 weight + uint8 scale are
        # final here (mxfp8 post-process only derives the packed scale, not these).
        build_minimax_fused_qkv_index(self)
        return loaded_params

    @classmethod
    def get_model_config_for_expert_location(cls, config):
        from sglang.srt.eplb.expert_location import ModelConfigForExpertLocation

        return ModelConfigForExpertLocation(
            num_layers=config.num_hidden_layers,
            num_logical_experts=config.num_local_experts,
            num_groups=None,
        )


def get_spec_layer_idx_from_weight_name(
    config: PretrainedConfig, weight_name: str
) -> Optional[int]:
    if weight_name.startswith("model.dspark."):
        return config.num_hidden_layers
    # M3 checkpoints emit MTP weights as model.mtp.layers.{i}.*; skip them here
    # (no NextN module is built for the main model).
    if hasattr(config, "num_mtp_modules") and (config.num_mtp_modules > 0):
        for i in range(config.num_mtp_modules):
            if weight_name.startswith(f"model.mtp.layers.{i}."):
                return config.num_hidden_layers + i
    return None


EntryClass = [MiniMaxM3SparseForCausalLM]
