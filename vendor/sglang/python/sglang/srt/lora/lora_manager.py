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

# Integrates "S-LoRA: Serving Thousands of Concurrent LoRA Adapters"
# and "Punica: Multi-Tenant LoRA Serving"

import logging
import re
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.environ import envs
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.utils import get_layer_id
from sglang.srt.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from sglang.srt.lora.backend.base_backend import BaseLoRABackend
from sglang.srt.lora.backend.lora_registry import get_backend_from_name
from sglang.srt.lora.layers import BaseLayerWithLoRA, FusedMoEWithLoRA, get_lora_layer
from sglang.srt.lora.lora import LoRAAdapter
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.lora.mem_pool import LoRAMemoryPool
from sglang.srt.lora.utils import (
    DSA_INDEXER_LORA_NAMES,
    EMBEDDING_NAMES,
    LoRAType,
    auto_detect_lora_target_modules,
    get_normalized_target_modules,
    get_target_module_name,
    warn_if_adapter_targets_embeddings,
)
from sglang.srt.managers.io_struct import LoRAUpdateOutput
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.runtime_context import (
    LoRABatchLayout,
    get_exec,
    get_forward,
    get_lora,
    get_parallel,
    get_schedule,
    get_spec,
)
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import get_available_gpu_memory, replace_submodule
from sglang.srt.utils.hf_transformers_utils import AutoConfig

_SGLANG_EXPERIMENTAL_LORA_OPTI = envs.SGLANG_EXPERIMENTAL_LORA_OPTI.get()

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self,
        base_model: torch.nn.Module,
        base_hf_config: AutoConfig,
        max_loras_per_batch: int,
        load_config: LoadConfig,
        dtype: torch.dtype,
        server_args: ServerArgs,
        lora_backend: str = "triton",
        max_lora_rank: Optional[int] = None,
        target_modules: Optional[Iterable[str]] = None,
        lora_paths: Optional[List[LoRARef]] = None,
    ):
        self.base_model: torch.nn.Module = base_model
        if hasattr(base_hf_config, "get_text_config"):
            self.base_hf_config: AutoConfig = base_hf_config.get_text_config()
        else:
            self.base_hf_config: AutoConfig = base_hf_config
        self.max_loras_per_batch: int = max_loras_per_batch
        self.load_config: LoadConfig = load_config
        self.dtype: torch.dtype = dtype
        self.device: torch.device = next(self.base_model.parameters()).device
        # Attention projections shard on the attn-TP group; extracted once
        # here (parallel groups are frozen after init_torch_distributed).
        self.attn_tp_size: int = get_parallel().attn_tp_size
        self.lora_added_tokens_size: Optional[int] = None
        self.enable_lora_overlap_loading: Optional[bool] = (
            get_lora().enable_lora_overlap_loading
        )
        self.attn_dp_enabled: bool = get_parallel().attn_dp_enabled
        if (
            self.attn_dp_enabled
            and self.enable_lora_overlap_loading
            and not LoRAMemoryPool.supports_dp_attention_overlap_loading
        ):
            raise ValueError(
                "The configured LoRA memory pool does not support DP-attention "
                "overlap loading; use a pool that coordinates adapter slots "
                "across DP ranks or disable overlap loading"
            )
        # LoRA routing knows only DP-local and TP-global token layouts. A wider
        # attention TP/CP group can scatter one DP rank's tokens across ranks.
        if self.attn_dp_enabled and (
            self.attn_tp_size != 1 or get_parallel().attn_cp_size != 1
        ):
            raise ValueError(
                "LoRA with DP attention requires --attn-dp-size equal to --tp-size "
                f"(got attention TP size {self.attn_tp_size} and attention CP "
                f"size {get_parallel().attn_cp_size})"
            )
        self.pending_lora_load_events = {}

        self.eviction_policy = get_lora().lora_eviction_policy
        self._experts_shared_outer_override: Optional[bool] = (
            get_lora().experts_shared_outer_loras
        )
        from sglang.srt.layers.moe.utils import get_moe_runner_backend

        self.moe_lora_runner_backend = get_moe_runner_backend()
        self.lora_use_virtual_experts: bool = get_lora().lora_use_virtual_experts
        self.lora_strict_loading: bool = get_lora().lora_strict_loading
        self.speculative_algorithm: Optional[str] = get_spec().speculative_algorithm

        # LoRA backend for running sgemm kernels
        logger.info(f"Using {lora_backend} as backend of LoRA kernels.")
        backend_type = get_backend_from_name(lora_backend)
        self.lora_backend: BaseLoRABackend = backend_type(
            max_loras_per_batch=max_loras_per_batch,
            device=self.device,
            server_args=server_args,
        )
        if self.attn_dp_enabled and not self.lora_backend.supports_dp_attention:
            raise ValueError(
                f"LoRA backend {lora_backend!r} does not support DP attention"
            )

        # Initialize mutable internal state of the LoRAManager.
        self.init_state(
            max_lora_rank=max_lora_rank,
            target_modules=target_modules,
            lora_paths=lora_paths,
        )

    def init_decode_cuda_graph_batch_info(
        self, max_bs_in_cuda_graph: int, num_tokens_per_req: int
    ):
        """Initialize decode-runner metadata after model memory-pool setup."""
        self.max_bs_in_decode_cuda_graph = max_bs_in_cuda_graph
        self.lora_backend.init_decode_cuda_graph_batch_info(
            max_bs_in_cuda_graph=max_bs_in_cuda_graph,
            num_tokens_per_req=num_tokens_per_req,
        )
        max_moe_tokens = max_bs_in_cuda_graph * num_tokens_per_req
        if self.attn_dp_enabled:
            self.lora_backend.init_dp_attention_cuda_graph_batch_info(max_moe_tokens)
            max_moe_tokens *= get_parallel().num_dp_ranks
        if self.lora_backend.resize_cuda_graph_moe_buffers(max_moe_tokens):
            logger.info(
                "Right-sized shared MoE LoRA CUDA graph buffers "
                f"(max_tokens={max_moe_tokens})"
            )

        # ===== TO BE REFACTORED ====
        # Pre-create the experimental LoRA two-stream side stream now (gated) so the
        # torch.cuda.Stream() call never lands inside a cuda-graph capture region.
        if _SGLANG_EXPERIMENTAL_LORA_OPTI:
            from sglang.srt.lora.trtllm_lora_temp import (
                init_lora_two_stream_resources,
            )

            init_lora_two_stream_resources(self.device)
        # ===== END TO BE REFACTORED ====

    def init_prefill_cuda_graph_batch_info(
        self, max_num_tokens: int, max_num_requests: Optional[int] = None
    ):
        """Allocate static LoRA metadata and MoE scratch before prefill capture."""
        self.lora_backend.init_prefill_cuda_graph_batch_info(
            max_num_tokens=max_num_tokens, max_num_requests=max_num_requests
        )
        for module in self.base_model.modules():
            if isinstance(module, FusedMoEWithLoRA):
                self.lora_backend.init_cuda_graph_moe_buffers(
                    max_bs=max_num_tokens,
                    max_loras=self.max_loras_per_batch,
                    compute_dtype=self.dtype,
                    moe_layer=module,
                    prefill=True,
                )
                break

    @property
    def supports_prefill_cuda_graph(self) -> bool:
        """MoE LoRA supports full and breakable capture; DP attention is unsupported."""
        from sglang.srt.model_executor.cuda_graph_config import (
            Backend,
            Phase,
            check_cuda_graph_backend,
        )

        if self.attn_dp_enabled or not self.lora_backend.supports_prefill_cuda_graph:
            return False
        if self.lora_backend.is_moe_lora:
            return check_cuda_graph_backend(
                Phase.PREFILL, Backend.BREAKABLE
            ) or check_cuda_graph_backend(Phase.PREFILL, Backend.FULL)
        return True

    @property
    def prefill_cuda_graph_max_bs(self) -> Optional[int]:
        """Request-count cap for prefill-graph LoRA batches; None until
        init_prefill_cuda_graph_batch_info() ran."""
        return self.lora_backend.prefill_cuda_graph_max_bs

    def can_use_prefill_cuda_graph(self, forward_batch: ForwardBatch) -> bool:
        """Whether this batch can use the static prefill-graph LoRA metadata;
        shared by prepare_lora_batch and can_run_graph so they stay consistent."""
        max_bs = self.lora_backend.prefill_cuda_graph_max_bs
        max_tokens = self.lora_backend.prefill_cuda_graph_max_tokens
        if max_bs is None or max_tokens is None:
            return False
        # DP attention: per-rank eligibility could diverge across ranks and
        # desync collectives; keep LoRA prefill eager.
        if self.attn_dp_enabled:
            return False
        # Decode-CUDA-graph extend modes (TARGET_VERIFY, DLLM_EXTEND) are
        # owned by the decode static batch info path.
        if (
            not forward_batch.forward_mode.is_extend()
            or forward_batch.forward_mode.is_cuda_graph()
        ):
            return False
        if forward_batch.extend_num_tokens is None:
            return False
        return (
            forward_batch.batch_size <= max_bs
            and forward_batch.extend_num_tokens <= max_tokens
        )

    def init_cuda_graph_moe_buffers(
        self,
        max_bs: int,
        max_loras: int,
        compute_dtype,
        moe_layer,
    ):
        """Phase 1 of LoRA CUDA graph init: MoE intermediate buffers.

        Called before init_memory_pool() so memory profiling accounts for them.
        Phase 2 (dense batch metadata) uses init_decode_cuda_graph_batch_info().
        """
        self.lora_backend.init_cuda_graph_moe_buffers(
            max_bs=max_bs,
            max_loras=max_loras,
            compute_dtype=compute_dtype,
            moe_layer=moe_layer,
        )

    def create_lora_update_result(
        self, success: bool, error_message: str = ""
    ) -> LoRAUpdateOutput:
        return LoRAUpdateOutput(
            success=success,
            error_message=error_message,
            loaded_adapters={
                lora_ref.lora_name: lora_ref.lora_path
                for lora_ref in self.lora_refs.values()
            },
        )

    def load_lora_adapter(self, lora_ref: LoRARef) -> LoRAUpdateOutput:
        logger.info(
            f"LoRA adapter loading starts: {lora_ref}. "
            f"avail mem={get_available_gpu_memory(self.device.type, self.device.index):.2f} GB"
        )
        result = self._load_lora_adapter(lora_ref)
        logger.info(
            f"LoRA adapter loading completes: {lora_ref}. "
            f"avail mem={get_available_gpu_memory(self.device.type, self.device.index):.2f} GB"
        )
        return result

    def _load_lora_adapter(self, lora_ref: LoRARef) -> LoRAUpdateOutput:
        """
        Load a single LoRA adapter from the specified path.

        Args:
            lora_ref (LoRARef): The LoRARef object containing the LoRA name, path, and ID.
        """
        assert lora_ref.lora_name is not None and lora_ref.lora_path is not None, (
            "LoRARef must have both lora_name and lora_path set for loading."
        )
        assert lora_ref.lora_id not in self.loras, (
            f"LoRA adapter with ID {lora_ref.lora_id} is already loaded. This should have been verified before request is sent to the backend."
        )

        try:
            # load configs
            new_adapter = LoRAConfig(
                lora_ref.lora_path,
                base_vocab_size=self.base_hf_config.vocab_size,
            )
            self.validate_new_adapter(new_adapter, lora_ref)
            self.configs[lora_ref.lora_id] = new_adapter

            # load weights
            self.load_lora_weights(lora_ref)

            # keep metadata for displayed messages
            self.lora_refs[lora_ref.lora_id] = lora_ref
            self.num_pinned_loras += int(lora_ref.pinned)
        except Exception as e:
            return self.create_lora_update_result(
                success=False,
                error_message=str(e),
            )

        return self.create_lora_update_result(success=True)

    def _validate_replicated_q_targets(self, target_modules):
        # q_proj adapter targets normalize to qkv_proj.
        unsupported = set(target_modules) & {"q_b_proj", "qkv_proj", "kv_b_proj"}
        if unsupported and get_parallel().dcp_replicate_q_proj:
            raise ValueError(
                f"Replicated-Q decode is incompatible with LoRA targets {sorted(unsupported)}; "
                "pass --no-dcp-replicate-q-proj to use the local-head Q path."
            )

    def validate_new_adapter(self, lora_config: LoRAConfig, lora_ref: LoRARef):
        """
        Validate if an adapter can be loaded into the current LoRA memory pool and generate error if it is incompatible.
        """
        assert not self.attn_dp_enabled or lora_ref.pinned, (
            "DP-attention LoRA requires pinned adapters"
        )
        if lora_config.lora_added_tokens_size > 0:
            raise ValueError(
                f"Failed to load {lora_ref.lora_name} because LoRA serving currently doesn't support adapters that add tokens to the vocabulary"
            )

        if lora_config.use_dora:
            raise ValueError(
                f"Failed to load {lora_ref.lora_name} because LoRA serving currently doesn't support DoRA adapters"
            )

        # Check if this LoRA adapter is already loaded
        for existing_lora_ref in self.lora_refs.values():
            if lora_ref.lora_name == existing_lora_ref.lora_name:
                raise ValueError(
                    f"Failed to load LoRA adapter {lora_ref.lora_name} because it is already loaded"
                )

            if lora_ref.lora_path == existing_lora_ref.lora_path:
                logger.warning(
                    f"{lora_ref.lora_path} is already loaded with name: {existing_lora_ref.lora_name}, "
                    f"but another copy is being loaded with name: {lora_ref.lora_name}"
                )

        # Check if the LoRA adapter shape is compatible with the current LoRA memory pool configuration.
        memory_pool = getattr(self, "memory_pool", None)
        incompatible = memory_pool and not memory_pool.can_support(lora_config)
        if incompatible:
            raise ValueError(
                f"LoRA adapter {lora_ref.lora_name} with rank {lora_config.r} is incompatible with the current "
                "LoRA memory pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
            )

        # Ensure pinned LoRA adapters does not exceed maximal limit or cause starvation.
        if lora_ref.pinned and self.num_pinned_loras >= self.max_loras_per_batch - 1:
            raise ValueError(
                f"Failed to load LoRA adapter {lora_ref.lora_name} as a pinned adapter. It is not allowed to pin all slots "
                "in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please increase your "
                "`--max-loras-per-batch` or load it as unpinned LoRA adapters."
            )

    def unload_lora_adapter(self, lora_ref: LoRARef) -> LoRAUpdateOutput:
        logger.info(
            f"LoRA adapter unloading starts: {lora_ref}. "
            f"avail mem={get_available_gpu_memory(self.device.type, self.device.index):.2f} GB"
        )
        result = self._unload_lora_adapter(lora_ref)
        logger.info(
            f"LoRA adapter unloading completes: {lora_ref}. "
            f"avail mem={get_available_gpu_memory(self.device.type, self.device.index):.2f} GB"
        )
        return result

    def _unload_lora_adapter(self, lora_ref: LoRARef) -> LoRAUpdateOutput:
        """
        Unload LoRA adapters by their names. This will remove the adapters from the memory pool and
        delete the corresponding LoRA modules.
        """

        loaded_lora_ref = self.lora_refs.get(lora_ref.lora_id)
        try:
            pending_events = getattr(self, "pending_lora_load_events", {})
            pending_event = pending_events.get(lora_ref.lora_id)
            if pending_event is not None:
                pending_event.synchronize()
                pending_events.pop(lora_ref.lora_id, None)

            removed_slot = self.memory_pool.remove_lora(lora_ref.lora_id)
            if removed_slot is not None:
                self._notify_lora_slots_updated({removed_slot})
            self.configs.pop(lora_ref.lora_id, None)
            self.loras.pop(lora_ref.lora_id, None)
            self.lora_refs.pop(lora_ref.lora_id, None)
            if loaded_lora_ref is not None:
                self.num_pinned_loras -= int(loaded_lora_ref.pinned)
        except Exception as e:
            return self.create_lora_update_result(
                success=False,
                error_message=str(e),
            )

        return self.create_lora_update_result(success=True)

    def validate_lora_batch(self, lora_ids: set[Optional[str]]) -> bool:
        """
        Validate if the LoRA IDs in the batch can be loaded into the current LoRA memory pool.
        """
        if len(lora_ids) > self.max_loras_per_batch:
            return False

        # skip pinned LoRA check if no pinned LoRA adapters are loaded.
        if self.num_pinned_loras == 0:
            return True

        # counting the number of pinned LoRA adapters in the batch.
        pinned_loras_in_batch = 0
        for lora_id in lora_ids:
            if lora_id is not None:
                lora_ref = self.lora_refs.get(lora_id)
                assert lora_ref is not None, (
                    f"LoRA ID {lora_id} not found in lora_refs."
                )
                pinned_loras_in_batch += int(lora_ref.pinned)

        assert pinned_loras_in_batch <= self.num_pinned_loras, (
            f"Number of pinned LoRA adapters in the batch ({pinned_loras_in_batch}) exceeds the total number of pinned adapters "
            f"({self.num_pinned_loras}). This indicates a bug in the LoRA loading logic."
        )

        required_slots = len(lora_ids) - pinned_loras_in_batch
        mem_pool_vacancy = self.memory_pool.max_loras_per_batch - self.num_pinned_loras

        return required_slots <= mem_pool_vacancy

    def fetch_new_loras(
        self, new_loras: set[Optional[str]], running_loras: set[Optional[str]] = set()
    ):
        # Load active loras into lora memory pool
        cur_uids = new_loras | running_loras

        assert len(cur_uids) <= self.max_loras_per_batch
        new_uids = {
            uid for uid in cur_uids if uid not in self.memory_pool.uid_to_buffer_id
        }
        self.memory_pool.prepare_lora_batch(
            cur_uids=cur_uids,
            lora_adapters=self.loras,
            lora_modules=self.lora_modules,
            lora_refs=self.lora_refs.copy(),  # copy snapshot of current lora_refs to avoid mutation during the batch preparation.
            lora_embed_tokens_module=self.embed_tokens_module,  # merge into embedding or lora module
            lora_lm_head_module=self.lm_head_module,  # merge into embedding or lora module
        )
        if new_uids:
            changed_slots = {self.memory_pool.uid_to_buffer_id[uid] for uid in new_uids}
            self._notify_lora_slots_updated(changed_slots)

    def _notify_lora_slots_updated(self, slot_ids: set[int]) -> None:
        for layer_modules in self.lora_modules:
            for module in layer_modules.values():
                notify = getattr(module, "on_lora_slots_updated", None)
                if callable(notify):
                    notify(slot_ids)

    def reset_lora_batch(self):
        """Clear per-batch LoRA state. Called instead of prepare_lora_batch()
        on DP-attention idle forwards (zero local tokens), so the LoRA layers
        take the base path instead of reading the previous batch's stale
        metadata."""
        self.lora_backend.reset_batch_state()

    def reset_routing_cache(self) -> None:
        self.lora_backend.reset_routing_cache()

    def prepare_lora_batch(self, forward_batch: ForwardBatch):
        # Some internal-only backends (currently UNO) use explicit token-row
        # routing for their adapted forwards and want all-base batches to run
        # through the plain model path.  Clear any routing retained by the
        # preceding adapted forward before inspecting CUDA-graph metadata.
        if self.lora_backend.skip_inactive_lora_batches and not any(
            uid is not None for uid in forward_batch.lora_ids
        ):
            self.reset_lora_batch()
            return

        # set up batch info shared by all lora modules
        use_decode_cuda_graph = self._use_cuda_graph_batch(forward_batch)
        # Eligible extend batches refresh the static prefill batch info in
        # place so captured kernels read current values at replay.
        use_prefill_cuda_graph = (
            not use_decode_cuda_graph and self.can_use_prefill_cuda_graph(forward_batch)
        )

        active_lora_ids = set(forward_batch.lora_ids)
        if self.attn_dp_enabled:
            get_forward().set("lora_batch_layout", LoRABatchLayout.DP_LOCAL)
            gathered_lora_ids = get_parallel().tp_group.all_gather_object(
                forward_batch.lora_ids
            )
            active_lora_ids = {
                lora_id
                for rank_lora_ids in gathered_lora_ids
                for lora_id in rank_lora_ids
            }
            if not self.validate_lora_batch(active_lora_ids):
                raise ValueError(
                    "The global DP-attention batch contains more LoRA adapters than "
                    "the memory pool can hold"
                )
            self.fetch_new_loras(active_lora_ids)

        base_weight_index = self.memory_pool.uid_to_buffer_id.get(None, 0)
        weight_indices = [base_weight_index] * len(forward_batch.lora_ids)
        lora_ranks = [0] * self.max_loras_per_batch
        scalings = [0] * self.max_loras_per_batch
        for i, uid in enumerate(forward_batch.lora_ids):
            if uid not in self.memory_pool.uid_to_buffer_id:
                continue
            weight_indices[i] = self.memory_pool.get_buffer_id(uid)
        for uid in active_lora_ids:
            if uid is None:
                continue
            weight_index = self.memory_pool.get_buffer_id(uid)
            lora = self.loras[uid]
            lora_ranks[weight_index] = lora.config.r
            scalings[weight_index] = lora.scaling
        # Do in-place updates when CUDA graph is enabled and the batch forward mode
        # could use CUDA graph.
        self.lora_backend.prepare_lora_batch(
            forward_batch,
            weight_indices,
            lora_ranks,
            scalings,
            use_decode_cuda_graph,
            use_prefill_cuda_graph=use_prefill_cuda_graph,
        )
        self.lora_backend.batch_info.has_active_lora = any(
            lora_ranks[wi] > 0 for wi in weight_indices
        )
        self.lora_backend.batch_info.is_prefill = (
            forward_batch.forward_mode.is_extend()
            and not forward_batch.forward_mode.is_cuda_graph()
        )
        if self.attn_dp_enabled:
            self.lora_backend.prepare_global_lora_batch(forward_batch)
            if forward_batch.forward_mode.is_idle():
                # Idle ranks must join the global routing collectives, but
                # their DP-local attention path has no tokens to adapt.
                self.lora_backend.batch_info = None

    def _use_cuda_graph_batch(self, forward_batch: ForwardBatch) -> bool:
        return (
            hasattr(self, "max_bs_in_decode_cuda_graph")
            and forward_batch.batch_size <= self.max_bs_in_decode_cuda_graph
            and forward_batch.forward_mode.is_cuda_graph()
            and (not self.attn_dp_enabled or forward_batch.can_run_decode_cuda_graph)
        )

    def prepare_lora_token_segments(
        self,
        *,
        lora_ids: Sequence[Optional[str]],
        segment_lens: Sequence[int],
    ) -> None:
        """Prepare eager LoRA routing independently of request batching."""
        lora_ids = list(lora_ids)
        segment_lens = list(segment_lens)
        if len(lora_ids) != len(segment_lens):
            raise ValueError("LoRA ids and segment lengths must have equal length.")

        weight_indices = []
        lora_ranks = [0] * self.max_loras_per_batch
        scalings = [0.0] * self.max_loras_per_batch
        for lora_id in lora_ids:
            weight_index = self.memory_pool.get_buffer_id(lora_id)
            weight_indices.append(weight_index)
            if lora_id is not None:
                lora = self.loras[lora_id]
                lora_ranks[weight_index] = lora.config.r
                scalings[weight_index] = lora.scaling

        self.lora_backend.prepare_lora_token_segments(
            segment_lens=segment_lens,
            weight_indices=weight_indices,
            lora_ranks=lora_ranks,
            scalings=scalings,
        )
        self.lora_backend.batch_info.has_active_lora = any(
            lora_ranks[index] > 0 for index in weight_indices
        )

    def update_lora_info(self):
        """
        Update all LoRA modules to associate them with the latest memory buffer.
        """
        for layer_id, layer_modules in enumerate(self.lora_modules):
            for module_name, module in layer_modules.items():
                if (
                    isinstance(module, FusedMoEWithLoRA)
                    or getattr(module, "is_shared_fused_moe", False)
                ) and all(
                    x in self.target_modules for x in ["gate_up_proj", "down_proj"]
                ):
                    base_layer = getattr(module, "base_layer", module)
                    suffix = "_shared_moe" if base_layer.is_shared_fused_moe else "_moe"
                    gate_up_key = (
                        f"gate_up_proj{suffix}"
                        if f"gate_up_proj{suffix}" in self.memory_pool.A_buffer
                        else "gate_up_proj"
                    )
                    down_key = (
                        f"down_proj{suffix}"
                        if f"down_proj{suffix}" in self.memory_pool.A_buffer
                        else "down_proj"
                    )
                    gate_up_a = self.memory_pool.get_tensor(
                        target_module=gate_up_key,
                        layer_id=layer_id,
                        lora_type=LoRAType.LORA_A,
                    )
                    gate_up_b = self.memory_pool.get_tensor(
                        target_module=gate_up_key,
                        layer_id=layer_id,
                        lora_type=LoRAType.LORA_B,
                    )
                    down_a = self.memory_pool.get_tensor(
                        target_module=down_key,
                        layer_id=layer_id,
                        lora_type=LoRAType.LORA_A,
                    )
                    down_b = self.memory_pool.get_tensor(
                        target_module=down_key,
                        layer_id=layer_id,
                        lora_type=LoRAType.LORA_B,
                    )

                    module.set_lora_info(
                        gate_up_lora_a_weights=gate_up_a,
                        gate_up_lora_b_weights=gate_up_b,
                        down_lora_a_weights=down_a,
                        down_lora_b_weights=down_b,
                    )
                    continue

                target_module = get_target_module_name(
                    module_name, self.memory_pool.target_modules
                )

                module.set_lora_info(
                    self.memory_pool.get_tensor(
                        target_module=target_module,
                        layer_id=layer_id,
                        lora_type=LoRAType.LORA_A,
                    ),
                    self.memory_pool.get_tensor(
                        target_module=target_module,
                        layer_id=layer_id,
                        lora_type=LoRAType.LORA_B,
                    ),
                )

        # Update embedding layer if present - gotta merge (refer to PR codebase)
        if self.embed_tokens_module is not None:
            self.embed_tokens_module.set_lora_info(
                self.memory_pool.get_embedding_tensor("added_tokens", LoRAType.LORA_A),
                self.memory_pool.get_embedding_tensor("embed_tokens", LoRAType.LORA_A),
                self.memory_pool.get_embedding_tensor("embed_tokens", LoRAType.LORA_B),
            )

        # Update lm_head layer if present
        if self.lm_head_module is not None:
            self.lm_head_module.set_lora_info(
                self.memory_pool.get_embedding_tensor("lm_head", LoRAType.LORA_A),
                self.memory_pool.get_embedding_tensor("lm_head", LoRAType.LORA_B),
            )

    def init_state(
        self,
        max_lora_rank: Optional[int] = None,
        target_modules: Optional[Iterable[str]] = None,
        lora_paths: Optional[List[LoRARef]] = None,
    ):
        """
        Initialize the internal (mutable) state of the LoRAManager.

        When `lora_paths` is provided and not empty, it might be used for inferring LoRA shape info such as
        the target modules and max_lora_rank.
        """

        assert lora_paths or (
            max_lora_rank is not None and target_modules is not None
        ), (
            "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and --lora-target-modules for LoRA initialization."
        )

        self.init_lora_adapters(lora_paths)
        self.init_lora_shapes(
            max_lora_rank=max_lora_rank,
            target_modules=target_modules,
        )
        self.lora_backend.validate_lora_targets(
            base_model=self.base_model,
            target_modules=self.target_modules,
        )
        self._validate_replicated_q_targets(self.target_modules)

        if self._experts_shared_outer_override is not None:
            self.experts_shared_outer_loras = self._experts_shared_outer_override
        else:
            self.experts_shared_outer_loras = self._detect_shared_outer_loras()
        if self.experts_shared_outer_loras:
            logger.info(
                "Shared outer LoRA mode enabled: gate_up lora_A and "
                "down lora_B will be shared across experts (expert_dim=1)."
            )

        self.init_lora_modules()
        self.init_memory_pool()
        self.update_lora_info()

    def init_lora_adapters(self, lora_paths: Optional[List[LoRARef]] = None):
        # Configs of all active LoRA adapters, indexed by LoRA ID.
        self.configs: Dict[str, LoRAConfig] = {}

        # LoRA adapter weights cached in CPU memory, indexed by LoRA ID.
        self.loras: Dict[str, LoRAAdapter] = {}

        # Mapping from LoRA ID to LoRARef object.
        self.lora_refs: Dict[str, LoRARef] = {}

        # Count of pinned LoRA adapters.
        self.num_pinned_loras: int = 0

        if lora_paths:
            for lora_ref in lora_paths:
                result = self._load_lora_adapter(lora_ref)
                if not result.success:
                    raise RuntimeError(
                        f"Failed to load LoRA adapter {lora_ref.lora_name}: {result.error_message}"
                    )

    def _detect_shared_outer_loras(self) -> bool:
        """Auto-detect shared outer LoRA format from loaded adapter weights.

        MoE adapters with shared outer experts store 3D tensors where
        dim[0]=1 indicates weights shared across all experts, while
        dim[0]=num_experts indicates per-expert weights.
        Returns True if gate_up lora_A has expert_dim=1 (shared).

        All loaded adapters that expose a 3D gate_up lora_A must agree;
        mixed formats raise RuntimeError.
        """
        shared_outer: Optional[bool] = None
        for adapter_id, adapter in self.loras.items():
            for layer in adapter.layers:
                for name, weight in layer.weights.items():
                    if "gate_up_proj" not in name or "lora_A" not in name:
                        continue
                    if weight.dim() == 3:
                        is_shared = weight.shape[0] == 1
                    elif re.search(r"(?:shared_)?experts\.\d+\.", name):
                        # Per-expert adapters keep numbered 2D expert weights;
                        # they must count against the layout agreement too.
                        is_shared = False
                    else:
                        continue
                    if shared_outer is None:
                        shared_outer = is_shared
                    elif shared_outer != is_shared:
                        raise RuntimeError(
                            "Mixed shared-outer LoRA formats detected across "
                            f"loaded adapters (conflict in adapter '{adapter_id}'). "
                            "All MoE adapters must either all use shared outer "
                            "experts (expert_dim=1) or all use per-expert weights."
                        )
        return bool(shared_outer) if shared_outer is not None else False

    def init_lora_shapes(
        self,
        max_lora_rank: Optional[int] = None,
        target_modules: Optional[Iterable[str]] = None,
    ):
        """Infer LoRA target modules and max_lora_rank from loaded adapters if not provided."""

        if target_modules and target_modules == {"all"}:
            self.target_modules = auto_detect_lora_target_modules(self.base_model)
            self.target_modules.update(EMBEDDING_NAMES)
            logger.info(
                "CLI --lora-target-modules='all' resolved to %s "
                "by inspecting the base model.",
                sorted(self.target_modules),
            )
            target_modules = self.target_modules
        elif target_modules:
            self.target_modules = get_normalized_target_modules(target_modules)
        else:
            self.target_modules = set()

        for lora_id, config in self.configs.items():
            # Handle PEFT shorthand strings like "all-linear" or "all".
            if isinstance(config.target_modules, str):
                if config.target_modules in ("all-linear", "all"):
                    if target_modules is not None:
                        # CLI --lora-target-modules already provided; skip
                        # per-adapter inference for this adapter.
                        continue
                    else:
                        # Resolve by scanning the base model for all
                        # LoRA-compatible linear modules.
                        adapter_target_modules = auto_detect_lora_target_modules(
                            self.base_model
                        )
                        logger.info(
                            "LoRA adapter '%s' uses target_modules='%s'. "
                            "Resolved to %s by inspecting the base model.",
                            self.lora_refs[lora_id].lora_name,
                            config.target_modules,
                            sorted(adapter_target_modules),
                        )
                        self.target_modules.update(adapter_target_modules)
                        continue
                else:
                    raise ValueError(
                        f"SGLang does not recognize target_modules="
                        f"'{config.target_modules}'. Please use a list of module "
                        "name suffixes in the adapter's PEFT config, or explicitly "
                        "specify --lora-target-modules during server startup."
                    )

            if not isinstance(config.target_modules, list):
                raise ValueError(
                    f"SGLang currently only supports inferring LoRA target modules when a list of "
                    "suffixes is provided in `target_modules` field of PEFT config. Please explicitly "
                    "specify `--lora-target-modules` during server startup. You can specify `all` to "
                    "enable all support modules types. "
                )

            adapter_target_modules = get_normalized_target_modules(
                config.target_modules
            )

            if target_modules is not None:
                # When `--lora-target-modules` is provided, validate adapter target modules is a subset of the specified target modules.
                if not adapter_target_modules.issubset(self.target_modules):
                    unsupported_modules = adapter_target_modules - self.target_modules
                    lora_name = self.lora_refs[lora_id].lora_name
                    raise ValueError(
                        f"LoRA adapter '{lora_name}' contains target modules {sorted(unsupported_modules)} "
                        f"that are not included in the specified --lora-target-modules {sorted(self.target_modules)}. "
                        f"Please update --lora-target-modules to include all required modules: "
                        f"{sorted(self.target_modules | adapter_target_modules)}, or use 'all' to enable all supported modules."
                    )
            else:
                # Otherwise, infer target_modules from adapter configs.
                self.target_modules.update(adapter_target_modules)

        # Fusion folds wk + weights_proj into wk_weights_proj, so the modules
        # LoRA wraps are absent and an indexer-targeted adapter is silently dropped.
        # Each Indexer decides fusion when it is built (CUDA, env, RoPE style).
        indexer_targets = self.target_modules & DSA_INDEXER_LORA_NAMES
        if indexer_targets and any(
            getattr(module, "use_dsa_indexer_fusion", False)
            for _, module in self.base_model.named_modules()
        ):
            raise ValueError(
                f"LoRA targets the DSA indexer ({sorted(indexer_targets)}), which is "
                "incompatible with DSA indexer Q/K fusion. Set "
                "SGLANG_DISABLE_DSA_INDEXER_FUSION=1 to disable fusion and use indexer LoRA."
            )

        if max_lora_rank is not None:
            self.max_lora_rank = max_lora_rank
        else:
            self.max_lora_rank = max(
                [x.r for x in self.configs.values()],
                default=0,
            )

        # Auto-infer self.lora_added_vocab_size from loaded LoRA configs
        # This happens automatically without requiring user input
        # if self.lora_added_vocab_size is None:
        if self.lora_added_tokens_size is None:
            inferred_extra_vocab_size = next(
                (
                    x.lora_added_tokens_size
                    for x in self.configs.values()
                    if x.lora_added_tokens_size > 0
                ),
                0,
            )
            if inferred_extra_vocab_size > 0:
                logger.info(
                    f"self.lora_added_tokens_size={inferred_extra_vocab_size} from LoRA adapters."
                )
            self.lora_added_tokens_size = inferred_extra_vocab_size

    def load_lora_weights(self, lora_ref: LoRARef):
        """
        Load the weights of a LoRA adapter to CPU memory and conducts post-loading validation.
        """
        lora_adapter = LoRAAdapter(
            lora_ref.lora_id,
            self.configs[lora_ref.lora_id],
            self.base_hf_config,
            self.load_config,
            self.lora_backend,
            base_model=self.base_model,
        )
        lora_adapter.initialize_weights()

        warn_if_adapter_targets_embeddings(
            lora_name=lora_ref.lora_name,
            embedding_layer_names=lora_adapter.embedding_layers.keys(),
            speculative_algorithm=self.speculative_algorithm,
        )

        self.loras[lora_ref.lora_id] = lora_adapter

    def load_lora_weights_from_tensors(
        self, lora_ref: LoRARef, tensors: Dict[str, torch.Tensor]
    ):
        """
        Load the weights of a LoRA adapter from tensors to CPU memory.
        """
        lora_adapter = LoRAAdapter(
            lora_ref.lora_id,
            self.configs[lora_ref.lora_id],
            self.base_hf_config,
            self.load_config,
            self.lora_backend,
            base_model=self.base_model,
        )
        lora_adapter.initialize_weights_from_tensors(tensors)

        warn_if_adapter_targets_embeddings(
            lora_name=lora_ref.lora_name,
            embedding_layer_names=lora_adapter.embedding_layers.keys(),
            speculative_algorithm=self.speculative_algorithm,
        )
        self.loras[lora_ref.lora_id] = lora_adapter

    def load_lora_adapter_from_tensors(
        self,
        lora_ref: LoRARef,
        tensors: Dict[str, torch.Tensor],
        config_dict: Dict,
        added_tokens_config: Optional[Dict] = None,
    ) -> LoRAUpdateOutput:
        logger.info(f"LoRA adapter loading from tensors starts: {lora_ref}.")
        result = self._load_lora_adapter_from_tensors(
            lora_ref, tensors, config_dict, added_tokens_config
        )
        logger.info(f"LoRA adapter loading from tensors completes: {lora_ref}.")
        return result

    def _load_lora_adapter_from_tensors(
        self,
        lora_ref: LoRARef,
        tensors: Dict[str, torch.Tensor],
        config_dict: Dict,
        added_tokens_config: Optional[Dict] = None,
    ) -> LoRAUpdateOutput:
        """
        Load a single LoRA adapter from tensors and config dict.
        """
        assert lora_ref.lora_name is not None and lora_ref.lora_path is not None, (
            "LoRARef must have both lora_name and lora_path set for loading."
        )
        assert lora_ref.lora_id not in self.loras, (
            f"LoRA adapter with ID {lora_ref.lora_id} is already loaded. This should have been verified before request is sent to the backend."
        )

        try:
            new_adapter = LoRAConfig.from_dict(
                config_dict,
                added_tokens_config,
                base_vocab_size=self.base_hf_config.vocab_size,
            )
            self.validate_new_adapter(new_adapter, lora_ref)
            self.configs[lora_ref.lora_id] = new_adapter

            self.load_lora_weights_from_tensors(lora_ref, tensors)

            self.lora_refs[lora_ref.lora_id] = lora_ref
            self.num_pinned_loras += int(lora_ref.pinned)
        except Exception as e:
            return self.create_lora_update_result(
                success=False,
                error_message=str(e),
            )

        return self.create_lora_update_result(success=True)

    def init_memory_pool(self):
        """(Re)initialize the LoRA memory pool based on the current configurations."""
        self.memory_pool = LoRAMemoryPool(
            base_hf_config=self.base_hf_config,
            max_loras_per_batch=self.max_loras_per_batch,
            dtype=self.dtype,
            max_lora_rank=self.max_lora_rank,
            target_modules=self.target_modules,
            base_model=self.base_model,
            eviction_policy=self.eviction_policy,
            lora_added_tokens_size=self.lora_added_tokens_size,
            experts_shared_outer_loras=self.experts_shared_outer_loras,
            strict_loading=self.lora_strict_loading,
            enable_lora_overlap_loading=self.enable_lora_overlap_loading,
        )

        # Initializing memory pool with base model
        self.fetch_new_loras({None})

    def set_lora_module(self, module_name, module, **kwargs):
        """Wrap any module (standard or MoE) with LoRA support."""
        lora_module = get_lora_layer(module, self.lora_backend, **kwargs)
        replace_submodule(self.base_model, module_name, lora_module)
        return lora_module

    def init_lora_modules(self):
        # Look-up table that essentially maps (layer_index, module_name) to the corresponding LoRA module.
        self.lora_modules: List[Dict[str, torch.nn.Module]] = [
            {} for _ in range(self.base_hf_config.num_hidden_layers)
        ]

        self.embed_tokens_module: Optional[BaseLayerWithLoRA] = None
        self.lm_head_module: Optional[BaseLayerWithLoRA] = None

        # When tie_word_embeddings=True, lm_head is the same Python object as
        # embed_tokens. PyTorch's named_modules() deduplicates by object identity,
        # so lm_head will not appear as a separate entry in the scan below,
        # preventing LoRA from wrapping it. To fix this, we create a new
        # ParallelLMHead that shares the same base weight tensor (no extra GPU
        # memory) so that named_modules() yields it as an independent module.
        if "lm_head" in self.target_modules:
            lm_head = getattr(self.base_model, "lm_head", None)
            embed_tokens = None
            for name, mod in self.base_model.named_modules():
                if name.endswith("embed_tokens"):
                    embed_tokens = mod
                    break
            if (
                lm_head is not None
                and embed_tokens is not None
                and lm_head is embed_tokens
            ):
                logger.info(
                    "lm_head is tied with embed_tokens. Creating a separate "
                    "ParallelLMHead that shares the base weight for LoRA support."
                )
                untied_lm_head = ParallelLMHead(
                    num_embeddings=embed_tokens.org_vocab_size,
                    embedding_dim=embed_tokens.embedding_dim,
                    params_dtype=embed_tokens.weight.dtype,
                    org_num_embeddings=embed_tokens.org_vocab_size,
                )
                # Share the base weight tensor — no additional GPU memory.
                untied_lm_head.weight = embed_tokens.weight
                # Replace the model attribute so named_modules() sees it
                # independently.
                self.base_model.lm_head = untied_lm_head

        from sglang.srt.models.inkling_common.dense_mlp import InklingBatchDenseMLP

        for module_name, module in self.base_model.named_modules():
            # Handle embed_tokens and lm_head before the should_apply_lora gate,
            # since VL models' should_apply_lora patterns only match language
            # model layers and would incorrectly skip these.
            # Handle embed_tokens
            if "embed_tokens" in module_name and "embed_tokens" in self.target_modules:
                if isinstance(module, VocabParallelEmbedding) and not isinstance(
                    module, BaseLayerWithLoRA
                ):
                    lora_module = self.set_lora_module(module_name, module)
                    self.embed_tokens_module = lora_module
                    continue
            # Handle lm_head
            if "lm_head" in module_name and "lm_head" in self.target_modules:
                if isinstance(module, ParallelLMHead) and not isinstance(
                    module, BaseLayerWithLoRA
                ):
                    lora_module = self.set_lora_module(module_name, module)
                    self.lm_head_module = lora_module
                    continue

            # Routed banks live outside `model.layers.`, so the gate below drops
            # them before the FusedMoE branch can reject them.
            if (
                module_name.startswith("model.meta_mlp.")
                and isinstance(module, (FusedMoE, InklingBatchDenseMLP))
                and all(x in self.target_modules for x in ["gate_up_proj", "down_proj"])
                and get_layer_id(module_name) is None
            ):
                raise ValueError(
                    "LoRA on Intern-S2-Mobius model.meta_mlp routed banks "
                    "is not supported by the baseline; remove routed-expert "
                    "targets or use a future bank-aware LoRA implementation."
                )

            if getattr(
                self.base_model, "should_apply_lora", None
            ) and not self.base_model.should_apply_lora(module_name):
                continue

            # Handle DeepSeek MLA fused projection: set the boundary
            # between q_a and kv_a output partitions so the LoRA layer
            # can apply separate B projections for each.
            if (
                "fused_qkv_a_proj_with_mqa" in self.target_modules
                and module_name.endswith("fused_qkv_a_proj_with_mqa")
            ):
                from sglang.srt.lora.layers import ReplicatedLinearWithLoRA

                layer_id = get_layer_id(module_name)
                if layer_id is None:
                    continue
                lora_module = self.set_lora_module(module_name, module)
                if isinstance(lora_module, ReplicatedLinearWithLoRA):
                    q_lora_rank = getattr(self.base_hf_config, "q_lora_rank", None) or 0
                    lora_module.first_output_dim = q_lora_rank
                self.lora_modules[layer_id][module_name] = lora_module
                continue

            # The module should be converted if it is included in target_names
            parts = module_name.split(".")
            if (
                parts[-1] in self.target_modules
                or ".".join(parts[-2:]) in self.target_modules
            ):
                layer_id = get_layer_id(module_name)
                if layer_id is None:
                    continue
                self.lora_modules[layer_id][module_name] = self.set_lora_module(
                    module_name, module
                )
                continue

            if isinstance(module, (FusedMoE, InklingBatchDenseMLP)) and all(
                x in self.target_modules for x in ["gate_up_proj", "down_proj"]
            ):
                layer_id = get_layer_id(module_name)
                if layer_id is None:
                    # FusedMoE submodules outside the decoder layer hierarchy
                    # (e.g. nested helpers under non-".layers." prefixes) have
                    # no resolvable layer id; skip them so we don't index
                    # `self.lora_modules` with `None`.
                    continue
                if isinstance(module, InklingBatchDenseMLP):
                    module.initialize_lora(self.lora_backend)
                    logger.info_once(
                        "Inkling shared-sink LoRA: %s on the %s backend",
                        type(module).__name__,
                        self.lora_backend.name,
                    )
                    lora_module = module
                else:
                    lora_module = self.set_lora_module(
                        module_name,
                        module,
                        experts_shared_outer_loras=self.experts_shared_outer_loras,
                        max_lora_rank=self.max_lora_rank,
                    )
                    lora_module.lora_use_virtual_experts = self.lora_use_virtual_experts
                self.lora_modules[layer_id][module_name] = lora_module

        # lora_* quant methods leave execution to the LoRA wrapper; reject
        # target sets that leave every MoE layer without one.
        backend = getattr(self, "moe_lora_runner_backend", None)
        if backend is not None and backend.is_lora():
            modules = list(self.base_model.modules())
            if any(isinstance(module, FusedMoE) for module in modules) and not any(
                isinstance(module, FusedMoEWithLoRA) for module in modules
            ):
                raise ValueError(
                    f"--moe-runner-backend {backend.value} requires "
                    "the LoRA target modules to include gate_up_proj and down_proj; "
                    "this adapter leaves the MoE experts without a runner"
                )


def init_lora_cuda_graph_moe_buffers(
    *,
    model: torch.nn.Module,
    lora_manager: LoRAManager,
    dtype: torch.dtype,
):
    """Allocate legacy MoE buffers before init_memory_pool() sizes the KV cache.

    Sequential MoE layers reuse these buffers. Dense batch metadata is allocated
    later by DecodeCudaGraphRunner, which owns the capture-time batch sizes.
    """
    if lora_manager.lora_backend.name == "triton_v2":
        logger.debug("V2 MoE scratch is allocated during warmup, not reserved here")
        return
    from sglang.srt.lora.layers import FusedMoEWithLoRA

    max_bs = get_exec().graph.cuda_graph_config.decode.max_bs
    max_running_requests = get_schedule().max_running_requests
    if max_running_requests is not None:
        max_bs = min(
            max_bs,
            max(1, max_running_requests // get_parallel().attn_dp_size),
        )
    # With spec on, the decode graph captures TARGET_VERIFY batches of
    # num_draft_tokens per request, and the buffers below are per-token, so
    # they must be sized in tokens rather than requests.
    max_tokens = max_bs * (get_spec().speculative_num_draft_tokens or 1)
    if get_parallel().attn_dp_enabled:
        max_tokens *= get_parallel().attn_dp_size
    max_loras = get_lora().max_loras_per_batch
    for module in model.modules():
        if isinstance(module, FusedMoEWithLoRA):
            lora_manager.init_cuda_graph_moe_buffers(
                max_tokens,
                max_loras,
                dtype,
                module,
            )
            logger.info(
                f"Pre-allocated shared MoE LoRA CUDA graph buffers "
                f"(max_tokens={max_tokens}, max_loras={max_loras})"
            )
            break
