from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.kernels.ops.attention.metadata import (
    draft_extend_set_metadata,
    normal_decode_set_metadata,
    prepare_swa_spec_page_table_triton,
)
from sglang.kernels.ops.attention.pa_page_table import _build_pa_page_table
from sglang.kernels.ops.attention.suffix_attention_merge import (
    can_use_fused_suffix_attention_merge,
    merge_suffix_attention_in_place,
)
from sglang.kernels.ops.attention.trtllm_mha_page_table import (
    build_trtllm_mha_page_table,
)
from sglang.kernels.ops.attention.utils import assert_buffer_fits
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.kv_shard_hooks import (
    get_kv_shard_pool,
    prepare_kv_shard_forward,
)
from sglang.srt.layers.attention.local_attention import (
    LocalAttentionMetadata,
    LocalAttentionMetadataBuilder,
)
from sglang.srt.layers.attention.verify_mask import VerifyMask, maybe_create_verify_mask
from sglang.srt.layers.cp.base import CPAttentionBackendKind, get_cp_strategy
from sglang.srt.layers.cp.utils import is_cp_active
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.kv_loc_plan import IdSpaceKind
from sglang.srt.mem_cache.layout.paged_view import paged_kv_view, paged_view
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.runtime_context import (
    get_exec,
    get_memory,
    get_model,
    get_parallel,
    get_schedule,
    get_spec,
)
from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc
from sglang.srt.speculative.ragged_verify import build_ragged_target_verify_geometry
from sglang.srt.speculative.spec_info import SpecInput, SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import resolve_num_tokens_per_req
from sglang.srt.utils import get_compiler_backend
from sglang.srt.utils.common import get_device_capability

if TYPE_CHECKING:
    from sglang.srt.mem_cache.kv_loc_plan import KVLocPlan
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin
    from sglang.srt.model_executor.model_runner import ModelRunner

from sgl_kernel import merge_state_v2

from sglang.kernels.ops.attention.flash_attention import (
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)


def _should_disable_scheduler_metadata_precompute() -> bool:
    return bool(get_parallel().enable_prefill_cp or get_parallel().attn_dp_enabled)


@dataclass
class FlashAttentionMetadata:
    """Metadata to be init once in the model forward pass,
    each layer's forward pass can reuse the metadata.

    For each init metadata function, we will try set up them in below order
    """

    # Sequence lengths for the forward batch
    cache_seqlens_int32: torch.Tensor = None
    # Maximum sequence length for query
    max_seq_len_q: int = 1
    # Maximum sequence length for key
    max_seq_len_k: int = 0
    # Cumulative sequence lengths for query
    cu_seqlens_q: torch.Tensor = None
    # Cumulative sequence lengths for key
    cu_seqlens_k: torch.Tensor = None
    # Dummy-tail varlen metadata for the fa_skip_kv_cache path under a piecewise
    # CUDA graph (built once per forward, reused across layers). See forward_extend.
    fa_skip_cu_seqlens_q: torch.Tensor = None
    fa_skip_max_seqlen_q: int = None
    # Packed absolute image ranges for Gemma4 prefill; None for text/decode.
    image_token_ranges: torch.Tensor = None
    # Window size (typically used by Gemma)
    window_size: tuple = (-1, -1)
    # Page table, the index of KV Cache Tables/Blocks
    page_table: torch.Tensor = None
    # Page table for Sliding Window Attention
    swa_page_table: torch.Tensor = None

    pa_swa_page_table: torch.Tensor = None
    pa_swa_cache_seqlens: torch.Tensor = None
    # full->SWA translated out_cache_loc (SWA KV-store write target)
    swa_out_cache_loc: torch.Tensor = None
    # Precomputed FA3 scheduler metadata (avoids per-layer prepare_varlen_num_blocks)
    scheduler_metadata: torch.Tensor = None
    # Per-forward-pass cache for the FA4 sheared-bias block schedule.
    # Created lazily by the first rel_bias layer; lives as long as this metadata
    # object, which for CUDA-graph captures keeps the buffers owned by the graph.
    rel_bias_prep_cache: Optional[dict] = None

    # Encoder metadata
    # Cumulative sequence lengths for encoder key
    encoder_cu_seqlens_k: torch.Tensor = None
    # Maximum sequence length for encoder key
    encoder_max_seq_len_k: int = 0
    # Sequence lengths for the forward batch
    encoder_lens_int32: torch.Tensor = None
    # Page table for the encoder
    encoder_page_table: torch.Tensor = None

    local_attn_metadata: Optional[LocalAttentionMetadata] = None

    # For sliding window attention topk>1 spec decoding
    swa_spec_metadata: Optional[FlashAttentionMetadata] = None


class FlashAttentionBackend(AttentionBackend):
    """FlashAttention backend implementation.

    Note about the init:
    - If no spec decoding
        - FlashAttentionBackend will be init once when the server starts.
    - If spec decoding
        - FlashAttentionBackend will be init once for the target worker
        - FlashAttentionMultiStepBackend will be once for the draft worker
            - It will spawn num_steps FlashAttentionBackend for the draft worker

    Note about CUDA Graph:
    - We only support CUDA Graph for Decode (Normal Decode and Draft Decode) and Target Verify.
    - We don't support CUDA Graph for Extend and Draft Extend.
    - When server init, init_cuda_graph_state will be called first and then init_cuda_graph_capture will be called.
    - For each forward batch, init_replay_cuda_graph will be called first and then replay the graph.
    """

    needs_cpu_seq_lens: bool = False
    supports_ragged_verify_graph: bool = True

    # Set from the pool type in __init__; the class default keeps the extend
    # metadata guard readable on instances built with __new__ (test stubs).
    _kv_shard_pool: Optional[PageInterleaveKVPoolMixin] = None

    # Chunked-prefix attention reads the stable ForwardBatch cu-seqlens and
    # KV-index buffers directly, so it needs no backend-private replay state.
    supports_full_cuda_graph_chunked_prefix = True

    def __init__(
        self,
        model_runner: ModelRunner,
        skip_prefill: bool = False,
        speculative_step_id=0,
        topk=0,
        speculative_num_steps=0,
        fa_impl_ver=3,
    ):
        super().__init__()

        assert not (
            model_runner.sliding_window_size is not None
            and model_runner.model_config.is_encoder_decoder
        ), "Sliding window and cross attention are not supported together"

        self.is_encoder_decoder = model_runner.model_config.is_encoder_decoder
        self.forward_metadata: FlashAttentionMetadata = None
        # extra metadata for handling speculative decoding topk > 1, extended draft decode and verify
        self.forward_metadata_spec_decode_expand: FlashAttentionMetadata = None
        self.max_context_len = model_runner.model_config.context_len
        self.device = model_runner.device
        self.decode_cuda_graph_metadata = {}
        self.target_verify_metadata = {}
        # Pool refs — captured at construction so they survive deletion of the
        # corresponding ForwardBatch fields.
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.kv_cache_dtype = model_runner.kv_cache_dtype
        self.kv_cache_dtype_str = model_runner.kv_cache_dtype_str
        self.kv_cache_is_mxfp8 = self.kv_cache_dtype_str == "mxfp8"
        self.page_size = model_runner.page_size
        # Static page-table width (upper bound). The device-side page-table build
        # sizes to this constant, so no runtime host max is needed.
        self.max_num_pages = (
            self.max_context_len + self.page_size - 1
        ) // self.page_size
        # Page table is built on-device (build_trtllm_mha_page_table) and the
        # tree mask is preallocated (see VerifyMask), so no
        # seq_lens_cpu / seq_lens_sum D2H sync is ever needed.
        self.needs_cpu_seq_lens = False
        self.use_mla = model_runner.model_config.attention_arch == AttentionArch.MLA
        self.kv_index_translator = model_runner.kv_index_translator
        self.skip_prefill = skip_prefill
        self.attn_cp_size = get_parallel().attn_cp_size
        self._verify_mask = None
        # The worker fetches the tree-mask scratch from the target backend
        # only; draft-side instances must not allocate it.
        self.is_draft_runner = model_runner.is_draft_worker

        self.use_sliding_window_kv_pool = (
            isinstance(model_runner.token_to_kv_pool, SWAKVPool)
            and model_runner.token_to_kv_pool.swa_layer_nums > 0
        )

        self._kv_shard_pool = get_kv_shard_pool(self.token_to_kv_pool)
        # begin_shard_extend builds the owner-major gather plan from host-side
        # prefix/final lengths. Normal FA3 metadata is device-only, so opt the
        # sharded variant back into FutureMap's CPU mirror publication.
        self.needs_cpu_seq_lens = self._kv_shard_pool is not None

        self.topk = get_spec().speculative_eagle_topk or 0
        self.speculative_num_steps = speculative_num_steps
        self.speculative_num_draft_tokens = get_spec().speculative_num_draft_tokens
        if (
            self.speculative_num_draft_tokens is not None
            and model_runner.is_draft_worker
        ):
            # Static verify width; NOTE: overwrites the config-named attr in place.
            self.speculative_num_draft_tokens = resolve_num_tokens_per_req(
                phase="target_verify",
                spec_algorithm=SpeculativeAlgorithm.from_string(
                    get_spec().speculative_algorithm
                ),
                is_draft_worker=True,
                num_draft_tokens=int(self.speculative_num_draft_tokens),
            )
        self.speculative_step_id = speculative_step_id

        self.local_attn_builder = self._maybe_init_local_attn_builder(model_runner)
        # Read directly by MusaFlashAttentionBackend's copied forward paths.
        self.has_local_attention = self.local_attn_builder is not None
        self.attention_chunk_size = (
            self.local_attn_builder.attention_chunk_size
            if self.local_attn_builder is not None
            else None
        )

        # For each layer, the sliding_window_size can be different. This is only used for preparing SWA metadata.
        # We use `layer.sliding_window_size` to decide whether to use SWA for each layer.
        self.sliding_window_size = model_runner.sliding_window_size
        self.has_swa = (
            self.sliding_window_size is not None and self.sliding_window_size > -1
        )

        self.is_prefill_aware_swa = getattr(model_runner, "prefill_aware_swa", False)
        if self.is_prefill_aware_swa:
            assert self.page_size == 1, (
                "Prefill-aware SWA requires page_size=1, "
                f"got page_size={self.page_size}"
            )
            # Its page-table builder indexes prefill_lens by POOL SLOT,
            # incompatible with the batch-row canonical source.
            assert not self.kv_index_translator.is_translating, (
                "--enable-unified-memory does not support the prefill-aware "
                "SWA decode mode; disable it for this model."
            )
            # Indexed by raw req_pool_idx values (see the write below and
            # _build_pa_page_table), which range over [0, size] (row 0 is the
            # reserved padding slot) -- so this needs size+1, not size.
            max_req_pool_idx = model_runner.req_to_token_pool.size
            self._pa_swa_prefill_lens = torch.zeros(
                max_req_pool_idx + 1, dtype=torch.int32, device=model_runner.device
            )
            self._pa_swa_max_prefill_len = 0

        # Select version
        self.fa_impl_ver = fa_impl_ver
        device_capability = get_device_capability()
        if self.fa_impl_ver == 3:
            from sgl_kernel.flash_attn import (
                flash_attn_varlen_func,
                flash_attn_with_kvcache,
                get_scheduler_metadata,
            )

            self._get_scheduler_metadata = get_scheduler_metadata
            self._get_fa_runtime_policy = None
        elif self.fa_impl_ver == 4:
            if device_capability[0] == 12:
                from sglang.kernels.ops.attention.flash_attention_v4_sm120 import (
                    flash_attn_varlen_func,
                    flash_attn_with_kvcache,
                    get_flash_attention_v4_sm120_runtime_policy,
                )

                self._get_fa_runtime_policy = (
                    get_flash_attention_v4_sm120_runtime_policy
                )
            else:
                from sglang.kernels.ops.attention.flash_attention_v4 import (
                    flash_attn_varlen_func,
                    flash_attn_with_kvcache,
                )

                self._get_fa_runtime_policy = None

            self._get_scheduler_metadata = None
            if get_exec().deterministic.enable_deterministic_inference:
                # Must precede the first kernel compile.
                from sglang.kernels.ops.attention.flash_attn.cute.batch_invariance import (
                    set_batch_invariant,
                )

                set_batch_invariant(True)
        else:
            raise ValueError(f"Invalid version: {self.fa_impl_ver=}")

        self.flash_attn_varlen_func = flash_attn_varlen_func
        self.flash_attn_with_kvcache = flash_attn_with_kvcache

        # Store head info for precomputing FA3 scheduler metadata
        self.head_dim = model_runner.model_config.head_dim
        attention_tp_size = get_parallel().attn_tp_size
        self.num_attention_heads = (
            model_runner.model_config.hf_text_config.num_attention_heads
            // attention_tp_size
        )
        self.num_kv_heads = model_runner.model_config.get_num_kv_heads(
            attention_tp_size
        )
        _softcapping = getattr(
            model_runner.model_config.hf_text_config, "attn_logit_softcapping", None
        )
        self.has_softcap = _softcapping is not None and _softcapping > 0.0

        # num_splits == 0 delegates SplitKV sizing to the selected FA runtime.
        deterministic = get_exec().deterministic.enable_deterministic_inference
        if self._get_fa_runtime_policy is None:
            self.num_splits = 1 if deterministic else 0
            self.decode_num_splits = self.num_splits
            self._decode_uses_static_max_seqlen_k = False
        else:
            runtime_policy = self._get_fa_runtime_policy(
                device_capability=device_capability,
                deterministic=deterministic,
            )
            self.num_splits = runtime_policy.num_splits
            self.decode_num_splits = runtime_policy.decode_num_splits
            self._decode_uses_static_max_seqlen_k = (
                runtime_policy.decode_uses_static_max_seqlen_k
            )
        # Set (never getattr'd) so forward_extend can identity-check "is this the
        # full-CG prefill metadata?" to disable the pointer-keyed shear-bias
        # block-schedule cache (see forward_extend rel_bias handling).
        self.full_cg_prefill_metadata = None

        # In embedding mode with no chunked prefill and radix cache disabled,
        # skip KV cache write and use flash_attn_varlen_func with raw K/V
        # instead of flash_attn_with_kvcache, bypassing paged KV cache entirely.
        # Restricted to non-MLA backends: the read-skip elif lives inside the
        # `if not self.use_mla:` branch in forward_extend, while the write-skip
        # guard wraps both set_kv_buffer and set_mla_kv_buffer. Without this
        # gate, MLA + is_embedding would skip the write but still read stale
        # cache via get_key_buffer in the absorbed-MLA path.
        self.fa_skip_kv_cache = (
            get_model().is_embedding
            and get_schedule().chunked_prefill_size == -1
            and get_memory().disable_radix_cache
            and not self.use_mla
        )

        # Skip the FA3 scheduler_metadata precompute (PR #21104) when distributed
        # attention modes can change live cache_seqlens/num_splits across ranks.
        # A stale precomputed buffer can lead to an OOB read in the split-KV
        # combine kernel (flash_fwd_combine_launch_template.h:52). Leaving
        # scheduler_metadata unset uses the existing per-layer metadata path.
        self._disable_scheduler_metadata_precompute = (
            _should_disable_scheduler_metadata_precompute()
        )

    def _maybe_init_local_attn_builder(
        self, model_runner: ModelRunner
    ) -> Optional[LocalAttentionMetadataBuilder]:
        if not model_runner.model_config.is_local_attention_model:
            return None
        # Local attention re-translates metadata.page_table through the static
        # full->swa map, which is meaningless on the unified pool's physical tables.
        assert not self.kv_index_translator.is_translating, (
            "--enable-unified-memory does not support local-attention models "
            "on the fa3/fa4 backend."
        )
        assert model_runner.attention_chunk_size is not None, (
            "Attention chunk size is required for local attention"
        )
        return LocalAttentionMetadataBuilder(
            attention_chunk_size=model_runner.attention_chunk_size,
            page_size=self.page_size,
            max_context_len=self.max_context_len,
            device=self.device,
            swa_translate=(
                self.token_to_kv_pool.translate_loc_from_full_to_swa
                if self.use_sliding_window_kv_pool
                else None
            ),
        )

    def _compute_scheduler_metadata(
        self, batch_size, max_seq_len_k, cache_seqlens, cu_seqlens_q
    ):
        """Compute FA3 scheduler metadata for decode.

        Returns the scheduler_metadata tensor, or None if not applicable.
        """
        if self._get_scheduler_metadata is None or self.use_mla:
            return None
        if self._disable_scheduler_metadata_precompute:
            return None
        # Always use window_size=(-1, -1) because scheduler_metadata is only
        # consumed by non-SWA layers (SWA layers skip it in forward_decode).
        return self._get_scheduler_metadata(
            batch_size=batch_size,
            max_seqlen_q=1,
            max_seqlen_k=max_seq_len_k,
            num_heads=self.num_attention_heads,
            num_heads_k=self.num_kv_heads,
            headdim=self.head_dim,
            cache_seqlens=cache_seqlens,
            qkv_dtype=self.kv_cache_dtype,
            cu_seqlens_q=cu_seqlens_q,
            page_size=self.page_size,
            causal=True,
            has_softcap=self.has_softcap,
            num_splits=self.num_splits,
        )

    def validate_elastic_cuda_graph_recapture(self) -> None:
        if self.use_mla and self.fa_impl_ver != 3:
            raise ValueError(
                "Elastic EP CUDA graph recapture with MLA requires FlashAttention 3."
            )

    def _mxfp8_sf_kwargs(self, layer, forward_batch, q_descale=None):
        """Block-scaled UE8M0 scale factors for the FA4 MXFP8 attention path.

        The pool stores K/V scales interleaved in the FA4 BlockScaledBasicChunk
        layout (page_size==128) as sfk/sfv; the per-token Q scales (q_descale
        from the model layer) ride along as sfq. All three drive the kernel's
        block-scaled QK^T (mxf8f6f4) and in-kernel V dequant."""
        if not self.kv_cache_is_mxfp8:
            return {}
        if self.fa_impl_ver != 4:
            raise RuntimeError("MXFP8 KV cache requires the FA4 backend.")
        if q_descale is None:
            raise RuntimeError(
                "MXFP8 KV cache requires per-token Q scales (q_descale) from "
                "the attention layer for the block-scaled QK^T path."
            )
        # qk_sf_vec_size / v_sf_vec_size default to 32 inside the FA4 interface
        # when sf tensors are given, so they don't need to be passed here (the
        # flash_attn_with_kvcache / varlen wrappers don't forward them anyway).
        k_sf, v_sf = self.token_to_kv_pool.get_kv_scale_buffer(layer.layer_id)
        return {"sfq": q_descale, "sfk": k_sf, "sfv": v_sf}

    def _capture_unified_verify_metadata(self, forward_batch: ForwardBatch) -> bool:
        # Fixed-width verify uses only capture-stable request/length buffers.
        # Ragged layouts and encoder offsets still use their eager builders.
        return (
            forward_batch.forward_mode.is_target_verify()
            and self.fa_impl_ver == 4
            and self.kv_index_translator.reads_are_translated
            and self.topk <= 1
            and forward_batch.encoder_lens is None
            and getattr(forward_batch.spec_info, "ragged_verify_layout", None) is None
        )

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        if self._capture_unified_verify_metadata(forward_batch):
            metadata = self.target_verify_metadata[forward_batch.batch_size]
            translator = self.kv_index_translator
            swa = translator.space(IdSpaceKind.SLIDING_WINDOW)
            normal_decode_set_metadata(
                metadata.cache_seqlens_int32,
                metadata.cu_seqlens_k,
                metadata.page_table,
                self.req_to_token,
                forward_batch.req_pool_indices,
                self.max_num_pages,
                forward_batch.seq_lens,
                self.speculative_num_draft_tokens,
                self.page_size,
                metadata.swa_page_table,
                full_v2p=translator.space(IdSpaceKind.FULL).read_v2p,
                swa_v2p=None if swa is None else swa.read_v2p,
                zero_tail=True,
            )
            return
        # Single-CG has no Python between steps, so one capturable kernel updates
        # the persistent metadata.
        if not forward_batch.forward_mode.is_draft_extend_v2():
            return
        if self.kv_index_translator.is_translating:
            # The draft-extend runners record this call unconditionally; a
            # translating backend rebuilds these tables out of graph, and a
            # captured req_to_token gather would overwrite them with virtual ids.
            return
        bs = forward_batch.batch_size
        metadata = self.draft_extend_metadata[bs]
        mapping = self._in_graph_full_to_swa_index_mapping()
        draft_extend_set_metadata(
            cache_seqlens_int32=metadata.cache_seqlens_int32,
            cu_seqlens_k=metadata.cu_seqlens_k,
            cu_seqlens_q=metadata.cu_seqlens_q,
            page_table=metadata.page_table,
            req_to_token=self.req_to_token,
            req_pool_indices=forward_batch.req_pool_indices[:bs],
            seq_lens=forward_batch.seq_lens[:bs],
            extend_seq_lens=forward_batch.extend_seq_lens[:bs],
            page_size=self.page_size,
            full_to_swa_index_mapping=mapping,
            swa_page_table=metadata.swa_page_table if mapping is not None else None,
            out_cache_loc=(
                forward_batch.out_cache_loc if mapping is not None else None
            ),
            swa_out_cache_loc=(
                metadata.swa_out_cache_loc if mapping is not None else None
            ),
        )

    @property
    def supports_draft_extend_metadata_staging(self) -> bool:
        return (
            self.topk == 1
            and not self.kv_index_translator.is_translating
            and self.draft_extend_metadata_captured_in_graph()
        )

    def stage_draft_extend_metadata(self, forward_batch: ForwardBatch):
        self.forward_metadata = self.draft_extend_metadata[forward_batch.batch_size]
        self.forward_metadata.max_seq_len_k = self.max_context_len
        self.forward_metadata_spec_decode_expand = None
        self.init_forward_metadata_in_graph(forward_batch)

    def _in_graph_full_to_swa_index_mapping(self) -> Optional[torch.Tensor]:
        # The in-graph SWA translation needs the raw mapping tensor; v2p-table
        # pools (UnifiedSWAKVPool) keep it None and must stay on the eager
        # rebuild path.
        if not self.use_sliding_window_kv_pool:
            return None
        return self.token_to_kv_pool.full_to_swa_index_mapping

    def draft_extend_metadata_captured_in_graph(self) -> bool:
        # A translating backend rebuilds out of graph: the captured gather
        # would bake raw req_to_token (virtual) ids into the page table.
        if self.kv_index_translator.is_translating:
            return False
        return (
            not self.use_sliding_window_kv_pool
            or self.token_to_kv_pool.full_to_swa_index_mapping is not None
        )

    def init_forward_metadata_out_graph(
        self,
        forward_batch: ForwardBatch,
        in_capture: bool = False,
    ):
        """Dispatch full-CG metadata: plain EXTEND (prefill) vs decode modes."""
        forward_mode = forward_batch.forward_mode
        if forward_mode.is_extend() and not (
            forward_mode.is_target_verify()
            or forward_mode.is_draft_extend_v2()
            or forward_mode.is_dllm_extend()
        ):
            self._init_full_cg_prefill_metadata(forward_batch, in_capture)
        else:
            self._init_full_cg_decode_metadata(forward_batch, in_capture)

    def _get_swa_write_locations(self, forward_batch: ForwardBatch):
        """This step's sliding-window write ids: the plan's, sliced per
        draft step the way `out_cache_loc` is."""
        locations = self.kv_index_translator.write_ids(
            forward_batch, IdSpaceKind.SLIDING_WINDOW
        )
        if (
            locations is not None
            and forward_batch.forward_mode.is_decode_or_idle()
            and forward_batch.spec_info is not None
            and self.topk > 0
            and self.speculative_num_steps > 1
        ):
            locations = per_step_draft_out_cache_loc(
                locations,
                forward_batch.batch_size,
                self.topk,
                self.speculative_num_steps,
            )[self.speculative_step_id]
        return locations

    def _init_full_cg_decode_metadata(
        self, forward_batch: ForwardBatch, in_capture: bool
    ):
        """Capture/replay metadata for the decode-runner full-CG modes
        (decode / idle / target_verify / draft_extend)."""
        bs = forward_batch.batch_size
        req_pool_indices = forward_batch.req_pool_indices
        seq_lens = forward_batch.seq_lens
        encoder_lens = forward_batch.encoder_lens
        forward_mode = forward_batch.forward_mode
        spec_info = forward_batch.spec_info
        out_cache_loc = getattr(forward_batch, "out_cache_loc", None)

        # Refill the SWA write-target buffer (bound as a metadata view in
        # _bind_metadata_buffers) from the live out_cache_loc before replay.
        if self.use_sliding_window_kv_pool and out_cache_loc is not None:
            swa_out_cache_loc = self._get_swa_write_locations(forward_batch)
            n = swa_out_cache_loc.shape[0]
            assert_buffer_fits(
                n,
                self.cuda_graph_swa_out_cache_loc.shape[0],
                "full decode SWA write locations",
            )
            self.cuda_graph_swa_out_cache_loc[n:].zero_()
            if in_capture:
                self.cuda_graph_swa_out_cache_loc[:n].zero_()
            else:
                self.cuda_graph_swa_out_cache_loc[:n].copy_(swa_out_cache_loc)

        if self._capture_unified_verify_metadata(forward_batch):
            if in_capture:
                self._bind_metadata_buffers(
                    bs,
                    forward_batch.positions.numel(),
                    encoder_lens,
                    forward_mode,
                    spec_info,
                    seq_lens.device,
                )
            self.forward_metadata = self.target_verify_metadata[bs]
            self.forward_metadata_spec_decode_expand = None
            # The runner records the device-side update at the start of the
            # model graph. Do not populate a live plan's read-table cache with
            # this graph-owned buffer: another bucket can overwrite it later.
            return

        if in_capture:
            num_tokens = forward_batch.positions.numel()
            seq_lens_cpu = seq_lens.cpu()
            self._bind_metadata_buffers(
                bs,
                num_tokens,
                encoder_lens,
                forward_mode,
                spec_info,
                seq_lens.device,
            )

            if (
                forward_mode.is_decode_or_idle()
                and spec_info is not None
                and self.topk > 1
            ):
                # topk>1 draft decode: replay needs out_cache_loc which capture doesn't have;
                # set forward_metadata directly and let actual CUDA graph replay fill data.
                self.forward_metadata = self.draft_decode_metadata_topk_normal[bs]
                self.forward_metadata_spec_decode_expand = (
                    self.draft_decode_metadata_topk_expand[bs]
                )
                return

            if forward_mode.is_target_verify() and self.topk > 1:
                # topk>1 target verify: replay needs spec_info.positions and .custom_mask
                # which are not populated at capture time.
                self.forward_metadata = self.target_verify_metadata_topk_normal[bs]
                self.forward_metadata_spec_decode_expand = (
                    self.target_verify_metadata_topk_expand[bs]
                )
                return

            self._apply_cuda_graph_metadata(
                plan=forward_batch.kv_loc_plan,
                bs=bs,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                encoder_lens=encoder_lens,
                forward_mode=forward_mode,
                spec_info=spec_info,
                seq_lens_cpu=seq_lens_cpu,
                out_cache_loc=out_cache_loc,
            )

            if forward_mode.is_decode_or_idle() and spec_info is None:
                # Local attention and scheduler metadata require capture-time slice sizing.
                # Both depend on data already filled by replay above.
                metadata = self.decode_cuda_graph_metadata[bs]
                if self._decode_uses_static_max_seqlen_k:
                    # FA4 bakes its N-tile grid and SplitKV specialization into
                    # the graph. Capture against the full replay bound, not the
                    # padded seq-len fill value (1), or a later long-context
                    # replay would leave K/V tiles uncovered.
                    metadata.max_seq_len_k = self.max_context_len
                if self.local_attn_builder is not None:
                    metadata.local_attn_metadata = (
                        self.local_attn_builder.build_for_capture(
                            metadata,
                            bs,
                            buffers=self.decode_cuda_graph_local_attn_metadata,
                        )
                    )
                if self._sched_meta_buf is not None:
                    sched = self._compute_scheduler_metadata(
                        bs,
                        max(metadata.max_seq_len_k, 1),
                        metadata.cache_seqlens_int32,
                        metadata.cu_seqlens_q,
                    )
                    if sched is not None:
                        n = sched.shape[0]
                        self._sched_meta_buf[:n] = sched
                        self._sched_meta_buf[n:] = 0
                        metadata.scheduler_metadata = self._sched_meta_buf[:n]

            if forward_mode.is_draft_extend_v2():
                # CUDA graph bakes max_seq_len_q as a constant. replay() sets it to
                # max(num_accept_tokens_cpu) which is None/empty at capture time,
                # falling back to 1. Restore the correct upper bound so the kernel
                # sees num_tokens_per_req (not 1) for all replays of this graph.
                self.forward_metadata.max_seq_len_q = num_tokens // bs
        else:
            # A stale non-None seq_lens_cpu buffer would under-size max_seq_pages
            # (stale page-table rows -> OOB); force None under sync-free.
            self._apply_cuda_graph_metadata(
                plan=forward_batch.kv_loc_plan,
                bs=bs,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                encoder_lens=encoder_lens,
                forward_mode=forward_mode,
                spec_info=spec_info,
                seq_lens_cpu=(
                    forward_batch.seq_lens_cpu if self.needs_cpu_seq_lens else None
                ),
                out_cache_loc=out_cache_loc,
            )

    def _init_full_cg_prefill_metadata(
        self, forward_batch: ForwardBatch, in_capture: bool
    ):
        """Capture/replay metadata for plain EXTEND under full prefill CUDA
        graph. Mirrors the eager extend branch of init_forward_metadata, with
        three capture-contract differences:

        - all tensors live in dedicated preallocated buffers (the captured
          kernels hold their addresses; refilled in place each replay);
        - cu_seqlens_q always gets its own buffer (the eager no-prefix path
          aliases it to cu_seqlens_k — under capture that would permanently
          weld q to the k buffer and break prefix replays);
        - max_seq_len_q / max_seq_len_k are baked at capture as upper bounds
          (the bucket's num_tokens / max_context_len): the kernel reads real
          work extents from the cu_seqlens / cache_seqlens device buffers.
        """
        bs = forward_batch.batch_size
        if in_capture and getattr(self, "full_cg_prefill_metadata", None) is None:
            device = forward_batch.seq_lens.device
            m = FlashAttentionMetadata()
            m.cache_seqlens_int32 = torch.zeros((bs,), dtype=torch.int32, device=device)
            m.cu_seqlens_q = torch.zeros((bs + 1,), dtype=torch.int32, device=device)
            m.cu_seqlens_k = torch.zeros((bs + 1,), dtype=torch.int32, device=device)
            # Block table sized in PAGES. For page_size == 1 max_num_pages ==
            # max_context_len, so this reduces to the per-token layout.
            m.page_table = torch.zeros(
                (bs, self.max_num_pages), dtype=torch.int32, device=device
            )
            # Page-start token offsets for the strided block-table gather. For
            # page_size == 1 this is arange(max_context_len) and the gather + //1
            # below reduces to the plain per-token req_to_token copy.
            self.full_cg_prefill_strided_indices = torch.arange(
                0, self.max_context_len, self.page_size, device=device
            )
            # SWA (hybrid sliding-window) buffers, mirroring the eager extend
            # path: a page-strided SWA block table + SWA-translated write
            # locations. The out-cache buffer is pointer-stable (sized to an
            # upper bound) so captured graphs keep a valid address; each replay
            # refills a [:num_tokens] view.
            if self.use_sliding_window_kv_pool:
                assert forward_batch.out_cache_loc is not None
                m.swa_page_table = torch.zeros(
                    (bs, self.max_num_pages), dtype=torch.int32, device=device
                )
                self.full_cg_prefill_swa_out_cache_loc = torch.zeros(
                    (forward_batch.out_cache_loc.shape[0],),
                    dtype=torch.int64,
                    device=device,
                )
            self.full_cg_prefill_metadata = m
        m = self.full_cg_prefill_metadata
        assert m is not None and bs == m.cache_seqlens_int32.shape[0], (
            "full-CG prefill metadata must be created at capture with the same "
            "fixed request-slot count used at replay"
        )

        seq_lens = forward_batch.seq_lens[:bs]
        m.cache_seqlens_int32.copy_(seq_lens)
        m.cu_seqlens_k[1:].copy_(torch.cumsum(seq_lens, dim=0))
        m.cu_seqlens_q[1:].copy_(
            torch.cumsum(forward_batch.extend_seq_lens[:bs], dim=0)
        )
        translating = self.kv_index_translator.is_translating
        max_seq_len_k = int(forward_batch.seq_lens_cpu[:bs].max().item())
        if translating:
            # Unified pool: the plan's page table, physical page ids from this
            # iteration's v2p, copied into these capture-stable buffers.
            self.kv_index_translator.copy_page_table(
                forward_batch.kv_loc_plan, out=m.page_table
            )
            if self.use_sliding_window_kv_pool:
                self.kv_index_translator.copy_page_table(
                    forward_batch.kv_loc_plan,
                    out=m.swa_page_table,
                    kind=IdSpaceKind.SLIDING_WINDOW,
                )
        elif max_seq_len_k > 0:
            # Build the block table like the eager extend branch: take every
            # page_size-th token slot from req_to_token and divide by page_size.
            # Identity for page_size == 1 (strided is 0..max_seq_len_k-1, //1).
            max_seq_pages = (max_seq_len_k + self.page_size - 1) // self.page_size
            page_indices = self.req_to_token[
                forward_batch.req_pool_indices[:bs, None],
                self.full_cg_prefill_strided_indices[:max_seq_pages],
            ]
            m.page_table[:, :max_seq_pages].copy_(page_indices // self.page_size)
            if self.use_sliding_window_kv_pool:
                # SWA block table: translate the page-start full slots to their
                # SWA cache locations, then reduce to SWA page indices.
                swa_starts = self.token_to_kv_pool.translate_loc_from_full_to_swa(
                    page_indices
                )
                m.swa_page_table[:, :max_seq_pages].copy_(swa_starts // self.page_size)
        if self.use_sliding_window_kv_pool and forward_batch.out_cache_loc is not None:
            # SWA write targets for the new tokens (KVWriteLoc.swa_loc), refilled
            # into the pointer-stable buffer and bound as a [:num_tokens] view.
            num_out = forward_batch.out_cache_loc.shape[0]
            assert_buffer_fits(
                num_out,
                self.full_cg_prefill_swa_out_cache_loc.shape[0],
                "full-CG prefill SWA write-location buffer",
            )
            if in_capture:
                # The runner-built capture batch writes the page-0 sink.
                self.full_cg_prefill_swa_out_cache_loc[:num_out].zero_()
            else:
                self.full_cg_prefill_swa_out_cache_loc[:num_out].copy_(
                    self.kv_index_translator.write_ids(
                        forward_batch, IdSpaceKind.SLIDING_WINDOW
                    )
                )
            # Captured kernels read the full bucket. Route its inactive tail to
            # SWA's zero dummy slot to prevent stale writes into live slots.
            self.full_cg_prefill_swa_out_cache_loc[num_out:].zero_()
            m.swa_out_cache_loc = self.full_cg_prefill_swa_out_cache_loc[:num_out]
        if in_capture:
            # Baked into the captured kernel launches; upper bounds only.
            m.max_seq_len_q = forward_batch.positions.numel()
            m.max_seq_len_k = self.max_context_len
        self.forward_metadata = m

    def _spec_read_seq_len_delta(
        self, forward_mode: ForwardMode, spec_info: Optional[SpecInput]
    ) -> int:
        """Columns past ``seq_lens`` this mode's whole-sequence read covers;
        the translated table must reach ``cache_seqlens``.

        Zero for the prefix-only shapes: normal decode/extend, the topk>1
        split (drafts read via the expand metadata), draft-extend (whose lens
        already include the window) and its idle batch. The ragged verify
        layout's per-row lens are bounded by the draft window, so the same
        delta bounds it."""
        if spec_info is None:
            return 0
        if forward_mode.is_target_verify() and self.topk <= 1:
            return self.speculative_num_draft_tokens
        if (
            forward_mode.is_decode_or_idle()
            and self.topk <= 1
            and self.speculative_num_steps > 0
        ):
            return self.speculative_step_id + 1
        return 0

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Initialize forward metadata hence all layers in the forward pass can reuse it."""
        metadata = FlashAttentionMetadata()
        seqlens_in_batch = forward_batch.seq_lens
        batch_size = forward_batch.batch_size
        device = seqlens_in_batch.device
        # Eager (non-cuda-graph) path: max_seq_len_k only feeds Python-side
        # page-table slicing and the scheduler_metadata heuristic -- never the
        # kernel. Use the CPU mirror when published; otherwise the static
        # max_context_len bound (over-wide page table, slightly suboptimal
        # split heuristic, but no D2H sync).
        seq_lens_cpu = forward_batch.seq_lens_cpu
        eager_max_k = (
            seq_lens_cpu.max().item()
            if seq_lens_cpu is not None and seq_lens_cpu.numel() > 0
            else self.max_context_len
        )

        if forward_batch.forward_mode.is_decode_or_idle():
            # Draft Decode
            if forward_batch.spec_info is not None:
                if self.topk <= 1:
                    metadata.cache_seqlens_int32 = (
                        seqlens_in_batch + (self.speculative_step_id + 1)
                    ).to(torch.int32)
                    metadata.max_seq_len_k = eager_max_k + (
                        self.speculative_step_id + 1
                    )
                    metadata.cu_seqlens_q = torch.arange(
                        0, batch_size + 1, dtype=torch.int32, device=device
                    )
                    metadata.cu_seqlens_k = torch.nn.functional.pad(
                        torch.cumsum(
                            metadata.cache_seqlens_int32, dim=0, dtype=torch.int32
                        ),
                        (1, 0),
                    )
                    metadata.page_table = self.req_to_token_pool.req_to_token[
                        forward_batch.req_pool_indices, : metadata.max_seq_len_k
                    ]
                elif self.speculative_num_steps == 0:
                    # Draft-extend's idle batch (padded for DP MLP-sync) has no
                    # tree; build plain metadata (padded output is discarded).
                    metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
                    metadata.max_seq_len_k = eager_max_k
                    metadata.cu_seqlens_q = torch.arange(
                        0, batch_size + 1, dtype=torch.int32, device=device
                    )
                    metadata.cu_seqlens_k = torch.nn.functional.pad(
                        torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0)
                    )
                    metadata.page_table = self.req_to_token_pool.req_to_token[
                        forward_batch.req_pool_indices, : metadata.max_seq_len_k
                    ]
                else:
                    metadata.cache_seqlens_int32 = (seqlens_in_batch).to(torch.int32)
                    metadata.max_seq_len_q = self.topk
                    metadata.max_seq_len_k = eager_max_k
                    metadata.cu_seqlens_q = torch.arange(
                        0,
                        batch_size * self.topk + 1,
                        step=self.topk,
                        dtype=torch.int32,
                        device=device,
                    )
                    metadata.cu_seqlens_k = torch.nn.functional.pad(
                        torch.cumsum(
                            metadata.cache_seqlens_int32, dim=0, dtype=torch.int32
                        ),
                        (1, 0),
                    )
                    metadata.page_table = self.req_to_token_pool.req_to_token[
                        forward_batch.req_pool_indices, : metadata.max_seq_len_k
                    ]
                    metadata_expand = FlashAttentionMetadata()
                    decode_length = self.speculative_step_id + 1
                    metadata_expand.cache_seqlens_int32 = torch.full(
                        (seqlens_in_batch.numel() * self.topk,),
                        decode_length,
                        device=device,
                        dtype=torch.int32,
                    )
                    metadata_expand.max_seq_len_q = 1
                    metadata_expand.cu_seqlens_q = torch.arange(
                        0,
                        metadata_expand.cache_seqlens_int32.numel() + 1,
                        dtype=torch.int32,
                        device=device,
                    )
                    metadata_expand.cu_seqlens_k = torch.arange(
                        0,
                        metadata_expand.cache_seqlens_int32.numel() * decode_length + 1,
                        step=decode_length,
                        dtype=torch.int32,
                        device=device,
                    )
                    # shape: [bs, num_steps, topk] -> [bs x topk, num_steps]
                    cache_loc = forward_batch.out_cache_loc.view(
                        -1, self.speculative_num_steps
                    )
                    metadata_expand.page_table = (
                        cache_loc[:, :decode_length].contiguous().to(torch.int32)
                    )
                    self.forward_metadata_spec_decode_expand = metadata_expand
            else:
                # Normal Decode
                metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
                metadata.max_seq_len_k = eager_max_k
                metadata.cu_seqlens_q = torch.arange(
                    0, batch_size + 1, dtype=torch.int32, device=device
                )
                metadata.cu_seqlens_k = torch.nn.functional.pad(
                    torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0)
                )
                metadata.page_table = self.req_to_token_pool.req_to_token[
                    forward_batch.req_pool_indices, : metadata.max_seq_len_k
                ]

                if self.is_prefill_aware_swa and self.has_swa:
                    pa_max_len = min(
                        self._pa_swa_max_prefill_len + self.sliding_window_size,
                        metadata.max_seq_len_k,
                    )

                    pa_page_table, pa_kv_lens = _build_pa_page_table(
                        self.req_to_token,
                        forward_batch.req_pool_indices[:batch_size],
                        forward_batch.seq_lens,
                        self._pa_swa_prefill_lens,
                        self.sliding_window_size,
                        batch_size,
                        pa_max_len,
                        device,
                    )
                    metadata.pa_swa_page_table = pa_page_table
                    metadata.pa_swa_cache_seqlens = pa_kv_lens
                # Precompute FA3 scheduler metadata to avoid per-layer
                # prepare_varlen_num_blocks kernel calls
                metadata.scheduler_metadata = self._compute_scheduler_metadata(
                    batch_size,
                    metadata.max_seq_len_k,
                    metadata.cache_seqlens_int32,
                    metadata.cu_seqlens_q,
                )
            # TODO: we need to test this part for llama 4 eagle case
            self._maybe_init_local_attn_metadata(metadata, device)
        elif forward_batch.forward_mode.is_target_verify():
            if self.topk <= 1:
                ragged_layout = getattr(
                    forward_batch.spec_info, "ragged_verify_layout", None
                )
                if ragged_layout is not None:
                    geometry = build_ragged_target_verify_geometry(
                        seq_lens=forward_batch.seq_lens, layout=ragged_layout
                    )
                    metadata.cache_seqlens_int32 = geometry.cache_seqlens_int32
                    # Device-only layouts carry no host lens; the verify
                    # window is a valid varlen upper bound.
                    metadata.max_seq_len_q = (
                        geometry.max_seq_len_q
                        if geometry.max_seq_len_q is not None
                        else self.speculative_num_draft_tokens
                    )
                    metadata.max_seq_len_k = int(
                        metadata.cache_seqlens_int32.max().item()
                    )
                    metadata.cu_seqlens_q = geometry.cu_seqlens_q
                    metadata.cu_seqlens_k = geometry.cu_seqlens_k
                else:
                    metadata.cache_seqlens_int32 = (
                        forward_batch.seq_lens + self.speculative_num_draft_tokens
                    ).to(torch.int32)
                    metadata.max_seq_len_q = self.speculative_num_draft_tokens
                    metadata.max_seq_len_k = (
                        eager_max_k + self.speculative_num_draft_tokens
                    )
                    metadata.cu_seqlens_q = torch.arange(
                        0,
                        batch_size * self.speculative_num_draft_tokens + 1,
                        self.speculative_num_draft_tokens,
                        dtype=torch.int32,
                        device=device,
                    )
                    metadata.cu_seqlens_k = torch.nn.functional.pad(
                        torch.cumsum(
                            metadata.cache_seqlens_int32, dim=0, dtype=torch.int32
                        ),
                        (1, 0),
                    )
                metadata.page_table = self.req_to_token_pool.req_to_token[
                    forward_batch.req_pool_indices, : metadata.max_seq_len_k
                ]

                self._maybe_init_local_attn_metadata(metadata, device)
            else:
                metadata.cache_seqlens_int32 = forward_batch.seq_lens.to(torch.int32)
                metadata.max_seq_len_q = self.speculative_num_draft_tokens
                metadata.max_seq_len_k = eager_max_k
                metadata.cu_seqlens_q = torch.arange(
                    0,
                    batch_size * self.speculative_num_draft_tokens + 1,
                    step=self.speculative_num_draft_tokens,
                    dtype=torch.int32,
                    device=device,
                )
                metadata.cu_seqlens_k = torch.nn.functional.pad(
                    torch.cumsum(
                        metadata.cache_seqlens_int32, dim=0, dtype=torch.int32
                    ),
                    (1, 0),
                )
                metadata.page_table = self.req_to_token_pool.req_to_token[
                    forward_batch.req_pool_indices, : metadata.max_seq_len_k
                ]

                metadata_expand = FlashAttentionMetadata()

                metadata_expand.max_seq_len_q = 1
                metadata_expand.cu_seqlens_q = torch.arange(
                    0,
                    forward_batch.seq_lens.numel() * self.speculative_num_draft_tokens
                    + 1,
                    dtype=torch.int32,
                    device=device,
                )

                # create expand page table
                offsets = torch.arange(
                    self.speculative_num_draft_tokens, device=device
                ).unsqueeze(0)  # shape: (1, self.speculative_num_draft_tokens)
                cols = offsets.expand(
                    forward_batch.seq_lens.numel(), -1
                ) + forward_batch.seq_lens.unsqueeze(1)
                cum_len = torch.nn.functional.pad(
                    torch.cumsum(
                        (
                            forward_batch.seq_lens + self.speculative_num_draft_tokens
                        ).repeat_interleave(self.speculative_num_draft_tokens),
                        dim=0,
                    ),
                    (1, 0),
                )[:-1]
                mask_extraction_indices = (
                    cols.repeat_interleave(self.speculative_num_draft_tokens, dim=0)
                    + cum_len[:, None]
                ).view(1, -1)
                mask = forward_batch.spec_info.custom_mask[
                    mask_extraction_indices
                ].view(
                    -1, self.speculative_num_draft_tokens
                )  # (bsz * draft_num, draft_num)

                # shift table indices to avoid padding
                # non_masked_page_table [[8, 9, 10],   mask (display with int format) [[1, 0, 0],
                #                        [8, 9, 10],                                   [1, 1, 0],
                #                        [8, 9, 10]]                                   [1, 0, 1]]
                # if masked with padding [[8, 0, 0],   our mask without padding       [[8, 9, 10],
                #                        [8, 9, 0],                                    [8, 9, 10],
                #                        [8, 0, 10]]                                   [8, 10, 9]]
                # note here cache_seqlens_int32 is [1, 2, 2] so extra page indices will be ignored in each row
                col_indices = offsets.expand(
                    mask.shape[0], self.speculative_num_draft_tokens
                )
                # Build keys: if an entry is valid (mask==True), keep its original index;
                # if not, add self.speculative_num_draft_tokens so that it sorts after all valid entries.
                keys = torch.where(
                    mask, col_indices, col_indices + self.speculative_num_draft_tokens
                )
                _, sort_order = torch.sort(keys, dim=1)
                non_masked_page_table = (
                    self.req_to_token_pool.req_to_token[
                        forward_batch.req_pool_indices, :
                    ]
                    .gather(1, cols)
                    .repeat_interleave(self.speculative_num_draft_tokens, dim=0)
                )  # (bsz, draft_num)
                metadata_expand.page_table = non_masked_page_table.gather(1, sort_order)
                metadata_expand.cache_seqlens_int32 = mask.sum(dim=1).to(torch.int32)
                metadata_expand.cu_seqlens_k = torch.nn.functional.pad(
                    torch.cumsum(
                        metadata_expand.cache_seqlens_int32, dim=0, dtype=torch.int32
                    ),
                    (1, 0),
                )
                self.forward_metadata_spec_decode_expand = metadata_expand

                if self.has_swa:
                    self._init_sliding_window_attn_spec_metadata(
                        metadata, metadata_expand
                    )

        elif forward_batch.forward_mode.is_extend_or_draft_extend_or_mixed(
            include_draft_extend_v2=True
        ):
            metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
            metadata.max_seq_len_k = eager_max_k
            metadata.cu_seqlens_k = torch.nn.functional.pad(
                torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0)
            )

            metadata.page_table = self.req_to_token_pool.req_to_token[
                forward_batch.req_pool_indices, : metadata.max_seq_len_k
            ]

            if forward_batch.forward_mode.is_draft_extend_v2():
                # Fixed-q window (num_draft_tokens, widened by num_front_tokens
                # when the CPU mirror is published); extend_seq_lens_cpu may be
                # None on the GPU-only spec path, where the config constant is
                # the exact width.
                extend_seq_lens = forward_batch.extend_seq_lens
                metadata.max_seq_len_q = (
                    max(forward_batch.extend_seq_lens_cpu)
                    if forward_batch.extend_seq_lens_cpu is not None
                    else self.speculative_num_draft_tokens
                )
                metadata.cu_seqlens_q = torch.nn.functional.pad(
                    torch.cumsum(extend_seq_lens, dim=0, dtype=torch.int32), (1, 0)
                )
            elif any(forward_batch.extend_prefix_lens_cpu):
                extend_seq_lens = forward_batch.extend_seq_lens
                metadata.max_seq_len_q = max(forward_batch.extend_seq_lens_cpu)
                metadata.cu_seqlens_q = torch.nn.functional.pad(
                    torch.cumsum(extend_seq_lens, dim=0, dtype=torch.int32), (1, 0)
                )
            else:
                # max_seq_len_q reaches the kernel -- needs the real host max,
                # not the static max_seq_len_k bound.
                metadata.max_seq_len_q = max(forward_batch.extend_seq_lens_cpu)
                metadata.cu_seqlens_q = metadata.cu_seqlens_k

            # Setup local attention if enabled
            if forward_batch.forward_mode == ForwardMode.EXTEND:
                self._maybe_init_local_attn_metadata(metadata, device)

            if self.is_prefill_aware_swa:
                self._pa_swa_prefill_lens[
                    forward_batch.req_pool_indices[:batch_size]
                ] = forward_batch.seq_lens[:batch_size].to(torch.int32)
                if seq_lens_cpu is not None:
                    max_pf = int(seq_lens_cpu[:batch_size].max().item())
                else:
                    # Ratchet needs a true upper bound; a local D2H beats
                    # poisoning it with max_context_len forever.
                    max_pf = int(forward_batch.seq_lens[:batch_size].max().item())
                if max_pf > self._pa_swa_max_prefill_len:
                    self._pa_swa_max_prefill_len = max_pf

        # Encoder metadata for cross attention. Supports per-request varlen
        # encoder lengths (e.g. MossVL with different image sizes per request).
        if forward_batch.encoder_lens is not None:
            metadata.encoder_lens_int32 = forward_batch.encoder_lens.to(torch.int32)
            metadata.encoder_cu_seqlens_k = torch.nn.functional.pad(
                torch.cumsum(metadata.encoder_lens_int32, dim=0, dtype=torch.int32),
                (1, 0),
            )
            metadata.encoder_max_seq_len_k = metadata.encoder_lens_int32.max().item()

            # Cross-attn page_table: per-request rows. cache_seqlens
            # (encoder_lens_int32) caps per-request reads so any garbage past
            # encoder_lens[i] is never consumed.
            metadata.encoder_page_table = self.req_to_token_pool.req_to_token[
                forward_batch.req_pool_indices, : metadata.encoder_max_seq_len_k
            ]

            # Self-attn (text) page_table: text starts at per-request offset
            # encoder_lens[i], NOT at a single max. Use a fancy-index gather.
            text_max = metadata.max_seq_len_k
            arange_text = torch.arange(
                text_max, device=forward_batch.req_pool_indices.device
            )
            text_col = forward_batch.encoder_lens.long().unsqueeze(
                1
            ) + arange_text.unsqueeze(0)  # (bs, max_seq_len_k)
            text_row = forward_batch.req_pool_indices.unsqueeze(1).expand(-1, text_max)
            metadata.page_table = self.req_to_token_pool.req_to_token[
                text_row, text_col
            ]

        # Safe to rebind: every eager branch above produced a fresh tensor.
        _unified_read = (
            self.kv_index_translator.is_translating and metadata.page_table is not None
        )
        swa_out_cache_loc = (
            self._get_swa_write_locations(forward_batch)
            if self.use_sliding_window_kv_pool
            else None
        )
        if _unified_read:
            # The plan's table covers this forward's reads, a verify's and a
            # draft decode's window included; the kernels bound each row by
            # `cache_seqlens`.
            kv_view = self.kv_index_translator.read_table(
                forward_batch.kv_loc_plan, rows=forward_batch.batch_size
            )
            metadata.page_table = kv_view.ids
            if self.use_sliding_window_kv_pool:
                metadata.swa_page_table = self.kv_index_translator.read_table(
                    forward_batch.kv_loc_plan,
                    kind=IdSpaceKind.SLIDING_WINDOW,
                    rows=forward_batch.batch_size,
                ).ids
                metadata.swa_out_cache_loc = swa_out_cache_loc
        elif self.use_sliding_window_kv_pool:
            # FA3 requires an int32 page_table.
            metadata.swa_page_table = (
                self.token_to_kv_pool.translate_loc_from_full_to_swa(
                    metadata.page_table
                ).to(torch.int32)
            )
            metadata.swa_out_cache_loc = swa_out_cache_loc

        # Logical-page KV sharding: capture the batch's gather plan and swap the
        # page table to scratch rows. During a sharded extend, attention reads
        # the assembled [prefix | chunk] scratch, never the striped pool rows;
        # the plan capture also kicks the first layer's prefix gather.
        #
        # Runs after KVIndexTranslator and before the `// page_size` reduction.
        # The unified-memory UnifiedKVPool and page-interleaved pools are
        # alternatives, so at most one translation fires.
        if self._kv_shard_pool is not None and prepare_kv_shard_forward(
            self._kv_shard_pool,
            self.req_to_token,
            forward_batch,
        ):
            metadata.page_table = self._kv_shard_pool.translate_loc_to_scratch(
                metadata.page_table
            ).to(torch.int32)

        # Convert the page table to a strided format which is needed by FA3 API
        if self.page_size > 1 and not _unified_read:
            self.strided_indices = torch.arange(
                0, metadata.page_table.shape[1], self.page_size, device=self.device
            )

            if self.use_sliding_window_kv_pool:
                metadata.swa_page_table = (
                    metadata.swa_page_table[:, self.strided_indices] // self.page_size
                )

            metadata.page_table = (
                metadata.page_table[:, self.strided_indices] // self.page_size
            )

            if (
                self.topk > 1
                and forward_batch.forward_mode.is_decode_or_idle()
                and forward_batch.spec_info is not None
            ):
                # Modifies cache_seqlens_int32 and page_table(B, speculative_num_steps).
                last_page_lens = forward_batch.seq_lens % self.page_size
                # First attention handles prefix - last_page_len part.
                metadata.cache_seqlens_int32 -= last_page_lens  # Both (B, )

                # Second attention handles last_page_len + decode part.
                expanded_last_page_lens = last_page_lens.repeat_interleave(self.topk)
                self.forward_metadata_spec_decode_expand.cache_seqlens_int32 += (
                    expanded_last_page_lens
                )
                # NOTE: the max decode length is speculative_num_steps - 1 (one token always generated by draft extend)
                # and we leave one extra for last_page_len, which -> speculative_num_steps for the page table
                expand_page_table = torch.zeros(
                    forward_batch.batch_size * self.topk,
                    self.speculative_num_steps,
                    dtype=torch.int32,
                    device=self.device,
                )
                # shape: [bs, num_steps, topk] -> [bs x topk, num_steps]
                cache_loc = forward_batch.out_cache_loc.view(
                    -1, self.speculative_num_steps
                )
                draft_decode_set_expand_metadata(
                    cache_seqlens_int32=self.forward_metadata_spec_decode_expand.cache_seqlens_int32,
                    page_table=expand_page_table,
                    last_page_lens=last_page_lens,
                    decode_length=decode_length,
                    cache_loc=cache_loc,
                    topk=self.topk,
                    page_size=self.page_size,
                )
                self.forward_metadata_spec_decode_expand.page_table = expand_page_table

        self.forward_metadata = metadata

    def get_paged_mha_kv_cache(
        self,
        layer: RadixAttention,
        *,
        head_group_num: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key_cache, value_cache = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        key_cache = paged_kv_view(
            key_cache, self.page_size, layer.tp_k_head_num, layer.head_dim
        )
        value_cache = paged_kv_view(
            value_cache, self.page_size, layer.tp_v_head_num, layer.v_head_dim
        )
        if head_group_num != 1:
            # Reinterpret each page's heads as `head_group_num` pseudo-pages.
            assert key_cache.is_contiguous() and value_cache.is_contiguous(), (
                f"head_group_num={head_group_num} needs a contiguous paged KV "
                "view; this one carries the pool's slot stride "
                f"(key {key_cache.stride()}, value {value_cache.stride()}), "
                "which no reshape of the head dimension can express."
            )
            key_cache = key_cache.view(
                -1,
                self.page_size,
                layer.tp_k_head_num // head_group_num,
                layer.head_dim,
            )
            value_cache = value_cache.view(
                -1,
                self.page_size,
                layer.tp_v_head_num // head_group_num,
                layer.v_head_dim,
            )
        return key_cache, value_cache

    def prepare_paged_mha_query(
        self,
        q: torch.Tensor,
        q_rope: Optional[torch.Tensor],
        k_rope: Optional[torch.Tensor],
        layer: RadixAttention,
        *,
        logical_batch_size: int,
        kv_head_num: int,
        is_prefill: bool,
    ) -> tuple[
        torch.Tensor,
        Optional[torch.Tensor],
        Optional[torch.Tensor],
        Optional[torch.Tensor],
        Optional[torch.Tensor],
    ]:
        k_descale = v_descale = None
        if (
            self.kv_cache_dtype_str != "auto"
            and layer.head_dim <= 256
            and not self.kv_cache_is_mxfp8
            and (not is_prefill or self.fa_impl_ver != 4)
        ):
            if layer.k_scale is not None:
                descale_shape = (logical_batch_size, kv_head_num)
                k_descale = layer.k_scale.expand(descale_shape)
                v_descale = layer.v_scale.expand(descale_shape)
            q = q.to(self.kv_cache_dtype)
            q_rope = q_rope.to(self.kv_cache_dtype) if q_rope is not None else None
            k_rope = k_rope.to(self.kv_cache_dtype) if k_rope is not None else None
        return q, q_rope, k_rope, k_descale, v_descale

    def get_fused_kv_write_buffers(self, layer, forward_batch):
        if (
            self.kv_cache_dtype != torch.bfloat16
            or self.use_mla
            or layer.is_cross_attention
            or self.kv_index_translator.is_translating
            or self._kv_shard_pool is not None
            or self.fa_skip_kv_cache
            or layer.tp_k_head_num != layer.tp_v_head_num
            or is_cp_active(forward_batch)
            or forward_batch.dcp_kv_mask is not None
        ):
            return None
        write_loc = KVWriteLoc.for_layer(
            forward_batch,
            layer,
            swa_loc=self.forward_metadata.swa_out_cache_loc,
        )
        locations = (
            write_loc.swa_loc
            if self.use_sliding_window_kv_pool and layer.sliding_window_size >= 0
            else write_loc.loc
        )
        if locations is None:
            return None
        buffers = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        shapes = (
            (layer.tp_k_head_num, layer.head_dim),
            (layer.tp_v_head_num, layer.v_head_dim),
        )
        for buffer, shape in zip(buffers, shapes):
            if buffer.shape[1:] != shape or buffer.stride()[-2:] != (shape[-1], 1):
                return None
        return (*buffers, locations)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache=True,
        # For multi-head latent attention
        q_rope: Optional[torch.Tensor] = None,
        k_rope: Optional[torch.Tensor] = None,
        sinks: Optional[torch.Tensor] = None,
        q_descale: Optional[torch.Tensor] = None,
        k_descale: Optional[torch.Tensor] = None,
        v_descale: Optional[torch.Tensor] = None,
        score_mod=None,
        aux_tensors=None,
        rel_bias=None,
        rel_bias_event=None,
        return_lse: bool = False,
    ):
        if score_mod is not None and self.fa_impl_ver != 4:
            raise RuntimeError("score_mod is only supported by the FA4 backend.")
        if return_lse and self.use_mla:
            raise NotImplementedError("MLA extend does not return an LSE.")
        extend_lse = None
        cp_active = is_cp_active(forward_batch)

        if k is not None:
            assert v is not None

            if save_kv_cache and not self.fa_skip_kv_cache:
                if self.use_mla:
                    if cp_active:
                        cp_strategy = get_cp_strategy()
                        assert cp_strategy is not None
                        cp_strategy.materialize_full_mla_kv(
                            forward_batch, layer, k, k_rope
                        )
                    else:
                        self.token_to_kv_pool.set_mla_kv_buffer(
                            layer,
                            KVWriteLoc.for_layer(forward_batch, layer),
                            k,
                            k_rope,
                        )
                elif cp_active:
                    # Dense-MHA CP: k, v are still rank-local; backend
                    # all-gathers and writes to the per-rank pool.
                    swa_loc = (
                        self.forward_metadata.swa_out_cache_loc
                        if self.use_sliding_window_kv_pool
                        else None
                    )
                    cp_strategy = get_cp_strategy()
                    assert cp_strategy is not None
                    cp_strategy.materialize_full_kv(
                        forward_batch, layer, k, v, swa_loc=swa_loc
                    )
                else:
                    k_scale = k_descale if self.kv_cache_is_mxfp8 else layer.k_scale
                    v_scale = v_descale if self.kv_cache_is_mxfp8 else layer.v_scale
                    self.token_to_kv_pool.set_kv_buffer(
                        layer,
                        KVWriteLoc.for_layer(
                            forward_batch,
                            layer,
                            swa_loc=self.forward_metadata.swa_out_cache_loc,
                        ),
                        k,
                        v,
                        k_scale,
                        v_scale,
                    )

        # Use precomputed metadata across all layers
        metadata = self.forward_metadata

        # Calculate window size (can be moved to metadata if layer properties don't change)
        # we don't do layer.sliding_window_size - 1 since in model.get_attention_sliding_window_size() we already - 1
        # here is two side inclusive
        is_swa_layer = (
            layer.sliding_window_size is not None and layer.sliding_window_size > -1
        )
        causal = not (
            layer.is_cross_attention
            or layer.attn_type
            in (AttentionType.ENCODER_ONLY, AttentionType.DECODER_BIDIRECTIONAL)
        )
        # FlashAttention's sliding-window tuple is (left, right). Bidirectional
        # encoder layers must see the same local context on both sides.
        window_size = (
            (layer.sliding_window_size, 0 if causal else layer.sliding_window_size)
            if is_swa_layer
            else (-1, -1)
        )
        q, q_rope, k_rope, fa_k_descale, fa_v_descale = self.prepare_paged_mha_query(
            q,
            q_rope,
            k_rope,
            layer,
            logical_batch_size=forward_batch.batch_size,
            kv_head_num=layer.tp_k_head_num,
            is_prefill=True,
        )
        use_local_attn = (
            self.local_attn_builder is not None
            and self.local_attn_builder.applies(layer, metadata)
        )

        # We do cascade attention for Target Verify with topk > 1
        # We don't use cascade attention for Sliding Window Attention:
        # - Different window sizes should be passed in for each q in the first stage of cascade attention, but FA3 interface doesn't support pass in a list of window sizes.
        # - The overhead of duplicated computation of the common prefix part is small for sliding window layers (seq_len <= window_size), so we can just expand it.
        use_cascade_attn = (
            forward_batch.forward_mode.is_target_verify()
            and self.topk > 1
            and not is_swa_layer
        )

        kwargs = {}
        if sinks is not None:
            kwargs["sinks"] = sinks
        if score_mod is not None:
            kwargs["score_mod"] = score_mod
            kwargs["aux_tensors"] = aux_tensors
        if metadata.image_token_ranges is not None:
            if (
                self.fa_impl_ver != 4
                or cp_active
                or use_local_attn
                or use_cascade_attn
                or self.use_mla
                or self.fa_skip_kv_cache
                or metadata.swa_spec_metadata is not None
                or metadata is self.full_cg_prefill_metadata
                or score_mod is not None
            ):
                raise NotImplementedError(
                    "FA4 image masks require standard paged MHA prefill without "
                    "context parallelism, full prefill graphs, speculative metadata, "
                    "or score modifiers."
                )
            from sglang.kernels.ops.attention.flash_attention_v4 import (
                make_image_mask_mod,
            )

            kwargs["mask_mod"] = make_image_mask_mod(window_size[0])
            kwargs["aux_tensors"] = [metadata.image_token_ranges, metadata.cu_seqlens_q]
            # The callback permits future keys within an image. Built-in
            # causal/window pruning would discard those keys before the mask.
            causal = False
            window_size = (-1, -1)
        kwargs.update(self._mxfp8_sf_kwargs(layer, forward_batch, q_descale))
        if fa_k_descale is not None:
            kwargs["k_descale"] = fa_k_descale
            kwargs["v_descale"] = fa_v_descale
        if rel_bias is not None:
            if self.fa_impl_ver != 4:
                raise RuntimeError(
                    "rel_bias (sheared bias) is only supported by the FA4 backend."
                )
            if rel_bias_event is not None:
                # rel_bias (rel_logits) is produced on InklingAttention's alt stream;
                # join it here -- as late as possible, just before the kernel reads
                # it -- so rel_logits_proj overlaps the KV-write above.
                rel_bias_event.wait()
            kwargs["rel_bias"] = rel_bias
            if metadata is self.full_cg_prefill_metadata:
                # Full-CG reuses the cu_seqlens pointer with new values each replay.
                # Disable its pointer-keyed schedule cache so the graph refreshes it.
                kwargs["rel_bias_prep_cache"] = None
            else:
                if metadata.rel_bias_prep_cache is None:
                    metadata.rel_bias_prep_cache = {}
                kwargs["rel_bias_prep_cache"] = metadata.rel_bias_prep_cache

        _fa_out = (
            forward_batch._attn_output.view(-1, layer.tp_q_head_num, layer.v_head_dim)
            if getattr(forward_batch, "_attn_output", None) is not None
            else None
        )

        # Get the appropriate page table based on whether we're using local attention
        if use_local_attn:
            local_metadata = metadata.local_attn_metadata
            page_table = local_metadata.local_block_table
            cu_seqlens_q = local_metadata.local_query_start_loc
            cache_seqlens = local_metadata.local_seqused_k
            max_seqlen_q = local_metadata.local_max_query_len
        elif is_swa_layer and metadata.swa_spec_metadata is not None:
            swa_spec_metadata = metadata.swa_spec_metadata
            page_table = swa_spec_metadata.page_table
            cu_seqlens_q = swa_spec_metadata.cu_seqlens_q
            cache_seqlens = swa_spec_metadata.cache_seqlens_int32
            max_seqlen_q = swa_spec_metadata.max_seq_len_q
            cu_seqlens_k = swa_spec_metadata.cu_seqlens_k
        else:
            page_table = metadata.page_table
            if is_swa_layer and self.use_sliding_window_kv_pool:
                if metadata.swa_page_table is not None:
                    page_table = metadata.swa_page_table
                else:
                    page_table = self.token_to_kv_pool.translate_loc_from_full_to_swa(
                        metadata.page_table
                    ).to(torch.int32)
            cu_seqlens_q = metadata.cu_seqlens_q
            cache_seqlens = metadata.cache_seqlens_int32
            max_seqlen_q = metadata.max_seq_len_q
            cu_seqlens_k = metadata.cu_seqlens_k

        # Use Flash Attention for prefill
        if not self.use_mla:
            # Do multi-head attention
            key_cache, value_cache = self.get_paged_mha_kv_cache(
                layer,
            )
            if layer.is_cross_attention:
                page_table = metadata.encoder_page_table
                cache_seqlens = metadata.encoder_lens_int32
                cu_seqlens_k = metadata.encoder_cu_seqlens_k
                window_size = (-1, -1)

            if cp_active:

                def _fa_cp_attn(
                    q_chunk, cu_seqlens_q_cp, cache_seqlens_cp, max_seqlen_q_cp
                ):
                    return flash_attn_with_kvcache(
                        q=q_chunk,
                        k_cache=key_cache,
                        v_cache=value_cache,
                        page_table=page_table,
                        cache_seqlens=cache_seqlens_cp,
                        cu_seqlens_q=cu_seqlens_q_cp,
                        cu_seqlens_k_new=cu_seqlens_k if not use_local_attn else None,
                        max_seqlen_q=max_seqlen_q_cp,
                        softmax_scale=layer.scaling,
                        causal=False if use_cascade_attn else causal,
                        window_size=window_size,
                        softcap=layer.logit_cap,
                        return_softmax_lse=use_cascade_attn,
                        num_splits=self.num_splits,
                        ver=self.fa_impl_ver,
                        **kwargs,
                    )

                q_cp = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
                cp_strategy = get_cp_strategy()
                assert cp_strategy is not None
                result = cp_strategy.run_attention(
                    q_cp,
                    forward_batch,
                    self.device,
                    _fa_cp_attn,
                    attention_backend=CPAttentionBackendKind.FLASH_ATTENTION,
                )
            elif self.fa_skip_kv_cache:
                # Embedding mode: skip KV cache read and use raw K/V tensors
                # directly via flash_attn_varlen_func. The KV cache write is
                # also skipped (guarded above). This eliminates store_kvcache
                # and prepare_varlen_num_blocks overhead per layer.
                assert k is not None, "fa_skip_kv_cache requires k to be provided"
                assert k_descale is None and v_descale is None, (
                    "fa_skip_kv_cache uses raw K/V tensors, "
                    "FP8 KV cache descaling is not supported in this mode"
                )
                # Piecewise CUDA graph pads the token dimension up to a captured
                # bucket size, so ``q`` has more rows than ``cu_seqlens_q`` covers.
                # ``flash_attn_varlen_func`` requires ``q.shape[0] == cu_seqlens_q[-1]``;
                # otherwise the boundary query block corrupts the last real token's
                # output, producing a NaN embedding (LAST pooling reads that token).
                # Append the padded tail as a dummy, self-attending segment so every
                # row is a valid sequence. Real tokens stay in their own segment and
                # are unaffected. Built once per forward and cached on the metadata
                # (reused across layers). ``extend_num_tokens`` is a python int equal
                # to ``cu_seqlens_q[-1]`` for extend/prefill forwards, so it needs no
                # device sync. With no padding -- or if the count is unavailable (e.g.
                # any non-piecewise path) -- cu_seqlens_q already covers q, so fall
                # through to using it as-is (no dummy segment).
                if metadata.fa_skip_cu_seqlens_q is None:
                    num_real_tokens = forward_batch.extend_num_tokens
                    num_padded_tokens = q.shape[0]
                    if (
                        num_real_tokens is not None
                        and num_real_tokens < num_padded_tokens
                    ):
                        metadata.fa_skip_cu_seqlens_q = torch.cat(
                            [cu_seqlens_q, cu_seqlens_q.new_tensor([num_padded_tokens])]
                        )
                        metadata.fa_skip_max_seqlen_q = max(
                            int(max_seqlen_q), num_padded_tokens - num_real_tokens
                        )
                    else:
                        metadata.fa_skip_cu_seqlens_q = cu_seqlens_q
                        metadata.fa_skip_max_seqlen_q = max_seqlen_q
                result = self.flash_attn_varlen_func(
                    q=q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim),
                    k=k.view(-1, layer.tp_k_head_num, layer.head_dim),
                    v=v.view(-1, layer.tp_v_head_num, layer.v_head_dim),
                    cu_seqlens_q=metadata.fa_skip_cu_seqlens_q,
                    cu_seqlens_k=metadata.fa_skip_cu_seqlens_q,
                    max_seqlen_q=metadata.fa_skip_max_seqlen_q,
                    max_seqlen_k=metadata.fa_skip_max_seqlen_q,
                    softmax_scale=layer.scaling,
                    causal=causal,
                    window_size=window_size,
                    softcap=layer.logit_cap,
                    num_splits=self.num_splits,
                    out=_fa_out,
                    **kwargs,
                )
            else:
                result = flash_attn_with_kvcache(
                    q=q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim),
                    k_cache=key_cache,
                    v_cache=value_cache,
                    page_table=page_table,
                    cache_seqlens=cache_seqlens,
                    cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k_new=cu_seqlens_k if not use_local_attn else None,
                    max_seqlen_q=max_seqlen_q,
                    softmax_scale=layer.scaling,
                    causal=False if use_cascade_attn else causal,
                    window_size=window_size,
                    softcap=layer.logit_cap,
                    return_softmax_lse=use_cascade_attn or return_lse,
                    num_splits=self.num_splits,
                    out=_fa_out,
                    ver=self.fa_impl_ver,
                    **kwargs,
                )

            if return_lse and not use_cascade_attn:
                if not isinstance(result, tuple):
                    raise RuntimeError("This extend path does not return an LSE.")
                o, softmax_lse, *_ = result
                extend_lse = softmax_lse.T.contiguous()
                result = o
            if use_cascade_attn:
                o, softmax_lse, *rest = result
            if (
                use_cascade_attn
                and forward_batch.spec_algorithm.is_uno()
                and can_use_fused_suffix_attention_merge(
                    layer=layer,
                    q=q,
                    key_cache=key_cache,
                    value_cache=value_cache,
                    extra_kwargs=kwargs,
                )
            ):
                suffix_metadata = self.forward_metadata_spec_decode_expand
                o = merge_suffix_attention_in_place(
                    q=q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim),
                    k_cache=key_cache.view(-1, layer.tp_k_head_num, layer.head_dim),
                    v_cache=value_cache.view(-1, layer.tp_v_head_num, layer.v_head_dim),
                    suffix_page_table=suffix_metadata.page_table,
                    suffix_cache_seqlens=suffix_metadata.cache_seqlens_int32,
                    prefix=o,
                    prefix_lse=softmax_lse,
                    softmax_scale=layer.scaling,
                )
            elif use_cascade_attn:
                o_expand, softmax_lse_expand, *rest_expand = flash_attn_with_kvcache(
                    q=q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim),
                    # The suffix table stores physical token slots, so expose
                    # the paged cache as page-size-one blocks.
                    k_cache=paged_view(
                        key_cache.view(-1, layer.tp_k_head_num, layer.head_dim), 1
                    ),
                    v_cache=paged_view(
                        value_cache.view(-1, layer.tp_v_head_num, layer.v_head_dim),
                        1,
                    ),
                    page_table=self.forward_metadata_spec_decode_expand.page_table,
                    cache_seqlens=self.forward_metadata_spec_decode_expand.cache_seqlens_int32,
                    cu_seqlens_q=self.forward_metadata_spec_decode_expand.cu_seqlens_q,
                    cu_seqlens_k_new=self.forward_metadata_spec_decode_expand.cu_seqlens_k,
                    max_seqlen_q=self.forward_metadata_spec_decode_expand.max_seq_len_q,
                    softmax_scale=layer.scaling,
                    causal=False,
                    window_size=window_size,
                    softcap=layer.logit_cap,
                    return_softmax_lse=True,
                    num_splits=self.num_splits,
                    ver=self.fa_impl_ver,
                    **kwargs,
                )
                o, _ = merge_state_v2_wrapper(
                    o,
                    softmax_lse.T.contiguous(),
                    o_expand,
                    softmax_lse_expand.T.contiguous(),
                )
            else:
                o = result
        else:
            if (
                forward_batch.attn_attend_prefix_cache is not None
                and not forward_batch.forward_mode.is_target_verify()
                and not forward_batch.forward_mode.is_draft_extend_v2()
            ):
                # Do multi-head attention with chunked prefix cache
                if forward_batch.attn_attend_prefix_cache:
                    assert not get_schedule().disable_chunked_prefix_cache
                    # MHA for chunked prefix kv cache when running model with MLA
                    assert forward_batch.prefix_chunk_idx is not None
                    assert forward_batch.prefix_chunk_cu_seq_lens is not None
                    assert forward_batch.prefix_chunk_max_seq_lens is not None

                    chunk_idx = forward_batch.prefix_chunk_idx
                    assert chunk_idx >= 0

                    assert forward_batch.mha_return_lse
                    output = flash_attn_varlen_func(
                        q=q.view(-1, layer.tp_q_head_num, layer.head_dim),
                        k=k.view(-1, layer.tp_k_head_num, layer.head_dim).to(q.dtype),
                        v=v.view(-1, layer.tp_k_head_num, layer.v_head_dim).to(q.dtype),
                        cu_seqlens_q=metadata.cu_seqlens_q,
                        cu_seqlens_k=forward_batch.prefix_chunk_cu_seq_lens[chunk_idx],
                        max_seqlen_q=metadata.max_seq_len_q,
                        max_seqlen_k=forward_batch.prefix_chunk_max_seq_lens[chunk_idx],
                        softmax_scale=layer.scaling,
                        causal=False,
                        return_softmax_lse=True,
                        out=_fa_out,
                        ver=self.fa_impl_ver,
                        **kwargs,
                    )
                else:
                    # MHA for extend part of sequence without attending prefix kv cache
                    cu_seqlens_k = (
                        metadata.cu_seqlens_q
                        if not forward_batch.mha_one_shot
                        else metadata.cu_seqlens_k
                    )
                    max_seqlen_k = (
                        metadata.max_seq_len_q
                        if not forward_batch.mha_one_shot
                        else metadata.max_seq_len_k
                    )
                    output = flash_attn_varlen_func(
                        q=q.view(-1, layer.tp_q_head_num, layer.head_dim),
                        k=k.view(-1, layer.tp_k_head_num, layer.head_dim).to(q.dtype),
                        v=v.view(-1, layer.tp_k_head_num, layer.v_head_dim).to(q.dtype),
                        cu_seqlens_q=metadata.cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k,
                        max_seqlen_q=metadata.max_seq_len_q,
                        max_seqlen_k=max_seqlen_k,
                        softmax_scale=layer.scaling,
                        causal=True,
                        return_softmax_lse=forward_batch.mha_return_lse,
                        out=_fa_out,
                        ver=self.fa_impl_ver,
                        **kwargs,
                    )
                if forward_batch.mha_return_lse:
                    output, lse, *rest = output
                    lse = torch.transpose(lse, 0, 1).contiguous()
                    return output, lse
                return output
            else:
                # FA4 absorbed MLA is shared by extend and decode: once qv is
                # threaded through the wrappers, decode's flash_attn_with_kvcache
                # call takes the same qv/ver arguments as this extend path.
                assert self.fa_impl_ver in (3, 4), "Only FA3/FA4 support here"
                # Do absorbed multi-latent attention
                kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(
                    q.dtype
                )
                k_rope = kv_cache[:, :, layer.v_head_dim :]
                c_kv = kv_cache[:, :, : layer.v_head_dim]
                k_rope_cache = paged_view(k_rope, self.page_size)
                c_kv_cache = paged_view(c_kv, self.page_size)
                if q_rope is not None:
                    q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
                    q_rope = q_rope.view(
                        -1, layer.tp_q_head_num, layer.head_dim - layer.v_head_dim
                    )
                else:
                    q_all = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
                    q_nope = q_all[:, :, : layer.v_head_dim]
                    q_rope = q_all[:, :, layer.v_head_dim :]

                if cp_active:
                    # MLA CP: q is rank-local zigzag-split; run the
                    # absorbed-MLA kernel twice (prev/next halves) against
                    # the full latent KV pool through the selected strategy.
                    # Concat q_nope + q_rope along dim=-1 so the wrapper's
                    # chunk(2, dim=0) keeps their alignment; split back
                    # inside the closure.
                    assert not use_cascade_attn, (
                        "Cascade attention under MLA CP is not supported."
                    )
                    q_fused = torch.cat([q_nope, q_rope], dim=-1)

                    def _mla_cp_attn(
                        q_chunk,
                        cu_seqlens_q_cp,
                        cache_seqlens_cp,
                        max_seqlen_q_cp,
                    ):
                        q_nope_chunk = q_chunk[..., : layer.v_head_dim]
                        q_rope_chunk = q_chunk[..., layer.v_head_dim :]
                        return flash_attn_with_kvcache(
                            q=q_rope_chunk,
                            qv=q_nope_chunk,
                            k_cache=k_rope_cache,
                            v_cache=c_kv_cache,
                            page_table=page_table,
                            cache_seqlens=cache_seqlens_cp,
                            cu_seqlens_q=cu_seqlens_q_cp,
                            cu_seqlens_k_new=(
                                cu_seqlens_k if not use_local_attn else None
                            ),
                            max_seqlen_q=max_seqlen_q_cp,
                            softmax_scale=layer.scaling,
                            causal=causal,
                            softcap=layer.logit_cap,
                            k_descale=fa_k_descale,
                            v_descale=fa_v_descale,
                            num_splits=self.num_splits,
                            ver=self.fa_impl_ver,
                        )

                    cp_strategy = get_cp_strategy()
                    assert cp_strategy is not None
                    o = cp_strategy.run_attention(
                        q_fused,
                        forward_batch,
                        self.device,
                        _mla_cp_attn,
                        attention_backend=CPAttentionBackendKind.FLASH_ATTENTION,
                    )
                else:
                    result = flash_attn_with_kvcache(
                        q=q_rope,
                        k_cache=k_rope_cache,
                        v_cache=c_kv_cache,
                        qv=q_nope,
                        page_table=page_table,
                        cache_seqlens=cache_seqlens,
                        cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k_new=cu_seqlens_k if not use_local_attn else None,
                        max_seqlen_q=max_seqlen_q,
                        softmax_scale=layer.scaling,
                        causal=False if use_cascade_attn else causal,
                        softcap=layer.logit_cap,
                        k_descale=fa_k_descale,
                        v_descale=fa_v_descale,
                        return_softmax_lse=use_cascade_attn,
                        num_splits=self.num_splits,
                        ver=self.fa_impl_ver,
                    )
                    if use_cascade_attn:
                        o, softmax_lse, *rest = result
                        o_expand, softmax_lse_expand, *rest_expand = (
                            flash_attn_with_kvcache(
                                q=q_rope,
                                k_cache=k_rope_cache,
                                v_cache=c_kv_cache,
                                qv=q_nope,
                                page_table=self.forward_metadata_spec_decode_expand.page_table,
                                cache_seqlens=self.forward_metadata_spec_decode_expand.cache_seqlens_int32,
                                cu_seqlens_q=self.forward_metadata_spec_decode_expand.cu_seqlens_q,
                                cu_seqlens_k_new=self.forward_metadata_spec_decode_expand.cu_seqlens_k,
                                max_seqlen_q=self.forward_metadata_spec_decode_expand.max_seq_len_q,
                                softmax_scale=layer.scaling,
                                causal=False,
                                window_size=window_size,
                                softcap=layer.logit_cap,
                                k_descale=fa_k_descale,
                                v_descale=fa_v_descale,
                                return_softmax_lse=True,
                                num_splits=self.num_splits,
                                ver=self.fa_impl_ver,
                            )
                        )
                        o, _ = merge_state_v2_wrapper(
                            o,
                            softmax_lse.T.contiguous(),
                            o_expand,
                            softmax_lse_expand.T.contiguous(),
                        )
                    else:
                        o = result

        o = o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
        if return_lse:
            if extend_lse is None:
                raise RuntimeError("This extend path does not return an LSE.")
            return o, extend_lse
        return o

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache=True,
        # For multi-head latent attention
        q_rope: Optional[torch.Tensor] = None,
        k_rope: Optional[torch.Tensor] = None,
        sinks: Optional[torch.Tensor] = None,
        q_descale: Optional[torch.Tensor] = None,
        k_descale: Optional[torch.Tensor] = None,
        v_descale: Optional[torch.Tensor] = None,
        score_mod=None,
        aux_tensors=None,
        rel_bias=None,
        rel_bias_event=None,
        return_lse: bool = False,
    ) -> torch.Tensor:
        if score_mod is not None and self.fa_impl_ver != 4:
            raise RuntimeError("score_mod is only supported by the FA4 backend.")
        if return_lse and self.use_mla:
            raise NotImplementedError("MLA decode does not return an LSE.")
        decode_lse = None
        if k is not None:
            assert v is not None
            if save_kv_cache:
                if not self.use_mla:
                    k_scale = k_descale if self.kv_cache_is_mxfp8 else layer.k_scale
                    v_scale = v_descale if self.kv_cache_is_mxfp8 else layer.v_scale
                    self.token_to_kv_pool.set_kv_buffer(
                        layer,
                        KVWriteLoc.for_layer(
                            forward_batch,
                            layer,
                            swa_loc=self.forward_metadata.swa_out_cache_loc,
                        ),
                        k,
                        v,
                        k_scale,
                        v_scale,
                    )
                else:
                    self.token_to_kv_pool.set_mla_kv_buffer(
                        layer,
                        KVWriteLoc.for_layer(forward_batch, layer),
                        k,
                        k_rope,
                    )

        # Use precomputed metadata across all layers
        metadata = self.forward_metadata
        local_attn_metadata = metadata.local_attn_metadata
        use_local_attn = (
            self.local_attn_builder is not None
            and self.local_attn_builder.applies(layer, metadata)
        )

        # When Spec Decode enabled, forward_decode would be called with two mode:
        # 1. DRAFT_DECODE: we enable cascade attention when top_k > 1
        # 2. IDLE: we don’t need cascade attention, spec_info will be none in this case
        use_cascade_attn = forward_batch.spec_info is not None and self.topk > 1

        # Calculate window size (can be moved to metadata if layer properties don't change)
        # we don't do layer.sliding_window_size - 1 since in model.get_attention_sliding_window_size() we already - 1
        # here is two side inclusive
        is_swa_layer = (
            layer.sliding_window_size is not None and layer.sliding_window_size > -1
        )
        if is_swa_layer and layer.attn_type == AttentionType.ENCODER_ONLY:
            window_size = (layer.sliding_window_size, layer.sliding_window_size)
        elif is_swa_layer:
            window_size = (layer.sliding_window_size, 0)
        else:
            window_size = (-1, -1)

        causal = True
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
            causal = False

        kwargs = {}
        if sinks is not None:
            kwargs["sinks"] = sinks
        if score_mod is not None:
            kwargs["score_mod"] = score_mod
            kwargs["aux_tensors"] = aux_tensors
        kwargs.update(self._mxfp8_sf_kwargs(layer, forward_batch, q_descale))
        if rel_bias is not None:
            if self.fa_impl_ver != 4:
                raise RuntimeError(
                    "rel_bias (sheared bias) is only supported by the FA4 backend."
                )
            if rel_bias_event is not None:
                # rel_bias (rel_logits) is produced on InklingAttention's alt stream;
                # join it here -- as late as possible, just before the kernel reads
                # it -- so rel_logits_proj overlaps the KV-write above.
                rel_bias_event.wait()
            kwargs["rel_bias"] = rel_bias
            if metadata is self.full_cg_prefill_metadata:
                # Full-CG reuses the cu_seqlens pointer with new values each replay.
                # Disable its pointer-keyed schedule cache so the graph refreshes it.
                kwargs["rel_bias_prep_cache"] = None
            else:
                if metadata.rel_bias_prep_cache is None:
                    metadata.rel_bias_prep_cache = {}
                kwargs["rel_bias_prep_cache"] = metadata.rel_bias_prep_cache

        _fa_out = (
            forward_batch._attn_output.view(-1, layer.tp_q_head_num, layer.v_head_dim)
            if getattr(forward_batch, "_attn_output", None) is not None
            else None
        )

        q, q_rope, k_rope, fa_k_descale, fa_v_descale = self.prepare_paged_mha_query(
            q,
            q_rope,
            k_rope,
            layer,
            logical_batch_size=forward_batch.batch_size,
            kv_head_num=layer.tp_k_head_num,
            is_prefill=False,
        )
        if fa_k_descale is not None:
            kwargs["k_descale"] = fa_k_descale
            kwargs["v_descale"] = fa_v_descale
        if not self.use_mla:
            # Do multi-head attention

            key_cache, value_cache = self.get_paged_mha_kv_cache(
                layer,
            )

            if layer.is_cross_attention:
                # Always use non-chunked logic for cross-attention
                if self._decode_uses_static_max_seqlen_k:
                    kwargs["max_seqlen_k"] = metadata.encoder_max_seq_len_k
                o = flash_attn_with_kvcache(
                    q=q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim),
                    k_cache=key_cache,
                    v_cache=value_cache,
                    page_table=metadata.encoder_page_table,
                    cache_seqlens=metadata.encoder_lens_int32,
                    cu_seqlens_q=metadata.cu_seqlens_q,
                    cu_seqlens_k_new=metadata.encoder_cu_seqlens_k,
                    max_seqlen_q=1,
                    softmax_scale=layer.scaling,
                    causal=False,
                    window_size=(-1, -1),
                    softcap=layer.logit_cap,
                    num_splits=self.num_splits,
                    ver=self.fa_impl_ver,
                    **kwargs,
                )
            elif use_local_attn:
                # Use chunked (local) attention batching for self-attention
                if self._decode_uses_static_max_seqlen_k:
                    kwargs["max_seqlen_k"] = local_attn_metadata.local_max_seq_len
                o = flash_attn_with_kvcache(
                    q=q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim),
                    k_cache=key_cache,
                    v_cache=value_cache,
                    page_table=local_attn_metadata.local_block_table,
                    cache_seqlens=local_attn_metadata.local_seqused_k,
                    cu_seqlens_q=local_attn_metadata.local_query_start_loc,
                    cu_seqlens_k_new=None,
                    max_seqlen_q=local_attn_metadata.local_max_query_len,
                    softmax_scale=layer.scaling,
                    causal=True,
                    window_size=(-1, -1),
                    softcap=layer.logit_cap,
                    num_splits=self.num_splits,
                    ver=self.fa_impl_ver,
                    **kwargs,
                )
            else:
                page_table = metadata.page_table
                if is_swa_layer and self.use_sliding_window_kv_pool:
                    if metadata.swa_page_table is not None:
                        page_table = metadata.swa_page_table
                    else:
                        page_table = (
                            self.token_to_kv_pool.translate_loc_from_full_to_swa(
                                metadata.page_table
                            ).to(torch.int32)
                        )
                cache_seqlens = metadata.cache_seqlens_int32
                max_seqlen_q = metadata.max_seq_len_q

                pa_swa_active = False
                if self.is_prefill_aware_swa and metadata.pa_swa_page_table is not None:
                    page_table = metadata.pa_swa_page_table
                    cache_seqlens = metadata.pa_swa_cache_seqlens
                    window_size = (-1, -1)
                    pa_swa_active = True

                q_reshaped = q.contiguous().view(
                    -1, layer.tp_q_head_num, layer.head_dim
                )

                # Default: single-token self-attention
                # Use precomputed scheduler_metadata when available and applicable.
                # scheduler_metadata is only valid for non-SWA, non-cascade decode.
                sched_meta = None
                if (
                    metadata.scheduler_metadata is not None
                    and not is_swa_layer
                    and not use_cascade_attn
                    and not pa_swa_active
                ):
                    sched_meta = metadata.scheduler_metadata
                if self._decode_uses_static_max_seqlen_k:
                    kwargs["max_seqlen_k"] = metadata.max_seq_len_k
                result = flash_attn_with_kvcache(
                    q=q_reshaped,
                    k_cache=key_cache,
                    v_cache=value_cache,
                    page_table=page_table,
                    cache_seqlens=cache_seqlens,
                    cu_seqlens_q=metadata.cu_seqlens_q,
                    max_seqlen_q=max_seqlen_q,
                    softmax_scale=layer.scaling,
                    causal=False if use_cascade_attn else causal,
                    window_size=window_size,
                    softcap=layer.logit_cap,
                    return_softmax_lse=use_cascade_attn or return_lse,
                    num_splits=(
                        self.decode_num_splits
                        if not is_swa_layer
                        and not use_cascade_attn
                        and not pa_swa_active
                        else self.num_splits
                    ),
                    out=_fa_out,
                    ver=self.fa_impl_ver,
                    scheduler_metadata=sched_meta,
                    **kwargs,
                )
                if return_lse and not use_cascade_attn:
                    o, softmax_lse, *_ = result
                    decode_lse = softmax_lse.T.contiguous()
                    result = o
                if use_cascade_attn:
                    o, softmax_lse, *rest = result
                    if self._decode_uses_static_max_seqlen_k:
                        kwargs["max_seqlen_k"] = (
                            self.forward_metadata_spec_decode_expand.max_seq_len_k
                        )
                    o_expand, softmax_lse_expand, *rest_expand = (
                        flash_attn_with_kvcache(
                            q=q_reshaped,
                            k_cache=key_cache,
                            v_cache=value_cache,
                            page_table=self.forward_metadata_spec_decode_expand.page_table,
                            cache_seqlens=self.forward_metadata_spec_decode_expand.cache_seqlens_int32,
                            cu_seqlens_q=self.forward_metadata_spec_decode_expand.cu_seqlens_q,
                            cu_seqlens_k_new=self.forward_metadata_spec_decode_expand.cu_seqlens_k,
                            max_seqlen_q=self.forward_metadata_spec_decode_expand.max_seq_len_q,
                            softmax_scale=layer.scaling,
                            causal=False,
                            window_size=window_size,
                            softcap=layer.logit_cap,
                            return_softmax_lse=True,
                            num_splits=self.num_splits,
                            ver=self.fa_impl_ver,
                            **kwargs,
                        )
                    )
                    o, _ = merge_state_v2(
                        o,
                        softmax_lse.T.contiguous(),
                        o_expand,
                        softmax_lse_expand.T.contiguous(),
                    )
                else:
                    o = result
        else:
            # Do absorbed multi-latent attention
            kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
            k_rope = kv_cache[:, :, layer.v_head_dim :]
            c_kv = kv_cache[:, :, : layer.v_head_dim]
            k_rope_cache = paged_view(k_rope, self.page_size)
            c_kv_cache = paged_view(c_kv, self.page_size)

            if q_rope is not None:
                q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
                q_rope = q_rope.view(
                    -1, layer.tp_q_head_num, layer.head_dim - layer.v_head_dim
                )
            else:
                q_all = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
                q_nope = q_all[:, :, : layer.v_head_dim]
                q_rope = q_all[:, :, layer.v_head_dim :]
            max_seqlen_q = metadata.max_seq_len_q
            result = flash_attn_with_kvcache(
                q=q_rope,
                k_cache=k_rope_cache,
                v_cache=c_kv_cache,
                qv=q_nope,
                page_table=metadata.page_table,
                cache_seqlens=metadata.cache_seqlens_int32,
                cu_seqlens_q=metadata.cu_seqlens_q,
                cu_seqlens_k_new=metadata.cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                softmax_scale=layer.scaling,
                causal=False if use_cascade_attn else causal,
                softcap=layer.logit_cap,
                k_descale=fa_k_descale,
                v_descale=fa_v_descale,
                return_softmax_lse=use_cascade_attn,  # softmax_lse is needed for merge states
                num_splits=self.num_splits,
                ver=self.fa_impl_ver,
            )
            if use_cascade_attn:
                o, softmax_lse, *rest = result
                o_expand, softmax_lse_expand, *rest_expand = flash_attn_with_kvcache(
                    q=q_rope,
                    k_cache=k_rope_cache,
                    v_cache=c_kv_cache,
                    qv=q_nope,
                    page_table=self.forward_metadata_spec_decode_expand.page_table,
                    cache_seqlens=self.forward_metadata_spec_decode_expand.cache_seqlens_int32,
                    cu_seqlens_q=self.forward_metadata_spec_decode_expand.cu_seqlens_q,
                    cu_seqlens_k_new=self.forward_metadata_spec_decode_expand.cu_seqlens_k,
                    max_seqlen_q=self.forward_metadata_spec_decode_expand.max_seq_len_q,
                    softmax_scale=layer.scaling,
                    causal=False,
                    window_size=window_size,
                    softcap=layer.logit_cap,
                    k_descale=fa_k_descale,
                    v_descale=fa_v_descale,
                    return_softmax_lse=True,
                    num_splits=self.num_splits,
                    ver=self.fa_impl_ver,
                )
                o, _ = merge_state_v2(
                    o,
                    softmax_lse.T.contiguous(),
                    o_expand,
                    softmax_lse_expand.T.contiguous(),
                )
            else:
                o = result

        o = o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
        if return_lse:
            if decode_lse is None:
                raise RuntimeError("This decode path does not return an LSE.")
            return o, decode_lse
        return o

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Initialize CUDA graph state for the attention backend.

        Args:
            max_bs (int): Maximum batch size to support in CUDA graphs

        This creates fixed-size tensors that will be reused during CUDA graph replay
        to avoid memory allocations.
        """
        max_num_pages = (self.max_context_len + self.page_size - 1) // self.page_size

        # This is being used by normal decode and draft decode when topk == 1
        self.decode_cuda_graph_metadata = {
            "cache_seqlens": torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            "cu_seqlens_q": torch.arange(
                0, max_bs + 1, dtype=torch.int32, device=self.device
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
            "strided_indices": torch.arange(
                0, self.max_context_len, self.page_size, device=self.device
            ),
        }
        # Pre-allocate scheduler_metadata buffer for CUDA graph
        # Size: 1 (semaphore) + round_up(max_bs, 4) * 4 (causal decode vectors)
        if self._get_scheduler_metadata is not None and not self.use_mla:
            b_rounded = ((max_bs + 3) // 4) * 4
            self._sched_meta_buf = torch.zeros(
                1 + b_rounded * 4, dtype=torch.int32, device=self.device
            )
        else:
            self._sched_meta_buf = None

        if self.local_attn_builder is not None:
            self.decode_cuda_graph_local_attn_metadata = (
                self.local_attn_builder.alloc_cuda_graph_buffers(max_bs)
            )

        if self.use_sliding_window_kv_pool:
            self.decode_cuda_graph_metadata["swa_page_table"] = torch.zeros(
                max_bs,
                max_num_pages,
                dtype=torch.int32,
                device=self.device,
            )
            # SWA write-target buffer; metadata binds a [:num_tokens] view,
            # refilled from the live out_cache_loc before each replay.
            self.cuda_graph_swa_out_cache_loc = torch.zeros(
                max_num_tokens,
                dtype=torch.int64,
                device=self.device,
            )

        # This is used by draft decode's first half of metadata when topk > 1
        if self.topk > 1:
            self.draft_decode_metadata_topk_normal = {
                "cache_seqlens": torch.zeros(
                    max_bs, dtype=torch.int32, device=self.device
                ),
                "cu_seqlens_q": torch.arange(
                    0,
                    max_bs * self.topk + 1,
                    step=self.topk,
                    dtype=torch.int32,
                    device=self.device,
                ),
                "cu_seqlens_k": torch.zeros(
                    max_bs + 1, dtype=torch.int32, device=self.device
                ),
                "page_table": torch.zeros(
                    max_bs,
                    self.max_context_len,
                    dtype=torch.int32,
                    device=self.device,
                ),
            }

            # This is used by draft decode's second half of metadata when topk > 1
            decode_length = self.speculative_step_id + 1
            self.draft_decode_metadata_topk_expand = {
                "cache_seqlens": torch.full(
                    (max_bs * self.topk,),
                    decode_length,
                    device=self.device,
                    dtype=torch.int32,
                ),
                "cu_seqlens_q": torch.arange(
                    0,
                    max_bs * self.topk + 1,
                    dtype=torch.int32,
                    device=self.device,
                ),
                "cu_seqlens_k": torch.arange(
                    0,
                    max_bs * self.topk * decode_length + 1,
                    step=decode_length,
                    dtype=torch.int32,
                    device=self.device,
                ),
                "page_table": torch.zeros(
                    max_bs * self.topk,
                    decode_length + 1,  # Additional page for last partial page
                    dtype=torch.int32,
                    device=self.device,
                ),
            }

        if (
            self.speculative_num_draft_tokens is not None
            and self.speculative_num_draft_tokens > 0
        ):
            # "page_table_draft_decode" will be set only when spec decoding enabled to save memory
            self.decode_cuda_graph_metadata["page_table_draft_decode"] = torch.zeros(
                max_bs,
                max_num_pages,
                dtype=torch.int32,
                device=self.device,
            )

            self.target_verify_metadata = {
                "cache_seqlens": torch.zeros(
                    max_bs, dtype=torch.int32, device=self.device
                ),
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
                "strided_indices": torch.arange(
                    0, self.max_context_len, self.page_size, device=self.device
                ),
            }

            # topk<=1 never extracts the mask; both metadata paths gate on topk > 1.
            self._verify_mask = maybe_create_verify_mask(
                is_draft_runner=self.is_draft_runner,
                skip_prefill=self.skip_prefill,
                max_bs=max_bs,
                max_context_len=self.max_context_len,
                num_draft_tokens=self.speculative_num_draft_tokens,
                device=self.device,
                is_read=self.topk > 1,
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
                "strided_indices": torch.arange(
                    0, self.max_context_len, self.page_size, device=self.device
                ),
            }

            if self.use_sliding_window_kv_pool:
                self.target_verify_metadata["swa_page_table"] = torch.zeros(
                    max_bs,
                    max_num_pages,
                    dtype=torch.int32,
                    device=self.device,
                )
                self.draft_extend_metadata["swa_page_table"] = torch.zeros(
                    max_bs,
                    max_num_pages,
                    dtype=torch.int32,
                    device=self.device,
                )

        if self.topk > 1:
            self.target_verify_metadata_topk_normal = {
                "cache_seqlens": torch.zeros(
                    max_bs, dtype=torch.int32, device=self.device
                ),
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
                    self.max_context_len,
                    dtype=torch.int32,
                    device=self.device,
                ),
            }

            self.target_verify_metadata_topk_expand = {
                "cache_seqlens": torch.zeros(
                    max_bs * self.speculative_num_draft_tokens,
                    dtype=torch.int32,
                    device=self.device,
                ),
                "cu_seqlens_k": torch.zeros(
                    max_bs * self.speculative_num_draft_tokens + 1,
                    dtype=torch.int32,
                    device=self.device,
                ),
                "cu_seqlens_q": torch.arange(
                    0,
                    max_bs * self.speculative_num_draft_tokens + 1,
                    dtype=torch.int32,
                    device=self.device,
                ),
                "page_table": torch.zeros(
                    max_bs * self.speculative_num_draft_tokens,
                    self.speculative_num_draft_tokens,
                    dtype=torch.int32,
                    device=self.device,
                ),
            }

            if self.has_swa:
                self.target_verify_metadata_topk_swa = {
                    "cache_seqlens": torch.zeros(
                        max_bs * self.speculative_num_draft_tokens,
                        dtype=torch.int32,
                        device=self.device,
                    ),
                    "cu_seqlens_k": torch.zeros(
                        max_bs * self.speculative_num_draft_tokens + 1,
                        dtype=torch.int32,
                        device=self.device,
                    ),
                    "cu_seqlens_q": torch.arange(
                        0,
                        max_bs * self.speculative_num_draft_tokens + 1,
                        dtype=torch.int32,
                        device=self.device,
                    ),
                    # Width covers the static max_seq_len_k bound + draft
                    # columns (checked by assert_buffer_fits at the merge).
                    "page_table": torch.zeros(
                        max_bs * self.speculative_num_draft_tokens,
                        self.max_context_len + self.speculative_num_draft_tokens,
                        dtype=torch.int32,
                        device=self.device,
                    ),
                }

        # Only allocate encoder metadata for encoder-decoder models
        if self.is_encoder_decoder:
            self.encoder_metadata = {
                "encoder_page_table": torch.zeros(
                    max_bs,
                    self.max_context_len,
                    dtype=torch.int32,
                    device=self.device,
                ),
                "encoder_lens_int32": torch.zeros(
                    max_bs, dtype=torch.int32, device=self.device
                ),
                "encoder_cu_seqlens_k": torch.zeros(
                    max_bs + 1, dtype=torch.int32, device=self.device
                ),
            }
        else:
            # For decoder-only models, skip encoder_metadata allocation
            self.encoder_metadata = {}

    def _bind_metadata_buffers(
        self,
        bs: int,
        num_tokens: int,
        encoder_lens: Optional[torch.Tensor],
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInput],
        device: torch.device,
    ) -> tuple:
        """Create FlashAttentionMetadata with pre-allocated buffer slice refs.

        Assigns all buffer slice references but does NOT fill data values.
        Stores the new metadata object(s) in the appropriate lookup dicts.
        Returns (metadata, metadata_expand).
        """
        metadata = FlashAttentionMetadata()
        metadata_expand = FlashAttentionMetadata()

        if forward_mode.is_decode_or_idle():
            if spec_info is not None:
                if self.topk <= 1:
                    # Draft Decode topk=1
                    metadata.cache_seqlens_int32 = self.decode_cuda_graph_metadata[
                        "cache_seqlens"
                    ][:bs]
                    metadata.cu_seqlens_q = self.decode_cuda_graph_metadata[
                        "cu_seqlens_q"
                    ][: bs + 1]
                    metadata.cu_seqlens_k = self.decode_cuda_graph_metadata[
                        "cu_seqlens_k"
                    ][: bs + 1]
                    metadata.page_table = self.decode_cuda_graph_metadata[
                        "page_table_draft_decode"
                    ][:bs, :]
                    if self.use_sliding_window_kv_pool:
                        metadata.swa_page_table = self.decode_cuda_graph_metadata[
                            "swa_page_table"
                        ][:bs, :]
                        metadata.swa_out_cache_loc = self.cuda_graph_swa_out_cache_loc[
                            :num_tokens
                        ]
                    self.decode_cuda_graph_metadata[bs] = metadata
                else:
                    # Draft Decode topk>1: two metadata objects
                    metadata.cache_seqlens_int32 = (
                        self.draft_decode_metadata_topk_normal["cache_seqlens"][:bs]
                    )
                    metadata.max_seq_len_q = self.topk
                    metadata.cu_seqlens_q = self.draft_decode_metadata_topk_normal[
                        "cu_seqlens_q"
                    ][: bs + 1]
                    metadata.cu_seqlens_k = self.draft_decode_metadata_topk_normal[
                        "cu_seqlens_k"
                    ][: bs + 1]
                    metadata.page_table = self.draft_decode_metadata_topk_normal[
                        "page_table"
                    ][:bs, :]

                    metadata_expand.cache_seqlens_int32 = (
                        self.draft_decode_metadata_topk_expand["cache_seqlens"][
                            : bs * self.topk
                        ]
                    )
                    metadata_expand.max_seq_len_q = 1
                    metadata_expand.cu_seqlens_q = (
                        self.draft_decode_metadata_topk_expand["cu_seqlens_q"][
                            : bs * self.topk + 1
                        ]
                    )
                    metadata_expand.cu_seqlens_k = (
                        self.draft_decode_metadata_topk_expand["cu_seqlens_k"][
                            : bs * self.topk + 1
                        ]
                    )
                    metadata_expand.page_table = self.draft_decode_metadata_topk_expand[
                        "page_table"
                    ][: bs * self.topk]
                    self.draft_decode_metadata_topk_normal[bs] = metadata
                    self.draft_decode_metadata_topk_expand[bs] = metadata_expand
            else:
                # Normal Decode
                metadata.cache_seqlens_int32 = self.decode_cuda_graph_metadata[
                    "cache_seqlens"
                ][:bs]
                metadata.cu_seqlens_q = self.decode_cuda_graph_metadata["cu_seqlens_q"][
                    : bs + 1
                ]
                metadata.cu_seqlens_k = self.decode_cuda_graph_metadata["cu_seqlens_k"][
                    : bs + 1
                ]
                metadata.page_table = self.decode_cuda_graph_metadata["page_table"][
                    :bs, :
                ]
                if self.is_prefill_aware_swa:
                    metadata.pa_swa_page_table = metadata.page_table
                    metadata.pa_swa_cache_seqlens = metadata.cache_seqlens_int32
                if self.use_sliding_window_kv_pool:
                    metadata.swa_page_table = self.decode_cuda_graph_metadata[
                        "swa_page_table"
                    ][:bs, :]
                    metadata.swa_out_cache_loc = self.cuda_graph_swa_out_cache_loc[
                        :num_tokens
                    ]
                self.decode_cuda_graph_metadata[bs] = metadata

        elif forward_mode.is_target_verify():
            if self.topk <= 1:
                metadata.cache_seqlens_int32 = self.target_verify_metadata[
                    "cache_seqlens"
                ][:bs]
                metadata.max_seq_len_q = self.speculative_num_draft_tokens
                metadata.cu_seqlens_q = self.target_verify_metadata["cu_seqlens_q"][
                    : bs + 1
                ]
                metadata.cu_seqlens_k = self.target_verify_metadata["cu_seqlens_k"][
                    : (bs + 1)
                ]
                metadata.page_table = self.target_verify_metadata["page_table"][:bs, :]
                if self.use_sliding_window_kv_pool:
                    metadata.swa_page_table = self.target_verify_metadata[
                        "swa_page_table"
                    ][:bs, :]
                    metadata.swa_out_cache_loc = self.cuda_graph_swa_out_cache_loc[
                        :num_tokens
                    ]
                self.target_verify_metadata[bs] = metadata
            else:
                # Target Verify topk>1: two (or three with SWA) metadata objects
                metadata.cache_seqlens_int32 = self.target_verify_metadata_topk_normal[
                    "cache_seqlens"
                ][:bs]
                metadata.max_seq_len_q = self.speculative_num_draft_tokens
                metadata.cu_seqlens_q = self.target_verify_metadata_topk_normal[
                    "cu_seqlens_q"
                ][: bs + 1]
                metadata.cu_seqlens_k = self.target_verify_metadata_topk_normal[
                    "cu_seqlens_k"
                ][: bs + 1]
                metadata.page_table = self.target_verify_metadata_topk_normal[
                    "page_table"
                ][:bs, :]

                metadata_expand.cache_seqlens_int32 = (
                    self.target_verify_metadata_topk_expand["cache_seqlens"][
                        : bs * self.speculative_num_draft_tokens
                    ]
                )
                metadata_expand.max_seq_len_q = 1
                metadata_expand.cu_seqlens_q = self.target_verify_metadata_topk_expand[
                    "cu_seqlens_q"
                ][: bs * self.speculative_num_draft_tokens + 1]
                metadata_expand.cu_seqlens_k = self.target_verify_metadata_topk_expand[
                    "cu_seqlens_k"
                ][: bs * self.speculative_num_draft_tokens + 1]
                metadata_expand.page_table = self.target_verify_metadata_topk_expand[
                    "page_table"
                ][: bs * self.speculative_num_draft_tokens]

                self.target_verify_metadata_topk_normal[bs] = metadata
                self.target_verify_metadata_topk_expand[bs] = metadata_expand
                # topk>1 target-verify early-returns before _apply; bind the
                # view here (buffer refilled at replay).
                if self.use_sliding_window_kv_pool:
                    metadata.swa_out_cache_loc = self.cuda_graph_swa_out_cache_loc[
                        :num_tokens
                    ]

                if self.has_swa:
                    metadata_swa = FlashAttentionMetadata()
                    metadata_swa.cache_seqlens_int32 = (
                        self.target_verify_metadata_topk_swa["cache_seqlens"][
                            : bs * self.speculative_num_draft_tokens
                        ]
                    )
                    metadata_swa.max_seq_len_q = 1
                    metadata_swa.cu_seqlens_q = self.target_verify_metadata_topk_swa[
                        "cu_seqlens_q"
                    ][: bs * self.speculative_num_draft_tokens + 1]
                    metadata_swa.cu_seqlens_k = self.target_verify_metadata_topk_swa[
                        "cu_seqlens_k"
                    ][: bs * self.speculative_num_draft_tokens + 1]
                    metadata_swa.page_table = self.target_verify_metadata_topk_swa[
                        "page_table"
                    ][: bs * self.speculative_num_draft_tokens]
                    self.target_verify_metadata_topk_swa[bs] = metadata_swa
                    metadata.swa_spec_metadata = metadata_swa

        elif forward_mode.is_draft_extend_v2():
            num_tokens_per_req = spec_info.num_tokens_per_req
            metadata.cache_seqlens_int32 = self.draft_extend_metadata["cache_seqlens"][
                :bs
            ]
            metadata.max_seq_len_q = num_tokens_per_req
            metadata.cu_seqlens_q = self.draft_extend_metadata["cu_seqlens_q"][: bs + 1]
            metadata.cu_seqlens_k = self.draft_extend_metadata["cu_seqlens_k"][
                : (bs + 1)
            ]
            metadata.page_table = self.draft_extend_metadata["page_table"][:bs, :]
            if self.use_sliding_window_kv_pool:
                metadata.swa_page_table = self.draft_extend_metadata["swa_page_table"][
                    :bs, :
                ]
                metadata.swa_out_cache_loc = self.cuda_graph_swa_out_cache_loc[
                    :num_tokens
                ]
            self.draft_extend_metadata[bs] = metadata

        if encoder_lens is not None:
            encoder_bs = encoder_lens.numel()
            metadata.encoder_lens_int32 = self.encoder_metadata["encoder_lens_int32"][
                :encoder_bs
            ]
            metadata.encoder_cu_seqlens_k = self.encoder_metadata[
                "encoder_cu_seqlens_k"
            ][: (encoder_bs + 1)]
            metadata.encoder_page_table = self.encoder_metadata["encoder_page_table"][
                :bs, :
            ]

        return metadata, metadata_expand

    @property
    def verify_mask(self) -> Optional[VerifyMask]:
        return self._verify_mask

    @staticmethod
    def _host_max_seq_len(
        seq_lens_cpu: Optional[torch.Tensor], seq_lens: torch.Tensor
    ) -> int:
        """Host-side max KV length: the CPU mirror when published, else a local
        D2H. Only for paths that accept a host sync (currently prefill-aware
        SWA decode replay)."""
        src = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.cpu()
        return src.max().item()

    def _set_decode_page_metadata(
        self,
        plan: KVLocPlan,
        metadata,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_len_delta: int,
    ) -> None:
        """Fill `cache_seqlens_int32`, `cu_seqlens_k` and the page table(s).

        Under the unified pool the page tables are the plan's, copied in, so
        the fused kernel is left with the prefix sum alone.
        """
        translated = self.kv_index_translator.reads_are_translated
        normal_decode_set_metadata(
            metadata.cache_seqlens_int32,
            metadata.cu_seqlens_k,
            metadata.page_table,
            self.req_to_token,
            req_pool_indices,
            self.max_num_pages,
            seq_lens,
            seq_len_delta,
            self.page_size,
            metadata.swa_page_table,
            full_to_swa_index_mapping=(
                self.token_to_kv_pool.full_to_swa_index_mapping
                if self.use_sliding_window_kv_pool
                else None
            ),
            skip_page_table=translated,
        )
        if translated:
            # The plan's table reaches `cache_seqlens_int32`, which the kernels
            # bound their reads by: a draft decode reads past `seq_lens`.
            bs = int(req_pool_indices.numel())
            self.kv_index_translator.copy_page_table(plan, out=metadata.page_table[:bs])
            if metadata.swa_page_table is not None:
                self.kv_index_translator.copy_page_table(
                    plan,
                    out=metadata.swa_page_table[:bs],
                    kind=IdSpaceKind.SLIDING_WINDOW,
                )

    def _apply_cuda_graph_metadata(
        self,
        plan: KVLocPlan,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        encoder_lens: Optional[torch.Tensor],
        forward_mode: ForwardMode,
        spec_info: Optional[SpecInput],
        seq_lens_cpu: Optional[torch.Tensor],
        out_cache_loc: Optional[torch.Tensor] = None,
    ):
        """Shared capture+replay body for the cuda-graph init path.

        Public entry: :py:meth:`init_forward_metadata_out_graph`. This helper
        formerly lived as the legacy init_forward_metadata_replay_cuda_graph;
        the capture path used to wrap it. Both legacy method overrides
        are gone.
        """
        seq_lens = seq_lens[:bs]
        # The sync-free path passes seq_lens_cpu=None; branches that still need a
        # host max fall back to the static max_context_len, so no D2H is forced here.
        seq_lens_cpu = seq_lens_cpu[:bs] if seq_lens_cpu is not None else None
        req_pool_indices = req_pool_indices[:bs]
        device = seq_lens.device
        metadata = None
        metadata_expand = None

        if forward_mode.is_decode_or_idle():
            if spec_info is not None:
                # Draft Decode
                if self.topk <= 1:
                    # When topk = 1, we use the normal decode metadata
                    metadata = self.decode_cuda_graph_metadata[bs]
                    # Page table built on-device (self-guards on cache_seqlens);
                    # max_seq_len_k left unset -- unread here (scheduler_metadata
                    # is normal-decode-only).
                    self._set_decode_page_metadata(
                        plan,
                        metadata,
                        req_pool_indices,
                        seq_lens,
                        self._spec_read_seq_len_delta(forward_mode, spec_info),
                    )

                else:
                    # When top k > 1, we need two specific draft decode metadata, and then merge states
                    # 1. The first half of metadata for prefix tokens
                    metadata = self.draft_decode_metadata_topk_normal[bs]
                    if self.page_size > 1:
                        # First attention handles seq_lens - last_page_lens if page size > 1.
                        last_page_lens = seq_lens % self.page_size
                        seq_lens = seq_lens - last_page_lens
                    metadata.cache_seqlens_int32.copy_(seq_lens)
                    # metadata.max_seq_len_q = self.topk, already set in capture
                    # metadata.cu_seqlens_q already set in capture
                    # metadata.cu_seqlens_k is not needed

                    # Tight page-table bound when the CPU mirror is free.
                    metadata.max_seq_len_k = (
                        seq_lens_cpu.max().item()
                        if seq_lens_cpu is not None
                        else self.max_context_len
                    )
                    max_seq_pages = (
                        metadata.max_seq_len_k + self.page_size - 1
                    ) // self.page_size
                    strided_indices = self.decode_cuda_graph_metadata["strided_indices"]
                    strided_indices = strided_indices[:max_seq_pages]
                    page_table = (
                        self.req_to_token[
                            req_pool_indices[:, None],  # shape [bs, 1]
                            strided_indices[None, :],  # shape [1, max_seq_pages]
                        ]
                        // self.page_size
                    )
                    metadata.page_table[:, :max_seq_pages].copy_(page_table)
                    # 2. The second half of metadata for draft tokens (per_batch_num_tokens = topk)
                    metadata_expand = self.draft_decode_metadata_topk_expand[bs]
                    decode_length = self.speculative_step_id + 1
                    # shape: [bs, num_steps, topk] -> [bs x topk, num_steps]
                    cache_loc = out_cache_loc.view(-1, self.speculative_num_steps)
                    if self.page_size > 1:
                        # Only the draft tokens produced up to this step are live;
                        # cache_loc arrives num_steps-wide. Slice so the scatter fills at
                        # most decode_length of the (decode_length + 1) expand page_table
                        # columns -- without this the extra distinct pages overflow the row.
                        cache_loc = cache_loc[:, :decode_length]
                        assert_buffer_fits(
                            cache_loc.shape[1],
                            metadata_expand.page_table.shape[1],
                            "draft expand page_table (width decode_length + 1)",
                        )
                        draft_decode_set_expand_metadata(
                            cache_seqlens_int32=metadata_expand.cache_seqlens_int32,
                            page_table=metadata_expand.page_table,
                            last_page_lens=last_page_lens,
                            decode_length=decode_length,
                            cache_loc=cache_loc,
                            topk=self.topk,
                            page_size=self.page_size,
                        )
                    else:
                        num_seqs = cache_loc.shape[0]
                        metadata_expand.page_table[:num_seqs, :decode_length].copy_(
                            cache_loc[:, :decode_length]
                        )
                # TODO: Handle local attention metadata for draft decode when llama4 eagle is supported
            else:
                # Normal Decode
                metadata = self.decode_cuda_graph_metadata[bs]
                if self.is_prefill_aware_swa:
                    # Prefill-aware SWA still needs a host max to bound the
                    # per-batch page table built below.
                    max_len = self._host_max_seq_len(seq_lens_cpu, seq_lens)
                    metadata.max_seq_len_k = max_len
                    pa_max_len = min(
                        self._pa_swa_max_prefill_len + self.sliding_window_size,
                        max_len,
                    )
                    if pa_max_len > 0:
                        _build_pa_page_table(
                            self.req_to_token,
                            req_pool_indices,
                            seq_lens,
                            self._pa_swa_prefill_lens,
                            self.sliding_window_size,
                            bs,
                            pa_max_len,
                            device,
                            dst_page_table=metadata.page_table,
                            dst_kv_lens=metadata.cache_seqlens_int32,
                        )
                else:
                    # Page table uses the static max_num_pages bound (no D2H).
                    # max_seq_len_k only feeds scheduler_metadata below, so use
                    # the free CPU mirror for a tight split heuristic when present.
                    metadata.max_seq_len_k = (
                        seq_lens_cpu.max().item()
                        if seq_lens_cpu is not None
                        else self.max_context_len
                    )
                    self._set_decode_page_metadata(
                        plan,
                        metadata,
                        req_pool_indices,
                        seq_lens,
                        self._spec_read_seq_len_delta(forward_mode, spec_info),
                    )

                if self.local_attn_builder is not None:
                    self.local_attn_builder.update_for_replay(
                        metadata,
                        bs,
                        buffers=self.decode_cuda_graph_local_attn_metadata,
                    )

                # Recompute scheduler_metadata into pre-allocated buffer
                if (
                    self._sched_meta_buf is not None
                    and metadata.scheduler_metadata is not None
                ):
                    sched = self._compute_scheduler_metadata(
                        bs,
                        metadata.max_seq_len_k,
                        metadata.cache_seqlens_int32,
                        metadata.cu_seqlens_q,
                    )
                    if sched is not None:
                        n = sched.shape[0]
                        self._sched_meta_buf[:n] = sched
                        self._sched_meta_buf[n:] = 0

        elif forward_mode.is_target_verify():
            if self.topk <= 1:
                metadata = self.target_verify_metadata[bs]
                ragged_layout = getattr(spec_info, "ragged_verify_layout", None)
                if ragged_layout is not None:
                    padded = ragged_layout.padded_to_bucket(padded_bs=bs)
                    geometry = build_ragged_target_verify_geometry(
                        seq_lens=seq_lens, layout=padded
                    )
                    metadata.cu_seqlens_q.copy_(geometry.cu_seqlens_q)
                    # Per-row verify lens; the builder re-derives
                    # cache_seqlens from them at delta 0.
                    verify_lens = geometry.cache_seqlens_int32
                    verify_delta = 0
                else:
                    verify_lens = seq_lens
                    verify_delta = self.speculative_num_draft_tokens

                # Page table built on-device (self-guards on cache_seqlens);
                # max_seq_len_k left unset -- unread here (scheduler_metadata is
                # normal-decode-only).
                self._set_decode_page_metadata(
                    plan, metadata, req_pool_indices, verify_lens, verify_delta
                )
            else:
                # When topk > 1, we need two specific target verify metadata, and then merge states
                # 1. The first half of metadata for prefix tokens
                metadata = self.target_verify_metadata_topk_normal[bs]
                metadata.cache_seqlens_int32.copy_(seq_lens)
                # metadata.max_seq_len_q = self.speculative_num_draft_tokens, already set in capture
                # Page table built on-device (self-guards on cache_seqlens).
                # max_seq_len_k stays the static bound; its only replay reader
                # is the SWA-merge capacity assert, capture-sized to match.
                metadata.max_seq_len_k = self.max_context_len
                # metadata.cu_seqlens_q already set in capture
                metadata.cu_seqlens_k[1:].copy_(
                    torch.cumsum(metadata.cache_seqlens_int32, dim=0, dtype=torch.int32)
                )
                build_trtllm_mha_page_table(
                    req_to_token=self.req_to_token,
                    req_pool_indices=req_pool_indices,
                    cache_seqlens=metadata.cache_seqlens_int32,
                    page_table=metadata.page_table,
                    page_size=self.page_size,
                )

                # 2. The second half of metadata for draft tokens (per_batch_num_tokens = topk)
                metadata_expand = self.target_verify_metadata_topk_expand[bs]

                # metadata_expand.max_seq_len_q = 1, already set in capture
                # metadata_expand.cu_seqlens_q already set in capture
                offsets = torch.arange(
                    self.speculative_num_draft_tokens, device=device
                ).unsqueeze(0)  # shape: (1, self.speculative_num_draft_tokens)

                cols = offsets.expand(seq_lens.numel(), -1) + seq_lens.unsqueeze(1)
                cum_len = torch.nn.functional.pad(
                    torch.cumsum(
                        (
                            seq_lens + self.speculative_num_draft_tokens
                        ).repeat_interleave(self.speculative_num_draft_tokens),
                        dim=0,
                    ),
                    (1, 0),
                )[:-1]
                mask_extraction_indices = (
                    cols.repeat_interleave(self.speculative_num_draft_tokens, dim=0)
                    + cum_len[:, None]
                ).view(1, -1)
                # avoid extracting padded seq indices which will be out of boundary
                mask_extraction_indices[
                    :,
                    spec_info.positions.numel() * self.speculative_num_draft_tokens :,
                ].fill_(0)
                mask = spec_info.custom_mask[mask_extraction_indices].view(
                    -1, self.speculative_num_draft_tokens
                )  # (bsz * draft_num, draft_num)

                col_indices = offsets.expand(
                    mask.shape[0], self.speculative_num_draft_tokens
                )
                keys = torch.where(
                    mask,
                    col_indices,
                    col_indices + self.speculative_num_draft_tokens,
                )
                _, sort_order = torch.sort(keys, dim=1)

                non_masked_page_table = (
                    self.req_to_token[req_pool_indices, :]
                    .gather(1, cols)
                    .repeat_interleave(self.speculative_num_draft_tokens, dim=0)
                )  # (bsz, draft_num)

                metadata_expand.page_table.copy_(
                    non_masked_page_table.gather(1, sort_order)
                )
                metadata_expand.cache_seqlens_int32.copy_(mask.sum(dim=1))
                metadata_expand.cu_seqlens_k[1:].copy_(
                    torch.cumsum(
                        metadata_expand.cache_seqlens_int32,
                        dim=0,
                        dtype=torch.int32,
                    )
                )
                if self.has_swa:
                    metadata_swa = self.target_verify_metadata_topk_swa[bs]
                    self._init_sliding_window_attn_spec_metadata(
                        metadata, metadata_expand, metadata_swa
                    )

        elif forward_mode.is_draft_extend_v2():
            metadata = self.draft_extend_metadata[bs]
            metadata.cache_seqlens_int32.copy_(seq_lens)

            # Tight page-table bound when the CPU mirror is free.
            metadata.max_seq_len_k = (
                seq_lens_cpu.max().item()
                if seq_lens_cpu is not None
                else self.max_context_len
            )
            metadata.cu_seqlens_k[1:].copy_(
                torch.cumsum(metadata.cache_seqlens_int32, dim=0, dtype=torch.int32)
            )

            extend_seq_lens_tensor = getattr(spec_info, "extend_seq_lens_tensor", None)
            extend_seq_lens_cpu = getattr(spec_info, "extend_seq_lens_cpu", None)
            if extend_seq_lens_tensor is not None:
                extend_seq_lens = extend_seq_lens_tensor.to(torch.int32)
            elif extend_seq_lens_cpu is not None:
                extend_seq_lens = torch.as_tensor(
                    extend_seq_lens_cpu,
                    dtype=torch.int32,
                    device=device,
                )
            else:
                default_extend = spec_info.num_tokens_per_req
                extend_seq_lens = torch.full(
                    (bs,), default_extend, dtype=torch.int32, device=device
                )
                extend_seq_lens_cpu = [default_extend] * bs

            if extend_seq_lens_cpu:
                metadata.max_seq_len_q = int(max(extend_seq_lens_cpu))
            else:
                metadata.max_seq_len_q = spec_info.num_tokens_per_req

            metadata.cu_seqlens_q[1:].copy_(
                torch.cumsum(extend_seq_lens, dim=0, dtype=torch.int32)
            )

            max_seq_pages = (
                metadata.max_seq_len_k + self.page_size - 1
            ) // self.page_size
            if self.kv_index_translator.reads_are_translated:
                rows = int(req_pool_indices.numel())
                self.kv_index_translator.copy_page_table(
                    plan, out=metadata.page_table[:rows]
                )
                if (
                    self.use_sliding_window_kv_pool
                    and metadata.swa_page_table is not None
                ):
                    self.kv_index_translator.copy_page_table(
                        plan,
                        out=metadata.swa_page_table[:rows],
                        kind=IdSpaceKind.SLIDING_WINDOW,
                    )
            else:
                page_indices = self.req_to_token[
                    req_pool_indices[:, None],
                    self.draft_extend_metadata["strided_indices"][:max_seq_pages],
                ]
                if (
                    self.use_sliding_window_kv_pool
                    and metadata.swa_page_table is not None
                ):
                    swa_page_indices = (
                        self.token_to_kv_pool.translate_loc_from_full_to_swa(
                            page_indices
                        )
                    )
                    metadata.swa_page_table[:, :max_seq_pages].copy_(
                        swa_page_indices // self.page_size
                    )
                metadata.page_table[:, :max_seq_pages].copy_(
                    page_indices // self.page_size
                )

        else:
            raise ValueError(
                f"FA3 `_apply_cuda_graph_metadata` only supports the modes the "
                f"full cuda-graph runner captures (decode / idle / target_verify "
                f"/ draft_extend / draft_extend_v2). Got {forward_mode=}. "
                f"Piecewise / breakable capture must route through "
                f"`init_forward_metadata(fb)` (the eager entry) instead of "
                f"`init_forward_metadata_out_graph(fb, in_capture=True)`."
            )

        if encoder_lens is not None:
            # Per-request varlen encoder support (e.g. MossVL different images).
            metadata.encoder_max_seq_len_k = int(encoder_lens.max().item())
            metadata.encoder_lens_int32[:bs].copy_(encoder_lens[:bs].to(torch.int32))
            metadata.encoder_cu_seqlens_k[1 : bs + 1].copy_(
                torch.cumsum(metadata.encoder_lens_int32[:bs], dim=0, dtype=torch.int32)
            )

            metadata.encoder_page_table[:bs, : metadata.encoder_max_seq_len_k].copy_(
                self.req_to_token[req_pool_indices, : metadata.encoder_max_seq_len_k]
            )

            # Self-attn (text) page_table: per-request offset = encoder_lens[i].
            text_max = metadata.max_seq_len_k
            arange_text = torch.arange(text_max, device=req_pool_indices.device)
            text_col = encoder_lens[:bs].long().unsqueeze(1) + arange_text.unsqueeze(0)
            text_row = req_pool_indices.unsqueeze(1).expand(-1, text_max)
            metadata.page_table[:bs, :text_max].copy_(
                self.req_to_token[text_row, text_col]
            )

        self.forward_metadata = metadata
        self.forward_metadata_spec_decode_expand = metadata_expand

    def get_cuda_graph_seq_len_fill_value(self):
        """Get the fill value for sequence length in CUDA graph."""
        return 1

    def _maybe_init_local_attn_metadata(
        self, metadata: FlashAttentionMetadata, device
    ) -> None:
        if self.local_attn_builder is None:
            metadata.local_attn_metadata = None
            return
        metadata.local_attn_metadata = self.local_attn_builder.build(
            cu_seqlens_q=metadata.cu_seqlens_q,
            cache_seqlens_int32=metadata.cache_seqlens_int32,
            page_table=metadata.page_table,
            device=device,
        )

    def _init_sliding_window_attn_spec_metadata(
        self,
        metadata: FlashAttentionMetadata,
        metadata_expand: FlashAttentionMetadata,
        metadata_swa: Optional[FlashAttentionMetadata] = None,
    ):
        # TODO: support page_size > 1 for swa spec
        assert self.page_size == 1, (
            "FlashAttention backend doesn't support topk > 1 speculative decoding with page size > 1 sliding window attention"
        )

        cache_seqlens_int32 = (
            metadata.cache_seqlens_int32.repeat_interleave(
                self.speculative_num_draft_tokens
            )
            + metadata_expand.cache_seqlens_int32
        )
        cu_seqlens_k = torch.nn.functional.pad(
            torch.cumsum(cache_seqlens_int32, dim=0, dtype=torch.int32), (1, 0)
        )
        bs = cache_seqlens_int32.shape[0]
        page_table = (
            metadata.page_table.new_zeros(
                (bs, metadata.max_seq_len_k + metadata_expand.page_table.shape[1])
            )
            if metadata_swa is None
            else metadata_swa.page_table
        )
        assert_buffer_fits(
            metadata.max_seq_len_k + metadata_expand.page_table.shape[1],
            page_table.shape[1],
            "FA3 swa-spec page_table",
        )

        page_table_a = metadata.page_table
        page_table_b = metadata_expand.page_table
        if self.use_sliding_window_kv_pool:
            page_table_a = self.token_to_kv_pool.translate_loc_from_full_to_swa(
                page_table_a
            ).to(torch.int32)
            page_table_b = self.token_to_kv_pool.translate_loc_from_full_to_swa(
                page_table_b
            ).to(torch.int32)

        prepare_swa_spec_page_table_triton(
            page_table,
            page_table_a,
            page_table_b,
            metadata.cache_seqlens_int32,
            metadata_expand.cache_seqlens_int32,
            self.speculative_num_draft_tokens,
        )

        if metadata_swa is None:
            metadata_swa = FlashAttentionMetadata()
            metadata_swa.max_seq_len_q = 1
            metadata_swa.cu_seqlens_q = metadata_expand.cu_seqlens_q
            metadata_swa.cache_seqlens_int32 = cache_seqlens_int32
            metadata_swa.cu_seqlens_k = cu_seqlens_k
            metadata_swa.page_table = page_table
        else:
            metadata_swa.cache_seqlens_int32.copy_(cache_seqlens_int32)
            metadata_swa.cu_seqlens_k.copy_(cu_seqlens_k)

        metadata.swa_spec_metadata = metadata_swa


class FlashAttentionMultiStepBackend:
    # Read by decide_needs_cpu_seq_lens (a missing flag defaults to True);
    # the multi-step draft and draft-extend paths are device-side.
    needs_cpu_seq_lens: bool = False

    def __init__(
        self,
        model_runner: ModelRunner,
        topk: int,
        speculative_num_steps: int,
        fa_impl_ver: int = 3,
    ):
        self.model_runner = model_runner
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.kv_index_translator = model_runner.kv_index_translator
        self.attn_backends = []
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends.append(
                FlashAttentionBackend(
                    model_runner,
                    speculative_step_id=i,
                    topk=self.topk,
                    speculative_num_steps=self.speculative_num_steps,
                    fa_impl_ver=fa_impl_ver,
                )
            )
        self.attn_backend_list = self.attn_backends
        self.forward_metadata = None

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

        inner_fb = build_inner_fb_view(
            forward_batch,
            bs=forward_batch.batch_size,
            forward_mode=ForwardMode.DECODE,
            encoder_lens=forward_batch.encoder_lens,
        )
        for i in range(self.speculative_num_steps - 1):
            # TODO: incrementally update the metadata for the later steps,
            # so that they do not need to recompute everything from scratch.
            self.attn_backends[i].init_forward_metadata_out_graph(
                inner_fb, in_capture=in_capture
            )

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata_in_graph(forward_batch)


@torch.compile(dynamic=True, backend=get_compiler_backend())
def draft_decode_set_expand_metadata(
    cache_seqlens_int32: torch.Tensor,  # Modifies
    page_table: torch.Tensor,  # Modifies
    last_page_lens: torch.Tensor,
    decode_length: int,
    cache_loc: torch.Tensor,
    topk: int,
    page_size: int,
):
    expanded_last_page_lens = last_page_lens.repeat_interleave(topk)
    cache_seqlens_int32.copy_(decode_length + expanded_last_page_lens)
    cache_loc = (cache_loc // page_size).to(torch.int32)
    if cache_loc.dim() == 1:
        cache_loc = cache_loc.unsqueeze(0)
    # cache_loc is pre-sliced to decode_length by the caller, so the scatter fills at
    # most decode_length of the (decode_length + 1) page_table columns.
    # Vectorized torch.unique_consecutive: track value change points then scatter
    mask = torch.ones_like(cache_loc, dtype=torch.bool)
    mask[:, 1:] = cache_loc[:, 1:] != cache_loc[:, :-1]
    positions = mask.cumsum(dim=1) - 1
    num_seqs = cache_loc.shape[0]
    page_table[:num_seqs, :].scatter_(1, positions, cache_loc)


# Copied from:
# https://github.com/houseroad/vllm/blob/4e45bfcaf928bdb9bd952b4ac922a3c205589ae8/vllm/v1/attention/backends/flash_attn.py
#
# Take in `query_start_loc_np` and `seq_lens_np` and break the sequences into
# local attention blocks, where each block is passed to the attention kernel
# as an independent local ("virtual") batch item.
#
# For example, if are performing a chunked prefill a batch of 3 sequences:
#   q_seqlens  = [4, 10, 5]
#   kv_seqlens = [6, 17, 9]
# Then normally for regular attention we would compute with an attention mask
#  for batch idx 0 (q_seqlens = 4, kv_seqlens = 6) like:
#   batch idx: 0 (q_seqlens = 4, kv_seqlens = 6)
#        k_toks >   0 1 2 3 4 5
#        q_toks v  _____________
#               0 | 1 1 1
#               1 | 1 1 1 1
#               2 | 1 1 1 1 1
#               3 | 1 1 1 1 1 1
#
# for local attention (with attn_chunk_size = 4) we would compute with an
#  attention mask like:
#   batch idx: 0  (q_seqlens = 4, kv_seqlens = 6, attn_chunk_size = 4)
#        k_toks >   0 1 2 3 4 5
#        q_toks v  _____________
#               0 | 1 1 1
#               1 | 1 1 1 1
#               2 |         1
#               3 |         1 1
#
# We can simulate this mask using standard flash-attention by breaking the
#  sequences into local ("virtual") batches, where each local batch item is a
#  local attention block, so in this case batch idx 0 would be broken up into:
#
#   local-batch idx: 0 (q_seqlens = 2, kv_seqlens = 4)  (batch 0)
#        k_toks >   0 1 2 3
#        q_toks v  _____________
#               0 | 1 1 1
#               1 | 1 1 1 1
#   local-batch idx: 1 (q_seqlens = 2, kv_seqlens = 2) (batch 0)
#        k_toks >   4 5
#        q_toks v  _____________
#               2 | 1
#               3 | 1 1
#
# e.g. if we have:
#   attn_chunk_size = 4
#   query_start_loc_np = [0, 4, 14, 19] (q_seqlens = [4, 10, 5])
# Then this function would return:
#                           __b0__  ______b1______  __b2__ < orig batch indices
#   q_seqlens_local    = [   2,  2,  1,  4,  4,  1,  4,  1]
#   cu_seqlens_q_local = [0, 4,  6, 10, 14, 18, 19, 23, 24]
#   seqlens_k_local    = [   4,  2,  4,  4,  4,  1,  4,  1]
#   block_table_local  : shape[local_virtual_batches, pages_per_local_batch]
# TODO(hebiao064): remove this once we have a better way to handle the merge_state_v2 torch.compile issue
@torch._dynamo.disable()
def merge_state_v2_wrapper(o, s_a, o_exp, s_b):
    return merge_state_v2(o, s_a, o_exp, s_b)
