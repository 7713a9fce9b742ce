from __future__ import annotations

import logging
import os
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from sglang.srt.environ import envs
from sglang.srt.layers.dp_attention import get_is_extend_in_batch
from sglang.srt.layers.moe.token_dispatcher.base import (
    BaseDispatcher,
    CombineInput,
    CombineInputFormat,
    DispatchOutput,
    DispatchOutputFormat,
    RoutewiseLayout,
)
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.layers.moe.utils import (
    DeepEPv2Fp8ScaleFormat,
    get_deepep_v2_fp8_scale_format,
)
from sglang.srt.runtime_context import (
    get_exec,
    get_parallel,
    get_resources,
)

logger = logging.getLogger(__name__)

_SCALE_BLOCK_SIZE = 128
# Must match DeepGEMM's contiguous expert alignment.
_EXPERT_ALIGNMENT = 128
_deepep_v2_import_error: Optional[BaseException] = None
_fp8_quant_import_error: Optional[BaseException] = None
sglang_per_token_group_quant_fp8 = None


try:
    from deep_ep import ElasticBuffer

    use_deepep_v2 = True
except Exception as exc:  # deep_ep's import-time host checks; see deepep.py
    use_deepep_v2 = False
    _deepep_v2_import_error = exc

if use_deepep_v2:
    try:
        from sglang.kernels.ops.quantization.fp8_kernel import (
            sglang_per_token_group_quant_fp8,
        )
    except (ImportError, OSError) as exc:
        _fp8_quant_import_error = exc


class DeepEPv2DispatchOutput(NamedTuple):
    hidden_states: torch.Tensor
    hidden_states_scale: Optional[torch.Tensor]
    topk_ids: Optional[torch.Tensor]  # Receiver-local expert IDs, or -1.
    topk_weights: torch.Tensor
    psum_num_recv_tokens_per_expert: Optional[torch.Tensor] = None
    is_expanded: bool = False
    use_masked_gemm: bool = False
    expected_m: int = 0
    masked_max_m: int = 0
    total_expanded: int = 0
    expert_alignment: int = 128
    activation_scale_block_size: int = _SCALE_BLOCK_SIZE

    @property
    def format(self) -> DispatchOutputFormat:
        return DispatchOutputFormat.DEEPEP_V2


class DeepEPv2CombineInput(NamedTuple):
    hidden_states: torch.Tensor
    topk_weights: Optional[torch.Tensor]
    routewise_layout: Optional[RoutewiseLayout] = None

    @property
    def format(self) -> CombineInputFormat:
        return CombineInputFormat.DEEPEP_V2


assert isinstance(DeepEPv2DispatchOutput, DispatchOutput)
assert isinstance(DeepEPv2CombineInput, CombineInput)


def _raise_deepep_v2_import_error() -> None:
    detail = (
        f" Original import error: {_deepep_v2_import_error}"
        if _deepep_v2_import_error is not None
        else ""
    )
    raise ImportError(
        "DeepEP v2 (ElasticBuffer) is not available. Install DeepEP v2 from "
        "https://github.com/deepseek-ai/DeepEP." + detail
    )


def _ensure_deepep_v2_available() -> None:
    if not use_deepep_v2:
        _raise_deepep_v2_import_error()


def _ensure_fp8_quant_available() -> None:
    _ensure_deepep_v2_available()
    if sglang_per_token_group_quant_fp8 is None:
        detail = (
            f" Original import error: {_fp8_quant_import_error}"
            if _fp8_quant_import_error is not None
            else ""
        )
        raise ImportError(
            "DeepEP v2 FP8 dispatch requires the SGLang FP8 quantization kernel."
            + detail
        )


def _get_allow_hybrid_mode() -> bool:
    # Multi-node is rejected with direct in server-args validation, so a hybrid
    # mode here already covers every multi-node run.
    return get_exec().moe.deepep_v2_mode == "hybrid"


def _quantize_for_deepep_v2_dispatch(
    hidden_states: torch.Tensor,
    scale_format: DeepEPv2Fp8ScaleFormat,
    activation_scale_block_size: int = _SCALE_BLOCK_SIZE,
):
    _ensure_fp8_quant_available()
    return sglang_per_token_group_quant_fp8(
        hidden_states,
        activation_scale_block_size,
        column_major_scales=scale_format.tma_aligned,
        scale_tma_aligned=scale_format.tma_aligned,
        scale_ue8m0=scale_format.ue8m0,
    )


class DeepEPv2Buffer:
    """Facade for the process-wide ElasticBuffer stored in runtime resources."""

    _STATE_KEY = "deepep_v2_ep_state"

    @classmethod
    def _state(cls):
        from types import SimpleNamespace

        buffers = get_resources().buffers
        state = buffers.get(cls._STATE_KEY)
        if state is None:
            state = SimpleNamespace(buffer=None, key=None)
            buffers[cls._STATE_KEY] = state
        return state

    @classmethod
    def get_buffer(
        cls,
        group: dist.ProcessGroup,
        hidden_size: int,
        router_topk: int,
        num_max_dispatch_tokens_per_rank: int,
        use_fp8_dispatch: bool,
        allow_hybrid_mode: Optional[bool] = None,
    ) -> ElasticBuffer:
        _ensure_deepep_v2_available()

        if allow_hybrid_mode is None:
            allow_hybrid_mode = _get_allow_hybrid_mode()
        state = cls._state()
        # A key change rebuilds ElasticBuffer collectively on every rank.
        key = (
            group,
            hidden_size,
            router_topk,
            num_max_dispatch_tokens_per_rank,
            use_fp8_dispatch,
            allow_hybrid_mode,
            dist.get_world_size(group),
        )
        if state.buffer is not None and state.key == key:
            return state.buffer

        # Native explicit teardown is unavailable unless explicitly_destroy=True.
        cls.destroy()

        # Communicator reuse requires a device-bound process group.
        os.environ.setdefault("EP_REUSE_NCCL_COMM", "0")
        buffer = ElasticBuffer(
            group,
            num_max_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            hidden=hidden_size,
            num_topk=router_topk,
            use_fp8_dispatch=use_fp8_dispatch,
            allow_hybrid_mode=allow_hybrid_mode,
            sl_idx=0,
            prefer_overlap_with_compute=False,
        )
        # Publish only after collective construction succeeds.
        state.buffer = buffer
        state.key = key
        logger.info(
            "Initialized DeepEP v2 ElasticBuffer: world_size=%s hidden_size=%s "
            "num_topk=%s max_dispatch_tokens_per_rank=%s use_fp8_dispatch=%s "
            "allow_hybrid_mode=%s num_bytes=%s",
            dist.get_world_size(group),
            hidden_size,
            router_topk,
            num_max_dispatch_tokens_per_rank,
            use_fp8_dispatch,
            allow_hybrid_mode,
            buffer.num_bytes,
        )
        return buffer

    @classmethod
    def destroy(cls) -> None:
        state = cls._state()
        state.buffer = None
        state.key = None


class _DeepEPv2Impl:
    def __init__(
        self,
        group: dist.ProcessGroup,
        router_topk: int,
        num_experts: int,
        num_local_experts: int,
        hidden_size: int,
        scale_format: DeepEPv2Fp8ScaleFormat,
        num_max_dispatch_tokens_per_rank: int,
        use_fp8_dispatch: bool,
        activation_scale_block_size: int = _SCALE_BLOCK_SIZE,
    ):
        self.group = group
        self.router_topk = router_topk
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.scale_format = scale_format
        self.activation_scale_block_size = activation_scale_block_size
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.use_fp8_dispatch = use_fp8_dispatch
        self._handle = None
        self._pad_empty_combine = False
        prefill_expand = envs.SGLANG_DEEPEP_V2_ENABLE_PREFILL_EXPAND.get()
        if prefill_expand is None:
            # Unset: expanded prefill is validated end to end only without
            # UE8M0 scales (Hopper), so Blackwell keeps the non-expanded path.
            prefill_expand = not scale_format.ue8m0
        self._prefill_expand_enabled = prefill_expand

    def _destroy_handle(self) -> None:
        self._handle = None

    def _get_buffer(self) -> ElasticBuffer:
        return DeepEPv2Buffer.get_buffer(
            self.group,
            self.hidden_size,
            self.router_topk,
            self.num_max_dispatch_tokens_per_rank,
            self.use_fp8_dispatch,
        )

    def prebuild_buffer(self) -> None:
        """Build the ElasticBuffer now instead of lazily on the first dispatch.

        Avoids the ~2GB alloc + cross-rank NCCL barrier stalling the first request
        when decode CUDA-graph capture did not already build it. Needs only
        host-known config already on this impl; key-cached so dispatch reuses it.
        """
        self._get_buffer()

    def _validate_common(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor
    ) -> None:
        if hidden_states.shape[0] > self.num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"DeepEP v2 dispatch input exceeds the per-rank buffer capacity "
                f"{self.num_max_dispatch_tokens_per_rank}, got {hidden_states.shape[0]}. "
                "Increase SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK or "
                "lower the active prefill/decode batch limit."
            )
        if hidden_states.shape[1] != self.hidden_size:
            raise ValueError(
                f"DeepEP v2 hidden size mismatch: expected {self.hidden_size}, "
                f"got {hidden_states.shape[1]}"
            )
        if self.hidden_size % self.activation_scale_block_size != 0:
            raise ValueError(
                "DeepEP v2 requires hidden_size multiple of "
                f"{self.activation_scale_block_size}, got {self.hidden_size}"
            )
        if topk_ids.shape[1] != self.router_topk:
            raise ValueError(
                f"DeepEP v2 topk mismatch: expected {self.router_topk}, "
                f"got {topk_ids.shape[1]}"
            )

    def _masked_token_capacity(self, local_tokens: int, ep_group_size: int) -> int:
        capacity = self.num_max_dispatch_tokens_per_rank * ep_group_size
        parallel = get_parallel()
        # Without attention DP/CP, sources in the TP group share a batch:
        # inputs are replicated or tensor_split shards differing by at most
        # one row. Other topologies may have larger remote batches.
        if (
            parallel.attn_dp_size != 1
            or parallel.attn_cp_size != 1
            or parallel.tp_size != ep_group_size
            or parallel.tp_group is None
            or self.group is not parallel.tp_group.device_group
        ):
            return capacity

        # A token selects an expert at most once. Even if every source routes
        # every token to one expert, its count cannot exceed the source total.
        # Round up for the masked GEMM layout; never enlarge the original slab.
        # Include the possible extra row on each other tensor_split shard.
        source_total = max(1, local_tokens * ep_group_size + ep_group_size - 1)
        aligned_total = (
            (source_total + _EXPERT_ALIGNMENT - 1)
            // _EXPERT_ALIGNMENT
            * _EXPERT_ALIGNMENT
        )
        return min(capacity, aligned_total)

    def dispatch(
        self, hidden_states: torch.Tensor, topk_output: TopKOutput
    ) -> DeepEPv2DispatchOutput:
        if self._handle is not None:
            raise RuntimeError(
                "DeepEP v2 dispatch called while the previous dispatch handle is "
                "still unconsumed (missing combine)"
            )
        _ensure_deepep_v2_available()
        topk_weights = topk_output.topk_weights
        topk_ids = topk_output.topk_ids.to(torch.int64)
        self._validate_common(hidden_states, topk_ids)
        is_decode = not get_is_extend_in_batch()
        use_masked = is_decode
        use_expand_layout = is_decode or self._prefill_expand_enabled

        # CPU-synced dispatch needs a dummy token to notify from an idle rank.
        self._pad_empty_combine = (not use_masked) and hidden_states.shape[0] == 0
        if self._pad_empty_combine:
            hidden_states = hidden_states.new_zeros((1, hidden_states.shape[-1]))
            # Dummy routes need distinct expert ids; zero weights null the result.
            topk_ids = torch.arange(
                topk_ids.shape[-1], dtype=topk_ids.dtype, device=topk_ids.device
            ).unsqueeze(0)
            topk_weights = topk_weights.new_zeros((1, topk_weights.shape[-1]))

        if not self.use_fp8_dispatch:
            dispatch_x = hidden_states
            use_tma_aligned_col_major_sf = False
        elif use_expand_layout:
            _ensure_fp8_quant_available()
            _ue8m0 = self.scale_format.ue8m0
            dispatch_x = sglang_per_token_group_quant_fp8(
                hidden_states,
                self.activation_scale_block_size,
                column_major_scales=_ue8m0,
                scale_tma_aligned=_ue8m0,
                scale_ue8m0=_ue8m0,
            )
            use_tma_aligned_col_major_sf = _ue8m0
        else:
            dispatch_x = _quantize_for_deepep_v2_dispatch(
                hidden_states, self.scale_format, self.activation_scale_block_size
            )
            use_tma_aligned_col_major_sf = self.scale_format.tma_aligned

        # This collective argument must not depend on a rank-local batch.
        num_max_tokens = self.num_max_dispatch_tokens_per_rank
        # Masked dispatch stays asynchronous for CUDA graph capture.
        do_cpu_sync_val = True
        if use_masked:
            do_cpu_sync_val = False

        buffer = self._get_buffer()
        recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
            dispatch_x,
            topk_idx=topk_ids,
            topk_weights=topk_weights,
            num_experts=self.num_experts,
            num_max_tokens_per_rank=num_max_tokens,
            expert_alignment=_EXPERT_ALIGNMENT,
            num_sms=envs.SGLANG_DEEPEP_V2_NUM_SMS.get(),
            use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
            do_cpu_sync=do_cpu_sync_val,
            do_expand=use_expand_layout,
        )
        local_tokens = hidden_states.shape[0]
        if event.event is not None:
            event.current_stream_wait()

        if isinstance(recv_x, tuple):
            recv_hidden_states, recv_hidden_states_scale = recv_x
        else:
            recv_hidden_states = recv_x
            recv_hidden_states_scale = None

        if use_expand_layout:
            # Expanded combine uses handle metadata instead of recv_topk_idx.
            local_topk_ids = None
            if recv_topk_weights.shape != (recv_hidden_states.shape[0],):
                raise ValueError(
                    "DeepEP v2 expanded activations and router weights must "
                    "have the same receive capacity"
                )
        else:
            num_recv_tokens = int(
                handle.psum_num_recv_tokens_per_scaleup_rank[-1].item()
            )
            recv_topk_idx = recv_topk_idx[:num_recv_tokens]
            recv_topk_weights = recv_topk_weights[:num_recv_tokens]
            recv_hidden_states = recv_hidden_states[:num_recv_tokens]
            if recv_hidden_states_scale is not None:
                recv_hidden_states_scale = recv_hidden_states_scale[:num_recv_tokens]

            # ElasticBuffer already converts global router IDs to receiver-local
            # expert IDs; applying this rank's offset again would discard routes.
            local_topk_ids = recv_topk_idx

        expected_m = 0
        masked_max_m = 0
        total_expanded = 0
        if use_masked:
            recv_capacity = recv_hidden_states.shape[0]
            # expected_m is only a schedule hint; masked_m is the actual bound.
            ep_group_size = max(1, self.num_experts // self.num_local_experts)
            expected_m = max(
                1,
                (local_tokens * ep_group_size * self.router_topk + self.num_experts)
                // self.num_experts,
            )
            # Only the GEMM slab shrinks; ElasticBuffer and collective dispatch
            # keep their configured capacity and existing handle geometry.
            masked_max_m = self._masked_token_capacity(local_tokens, ep_group_size)
            total_expanded = recv_capacity

        # Publish ownership only after the returned metadata is validated.
        self._handle = handle
        return DeepEPv2DispatchOutput(
            recv_hidden_states,
            recv_hidden_states_scale,
            local_topk_ids,
            recv_topk_weights,
            handle.psum_num_recv_tokens_per_expert,
            use_expand_layout,
            use_masked,
            expected_m,
            masked_max_m,
            total_expanded,
            _EXPERT_ALIGNMENT,
            activation_scale_block_size=self.activation_scale_block_size,
        )

    def combine(self, combine_input: DeepEPv2CombineInput) -> torch.Tensor:
        if self._handle is None:
            raise RuntimeError(
                "DeepEP v2 combine called without a valid dispatch handle"
            )
        # Release the single-use handle even when combine fails.
        try:
            if combine_input.routewise_layout is not None:
                raise ValueError(
                    "DeepEP v2 combine requires model route finalization first"
                )
            buffer = self._get_buffer()
            combined_x, _, event = buffer.combine(
                combine_input.hidden_states,
                handle=self._handle,
                topk_weights=combine_input.topk_weights,
            )
            if event.event is not None:
                event.current_stream_wait()
            if self._pad_empty_combine:
                combined_x = combined_x[:0]
            return combined_x
        finally:
            self._pad_empty_combine = False
            self._destroy_handle()


class DeepEPv2Dispatcher(BaseDispatcher):
    def __init__(
        self,
        group: dist.ProcessGroup,
        router_topk: int,
        num_experts: int,
        num_local_experts: int,
        hidden_size: int,
        params_dtype: torch.dtype,
        use_fp8_dispatch: bool,
        activation_scale_block_size: int = _SCALE_BLOCK_SIZE,
    ):
        super().__init__()
        if params_dtype != torch.bfloat16:
            raise NotImplementedError(
                "DeepEP v2 dispatch adapter currently expects BF16 model activations, "
                f"got {params_dtype}"
            )
        scale_format = get_deepep_v2_fp8_scale_format()
        self.num_max_dispatch_tokens_per_rank = (
            envs.SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK.get()
        )
        self.use_fp8_dispatch = use_fp8_dispatch
        self._impl = _DeepEPv2Impl(
            group=group,
            router_topk=router_topk,
            num_experts=num_experts,
            num_local_experts=num_local_experts,
            hidden_size=hidden_size,
            scale_format=scale_format,
            num_max_dispatch_tokens_per_rank=self.num_max_dispatch_tokens_per_rank,
            use_fp8_dispatch=use_fp8_dispatch,
            activation_scale_block_size=activation_scale_block_size,
        )

    def dispatch(
        self, hidden_states: torch.Tensor, topk_output: TopKOutput
    ) -> DispatchOutput:
        return self._impl.dispatch(hidden_states, topk_output)

    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        if combine_input.format != CombineInputFormat.DEEPEP_V2:
            raise TypeError(
                f"Expected DeepEP v2 combine input, got {combine_input.format}"
            )
        return self._impl.combine(combine_input)

    def prebuild(self) -> None:
        """Build the ElasticBuffer eagerly at deployment time (no forward needed)."""
        self._impl.prebuild_buffer()
