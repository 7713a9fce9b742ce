from __future__ import annotations

"""
Support attention backend for TRTLLM MHA kernels from flashinfer.

Prefill dispatch:
  - SM90 / SM120: trtllm_fmha_v2_prefill (Q_PAGED_KV_NHD layout)
  - SM100:        trtllm_batch_context_with_kv_cache (HND layout)

Decode: uses XQA on SM90 and SM120, TRTLLM-GEN on SM100.

Sliding window and attention sink features are supported.
"""

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.kernels.ops.attention.trtllm_mha_graph_metadata import (
    Q_MODE_NONE,
    Q_MODE_STRIDED,
    update_trtllm_mha_graph_metadata,
)
from sglang.kernels.ops.attention.trtllm_mha_page_table import (
    build_trtllm_mha_page_table,
)
from sglang.kernels.ops.attention.utils import canonicalize_stride
from sglang.srt.environ import envs
from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds
from sglang.srt.layers.attention.flashinfer_backend import (
    FlashInferAttnBackend,
    FlashInferMultiStepDraftBackend,
)
from sglang.srt.layers.attention.trtllm_mla_backend import (
    make_persistent_multi_ctas_kv_counter_buffer,
)
from sglang.srt.layers.cp.base import CPAttentionBackendKind, get_cp_strategy
from sglang.srt.layers.cp.utils import is_cp_active
from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import (
    KVCacheAttentionAccessKind,
)
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.kv_loc_plan import IdSpaceKind
from sglang.srt.mem_cache.layout.paged_view import paged_kv_view
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, KVWriteLoc
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.runtime_context import (
    get_buffer,
    get_exec,
    get_parallel,
    get_platform,
    get_schedule,
    get_spec,
    max_prefill_buffer_tokens,
    max_speculative_num_draft_tokens,
)
from sglang.srt.speculative.ragged_verify import (
    build_ragged_target_verify_geometry,
    resolve_ragged_verify_layout,
)
from sglang.srt.utils import is_flashinfer_available

logger = logging.getLogger(__name__)

if is_flashinfer_available():
    import flashinfer

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout
    from sglang.srt.speculative.spec_info import SpecInput

# Constants
# Default workspace size in MB for TRTLLM MHA
# Can be configured via SGLANG_FLASHINFER_WORKSPACE_SIZE environment variable
DEFAULT_WORKSPACE_SIZE_MB = 512
# flashinfer's XQA decode keeps its multi-block semaphores in the first 8 MiB
# of the workspace and needs them zero at every launch.
_XQA_SEMAPHORE_BYTES = 8 * 1024 * 1024

# Reuse this workspace buffer across all TRTLLM MHA wrappers


def _native_fp4_decode_output_capacity(
    max_running_requests: int,
    max_draft_tokens: Optional[int],
    max_cuda_graph_bs: Optional[int] = None,
) -> int:
    """Maximum FP8 output rows for eager/graph decode and target verify."""
    request_capacity = max(max_running_requests, max_cuda_graph_bs or 0)
    return request_capacity * max(1, max_draft_tokens or 1)


def _native_fp4_prefill_output_capacity(
    max_context_len: int,
    max_prefill_tokens: int,
    chunked_prefill_limit: int,
) -> int:
    """Maximum FP8 output rows for one admitted prefill batch."""
    if chunked_prefill_limit > 0:
        return chunked_prefill_limit
    return max(max_context_len, max_prefill_tokens)


def _trtllm_native_nvfp4_kv_buffer(token_to_kv_pool, layer_id: int):
    """Return the pool-owned buffers in TRT-LLM GenMHA's native layout."""
    pool = token_to_kv_pool
    if isinstance(pool, HybridLinearKVPool):
        pool._wait_for_layer(layer_id)
        layer_id = pool._transfer_full_attention_id(layer_id)
        pool = pool.full_kv_pool
    elif pool.layer_transfer_counter is not None:
        pool.layer_transfer_counter.wait_until(layer_id - pool.start_layer)

    local_layer_id = layer_id - pool.start_layer
    if pool.native_k_scale_buffer is None or pool.native_v_scale_buffer is None:
        raise RuntimeError(
            "TRT-LLM native FP4 KV cache requested from a pool without native scales."
        )
    k_scale = pool.native_k_scale_buffer[local_layer_id]
    v_scale = pool.native_v_scale_buffer[local_layer_id]
    scale_view_dtype = pool.quant_method.scale_buffer_view_dtype()
    if scale_view_dtype is not None:
        k_scale = k_scale.view(scale_view_dtype)
        v_scale = v_scale.view(scale_view_dtype)
    return (
        pool.k_buffer[local_layer_id],
        pool.v_buffer[local_layer_id],
        k_scale,
        v_scale,
    )


@dataclass
class TRTLLMMHAMetadata:
    # Sequence lengths for the forward batch
    cache_seqlens_int32: torch.Tensor = None
    # Maximum sequence length for query
    max_seq_len_q: int = 1
    # Cumulative sequence lengths for `query
    cu_seqlens_q: torch.Tensor = None
    # Cumulative sequence lengths for key
    cu_seqlens_k: torch.Tensor = None
    # Page table, the index of KV Cache Tables/Blocks
    page_table: torch.Tensor = None
    # Page table for SWA layers (translated from full pool indices to SWA pool indices)
    swa_page_table: torch.Tensor = None
    # CP zigzag treats prev/next halves as a synthetic 2 * batch_size batch.
    zigzag_page_table: torch.Tensor = None
    zigzag_swa_page_table: torch.Tensor = None
    # full->SWA translated out_cache_loc (SWA KV-store write target)
    swa_out_cache_loc: torch.Tensor = None
    is_ragged_verify: bool = False
    # ENCODER_ONLY target-verify (bidirectional attention over the window):
    # bs*L single-token decode rows whose kv length spans the whole window,
    # so each token attends the full window despite the causal decode kernel.
    encoder_cache_seqlens: torch.Tensor = None
    encoder_page_table: torch.Tensor = None
    encoder_row_map: torch.Tensor = None
    # Prefix before trailing one-token requests; -1 means there is no decode tail.
    mixed_prefill_reqs: int = -1
    mixed_prefill_tokens: int = 0
    # fmha_v2 prefill: the (row, column) of each page-table entry the batch
    # reads, in copy order, and the block table over that copy.
    fmha_v2_copy_rows: torch.Tensor = None
    fmha_v2_copy_cols: torch.Tensor = None
    fmha_v2_block_table: torch.Tensor = None
    # Per-forward memoization of pre-expanded [B, 2, M] fmha_v2 block tables
    fmha_v2_block_tables: Optional[dict] = None


class TRTLLMHAAttnBackend(FlashInferAttnBackend):
    """TRTLLM MHA attention kernel from flashinfer."""

    # Build the page table on-device from seq_lens (incl. the SWA-translated table
    # via the full->SWA lookup; see _fill_page_table_device), so we never need the
    # seq_lens_cpu D2H sync; opt out of it, matching trtllm_mla / triton.
    needs_cpu_seq_lens: bool = False

    supports_ragged_verify_graph: bool = True

    def shared_read_ends(self, fm: ForwardMode) -> SharedReadEnds:
        # Prefill metadata init snapshots all scheduler-shared inputs pre-replay.
        if fm == ForwardMode.EXTEND:
            return SharedReadEnds.PRE_REPLAY
        return super().shared_read_ends(fm)

    def __init__(
        self,
        model_runner: ModelRunner,
        skip_prefill: bool = False,
        kv_indptr_buf: Optional[torch.Tensor] = None,
        kv_last_page_len_buf: Optional[torch.Tensor] = None,
        speculative_step_id: int = 0,
    ):
        # Capture workspace size before super().__init__() to preserve user's
        # SGLANG_FLASHINFER_WORKSPACE_SIZE setting (may be overridden by parent)
        env_var = envs.SGLANG_FLASHINFER_WORKSPACE_SIZE
        workspace_size_bytes = (
            env_var.get()
            if env_var.is_set()
            else DEFAULT_WORKSPACE_SIZE_MB * 1024 * 1024
        )

        super().__init__(
            model_runner, skip_prefill, kv_indptr_buf, kv_last_page_len_buf
        )
        self.prefill_kv_access = self.kv_cache_quant_method.resolve_attention_access(
            "prefill", "trtllm_mha"
        )
        self.decode_kv_access = self.kv_cache_quant_method.resolve_attention_access(
            "decode", "trtllm_mha"
        )
        prefill_is_trtllm_mha = (
            model_runner.prefill_attention_backend_str == "trtllm_mha"
        )
        decode_is_trtllm_mha = model_runner.decode_attention_backend_str == "trtllm_mha"
        if prefill_is_trtllm_mha:
            self._check_prefill_kv_access()
        if decode_is_trtllm_mha:
            self._check_decode_kv_access()
        self.prefill_uses_native_fp4 = (
            prefill_is_trtllm_mha
            and self.prefill_kv_access.kind == KVCacheAttentionAccessKind.NATIVE_FP4
        )
        self.decode_uses_native_fp4 = (
            decode_is_trtllm_mha
            and self.decode_kv_access.kind == KVCacheAttentionAccessKind.NATIVE_FP4
        )
        self.is_nvfp4_kvcache = (
            self.prefill_uses_native_fp4
            and self.prefill_kv_access.scale_recipe == "nvfp4"
        ) or (
            self.decode_uses_native_fp4
            and self.decode_kv_access.scale_recipe == "nvfp4"
        )

        config = model_runner.model_config

        # MHA-specific dimensions
        self.max_context_len = model_runner.model_config.context_len
        self.hidden_size = config.hidden_size

        # Runtime parameters
        self.data_type = model_runner.kv_cache_dtype
        self.q_data_type = model_runner.dtype
        self.page_size = model_runner.page_size
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.device = model_runner.device

        # XQA (SM90/SM120) consumes the legacy linear NVFP4 scale layout and
        # BF16 Q/O. TRT-LLM GenMHA (SM100) consumes physical HND scales and
        # requires FP8 Q/O.
        self.is_xqa_impl = get_platform().is_sm90 or get_platform().is_sm120
        if self.prefill_uses_native_fp4 and self.is_xqa_impl:
            raise ValueError(
                "Native NVFP4 prefill with trtllm_mha requires SM100 "
                "TRT-LLM GenMHA. Use --prefill-attention-backend flashinfer "
                "with XQA on SM90/SM120."
            )
        self.uses_trtllm_gen_native_fp4 = self.is_nvfp4_kvcache and not self.is_xqa_impl

        # Speculative decoding
        # Only support topk <= 1 for now.
        self.topk = get_spec().speculative_eagle_topk or 0
        self.speculative_step_id = speculative_step_id
        self.target_verify_metadata = {}
        self.speculative_num_draft_tokens = get_spec().speculative_num_draft_tokens

        self._nvfp4_fp8_output = None
        if self.uses_trtllm_gen_native_fp4:
            prefill_limit = 0
            if self.prefill_uses_native_fp4 and not skip_prefill:
                # Includes PP dynamic-chunk growth and piecewise capture bounds.
                prefill_limit = _native_fp4_prefill_output_capacity(
                    self.max_context_len,
                    get_schedule().max_prefill_tokens or 0,
                    max_prefill_buffer_tokens(),
                )
            decode_limit = 0
            if self.decode_uses_native_fp4:
                # TARGET_VERIFY submits one query row per draft token. Use the
                # widest adaptive-spec candidate too: the output buffer is
                # shared by eager execution and every captured CUDA graph.
                decode_limit = _native_fp4_decode_output_capacity(
                    model_runner.max_running_requests,
                    max_speculative_num_draft_tokens(),
                    get_exec().graph.cuda_graph_config.decode.max_bs,
                )
            max_native_tokens = max(prefill_limit, decode_limit)
            num_q_heads = config.num_attention_heads // get_parallel().attn_tp_size
            self._nvfp4_fp8_output = get_buffer(
                f"trtllm_mha_nvfp4_output_{max_native_tokens}_"
                f"{num_q_heads}_{config.head_dim}",
                lambda: torch.empty(
                    (max_native_tokens, num_q_heads, config.head_dim),
                    dtype=torch.float8_e4m3fn,
                    device=self.device,
                ),
            )

        # Workspace allocation
        self.workspace_size = workspace_size_bytes
        semaphore_bytes = _XQA_SEMAPHORE_BYTES if self.is_xqa_impl else 0
        # Allocate buffers
        self.workspace_buffer = get_buffer(
            "trtllm_mha_zero_workspace",
            lambda: torch.zeros(
                semaphore_bytes + self.workspace_size,
                dtype=torch.uint8,
                device=model_runner.device,
            ),
        )
        self.fmha_v2_workspace_buffer = self.workspace_buffer[semaphore_bytes:]

        # CUDA graph state
        self.decode_cuda_graph_metadata = {}

        # True iff the model declares ENCODER_ONLY (bidirectional) layers, which
        # need the expanded TARGET_VERIFY metadata (TRTLLMMHAMetadata.encoder_*).
        self.expand_encoder_only_verify = any(
            getattr(module, "attn_type", None) == AttentionType.ENCODER_ONLY
            for module in model_runner.model.modules()
        )

        # SWA hybrid models split the KV cache into full and SWA pools with
        # separate index spaces; SWA layers need a translated page_table.
        self._swa_kv_pool: Optional[SWAKVPool] = self._resolve_swa_kv_pool(model_runner)
        # Raw full->swa index mapping tensor for the fused cuda-graph
        # metadata kernel (gather + // page_size happen on device). The unified
        # pool has no token-level mapping, so this is a static-pool mechanism.
        if (
            self._swa_kv_pool is not None
            and not self.kv_index_translator.is_translating
        ):
            self._swa_full_to_swa_mapping = self._swa_kv_pool.full_to_swa_index_mapping
            assert self._swa_full_to_swa_mapping is not None, (
                "SWA pool must register full_to_swa_index_mapping before "
                "TRTLLMHAAttnBackend is constructed"
            )
        else:
            self._swa_full_to_swa_mapping = None

        # Static page-table width (upper bound). The CUDA-graph path builds the
        # page table on-device sized to this constant, so it never reads a runtime
        # max. See _fill_page_table_device.
        self.max_num_pages = (
            self.max_context_len + self.page_size - 1
        ) // self.page_size

        # Forward metadata
        self.forward_metadata: Optional[TRTLLMMHAMetadata] = None

        # Init backend (XQA or TRTLLM-GEN)
        # We need to specify q_type and out_type for different backend
        # XQA: (q_type must be bf16)
        #   KV bf16: q_type = bf16, out_type=model_runner.dtype
        #   KV fp8: q_type = bf16, out_type=model_runner.dtype
        # TRTLLM-GEN:
        #   KV bf16: q_type = bf16, out_type=model_runner.dtype
        #   KV fp8: q_type = fp8, out_type=model_runner.dtype
        # fmha_v2 prefill kernel supports SM90 and SM120
        self.use_fmha_v2 = get_platform().is_sm90 or get_platform().is_sm120
        # trtllm-gen serves page_size >= 128 only through its dynamic
        # tokens-per-page kernels, which exist solely for GQA with equal QK/V
        # head dims (power-of-2 pages). Mirror that precondition here so an
        # unsupported combo fails at construction instead of as a
        # "Missing TRTLLM-GEN kernel" error during CUDA-graph capture.
        # XQA (SM90/SM120 decode) has native page-128 kernels; no check needed.
        if self.page_size >= 128 and not self.is_xqa_impl:
            attn_tp_size = get_parallel().attn_tp_size
            num_q_heads = config.num_attention_heads // attn_tp_size
            num_kv_heads = config.get_num_kv_heads(attn_tp_size)
            if (
                num_q_heads // num_kv_heads <= 1
                or config.head_dim != config.v_head_dim
                or self.page_size & (self.page_size - 1) != 0
            ):
                raise ValueError(
                    f"trtllm_mha with page_size={self.page_size} requires "
                    f"trtllm-gen's dynamic tokens-per-page kernels, which only "
                    f"support GQA (q heads per kv head > 1, got "
                    f"{num_q_heads}/{num_kv_heads}) with equal QK/V head dims "
                    f"(got {config.head_dim}/{config.v_head_dim}) and a "
                    f"power-of-2 page size. Use --page-size 64 instead."
                )

        # Owned here, and sized for the widest batch this backend can see, so
        # FlashInfer does not allocate and zero a fresh counter buffer per
        # attention layer inside the captured decode graph.
        self._multi_ctas_kv_counter_buffer = (
            make_persistent_multi_ctas_kv_counter_buffer(
                torch.device(self.device),
                num_q_heads=config.num_attention_heads,
                max_batch_size=(model_runner.max_running_requests + 1)
                * max(1, self.speculative_num_draft_tokens or 1),
            )
        )
        # Same reason for the fused FP8 KV-cache write's fallback scales: it
        # needs float32 [1] tensors, and layers without checkpoint kv scales
        # would otherwise have torch.ones() build them on every call.
        self._default_kv_scale = get_buffer(
            "trtllm_mha_default_kv_scale",
            lambda: torch.ones(1, dtype=torch.float32, device=self.device),
        )
        self.decode_seq_len_splits = envs.SGLANG_TRTLLM_MHA_DECODE_SEQ_LEN_SPLITS.get()
        if self.decode_seq_len_splits < 1:
            raise ValueError(
                "SGLANG_TRTLLM_MHA_DECODE_SEQ_LEN_SPLITS must be at least 1, "
                f"got {self.decode_seq_len_splits}"
            )
        self._xqa_spec_dec_mask = None
        if self.is_xqa_impl and self.speculative_num_draft_tokens:
            draft_len = self.speculative_num_draft_tokens
            max_bs = model_runner.max_running_requests + 1
            words_per_row = (draft_len + 31) // 32 * 2
            row = torch.arange(draft_len, dtype=torch.int32)[:, None]
            word = torch.arange(words_per_row, dtype=torch.int32)[None, :]
            bits = (row + 1 - 16 * word).clamp(0, 16)
            mask = ((1 << bits) - 1).to(torch.uint16)
            self._xqa_spec_dec_mask = (
                mask.unsqueeze(0).expand(max_bs, -1, -1).contiguous().to(self.device)
            )

    def _fmha_v2_paged_inputs(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
    ):
        """Build (qkv, block_tables) for trtllm_fmha_v2_prefill.

        The kernel addresses K and V blocks from k_cache's base pointer via
        int32 block offsets. When K and V are contiguous and V sits at a
        block-aligned offset from K (the fused pool halves), pass them with
        pre-expanded [B, 2, M] offsets, avoiding an expensive copy of KV caches.
        """
        block_bytes = k_cache.stride(0) * k_cache.element_size()
        delta, rem = divmod(v_cache.data_ptr() - k_cache.data_ptr(), block_bytes)
        if (
            rem != 0
            or not 0 < delta < torch.iinfo(torch.int32).max // 2
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        ):
            logger.warning_once(
                "fmha_v2 prefill: K/V caches are not contiguous block-aligned halves "
                "of one allocation, so every prefill copies the batch's KV pages (slow)."
            )
            paged_kv, block_tables = self._fmha_v2_paged_kv(
                k_cache, v_cache, page_table
            )
            return (q, paged_kv), block_tables

        tables = self.forward_metadata.fmha_v2_block_tables
        if tables is None:
            tables = self.forward_metadata.fmha_v2_block_tables = {}
        key = (page_table.data_ptr(), tuple(page_table.shape), delta)
        expanded = tables.get(key)
        if expanded is None:
            expanded = tables[key] = torch.stack(
                [page_table, page_table + delta], dim=1
            )
        return (q, (k_cache, v_cache)), expanded

    def _check_decode_kv_access(self) -> None:
        supported_kinds = {
            KVCacheAttentionAccessKind.PLAIN,
            KVCacheAttentionAccessKind.NATIVE_FP4,
        }
        if (
            self.decode_kv_access is not None
            and self.decode_kv_access.kind in supported_kinds
        ):
            return

        method_name = getattr(self.kv_cache_quant_method, "name", "unknown")
        available = self.kv_cache_quant_method.describe_attention_accesses("decode")
        raise ValueError(
            f"KV cache method {method_name!r} does not support decode with "
            f"trtllm_mha. Available decode accesses: {available}."
        )

    def _check_prefill_kv_access(self) -> None:
        supported_kinds = {
            KVCacheAttentionAccessKind.PLAIN,
            KVCacheAttentionAccessKind.NATIVE_FP4,
        }
        if (
            self.prefill_kv_access is not None
            and self.prefill_kv_access.kind in supported_kinds
        ):
            return

        method_name = getattr(self.kv_cache_quant_method, "name", "unknown")
        available = self.kv_cache_quant_method.describe_attention_accesses("prefill")
        raise ValueError(
            f"KV cache method {method_name!r} does not support prefill with "
            f"trtllm_mha. Available prefill accesses: {available}."
        )

    def _nvfp4_output_view(self, q: torch.Tensor) -> torch.Tensor:
        if self._nvfp4_fp8_output is None:
            raise RuntimeError("Native NVFP4 output buffer was not initialized.")
        if q.shape[0] > self._nvfp4_fp8_output.shape[0]:
            raise RuntimeError(
                "TRT-LLM NVFP4 attention received more query tokens than its "
                f"preallocated FP8 output buffer: {q.shape[0]} > "
                f"{self._nvfp4_fp8_output.shape[0]}. Increase "
                "--chunked-prefill-size, --max-running-requests, or the "
                "speculative/CUDA-graph output capacity."
            )
        return self._nvfp4_fp8_output[: q.shape[0]].view_as(q)

    def _forward_extend_uses_native_fp4(self, forward_batch: ForwardBatch) -> bool:
        """Whether this extend-family call must consume physical NVFP4.

        A hybrid backend can route TARGET_VERIFY to its decode child. That
        child's normal extend role belongs to FlashInfer, so its prefill flag
        is false even though this particular verify call must use the native
        GenMHA decode layout.
        """
        return self.uses_trtllm_gen_native_fp4 and (
            self.prefill_uses_native_fp4
            or (
                self.decode_uses_native_fp4
                and forward_batch.forward_mode.is_target_verify()
            )
        )

    def _finalize_nvfp4_output(
        self, output: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        if output.dtype == self.q_data_type:
            return output
        model_output = forward_batch._attn_output
        if model_output is not None and model_output.numel() == output.numel():
            model_output = model_output.view_as(output)
            model_output.copy_(output)
            return model_output
        return output.to(self.q_data_type)

    @staticmethod
    def _resolve_swa_kv_pool(model_runner: ModelRunner) -> Optional[SWAKVPool]:
        """Return the SWAKVPool to translate against, or None for non-SWA models.

        EAGLE draft workers share the target allocator for token bookkeeping,
        but own a separate draft KV pool. Do not use the target allocator's
        SWA mapping for that draft pool. FROZEN_KV MTP is the exception: its
        draft path reads target KV directly, so it still needs the allocator
        pool when the active pool is not SWA.
        """
        active_pool = model_runner.token_to_kv_pool
        if isinstance(active_pool, SWAKVPool):
            return active_pool

        if model_runner.is_draft_worker:
            if not model_runner.spec_algorithm.is_frozen_kv_mtp():
                return None

        allocator = model_runner.token_to_kv_pool_allocator
        kvcache = allocator.get_kvcache()
        return kvcache if isinstance(kvcache, SWAKVPool) else None

    def _alloc_swa_page_table(
        self, max_bs: int, max_num_pages: int
    ) -> Optional[torch.Tensor]:
        """Allocate a SWA page_table buffer, or return None for non-SWA models."""
        if self._swa_kv_pool is None:
            return None
        return torch.zeros(max_bs, max_num_pages, dtype=torch.int32, device=self.device)

    def _fill_page_table_device(
        self,
        metadata: TRTLLMMHAMetadata,
        req_pool_indices: torch.Tensor,
        cache_seqlens: torch.Tensor,
    ):
        """Build the page table on-device from per-request KV lengths (no sync).

        Fills ``metadata.page_table`` (a [bs, max_num_pages] buffer) in place with
        block ids derived from ``cache_seqlens`` (a GPU tensor); for SWA models it
        also fills ``metadata.swa_page_table`` via the full->SWA lookup. The Triton
        kernel self-guards per request on the device-side length, so the grid and
        buffer width use the static ``max_num_pages`` upper bound while the actual
        writes stay bounded by ``cache_seqlens`` — no host-side max / D2H sync.
        """
        has_swa = self._swa_kv_pool is not None
        build_trtllm_mha_page_table(
            req_to_token=self.req_to_token,
            req_pool_indices=req_pool_indices,
            cache_seqlens=cache_seqlens,
            page_table=metadata.page_table,
            page_size=self.page_size,
            swa_page_table=metadata.swa_page_table if has_swa else None,
            full_to_swa=(
                self._swa_kv_pool.full_to_swa_index_mapping if has_swa else None
            ),
        )

    def _get_layer_cache_loc(
        self,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Return cache locations in the correct index space for the given layer."""
        if self._swa_kv_pool is not None:
            _, is_swa = self._swa_kv_pool.layers_mapping[layer.layer_id]
            if is_swa:
                swa_loc = self.forward_metadata.swa_out_cache_loc
                assert (
                    swa_loc is not None
                    and swa_loc.shape[0] >= forward_batch.out_cache_loc.shape[0]
                ), (
                    "SWA write locs missing or too short: init_forward_metadata "
                    "must translate out_cache_loc once; a per-layer gather of "
                    "the live mapping would race the scheduler after the WAR "
                    "fence releases"
                )
                # Piecewise prefill narrows out_cache_loc per attention call;
                # the snapshot keeps the padded batch length.
                return swa_loc[: forward_batch.out_cache_loc.shape[0]]
        return forward_batch.out_cache_loc

    def _bind_swa_page_table(
        self, metadata: TRTLLMMHAMetadata, source: dict, key: str, bs: int
    ):
        """Bind a pre-allocated SWA page_table slice to metadata for CUDA graph."""
        buf = source.get(key)
        if buf is not None:
            metadata.swa_page_table = buf[:bs, :]

    def _get_layer_page_table(
        self, layer: RadixAttention, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """Return the correct page_table for the given layer (SWA or full)."""
        swa_pt = self.forward_metadata.swa_page_table
        if swa_pt is not None:
            _, is_swa = self._swa_kv_pool.layers_mapping[layer.layer_id]
            if is_swa:
                return swa_pt
        return self.forward_metadata.page_table

    def _maybe_build_cp_zigzag_page_tables(
        self,
        metadata: TRTLLMMHAMetadata,
        forward_batch: ForwardBatch,
    ) -> None:
        """Duplicate request rows once for the combined prev-then-next CP launch."""
        if not is_cp_active(forward_batch):
            return

        # TODO: Avoid materializing duplicated page tables to reduce zigzag CP
        # page-table memory usage.
        metadata.zigzag_page_table = torch.cat(
            (metadata.page_table, metadata.page_table), dim=0
        )
        if metadata.swa_page_table is not None:
            metadata.zigzag_swa_page_table = torch.cat(
                (metadata.swa_page_table, metadata.swa_page_table), dim=0
            )

    @staticmethod
    def _get_scalar_scale(
        layer: RadixAttention,
        float_attr: str,
        scale_attr: str,
    ) -> float:
        scale = getattr(layer, float_attr, None)
        if scale is None:
            scale = getattr(layer, scale_attr, None)
        if scale is None:
            return 1.0
        if isinstance(scale, torch.Tensor):
            logger.warning_once(
                "Ignoring tensor %s for TRT-LLM MHA FP8 KV cache scale. "
                "Expected %s to be populated with a Python scalar.",
                scale_attr,
                float_attr,
            )
            return 1.0
        scale = float(scale)
        return scale if scale > 0.0 else 1.0

    def _get_bmm_scales(
        self, layer: RadixAttention, q_scale: float | torch.Tensor = 1.0
    ) -> tuple[float | torch.Tensor, float]:
        """Return FlashInfer TRT-LLM MHA BMM scales.

        The FP8 paths store Q/K/V as values divided by their per-tensor scales.
        FlashInfer applies bmm1_scale to QK and bmm2_scale to PV, so FP8 reads
        need Q and K descales in BMM1 and V descale in BMM2. Non-FP8 KV cache
        entries are already in model dtype.
        """
        if self.data_type != torch.float8_e4m3fn:
            return layer.scaling, 1.0

        k_scale = self._get_scalar_scale(layer, "k_scale_float", "k_scale")
        v_scale = self._get_scalar_scale(layer, "v_scale_float", "v_scale")
        return q_scale * k_scale * layer.scaling, v_scale

    def init_cuda_graph_state(
        self,
        max_bs: int,
        max_num_tokens: int,
        kv_indices_buf: Optional[torch.Tensor] = None,
    ):
        """Initialize CUDA graph state for TRTLLM MHA."""
        max_num_pages = self.max_num_pages
        self.decode_cuda_graph_metadata = {
            "cache_seqlens": torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            "page_table": torch.zeros(
                max_bs,
                max_num_pages,
                dtype=torch.int32,
                device=self.device,
            ),
            "swa_page_table": self._alloc_swa_page_table(max_bs, max_num_pages),
        }

        # SWA write-target buffer; bound as a [:num_tokens] view in
        # _build_cuda_graph_metadata and refilled by the fused metadata kernel.
        self.cuda_graph_swa_out_cache_loc = (
            torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
            if self.use_sliding_window_kv_pool
            else None
        )

        if (
            self.speculative_num_draft_tokens is not None
            and self.speculative_num_draft_tokens > 0
        ):
            self.decode_cuda_graph_metadata["cu_seqlens_q"] = torch.arange(
                0, max_bs + 1, dtype=torch.int32, device=self.device
            )
            self.decode_cuda_graph_metadata["cu_seqlens_k"] = torch.zeros(
                max_bs + 1, dtype=torch.int32, device=self.device
            )
            self.decode_cuda_graph_metadata["page_table_draft_decode"] = torch.zeros(
                max_bs,
                max_num_pages,
                dtype=torch.int32,
                device=self.device,
            )
            self.decode_cuda_graph_metadata["swa_page_table_draft_decode"] = (
                self._alloc_swa_page_table(max_bs, max_num_pages)
            )

            self.target_verify_metadata = {
                "cache_seqlens": torch.zeros(
                    max_bs, dtype=torch.int32, device=self.device
                ),
                # Static uniform preset (Q_MODE_NONE: the fused kernel never
                # rewrites it). Ragged verify overwrites the [:bs+1] slice
                # eagerly on every capture/replay-prep, and the ragged-verify
                # mode is fixed for the whole server run, so the two never mix.
                "cu_seqlens_q": torch.arange(
                    0,
                    max_bs * self.speculative_num_draft_tokens + 1,
                    step=self.speculative_num_draft_tokens,
                    dtype=torch.int32,
                    device=self.device,
                ),
                "cu_seqlens_k": torch.zeros(
                    max_bs + 1, dtype=torch.int32, device=self.device
                ),
                "page_table": torch.zeros(
                    max_bs,
                    max_num_pages,
                    dtype=torch.int32,
                    device=self.device,
                ),
                "swa_page_table": self._alloc_swa_page_table(max_bs, max_num_pages),
            }
            if self.expand_encoder_only_verify:
                max_verify_rows = max_bs * self.speculative_num_draft_tokens
                self.target_verify_metadata["encoder_cache_seqlens"] = torch.zeros(
                    max_verify_rows, dtype=torch.int32, device=self.device
                )
                self.target_verify_metadata["encoder_page_table"] = torch.zeros(
                    max_verify_rows,
                    max_num_pages,
                    dtype=torch.int32,
                    device=self.device,
                )

            self.draft_extend_metadata = {
                "cache_seqlens": torch.zeros(
                    max_bs, dtype=torch.int32, device=self.device
                ),
                "cu_seqlens_q": torch.zeros(
                    max_bs + 1,
                    dtype=torch.int32,
                    device=self.device,
                ),
                "cu_seqlens_k": torch.zeros(
                    max_bs + 1, dtype=torch.int32, device=self.device
                ),
                "page_table": torch.zeros(
                    max_bs,
                    max_num_pages,
                    dtype=torch.int32,
                    device=self.device,
                ),
                "swa_page_table": self._alloc_swa_page_table(max_bs, max_num_pages),
            }

    def _build_cuda_graph_metadata(
        self,
        bs: int,
        num_tokens: int,
        forward_mode: ForwardMode,
        spec_info,
        device: torch.device,
    ) -> TRTLLMMHAMetadata:
        """Create TRTLLMMHAMetadata with pre-allocated buffer slice refs, stored in the dict."""
        metadata = TRTLLMMHAMetadata()

        if forward_mode.is_decode_or_idle():
            if spec_info is not None:
                # Draft Decode (topk = 1)
                metadata.cache_seqlens_int32 = self.decode_cuda_graph_metadata[
                    "cache_seqlens"
                ][:bs]
                metadata.cu_seqlens_q = self.decode_cuda_graph_metadata["cu_seqlens_q"][
                    : bs + 1
                ]
                metadata.cu_seqlens_k = self.decode_cuda_graph_metadata["cu_seqlens_k"][
                    : bs + 1
                ]
                metadata.page_table = self.decode_cuda_graph_metadata[
                    "page_table_draft_decode"
                ][:bs, :]
                self._bind_swa_page_table(
                    metadata,
                    self.decode_cuda_graph_metadata,
                    "swa_page_table_draft_decode",
                    bs,
                )
                self.decode_cuda_graph_metadata[bs] = metadata
            else:
                # Normal Decode
                metadata.cache_seqlens_int32 = self.decode_cuda_graph_metadata[
                    "cache_seqlens"
                ][:bs]
                metadata.cu_seqlens_q = torch.arange(
                    0, bs + 1, dtype=torch.int32, device=device
                )
                metadata.cu_seqlens_k = torch.zeros(
                    bs + 1, dtype=torch.int32, device=device
                )
                metadata.page_table = self.decode_cuda_graph_metadata["page_table"][
                    :bs, :
                ]
                self._bind_swa_page_table(
                    metadata,
                    self.decode_cuda_graph_metadata,
                    "swa_page_table",
                    bs,
                )
                self.decode_cuda_graph_metadata[bs] = metadata
        elif forward_mode.is_target_verify():
            # Target Verify (topk = 1)
            metadata.cache_seqlens_int32 = self.target_verify_metadata["cache_seqlens"][
                :bs
            ]
            metadata.cu_seqlens_q = self.target_verify_metadata["cu_seqlens_q"][
                : bs + 1
            ]
            metadata.cu_seqlens_k = self.target_verify_metadata["cu_seqlens_k"][
                : bs + 1
            ]
            metadata.is_ragged_verify = (
                spec_info is not None and spec_info.ragged_verify_layout is not None
            )
            metadata.max_seq_len_q = (
                self.speculative_num_draft_tokens
                if metadata.is_ragged_verify
                else num_tokens // bs
            )
            metadata.page_table = self.target_verify_metadata["page_table"][:bs, :]
            self._bind_swa_page_table(
                metadata,
                self.target_verify_metadata,
                "swa_page_table",
                bs,
            )
            if self._needs_encoder_only_expand(forward_mode, metadata):
                verify_rows = bs * metadata.max_seq_len_q
                # Static per-capture row map (expanded row i -> request i // L);
                # the recorded refresh in _apply_cuda_graph_metadata uses it.
                metadata.encoder_row_map = (
                    torch.arange(verify_rows, device=self.device)
                    // metadata.max_seq_len_q
                )
                metadata.encoder_cache_seqlens = self.target_verify_metadata[
                    "encoder_cache_seqlens"
                ][:verify_rows]
                metadata.encoder_page_table = self.target_verify_metadata[
                    "encoder_page_table"
                ][:verify_rows, :]
            self.target_verify_metadata[bs] = metadata
        elif forward_mode.is_draft_extend_v2():
            num_tokens_per_req = spec_info.num_tokens_per_req
            metadata.cache_seqlens_int32 = self.draft_extend_metadata["cache_seqlens"][
                :bs
            ]
            metadata.cu_seqlens_q = self.draft_extend_metadata["cu_seqlens_q"][: bs + 1]
            metadata.cu_seqlens_k = self.draft_extend_metadata["cu_seqlens_k"][: bs + 1]
            metadata.max_seq_len_q = num_tokens_per_req
            metadata.page_table = self.draft_extend_metadata["page_table"][:bs, :]
            self._bind_swa_page_table(
                metadata,
                self.draft_extend_metadata,
                "swa_page_table",
                bs,
            )
            self.draft_extend_metadata[bs] = metadata

        # Bind the SWA write-target buffer slice (refilled by in-graph metadata).
        if self.use_sliding_window_kv_pool:
            metadata.swa_out_cache_loc = self.cuda_graph_swa_out_cache_loc[:num_tokens]

        return metadata

    def _needs_encoder_only_expand(
        self, forward_mode: ForwardMode, metadata: TRTLLMMHAMetadata
    ) -> bool:
        # The single gate for building the expanded ENCODER_ONLY verify
        # metadata; forward() consumes it per-layer where attn_type is ENCODER_ONLY.
        return (
            self.expand_encoder_only_verify
            and forward_mode.is_target_verify()
            and not metadata.is_ragged_verify
        )

    def _apply_cuda_graph_metadata(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInput],
        out_cache_loc: Optional[torch.Tensor] = None,
    ):
        """Shared capture+replay body for the cuda-graph init path.

        One fused triton kernel (update_trtllm_mha_graph_metadata) rebuilds
        cache_seqlens, cu_seqlens_k/q, the page table(s), and swa_out_cache_loc.
        The previous aten-op implementation issued ~25 host dispatches per graph
        replay, whose per-rank jitter was paid as spin time inside the first
        all-reduce of every replayed graph.

        The page table is rewritten to the static ``max_num_pages`` width (the
        same upper bound ``_fill_page_table_device`` uses); the kernel
        bounds the actual KV reads by the on-device ``cache_seqlens``, so no
        runtime host max / seq_lens_cpu D2H sync is needed.

        Public entry: :py:meth:`init_forward_metadata_in_graph`.
        """
        seq_lens = seq_lens[:bs]
        req_pool_indices = req_pool_indices[:bs]

        metadata = None
        seqlen_offset = 0
        cu_seqlens_q = None
        qlens = None
        q_stride = 0
        q_mode = Q_MODE_NONE
        if forward_mode.is_decode_or_idle():
            if spec_info is not None:
                # Draft Decode
                # Here we only support topk = 1 for now.
                metadata = self.decode_cuda_graph_metadata[bs]
                seqlen_offset = self.speculative_step_id + 1
            else:
                # Normal Decode
                metadata = self.decode_cuda_graph_metadata[bs]
        elif forward_mode.is_target_verify():
            # Here we only support topk = 1 for now.
            metadata = self.target_verify_metadata[bs]
            if spec_info is not None and spec_info.ragged_verify_layout is not None:
                # Ragged verify: the per-request k-extension is not a
                # uniform scalar seqlen_offset, so the fused kernel cannot
                # rebuild this metadata. It is written eagerly on every
                # capture/replay-prep in init_forward_metadata_out_graph;
                # record nothing here.
                return
            seqlen_offset = metadata.max_seq_len_q
        elif forward_mode.is_draft_extend_v2():
            metadata = self.draft_extend_metadata[bs]
            # Static per-request query width, fixed by the captured graph shape.
            # Do not inspect replay-time tensors here; this body is recorded into
            # the CUDA graph.
            num_tokens_per_req = metadata.max_seq_len_q
            cu_seqlens_q = metadata.cu_seqlens_q
            q_stride = num_tokens_per_req
            q_mode = Q_MODE_STRIDED
        else:
            raise ValueError(
                "TRTLLM-MHA CUDA graph metadata build got an unsupported forward "
                f"mode: {forward_mode}"
            )

        assert metadata is not None
        # Static upper-bound page-table width (see docstring); the kernel
        # bounds real KV reads by cache_seqlens, so this is a fixed loop
        # bound only — never a host max / seq_lens_cpu D2H sync.
        max_seq_pages = self.max_num_pages
        unified = self.kv_index_translator.is_translating
        update_trtllm_mha_graph_metadata(
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            req_to_token=self.req_to_token,
            cache_seqlens=metadata.cache_seqlens_int32,
            cu_seqlens_k=metadata.cu_seqlens_k,
            page_table=None if unified else metadata.page_table,
            bs=bs,
            seqlen_offset=seqlen_offset,
            max_seq_pages=max_seq_pages,
            page_size=self.page_size,
            swa_mapping=self._swa_full_to_swa_mapping,
            swa_page_table=None if unified else metadata.swa_page_table,
            out_cache_loc=out_cache_loc,
            swa_out_cache_loc=None if unified else metadata.swa_out_cache_loc,
            cu_seqlens_q=cu_seqlens_q,
            qlens=qlens,
            q_stride=q_stride,
            q_mode=q_mode,
            skip_page_table=unified,
        )

        if self._needs_encoder_only_expand(forward_mode, metadata):
            # Recorded into the graph: refresh the expanded rows from the
            # freshly rebuilt base metadata.
            metadata.encoder_cache_seqlens.copy_(
                metadata.cache_seqlens_int32[metadata.encoder_row_map]
            )
            metadata.encoder_page_table.copy_(
                metadata.page_table[metadata.encoder_row_map]
            )

        self.forward_metadata = metadata

    def update_verify_buffers_to_fill_after_draft(
        self, spec_info: SpecInput, cuda_graph_bs: Optional[int]
    ):
        pass

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Get the fill value for sequence lengths in CUDA graph."""
        return 1

    def _should_use_fused_fp8_path(
        self, save_kv_cache: bool, k: torch.Tensor, forward_batch: ForwardBatch
    ) -> bool:
        """Check if we should use the fused FP8 KV cache write path."""
        return (
            not is_cp_active(forward_batch)
            and save_kv_cache
            and k is not None
            and self.data_type == torch.float8_e4m3fn
        )

    def _fused_fp8_qkv_kv_cache(
        self,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor | None:
        from sglang.kernels.ops.kvcache.fused_fp8_qkv_kv_cache import (
            fused_fp8_qkv_kv_cache,
        )

        cache_loc = self._get_layer_cache_loc(layer, forward_batch)
        k_cache, v_cache = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        # Layers without checkpoint KV scales fall back to the backend-owned
        # float32 ones tensor; letting the op synthesize one costs a fill
        # kernel per layer per forward, baked into the captured graph.
        return fused_fp8_qkv_kv_cache(
            q=q,
            k=k,
            v=v,
            k_cache=k_cache,
            v_cache=v_cache,
            cache_loc=cache_loc,
            k_scale=(
                layer.k_scale if layer.k_scale is not None else self._default_kv_scale
            ),
            v_scale=(
                layer.v_scale if layer.v_scale is not None else self._default_kv_scale
            ),
        )

    def init_forward_metadata_out_graph(
        self,
        forward_batch: ForwardBatch,
        in_capture: bool = False,
    ):
        bs = forward_batch.batch_size
        forward_mode = forward_batch.forward_mode
        spec_info = forward_batch.spec_info

        if (
            forward_mode.is_target_verify()
            and resolve_ragged_verify_layout(forward_batch) is not None
        ):
            self._assert_ragged_verify_supported()

        if in_capture:
            num_tokens = forward_batch.positions.numel()
            self._build_cuda_graph_metadata(
                bs, num_tokens, forward_mode, spec_info, forward_batch.seq_lens.device
            )

        if forward_mode.is_decode_or_idle():
            self.forward_metadata = self.decode_cuda_graph_metadata[bs]
        elif forward_mode.is_target_verify():
            self.forward_metadata = self.target_verify_metadata[bs]
            ragged_layout = resolve_ragged_verify_layout(forward_batch)
            if ragged_layout is not None:
                self._write_ragged_verify_graph_metadata(
                    self.forward_metadata,
                    forward_batch,
                    ragged_layout,
                    bs,
                    in_capture=in_capture,
                )
        elif forward_mode.is_draft_extend_v2():
            self.forward_metadata = self.draft_extend_metadata[bs]
        else:
            raise ValueError(
                f"Invalid forward mode: {forward_mode=} for CUDA Graph replay."
            )

        if self.kv_index_translator.is_translating:
            # Unified pool: refill this mode's own page table (this runs
            # out-of-graph on BOTH capture and every replay-prep; the recorded
            # fused kernel skips its page-table writes so the graph reads the
            # refreshed content through pointers baked at capture).
            metadata = self.forward_metadata
            # The kernels bound their page-table reads by `cache_seqlens_int32`
            # (the fused metadata call above wrote it); the plan's table
            # reaches that far, a target verify's draft tail included.
            self.kv_index_translator.copy_page_table(
                forward_batch.kv_loc_plan, out=metadata.page_table[:bs]
            )
            if metadata.swa_page_table is not None:
                self.kv_index_translator.copy_page_table(
                    forward_batch.kv_loc_plan,
                    out=metadata.swa_page_table[:bs],
                    kind=IdSpaceKind.SLIDING_WINDOW,
                )
            # A capture batch carries no prepared write loc; zeros are the
            # page-0 sink.
            if (
                self.use_sliding_window_kv_pool
                and forward_batch.out_cache_loc is not None
            ):
                n = forward_batch.out_cache_loc.shape[0]
                self.cuda_graph_swa_out_cache_loc[n:].zero_()
                if in_capture:
                    self.cuda_graph_swa_out_cache_loc[:n].zero_()
                else:
                    self.cuda_graph_swa_out_cache_loc[:n].copy_(
                        self.kv_index_translator.write_ids(
                            forward_batch, IdSpaceKind.SLIDING_WINDOW
                        )
                    )

    def _assert_ragged_verify_supported(self) -> None:
        if self.is_xqa_impl:
            raise NotImplementedError(
                "Compact ragged verify (variable-length cum_seq_lens_q) "
                "requires the trtllm-gen decode kernel; the xqa impl (sm90 / sm120) "
                "rejects it. Disable SGLANG_RAGGED_VERIFY_MODE for this configuration."
            )

    def _write_ragged_verify_graph_metadata(
        self,
        metadata: TRTLLMMHAMetadata,
        forward_batch: ForwardBatch,
        ragged_layout: RaggedVerifyLayout,
        bs: int,
        in_capture: bool = False,
    ) -> None:
        """Eagerly rebuild the target-verify graph metadata for ragged verify.

        The per-request verify lengths make the k-extension non-uniform, which
        the fused in-graph kernel cannot express (scalar ``seqlen_offset``
        only), so this runs out-of-graph on every capture/replay-prep and
        ``_apply_cuda_graph_metadata`` records nothing for ragged batches.
        """
        seq_lens = forward_batch.seq_lens[:bs]
        req_pool_indices = forward_batch.req_pool_indices[:bs]
        padded_layout = ragged_layout.padded_to_bucket(padded_bs=bs)
        geometry = build_ragged_target_verify_geometry(
            seq_lens=seq_lens, layout=padded_layout
        )
        metadata.cache_seqlens_int32.copy_(geometry.cache_seqlens_int32)
        metadata.cu_seqlens_q.copy_(geometry.cu_seqlens_q)
        metadata.cu_seqlens_k[1:].copy_(
            torch.cumsum(metadata.cache_seqlens_int32, dim=0, dtype=torch.int32)
        )
        self._fill_page_table_device(
            metadata, req_pool_indices, metadata.cache_seqlens_int32
        )
        # The fused in-graph kernel also skips ragged batches, so refill the
        # SWA write-target buffer here, from the plan.
        if self.use_sliding_window_kv_pool and forward_batch.out_cache_loc is not None:
            n = forward_batch.out_cache_loc.shape[0]
            self.cuda_graph_swa_out_cache_loc[n:].zero_()
            if in_capture:
                self.cuda_graph_swa_out_cache_loc[:n].zero_()
            else:
                self.cuda_graph_swa_out_cache_loc[:n].copy_(
                    self.kv_index_translator.write_ids(
                        forward_batch, IdSpaceKind.SLIDING_WINDOW
                    )
                )

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        self._apply_cuda_graph_metadata(
            bs=forward_batch.batch_size,
            req_pool_indices=forward_batch.req_pool_indices,
            seq_lens=forward_batch.seq_lens,
            forward_mode=forward_batch.forward_mode,
            spec_info=forward_batch.spec_info,
            out_cache_loc=forward_batch.out_cache_loc,
        )

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Initialize the metadata for a forward pass."""

        metadata = TRTLLMMHAMetadata()
        seqlens_in_batch = forward_batch.seq_lens
        batch_size = forward_batch.batch_size
        device = seqlens_in_batch.device

        if forward_batch.forward_mode.is_decode_or_idle():
            if forward_batch.spec_info is not None:
                # Draft Decode
                # Here we only support topk = 1 for now.
                metadata.cache_seqlens_int32 = (
                    seqlens_in_batch + (self.speculative_step_id + 1)
                ).to(torch.int32)
                metadata.cu_seqlens_q = torch.arange(
                    0, batch_size + 1, dtype=torch.int32, device=device
                )
                metadata.cu_seqlens_k = torch.nn.functional.pad(
                    torch.cumsum(
                        metadata.cache_seqlens_int32, dim=0, dtype=torch.int32
                    ),
                    (1, 0),
                )
            else:
                # Normal Decode
                metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
                metadata.cu_seqlens_q = torch.arange(
                    0, batch_size + 1, dtype=torch.int32, device=device
                )
                metadata.cu_seqlens_k = torch.nn.functional.pad(
                    torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0)
                )
        elif forward_batch.forward_mode.is_target_verify():
            ragged_layout = resolve_ragged_verify_layout(forward_batch)
            if ragged_layout is not None:
                self._assert_ragged_verify_supported()
                geometry = build_ragged_target_verify_geometry(
                    seq_lens=seqlens_in_batch, layout=ragged_layout
                )
                metadata.cache_seqlens_int32 = geometry.cache_seqlens_int32
                # Device-only layouts carry no host lens; the verify window
                # is a valid varlen upper bound.
                metadata.max_seq_len_q = (
                    geometry.max_seq_len_q
                    if geometry.max_seq_len_q is not None
                    else self.speculative_num_draft_tokens
                )
                metadata.cu_seqlens_q = geometry.cu_seqlens_q
                metadata.cu_seqlens_k = geometry.cu_seqlens_k
                metadata.is_ragged_verify = True
            else:
                tokens_per_req = forward_batch.input_ids.shape[0] // batch_size
                metadata.cache_seqlens_int32 = (
                    forward_batch.seq_lens + tokens_per_req
                ).to(torch.int32)
                metadata.max_seq_len_q = tokens_per_req
                metadata.cu_seqlens_q = torch.arange(
                    0,
                    batch_size * tokens_per_req + 1,
                    tokens_per_req,
                    dtype=torch.int32,
                    device=device,
                )
                metadata.cu_seqlens_k = torch.nn.functional.pad(
                    torch.cumsum(
                        metadata.cache_seqlens_int32, dim=0, dtype=torch.int32
                    ),
                    (1, 0),
                )

        else:
            metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
            metadata.cu_seqlens_k = torch.nn.functional.pad(
                torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0)
            )
            # Query-side max length, sourced from the host-resident extend lengths
            # (sync-free); for plain prefill these equal the full seq lens.
            metadata.max_seq_len_q = int(max(forward_batch.extend_seq_lens_cpu))
            if (
                forward_batch.forward_mode.is_extend()
                and forward_batch.spec_info is None
            ):
                lengths = forward_batch.extend_seq_lens_cpu
                prefix = len(lengths)
                while prefix and lengths[prefix - 1] == 1:
                    prefix -= 1
                if prefix < len(lengths):
                    metadata.mixed_prefill_reqs = prefix
                    metadata.mixed_prefill_tokens = sum(lengths[:prefix])
            if (
                forward_batch.extend_prefix_lens_cpu is not None
                and any(forward_batch.extend_prefix_lens_cpu)
            ) or forward_batch.forward_mode.is_draft_extend_v2():
                extend_seq_lens = forward_batch.extend_seq_lens
                metadata.cu_seqlens_q = torch.nn.functional.pad(
                    torch.cumsum(extend_seq_lens, dim=0, dtype=torch.int32), (1, 0)
                )
            else:
                metadata.cu_seqlens_q = metadata.cu_seqlens_k
            if self.use_fmha_v2 and not forward_batch.forward_mode.is_draft_extend_v2():
                self._init_fmha_v2_batch_pages(metadata, forward_batch)

        kv_view = self.kv_index_translator.read_table(
            forward_batch.kv_loc_plan, rows=forward_batch.batch_size
        )
        if kv_view.is_translated:
            # No fill kernel: the kernels bound their reads by cache_seqlens.
            metadata.page_table = kv_view.ids
            metadata.swa_page_table = (
                self.kv_index_translator.read_table(
                    forward_batch.kv_loc_plan,
                    kind=IdSpaceKind.SLIDING_WINDOW,
                    rows=forward_batch.batch_size,
                ).ids
                if self.kv_index_translator.space(IdSpaceKind.SLIDING_WINDOW)
                is not None
                else None
            )
            # XQA and fmha_v2 take a page table's row length from its width and
            # ignore its strides, so a view into a wider table would be misread.
            assert metadata.page_table.is_contiguous() and (
                metadata.swa_page_table is None
                or metadata.swa_page_table.is_contiguous()
            ), (
                "trtllm_mha reads its page tables as packed rows, but the plan's "
                "table is a strided view of a wider buffer"
            )
        else:
            has_swa = self._swa_kv_pool is not None
            metadata.page_table = torch.empty(
                (batch_size, self.max_num_pages), dtype=torch.int32, device=device
            )
            metadata.swa_page_table = (
                torch.empty(
                    (batch_size, self.max_num_pages), dtype=torch.int32, device=device
                )
                if has_swa
                else None
            )
            self._fill_page_table_device(
                metadata, forward_batch.req_pool_indices, metadata.cache_seqlens_int32
            )
        self._maybe_build_cp_zigzag_page_tables(metadata, forward_batch)

        if self._needs_encoder_only_expand(forward_batch.forward_mode, metadata):
            row_map = (
                torch.arange(batch_size * metadata.max_seq_len_q, device=device)
                // metadata.max_seq_len_q
            )
            metadata.encoder_row_map = row_map
            metadata.encoder_cache_seqlens = metadata.cache_seqlens_int32[row_map]
            metadata.encoder_page_table = metadata.page_table[row_map]

        # int64 scatter index (unlike the int32 read page table above).
        if self.use_sliding_window_kv_pool and forward_batch.out_cache_loc is not None:
            metadata.swa_out_cache_loc = self.kv_index_translator.write_ids(
                forward_batch, IdSpaceKind.SLIDING_WINDOW
            )

        self.forward_metadata = metadata

    def _init_fmha_v2_batch_pages(
        self, metadata: TRTLLMMHAMetadata, forward_batch: ForwardBatch
    ) -> None:
        """Index the pages this batch reads, for the fmha_v2 prefill copy.

        Sized by the host seq_lens, which are live only alongside seq_lens_sum
        (a GPU-only batch keeps a stale seq_lens_cpu); without them the prefill
        copies the whole pool.
        """
        seq_lens_cpu = forward_batch.seq_lens_cpu
        if (
            forward_batch.seq_lens_sum is None
            or seq_lens_cpu is None
            or seq_lens_cpu.numel() == 0
        ):
            return
        host_pages = (seq_lens_cpu + self.page_size - 1) // self.page_size
        total_pages = int(host_pages.sum())
        if total_pages == 0:
            return
        num_pages = (
            (metadata.cache_seqlens_int32 + self.page_size - 1) // self.page_size
        ).to(torch.int64)
        device = num_pages.device
        # Row r's pages land in copy rows [first[r], first[r] + num_pages[r]).
        first = torch.cumsum(num_pages, 0) - num_pages
        rows = torch.repeat_interleave(num_pages, output_size=total_pages)
        metadata.fmha_v2_copy_rows = rows
        metadata.fmha_v2_copy_cols = (
            torch.arange(total_pages, device=device) - first[rows]
        )
        # Past a row's last page, entries only need to stay in range.
        metadata.fmha_v2_block_table = (
            (first[:, None] + torch.arange(int(host_pages.max()), device=device))
            .clamp_(max=total_pages - 1)
            .to(torch.int32)
        )

    def _fmha_v2_paged_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as the [pages, 2, page_size, heads, head_dim] tensor fmha_v2
        takes, and the block table that addresses it.

        fmha_v2 derives strides from shapes, so this is a copy: of the batch's
        pages only, unless they are no fewer than the pool's.
        """
        metadata = self.forward_metadata
        rows = metadata.fmha_v2_copy_rows
        if rows is None or rows.numel() >= k_cache.shape[0]:
            return torch.stack([k_cache, v_cache], dim=1), page_table
        pages = page_table[rows, metadata.fmha_v2_copy_cols]
        paged_kv = k_cache.new_empty((rows.numel(), 2, *k_cache.shape[1:]))
        torch.index_select(k_cache, 0, pages, out=paged_kv[:, 0])
        torch.index_select(v_cache, 0, pages, out=paged_kv[:, 1])
        return paged_kv, metadata.fmha_v2_block_table

    def _reshape_paged_kv_cache(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: RadixAttention,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache = paged_kv_view(
            k_cache, self.page_size, layer.tp_k_head_num, head_dim
        ).permute(0, 2, 1, 3)
        v_cache = paged_kv_view(
            v_cache, self.page_size, layer.tp_v_head_num, head_dim
        ).permute(0, 2, 1, 3)
        if layer.tp_k_head_num == 1:
            k_cache = canonicalize_stride(k_cache)
        if layer.tp_v_head_num == 1:
            v_cache = canonicalize_stride(v_cache)
        return k_cache, v_cache

    def _get_nvfp4_bmm_scales(self, layer: RadixAttention) -> tuple[float, float]:
        assert self.is_nvfp4_kvcache
        return self.kv_cache_quant_method.get_bmm_scales(layer.layer_id)

    def _run_fixed_q_len_decode(
        self,
        query: torch.Tensor,
        kv_cache,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        bmm1_scale,
        bmm2_scale,
        window_left: int,
        sinks: Optional[torch.Tensor],
        q_len_per_req: int = 1,
        kv_cache_sf=None,
        out: Optional[torch.Tensor] = None,
        out_dtype: Optional[torch.dtype] = None,
        mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Run decode, optionally sorting and splitting requests by KV length."""

        resolved_out_dtype = (
            out_dtype
            if out_dtype is not None
            else (out.dtype if out is not None else self.q_data_type)
        )

        def run_group(group_query, group_block_tables, group_seq_lens, group_out=None):
            kwargs = {}
            if q_len_per_req != 1:
                kwargs["q_len_per_req"] = q_len_per_req
            if mask is not None:
                kwargs["mask"] = mask[: group_seq_lens.shape[0]]
            return flashinfer.decode.trtllm_batch_decode_with_kv_cache(
                query=group_query,
                kv_cache=kv_cache,
                workspace_buffer=self.workspace_buffer,
                block_tables=group_block_tables,
                seq_lens=group_seq_lens,
                max_seq_len=self.max_context_len,
                bmm1_scale=bmm1_scale,
                bmm2_scale=bmm2_scale,
                window_left=window_left,
                sinks=sinks,
                skip_softmax_threshold_scale_factor=envs.SGLANG_SKIP_SOFTMAX_DECODE_THRESHOLD_SCALE_FACTOR.get(),
                out=group_out,
                out_dtype=None if group_out is not None else resolved_out_dtype,
                kv_cache_sf=kv_cache_sf,
                multi_ctas_kv_counter_buffer=self._multi_ctas_kv_counter_buffer,
                **kwargs,
            )

        num_requests = seq_lens.shape[0]
        num_splits = min(self.decode_seq_len_splits, num_requests)
        if num_splits == 1:
            return run_group(query, block_tables, seq_lens, out)

        order = torch.argsort(seq_lens)
        query_by_request = query.view(
            num_requests, q_len_per_req, query.shape[-2], query.shape[-1]
        )
        output_by_request = (
            out.view_as(query_by_request)
            if out is not None
            else torch.empty(
                query_by_request.shape,
                dtype=resolved_out_dtype,
                device=query.device,
            )
        )
        for indices in torch.tensor_split(order, num_splits):
            group_output = run_group(
                query_by_request.index_select(0, indices).reshape(
                    -1, query.shape[-2], query.shape[-1]
                ),
                block_tables.index_select(0, indices),
                seq_lens.index_select(0, indices),
            )
            output_by_request.index_copy_(
                0,
                indices,
                group_output.view(-1, q_len_per_req, query.shape[-2], query.shape[-1]),
            )
        return output_by_request.view(-1, query.shape[-2], query.shape[-1])

    def _get_nvfp4_decode_kv_cache(
        self, layer: RadixAttention
    ) -> tuple[
        tuple[torch.Tensor, torch.Tensor],
        tuple[torch.Tensor, torch.Tensor],
    ]:
        assert self.is_nvfp4_kvcache
        if self.is_xqa_impl:
            k_fp4, v_fp4, k_scale, v_scale = self.token_to_kv_pool.get_raw_kv_buffer(
                layer.layer_id
            )
        else:
            k_fp4, v_fp4, k_scale, v_scale = _trtllm_native_nvfp4_kv_buffer(
                self.token_to_kv_pool, layer.layer_id
            )
        kv_cache = self._reshape_paged_kv_cache(
            k_fp4, v_fp4, layer, layer.head_dim // 2
        )
        if self.is_xqa_impl:
            kv_cache_block_scales = self._reshape_paged_kv_cache(
                k_scale, v_scale, layer, layer.head_dim // 16
            )
        else:
            # SM100 native scale buffers are already physical HND with
            # contiguous [page-token, block-scale] dimensions. V is
            # four-token interleaved.
            kv_cache_block_scales = (k_scale, v_scale)
        return kv_cache, kv_cache_block_scales

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """Run forward for decode using TRTLLM MHA kernel."""

        use_fused_fp8_path = self._should_use_fused_fp8_path(
            save_kv_cache, k, forward_batch
        )
        use_fused_qkv = use_fused_fp8_path and not self.is_xqa_impl
        pool = self.token_to_kv_pool

        if use_fused_fp8_path:
            fused_q = self._fused_fp8_qkv_kv_cache(
                q if use_fused_qkv else None, k, v, layer, forward_batch
            )
            if fused_q is not None:
                q = fused_q
            k = None
            v = None
        else:
            if save_kv_cache and k is not None:
                self.token_to_kv_pool.set_kv_buffer(
                    layer,
                    KVWriteLoc.for_batch(
                        forward_batch,
                        swa_loc=self.forward_metadata.swa_out_cache_loc,
                    ),
                    k,
                    v,
                    *self._kv_write_scales(layer),
                )

        # For XQA, q_dtype should be bf16. For trtllm-gen,
        # q_dtype should be FP8 when KV is in FP8.
        q_scale = 1.0
        if self.decode_uses_native_fp4 and not self.is_xqa_impl:
            # SM100 TRT-LLM GenMHA requires FP8 Q for native NVFP4 KV.
            q = q.to(torch.float8_e4m3fn)
        elif (
            self.data_type == torch.float8_e4m3fn
            and not self.is_xqa_impl
            and not use_fused_qkv
        ):
            q = q.to(torch.float8_e4m3fn)
        if self.is_xqa_impl:
            q = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
        else:
            q = q.reshape(-1, layer.tp_q_head_num, layer.head_dim)

        if self.is_nvfp4_kvcache:
            kv_cache, kv_cache_block_scales = self._get_nvfp4_decode_kv_cache(layer)
        else:
            k_cache, v_cache = pool.get_kv_buffer(layer.layer_id)
            kv_cache = self._reshape_paged_kv_cache(
                k_cache, v_cache, layer, layer.head_dim
            )
            kv_cache_block_scales = None

        if self.is_nvfp4_kvcache:
            k_scale, v_scale = self._get_nvfp4_bmm_scales(layer)
            bmm1_scale = q_scale * k_scale * layer.scaling
            bmm2_scale = v_scale
        else:
            bmm1_scale, bmm2_scale = self._get_bmm_scales(layer, q_scale)
        attention_sink = kwargs.get("sinks", None)

        page_table = self._get_layer_page_table(layer, forward_batch)
        native_out = (
            self._nvfp4_output_view(q)
            if self.decode_uses_native_fp4 and not self.is_xqa_impl
            else None
        )
        o = self._run_fixed_q_len_decode(
            q,
            kv_cache,
            page_table,
            self.forward_metadata.cache_seqlens_int32,
            bmm1_scale=bmm1_scale,
            bmm2_scale=bmm2_scale,
            window_left=layer.sliding_window_size,
            sinks=attention_sink,
            out=native_out,
            out_dtype=(
                None
                if self.decode_uses_native_fp4 and not self.is_xqa_impl
                else self.q_data_type
            ),
            kv_cache_sf=kv_cache_block_scales,
        )
        if self.decode_uses_native_fp4 and not self.is_xqa_impl:
            o = self._finalize_nvfp4_output(o, forward_batch)

        return o.view(-1, layer.tp_q_head_num * layer.head_dim)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache=True,
        **kwargs,
    ):
        cp_active = is_cp_active(forward_batch)
        uses_native_fp4 = self._forward_extend_uses_native_fp4(forward_batch)
        if uses_native_fp4 and cp_active:
            raise NotImplementedError(
                "Native NVFP4 TRT-LLM prefill does not yet support context parallelism."
            )

        # The fused path writes rank-local K/V directly to cache. CP needs
        # the strategy to gather K/V into full logical token order first.
        use_fused_fp8_path = self._should_use_fused_fp8_path(
            save_kv_cache, k, forward_batch
        )
        use_fused_qkv = use_fused_fp8_path and not self.is_xqa_impl

        if use_fused_fp8_path:
            fused_q = self._fused_fp8_qkv_kv_cache(
                q if use_fused_qkv else None, k, v, layer, forward_batch
            )
            if fused_q is not None:
                q = fused_q
            k = None
            v = None
        else:
            if save_kv_cache and k is not None:
                if cp_active:
                    cp_strategy = get_cp_strategy()
                    assert cp_strategy is not None
                    cp_strategy.materialize_full_kv(
                        forward_batch,
                        layer,
                        k,
                        v,
                        swa_loc=self.forward_metadata.swa_out_cache_loc,
                    )
                else:
                    self.token_to_kv_pool.set_kv_buffer(
                        layer,
                        KVWriteLoc.for_batch(
                            forward_batch,
                            swa_loc=self.forward_metadata.swa_out_cache_loc,
                        ),
                        k,
                        v,
                        *self._kv_write_scales(layer),
                    )

        uses_decode_kernel = (
            forward_batch.forward_mode.is_target_verify()
            or forward_batch.forward_mode.is_draft_extend_v2()
        )

        q_scale = 1.0
        if uses_native_fp4:
            q = q.to(torch.float8_e4m3fn)
        elif (
            self.data_type == torch.float8_e4m3fn
            and (not self.is_xqa_impl or not uses_decode_kernel)
            and not use_fused_qkv
        ):
            q = q.to(torch.float8_e4m3fn)
        if self.use_fmha_v2:
            q = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
        else:
            q = q.reshape(-1, layer.tp_q_head_num, layer.head_dim)

        kv_pool_is_hnd = False
        if uses_native_fp4:
            kv_cache, kv_cache_block_scales = self._get_nvfp4_decode_kv_cache(layer)
            k_cache, v_cache = kv_cache
        else:
            k_cache_raw, v_cache_raw = self.token_to_kv_pool.get_kv_buffer(
                layer.layer_id
            )
            if not self.use_fmha_v2 or uses_decode_kernel:
                # Decode and SM100 batch_context kernels require HND layout.
                k_cache, v_cache = self._reshape_paged_kv_cache(
                    k_cache_raw, v_cache_raw, layer, layer.head_dim
                )
            elif k_cache_raw.dim() == 4:
                # Same test as paged_kv_view: SGLANG_USE_HND_KVCACHE pools are
                # [pages, heads, page, dim]; NHD pools are per-slot rows.
                # fmha_v2 reads HND pool buffers as-is; they are already contiguous.
                kv_pool_is_hnd = True
                hnd_shape = (layer.tp_k_head_num, self.page_size, layer.head_dim)
                assert k_cache_raw.shape[1:] == v_cache_raw.shape[1:] == hnd_shape, (
                    f"expected HND buffers [pages, *{hnd_shape}], got "
                    f"{tuple(k_cache_raw.shape)} / {tuple(v_cache_raw.shape)}"
                )
                k_cache, v_cache = k_cache_raw, v_cache_raw
            else:
                k_cache = paged_kv_view(
                    k_cache_raw, self.page_size, layer.tp_k_head_num, layer.head_dim
                )
                v_cache = paged_kv_view(
                    v_cache_raw, self.page_size, layer.tp_v_head_num, layer.head_dim
                )

            kv_cache = (k_cache, v_cache)
            kv_cache_block_scales = None
        # sink: additional value per head in the denominator of the softmax.
        attention_sink = kwargs.get("sinks", None)
        if uses_native_fp4:
            k_scale, v_scale = self._get_nvfp4_bmm_scales(layer)
            bmm1_scale = q_scale * k_scale * layer.scaling
            bmm2_scale = v_scale
        else:
            bmm1_scale, bmm2_scale = self._get_bmm_scales(layer, q_scale)

        page_table = self._get_layer_page_table(layer, forward_batch)
        native_out = self._nvfp4_output_view(q) if uses_native_fp4 else None

        if uses_decode_kernel:
            if (
                forward_batch.forward_mode.is_target_verify()
                and layer.attn_type == AttentionType.ENCODER_ONLY
            ):
                # ENCODER_ONLY layers need bidirectional attention over the
                # verify window; the spec-decode kernel is causal in-window, so
                # run bs*L single-token rows over the full window instead (the
                # window's K/V are already in the pool).
                assert not self.forward_metadata.is_ragged_verify, (
                    "ENCODER_ONLY target_verify does not support ragged verify layouts"
                )
                assert self.forward_metadata.encoder_cache_seqlens is not None, (
                    "ENCODER_ONLY target_verify requires the expanded decode "
                    "metadata (built only on the draft worker)"
                )
                o = flashinfer.decode.trtllm_batch_decode_with_kv_cache(
                    query=q,
                    kv_cache=kv_cache,
                    workspace_buffer=self.workspace_buffer,
                    block_tables=self.forward_metadata.encoder_page_table,
                    seq_lens=self.forward_metadata.encoder_cache_seqlens,
                    max_seq_len=self.max_context_len,
                    bmm1_scale=bmm1_scale,
                    bmm2_scale=bmm2_scale,
                    window_left=layer.sliding_window_size,
                    sinks=attention_sink,
                    skip_softmax_threshold_scale_factor=envs.SGLANG_SKIP_SOFTMAX_DECODE_THRESHOLD_SCALE_FACTOR.get(),
                    out=native_out,
                    out_dtype=(None if uses_native_fp4 else self.q_data_type),
                    kv_cache_sf=kv_cache_block_scales,
                    q_len_per_req=1,
                    multi_ctas_kv_counter_buffer=self._multi_ctas_kv_counter_buffer,
                )
            elif self.forward_metadata.is_ragged_verify:
                o = flashinfer.decode.trtllm_batch_decode_with_kv_cache(
                    query=q,
                    kv_cache=kv_cache,
                    workspace_buffer=self.workspace_buffer,
                    block_tables=page_table,
                    seq_lens=self.forward_metadata.cache_seqlens_int32,
                    max_seq_len=self.max_context_len,
                    bmm1_scale=bmm1_scale,
                    bmm2_scale=bmm2_scale,
                    window_left=layer.sliding_window_size,
                    sinks=attention_sink,
                    skip_softmax_threshold_scale_factor=envs.SGLANG_SKIP_SOFTMAX_DECODE_THRESHOLD_SCALE_FACTOR.get(),
                    out=native_out,
                    out_dtype=(None if uses_native_fp4 else self.q_data_type),
                    kv_cache_sf=kv_cache_block_scales,
                    q_len_per_req=None,
                    max_q_len=self.forward_metadata.max_seq_len_q,
                    cum_seq_lens_q=self.forward_metadata.cu_seqlens_q,
                    multi_ctas_kv_counter_buffer=self._multi_ctas_kv_counter_buffer,
                )
            else:
                mask = (
                    self._xqa_spec_dec_mask
                    if self.forward_metadata.max_seq_len_q > 1
                    else None
                )
                o = self._run_fixed_q_len_decode(
                    q,
                    kv_cache,
                    page_table,
                    self.forward_metadata.cache_seqlens_int32,
                    bmm1_scale=bmm1_scale,
                    bmm2_scale=bmm2_scale,
                    window_left=layer.sliding_window_size,
                    sinks=attention_sink,
                    out=native_out,
                    out_dtype=(None if uses_native_fp4 else self.q_data_type),
                    kv_cache_sf=kv_cache_block_scales,
                    q_len_per_req=self.forward_metadata.max_seq_len_q,
                    mask=mask,
                )
        elif self.use_fmha_v2 and not cp_active:
            # CP must go through cp_strategy.run_attention (per-shard
            # masking); the plain-causal fmha_v2 call below would be wrong.
            qkv, fmha_v2_block_tables = self._fmha_v2_paged_inputs(
                q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table
            )
            out = forward_batch._attn_output
            o = flashinfer.prefill.trtllm_fmha_v2_prefill(
                qkv,
                input_layout="Q_PAGED_KV_HND" if kv_pool_is_hnd else "Q_PAGED_KV_NHD",
                workspace_buffer=self.fmha_v2_workspace_buffer,
                seq_lens=self.forward_metadata.cache_seqlens_int32,
                max_q_len=self.forward_metadata.max_seq_len_q,
                max_kv_len=self.max_context_len,
                bmm1_scale=bmm1_scale,
                bmm2_scale=bmm2_scale,
                batch_size=forward_batch.batch_size,
                cum_seq_lens_q=self.forward_metadata.cu_seqlens_q,
                cum_seq_lens_kv=self.forward_metadata.cu_seqlens_k,
                block_tables=fmha_v2_block_tables,
                out=None if out is None else out.view_as(q),
                out_dtype=self.q_data_type,
                mask_mode=(
                    "padding"
                    if layer.attn_type == AttentionType.ENCODER_ONLY
                    else "causal"
                ),
                window_left=layer.sliding_window_size,
                sinks=attention_sink,
                skip_softmax_threshold_scale_factor=envs.SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR.get()
                or 0.0,
            )
        else:

            def _trtllm_context_attn(
                q_chunk,
                cu_seqlens_q,
                cache_seqlens,
                max_seqlen_q,
                *,
                cu_seqlens_kv,
                use_zigzag_page_table=False,
                out=None,
                page_table_override=None,
            ):
                block_tables = (
                    page_table if page_table_override is None else page_table_override
                )
                if use_zigzag_page_table:
                    block_tables = self.forward_metadata.zigzag_page_table
                    zigzag_swa_pt = self.forward_metadata.zigzag_swa_page_table
                    if zigzag_swa_pt is not None:
                        _, is_swa = self._swa_kv_pool.layers_mapping[layer.layer_id]
                        if is_swa:
                            block_tables = zigzag_swa_pt
                return flashinfer.prefill.trtllm_batch_context_with_kv_cache(
                    query=q_chunk,
                    kv_cache=kv_cache,
                    workspace_buffer=self.workspace_buffer,
                    block_tables=block_tables,
                    seq_lens=cache_seqlens,
                    max_q_len=max_seqlen_q,
                    max_kv_len=self.max_context_len,
                    bmm1_scale=bmm1_scale,
                    bmm2_scale=bmm2_scale,
                    batch_size=cu_seqlens_q.shape[0] - 1,
                    cum_seq_lens_q=cu_seqlens_q,
                    cum_seq_lens_kv=cu_seqlens_kv,
                    window_left=layer.sliding_window_size,
                    sinks=attention_sink,
                    skip_softmax_threshold_scale_factor=envs.SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR.get(),
                    out=out,
                    out_dtype=(None if uses_native_fp4 else self.q_data_type),
                    kv_cache_sf=kv_cache_block_scales,
                    causal=layer.attn_type != AttentionType.ENCODER_ONLY,
                )

            if cp_active:
                cp_strategy = get_cp_strategy()
                assert cp_strategy is not None
                o = cp_strategy.run_attention(
                    q,
                    forward_batch,
                    self.device,
                    _trtllm_context_attn,
                    attention_backend=CPAttentionBackendKind.TRTLLM_MHA,
                )
            else:
                out = native_out if uses_native_fp4 else forward_batch._attn_output
                if out is not None:
                    out = out.view_as(q)
                prefix_reqs = self.forward_metadata.mixed_prefill_reqs
                prefix_tokens = self.forward_metadata.mixed_prefill_tokens
                # FMHA-v2 platforms (SM90/SM120) never get here, so the FP8 tail
                # runs on trtllm-gen only and never hands an FP8 Q to XQA.
                if (
                    prefix_reqs >= 0
                    and self.data_type
                    in (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
                    and q.dtype == self.data_type
                    and layer.attn_type == AttentionType.DECODER
                ):
                    if out is None:
                        # FP8 Q/KV still produces attention output in model dtype.
                        out = torch.empty_like(q, dtype=self.q_data_type)
                    if prefix_reqs:
                        _trtllm_context_attn(
                            q[:prefix_tokens],
                            self.forward_metadata.cu_seqlens_q[: prefix_reqs + 1],
                            self.forward_metadata.cache_seqlens_int32[:prefix_reqs],
                            self.forward_metadata.max_seq_len_q,
                            cu_seqlens_kv=self.forward_metadata.cu_seqlens_k[
                                : prefix_reqs + 1
                            ],
                            out=out[:prefix_tokens],
                            page_table_override=page_table[:prefix_reqs],
                        )
                    # Eager DP batches can pad Q without adding requests.
                    tail_end = prefix_tokens + (
                        self.forward_metadata.cache_seqlens_int32.shape[0] - prefix_reqs
                    )
                    self._run_fixed_q_len_decode(
                        q[prefix_tokens:tail_end],
                        kv_cache,
                        page_table[prefix_reqs:],
                        self.forward_metadata.cache_seqlens_int32[prefix_reqs:],
                        bmm1_scale=bmm1_scale,
                        bmm2_scale=bmm2_scale,
                        window_left=layer.sliding_window_size,
                        sinks=attention_sink,
                        out=out[prefix_tokens:tail_end],
                    )
                    o = out
                else:
                    o = _trtllm_context_attn(
                        q,
                        self.forward_metadata.cu_seqlens_q,
                        self.forward_metadata.cache_seqlens_int32,
                        self.forward_metadata.max_seq_len_q,
                        cu_seqlens_kv=self.forward_metadata.cu_seqlens_k,
                        out=out,
                    )

        if uses_native_fp4:
            o = self._finalize_nvfp4_output(o, forward_batch)
        return o.view(-1, layer.tp_q_head_num * layer.head_dim)


class TRTLLMHAAttnMultiStepDraftBackend(FlashInferMultiStepDraftBackend):
    """Multi-step TRTLLM MHA attention kernel used by EAGLE."""

    # Per-step backends build the page table on-device (sync-free); mirror that so
    # decide_needs_cpu_seq_lens sees a consistent target + draft value.
    needs_cpu_seq_lens: bool = False

    def __init__(
        self, model_runner: ModelRunner, topk: int, speculative_num_steps: int
    ):
        super().__init__(model_runner, topk, speculative_num_steps)
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i] = TRTLLMHAAttnBackend(
                model_runner,
                skip_prefill=True,
                kv_indptr_buf=self.kv_indptr[i],
                kv_last_page_len_buf=self.kv_last_page_len,
                speculative_step_id=i,
            )

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(
        self,
        forward_batch: ForwardBatch,
        in_capture: bool = False,
    ):
        from sglang.srt.model_executor.forward_batch_info import build_inner_fb_view

        assert forward_batch.spec_info is not None
        assert forward_batch.spec_info.is_draft_input()

        # TRTLLM-MHA uses encoder_lens from the original fb for inner dispatch
        # (FlashInfer parent forces encoder_lens=None instead).
        inner_fb = build_inner_fb_view(
            forward_batch,
            bs=forward_batch.batch_size,
            forward_mode=ForwardMode.DECODE,
            encoder_lens=forward_batch.encoder_lens,
        )
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata_out_graph(
                inner_fb, in_capture=in_capture
            )

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        from sglang.srt.model_executor.forward_batch_info import build_inner_fb_view

        assert forward_batch.spec_info is not None
        assert forward_batch.spec_info.is_draft_input()

        inner_fb = build_inner_fb_view(
            forward_batch,
            bs=forward_batch.batch_size,
            forward_mode=ForwardMode.DECODE,
            encoder_lens=forward_batch.encoder_lens,
        )
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata_in_graph(inner_fb)
