# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Copyright 2023-2025 SGLang Team
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
# Adapted from https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/models/nemotron_h.py

"""Inference-only NemotronH model."""

from collections.abc import Iterable
from functools import lru_cache, partial

import torch
from torch import nn

from sglang.srt.compilation.compilation_config import register_split_op
from sglang.srt.configs import NemotronHConfig
from sglang.srt.configs.nemotron_h import ATTENTION, MAMBA, MLP, MOE
from sglang.srt.environ import envs
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.eplb.expert_location import ModelConfigForExpertLocation
from sglang.srt.layers.activation import ReLU2
from sglang.srt.layers.attention.hybrid_linear_attn_backend import (
    HybridLinearAttnBackend,
    Mamba2AttnBackend,
)
from sglang.srt.layers.attention.mamba.mamba import MambaMixer2
from sglang.srt.layers.dp_attention import (
    is_dp_attention_enabled,
)
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    LinearParallelGroup,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.moe.topk import TopK
from sglang.srt.layers.moe.utils import (
    RoutingMethodType,
    filter_moe_weight_param_global_expert,
    get_moe_a2a_backend,
)
from sglang.srt.layers.quantization import QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.utils import PPMissingLayer, get_layer_id
from sglang.srt.layers.vocab_parallel_embedding import (
    DEFAULT_VOCAB_PADDING_SIZE,
    ParallelLMHead,
    VocabParallelEmbedding,
)
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    PPProxyTensors,
)
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.model_executor.runner import get_is_capture_mode
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
    eager_on_graph,
    is_in_breakable_cuda_graph,
)
from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (
    get_tc_piecewise_forward_context,
    is_in_tc_piecewise_cuda_graph,
)
from sglang.srt.model_loader.weight_utils import (
    default_weight_loader,
    maybe_remap_kv_scale_name,
    replace_prefix,
    replace_substrings,
)
from sglang.srt.models.nemotron_h_utils import make_stage_boundary, stage_facts
from sglang.srt.models.utils import WeightsMapper
from sglang.srt.runtime_context import get_exec, get_model, get_parallel, get_schedule
from sglang.srt.utils import (
    LazyValue,
    add_prefix,
    get_current_device_stream_fast,
    is_cuda,
    is_sm120,
    make_pp_layers,
)
from sglang.srt.utils.custom_op import register_custom_op
from sglang.utils import logger

_is_cuda = is_cuda()

if _is_cuda:
    from sglang.kernels.ops.gemm.fused_a_gemm import (
        fused_a_gemm_weight_eligible,
        linear_with_fused_a_gemm,
    )


class NemotronHMLP(nn.Module):
    def __init__(
        self,
        config: NemotronHConfig,
        intermediate_size: int,
        quant_config: QuantizationConfig | None = None,
        bias: bool = False,
        reduce_results: bool = True,
        prefix: str = "",
        *,
        parallel_group: LinearParallelGroup = "tp",
    ) -> None:
        super().__init__()

        self.up_proj = ColumnParallelLinear(
            input_size=config.hidden_size,
            output_size=intermediate_size,
            bias=bias,
            quant_config=quant_config,
            parallel_group=parallel_group,
            prefix=f"{prefix}.up_proj",
        )
        self.down_proj = RowParallelLinear(
            input_size=intermediate_size,
            output_size=config.hidden_size,
            bias=bias,
            quant_config=quant_config,
            reduce_results=reduce_results,
            parallel_group=parallel_group,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = ReLU2()

    def forward(
        self,
        x: torch.Tensor,
    ):
        x, _ = self.up_proj(x)
        x = self.act_fn(x)
        x, _ = self.down_proj(x)
        return x


_alt_stream = None


def _get_or_create_alt_stream(device_module):
    global _alt_stream
    if _alt_stream is None:
        _alt_stream = device_module.Stream()
    return _alt_stream


@lru_cache(maxsize=None)
def _prefill_shared_expert_pool(device_index: int):
    # Shared experts overlap the main graph, so their intermediates must use
    # a separate pool. Calls on the shared stream are ordered across layers.
    with torch.cuda.device(device_index):
        return torch.cuda.graph_pool_handle()


class _PrefillSharedExpertCall:
    def __init__(self, stream):
        self.graph = None
        self.stream = stream
        self.ready = torch.cuda.Event(external=True)
        self.done = torch.cuda.Event(external=True)
        self.output = None

    def launch(self, module, hidden_states) -> None:
        main_stream = torch.cuda.current_stream()
        with torch.cuda.stream(self.stream):
            if self.graph is None:
                # BCG warmup follows the same dependencies, without capture.
                self.ready.wait()
                self.output = module(hidden_states)
                self.done.record()
                self.output.record_stream(main_stream)
            else:
                self.graph.replay()


def _capture_prefill_shared_expert(module, hidden_states, call) -> None:
    call.graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(
        call.graph,
        pool=_prefill_shared_expert_pool(hidden_states.device.index),
        stream=call.stream,
    ):
        call.ready.wait()
        call.output = module(hidden_states)
        call.done.record()
    # The ready record belongs to the preceding main-stream graph. Do not
    # replay here: that graph has only been captured, not launched yet.


@eager_on_graph(True, capture_stub=_capture_prefill_shared_expert)
def _launch_prefill_shared_expert(module, hidden_states, call) -> None:
    # BCG retains this call, its graph, events and output until graph cleanup.
    # A replay launches on the same explicit stream for every layer.
    call.launch(module, hidden_states)


def _latent_proj_fuses_shared_add(projection: nn.Module) -> bool:
    return (
        # LoRA swaps a wrapper module over this attribute after init,
        # and a subclass may override forward; exact type excludes both.
        type(projection) is ReplicatedLinear
        # Without a bias, ReplicatedLinear.forward is a bare quant_method.apply.
        and projection.bias is None
        and isinstance(projection.quant_method, UnquantizedLinearMethod)
    )


def _publishes_weight_storage() -> bool:
    # Transfer-engine seeds and ModelExpress instances publish parameter
    # addresses for remote readers right after weight loading.
    model_config = get_model()
    return (
        model_config.remote_instance_weight_loader_start_seed_via_transfer_engine
        or (
            model_config.load_format == "remote_instance"
            and model_config.remote_instance_weight_loader_backend == "modelexpress"
        )
    )


class NemotronHMoE(nn.Module):
    def __init__(
        self,
        config: NemotronHConfig,
        layer_idx: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        is_nextn: bool = False,
    ) -> None:
        super().__init__()

        self.layer_id = layer_idx
        self.is_nextn = is_nextn
        self.routed_scaling_factor = config.routed_scaling_factor
        self.device_module = torch.get_device_module()

        self.ep_group = get_parallel().moe_ep_group.device_group
        self.ep_rank = self.ep_group.rank()
        self.ep_size = self.ep_group.size()
        self.n_routed_experts = config.n_routed_experts
        self.n_shared_experts = config.n_shared_experts
        self.use_latent_moe = getattr(config, "moe_latent_size", None) is not None
        self.moe_hidden_size = (
            config.moe_latent_size if self.use_latent_moe else config.hidden_size
        )

        self.gate = ReplicatedLinear(
            config.hidden_size,
            config.n_routed_experts,
            bias=False,
            quant_config=None,
            prefix=f"{prefix}.gate",
        )
        self.gate.e_score_correction_bias = nn.Parameter(
            torch.empty(config.n_routed_experts, dtype=torch.float32)
        )

        self.experts = get_moe_impl_class(quant_config)(
            num_experts=config.n_routed_experts
            + get_exec().moe.ep_num_redundant_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=self.moe_hidden_size,
            intermediate_size=config.moe_intermediate_size,
            reduce_results=False,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            activation=config.mlp_hidden_act,
            layer_id=layer_idx,
            is_gated=False,
            routing_method_type=RoutingMethodType.DeepSeekV3,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        self.topk = TopK(
            top_k=config.num_experts_per_tok,
            layer_id=layer_idx,
            use_grouped_topk=True,
            topk_group=config.topk_group,
            num_expert_group=config.n_group,
            renormalize=config.norm_topk_prob,
            scoring_func="sigmoid",
            correction_bias=self.gate.e_score_correction_bias,
            routed_scaling_factor=self.routed_scaling_factor,
            apply_routed_scaling_factor_on_output=self.experts.should_fuse_routed_scaling_factor_in_topk,
        )
        self.topk.bind_runner_backend(
            self.experts.runner_backend,
            routing_method_type=self.experts.routing_method_type,
        )
        if config.n_shared_experts:
            self.shared_experts = NemotronHMLP(
                config,
                intermediate_size=config.moe_shared_expert_intermediate_size
                * config.n_shared_experts,
                quant_config=quant_config,
                reduce_results=False,
                **(
                    dict(parallel_group="replicated")
                    if get_moe_a2a_backend().is_deepep()
                    or get_moe_a2a_backend().is_flashinfer()
                    or get_moe_a2a_backend().is_flashinfer_megamoe()
                    else {}
                ),
                prefix=f"{prefix}.shared_experts",
            )
        else:
            self.shared_experts = None

        if self.use_latent_moe:
            self.fc1_latent_proj = ReplicatedLinear(
                input_size=config.hidden_size,
                output_size=self.moe_hidden_size,
                bias=config.mlp_bias,
                quant_config=quant_config,
                prefix=f"{prefix}.fc1_latent_proj",
            )
            self.fc2_latent_proj = ReplicatedLinear(
                input_size=self.moe_hidden_size,
                output_size=config.hidden_size,
                bias=config.mlp_bias,
                quant_config=quant_config,
                prefix=f"{prefix}.fc2_latent_proj",
            )
        else:
            self.fc1_latent_proj = None
            self.fc2_latent_proj = None

        self._use_min_latency_fc1_gemm: bool | None = None

    def _apply_fc1_latent_proj(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._use_min_latency_fc1_gemm is None:
            self._use_min_latency_fc1_gemm = (
                self.use_latent_moe
                and self.fc1_latent_proj is not None
                and _is_cuda
                and fused_a_gemm_weight_eligible(self.fc1_latent_proj)
            )
        if self._use_min_latency_fc1_gemm:
            return linear_with_fused_a_gemm(self.fc1_latent_proj, hidden_states)
        return self.fc1_latent_proj(hidden_states)[0]

    def _forward_core(
        self,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if (
            forward_batch is not None
            and forward_batch.forward_mode == ForwardMode.EXTEND
            and hidden_states.shape == (1024, 4096)
            and hidden_states.dtype == torch.bfloat16
            and get_parallel().tp_size == self.ep_size == 1
            and self.n_routed_experts == 512
            and self.moe_hidden_size == 1024
            and self.shared_experts is not None
            and is_in_breakable_cuda_graph()
            and is_sm120()
        ):
            return self._forward_core_prefill_overlap(hidden_states)
        if _is_cuda and (
            not get_moe_a2a_backend().is_flashinfer() or get_is_capture_mode()
        ):
            return self._forward_core_shared_routed_overlap(hidden_states)
        return self._forward_core_normal(hidden_states)

    def _forward_core_normal(
        self,
        hidden_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # router_scores: [num_tokens, num_experts]
        # bf16 gemm on tensor cores with fp32 accumulation/output for sigmoid/topk.
        router_logits = torch.mm(
            hidden_states, self.gate.weight.t(), out_dtype=torch.float32
        )
        if self.shared_experts is not None:
            shared_output = self.shared_experts(hidden_states)
        else:
            shared_output = None
        topk_output = self.topk(
            hidden_states,
            router_logits,
        )
        if self.use_latent_moe:
            hidden_states = self._apply_fc1_latent_proj(hidden_states)
        final_hidden_states = self.experts(hidden_states, topk_output)
        return final_hidden_states, shared_output

    def _forward_core_shared_routed_overlap(
        self,
        hidden_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        alt_stream = _get_or_create_alt_stream(self.device_module)

        alt_stream.wait_stream(get_current_device_stream_fast())

        if self.shared_experts is not None:
            shared_output = self.shared_experts(hidden_states)
        else:
            shared_output = None

        with self.device_module.stream(alt_stream):
            # router_scores: [num_tokens, num_experts]
            # bf16 gemm on tensor cores with fp32 accumulation/output for sigmoid/topk.
            router_logits = torch.mm(
                hidden_states, self.gate.weight.t(), out_dtype=torch.float32
            )
            topk_output = self.topk(
                hidden_states,
                router_logits,
            )
            if self.use_latent_moe:
                hidden_states = self._apply_fc1_latent_proj(hidden_states)
            final_hidden_states = self.experts(hidden_states, topk_output)
        get_current_device_stream_fast().wait_stream(alt_stream)

        return final_hidden_states, shared_output

    def _forward_core_prefill_overlap(
        self,
        hidden_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A multi-stream graph per hybrid segment creates one internal stream
        # per executable. Keep each graph linear and launch shared experts on
        # one explicit stream, preserving overlap with the routed experts.
        call = _PrefillSharedExpertCall(_get_or_create_alt_stream(self.device_module))
        call.ready.record()
        _launch_prefill_shared_expert(self.shared_experts, hidden_states, call)
        shared_output = call.output
        router_logits = torch.mm(
            hidden_states, self.gate.weight.t(), out_dtype=torch.float32
        )
        topk_output = self.topk(
            hidden_states,
            router_logits,
        )
        if self.use_latent_moe:
            hidden_states = self._apply_fc1_latent_proj(hidden_states)
        final_hidden_states = self.experts(hidden_states, topk_output)
        call.done.wait()
        return final_hidden_states, shared_output

    def get_moe_weights(self) -> list[torch.Tensor]:
        return [
            x.data
            for name, x in self.experts.named_parameters()
            if name not in ["correction_bias"]
            and filter_moe_weight_param_global_expert(
                name, x, self.experts.num_local_experts
            )
        ]

    def _apply_latent_projection(
        self,
        final_hidden_states: torch.Tensor,
        shared_output: torch.Tensor | None,
    ) -> torch.Tensor:
        projection = self.fc2_latent_proj
        if shared_output is not None and _latent_proj_fuses_shared_add(projection):
            return projection.quant_method.apply_with_addend(
                projection, final_hidden_states, addend=shared_output
            )

        final_hidden_states, _ = projection(final_hidden_states)
        if shared_output is not None:
            final_hidden_states += shared_output
        return final_hidden_states

    def forward(
        self,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch | None = None,
    ) -> torch.Tensor:
        num_tokens, hidden_dim = hidden_states.shape
        # routed_scaling_factor is fused into the experts call (applied by the
        # MoE runner / topk), so final_hidden_states is already scaled.
        final_hidden_states, shared_output = self._forward_core(
            hidden_states,
            forward_batch=forward_batch,
        )

        if self.use_latent_moe:
            final_hidden_states = self._apply_latent_projection(
                final_hidden_states, shared_output
            )
        elif shared_output is not None:
            final_hidden_states += shared_output

        return final_hidden_states.view(num_tokens, hidden_dim)


class NemotronHMLPLikeDecoderLayer(nn.Module):
    """An FFN (MLP / MoE) stage. Its input is the previous stage's output: a
    mixer's attention partial sum, or a value that is complete or carries the
    sum an FFN before it left."""

    def _init_stage_boundary(self, config: NemotronHConfig, layer_idx: int):
        self.boundary = make_stage_boundary(
            self.norm, pattern=config.hybrid_override_pattern, layer_idx=layer_idx
        )

    def forward(
        self,
        *,
        hidden_states,
        forward_batch: ForwardBatch,
    ):
        hidden_states = self.boundary.prepare(hidden_states, forward_batch)
        hidden_states = self.mixer.forward(hidden_states)
        return self.boundary.finish(hidden_states, forward_batch)


class NemotronHMLPDecoderLayer(NemotronHMLPLikeDecoderLayer):
    def __init__(
        self,
        config: NemotronHConfig,
        layer_idx: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.config = config

        hybrid_override_pattern = config.hybrid_override_pattern
        mlp_index = hybrid_override_pattern[: layer_idx + 1].count("-") - 1
        self.layer_idx = layer_idx
        if isinstance(config.intermediate_size, list):
            if len(config.intermediate_size) == 1:
                intermediate_size = config.intermediate_size[0]
            else:
                intermediate_size = config.intermediate_size[mlp_index]
        else:
            intermediate_size = config.intermediate_size

        self.mixer = NemotronHMLP(
            config,
            intermediate_size=intermediate_size,
            quant_config=quant_config,
            bias=config.mlp_bias,
            prefix=f"{prefix}.mixer",
            reduce_results=False,
        )

        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self._init_stage_boundary(config, layer_idx)


class NemotronHMoEDecoderLayer(NemotronHMLPLikeDecoderLayer):
    def __init__(
        self,
        config: NemotronHConfig,
        layer_idx: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        is_nextn: bool = False,
    ) -> None:
        super().__init__()
        layer_config = config.get_nemotron_h_config_for_layer(layer_idx)

        self.layer_idx = layer_idx
        self.mixer = NemotronHMoE(
            layer_config,
            layer_idx=layer_idx,
            quant_config=quant_config,
            prefix=f"{prefix}.mixer",
            is_nextn=is_nextn,
        )

        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self._init_stage_boundary(config, layer_idx)

    def forward(
        self,
        *,
        hidden_states,
        forward_batch: ForwardBatch,
    ):
        hidden_states = self.boundary.prepare(hidden_states, forward_batch)
        hidden_states = self.mixer.forward(hidden_states, forward_batch=forward_batch)
        return self.boundary.finish(hidden_states, forward_batch)


class NemotronHAttnLikeDecoderLayer(nn.Module):
    """A mixer (Mamba / attention) stage. Before an FFN stage it leaves its
    output all-reduce to that stage's input; otherwise it reduces the output
    itself unless the fused kernel takes the sum into the next input norm."""

    def _init_stage_boundary(self, config: NemotronHConfig, layer_idx: int):
        self.boundary = make_stage_boundary(
            self.norm, pattern=config.hybrid_override_pattern, layer_idx=layer_idx
        )

    def forward(
        self,
        *,
        hidden_states,
        forward_batch: ForwardBatch,
    ):
        hidden_states = self.boundary.prepare(hidden_states, forward_batch)
        if forward_batch.forward_mode.is_idle():
            return hidden_states

        hidden_states = self._forward_mixer(hidden_states, forward_batch)
        return self.boundary.finish(hidden_states, forward_batch)


class NemotronHMambaDecoderLayer(NemotronHAttnLikeDecoderLayer):
    def __init__(
        self,
        config: NemotronHConfig,
        layer_idx: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_id = layer_idx
        self.mixer = MambaMixer2(
            cache_params=config.mamba2_cache_params,
            hidden_size=config.hidden_size,
            use_conv_bias=config.use_conv_bias,
            use_bias=config.use_bias,
            n_groups=config.mamba_n_groups,
            rms_norm_eps=config.layer_norm_epsilon,
            activation=config.mamba_hidden_act,
            quant_config=quant_config,
            reduce_results=False,
            prefix=f"{prefix}.mixer",
        )

        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self._init_stage_boundary(config, layer_idx)

    def _forward_mamba(
        self,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Core Mamba forward logic, called directly or via split op."""
        attn_backend = get_attn_backend()
        assert isinstance(attn_backend, HybridLinearAttnBackend)
        assert isinstance(attn_backend.linear_attn_backend, Mamba2AttnBackend)
        return attn_backend.linear_attn_backend.forward(
            mixer=self.mixer,
            layer_id=self.layer_id,
            hidden_states=hidden_states,
            output=None,
            forward_batch=forward_batch,
            use_triton_causal_conv=True,
        )

    def _forward_mixer(
        self,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if is_in_breakable_cuda_graph():
            output = torch.empty_like(hidden_states)
            breakable_nemotron_mamba2_with_output(hidden_states, output, self.layer_id)
            return output
        if is_in_tc_piecewise_cuda_graph():
            output = torch.empty_like(hidden_states)
            nemotron_mamba2_with_output(hidden_states, output, self.layer_id)
            return output
        return self._forward_mamba(hidden_states, forward_batch)


class NemotronHAttention(nn.Module):
    def __init__(
        self,
        config: NemotronHConfig,
        layer_idx: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        tp_size = get_parallel().attn_tp_size
        self.total_num_heads = config.num_attention_heads
        assert self.total_num_heads % tp_size == 0
        self.num_heads = self.total_num_heads // tp_size
        self.total_num_kv_heads = config.num_key_value_heads
        if self.total_num_kv_heads >= tp_size:
            # Number of KV heads is greater than TP size, so we partition
            # the KV heads across multiple tensor parallel GPUs.
            assert self.total_num_kv_heads % tp_size == 0
        else:
            # Number of KV heads is less than TP size, so we replicate
            # the KV heads across multiple tensor parallel GPUs.
            assert tp_size % self.total_num_kv_heads == 0
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        if hasattr(config, "head_dim") and config.head_dim is not None:
            self.head_dim = config.head_dim
        else:
            self.head_dim = config.hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5

        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=False,
            quant_config=quant_config,
            parallel_group="attn_tp",
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            parallel_group="attn_tp",
            reduce_results=False,
            use_dp_attention_reduce=is_dp_attention_enabled(),
            prefix=f"{prefix}.o_proj",
        )

        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            layer_id=layer_idx,
            sliding_window_size=config.sliding_window,
            quant_config=quant_config,
            prefix=add_prefix("attn", prefix),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        attn_output = self.attn.forward(q, k, v, forward_batch)
        output, _ = self.o_proj(attn_output)
        return output


class NemotronHAttentionDecoderLayer(NemotronHAttnLikeDecoderLayer):
    def __init__(
        self,
        config: NemotronHConfig,
        layer_idx: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        layer_config = config.get_nemotron_h_config_for_layer(layer_idx)

        self.mixer = NemotronHAttention(
            layer_config,
            layer_idx,
            quant_config,
            prefix=f"{prefix}.mixer",
        )

        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self._init_stage_boundary(config, layer_idx)

    def _forward_mixer(
        self,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        return self.mixer.forward(
            hidden_states=hidden_states, forward_batch=forward_batch
        )


Layers = (
    NemotronHAttentionDecoderLayer,
    NemotronHMLPDecoderLayer,
    NemotronHMambaDecoderLayer,
    NemotronHMoEDecoderLayer,
)
ALL_DECODER_LAYER_TYPES: dict[str, type] = {
    ATTENTION: NemotronHAttentionDecoderLayer,
    MLP: NemotronHMLPDecoderLayer,
    MAMBA: NemotronHMambaDecoderLayer,
    MOE: NemotronHMoEDecoderLayer,
}


class NemotronHModel(nn.Module):
    def __init__(
        self,
        *,
        config: NemotronHConfig,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()

        lora_config = None
        self.config = config
        lora_vocab = (
            (lora_config.lora_extra_vocab_size * (lora_config.max_loras or 1))
            if lora_config
            else 0
        )
        self.vocab_size = config.vocab_size + lora_vocab
        self.org_vocab_size = config.vocab_size
        self.pp_group = get_parallel().pp_group

        if self.pp_group.is_first_rank:
            self.embed_tokens = VocabParallelEmbedding(
                self.vocab_size,
                config.hidden_size,
                org_num_embeddings=config.vocab_size,
                use_attn_tp_group=is_dp_attention_enabled(),
            )
        else:
            self.embed_tokens = PPMissingLayer()

        def get_layer(idx: int, prefix: str):
            layer_class = ALL_DECODER_LAYER_TYPES[config.hybrid_override_pattern[idx]]
            return layer_class(config, idx, quant_config=quant_config, prefix=prefix)

        self.layers, self.start_layer, self.end_layer = make_pp_layers(
            len(config.hybrid_override_pattern),
            get_layer,
            prefix=f"{prefix}.layers",
            stage_facts=partial(stage_facts, config.hybrid_override_pattern),
        )
        if self.pp_group.is_last_rank:
            self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        else:
            self.norm_f = PPMissingLayer(return_tuple=True)
        self.layers_to_capture: set[int] = set()

    @property
    def supports_hybrid_prefill_graph(self) -> bool:
        return is_sm120()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        pp_proxy_tensors: PPProxyTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | PPProxyTensors:
        if self.pp_group.is_first_rank:
            if inputs_embeds is not None:
                hidden_states = inputs_embeds
            else:
                hidden_states = self.embed_tokens(input_ids)
            residual_batch.start(forward_batch)
        else:
            assert pp_proxy_tensors is not None
            hidden_states = self.layers[self.start_layer].boundary.from_pp(
                pp_proxy_tensors, forward_batch
            )

        aux_hidden_states = []
        for i in range(self.start_layer, self.end_layer):
            if i in self.layers_to_capture:
                hidden_states, snapshot = self.layers[i].boundary.capture_output(
                    hidden_states, forward_batch
                )
                aux_hidden_states.append(snapshot)
            layer = self.layers[i]
            if not isinstance(layer, Layers):
                raise ValueError(f"Unknown layer type: {type(layer)}")
            with get_global_expert_distribution_recorder().with_current_layer(i):
                hidden_states = layer.forward(
                    hidden_states=hidden_states,
                    forward_batch=forward_batch,
                )

        if not self.pp_group.is_last_rank:
            return residual_batch.to_pp(hidden_states, forward_batch)
        hidden_states = residual_batch.complete_output(hidden_states, forward_batch)
        if self.end_layer in self.layers_to_capture:
            aux_hidden_states.append(
                residual_batch.snapshot(hidden_states, forward_batch)
            )
        hidden_states = residual_batch.final_norm(
            hidden_states, forward_batch, self.norm_f
        )
        if aux_hidden_states:
            return hidden_states, aux_hidden_states
        return hidden_states


class NemotronHForCausalLM(nn.Module):
    stacked_params_mapping = [
        # (param_name, shard_name, shard_id)
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    ]
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    }
    supported_lora_modules = [
        "qkv_proj",
        "o_proj",
        "out_proj",
        "in_proj",
        "up_proj",
        "gate_up_proj",
        "down_proj",
        "fc1_latent_proj",
        "fc2_latent_proj",
    ]

    remap_prefix = {"backbone": "model"}
    remap_substr = {
        "A_log": "A",
        "embeddings": "embed_tokens",
        "k_proj.k_scale": "attn.k_scale",
        "v_proj.v_scale": "attn.v_scale",
    }

    hf_to_sglang_mapper = WeightsMapper(
        orig_to_new_prefix={
            "backbone.": "model.",
        }
    )

    def __init__(
        self,
        *,
        config: NemotronHConfig,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        lora_config = None
        self._use_nvfp4_phase_layout = envs.SGLANG_OPT_SM120_NVFP4_PHASE_LAYOUT.get()
        if self._use_nvfp4_phase_layout and _publishes_weight_storage():
            raise ValueError(
                "NVFP4 phase layout rewrites FC2 weight storage in place; "
                "it cannot be combined with remote-instance weight publication"
            )
        self.config = config
        self.quant_config = quant_config
        self.model = self._init_model(
            config=config, quant_config=quant_config, prefix=prefix
        )
        self.pp_group = get_parallel().pp_group

        if self.pp_group.is_last_rank:
            if self.pp_group.world_size == 1 and self.config.tie_word_embeddings:
                self.lm_head = self.model.embed_tokens
            else:
                self.unpadded_vocab_size = config.vocab_size
                if lora_config:
                    self.unpadded_vocab_size += lora_config.lora_extra_vocab_size
                self.lm_head = ParallelLMHead(
                    self.unpadded_vocab_size,
                    config.hidden_size,
                    org_num_embeddings=config.vocab_size,
                    padding_size=(
                        DEFAULT_VOCAB_PADDING_SIZE
                        # We need bigger padding if using lora for kernel
                        # compatibility
                        if not lora_config
                        else lora_config.lora_vocab_padding_size
                    ),
                    quant_config=quant_config,
                    use_attn_tp_group=get_parallel().enable_dp_lm_head,
                    prefix=add_prefix("lm_head", prefix),
                )
        else:
            self.lm_head = PPMissingLayer()

        if self.pp_group.world_size > 1 and self.config.tie_word_embeddings:
            if self.pp_group.is_first_rank:
                self.pp_group.send(
                    self.model.embed_tokens.weight, dst=self.pp_group.last_rank
                )
            elif self.pp_group.is_last_rank:
                emb_token_weight = self.pp_group.recv(
                    size=self.lm_head.weight.shape,
                    dtype=next(self.model.parameters()).dtype,
                    src=self.pp_group.first_rank,
                )
                self.lm_head.weight.copy_(emb_token_weight)

        self.logits_processor = LogitsProcessor(config)
        self.capture_aux_hidden_states = False

        self.routed_experts_weights_of_layer = LazyValue(
            lambda: {
                layer_id: self.model.layers[layer_id].mixer.get_moe_weights()
                for layer_id in range(self.model.start_layer, self.model.end_layer)
                if isinstance(self.model.layers[layer_id], NemotronHMoEDecoderLayer)
            }
        )

    @classmethod
    def get_model_config_for_expert_location(cls, config):
        return ModelConfigForExpertLocation(
            num_layers=config.num_hidden_layers,
            num_logical_experts=config.max_n_routed_experts,
            num_groups=config.n_group,
        )

    def _init_model(
        self,
        config: NemotronHConfig,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        return NemotronHModel(
            config=config, quant_config=quant_config, prefix=add_prefix("model", prefix)
        )

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def get_stacked_multiply(self, module_name):
        """Non-gated MoE uses stacked_multiply=1 for gate_up_proj_moe."""
        if module_name == "gate_up_proj_moe":
            return 1  # Non-gated: only w1, no w3
        # Fall back to defaults for everything else
        from sglang.srt.lora.utils import get_stacked_multiply

        return get_stacked_multiply(module_name)

    def get_hidden_dim(self, module_name, layer_idx):
        """Return (input_dim, output_dim) for LoRA buffers, per layer type."""
        config = self.config
        layer_type = config.layers_block_type[layer_idx]
        hidden_size = config.hidden_size
        head_dim = getattr(
            config, "head_dim", hidden_size // config.num_attention_heads
        )

        if module_name == "qkv_proj":
            return (
                hidden_size,
                head_dim
                * (config.num_attention_heads + config.num_key_value_heads * 2),
            )
        elif module_name == "o_proj":
            return (
                head_dim * config.num_attention_heads,
                hidden_size,
            )
        elif module_name == "out_proj":
            # Mamba out_proj: RowParallelLinear from mamba_intermediate to hidden_size
            mamba_intermediate = config.mamba_num_heads * config.mamba_head_dim
            return mamba_intermediate, hidden_size
        elif module_name == "gate_up_proj":
            if layer_type == "mamba":
                # Mamba in_proj gate component: output = mamba_num_heads * mamba_head_dim
                mamba_intermediate = config.mamba_num_heads * config.mamba_head_dim
                return hidden_size, mamba_intermediate * 2
            elif layer_type == "moe":
                # Shared expert: only has up_proj (no gate), but gets stacked
                shared_inter = (
                    config.moe_shared_expert_intermediate_size * config.n_shared_experts
                )
                return hidden_size, shared_inter * 2
            else:
                # MLP layer
                return hidden_size, config.intermediate_size * 2
        elif module_name == "up_proj":
            if layer_type == "moe":
                shared_inter = (
                    config.moe_shared_expert_intermediate_size * config.n_shared_experts
                )
                return hidden_size, shared_inter
            else:
                return hidden_size, config.intermediate_size
        elif module_name == "down_proj":
            if layer_type == "moe":
                shared_inter = (
                    config.moe_shared_expert_intermediate_size * config.n_shared_experts
                )
                return shared_inter, hidden_size
            else:
                return config.intermediate_size, hidden_size
        elif module_name == "in_proj":
            # Mamba in_proj: gate_proj + x_proj, each mamba_intermediate wide
            mamba_intermediate = config.mamba_num_heads * config.mamba_head_dim
            return hidden_size, mamba_intermediate * 2
        elif module_name == "x_proj":
            # Mamba x_proj: projects from hidden_size to mamba_intermediate
            mamba_intermediate = config.mamba_num_heads * config.mamba_head_dim
            return hidden_size, mamba_intermediate
        elif module_name == "gate_up_proj_moe":
            # Non-gated MoE: only w1, no w3. stacked_multiply=1.
            # For latent MoE, experts operate in moe_latent_size space.
            moe_hidden = getattr(config, "moe_latent_size", None) or hidden_size
            return moe_hidden, config.moe_intermediate_size
        elif module_name == "down_proj_moe":
            moe_hidden = getattr(config, "moe_latent_size", None) or hidden_size
            return config.moe_intermediate_size, moe_hidden
        elif module_name == "fc1_latent_proj":
            moe_latent = getattr(config, "moe_latent_size", None) or hidden_size
            return hidden_size, moe_latent
        elif module_name == "fc2_latent_proj":
            moe_latent = getattr(config, "moe_latent_size", None) or hidden_size
            return moe_latent, hidden_size
        elif module_name == "embed_tokens":
            return config.vocab_size, hidden_size
        elif module_name == "lm_head":
            return hidden_size, config.vocab_size
        else:
            raise NotImplementedError(
                f"get_hidden_dim not implemented for {module_name}"
            )

    def prepare_for_forward(self, forward_batch: ForwardBatch) -> None:
        if not getattr(self, "_use_nvfp4_phase_layout", False):
            return
        from sglang.srt.layers.moe.moe_runner.flashinfer_cutlass import (
            _flashinfer_autotune_active,
            _sm120_mtp_mma_supported,
        )
        from sglang.srt.models.nemotron_h_nvfp4_layout import Nvfp4LayoutCycle

        cycle = getattr(self, "_nvfp4_layout", None)
        if cycle is None:
            if not (
                get_parallel().tp_size
                == get_parallel().ep_size
                == get_parallel().pp_size
                == 1
                and get_schedule().max_running_requests == 1
                and _sm120_mtp_mma_supported()
            ):
                raise ValueError(
                    "NVFP4 phase layout requires serial SM120 CUTLASS MoE with TP/EP/PP=1"
                )
            experts = [
                m.experts for m in self.model.modules() if isinstance(m, NemotronHMoE)
            ]
            if not experts or not all(
                getattr(m.quant_method, "enable_flashinfer_cutlass_moe", False)
                and m.w13_weight.shape == (512, 2688, 512)
                for m in experts
            ):
                raise ValueError(
                    "NVFP4 phase layout requires compatible native NVFP4 experts"
                )
            cycle = self._nvfp4_layout = Nvfp4LayoutCycle(
                [m.w2_weight for m in experts]
            )
            for index, module in enumerate(experts):
                module._nvfp4_layout_slot = (cycle, index)
            self._derived_weight_cache_error = (
                "Online weight updates require disabling NVFP4 phase layout"
            )
            self._weight_export_error = (
                "Weight export requires disabling NVFP4 phase layout"
            )

        mode = forward_batch.forward_mode
        cycle.ensure(
            (mode.is_target_verify() or mode.is_decode_or_idle())
            and forward_batch.input_ids.numel() <= 4
            and not _flashinfer_autotune_active()
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
        pp_proxy_tensors: PPProxyTensors | None = None,
    ):
        self.prepare_for_forward(forward_batch)
        hidden_states = self.model.forward(
            input_ids, positions, forward_batch, pp_proxy_tensors, input_embeds
        )
        aux_hidden_states = None
        if self.capture_aux_hidden_states:
            hidden_states, aux_hidden_states = hidden_states
        if self.pp_group.is_last_rank:
            return self.logits_processor(
                input_ids,
                hidden_states,
                self.lm_head,
                forward_batch,
                aux_hidden_states,
            )
        else:
            return hidden_states

    def copy_inputs_before_cuda_graphs(self, input_buffers, **kwargs):
        return self.mamba_cache.copy_inputs_before_cuda_graphs(input_buffers, **kwargs)

    def get_seqlen_agnostic_capture_inputs(self, batch_size: int):
        return self.mamba_cache.get_seqlen_agnostic_capture_inputs(batch_size)

    def get_embed_and_head(self):
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_embed_and_head(self, embed, head):
        del self.model.embed_tokens.weight
        del self.lm_head.weight
        self.model.embed_tokens.weight = embed
        self.lm_head.weight = head
        torch.cuda.empty_cache()
        torch.cuda.synchronize()

    def set_dflash_layers_to_capture(self, layer_ids: list[int]):
        if not self.pp_group.is_last_rank:
            return
        if layer_ids is None:
            raise ValueError(
                "DFLASH requires explicit layer_ids for aux hidden capture."
            )

        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = {layer_id + 1 for layer_id in layer_ids}

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], is_mtp: bool = False
    ) -> None:
        # - FusedMoe.w1 (aka gate_proj) should be up_proj since that's
        #   what the activation is applied to
        # - FusedMoe.w3 (aka up_proj) should be ignored since we're
        #   using non-gated MoE
        expert_params_mapping = FusedMoE.make_expert_params_mapping(
            ckpt_gate_proj_name="up_proj",
            ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="",
            num_experts=self.config.max_n_routed_experts,
        )

        params_dict = dict(self.named_parameters())

        # Stream weights directly from the generator to avoid buffering
        # the entire checkpoint (~75 GB) into a Python list. On unified-
        # memory systems (e.g. DGX Spark, 119 GB) the old buffered path
        # caused OOM: skeleton 81.6 GB + buffer 75 GB = 157 GB peak.
        for name, loaded_weight in weights:
            name = replace_prefix(name, self.remap_prefix)
            name = replace_substrings(name, self.remap_substr)
            if is_mtp:
                # Keep the MTP draft layers (mtp.layers.*) and the shared
                # embed_tokens / lm_head weights. The remap above already
                # rewrote "embeddings" -> "embed_tokens", so the shared draft
                # weights must be whitelisted by their post-remap names; without
                # this the draft loads no embedding / head and accepts zero
                # draft tokens (accept rate 0.00), see issue #21138.
                if (
                    "mtp" not in name
                    and "embed_tokens" not in name
                    and "lm_head" not in name
                ):
                    continue

                name = name.replace("mtp.layers.", "model.layers.")

                if "embeddings" in name:
                    name = name.replace("embeddings", "model.embed_tokens")
                    if name.startswith("backbone."):
                        name = name.replace("backbone.", "")

            if not is_mtp and "mtp" in name:
                continue

            if "scale" in name:
                if name not in params_dict:
                    name = maybe_remap_kv_scale_name(name, params_dict)
                    if name is None:
                        continue

            layer_id = get_layer_id(name)
            if (
                layer_id is not None
                and hasattr(self.model, "start_layer")
                and (
                    layer_id < self.model.start_layer
                    or layer_id >= self.model.end_layer
                )
            ):
                continue

            if "embed_tokens" in name and not self.pp_group.is_first_rank:
                continue

            if (
                "norm_f" in name or "lm_head" in name
            ) and not self.pp_group.is_last_rank:
                continue

            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name:
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
                is_expert_weight = False
                for mapping in expert_params_mapping:
                    param_name, weight_name, expert_id, shard_id = mapping
                    if weight_name not in name:
                        continue
                    is_expert_weight = True
                    name_mapped = name.replace(weight_name, param_name)
                    if name_mapped not in params_dict:
                        continue
                    param = params_dict[name_mapped]
                    param.weight_loader(
                        param,
                        loaded_weight,
                        name_mapped,
                        shard_id=shard_id,
                        expert_id=expert_id,
                    )
                    name = name_mapped
                    break
                else:
                    if is_expert_weight:
                        continue
                    # Skip loading extra bias for GPTQ models.
                    if name.endswith(".bias") and name not in params_dict:
                        continue
                    if name in params_dict.keys():
                        param = params_dict[name]
                        weight_loader = getattr(
                            param, "weight_loader", default_weight_loader
                        )
                        weight_loader(param, loaded_weight)
                    else:
                        logger.warning(f"Parameter {name} not found in params_dict")


class NemotronHPuzzleForCausalLM(NemotronHForCausalLM):
    pass


EntryClass = [NemotronHForCausalLM, NemotronHPuzzleForCausalLM]


@register_custom_op(mutates_args=["output"])
@register_split_op()
def nemotron_mamba2_with_output(
    hidden_states: torch.Tensor,
    output: torch.Tensor,
    layer_id: int,
) -> None:
    """Split op for Mamba2 forward in piecewise CUDA graph mode."""
    context = get_tc_piecewise_forward_context()
    forward_batch = context.forward_batch
    attention_layers = context.attention_layers
    mamba_layer = attention_layers[layer_id]

    # In piecewise CUDA graph mode, hidden_states may be padded to the
    # captured graph size. Slice to actual token count for Mamba forward.
    attn_backend = get_attn_backend()
    metadata = attn_backend.linear_attn_backend.forward_metadata
    num_actual_tokens = metadata.num_prefill_tokens + (
        metadata.num_decodes * metadata.draft_token_num
        if metadata.is_target_verify
        else metadata.num_decodes
    )
    if hidden_states.shape[0] != num_actual_tokens:
        hidden_states = hidden_states[:num_actual_tokens]

    ret = mamba_layer._forward_mamba(hidden_states, forward_batch)

    # Copy result back; output may be larger (padded) so only fill actual tokens
    output[:num_actual_tokens].view(ret.shape).copy_(ret)
    if output.shape[0] != num_actual_tokens:
        output[num_actual_tokens:].zero_()


breakable_nemotron_mamba2_with_output = eager_on_graph(True)(
    nemotron_mamba2_with_output
)
