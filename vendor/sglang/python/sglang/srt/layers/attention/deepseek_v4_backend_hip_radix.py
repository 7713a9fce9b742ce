from __future__ import annotations

import enum
import functools
import logging
import os
from dataclasses import dataclass, field, fields
from typing import (
    TYPE_CHECKING,
    ClassVar,
    Dict,
    List,
    Literal,
    Optional,
    Tuple,
    TypeVar,
    Union,
)

import torch
import torch.nn.functional as F

from sglang.kernels.ops.attention.dsv4.attn_glue_hip import (
    expand_index_page_table,
    low_ratio_compression_metadata,
    mask_indices_by_length,
    page_table_from_req_to_token,
    sparse_buffers,
    widen_pair_i64,
)
from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import (
    BuildCausalSwaPageIndices,
    late_layer_tail_layout,
)
from sglang.kernels.ops.attention.dsv4.decode_attention_sm100 import (
    HEAD_DIM as SWAPAB_HEAD_DIM,
)
from sglang.kernels.ops.attention.dsv4.decode_attention_sm100 import (
    MAX_BATCH as SWAPAB_MAX_BATCH,
)
from sglang.kernels.ops.attention.dsv4.decode_attention_sm100 import (
    NUM_HEADS as SWAPAB_NUM_HEADS,
)
from sglang.kernels.ops.attention.dsv4.decode_attention_sm100 import (
    SOFTMAX_SCALE as SWAPAB_SOFTMAX_SCALE,
)
from sglang.kernels.ops.attention.dsv4.dequant_k_cache import (
    dequantize_k_cache_paged_dsv4,
)
from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
from sglang.kernels.ops.attention.dsv4.metadata_kernel import (
    init_compression_metadata as _init_compression_metadata_triton,
)
from sglang.kernels.ops.attention.dsv4.opus_sparse_prefill_hip import (
    Csr,
    combined_to_csr,
    opus_sparse_prefill,
)
from sglang.kernels.ops.attention.dsv4.swapab_gluon_hip import swapab_attention
from sglang.kernels.plugin_kernels.amd.spec import StepMetadata
from sglang.srt.environ import envs
from sglang.srt.kernel_plugins.amd.binding import is_metadata_unread
from sglang.srt.layers.attention import deepseek_v4_backend as _cuda_backend
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.deepseek_v4_backend import (
    DeepseekV4AttnBackend,
    LateLayerTail,
    _as_int_list,
    _tail_rows,
    late_layer_num_tokens,
    late_layer_whole_extend,
)
from sglang.srt.layers.attention.dsv4.compressor_v2 import (
    CompressorBackendMixin,
    FusedCompressMetadata,
    create_paged_compressor_data,
)
from sglang.srt.layers.attention.dsv4.dsv41_sparse import token_req_indices
from sglang.srt.layers.attention.dsv4.indexer import C4IndexerBackendMixin
from sglang.srt.layers.attention.dsv4.low_ratio_backend_hip import (
    build_low_ratio_decode_workspaces,
    low_ratio_candidate_span,
    low_ratio_decode_rows_are_identity,
    low_ratio_identity_skip_enabled,
    low_ratio_index_topk_hip_decode,
    low_ratio_index_topk_hip_extend,
    refresh_low_ratio_prefill_workspaces,
)
from sglang.srt.layers.attention.dsv4.metadata import (
    PagedIndexerMetadata,
    copy_metadata,
    maybe_copy_inplace,
)
from sglang.srt.layers.attention.dsv4.sparse_prefill_utils import (
    SparsePrefillChunkCache,
    SparsePrefillKVBuffer,
)
from sglang.srt.layers.attention.hip_flash_mla import (
    _apply_inverse_rope,
    flash_mla_with_kvcache_entrypoint,
    hip_attn_kv_splits,
    resolve_hip_flashmla_backend,
)
from sglang.srt.layers.attention.verify_mask import VerifyMask, maybe_create_verify_mask
from sglang.srt.layers.cp.utils import is_cp_active
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.mem_cache.dsv41_request_window import window_layout
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.runtime_context import (
    get_exec,
    get_parallel,
    get_spec,
)
from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc
from sglang.srt.speculative.ragged_verify import resolve_ragged_verify_layout
from sglang.srt.utils import ceil_align, is_gfx95_supported

if TYPE_CHECKING:
    from sglang.kernels.ops.attention.dsv4.fp4_indexer_hip import (
        FP4DecodeWorkspace,
        FP4KWriteMetadata,
        FP4PrefillWorkspace,
        FP4RowgroupDecodeWorkspace,
        FP4RowgroupPrefillWorkspace,
    )
    from sglang.kernels.ops.attention.flash_mla_interface import FlashMLASchedMeta
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DSPARK_DRAFT_RAW_METADATA = envs.SGLANG_HIP_DSPARK_DRAFT_RAW_METADATA.get()

SWA_WINDOW = 128
DEFAULT_INDEX_TOPK = 512
PAGE_INDEX_ALIGNED_SIZE = 64


T = TypeVar("T", bound=Optional[torch.Tensor])


def _pad_last_dim(x: T, multiples_of: int = PAGE_INDEX_ALIGNED_SIZE) -> T:
    if x is None:
        return None
    curr_size = x.shape[-1]
    target_size = ceil_align(curr_size, multiples_of)
    return F.pad(x, pad=(0, target_size - curr_size), mode="constant", value=-1)


# OPUS prefill applies from this many query rows; below it the decode kernel splits KV
# and the dequant is not amortized.
_OPUS_PREFILL_MIN_TOKENS = 1024
# The OPUS workspace holds every request's whole compressed history, dequantized once
# per kv_source layer. Past this many history rows per query row that dequant costs
# more than OPUS saves (gfx950, uniformly random top-k): a ratio-2 source serves fewer
# layers than the ratio-1 one.
_OPUS_PREFILL_MAX_ROWS_PER_TOKEN = {1: 256, 2: 128}
# One ratio's bf16 workspace stays within 1 GiB.
_OPUS_PREFILL_MAX_WORKSPACE_ROWS = 1 << 20
# DeepSeek-V4.1's prefill graph metadata width when the user sets no
# cuda_graph_config[prefill].max_seq_len; longer contexts run eager.
_PREFILL_GRAPH_DEFAULT_MAX_SEQ_LEN = 16 * 1024


@dataclass
class _OpusPrefillState:
    """OPUS prefill inputs of one forward. A V4.1 ratio-1/2 layer reads the
    compressed KV of its kv_source layer and the top-k of its index_source layer,
    so each is built once and reused by the layers that follow its source."""

    cache: SparsePrefillChunkCache
    # the SWA rows every layer lays out alike
    swa_csr: Csr
    # ratio -> (data_ptr of the compressed cache, its bf16 rows)
    compressed_kv: Dict[int, Tuple[int, torch.Tensor]] = field(default_factory=dict)
    # ratio -> CSR of the top-k into compressed_kv[ratio]; dropped when the indexer
    # rewrites that ratio's top-k
    topk_csr: Dict[int, Csr] = field(default_factory=dict)


def _fold_lengths_into_index_lists(
    indices: torch.Tensor,
    lengths: Optional[torch.Tensor],
    extra_indices: Optional[torch.Tensor] = None,
    extra_lengths: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Entries of indices ([b, s, w]) at position >= lengths ([b]) set to -1 (the aiter
    sparse kernel skips -1), likewise the optional second list; one launch for both."""
    if lengths is None:
        indices, lengths = None, None
    if extra_indices is not None and extra_lengths is None:
        extra_indices = None
    if indices is None and extra_indices is None:
        return indices, extra_indices
    first, first_len = (
        (indices, lengths) if indices is not None else (extra_indices, extra_lengths)
    )
    second, second_len = (
        (extra_indices, extra_lengths) if indices is not None else (None, None)
    )
    masked, masked_second = mask_indices_by_length(
        first.contiguous(), first_len.contiguous(), second, second_len
    )
    if indices is None:
        return None, masked
    return masked, masked_second if second is not None else extra_indices


def _fold_lengths_for_aiter_sparse(
    core_attn_metadata,
    compress_ratio: int,
    swa_page_indices: torch.Tensor,
    swa_topk_lengths: Optional[torch.Tensor],
    extra_indices: Optional[torch.Tensor],
    extra_topk_lengths: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """indices with positions >= lengths set to -1, since the aiter kernel takes
    no per-row length; cached on the per-step metadata, once per step and ratio."""
    key = (
        compress_ratio,
        swa_page_indices.data_ptr(),
        tuple(swa_page_indices.shape),
        None if extra_indices is None else extra_indices.data_ptr(),
        None if extra_indices is None else tuple(extra_indices.shape),
    )
    cache = core_attn_metadata._aiter_sparse_masked_indices
    if cache is None:
        cache = core_attn_metadata._aiter_sparse_masked_indices = {}
    folded = cache.get(key)
    if folded is None:
        masked, masked_extra = _fold_lengths_into_index_lists(
            swa_page_indices, swa_topk_lengths, extra_indices, extra_topk_lengths
        )
        folded = (
            swa_page_indices if masked is None else masked,
            masked_extra,
        )
        # the C4 indexer rewrites c4_sparse_page_indices in place for every C4 layer
        if compress_ratio != 4:
            cache[key] = folded
    return folded


def _create_flashmla_metadata():
    from sglang.srt.utils import is_hip

    if is_hip():
        return None
    from sglang.kernels.ops.attention.flash_mla_interface import get_mla_metadata

    return get_mla_metadata()[0]


def _create_dummy_paged_compress_data(compress_ratio: int):
    return None


@dataclass
class UnifiedKvMetadata:
    # SWA ring write target (req_slot*ring + pos%ring)
    swa_loc: Optional[torch.Tensor] = None

    # ragged decode index streams
    swa_indices: Optional[torch.Tensor] = None
    swa_indptr: Optional[torch.Tensor] = None
    hca_indices: Optional[torch.Tensor] = None
    hca_indptr: Optional[torch.Tensor] = None
    csa_indices: Optional[torch.Tensor] = None
    csa_indptr: Optional[torch.Tensor] = None

    # Grouped target-verify streams for the asm decode: one per (request,
    # draft group), laid out [compressed tail][that group's window slice] so
    # the kernel's own causal bound and band mask land on each draft's real
    # cutoff.
    gasm_indices: Optional[torch.Tensor] = None
    gasm_kv_indptr: Optional[torch.Tensor] = None
    gasm_qo_indptr: Optional[torch.Tensor] = None

    # Grouped target-verify streams for the FlyDSL fp8 decode: one per request
    # on HCA / SWA-only layers, with per-draft key ranges (q_kv_bounds).
    grp_qo_indptr: Optional[torch.Tensor] = None
    grp_hca_indices: Optional[torch.Tensor] = None
    grp_hca_indptr: Optional[torch.Tensor] = None
    grp_hca_bounds: Optional[torch.Tensor] = None
    grp_swa_indices: Optional[torch.Tensor] = None
    grp_swa_indptr: Optional[torch.Tensor] = None
    grp_swa_bounds: Optional[torch.Tensor] = None

    # prefill/extend per-token mapping
    pf_state_slot: Optional[torch.Tensor] = None
    pf_chunk_start: Optional[torch.Tensor] = None
    pf_cu_q: Optional[torch.Tensor] = None
    pf_final_pos: Optional[torch.Tensor] = None

    # Per-token req-slot map for the target-verify SWA ring store (num_draft*bs
    # tokens); unused by plain decode, whose store reads req_pool_indices live.
    verify_store_state_slot: Optional[torch.Tensor] = None

    # SWA-page-offset compressed-store locations (= c*_out_loc + unified_swa_pages),
    # precomputed once per step to drop the per-layer int add in the store path.
    c4_out_loc: Optional[torch.Tensor] = None
    c128_out_loc: Optional[torch.Tensor] = None

    def copy_(self, other: UnifiedKvMetadata) -> None:
        copy_metadata(
            src=other,
            dst=self,
            check_eq_fields=[],
            copy_fields=[
                "swa_indices",
                "swa_indptr",
                "hca_indices",
                "hca_indptr",
                "gasm_indices",
                "gasm_kv_indptr",
                "gasm_qo_indptr",
                "grp_qo_indptr",
                "grp_hca_indices",
                "grp_hca_indptr",
                "grp_hca_bounds",
                "grp_swa_indices",
                "grp_swa_indptr",
                "grp_swa_bounds",
                "csa_indices",
                "csa_indptr",
                "pf_state_slot",
                "pf_chunk_start",
                "pf_cu_q",
                "pf_final_pos",
                "verify_store_state_slot",
                "c4_out_loc",
                "c128_out_loc",
                # Captured store_cache reads swa_loc by address, and the eager
                # target-verify path builds it outside the graph.
                "swa_loc",
            ],
            assign_fields=[],
        )

    def refresh_for_breakable_cuda_graph_replay_(
        self, other: UnifiedKvMetadata
    ) -> None:
        copy_metadata(
            src=other,
            dst=self,
            check_eq_fields=[],
            copy_fields=[
                "swa_loc",
                "swa_indices",
                "swa_indptr",
                "hca_indices",
                "hca_indptr",
                "gasm_indices",
                "gasm_kv_indptr",
                "gasm_qo_indptr",
                "grp_qo_indptr",
                "grp_hca_indices",
                "grp_hca_indptr",
                "grp_hca_bounds",
                "grp_swa_indices",
                "grp_swa_indptr",
                "grp_swa_bounds",
                "csa_indices",
                "csa_indptr",
                "pf_state_slot",
                "pf_chunk_start",
                "pf_cu_q",
                "pf_final_pos",
                "verify_store_state_slot",
                "c4_out_loc",
                "c128_out_loc",
            ],
        )


@dataclass
class DSV4AttnMetadata:
    page_size: int
    page_table: torch.Tensor
    raw_out_loc: torch.Tensor
    cuda_int32_kwargs: dict

    seq_lens_casual: torch.Tensor
    positions_casual: torch.Tensor

    swa_page_indices: torch.Tensor
    swa_topk_lengths: torch.Tensor

    index_topk: int
    # Shared by all layer stores; locations are in SWA space.
    swa_out_cache_loc: Optional[torch.Tensor] = None
    c4_out_loc: Optional[torch.Tensor] = None
    c4_topk_lengths_raw: Optional[torch.Tensor] = None
    c4_topk_lengths_clamp1: Optional[torch.Tensor] = None
    c4_sparse_topk_lengths: torch.Tensor = field(init=False)
    c4_sparse_topk_lengths_raw: torch.Tensor = field(init=False)
    c4_sparse_page_indices: torch.Tensor = field(init=False)
    c4_sparse_raw_indices: Optional[torch.Tensor] = field(init=False, default=None)

    c128_out_loc: Optional[torch.Tensor] = None
    c128_page_indices: Optional[torch.Tensor] = None
    c128_topk_lengths_clamp1: Optional[torch.Tensor] = None
    c128_topk_lengths_raw: Optional[torch.Tensor] = None

    # V4.1 ratios 1 / 2: latents live at raw_out_loc // ratio of the c1 / c2 pool; None when absent
    low_ratios: Tuple[int, ...] = ()
    c1_out_loc: Optional[torch.Tensor] = None
    c1_topk_lengths_clamp1: Optional[torch.Tensor] = None
    c1_sparse_topk_lengths: Optional[torch.Tensor] = field(init=False, default=None)
    c1_sparse_page_indices: Optional[torch.Tensor] = field(init=False, default=None)
    c1_sparse_raw_indices: Optional[torch.Tensor] = field(init=False, default=None)
    c2_out_loc: Optional[torch.Tensor] = None
    c2_topk_lengths_clamp1: Optional[torch.Tensor] = None
    c2_sparse_topk_lengths: Optional[torch.Tensor] = field(init=False, default=None)
    c2_sparse_page_indices: Optional[torch.Tensor] = field(init=False, default=None)
    c2_sparse_raw_indices: Optional[torch.Tensor] = field(init=False, default=None)

    # unified-kv metadata
    unified: Optional[UnifiedKvMetadata] = None
    request_window_layout: Optional[object] = None

    # length-folded aiter_sparse lists keyed by (ratio, address, shape); valid for one forward only
    _aiter_sparse_masked_indices: Optional[dict] = field(default=None, repr=False)

    c0_flashmla_metadata: FlashMLASchedMeta = field(init=False, repr=False)
    c1_flashmla_metadata: Optional[FlashMLASchedMeta] = field(
        init=False, default=None, repr=False
    )
    c2_flashmla_metadata: Optional[FlashMLASchedMeta] = field(
        init=False, default=None, repr=False
    )
    c4_flashmla_metadata: FlashMLASchedMeta = field(init=False, repr=False)
    c128_flashmla_metadata: FlashMLASchedMeta = field(init=False, repr=False)

    @property
    def positions(self) -> torch.Tensor:
        return self.positions_casual

    def get_flashmla_metadata(self, compress_ratio: Literal[0, 1, 2, 4, 128]):
        if compress_ratio == 0:
            return self.c0_flashmla_metadata
        elif compress_ratio == 1:
            return self.c1_flashmla_metadata
        elif compress_ratio == 2:
            return self.c2_flashmla_metadata
        elif compress_ratio == 4:
            return self.c4_flashmla_metadata
        elif compress_ratio == 128:
            return self.c128_flashmla_metadata
        else:
            raise ValueError(f"invalid {compress_ratio=}")

    def sparse_page_indices(self, compress_ratio: Literal[1, 2, 4]) -> torch.Tensor:
        """Top-k slots into the ratio's extra cache, -1 padded; the indexer fills them."""
        if compress_ratio == 1:
            return self.c1_sparse_page_indices
        elif compress_ratio == 2:
            return self.c2_sparse_page_indices
        elif compress_ratio == 4:
            return self.c4_sparse_page_indices
        raise ValueError(f"invalid {compress_ratio=}")

    def drop_folded_sparse_indices(self, compress_ratio: Literal[1, 2, 4]) -> None:
        """An index source rewrites sparse_page_indices(compress_ratio) in place, so the
        length-folded copies keyed on that buffer stop describing it."""
        cache = self._aiter_sparse_masked_indices
        if cache:
            for key in [k for k in cache if k[0] == compress_ratio]:
                del cache[key]

    def sparse_raw_indices(
        self, compress_ratio: Literal[1, 2, 4]
    ) -> Optional[torch.Tensor]:
        if compress_ratio == 1:
            return self.c1_sparse_raw_indices
        elif compress_ratio == 2:
            return self.c2_sparse_raw_indices
        elif compress_ratio == 4:
            return self.c4_sparse_raw_indices
        raise ValueError(f"invalid {compress_ratio=}")

    def sparse_topk_lengths(self, compress_ratio: Literal[1, 2, 4]) -> torch.Tensor:
        if compress_ratio == 1:
            return self.c1_sparse_topk_lengths
        elif compress_ratio == 2:
            return self.c2_sparse_topk_lengths
        elif compress_ratio == 4:
            return self.c4_sparse_topk_lengths
        raise ValueError(f"invalid {compress_ratio=}")

    def copy_(self, other: DSV4AttnMetadata) -> None:
        copy_metadata(
            src=other,
            dst=self,
            check_eq_fields=[
                "index_topk",
                "page_size",
                "cuda_int32_kwargs",
                "low_ratios",
            ],
            copy_fields=[
                "raw_out_loc",
                "seq_lens_casual",
                "positions_casual",
                "c4_out_loc",
                "c128_out_loc",
                "page_table",
                "swa_page_indices",
                "swa_topk_lengths",
                "c128_page_indices",
                "c128_topk_lengths_clamp1",
                "c128_topk_lengths_raw",
                "c4_topk_lengths_raw",
                "c4_topk_lengths_clamp1",
                "c4_sparse_topk_lengths",
                "c4_sparse_topk_lengths_raw",
                "c4_sparse_page_indices",
                "c4_sparse_raw_indices",
                "c1_out_loc",
                "c1_topk_lengths_clamp1",
                "c1_sparse_topk_lengths",
                "c1_sparse_page_indices",
                "c1_sparse_raw_indices",
                "c2_out_loc",
                "c2_topk_lengths_clamp1",
                "c2_sparse_topk_lengths",
                "c2_sparse_page_indices",
                "c2_sparse_raw_indices",
                "unified",
                "request_window_layout",
            ],
            assign_fields=[
                # Recomputed by the recorded init_forward_metadata_in_graph op
                # each forward; not copied across replays.
                "swa_out_cache_loc",
                "_aiter_sparse_masked_indices",
                "c0_flashmla_metadata",
                "c1_flashmla_metadata",
                "c2_flashmla_metadata",
                "c4_flashmla_metadata",
                "c128_flashmla_metadata",
            ],
        )

    # the captured store kernels read this by address, so a replay must find the live values at it
    BREAKABLE_CUDA_GRAPH_IN_GRAPH_FIELDS: ClassVar[Tuple[str, ...]] = (
        "swa_out_cache_loc",
    )

    def refresh_for_breakable_cuda_graph_replay_(self, other: DSV4AttnMetadata) -> None:
        if not self.low_ratios:
            assert self.page_size == other.page_size
            assert self.index_topk == other.index_topk
            assert self.low_ratios == other.low_ratios
            for f in fields(self):
                src, dst = getattr(other, f.name), getattr(self, f.name)
                if torch.is_tensor(src) or torch.is_tensor(dst):
                    assert src is not None and dst is not None, f.name
                    dst.copy_(src)
                elif f.name == "unified" and src is not None:
                    assert dst is not None
                    dst.refresh_for_breakable_cuda_graph_replay_(src)
                else:
                    setattr(self, f.name, src)
            return
        # low ratios: rebind every field to other's (built for the live batch), except the
        # SWA store target, which the captured segments read by address and is copied
        assert self.page_size == other.page_size
        assert self.index_topk == other.index_topk
        assert self.low_ratios == other.low_ratios
        for f in fields(self):
            name = f.name
            src = getattr(other, name)
            if name in self.BREAKABLE_CUDA_GRAPH_IN_GRAPH_FIELDS:
                dst = getattr(self, name)
                assert dst is not None and src is not None, f"{name=} {dst=} {src=}"
                assert dst.shape == src.shape, f"{name=} {dst.shape=} {src.shape=}"
                dst.copy_(src)
            else:
                # the length-fold cache too: a stale entry could match a reused address
                setattr(self, name, src)

    def init_compression_metadata(
        self, num_tokens: Optional[int] = None, unified_swa_pages: int = 0
    ):
        assert self.page_table.dim() == 2
        if num_tokens is None:
            num_tokens = self.seq_lens_casual.shape[0]
        assert self.raw_out_loc.shape[0] == num_tokens, (
            f"{self.raw_out_loc.shape=}, {num_tokens=}"
        )

        (
            self.c4_out_loc,
            _,
            self.c4_topk_lengths_raw,
            self.c4_topk_lengths_clamp1,
            self.c128_out_loc,
            _,
            self.c128_topk_lengths_raw,
            self.c128_topk_lengths_clamp1,
            self.c128_page_indices,
        ) = _init_compression_metadata_triton(
            self.seq_lens_casual,
            self.positions_casual,
            self.raw_out_loc,
            self.page_table,
            self.page_size,
            compute_page_indices=True,
        )

        self.c128_page_indices = _pad_last_dim(self.c128_page_indices)
        self.swa_page_indices = _pad_last_dim(self.swa_page_indices)

        if unified_swa_pages:
            if self.unified is None:
                self.unified = UnifiedKvMetadata()
            self.unified.c4_out_loc = self.c4_out_loc + unified_swa_pages
            self.unified.c128_out_loc = self.c128_out_loc + unified_swa_pages

        # ratio 1/2 counterparts of the c4/c128 metadata, one launch for both
        for name, value in low_ratio_compression_metadata(
            self.seq_lens_casual, self.raw_out_loc, self.low_ratios
        ).items():
            setattr(self, name, value)

    # Same CP contract as the CUDA metadata; HIP also keeps the raw c128 lengths.
    _CP_REINDEX_FIELDS = _cuda_backend.DSV4AttnMetadata._CP_REINDEX_FIELDS
    _CP_REINDEX_OPTIONAL_FIELDS = (
        _cuda_backend.DSV4AttnMetadata._CP_REINDEX_OPTIONAL_FIELDS
        + ["c128_topk_lengths_raw"]
    )
    _CP_GLOBAL_FIELDS = _cuda_backend.DSV4AttnMetadata._CP_GLOBAL_FIELDS
    apply_cp_reindex = _cuda_backend.DSV4AttnMetadata.apply_cp_reindex

    def init_flashmla_related(self, is_prefill: bool = False):
        assert self.index_topk in (512, 1024), (
            f"unexpected index_topk={self.index_topk}; "
            "supported: 512 (small) or 1024 (large)"
        )
        assert self.c4_topk_lengths_clamp1 is not None
        assert self.c4_topk_lengths_raw is not None
        # the clamped lengths and the -1 filled top-k buffers of every ratio in one launch
        for name, value in sparse_buffers(
            c4_topk_lengths_clamp1=self.c4_topk_lengths_clamp1,
            c4_topk_lengths_raw=self.c4_topk_lengths_raw,
            c1_topk_lengths_clamp1=(
                self.c1_topk_lengths_clamp1 if 1 in self.low_ratios else None
            ),
            c2_topk_lengths_clamp1=(
                self.c2_topk_lengths_clamp1 if 2 in self.low_ratios else None
            ),
            index_topk=self.index_topk,
            page_index_align=PAGE_INDEX_ALIGNED_SIZE,
        ).items():
            setattr(self, name, value)
        if is_prefill:
            self.c4_sparse_raw_indices = torch.empty_like(self.c4_sparse_page_indices)
        self.c0_flashmla_metadata = _create_flashmla_metadata()
        self.c4_flashmla_metadata = _create_flashmla_metadata()
        self.c128_flashmla_metadata = _create_flashmla_metadata()
        # -1 filled like the page indices: identity rows write only their reachable columns,
        # and the OPUS prefill reads the raw indices without the top-k lengths
        if 1 in self.low_ratios:
            self.c1_sparse_raw_indices = torch.full_like(
                self.c1_sparse_page_indices, -1
            )
            self.c1_flashmla_metadata = _create_flashmla_metadata()
        if 2 in self.low_ratios:
            self.c2_sparse_raw_indices = torch.full_like(
                self.c2_sparse_page_indices, -1
            )
            self.c2_flashmla_metadata = _create_flashmla_metadata()


@dataclass
class DSV4Metadata:
    core_attn_metadata: DSV4AttnMetadata
    indexer_metadata: Optional[PagedIndexerMetadata]

    # low-ratio indexer metadata per ratio: decode rows per request (clamp-1), prefill per token
    c1_indexer_metadata: Optional[PagedIndexerMetadata] = None
    c2_indexer_metadata: Optional[PagedIndexerMetadata] = None

    c4_compress_metadata: Optional[FusedCompressMetadata] = None
    c128_compress_metadata: Optional[FusedCompressMetadata] = None
    # per-step inputs of forward_low_ratio_sources, hoisted for one-token rows and the replay tail
    low_ratio_req_indices: Optional[torch.Tensor] = None
    low_ratio_pos_i64: Optional[torch.Tensor] = None
    # Per-step scratch for the TP-padded query heads (models/deepseek_v4.py).
    q_pad_buffer: Optional[torch.Tensor] = None
    # Set once a CUDA graph captures q_pad_buffer; it may not grow after that.
    q_pad_captured: bool = False
    # low-ratio FlyDSL indexer workspaces by ratio; address-pinned like the c4 ones, rebuilt in place
    fp4_low_ratio_decode_workspaces: Dict[
        int, Union[FP4DecodeWorkspace, FP4RowgroupDecodeWorkspace]
    ] = field(default_factory=dict, repr=False)
    fp4_low_ratio_prefill_workspaces: Dict[
        int, Union[FP4PrefillWorkspace, FP4RowgroupPrefillWorkspace]
    ] = field(default_factory=dict, repr=False)
    # Captured kernels bind these FP4 indexer buffers by address; absent from copy_
    # so addresses stay pinned across replays (the builders refresh contents).
    fp4_decode_workspace: Optional[
        Union[FP4DecodeWorkspace, FP4RowgroupDecodeWorkspace]
    ] = field(default=None, repr=False)
    fp4_prefill_workspace: Optional[FP4PrefillWorkspace] = field(
        default=None, repr=False
    )
    # Derived by the first C4 layer of a forward and reused by the rest.
    fp4_k_write_metadata: Optional[FP4KWriteMetadata] = field(default=None, repr=False)
    # AITER's rope kernels require int64 positions while the core metadata keeps
    # them int32, so widen once per forward instead of once per C4 layer.
    fp4_q_positions: Optional[torch.Tensor] = field(default=None, repr=False)
    # only on the metadata built for the late layers under decoder SWA bounded replay
    late_layer_tail: Optional[LateLayerTail] = None

    @property
    def core_metadata(self) -> DSV4AttnMetadata:
        return self.core_attn_metadata

    def low_ratio_indexer_metadata(
        self, compress_ratio: int
    ) -> Optional[PagedIndexerMetadata]:
        return (
            self.c1_indexer_metadata
            if compress_ratio == 1
            else self.c2_indexer_metadata
        )

    def low_ratio_indexer_metadata_by_ratio(self) -> Dict[int, PagedIndexerMetadata]:
        out = {}
        if self.c1_indexer_metadata is not None:
            out[1] = self.c1_indexer_metadata
        if self.c2_indexer_metadata is not None:
            out[2] = self.c2_indexer_metadata
        return out

    def copy_(self, other: DSV4Metadata):
        self.core_attn_metadata.copy_(other.core_attn_metadata)
        maybe_copy_inplace(self.indexer_metadata, src=other.indexer_metadata)
        maybe_copy_inplace(self.c1_indexer_metadata, src=other.c1_indexer_metadata)
        maybe_copy_inplace(self.c2_indexer_metadata, src=other.c2_indexer_metadata)
        maybe_copy_inplace(self.c4_compress_metadata, src=other.c4_compress_metadata)
        maybe_copy_inplace(
            self.c128_compress_metadata, src=other.c128_compress_metadata
        )

    # allocated inside a captured segment (graph-pool storage), so a refresh must keep it
    BREAKABLE_CUDA_GRAPH_KEEP_FIELDS: ClassVar[Tuple[str, ...]] = (
        "q_pad_buffer",
        "q_pad_captured",
    )

    def refresh_for_breakable_cuda_graph_replay_(self, other: DSV4Metadata) -> None:
        self.core_attn_metadata.refresh_for_breakable_cuda_graph_replay_(
            other.core_attn_metadata
        )
        if not self.core_attn_metadata.low_ratios:
            maybe_copy_inplace(self.indexer_metadata, src=other.indexer_metadata)
            maybe_copy_inplace(
                self.c4_compress_metadata, src=other.c4_compress_metadata
            )
            maybe_copy_inplace(
                self.c128_compress_metadata, src=other.c128_compress_metadata
            )

            if self.fp4_k_write_metadata is None and other.fp4_k_write_metadata is None:
                pass
            else:
                assert (
                    self.fp4_k_write_metadata is not None
                    and other.fp4_k_write_metadata is not None
                )
                for captured, replay in zip(
                    self.fp4_k_write_metadata,
                    other.fp4_k_write_metadata,
                    strict=True,
                ):
                    captured.copy_(replay)

            if self.fp4_q_positions is None and other.fp4_q_positions is None:
                pass
            else:
                assert self.fp4_q_positions is not None
                assert other.fp4_q_positions is not None
                self.fp4_q_positions.copy_(other.fp4_q_positions)
            return
        for f in fields(self):
            name = f.name
            if (
                name == "core_attn_metadata"
                or name in self.BREAKABLE_CUDA_GRAPH_KEEP_FIELDS
            ):
                continue
            setattr(self, name, getattr(other, name))


@dataclass
class DSV4RawVerifyMetadata:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor

    extend_seq_lens: Optional[torch.Tensor] = None

    def copy_(self, other: DSV4RawVerifyMetadata):
        self.req_pool_indices.copy_(other.req_pool_indices)
        self.seq_lens.copy_(other.seq_lens)
        self.out_cache_loc.copy_(other.out_cache_loc)

        self.extend_seq_lens = other.extend_seq_lens


@dataclass
class DSV4RawDecodeMetadata:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor

    def copy_(self, other: DSV4RawDecodeMetadata):
        self.req_pool_indices.copy_(other.req_pool_indices)
        self.seq_lens.copy_(other.seq_lens)
        self.out_cache_loc.copy_(other.out_cache_loc)


_GROUPED_ASM_BLOCK_Q = 4

# aiter serves gqa*msq off one 64-row q tile and only whitelists msq above 1
# at gqa=16 -- the TP-only shape. DP attention gives a rank all 128 heads, so
# the tile is full of heads with no room to group, and none is needed either:
# one kv read already feeds 128 heads rather than 16. An unsupported pair does
# not downgrade, it fails aiter's kernel lookup outright.
_GROUPED_ASM_GQA = 16
_GROUPED_ASM_MIN_REQS = 16


def _grouped_asm_enabled() -> bool:
    """
    Grouped target-verify decode through the asm kernel, off by default.
    """
    return os.environ.get("SGLANG_DSV4_GROUPED_ASM", "0") == "1"


@dataclass
class DSV4RawDSparkDraftMetadata:
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    block_size: int

    def copy_(self, other: DSV4RawDSparkDraftMetadata):
        assert self.block_size == other.block_size
        self.req_pool_indices.copy_(other.req_pool_indices)
        self.seq_lens.copy_(other.seq_lens)
        self.out_cache_loc.copy_(other.out_cache_loc)


class _GraphBucket(enum.Enum):
    DECODE_OR_IDLE = "decode_or_idle"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"

    @classmethod
    def of(cls, forward_mode: ForwardMode) -> _GraphBucket:
        if forward_mode.is_decode_or_idle():
            return cls.DECODE_OR_IDLE
        if forward_mode.is_target_verify():
            return cls.TARGET_VERIFY
        if forward_mode.is_draft_extend_v2():
            return cls.DRAFT_EXTEND
        raise NotImplementedError(f"unsupported {forward_mode=}")


class DeepseekV4HipRadixBackend(
    AttentionBackend,
    C4IndexerBackendMixin,
    CompressorBackendMixin,
):
    # DSV4 TBO runs only in eager prefill; driving TBO children through graph
    # capture/replay leaks ROCm HSA resources (HSA_STATUS_ERROR_OUT_OF_RESOURCES).
    tbo_supports_cuda_graph = False
    supports_prefill_cuda_graph_max_context_size = True
    supports_ragged_verify_graph: bool = True
    # each bucket keeps one metadata object; the captured segments read the SWA store target by address
    use_captured_forward_metadata_for_breakable_cuda_graph: bool = True

    forward = DeepseekV4AttnBackend.forward

    # the ratio-1/2 compressor and indexer orchestration is the CUDA backend's, taken
    # unbound; HIP differs only in the paged top-k (_low_ratio_index_topk below)
    forward_low_ratio_sources = DeepseekV4AttnBackend.forward_low_ratio_sources
    _forward_low_ratio_sources_cp = DeepseekV4AttnBackend._forward_low_ratio_sources_cp
    write_tail_source_kv = DeepseekV4AttnBackend.write_tail_source_kv
    # No two-level candidates on HIP: the ratio-1/2 sources stay one eager break.
    low_ratio_prefill_graph = False
    # This attribute is used in python/sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py.
    # PrefillCudaGraphRunner looks this up via getattr; contexts over prefill.max_seq_len run eager.
    can_run_prefill_cuda_graph = DeepseekV4AttnBackend.can_run_prefill_cuda_graph
    _prefill_graph_seq_limit = DeepseekV4AttnBackend._prefill_graph_seq_limit
    _low_ratio_in_prefill_graph = DeepseekV4AttnBackend._low_ratio_in_prefill_graph
    _low_ratio_compress = DeepseekV4AttnBackend._low_ratio_compress
    _low_ratio_compress_decode = DeepseekV4AttnBackend._low_ratio_compress_decode
    _low_ratio_compress_torch = DeepseekV4AttnBackend._low_ratio_compress_torch
    _low_ratio_pair_partners = DeepseekV4AttnBackend._low_ratio_pair_partners
    _low_ratio_write_group = DeepseekV4AttnBackend._low_ratio_write_group
    _low_ratio_compress_fused = DeepseekV4AttnBackend._low_ratio_compress_fused
    # MIXED BCG replay regresses ROCm DSV4 DP-attention serving throughput.
    prefer_eager_mixed_prefill_under_dp_attention: bool = True

    def __init__(
        self,
        model_runner: ModelRunner,
        skip_prefill: bool = False,
        speculative_step_id=0,
        topk=0,
        speculative_num_steps=0,
    ):
        super().__init__()
        self.model_runner = model_runner
        self.device = torch.device(model_runner.device)
        self.max_context_len = model_runner.model_config.context_len
        head_dim = model_runner.model_config.head_dim
        assert head_dim == 512, (
            "DSV4 MQA head_dim = qk_nope_head_dim(448) + qk_rope_head_dim(64) = 512"
        )
        self.softmax_scale: float = head_dim**-0.5
        self.head_dim_v: int = model_runner.model_config.v_head_dim
        self.cuda_int32_kwargs = {"device": self.device, "dtype": torch.int32}
        assert model_runner.page_size is not None
        assert model_runner.req_to_token_pool is not None
        self.page_size = model_runner.page_size
        assert self.page_size == 256, "the system hardcodes page_size=256"

        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool: DeepSeekV4TokenToKVPool = model_runner.token_to_kv_pool
        # The C4 state ring is addressed per SWA page, so a page holds whole windows.
        assert self.token_to_kv_pool.swa_page_size % SWA_WINDOW == 0
        self.hisparse_coordinator = model_runner.hisparse_coordinator
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.MAX_SEQ_LEN_FOR_CAPTURE = self.req_to_token.shape[1]

        assert isinstance(self.token_to_kv_pool, DeepSeekV4TokenToKVPool)
        # index_topk and candidate_* are optional HF-config keys
        self.index_topk = getattr(
            model_runner.model_config.hf_text_config, "index_topk", DEFAULT_INDEX_TOPK
        )
        # the distinct ratios this pool has, sorted: (4, 128) for V4, (1, 2) for V4.1
        self.present_ratios = self.token_to_kv_pool.present_ratios
        self.low_ratios: Tuple[int, ...] = tuple(
            ratio for ratio in (1, 2) if ratio in self.present_ratios
        )
        self.has_c4: bool = 4 in self.present_ratios
        self.has_c128: bool = 128 in self.present_ratios
        # rows whose compressed context fits index_topk take the sequential selection, unscored
        hf_text_config = model_runner.model_config.hf_text_config
        self.low_ratio_identity_skip: bool = bool(
            self.low_ratios
        ) and low_ratio_identity_skip_enabled(
            index_topk=self.index_topk,
            candidate_topk_blocks=getattr(hf_text_config, "candidate_topk_blocks", 0),
            candidate_block_size=getattr(hf_text_config, "candidate_block_size", 1),
        )
        # a decode batch whose longest context fits this span skips the candidate-block filter
        self.low_ratio_candidate_span: Optional[int] = (
            low_ratio_candidate_span(hf_text_config) if self.low_ratios else None
        )
        # published by the candidate-source layer, consumed by the later index-source layers
        self.candidate_masks = None
        self.enable_deepseek_v4_fp4_indexer: bool = (
            get_exec().kernel.enable_deepseek_v4_fp4_indexer
        )
        self.enable_decoder_swa_bounded_replay: bool = (
            get_exec().features.enable_decoder_swa_bounded_replay
        )
        if self.enable_decoder_swa_bounded_replay:
            # both read the store target off the full batch, not the tail metadata
            from sglang.srt.layers.attention.dsv4.unified_kv_gate import (
                is_unified_kv_triton,
            )

            if is_unified_kv_triton():
                raise NotImplementedError(
                    "decoder SWA bounded replay is not wired for unified_kv_triton"
                )
        # the model switches onto it at the last kv_source layer (enter_late_layer_tail)
        self.tail_forward_metadata: Optional[DSV4Metadata] = None
        # The source layer whose KV write_tail_source_kv wrote for every row; cleared in
        # exit_late_layer_tail.
        self.tail_source_kv_layer_id: Optional[int] = None
        self.encoder_replay = False
        self.topk = get_spec().speculative_eagle_topk or 0
        assert self.topk in [0, 1], "MTP Topk > 1 not supported for DeepSeek V4"
        self.mtp_enabled = self.topk > 0
        self.speculative_num_steps = speculative_num_steps
        self.speculative_num_draft_tokens: int = get_spec().speculative_num_draft_tokens
        self.is_draft_worker = getattr(model_runner, "is_draft_worker", False)
        self._verify_mask: Optional[VerifyMask] = None
        self.is_dspark = model_runner.spec_algorithm.is_dspark()
        # the DSpark draft reads the target's checkpoint, so its config names V4.1 too
        self.is_dsv41 = (
            getattr(model_runner.model_config.hf_text_config, "model_type", None)
            == "deepseek_v41"
        )
        # Decode and speculative metadata can be rebuilt from device lengths.
        # The online c128 planner still consumes CPU lengths.
        self.needs_cpu_seq_lens = envs.SGLANG_OPT_USE_ONLINE_COMPRESS.get()
        self.is_dspark_draft = self.is_draft_worker and self.is_dspark
        # Draft layers are all COMPRESS_RATIO_NEXTN_LAYER (0), so the draft pool
        # has neither compressed kv nor an indexer pool.
        self.need_compress = not self.is_draft_worker
        self.target_verify_num_draft_tokens = self.speculative_num_draft_tokens
        if self.is_dspark_draft:
            assert self.speculative_num_draft_tokens is not None
            assert self.speculative_num_draft_tokens > 1
            # DSpark draft workers verify gamma rows; the server arg keeps the
            # CUDA-side convention gamma + 1.
            self.target_verify_num_draft_tokens = self.speculative_num_draft_tokens - 1
        self._fp8_decode_num_heads = (
            model_runner.model_config.num_attention_heads // get_parallel().attn_tp_size
        )
        # output mode of the fp8 verify: deepseek_v4 fuses the fp8 wo_a quant into it
        self._fp8_verify_epi = (
            "invrope_mxfp8"
            if any(getattr(m, "wo_a_fp8", False) for m in model_runner.model.modules())
            else "bf16"
        )
        self._fp8_split_kv_hint: Dict[int, int] = {}
        self._init_fp8_asm_decode_plan()
        # Past MAX_FUSED_ROWS the fp4 schedule falls back to AITER's preamble,
        # which frees the scratch its kernels read -- not capture-safe.
        self._fp4_graph_row_limit: Optional[int] = None
        if self.enable_deepseek_v4_fp4_indexer and self.speculative_num_steps == 0:
            from sglang.kernels.ops.attention.dsv4.fp4_indexer_schedule_hip import (
                MAX_FUSED_ROWS,
            )

            self._fp4_graph_row_limit = MAX_FUSED_ROWS
        # DSv4 C4 decode / target-verify indexer on AITER's row-group kernel: no schedule,
        # its workspace built in the graph, a request's verify rows sharing each key load.
        # Every launch reads a table of one width (its compiled variant) for the server's life.
        self._fp4_c4_rowgroup_columns: Optional[int] = None
        if (
            self.enable_deepseek_v4_fp4_indexer
            and self.speculative_num_steps == 0
            and self.has_c4
            and envs.SGLANG_HIP_DSV4_C4_INDEXER_ROWGROUP.get()
        ):
            from sglang.kernels.ops.attention.dsv4.fp4_indexer_hip import (
                aiter_has_fp4_rowgroup,
                rowgroup_table_columns,
            )

            if aiter_has_fp4_rowgroup():
                self._fp4_c4_rowgroup_columns = rowgroup_table_columns(
                    max(self.max_context_len, self.MAX_SEQ_LEN_FOR_CAPTURE), 4
                )
                logger.info(
                    "DSv4 C4 indexer: decode / target-verify on the row-group FP4 "
                    "MQA logits kernel (%d table columns)",
                    self._fp4_c4_rowgroup_columns,
                )
            else:
                logger.warning(
                    "SGLANG_HIP_DSV4_C4_INDEXER_ROWGROUP is set but the installed AITER "
                    "has no row-group FP4 MQA logits kernel (#6145); keeping the "
                    "schedule-based C4 indexer."
                )
        self.speculative_step_id = speculative_step_id
        self.forward_metadata: Union[
            DSV4Metadata,
            DSV4RawVerifyMetadata,
            DSV4RawDecodeMetadata,
        ] = None
        self.opus_prefill_workspace = SparsePrefillKVBuffer(self.device)
        self.opus_compressed_workspaces = {
            ratio: SparsePrefillKVBuffer(self.device) for ratio in (1, 2)
        }
        # Reset with the metadata: its inputs belong to one prefill forward.
        self._opus_prefill_state: Optional[_OpusPrefillState] = None

    def _move_to_device(self, x: List[int]) -> torch.Tensor:
        pin_tensor = torch.tensor(x, dtype=torch.int32, pin_memory=True)
        return pin_tensor.to(self.device, non_blocking=True)

    def init_forward_metadata_indexer(
        self,
        core_attn_metadata: DSV4AttnMetadata,
        *,
        compress_ratio: int = 4,
        is_prefill: bool = False,
    ):
        page_table = core_attn_metadata.page_table
        index_page_size = 0
        if compress_ratio == 4:
            c_seq_lens = core_attn_metadata.c4_topk_lengths_raw
        elif compress_ratio in (1, 2):
            if is_prefill:
                # raw visible count per token row; a zero row is skipped by the prefill kernel
                c_seq_lens = (core_attn_metadata.seq_lens_casual // compress_ratio).to(
                    torch.int32
                )
            else:
                c_seq_lens = (
                    core_attn_metadata.c1_topk_lengths_clamp1
                    if compress_ratio == 1
                    else core_attn_metadata.c2_topk_lengths_clamp1
                )
            # the low-ratio indexer-K pool pages at 64 slots, not page_size // ratio
            index_page_size = self.token_to_kv_pool.get_index_k_page_size(
                compress_ratio
            )
            slots_per_page = self.page_size // compress_ratio
            assert slots_per_page % index_page_size == 0, (
                f"{self.page_size = } / {compress_ratio = } must be a multiple of "
                f"{index_page_size = }"
            )
            page_table = expand_index_page_table(
                page_table, slots_per_page // index_page_size
            )
        else:
            raise ValueError(f"Unsupported indexer {compress_ratio = }")
        return PagedIndexerMetadata(
            page_size=self.page_size,
            compressed_page_size=self.token_to_kv_pool.get_index_k_page_size(
                compress_ratio
            ),
            page_table=page_table,
            compressed_seq_lens=c_seq_lens,
            use_topk_v2=self.dsa_topk_backend.should_use_topk_v2(),
            compress_ratio=compress_ratio,
        )

    def _init_low_ratio_indexer_metadata(
        self, core_attn_metadata: DSV4AttnMetadata, *, is_prefill: bool
    ) -> Dict[str, PagedIndexerMetadata]:
        return {
            f"c{ratio}_indexer_metadata": self.init_forward_metadata_indexer(
                core_attn_metadata, compress_ratio=ratio, is_prefill=is_prefill
            )
            for ratio in core_attn_metadata.low_ratios
        }

    def init_forward_metadata_decode(
        self,
        max_seq_len: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> Union[DSV4Metadata, DSV4RawDecodeMetadata]:
        assert (
            req_pool_indices.shape[0] == seq_lens.shape[0] == out_cache_loc.shape[0]
        ), f"{req_pool_indices.shape=} {seq_lens.shape=} {out_cache_loc.shape=}"

        return DSV4RawDecodeMetadata(
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
        )

    def init_forward_metadata_prefill(
        self,
        max_seq_len: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: Optional[List[int]],
        out_cache_loc: torch.Tensor,
        num_tokens: int,
        extend_seq_lens: torch.Tensor,
        extend_seq_lens_cpu: Optional[List[int]],
        need_compress: bool = True,
        use_prefill_cuda_graph: bool = False,
        compress_gpu_plan: bool = False,
        extend_start_loc: Optional[torch.Tensor] = None,
        attach_decode_streams: bool = False,
        low_ratio_decode_rows: bool = False,
        swa_replay_start: Optional[torch.Tensor] = None,
        # Whether num_tokens == sum(extend_seq_lens) exactly, which lets the
        # token map skip an implicit D2H.
        exact_num_tokens: bool = True,
        forward_batch: Optional[ForwardBatch] = None,
    ) -> DSV4Metadata:
        padded_num_tokens = out_cache_loc.shape[0]
        cp_active = forward_batch is not None and is_cp_active(forward_batch)
        if cp_active:
            cp_metadata = forward_batch.attn_cp_metadata
            assert cp_metadata is not None
            padded_num_tokens = sum(cp_metadata.per_rank_actual_token)

        from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import (
            ExpandPrefillCausally,
        )

        # extend_start_loc and the CPU mirrors below only feed the torch
        # fallback; the triton kernel cumsums extend_seq_lens on device.
        _expanded = ExpandPrefillCausally.execute(
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            extend_seq_lens=extend_seq_lens,
            extend_start_loc=extend_start_loc,
            seq_lens_cpu=seq_lens_cpu,
            extend_seq_lens_cpu=extend_seq_lens_cpu,
            num_tokens=num_tokens,
            padded_num_tokens=padded_num_tokens,
        )
        seq_lens_casual = _expanded.seq_lens_casual
        req_pool_indices_repeated = _expanded.req_pool_indices_repeated
        core_attn_metadata = self.make_core_attn_metadata(
            req_to_token=self.req_to_token,
            req_pool_indices_repeated=req_pool_indices_repeated,
            seq_lens_casual=seq_lens_casual,
            max_seq_len=max_seq_len,
            out_loc=out_cache_loc,
            need_compress=need_compress,
            is_prefill=True,
            num_tokens=num_tokens if cp_active else None,
            swa_replay_start=swa_replay_start,
            num_groups=len(req_pool_indices),
        )
        # Normal prefill starts with a conservative exact_num_tokens=False.
        # Its CPU length mirror proves the exact query count without a D2H sync.
        host_proves_exact_num_tokens = (
            need_compress
            and not attach_decode_streams
            and extend_seq_lens_cpu is not None
            and sum(extend_seq_lens_cpu) == num_tokens
        )
        # Build unified metadata against the global padded layout before CP
        # slices the query-side core fields to this rank.
        self._attach_unified_kv_prefill_meta(
            core_attn_metadata,
            req_pool_indices,
            req_pool_indices_repeated,
            seq_lens,
            extend_seq_lens,
            num_tokens,
            exact_num_tokens=exact_num_tokens or host_proves_exact_num_tokens,
        )
        if cp_active:
            core_attn_metadata.apply_cp_reindex(num_tokens=num_tokens)
            if need_compress:
                core_attn_metadata.init_flashmla_related()
        if attach_decode_streams:
            # Verify runs the unified_kv DECODE kernel; req_pool_indices_repeated
            # is the per-token (num_draft*bs -> bs) req-slot map.
            self._attach_unified_kv_decode_streams(
                core_attn_metadata,
                req_pool_indices_repeated,
                num_draft=self.target_verify_num_draft_tokens,
            )
        indexer_metadata = (
            self.init_forward_metadata_indexer(core_attn_metadata)
            if need_compress and self.has_c4
            else None
        )
        if not need_compress:
            create = _create_dummy_paged_compress_data
        else:

            def create(compress_ratio: Literal[4, 128]):
                use_graph_plan = use_prefill_cuda_graph and not (
                    compress_ratio == 128 and envs.SGLANG_OPT_USE_ONLINE_COMPRESS.get()
                )
                if compress_gpu_plan or use_graph_plan:
                    return create_paged_compressor_data(
                        compress_ratio=compress_ratio,
                        is_prefill=True,
                        token_to_kv_pool=self.token_to_kv_pool,
                        req_to_token=self.req_to_token,
                        req_pool_indices=req_pool_indices,
                        seq_lens=seq_lens,
                        seq_lens_cpu=None,
                        extend_lens=extend_seq_lens,
                        extend_lens_cpu=None,
                        num_q_tokens=(
                            out_cache_loc.shape[0] if use_graph_plan else num_tokens
                        ),
                        use_prefill_cuda_graph=use_prefill_cuda_graph,
                    )
                return create_paged_compressor_data(
                    compress_ratio=compress_ratio,
                    is_prefill=True,
                    token_to_kv_pool=self.token_to_kv_pool,
                    req_to_token=self.req_to_token,
                    req_pool_indices=req_pool_indices,
                    seq_lens=seq_lens,
                    seq_lens_cpu=seq_lens_cpu,
                    extend_lens=extend_seq_lens,
                    extend_lens_cpu=extend_seq_lens_cpu,
                    use_prefill_cuda_graph=False,
                )

        low_ratio_indexer_metadata = (
            self._init_low_ratio_indexer_metadata(
                core_attn_metadata, is_prefill=not low_ratio_decode_rows
            )
            if need_compress
            else {}
        )
        return DSV4Metadata(
            core_attn_metadata,
            indexer_metadata,
            c4_compress_metadata=(
                create(compress_ratio=4)
                if self.has_c4
                else _create_dummy_paged_compress_data(compress_ratio=4)
            ),
            c128_compress_metadata=(
                create(compress_ratio=128)
                if self.has_c128
                else _create_dummy_paged_compress_data(compress_ratio=128)
            ),
            **low_ratio_indexer_metadata,
        )

    def init_forward_metadata_target_verify(
        self,
        max_seq_len: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: Optional[torch.Tensor] = None,
        extend_seq_lens: Optional[torch.Tensor] = None,
        use_prefill_cuda_graph: bool = False,
        seq_lens_cpu: Optional[List[int]] = None,
        ragged_layout=None,
    ) -> Union[DSV4Metadata, DSV4RawVerifyMetadata]:
        # Only DSPARK's uniform draft block defers into the graph; EAGLE's fixed-tier
        # plan trips planner invariants. Graph path only: the upgrade sizes page_table
        # by MAX_SEQ_LEN_FOR_CAPTURE, wider than an eager caller's max_seq_len.
        if (
            use_prefill_cuda_graph
            and self.is_dspark
            and ragged_layout is None
            and out_cache_loc is not None
            # Oversized batches keep the eager build; see _fp4_graph_row_limit.
            and (
                self._fp4_graph_row_limit is None
                or self.target_verify_num_draft_tokens * len(seq_lens)
                <= self._fp4_graph_row_limit
            )
        ):
            return DSV4RawVerifyMetadata(
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                out_cache_loc=out_cache_loc,
            )
        return self.init_forward_metadata_target_verify_old(
            max_seq_len=max_seq_len,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=out_cache_loc,
            use_prefill_cuda_graph=use_prefill_cuda_graph,
            ragged_layout=ragged_layout,
        )

    def init_forward_metadata_target_verify_old(
        self,
        max_seq_len: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: Optional[List[int]] = None,
        out_cache_loc: Optional[torch.Tensor] = None,
        use_prefill_cuda_graph: bool = False,
        ragged_layout=None,
    ) -> DSV4Metadata:
        batch_size = len(seq_lens)
        # Verify tokens may cross into the next page beyond the accepted prefix.
        max_seq_len += self.target_verify_num_draft_tokens
        extend_start_loc = None
        if ragged_layout is not None:
            verify_lens_dev = ragged_layout.verify_lens.to(
                device=seq_lens.device, dtype=torch.int32
            )
            extend_start_loc = ragged_layout.extend_start_loc.to(
                device=seq_lens.device, dtype=torch.int32
            )
            extend_seq_lens = verify_lens_dev
            seq_lens = seq_lens + verify_lens_dev.to(seq_lens.dtype)
            # Graph path: total_verify_tokens is the padded tier; an eager
            # device-assembled layout leaves it None, so use sum(verify_lens).
            num_tokens = ragged_layout.total_verify_tokens
            if num_tokens is None:
                num_tokens = int(verify_lens_dev.sum().item())
                exact_num_tokens = True
            else:
                num_tokens = int(num_tokens)
                # Padded tier: num_tokens >= sum(verify_lens)
                exact_num_tokens = False
            extend_seq_lens_cpu = None
            seq_lens_cpu = None
        else:
            seq_lens = seq_lens + self.target_verify_num_draft_tokens
            if seq_lens_cpu is None:
                extend_seq_lens_cpu = None
                extend_seq_lens = torch.full_like(
                    seq_lens, self.target_verify_num_draft_tokens
                )
            else:
                seq_lens_cpu = [
                    x + self.target_verify_num_draft_tokens for x in seq_lens_cpu
                ]
                extend_seq_lens_cpu = [self.target_verify_num_draft_tokens] * batch_size
                extend_seq_lens = self._move_to_device(extend_seq_lens_cpu)
            num_tokens = self.target_verify_num_draft_tokens * batch_size
            exact_num_tokens = True
        if out_cache_loc is None:
            out_cache_loc = seq_lens.new_zeros(num_tokens)
        # output_size drops the implicit sum()'s D2H in the prefill-meta build.
        # EAGLE verify faults without that sync.
        exact_num_tokens = exact_num_tokens and self.is_dspark
        return self.init_forward_metadata_prefill(
            max_seq_len=max_seq_len,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=out_cache_loc,
            num_tokens=num_tokens,
            extend_seq_lens=extend_seq_lens,
            extend_seq_lens_cpu=extend_seq_lens_cpu,
            # guarded inside init_forward_metadata_prefill, not here
            need_compress=self.need_compress,
            use_prefill_cuda_graph=use_prefill_cuda_graph,
            compress_gpu_plan=seq_lens_cpu is None,
            extend_start_loc=extend_start_loc,
            attach_decode_streams=True,
            exact_num_tokens=exact_num_tokens,
            low_ratio_decode_rows=True,
        )

    def _uses_dspark_draft_window(self) -> bool:
        """Whether the V4.1 DSpark draft block takes the block-window metadata; DSv4's
        draft keeps the causal verify indices, and unified_kv addresses its ring by
        (slot, position) and keeps its own path."""
        from sglang.srt.layers.attention.dsv4.unified_kv_gate import (
            is_unified_kv_triton,
        )

        return self.is_dspark_draft and self.is_dsv41 and not is_unified_kv_triton()

    def init_forward_metadata_dspark_draft_block(
        self,
        max_seq_len: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        block_size: int,
    ) -> DSV4Metadata:
        """DSpark draft block: seq_lens are the committed prefixes, extended by
        block_size per request from the device lengths only (the worker's
        seq_lens_cpu is already extended). SWA-only."""
        assert block_size == self.target_verify_num_draft_tokens, (
            f"{block_size=} must equal the draft's target_verify_num_draft_tokens="
            f"{self.target_verify_num_draft_tokens}"
        )
        batch_size = len(seq_lens)
        num_tokens = block_size * batch_size
        assert out_cache_loc.shape[0] >= num_tokens, (
            f"{out_cache_loc.shape=} holds fewer than {num_tokens=} block slots"
        )
        seq_lens_casual, req_pool_indices_repeated = (
            self.expand_extend_with_same_length(
                bs=batch_size,
                qo_len=block_size,
                seq_lens=seq_lens + block_size,
                req_pool_indices=req_pool_indices,
            )
        )
        core_attn_metadata = self.make_core_attn_metadata(
            req_to_token=self.req_to_token,
            req_pool_indices_repeated=req_pool_indices_repeated,
            seq_lens_casual=seq_lens_casual,
            # The block may cross into the next page beyond the prefix.
            max_seq_len=max_seq_len + block_size,
            out_loc=out_cache_loc,
            need_compress=False,
            is_prefill=True,
            dspark_block_size=block_size,
            num_groups=batch_size,
        )
        return DSV4Metadata(
            core_attn_metadata,
            None,
            c4_compress_metadata=_create_dummy_paged_compress_data(compress_ratio=4),
            c128_compress_metadata=_create_dummy_paged_compress_data(
                compress_ratio=128
            ),
        )

    def make_forward_metadata_from_raw_verify(
        self, raw_metadata: DSV4RawVerifyMetadata
    ) -> DSV4Metadata:
        req_pool_indices = raw_metadata.req_pool_indices
        seq_lens = raw_metadata.seq_lens
        out_cache_loc = raw_metadata.out_cache_loc

        bs, num_draft_tokens = len(seq_lens), self.target_verify_num_draft_tokens
        seq_lens = seq_lens + num_draft_tokens
        extend_seq_lens = raw_metadata.extend_seq_lens
        if extend_seq_lens is None or extend_seq_lens.numel() != bs:
            extend_seq_lens = torch.full_like(seq_lens, num_draft_tokens)
        else:
            extend_seq_lens = extend_seq_lens.to(
                device=seq_lens.device, dtype=seq_lens.dtype
            )
        extend_seq_lens = torch.minimum(extend_seq_lens, seq_lens).clamp_min_(1)

        seq_lens_casual, req_pool_indices_repeated = (
            self.expand_extend_with_same_length(
                bs, num_draft_tokens, seq_lens, req_pool_indices
            )
        )
        need_compress = self.need_compress
        core_attn_metadata = self.make_core_attn_metadata(
            req_to_token=self.req_to_token,
            req_pool_indices_repeated=req_pool_indices_repeated,
            seq_lens_casual=seq_lens_casual,
            max_seq_len=self.MAX_SEQ_LEN_FOR_CAPTURE,
            out_loc=out_cache_loc,
            need_compress=need_compress,
            num_groups=bs,
        )
        # extend_seq_lens is uniform here (seq_lens already carries the draft
        # block, so the minimum above cannot trim it), hence an exact token count.
        self._attach_unified_kv_prefill_meta(
            core_attn_metadata,
            req_pool_indices,
            req_pool_indices_repeated,
            seq_lens,
            extend_seq_lens,
            num_draft_tokens * bs,
        )
        self._attach_unified_kv_decode_streams(
            core_attn_metadata,
            req_pool_indices_repeated,
            num_draft=self.target_verify_num_draft_tokens,
        )
        indexer_metadata = (
            self.init_forward_metadata_indexer(core_attn_metadata)
            if need_compress and self.has_c4
            else None
        )
        if not need_compress:
            create = _create_dummy_paged_compress_data
        else:
            create = functools.partial(
                create_paged_compressor_data,
                is_prefill=True,
                token_to_kv_pool=self.token_to_kv_pool,
                req_to_token=self.req_to_token,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                extend_lens=extend_seq_lens,
                seq_lens_cpu=None,
                extend_lens_cpu=None,
                use_prefill_cuda_graph=True,
                num_q_tokens=num_draft_tokens * bs,
            )
        return DSV4Metadata(
            core_attn_metadata,
            indexer_metadata,
            **self._init_low_ratio_indexer_metadata(
                core_attn_metadata, is_prefill=False
            ),
            c4_compress_metadata=(
                create(compress_ratio=4)
                if self.has_c4
                else _create_dummy_paged_compress_data(compress_ratio=4)
            ),
            c128_compress_metadata=(
                create(compress_ratio=128)
                if self.has_c128
                else _create_dummy_paged_compress_data(compress_ratio=128)
            ),
        )

    def make_forward_metadata_from_raw_decode(
        self, raw_metadata: DSV4RawDecodeMetadata
    ) -> DSV4Metadata:
        req_pool_indices = raw_metadata.req_pool_indices
        seq_lens = raw_metadata.seq_lens
        out_cache_loc = raw_metadata.out_cache_loc
        if self.topk > 0 and self.speculative_num_steps > 1:
            # Each EAGLE draft step appends one token while ForwardBatch keeps
            # the accepted-prefix lengths unchanged across the captured loop.
            seq_lens = seq_lens + self.speculative_step_id + 1

        need_compress = self.need_compress
        core_attn_metadata = self.make_core_attn_metadata(
            req_to_token=self.req_to_token,
            req_pool_indices_repeated=req_pool_indices,
            seq_lens_casual=seq_lens,
            max_seq_len=self.MAX_SEQ_LEN_FOR_CAPTURE,
            out_loc=out_cache_loc,
            need_compress=need_compress,
        )
        self._attach_unified_kv_decode_streams(core_attn_metadata, req_pool_indices)
        indexer_metadata = (
            self.init_forward_metadata_indexer(core_attn_metadata)
            if need_compress and self.has_c4
            else None
        )
        low_ratio_indexer_metadata = self._init_low_ratio_indexer_metadata(
            core_attn_metadata, is_prefill=False
        )

        if not need_compress:
            create = _create_dummy_paged_compress_data
        else:
            create = functools.partial(
                create_paged_compressor_data,
                is_prefill=False,
                token_to_kv_pool=self.token_to_kv_pool,
                req_to_token=self.req_to_token,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
            )

        return DSV4Metadata(
            core_attn_metadata,
            indexer_metadata,
            c4_compress_metadata=(
                create(compress_ratio=4)
                if self.has_c4
                else _create_dummy_paged_compress_data(compress_ratio=4)
            ),
            c128_compress_metadata=(
                create(compress_ratio=128)
                if self.has_c128
                else _create_dummy_paged_compress_data(compress_ratio=128)
            ),
            **low_ratio_indexer_metadata,
        )

    def init_forward_metadata_draft_extend(
        self,
        max_seq_len: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: Optional[List[int]],
        num_tokens_per_req: int,
        out_cache_loc: Optional[torch.Tensor] = None,
        use_prefill_cuda_graph: bool = False,
    ) -> DSV4Metadata:
        batch_size = len(seq_lens)
        extend_seq_lens_cpu = (
            [num_tokens_per_req] * batch_size if seq_lens_cpu is not None else None
        )
        extend_seq_lens = torch.full_like(seq_lens, num_tokens_per_req)
        num_tokens = num_tokens_per_req * batch_size
        if out_cache_loc is None:
            out_cache_loc = seq_lens.new_zeros(num_tokens)
        return self.init_forward_metadata_prefill(
            seq_lens=seq_lens,
            # Draft extend attends only to SWA; compressed attention never reads
            # this page-table placeholder. Match CUDA's one-page allocation.
            max_seq_len=self.page_size,
            req_pool_indices=req_pool_indices,
            seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=out_cache_loc,
            num_tokens=num_tokens,
            extend_seq_lens=extend_seq_lens,
            extend_seq_lens_cpu=extend_seq_lens_cpu,
            need_compress=False,
            use_prefill_cuda_graph=use_prefill_cuda_graph,
        )

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        # Raw metadata must be materialized inside the graph to refresh on replay.
        upgraded_verify = isinstance(self.forward_metadata, DSV4RawVerifyMetadata)
        if upgraded_verify:
            self.forward_metadata = self.make_forward_metadata_from_raw_verify(
                raw_metadata=self.forward_metadata,
            )
        elif isinstance(self.forward_metadata, DSV4RawDecodeMetadata):
            self.forward_metadata = self.make_forward_metadata_from_raw_decode(
                raw_metadata=self.forward_metadata,
            )
        elif isinstance(self.forward_metadata, DSV4RawDSparkDraftMetadata):
            raw = self.forward_metadata
            # Graph path only: the page table is sized for the capture maximum.
            self.forward_metadata = self.init_forward_metadata_dspark_draft_block(
                max_seq_len=self.MAX_SEQ_LEN_FOR_CAPTURE,
                req_pool_indices=raw.req_pool_indices,
                seq_lens=raw.seq_lens,
                out_cache_loc=raw.out_cache_loc,
                block_size=raw.block_size,
            )

        metadata = self.forward_metadata
        if isinstance(metadata, DSV4Metadata):
            # the bucket object outlives the step; a warmup's length-fold cache must not be replayed
            metadata.core_attn_metadata._aiter_sparse_masked_indices = None

        window = self.token_to_kv_pool.request_window
        if window is not None and isinstance(metadata, DSV4Metadata):
            window.activate(metadata.core_attn_metadata.request_window_layout)

        # Spec-v2 and DP padding can rebind out_cache_loc after out-graph prep;
        # capture the translation here so replay reads live locations.
        # FlashMLA requires int32 indices.
        if (
            isinstance(metadata, DSV4Metadata)
            and forward_batch.out_cache_loc is not None
            and window is None
        ):
            out_cache_loc = forward_batch.out_cache_loc
            if (
                forward_batch.forward_mode.is_decode_or_idle()
                and self.topk > 0
                and self.speculative_num_steps > 1
            ):
                # Multi-step draft decode shares one out_cache_loc buffer across
                # steps; mirror the eager init's per-step slice.
                out_cache_loc = per_step_draft_out_cache_loc(
                    out_cache_loc,
                    forward_batch.batch_size,
                    self.topk,
                    self.speculative_num_steps,
                )[self.speculative_step_id]
            metadata.core_attn_metadata.swa_out_cache_loc = (
                self.token_to_kv_pool.translate_loc_from_full_to_swa(out_cache_loc).to(
                    torch.int32
                )
            )

        if self._fp4_workspaces_enabled(metadata):
            from sglang.kernels.ops.attention.dsv4.fp4_indexer_hip import (
                prepare_fp4_k_write_metadata,
            )

            metadata.fp4_k_write_metadata = prepare_fp4_k_write_metadata(
                metadata.c4_compress_metadata,
                metadata.core_attn_metadata.c4_out_loc,
                self.MAX_SEQ_LEN_FOR_CAPTURE,
            )
            metadata.fp4_q_positions = metadata.core_attn_metadata.positions.to(
                torch.int64
            )

        if upgraded_verify:
            # The out-graph refresh saw raw metadata and skipped; otherwise the
            # logits kernel builds a schedule that frees scratch replays re-read.
            self._refresh_fp4_prefill_workspace(forward_batch)
        # target-verify rows are one token each, so they take the decode indexer's inputs
        one_token_rows = (
            forward_batch.forward_mode.is_decode()
            or forward_batch.forward_mode.is_target_verify()
        )
        if (
            isinstance(metadata, DSV4Metadata)
            and metadata.core_metadata.low_ratios
            and one_token_rows
        ):
            if (
                forward_batch.forward_mode.is_decode()
                and forward_batch.positions.is_cuda
                and forward_batch.req_pool_indices.shape
                == forward_batch.positions.shape
            ):
                # both widenings in one launch
                metadata.low_ratio_req_indices, metadata.low_ratio_pos_i64 = (
                    widen_pair_i64(
                        forward_batch.req_pool_indices, forward_batch.positions
                    )
                )
            else:
                metadata.low_ratio_req_indices = token_req_indices(forward_batch)
                metadata.low_ratio_pos_i64 = forward_batch.positions.to(torch.int64)
            # same capture-safe workspace contract as the c4 ones below
            metadata.fp4_low_ratio_decode_workspaces = (
                build_low_ratio_decode_workspaces(
                    {
                        ratio: indexer_metadata
                        for ratio, indexer_metadata in (
                            metadata.low_ratio_indexer_metadata_by_ratio().items()
                        )
                        # Identity rows are not scored, so they need no schedule.
                        if not low_ratio_decode_rows_are_identity(
                            self, forward_batch, ratio
                        )
                        and not is_metadata_unread(
                            self.model_runner.model,
                            forward_batch,
                            StepMetadata.LOW_RATIO_DECODE_SCHEDULE,
                        )
                    },
                    max_context_len=self.max_context_len,
                    num_requests=forward_batch.batch_size,
                    page8_ratios=self.token_to_kv_pool.low_ratio_index_k_page8_ratios(),
                )
            )

        # Decode's schedule builder is capture-safe (the workspace pins its scratch);
        # prefill/target-verify's is not, see _refresh_fp4_prefill_workspace. The
        # row-group workspace has no schedule, so target-verify builds it here too.
        rowgroup_rows = self._fp4_c4_rowgroup_rows(metadata, forward_batch)
        if rowgroup_rows is not None:
            from sglang.kernels.ops.attention.dsv4.fp4_indexer_hip import (
                prepare_fp4_rowgroup_decode_workspace,
            )

            metadata.fp4_decode_workspace = prepare_fp4_rowgroup_decode_workspace(
                metadata.indexer_metadata.page_table,
                rowgroup_rows,
                table_columns=self._fp4_c4_rowgroup_columns,
                min_grouped_seqs=1,
            )
        elif self._fp4_workspaces_enabled(metadata) and (
            forward_batch.forward_mode.is_decode()
        ):
            from sglang.kernels.ops.attention.dsv4.fp4_indexer_hip import (
                prepare_fp4_decode_workspace,
            )

            indexer_metadata = metadata.indexer_metadata
            metadata.fp4_decode_workspace = prepare_fp4_decode_workspace(
                indexer_metadata.page_table,
                indexer_metadata.compressed_seq_lens,
            )

    def _fp4_workspaces_enabled(self, metadata) -> bool:
        return (
            self.enable_deepseek_v4_fp4_indexer
            # Draft-step backends drive the NextN layer, built with
            # compress_ratio_override=0, so it owns no C4 indexer.
            and self.speculative_num_steps == 0
            and isinstance(metadata, DSV4Metadata)
            and metadata.indexer_metadata is not None
            and metadata.c4_compress_metadata is not None
        )

    def _fp4_c4_rowgroup_rows(
        self, metadata, forward_batch: ForwardBatch
    ) -> Optional[int]:
        """Rows a request scores as one sequence on the row-group kernel this step: 1 for
        decode, the draft rows for a target-verify of at least C4_ROWGROUP_MIN_VERIFY_ROWS
        rows (below it the prefill kernel's schedule spreads a few requests' keys wider).
        None keeps the schedule kernels, as does a verify whose logits outgrow the prefill
        budget (the row-group launch is unchunked).
        """
        if self._fp4_c4_rowgroup_columns is None or not self._fp4_workspaces_enabled(
            metadata
        ):
            return None
        mode = forward_batch.forward_mode
        if mode.is_decode():
            return 1
        if not mode.is_target_verify():
            return None
        from sglang.kernels.ops.attention.dsv4.fp4_indexer_hip import (
            C4_ROWGROUP_MIN_VERIFY_ROWS,
            logits_rows_per_chunk,
        )

        page_table = metadata.indexer_metadata.page_table
        rows, num_draft = page_table.shape[0], self.target_verify_num_draft_tokens
        if (
            num_draft < 2
            or rows != num_draft * forward_batch.batch_size
            or rows < C4_ROWGROUP_MIN_VERIFY_ROWS
            or rows > logits_rows_per_chunk(page_table)
        ):
            return None
        return num_draft

    def _refresh_fp4_prefill_workspace(
        self, forward_batch: ForwardBatch, metadata: Optional[DSV4Metadata] = None
    ) -> None:
        """Must run outside graph capture: AITER's scheduler frees the scratch its
        kernel reads, so only the pinned buffers it fills may be read from a graph."""
        if metadata is None:
            metadata = self.forward_metadata
        if (
            isinstance(metadata, DSV4Metadata)
            and metadata.core_metadata.low_ratios
            and forward_batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED)
            and not torch.cuda.is_current_stream_capturing()
        ):
            metadata.fp4_low_ratio_prefill_workspaces = (
                refresh_low_ratio_prefill_workspaces(
                    metadata.low_ratio_indexer_metadata_by_ratio(),
                    metadata.fp4_low_ratio_prefill_workspaces,
                    extend_lens=(
                        metadata.late_layer_tail.extend_seq_lens_cpu
                        if metadata.late_layer_tail is not None
                        else _as_int_list(forward_batch.extend_seq_lens_cpu)
                    ),
                    max_context_len=self.max_context_len,
                    page8_ratios=self.token_to_kv_pool.low_ratio_index_k_page8_ratios(),
                )
            )
        if not self._fp4_workspaces_enabled(metadata):
            return
        if forward_batch.forward_mode not in (
            ForwardMode.EXTEND,
            ForwardMode.MIXED,
            ForwardMode.TARGET_VERIFY,
        ):
            return
        if self._fp4_c4_rowgroup_rows(metadata, forward_batch) is not None:
            # scored on the row-group kernel, its workspace built with the metadata
            return
        if (
            get_parallel().attn_cp_size != 1
            or getattr(forward_batch, "tbo_children", None)
            or getattr(forward_batch, "tbo_parent_token_range", None) is not None
        ):
            return

        from sglang.kernels.ops.attention.dsv4.fp4_indexer_hip import (
            prepare_fp4_prefill_workspace,
        )

        indexer_metadata = metadata.indexer_metadata
        metadata.fp4_prefill_workspace = prepare_fp4_prefill_workspace(
            indexer_metadata.page_table,
            indexer_metadata.compressed_seq_lens,
            workspace=metadata.fp4_prefill_workspace,
        )

    def init_forward_metadata_out_graph(
        self,
        forward_batch: ForwardBatch,
        in_capture: bool = False,
    ) -> None:
        bucket = _GraphBucket.of(forward_batch.forward_mode)
        bs = forward_batch.batch_size
        req_pool_indices = forward_batch.req_pool_indices
        seq_lens = forward_batch.seq_lens

        if in_capture:
            assert req_pool_indices.size(0) == bs
            assert seq_lens.size(0) == bs
            num_tokens = forward_batch.positions.numel()
            if bucket == _GraphBucket.DECODE_OR_IDLE:
                out_cache_loc = torch.zeros_like(seq_lens)
            elif bucket == _GraphBucket.TARGET_VERIFY:
                out_cache_loc = torch.zeros(num_tokens, **self.cuda_int32_kwargs)
            else:
                out_cache_loc = None
            actual_forward_mode = forward_batch.forward_mode
            seq_lens_cpu = seq_lens.cpu() if self.needs_cpu_seq_lens else None
        else:
            out_cache_loc = forward_batch.out_cache_loc
            actual_forward_mode = getattr(
                forward_batch, "actual_forward_mode", forward_batch.forward_mode
            )
            seq_lens_cpu = forward_batch.seq_lens_cpu

        if actual_forward_mode == ForwardMode.IDLE:
            logger.debug(
                f"[IDLE replay] bs={bs}, "
                f"local_seq_lens_len={len(seq_lens)}, "
                f"has_graph={bs in self.cuda_graph_metadata_of_bucket_and_bs[_GraphBucket.DECODE_OR_IDLE]}"
            )
            device = seq_lens.device
            seq_lens = torch.ones(bs, dtype=seq_lens.dtype, device=device)
            seq_lens_cpu = torch.ones(bs, dtype=torch.int64)
            req_pool_indices = torch.zeros(
                bs, dtype=req_pool_indices.dtype, device=device
            )
            out_cache_loc = torch.zeros(bs, dtype=torch.int64, device=device)

        seq_lens = seq_lens[:bs]
        req_pool_indices = req_pool_indices[:bs]
        chosen_max_seq_len = self.MAX_SEQ_LEN_FOR_CAPTURE
        if seq_lens_cpu is not None:
            seq_lens_cpu = seq_lens_cpu[:bs]
            assert seq_lens_cpu.max().item() <= chosen_max_seq_len

        graph_key = bs

        if bucket == _GraphBucket.DECODE_OR_IDLE:
            assert out_cache_loc is not None
            assert len(out_cache_loc.shape) == 1, f"{out_cache_loc.shape=}"
            out_cache_loc_padded = torch.nn.functional.pad(
                out_cache_loc,
                pad=(0, bs - len(out_cache_loc)),
                mode="constant",
                value=0,
            )
            temp_metadata = self.init_forward_metadata_decode(
                max_seq_len=chosen_max_seq_len,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                out_cache_loc=out_cache_loc_padded,
            )
        elif bucket == _GraphBucket.TARGET_VERIFY and self._uses_dspark_draft_window():
            assert out_cache_loc is not None
            block_size = self.target_verify_num_draft_tokens
            num_tokens_v = block_size * bs
            out_cache_loc_padded = F.pad(
                out_cache_loc,
                pad=(0, num_tokens_v - len(out_cache_loc)),
                mode="constant",
                value=0,
            )
            if _DSPARK_DRAFT_RAW_METADATA:
                temp_metadata = DSV4RawDSparkDraftMetadata(
                    req_pool_indices=req_pool_indices,
                    seq_lens=seq_lens,
                    out_cache_loc=out_cache_loc_padded,
                    block_size=block_size,
                )
            else:
                temp_metadata = self.init_forward_metadata_dspark_draft_block(
                    max_seq_len=chosen_max_seq_len,
                    req_pool_indices=req_pool_indices,
                    seq_lens=seq_lens,
                    out_cache_loc=out_cache_loc_padded,
                    block_size=block_size,
                )
        elif bucket == _GraphBucket.TARGET_VERIFY:
            assert out_cache_loc is not None
            ragged_layout = resolve_ragged_verify_layout(forward_batch)
            if ragged_layout is not None:
                ragged_layout = ragged_layout.padded_to_bucket(padded_bs=bs)
                num_tokens_v = ragged_layout.graph_num_tokens
                graph_key = num_tokens_v
            else:
                num_tokens_v = self.target_verify_num_draft_tokens * bs
            out_cache_loc_padded = torch.nn.functional.pad(
                out_cache_loc,
                pad=(0, num_tokens_v - len(out_cache_loc)),
                mode="constant",
                value=0,
            )
            temp_metadata = self.init_forward_metadata_target_verify(
                max_seq_len=chosen_max_seq_len,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                out_cache_loc=out_cache_loc_padded,
                use_prefill_cuda_graph=True,
                # CPU mirror already available here (== seq_lens, no D2H);
                # pass it so target_verify skips the per-iter seq_lens.tolist() sync.
                seq_lens_cpu=(
                    seq_lens_cpu.tolist() if seq_lens_cpu is not None else None
                ),
                ragged_layout=ragged_layout,
            )
        elif bucket == _GraphBucket.DRAFT_EXTEND:
            num_tokens_per_req = self.draft_extend_num_tokens_per_req
            if out_cache_loc is not None:
                # Pad the real write locations to the captured token count so
                # raw_out_loc reflects the actual replay out_cache_loc.
                out_cache_loc = torch.nn.functional.pad(
                    out_cache_loc,
                    pad=(0, num_tokens_per_req * bs - len(out_cache_loc)),
                    mode="constant",
                    value=0,
                )
            temp_metadata = self.init_forward_metadata_draft_extend(
                max_seq_len=chosen_max_seq_len,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                seq_lens_cpu=(
                    seq_lens_cpu.tolist() if seq_lens_cpu is not None else None
                ),
                num_tokens_per_req=num_tokens_per_req,
                out_cache_loc=out_cache_loc,
                use_prefill_cuda_graph=True,
            )
        else:
            raise NotImplementedError

        self.replay_cuda_graph_metadata_from(
            bs=graph_key, temp_metadata=temp_metadata, bucket=bucket
        )
        self._refresh_fp4_prefill_workspace(forward_batch)

        if in_capture:
            metadata = self.forward_metadata
            self._current_capture_raw = (
                metadata
                if isinstance(
                    metadata,
                    (
                        DSV4RawDecodeMetadata,
                        DSV4RawVerifyMetadata,
                        DSV4RawDSparkDraftMetadata,
                    ),
                )
                else None
            )

    def _build_forward_metadata(
        self,
        forward_batch: ForwardBatch,
        *,
        max_seq_len_override: Optional[int] = None,
        use_prefill_cuda_graph: bool = False,
    ):
        self.encoder_replay = forward_batch.encoder_swa_replay
        req_pool_indices = forward_batch.req_pool_indices
        seq_lens = forward_batch.seq_lens.to(torch.int32)
        seq_lens_cpu = forward_batch.seq_lens_cpu
        assert self.req_to_token_pool.req_to_token is self.req_to_token

        assert self.page_size % 128 == 0
        if max_seq_len_override is not None:
            max_seq_len = max_seq_len_override
        elif seq_lens_cpu is not None:
            max_seq_len = int(seq_lens_cpu.max().item())
        else:
            # an eager DSpark verify under the overlap scheduler has device lengths only
            max_seq_len = (
                getattr(
                    forward_batch.spec_info, "candidate_max_seq_len_upper_bound", None
                )
                or self.MAX_SEQ_LEN_FOR_CAPTURE
            )

        if forward_batch.forward_mode.is_decode_or_idle():
            # DSv4 bakes this step's KV write target (c4/c128) into metadata,
            # so slice the shared multi-step out_cache_loc now, not at forward time.
            out_cache_loc = forward_batch.out_cache_loc
            if self.topk > 0 and self.speculative_num_steps > 1:
                out_cache_loc = per_step_draft_out_cache_loc(
                    out_cache_loc,
                    forward_batch.batch_size,
                    self.topk,
                    self.speculative_num_steps,
                )[self.speculative_step_id]
            metadata = self.init_forward_metadata_decode(
                max_seq_len=max_seq_len,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                out_cache_loc=out_cache_loc,
            )
        elif (
            forward_batch.forward_mode.is_target_verify()
            and self._uses_dspark_draft_window()
        ):
            metadata = self.init_forward_metadata_dspark_draft_block(
                max_seq_len=max_seq_len,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                out_cache_loc=forward_batch.out_cache_loc,
                block_size=int(forward_batch.spec_info.draft_token_num),
            )
        elif forward_batch.forward_mode.is_target_verify():
            ragged_layout = resolve_ragged_verify_layout(forward_batch)
            metadata = self.init_forward_metadata_target_verify(
                max_seq_len=max_seq_len,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                out_cache_loc=forward_batch.out_cache_loc,
                extend_seq_lens=forward_batch.extend_seq_lens,
                seq_lens_cpu=(
                    seq_lens_cpu.tolist() if seq_lens_cpu is not None else None
                ),
                ragged_layout=ragged_layout,
            )
        elif forward_batch.forward_mode.is_draft_extend_v2():
            metadata = self.init_forward_metadata_draft_extend(
                max_seq_len=max_seq_len,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                seq_lens_cpu=(
                    seq_lens_cpu.tolist() if seq_lens_cpu is not None else None
                ),
                num_tokens_per_req=self.speculative_num_draft_tokens,
                out_cache_loc=forward_batch.out_cache_loc,
            )
        elif forward_batch.forward_mode.is_prefill():
            metadata = self._init_forward_metadata_prefill_from_batch(
                forward_batch,
                max_seq_len=max_seq_len,
                req_pool_indices=req_pool_indices,
                seq_lens=seq_lens,
                seq_lens_cpu=seq_lens_cpu,
                use_prefill_cuda_graph=use_prefill_cuda_graph,
            )
        else:
            raise NotImplementedError(f"unsupported mode {forward_batch.forward_mode=}")

        return metadata

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if self.mtp_enabled and forward_batch.forward_mode.is_idle():
            return

        self._opus_prefill_state = None
        self.forward_metadata = self._build_forward_metadata(forward_batch)
        self.init_forward_metadata_in_graph(forward_batch)
        self._refresh_fp4_prefill_workspace(forward_batch)
        self.tail_forward_metadata = (
            self._build_late_layer_tail_metadata(forward_batch)
            if self.enable_decoder_swa_bounded_replay
            and not self.is_draft_worker
            and forward_batch.forward_mode.is_extend_without_speculative()
            else None
        )

    def late_layer_num_tokens(self, forward_batch: ForwardBatch) -> Optional[int]:
        if not self.enable_decoder_swa_bounded_replay or self.is_draft_worker:
            return None
        return late_layer_num_tokens(forward_batch, dspark=self.is_dspark)

    def _init_forward_metadata_prefill_from_batch(
        self,
        forward_batch: ForwardBatch,
        *,
        max_seq_len: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        use_prefill_cuda_graph: bool = False,
    ) -> DSV4Metadata:
        extend_seq_lens_cpu = forward_batch.extend_seq_lens_cpu
        extend_seq_lens = forward_batch.extend_seq_lens
        assert (
            seq_lens is not None
            and seq_lens_cpu is not None
            and extend_seq_lens is not None
            and extend_seq_lens_cpu is not None
        )
        is_draft = (
            forward_batch.forward_mode.is_draft_extend_v2() or self.is_draft_worker
        )
        return self.init_forward_metadata_prefill(
            max_seq_len=max_seq_len,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu.tolist(),
            out_cache_loc=forward_batch.out_cache_loc,
            num_tokens=sum(extend_seq_lens_cpu),
            extend_seq_lens=extend_seq_lens,
            extend_seq_lens_cpu=extend_seq_lens_cpu,
            extend_start_loc=forward_batch.extend_start_loc,
            need_compress=not is_draft,
            use_prefill_cuda_graph=use_prefill_cuda_graph,
            exact_num_tokens=is_draft,
            forward_batch=forward_batch,
        )

    # ---- decoder SWA bounded replay ---------------------------------------

    def _build_late_layer_tail_metadata(
        self, forward_batch: ForwardBatch
    ) -> DSV4Metadata:
        """Metadata for the layers after the last kv_source layer under decoder SWA bounded
        replay: each request's last SWA_WINDOW extend tokens, or its whole extend
        when it reads prompt rows (late_layer_whole_extend)."""
        extend_lens_cpu = forward_batch.extend_seq_lens_cpu
        seq_lens_cpu = forward_batch.seq_lens_cpu
        assert extend_lens_cpu is not None and seq_lens_cpu is not None
        device = forward_batch.out_cache_loc.device
        token_indices, tail_lens_cpu, swa_replay_start = late_layer_tail_layout(
            extend_lens_cpu=extend_lens_cpu,
            seq_lens_cpu=seq_lens_cpu.tolist(),
            tail_len=SWA_WINDOW,
            device=device,
            whole_extend=late_layer_whole_extend(forward_batch, dspark=self.is_dspark),
        )
        contiguous_start = (
            extend_lens_cpu[0] - tail_lens_cpu[0] if len(extend_lens_cpu) == 1 else None
        )
        out_cache_loc = _tail_rows(
            forward_batch.out_cache_loc,
            token_indices=token_indices,
            contiguous_start=contiguous_start,
        )
        tail_lens = torch.tensor(tail_lens_cpu, dtype=torch.int32, device=device)
        num_tokens = sum(tail_lens_cpu)
        metadata = self.init_forward_metadata_prefill(
            max_seq_len=int(seq_lens_cpu.max().item()),
            req_pool_indices=forward_batch.req_pool_indices,
            seq_lens=forward_batch.seq_lens.to(torch.int32),
            seq_lens_cpu=seq_lens_cpu.tolist(),
            out_cache_loc=out_cache_loc,
            num_tokens=num_tokens,
            extend_seq_lens=tail_lens,
            extend_seq_lens_cpu=tail_lens_cpu,
            extend_start_loc=torch.cumsum(tail_lens, dim=0) - tail_lens,
            swa_replay_start=swa_replay_start,
        )
        request_layout = metadata.core_attn_metadata.request_window_layout
        swa_out_cache_loc = (
            request_layout.write_loc
            if request_layout is not None
            else self.token_to_kv_pool.translate_loc_from_full_to_swa(out_cache_loc).to(
                torch.int32
            )
        )
        metadata.core_attn_metadata.swa_out_cache_loc = swa_out_cache_loc
        metadata.low_ratio_req_indices = torch.repeat_interleave(
            forward_batch.req_pool_indices.to(torch.int64),
            tail_lens.to(torch.int64),
            output_size=num_tokens,
        )
        positions = _tail_rows(
            forward_batch.positions,
            token_indices=token_indices,
            contiguous_start=contiguous_start,
        )
        metadata.low_ratio_pos_i64 = positions.to(torch.int64)
        metadata.late_layer_tail = LateLayerTail(
            token_indices=token_indices,
            positions=positions,
            extend_seq_lens=tail_lens,
            extend_seq_lens_cpu=tail_lens_cpu,
            swa_out_cache_loc=swa_out_cache_loc,
            contiguous_start=contiguous_start,
        )
        self._refresh_fp4_prefill_workspace(forward_batch, metadata)
        return metadata

    def enter_late_layer_tail(self, forward_batch: ForwardBatch) -> tuple:
        """Switch the late layers onto the tail metadata; exit_late_layer_tail takes the
        return value. The source layer runs inside the tail and publishes its top-k and
        candidates on the tail rows, so nothing is carried over from the full rows."""
        assert self.tail_source_kv_layer_id is not None, (
            "write_tail_source_kv must run before enter_late_layer_tail"
        )
        tail_metadata = self.tail_forward_metadata
        assert tail_metadata is not None, "no tail metadata for this forward"
        saved = (self.forward_metadata, self.candidate_masks)
        self.forward_metadata = tail_metadata
        window = self.token_to_kv_pool.request_window
        if window is not None:
            window.activate(tail_metadata.core_attn_metadata.request_window_layout)
        return saved

    def exit_late_layer_tail(self, saved: tuple, forward_batch: ForwardBatch) -> None:
        self.forward_metadata, self.candidate_masks = saved
        self.tail_source_kv_layer_id = None
        window = self.token_to_kv_pool.request_window
        if window is not None:
            window.activate(
                self.forward_metadata.core_attn_metadata.request_window_layout
            )

    # ---- breakable prefill CUDA graphs -----------------------------------
    # only the fused KV store is recorded in a segment, and it reads the SWA store target by address

    def _prefill_metadata_for_batch(
        self,
        forward_batch: ForwardBatch,
        *,
        max_seq_len_override: Optional[int] = None,
    ) -> DSV4Metadata:
        """The eager prefill build, for a capture batch or a live replay batch."""
        seq_lens_cpu = forward_batch.seq_lens_cpu
        assert seq_lens_cpu is not None
        actual_max_seq_len = int(seq_lens_cpu.max().item())
        if max_seq_len_override is None:
            max_seq_len_override = forward_batch.max_seq_len_override
        max_seq_len = (
            actual_max_seq_len if max_seq_len_override is None else max_seq_len_override
        )
        if actual_max_seq_len > max_seq_len:
            raise ValueError(
                "Prefill CUDA graph max context size is smaller than the "
                f"live context: {max_seq_len=} < {actual_max_seq_len=}"
            )
        return self._init_forward_metadata_prefill_from_batch(
            forward_batch,
            max_seq_len=max_seq_len,
            req_pool_indices=forward_batch.req_pool_indices,
            seq_lens=forward_batch.seq_lens.to(torch.int32),
            seq_lens_cpu=seq_lens_cpu,
        )

    @property
    def prefill_cuda_graph_default_max_seq_len(self) -> Optional[int]:
        if self.low_ratios != (1, 2) or get_parallel().attn_cp_size > 1:
            return None
        return _PREFILL_GRAPH_DEFAULT_MAX_SEQ_LEN

    def _graph_metadata_max_seq_len(self, forward_batch: ForwardBatch) -> Optional[int]:
        """
        Capture and replay build the metadata at this fixed context length, so a
        replay's metadata is never larger than the captured one. Longer contexts run
        eager.
        """
        return forward_batch.max_seq_len_override or self._prefill_graph_seq_limit()

    def init_forward_metadata_for_breakable_cuda_graph_capture(
        self, forward_batch: ForwardBatch
    ) -> DSV4Metadata:
        self._opus_prefill_state = None
        if not self.low_ratios:
            self.forward_metadata = self._build_forward_metadata(
                forward_batch,
                max_seq_len_override=self.MAX_SEQ_LEN_FOR_CAPTURE,
                use_prefill_cuda_graph=True,
            )
            self.init_forward_metadata_in_graph(forward_batch)
            self._refresh_fp4_prefill_workspace(forward_batch)
            assert isinstance(self.forward_metadata, DSV4Metadata)
            return self.forward_metadata
        from sglang.srt.layers.attention.dsv4.unified_kv_gate import (
            is_unified_kv_triton,
        )

        if is_unified_kv_triton():
            raise NotImplementedError(
                "breakable prefill CUDA graphs on HIP need the flash_mla attention "
                "path: the unified_kv prefill runs attention without the graph break"
            )
        if self.has_c4 or self.has_c128:
            raise NotImplementedError(
                "breakable prefill CUDA graphs on HIP support only the DeepSeek-V4.1 layout "
                "(ratios 1 / 2); the c4 / c128 metadata is not pinned for the captured segments"
            )
        if get_parallel().attn_cp_size != 1:
            raise NotImplementedError(
                "breakable prefill CUDA graphs on HIP do not support attention CP"
            )
        assert forward_batch.forward_mode.is_extend(), forward_batch.forward_mode
        max_seq_len = self._graph_metadata_max_seq_len(forward_batch)
        metadata = self._prefill_metadata_for_batch(
            forward_batch, max_seq_len_override=max_seq_len
        )
        self.forward_metadata = metadata
        # the captured store kernels bind this target's address
        self.init_forward_metadata_in_graph(forward_batch)
        self._refresh_fp4_prefill_workspace(forward_batch)
        return metadata

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(
        self,
        capture_metadata,
        forward_batch: ForwardBatch,
        *,
        static_forward_batch: Optional[ForwardBatch] = None,
    ) -> None:
        self._opus_prefill_state = None
        if not self.low_ratios:
            replay_batch = (
                static_forward_batch
                if static_forward_batch is not None
                else forward_batch
            )
            replay_metadata = self._build_forward_metadata(
                replay_batch,
                max_seq_len_override=self.MAX_SEQ_LEN_FOR_CAPTURE,
                use_prefill_cuda_graph=True,
            )
            self.forward_metadata = replay_metadata
            self.init_forward_metadata_in_graph(replay_batch)

            assert isinstance(capture_metadata, DSV4Metadata)
            assert isinstance(replay_metadata, DSV4Metadata)
            capture_metadata.refresh_for_breakable_cuda_graph_replay_(replay_metadata)
            self.forward_metadata = capture_metadata
            self._refresh_fp4_prefill_workspace(replay_batch)
            return
        assert isinstance(capture_metadata, DSV4Metadata), type(capture_metadata)
        if static_forward_batch is None:
            static_forward_batch = forward_batch
        # break-time consumers read the live batch's eager build; the padded loc feeds only the target
        max_seq_len = self._graph_metadata_max_seq_len(static_forward_batch)
        live = self._prefill_metadata_for_batch(
            forward_batch, max_seq_len_override=max_seq_len
        )
        self.forward_metadata = live
        self.init_forward_metadata_in_graph(static_forward_batch)
        self._refresh_fp4_prefill_workspace(forward_batch)
        capture_metadata.refresh_for_breakable_cuda_graph_replay_(live)
        self.forward_metadata = capture_metadata

    @property
    def verify_mask(self) -> Optional[VerifyMask]:
        return self._verify_mask

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        # verify metadata never reads the tree mask, so EAGLE builds it QLEN_ONLY
        self._verify_mask = maybe_create_verify_mask(
            is_draft_runner=self.is_draft_worker,
            skip_prefill=False,
            max_bs=max_bs,
            max_context_len=self.max_context_len,
            num_draft_tokens=self.speculative_num_draft_tokens,
            device=self.device,
            is_read=False,
        )
        self.cuda_graph_metadata_of_bucket_and_bs: Dict[
            _GraphBucket,
            Dict[
                int,
                Union[
                    DSV4Metadata,
                    DSV4RawDecodeMetadata,
                    DSV4RawVerifyMetadata,
                ],
            ],
        ] = {bucket: {} for bucket in _GraphBucket}
        self.draft_extend_num_tokens_per_req = (
            max_num_tokens // max_bs if max_bs > 0 else 1
        )

    def replay_cuda_graph_metadata_from(
        self,
        bs: int,
        temp_metadata: Union[
            DSV4Metadata,
            DSV4RawVerifyMetadata,
            DSV4RawDecodeMetadata,
            DSV4RawDSparkDraftMetadata,
        ],
        bucket: _GraphBucket,
    ) -> None:
        if bs not in self.cuda_graph_metadata_of_bucket_and_bs[bucket]:
            # First call (from capture): store the new metadata directly.
            self.cuda_graph_metadata_of_bucket_and_bs[bucket][bs] = temp_metadata
            self.forward_metadata = temp_metadata
            return
        chosen_metadata = self.cuda_graph_metadata_of_bucket_and_bs[bucket][bs]
        chosen_metadata.copy_(temp_metadata)
        self.forward_metadata = chosen_metadata

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def on_after_cuda_graph_warmup(self):
        metadata = self.forward_metadata
        if isinstance(metadata, DSV4Metadata) and isinstance(
            metadata.core_attn_metadata, DSV4AttnMetadata
        ):
            core = metadata.core_attn_metadata
            core.c0_flashmla_metadata = _create_flashmla_metadata()
            core.c4_flashmla_metadata = _create_flashmla_metadata()
            core.c128_flashmla_metadata = _create_flashmla_metadata()
            if 1 in core.low_ratios:
                core.c1_flashmla_metadata = _create_flashmla_metadata()
            if 2 in core.low_ratios:
                core.c2_flashmla_metadata = _create_flashmla_metadata()

        # Warmup upgraded raw->full on the host;
        # restore raw so capture re-runs the upgrade inside the graph.
        current_raw = getattr(self, "_current_capture_raw", None)
        if current_raw is not None:
            self.forward_metadata = current_raw

    def _init_fp8_asm_decode_plan(self) -> None:
        """fp8 unified_kv asm decode: per-stream KV bound for the split plan
        and, at init (outside capture, before warmup), the constant split
        table and the HCA persistent workspace."""
        from sglang.srt.layers.attention.dsv4.unified_kv_gate import (
            is_unified_kv_fp8,
        )

        if self.is_draft_worker or not is_unified_kv_fp8():
            return
        from sglang.kernels.ops.attention.dsv4.unified_kv_kernels import runtime

        win = self.token_to_kv_pool.unified_swa_window
        ctx = min(
            envs.SGLANG_DSV4_FP8_DECODE_SPLIT_CTX.get() or self.max_context_len,
            self.max_context_len,
        )
        # longest KV one decode row of each stream can see
        self._fp8_split_kv_hint = {
            0: win,
            4: win + self.index_topk,
            128: win + ctx // 128,
        }
        if envs.SGLANG_DSV4_FP8_DECODE_SPLIT_MODEL.get():
            runtime.fp8_decode_split_table(self.device)
        if runtime.prepare_fp8_hca_persist(self.device, self._fp8_decode_num_heads):
            logger.info(
                "DSV4 fp8 decode: HCA layers on the persistent asm kernel "
                f"(rows >= {envs.SGLANG_DSV4_FP8_HCA_PERSIST_MIN_ROWS.get()})"
            )

    def _attach_unified_kv_decode_streams(
        self,
        core: DSV4AttnMetadata,
        state_slot: torch.Tensor,
        num_draft: int = 0,
    ) -> None:
        # state_slot maps each query token to its request slot;
        # target-verify repeats request slots for the draft tokens.
        from sglang.srt.layers.attention.dsv4.unified_kv_gate import (
            is_unified_kv_fp8,
            is_unified_kv_triton,
        )

        if not is_unified_kv_triton():
            return
        from sglang.kernels.ops.attention.dsv4.unified_kv_kernels import runtime

        pool = self.token_to_kv_pool
        N = core.positions_casual.shape[0]
        state_slot = state_slot[:N]
        if core.unified is None:
            core.unified = UnifiedKvMetadata()
        swa_len = core.swa_topk_lengths
        hca_len = core.c128_topk_lengths_raw
        csa_len = core.c4_sparse_topk_lengths_raw
        hca_page_indices = core.c128_page_indices
        c4_page_indices = core.c4_sparse_page_indices
        # A draft pool carries no c4/c128 metadata, but its verify store still
        # reads the swa half below, so build these with an empty compressed tail.
        if hca_len is None:
            hca_len = torch.zeros_like(swa_len)
        if csa_len is None:
            csa_len = torch.zeros_like(swa_len)
        if hca_page_indices is None:
            hca_page_indices = torch.empty(
                (N, 0), dtype=torch.int32, device=swa_len.device
            )
        (
            core.unified.swa_indices,
            core.unified.swa_indptr,
            core.unified.hca_indices,
            core.unified.hca_indptr,
            core.unified.csa_indices,
            core.unified.csa_indptr,
        ) = runtime.build_decode_streams(
            state_slot=state_slot,
            positions=core.positions_casual,
            swa_len=swa_len,
            hca_len=hca_len,
            csa_len=csa_len,
            hca_page_indices=hca_page_indices,
            csa_width=0 if c4_page_indices is None else c4_page_indices.shape[1],
            win=pool.unified_swa_window,
            ring_stride=pool.unified_swa_ring_size,
            swa_pages=pool.unified_swa_pages,
        )
        core.unified.gasm_indices = None
        core.unified.gasm_kv_indptr = None
        core.unified.gasm_qo_indptr = None
        if (
            _grouped_asm_enabled()
            and num_draft > 1
            and N % num_draft == 0
            and N // num_draft >= _GROUPED_ASM_MIN_REQS
        ):
            from sglang.kernels.ops.attention.dsv4.unified_kv_kernels import (
                grouped_verify_streams,
            )

            (
                core.unified.gasm_indices,
                core.unified.gasm_kv_indptr,
                core.unified.gasm_qo_indptr,
            ) = grouped_verify_streams.build_grouped_verify_streams(
                state_slot=state_slot,
                positions=core.positions_casual,
                hca_len=hca_len,
                hca_page_indices=hca_page_indices,
                win=pool.unified_swa_window,
                ring_stride=pool.unified_swa_ring_size,
                swa_pages=pool.unified_swa_pages,
                num_draft=num_draft,
                block_q=_GROUPED_ASM_BLOCK_Q,
            )

        u = core.unified
        u.grp_qo_indptr = None
        u.grp_hca_indices = u.grp_hca_indptr = u.grp_hca_bounds = None
        u.grp_swa_indices = u.grp_swa_indptr = u.grp_swa_bounds = None
        num_reqs = N // num_draft if num_draft > 1 and N % num_draft == 0 else 0
        if self.is_dspark and num_reqs and is_unified_kv_fp8():
            grouped = functools.partial(
                runtime.build_grouped_verify_streams,
                state_slot,
                core.positions_casual,
                num_draft=num_draft,
                win=pool.unified_swa_window,
                ring_stride=pool.unified_swa_ring_size,
                swa_pages=pool.unified_swa_pages,
            )
            pays = functools.partial(
                runtime.flydsl_grouped_verify_pays,
                self._fp8_decode_num_heads,
                num_draft,
                num_reqs,
                epi=self._fp8_verify_epi,
            )
            if pays(128):
                (
                    u.grp_hca_indices,
                    u.grp_hca_indptr,
                    u.grp_qo_indptr,
                    u.grp_hca_bounds,
                ) = grouped(hca_len, hca_page_indices)
            if pays(0):
                (
                    u.grp_swa_indices,
                    u.grp_swa_indptr,
                    u.grp_qo_indptr,
                    u.grp_swa_bounds,
                ) = grouped(None, None)

        # SWA ring write target, same value for every layer this forward.
        req_slot = state_slot.to(torch.int64)
        core.unified.swa_loc = (
            req_slot * pool.unified_swa_ring_size
            + core.positions_casual.to(torch.int64) % pool.unified_swa_ring_size
        ).to(torch.int32)
        # Per-token req-slot map for the target-verify SWA ring store; plain
        # decode's store reads req_pool_indices instead.
        core.unified.verify_store_state_slot = state_slot

    def _attach_unified_kv_prefill_meta(
        self,
        core: DSV4AttnMetadata,
        req_pool_indices: torch.Tensor,
        req_pool_indices_repeated: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        num_tokens: int,
        exact_num_tokens: bool = True,
    ) -> None:
        from sglang.srt.layers.attention.dsv4.unified_kv_gate import (
            is_unified_kv_triton,
        )

        if not is_unified_kv_triton():
            return
        device = req_pool_indices.device
        bs = req_pool_indices.shape[0]
        seq_lens = seq_lens.to(torch.int64)
        extend_seq_lens = extend_seq_lens.to(torch.int64)
        # token -> req index (length L = sum(extend_seq_lens)).
        # output_size skips the implicit sum() D2H, but it must equal L:
        # exact_num_tokens tells whether num_tokens does.
        bid = torch.repeat_interleave(
            torch.arange(bs, device=device, dtype=torch.int64),
            extend_seq_lens,
            output_size=num_tokens if exact_num_tokens else None,
        )
        if core.unified is None:
            core.unified = UnifiedKvMetadata()
        state_slot = req_pool_indices[bid]
        chunk_start = (seq_lens - extend_seq_lens)[bid]
        cu_q_per_req = torch.cumsum(extend_seq_lens, dim=0) - extend_seq_lens
        cu_q = cu_q_per_req[bid]
        final_pos = (seq_lens - 1)[bid]

        padded_num_tokens = core.positions_casual.shape[0]
        assert num_tokens <= padded_num_tokens
        if num_tokens < padded_num_tokens:
            pad_size = padded_num_tokens - num_tokens
            state_slot = torch.cat(
                (state_slot, req_pool_indices_repeated[num_tokens:padded_num_tokens])
            )
            chunk_start = F.pad(chunk_start, (0, pad_size), value=0)
            cu_q = F.pad(cu_q, (0, pad_size), value=0)
            # Padded positions are zero. final_pos=win makes the SWA store's
            # `pos <= final_pos - win` guard skip every padded row.
            final_pos = F.pad(
                final_pos,
                (0, pad_size),
                value=self.token_to_kv_pool.unified_swa_window,
            )

        core.unified.pf_state_slot = state_slot
        core.unified.pf_chunk_start = chunk_start
        core.unified.pf_cu_q = cu_q
        core.unified.pf_final_pos = final_pos

    def _forward_unified_kv(
        self,
        *,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        compress_ratio: Literal[0, 4, 128],
        attn_sink: torch.Tensor,
        core_attn_metadata: DSV4AttnMetadata,
        save_kv_cache: bool = True,
        q_rope: Optional[torch.Tensor] = None,
        k_rope: Optional[torch.Tensor] = None,
        wo_a_quant_freqs: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """q_rope present: packed fp8 q over the two-pool fp8 layout (asm decode;
        prefill also needs k_rope). Absent: plain bf16 q and pool (Triton).
        wo_a_quant_freqs (fp8 decode): return the inverse-RoPE'd wo_a mxfp8
        operands instead of the attention output."""
        from sglang.kernels.ops.attention.dsv4.unified_kv_kernels import runtime
        from sglang.kernels.ops.kvcache import dsv4_unified_kv_store

        pool = self.token_to_kv_pool
        layer_id = layer.layer_id
        unified = pool.get_unified_kv(layer_id)
        win = pool.unified_swa_window
        ring_stride = pool.unified_swa_ring_size
        swa_pages = pool.unified_swa_pages

        if q.ndim == 4:
            q = q.squeeze(1)
        device = q.device
        positions = forward_batch.positions.to(torch.int64)
        T = q.shape[0]
        positions = positions[:T]

        c128_pi = getattr(core_attn_metadata, "c128_page_indices", None)
        c4_pi = getattr(core_attn_metadata, "c4_sparse_page_indices", None)

        # Target-verify runs through the unified_kv DECODE kernel, same path as
        # decode; its per-token decode streams were built in metadata.
        verify_as_decode = forward_batch.forward_mode.is_target_verify()
        is_decode = forward_batch.forward_mode.is_decode_or_idle() or verify_as_decode
        if is_decode:
            if verify_as_decode:
                # Writing every draft token's K into the ring is safe: spec_extra
                # room prevents clobbering the history same-step tokens still read.
                state_slot = core_attn_metadata.unified.verify_store_state_slot[:T]
            else:
                state_slot = forward_batch.req_pool_indices[:T]
            if save_kv_cache:
                # Only verify reaches this under fp8; plain decode's rows are
                # written by the fused kernel itself, which leaves kv None.
                dsv4_unified_kv_store.store_swa_into_unified(
                    kv=kv,
                    state_slot=state_slot,
                    positions=positions,
                    unified_kv=unified,
                    win=win,
                    ring_stride=ring_stride,
                    final_pos=positions,
                    kv_rope=k_rope,
                    unified_kv_rope=(
                        None if k_rope is None else pool.get_unified_kv_rope(layer_id)
                    ),
                )
            unified_metadata = core_attn_metadata.unified
            if compress_ratio == 0:
                kv_indices = unified_metadata.swa_indices
                kv_indptr = unified_metadata.swa_indptr
            elif compress_ratio == 128:
                kv_indices = unified_metadata.hca_indices
                kv_indptr = unified_metadata.hca_indptr
            elif compress_ratio == 4:
                kv_indices = unified_metadata.csa_indices
                kv_indptr = unified_metadata.csa_indptr
                runtime.fill_compress_tail(
                    indices=kv_indices,
                    indptr=kv_indptr,
                    prefix_len=core_attn_metadata.swa_topk_lengths[:T],
                    page_indices=c4_pi[:T],
                    valid_len=core_attn_metadata.c4_sparse_topk_lengths_raw[:T],
                    swa_pages=swa_pages,
                )
            else:
                raise ValueError(f"bad compress_ratio {compress_ratio}")
            if q_rope is not None:
                # The asm kernel hardcodes softmax scale 1/sqrt(512) (V4 head_dim)
                # and takes no softmax_scale, unlike the other readers here.
                assert self.softmax_scale == 512**-0.5, (
                    "the v4 nm asm kernel hardcodes 1/sqrt(512), this backend is "
                    f"at {self.softmax_scale}"
                )
                qo_indptr, max_seqlen_q, q_kv_bounds = None, 1, None
                grp = {
                    128: (
                        unified_metadata.grp_hca_indices,
                        unified_metadata.grp_hca_indptr,
                        unified_metadata.grp_hca_bounds,
                    ),
                    0: (
                        unified_metadata.grp_swa_indices,
                        unified_metadata.grp_swa_indptr,
                        unified_metadata.grp_swa_bounds,
                    ),
                }.get(compress_ratio)
                if verify_as_decode and grp is not None and grp[0] is not None:
                    kv_indices, kv_indptr, q_kv_bounds = grp
                    qo_indptr = unified_metadata.grp_qo_indptr
                    max_seqlen_q = self.target_verify_num_draft_tokens
                if wo_a_quant_freqs is not None:
                    return runtime.decode_fp8_2buff_wo_a_mxfp8(
                        q=q,
                        q_rope=q_rope,
                        unified_kv=unified,
                        unified_kv_rope=pool.get_unified_kv_rope(layer_id),
                        kv_indices=kv_indices,
                        kv_indptr=kv_indptr,
                        attn_sink=attn_sink,
                        positions=positions,
                        rope_freqs=wo_a_quant_freqs,
                        compress_ratio=compress_ratio,
                        qo_indptr=qo_indptr,
                        max_seqlen_q=max_seqlen_q,
                        q_kv_bounds=q_kv_bounds,
                    )
                gasm = (
                    unified_metadata.gasm_indices
                    if compress_ratio == 128
                    and q.shape[1] == _GROUPED_ASM_GQA
                    and q_kv_bounds is None
                    else None
                )
                if gasm is not None:
                    return runtime.decode_fp8_2buff(
                        q=q,
                        q_rope=q_rope,
                        unified_kv=unified,
                        unified_kv_rope=pool.get_unified_kv_rope(layer_id),
                        kv_indices=gasm,
                        kv_indptr=unified_metadata.gasm_kv_indptr,
                        qo_indptr=unified_metadata.gasm_qo_indptr,
                        attn_sink=attn_sink,
                        v_head_dim=layer.v_head_dim,
                        max_seqlen_q=_GROUPED_ASM_BLOCK_Q,
                        compress_ratio=compress_ratio,
                    )
                return runtime.decode_fp8_2buff(
                    q=q,
                    q_rope=q_rope,
                    unified_kv=unified,
                    unified_kv_rope=pool.get_unified_kv_rope(layer_id),
                    kv_indices=kv_indices,
                    kv_indptr=kv_indptr,
                    attn_sink=attn_sink,
                    v_head_dim=layer.v_head_dim,
                    compress_ratio=compress_ratio,
                    qo_indptr=qo_indptr,
                    max_seqlen_q=max_seqlen_q,
                    q_kv_bounds=q_kv_bounds,
                    kv_len_hint=(
                        self._fp8_split_kv_hint.get(compress_ratio)
                        if qo_indptr is None
                        else None
                    ),
                )
            from sglang.kernels.ops.attention.dsv4.unified_kv_kernels.paged_decode import (
                kv_splits_for_stream,
            )

            return runtime.decode(
                q=q,
                unified_kv=unified,
                kv_indices=kv_indices,
                kv_indptr=kv_indptr,
                attn_sink=attn_sink,
                softmax_scale=self.softmax_scale,
                # Only this call site knows compress_ratio, and it is the one
                # thing that separates the ragged stream from the clamped ones.
                kv_splits=kv_splits_for_stream(compress_ratio),
            )

        # prefill / extend
        state_slot = core_attn_metadata.unified.pf_state_slot
        chunk_start = core_attn_metadata.unified.pf_chunk_start
        cu_q = core_attn_metadata.unified.pf_cu_q
        final_pos = core_attn_metadata.unified.pf_final_pos

        # Slice CP query metadata while keeping cache-write metadata global.
        _cp_active = is_cp_active(forward_batch)
        state_slot_full = state_slot
        final_pos_full = final_pos
        positions_full = positions
        if _cp_active:
            _cp_size = get_parallel().attn_cp_size
            # pf_* were built on the padded global layout before the reindex.
            assert state_slot.shape[0] == _cp_size * T, (state_slot.shape, T)
            _sl = slice(get_parallel().attn_cp_rank, None, _cp_size)
            state_slot, chunk_start, cu_q, final_pos = (
                v[_sl].contiguous() for v in (state_slot, chunk_start, cu_q, final_pos)
            )
            # Already CP-reindexed; padding rows carry the inert expansion position.
            positions = core_attn_metadata.positions_casual.to(torch.int64)
            assert positions.shape[0] == T
            positions_full = forward_batch.positions.to(torch.int64)

        kpre_i, kpre_p, kext_i, kext_p = runtime.build_prefill_indices(
            compress_ratio=compress_ratio,
            state_slot=state_slot,
            positions=positions,
            chunk_start=chunk_start,
            cu_q=cu_q,
            win=win,
            ring_stride=ring_stride,
            swa_pages=swa_pages,
            c128_page_indices=c128_pi,
            c4_sparse_page_indices=c4_pi,
        )

        if kpre_p.shape[0] < T + 1:
            pad = T + 1 - kpre_p.shape[0]
            kpre_p = torch.cat([kpre_p, kpre_p[-1:].expand(pad)])
            kext_p = torch.cat([kext_p, kext_p[-1:].expand(pad)])
        if q_rope is not None:
            assert k_rope is not None, (
                "fp8 prefill needs the extend rope half beside the packed nope; "
                "q_rope came through but k_rope did not"
            )
            # No empty-segment mask, unlike decode: this kernel returns zeros for
            # a token with neither region where the asm decode reader leaves NaN.
            o = runtime.prefill_fp8_2buff(
                q=q,
                q_rope=q_rope,
                unified_kv=unified,
                unified_kv_rope=pool.get_unified_kv_rope(layer_id),
                kv_indices_prefix=kpre_i,
                kv_indptr_prefix=kpre_p,
                kv_extend=kv,
                kv_extend_rope=k_rope,
                kv_indices_extend=kext_i,
                kv_indptr_extend=kext_p,
                attn_sink=attn_sink,
                softmax_scale=self.softmax_scale,
                v_head_dim=layer.v_head_dim,
            )
        else:
            o = runtime.prefill(
                q=q,
                unified_kv=unified,
                kv_indices_prefix=kpre_i,
                kv_indptr_prefix=kpre_p,
                kv_extend=kv,
                kv_indices_extend=kext_i,
                kv_indptr_extend=kext_p,
                attn_sink=attn_sink,
                softmax_scale=self.softmax_scale,
            )

        # write this chunk's SWA K into the ring for future chunks / decode
        # only the final-window tokens per request
        if save_kv_cache:
            # CP gathers only the logical rows; drop the physical padding rows.
            n_real = kv.shape[0] if _cp_active else state_slot_full.shape[0]
            # the store launches one program per kv row and never checks these lengths
            assert min(state_slot_full.shape[0], positions_full.shape[0]) >= n_real
            dsv4_unified_kv_store.store_swa_into_unified(
                kv=kv[:n_real],
                state_slot=state_slot_full[:n_real],
                positions=positions_full[:n_real],
                unified_kv=unified,
                win=win,
                ring_stride=ring_stride,
                final_pos=final_pos_full[:n_real],
                kv_rope=None if k_rope is None else k_rope[:n_real],
                unified_kv_rope=(
                    None if k_rope is None else pool.get_unified_kv_rope(layer_id)
                ),
            )
        return o

    def get_swa_out_cache_loc(self, forward_batch: ForwardBatch) -> torch.Tensor:
        # Idle metadata may be stale or unset: idle writes the request window's
        # idle layout, or translates the zero-padded out_cache_loc to the dummy slot.
        out_cache_loc = forward_batch.out_cache_loc
        window = self.token_to_kv_pool.request_window
        if forward_batch.forward_mode.is_idle():
            if window is not None:
                return window.activate_idle(out_cache_loc.shape[0])
            return self.token_to_kv_pool.translate_loc_from_full_to_swa(
                out_cache_loc
            ).to(torch.int32)
        if window is not None:
            layout = self.forward_metadata.core_attn_metadata.request_window_layout
            window.activate(layout)
            return layout.write_loc
        metadata = self.forward_metadata
        if isinstance(metadata, DSV4Metadata) and metadata.late_layer_tail is not None:
            # the tail's rows are a subset of the extend, so it owns its own store target
            return metadata.late_layer_tail.swa_out_cache_loc
        core = getattr(self.forward_metadata, "core_attn_metadata", None)
        cached = core.swa_out_cache_loc if core is not None else None
        if cached is not None and cached.shape[0] == out_cache_loc.shape[0]:
            return cached
        return self.token_to_kv_pool.translate_loc_from_full_to_swa(out_cache_loc).to(
            torch.int32
        )

    def get_unified_swa_loc(self, forward_batch: ForwardBatch) -> torch.Tensor:
        # Cached slots use committed positions; draft steps need live positions.
        positions = forward_batch.positions
        core = getattr(self.forward_metadata, "core_attn_metadata", None)
        unified = getattr(core, "unified", None) if core is not None else None
        cached = unified.swa_loc if unified is not None else None
        is_multistep_draft_decode = (
            forward_batch.forward_mode.is_decode_or_idle()
            and self.speculative_num_steps > 1
        )
        if (
            cached is not None
            and not forward_batch.forward_mode.is_idle()
            and cached.shape[0] == positions.shape[0]
            and not is_multistep_draft_decode
        ):
            result = cached
        else:
            ring = self.token_to_kv_pool.unified_swa_ring_size
            req_slot = forward_batch.req_pool_indices.to(torch.int64)
            if req_slot.shape[0] != positions.shape[0]:
                req_slot = req_slot.repeat_interleave(
                    positions.shape[0] // req_slot.shape[0]
                )
            result = (req_slot * ring + positions.to(torch.int64) % ring).to(
                torch.int32
            )
        return result

    def store_cache(
        self, layer_id: int, swa_k: torch.Tensor, forward_batch: ForwardBatch
    ) -> None:
        swa_loc = self.get_swa_out_cache_loc(forward_batch)
        self.token_to_kv_pool.set_swa_key_buffer_radix_fused(
            layer_id=layer_id,
            swa_loc=swa_loc,
            cache_k=swa_k,
        )

    def _opus_prefill_applies(
        self, q: torch.Tensor, forward_batch: ForwardBatch, compress_ratio: int
    ) -> bool:
        if not envs.SGLANG_OPT_HIP_OPUS_SPARSE_PREFILL.get():
            return False
        if (
            compress_ratio not in (0, 1, 2)
            or self.is_draft_worker
            or not forward_batch.forward_mode.is_extend_without_speculative()
            or q.ndim != 3
            or q.shape[0] < _OPUS_PREFILL_MIN_TOKENS
            or q.shape[-1] != 512
            or q.dtype != torch.bfloat16
            or not is_gfx95_supported()
            or self.token_to_kv_pool.request_window is not None
            or self.forward_metadata.late_layer_tail is not None
            or is_cp_active(forward_batch)
            or forward_batch.seq_lens_cpu is None
            or forward_batch.extend_seq_lens_cpu is None
        ):
            return False
        if compress_ratio == 0:
            return True
        seq_lens = forward_batch.seq_lens_cpu
        history_rows = len(seq_lens) * max(int(seq_lens.max()) // compress_ratio, 1)
        return history_rows <= min(
            _OPUS_PREFILL_MAX_ROWS_PER_TOKEN[compress_ratio] * q.shape[0],
            _OPUS_PREFILL_MAX_WORKSPACE_ROWS,
        )

    def _build_opus_prefill_cache(
        self,
        forward_batch: ForwardBatch,
        core_attn_metadata: DSV4AttnMetadata,
        num_tokens: int,
    ) -> SparsePrefillChunkCache:
        seq_lens_cpu = forward_batch.seq_lens_cpu.tolist()
        total_swa = sum(
            min(int(seq_len), int(extend_len) + SWA_WINDOW - 1)
            for seq_len, extend_len in zip(
                seq_lens_cpu, forward_batch.extend_seq_lens_cpu, strict=True
            )
        )
        extend_seq_lens = forward_batch.extend_seq_lens.to(torch.int32)
        query_pos = core_attn_metadata.seq_lens_casual[:num_tokens] - 1
        assert query_pos.shape[0] == num_tokens, (query_pos.shape, num_tokens)
        return SparsePrefillChunkCache.build(
            seq_lens=forward_batch.seq_lens.to(torch.int32),
            extend_seq_lens=extend_seq_lens,
            query_lens=extend_seq_lens,
            query_pos=query_pos.to(torch.int32),
            req_pool_indices=forward_batch.req_pool_indices.to(torch.int32),
            req_to_token=self.req_to_token,
            full_to_swa=self.token_to_kv_pool.full_to_swa_index_mapping,
            swa_window_size=SWA_WINDOW,
            swa_page_size=self.token_to_kv_pool.swa_kv_pool.page_size,
            num_qo_tokens=num_tokens,
            max_seq_len=max(seq_lens_cpu),
            seq_lens_cpu=seq_lens_cpu,
            total_swa=total_swa,
        )

    def _forward_prefill_opus(
        self,
        q: torch.Tensor,
        layer_id: int,
        compress_ratio: int,
        forward_batch: ForwardBatch,
        core_attn_metadata: DSV4AttnMetadata,
        attn_sink: torch.Tensor,
        inv_rope: Optional[Tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Sparse prefill through OPUS over the layer's SWA rows and, for ratios 1 / 2,
        the compressed history its top-k selects."""
        pool = self.token_to_kv_pool
        num_tokens = q.shape[0]
        state = self._opus_prefill_state
        if state is None or state.cache.num_qo_tokens != num_tokens:
            cache = self._build_opus_prefill_cache(
                forward_batch, core_attn_metadata, num_tokens
            )
            swa_csr = combined_to_csr(
                cache.c0_combined_indices,
                cache.c0_combined_lens,
                0,
                cache.swa_token_ids.shape[0],
            )
            state = self._opus_prefill_state = _OpusPrefillState(cache, swa_csr)
        cache = state.cache
        num_swa_rows = cache.swa_token_ids.shape[0]
        swa_rows = self.opus_prefill_workspace.get(num_swa_rows)
        dequantize_k_cache_paged_dsv4(
            pool.get_swa_key_buffer_radix(layer_id),
            cache.swa_token_ids,
            page_size=cache.swa_page_size,
            out=swa_rows,
            layout=pool.get_swa_key_layout(),
        )
        swa_kv = swa_rows.view(num_swa_rows, -1)
        if compress_ratio == 0:
            out = opus_sparse_prefill(
                q, swa_kv, state.swa_csr, attn_sink, self.softmax_scale
            )
        else:
            compressed_kv, topk_csr = self._opus_compressed_inputs(
                state, layer_id, compress_ratio, core_attn_metadata
            )
            out = opus_sparse_prefill(
                q,
                compressed_kv,
                topk_csr,
                attn_sink,
                self.softmax_scale,
                extend_kv=swa_kv,
                extend_csr=state.swa_csr,
            )
        if inv_rope is not None:
            _apply_inverse_rope(out, inv_rope)
        return out

    def _opus_compressed_inputs(
        self,
        state: _OpusPrefillState,
        layer_id: int,
        compress_ratio: int,
        core_attn_metadata: DSV4AttnMetadata,
    ) -> Tuple[torch.Tensor, Csr]:
        """The bf16 compressed history of the layer's kv_source and the CSR of the
        ratio's current top-k into it."""
        pool = self.token_to_kv_pool
        cache = state.cache
        c_cache = pool.get_extra_key_buffer(layer_id)
        entry = state.compressed_kv.get(compress_ratio)
        if entry is None or entry[0] != c_cache.data_ptr():
            c_page_size = pool.get_extra_key_page_size(layer_id)
            gather = cache.ensure_compressed(
                compress_ratio, core_attn_metadata.page_table, c_page_size
            )
            num_rows = gather.flat_token_ids.shape[0]
            rows = self.opus_compressed_workspaces[compress_ratio].get(num_rows)
            dequantize_k_cache_paged_dsv4(
                c_cache,
                gather.flat_token_ids,
                page_size=c_page_size,
                out=rows,
                layout=pool.get_extra_key_layout(layer_id),
            )
            entry = (c_cache.data_ptr(), rows.view(num_rows, -1))
            state.compressed_kv[compress_ratio] = entry
        compressed_kv = entry[1]
        topk_csr = state.topk_csr.get(compress_ratio)
        if topk_csr is None:
            raw_indices = core_attn_metadata.sparse_raw_indices(compress_ratio)
            indices, lens = cache.combine_compressed(
                compress_ratio, raw_indices[: cache.num_qo_tokens]
            )
            topk_csr = combined_to_csr(indices, lens, 0, compressed_kv.shape[0])
            state.topk_csr[compress_ratio] = topk_csr
        return compressed_kv, topk_csr

    def _drop_opus_topk_csr(self, compress_ratio: int) -> None:
        if self._opus_prefill_state is not None:
            self._opus_prefill_state.topk_csr.pop(compress_ratio, None)

    def _forward_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        compress_ratio: Literal[0, 1, 2, 4, 128],
        save_kv_cache: bool = True,
        attn_sink: Optional[torch.Tensor] = None,
        q_rope: Optional[torch.Tensor] = None,
        k_rope: Optional[torch.Tensor] = None,
        inv_rope: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        wo_a_quant_freqs: Optional[torch.Tensor] = None,
        **_,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """inv_rope=(freqs_real, positions) has the kernel apply the inverse RoPE
        to the last freqs_real.shape[-1] dims of every output head."""
        if self.mtp_enabled and forward_batch.forward_mode.is_idle():
            return q.new_empty(q.shape[0], q.shape[1], layer.v_head_dim)

        assert k is v, "DeepseekV4 shares k and v"
        swa_k = k

        layer_id = layer.layer_id
        metadata = self.forward_metadata
        core_attn_metadata = metadata.core_attn_metadata
        token_to_kv_pool = self.token_to_kv_pool
        assert isinstance(token_to_kv_pool, DeepSeekV4TokenToKVPool)

        from sglang.srt.layers.attention.dsv4.unified_kv_gate import (
            is_unified_kv_triton,
        )

        if is_unified_kv_triton():
            o = self._forward_unified_kv(
                q=q,
                kv=swa_k,
                layer=layer,
                forward_batch=forward_batch,
                compress_ratio=compress_ratio,
                attn_sink=attn_sink,
                core_attn_metadata=core_attn_metadata,
                save_kv_cache=save_kv_cache,
                q_rope=q_rope,
                k_rope=k_rope,
                wo_a_quant_freqs=wo_a_quant_freqs,
            )
            assert inv_rope is None, (
                "the unified_kv model path applies its inverse RoPE"
            )
            return o

        if isinstance(core_attn_metadata, DSV4AttnMetadata):
            if save_kv_cache:
                self.store_cache(layer_id, swa_k, forward_batch)
            if self._opus_prefill_applies(q, forward_batch, compress_ratio):
                return self._forward_prefill_opus(
                    q,
                    layer_id,
                    compress_ratio,
                    forward_batch,
                    core_attn_metadata,
                    attn_sink,
                    inv_rope,
                )
            swa_k_cache = token_to_kv_pool.get_swa_key_buffer_radix(layer_id)

            extra_k_cache, extra_indices, extra_topk_lengths = None, None, None
            if compress_ratio in (1, 2, 4):
                extra_k_cache = token_to_kv_pool.get_extra_key_buffer(layer_id)
                extra_indices = core_attn_metadata.sparse_page_indices(compress_ratio)
                extra_topk_lengths = core_attn_metadata.sparse_topk_lengths(
                    compress_ratio
                )
            elif compress_ratio == 128:
                extra_k_cache = token_to_kv_pool.get_extra_key_buffer(layer_id)
                extra_indices = core_attn_metadata.c128_page_indices
                extra_topk_lengths = core_attn_metadata.c128_topk_lengths_clamp1

            swa_page_size = token_to_kv_pool.swa_page_size
            assert swa_k_cache.ndim == 2
            swa_pool = (
                token_to_kv_pool.request_window.state
                if token_to_kv_pool.request_window is not None
                else token_to_kv_pool.swa_kv_pool
            )
            k_cache_total_dim = swa_pool.kv_cache_total_dim
            swa_k_cache = swa_k_cache[:, : swa_page_size * k_cache_total_dim].view(
                swa_k_cache.shape[0], swa_page_size, 1, k_cache_total_dim
            )

            if extra_k_cache is not None:
                extra_page_size = token_to_kv_pool.get_extra_key_page_size(layer_id)
                extra_cache_dim = token_to_kv_pool.get_extra_key_bytes_per_token(
                    layer_id
                )
                extra_k_cache = extra_k_cache[
                    :, : extra_page_size * extra_cache_dim
                ].view(
                    extra_k_cache.shape[0],
                    extra_page_size,
                    1,
                    extra_cache_dim,
                )
            swa_page_indices = core_attn_metadata.swa_page_indices
            swa_topk_lengths = core_attn_metadata.swa_topk_lengths

            swa_page_indices = _match_num_queries(swa_page_indices, q.shape[0], value=0)
            swa_topk_lengths = _match_num_queries(swa_topk_lengths, q.shape[0], value=1)
            extra_indices = _match_num_queries(extra_indices, q.shape[0], value=-1)
            extra_topk_lengths = _match_num_queries(
                extra_topk_lengths, q.shape[0], value=1
            )

            if q.ndim == 3:
                q = q.unsqueeze(1)
            if swa_page_indices.ndim == 2:
                swa_page_indices = swa_page_indices.unsqueeze(1)
            if extra_indices is not None and extra_indices.ndim == 2:
                extra_indices = extra_indices.unsqueeze(1)

            assert attn_sink is not None

            flashmla_metadata = core_attn_metadata.get_flashmla_metadata(compress_ratio)

            assert swa_page_indices.shape[-1] % 64 == 0, (
                f"{swa_page_indices.shape=}'s last dimension is not aligned to 64"
            )
            if extra_indices is not None:
                assert extra_indices.shape[-1] % 64 == 0, (
                    f"{extra_indices.shape=}'s last dimension is not aligned to 64"
                )

            backend = resolve_hip_flashmla_backend()
            if (
                backend == "aiter_sparse"
                and 0 < q.shape[0] <= SWAPAB_MAX_BATCH
                and q.shape[1:] == (1, SWAPAB_NUM_HEADS, SWAPAB_HEAD_DIM)
                and q.dtype == torch.bfloat16
                and self.head_dim_v == SWAPAB_HEAD_DIM
                and self.softmax_scale == SWAPAB_SOFTMAX_SCALE
                and swa_k_cache.shape[-1] == KVLayout.V4.bytes_per_token
                and (
                    extra_k_cache is None
                    or extra_k_cache.shape[-1] == KVLayout.V4.bytes_per_token
                )
                and hip_attn_kv_splits() == 0
                and (
                    forward_batch.forward_mode.is_decode()
                    or forward_batch.forward_mode.is_target_verify()
                    or forward_batch.forward_mode.is_draft_extend_v2()
                )
            ):
                return swapab_attention(
                    q,
                    swa_k_cache,
                    swa_page_indices,
                    swa_topk_lengths,
                    attn_sink,
                    extra_k_cache,
                    extra_indices,
                    extra_topk_lengths,
                    inv_rope=inv_rope,
                )
            # the V4.1 compact kernels read topk_length themselves
            if (
                backend == "aiter_sparse"
                and swa_k_cache.shape[-1] == KVLayout.V4.bytes_per_token
            ):
                swa_page_indices, extra_indices = _fold_lengths_for_aiter_sparse(
                    core_attn_metadata,
                    compress_ratio,
                    swa_page_indices,
                    swa_topk_lengths,
                    extra_indices,
                    extra_topk_lengths,
                )
            input_dict = dict(
                q=q,
                k_cache=swa_k_cache,
                head_dim_v=self.head_dim_v,
                block_table=None,
                cache_seqlens=None,
                tile_scheduler_metadata=flashmla_metadata,
                softmax_scale=self.softmax_scale,
                is_fp8_kvcache=True,
                indices=swa_page_indices,
                topk_length=swa_topk_lengths,
                attn_sink=attn_sink,
                extra_k_cache=extra_k_cache,
                extra_indices_in_kvcache=extra_indices,
                extra_topk_length=extra_topk_lengths,
            )
            if inv_rope is not None:
                input_dict["inv_rope"] = inv_rope
            o = flash_mla_with_kvcache_entrypoint(**input_dict, backend=backend)[0]

            o = o.squeeze(1)
            return o

        raise NotImplementedError("ragged attention")

    def _low_ratio_index_topk(
        self,
        layer,
        x,
        q_lora,
        req,
        pos,
        forward_batch,
        *,
        rows_per_request=None,  # NOTE: only used in CP
    ) -> None:
        """FlyDSL fp4 paged logits for decode, target-verify and ragged prefill;
        target-verify takes the decode body (one-token rows)."""
        # every body below rewrites the ratio's page indices in place
        self.forward_metadata.core_metadata.drop_folded_sparse_indices(
            layer.compress_ratio
        )
        self._drop_opus_topk_csr(layer.compress_ratio)
        if (
            forward_batch.forward_mode.is_decode()
            or forward_batch.forward_mode.is_target_verify()
        ):
            low_ratio_index_topk_hip_decode(
                self, layer, x, q_lora, pos, forward_batch=forward_batch
            )
        elif forward_batch.forward_mode.is_extend():
            # HIP rejects V4.1 prefill CP, the only caller passing rows_per_request
            assert rows_per_request is None, "V4.1 prefill CP is not supported on HIP"
            assert (
                forward_batch.seq_lens_cpu is not None
                and forward_batch.extend_seq_lens_cpu is not None
            ), "the HIP low-ratio prefill indexer needs the batch's CPU lengths"
            low_ratio_index_topk_hip_extend(self, layer, x, q_lora, pos, forward_batch)
        else:
            raise NotImplementedError(
                f"low-ratio indexer for {forward_batch.forward_mode} on HIP"
            )

    def expand_extend_with_same_length(
        self,
        bs: int,
        qo_len: int,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
    ):
        seq_lens_casual = seq_lens[:, None] + torch.arange(
            -qo_len + 1, 1, **self.cuda_int32_kwargs
        )
        seq_lens_casual = seq_lens_casual.flatten()
        idx_to_req_repeated = torch.arange(
            bs, **self.cuda_int32_kwargs
        ).repeat_interleave(qo_len)
        req_pool_indices_repeated = req_pool_indices[idx_to_req_repeated]
        return seq_lens_casual, req_pool_indices_repeated

    def make_core_attn_metadata(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices_repeated: torch.Tensor,
        seq_lens_casual: torch.Tensor,
        max_seq_len: int,
        out_loc: torch.Tensor,
        need_compress: bool = True,
        is_prefill: bool = False,
        num_tokens: Optional[int] = None,
        dspark_block_size: Optional[int] = None,
        swa_replay_start: Optional[torch.Tensor] = None,
        num_groups: Optional[int] = None,
    ) -> DSV4AttnMetadata:
        """swa_replay_start floors every row's window at that absolute position."""
        seq_lens_casual = seq_lens_casual.to(torch.int32)
        raw_positions = seq_lens_casual - 1

        request_layout = None
        window = self.token_to_kv_pool.request_window
        if window is not None:
            if self.encoder_replay:
                starts = torch.ones_like(raw_positions, dtype=torch.bool)
                starts[1:] = (
                    req_pool_indices_repeated[1:] != req_pool_indices_repeated[:-1]
                )
                offset = torch.arange(
                    raw_positions.numel(), device=raw_positions.device
                )
                group_first = torch.cummax(torch.where(starts, offset, 0), dim=0).values
                swa_replay_start = raw_positions - (offset - group_first)
            request_layout = window_layout(
                req_pool_indices_repeated,
                raw_positions,
                zero_row=window.zero_row,
                capacity=window.capacity,
                floor=swa_replay_start,
                num_groups=num_groups,
            )
            swa_page_indices = _pad_last_dim(
                request_layout.indices, multiples_of=PAGE_INDEX_ALIGNED_SIZE
            )
            swa_topk_lengths = request_layout.lengths
        elif dspark_block_size is not None:
            assert self._uses_dspark_draft_window() and (
                dspark_block_size == self.target_verify_num_draft_tokens
            ), (
                f"{dspark_block_size=} must equal target_verify_num_draft_tokens="
                f"{self.target_verify_num_draft_tokens} on the DSpark draft backend"
            )
            # Already padded to PAGE_INDEX_ALIGNED_SIZE by the builder.
            swa_page_indices, swa_topk_lengths = self.get_dspark_swa_page_indices(
                seq_lens_casual=seq_lens_casual,
                req_pool_indices_repeated=req_pool_indices_repeated,
                out_loc=out_loc,
                block_size=dspark_block_size,
            )
        elif swa_replay_start is None:
            swa_page_indices = self.get_swa_page_indices(
                seq_lens_casual=seq_lens_casual,
                req_pool_indices_repeated=req_pool_indices_repeated,
            )
            swa_page_indices = _pad_last_dim(
                swa_page_indices, multiples_of=PAGE_INDEX_ALIGNED_SIZE
            )
            swa_topk_lengths = torch.clamp(seq_lens_casual, max=SWA_WINDOW)
        else:
            swa_page_indices = BuildCausalSwaPageIndices.execute(
                req_to_token=self.req_to_token,
                full_to_swa_mapping=self.token_to_kv_pool.full_to_swa_index_mapping,
                req_pool_indices_repeated=req_pool_indices_repeated,
                seq_lens_casual=seq_lens_casual,
                swa_window=SWA_WINDOW,
                page_index_aligned_size=PAGE_INDEX_ALIGNED_SIZE,
                swa_replay_start=swa_replay_start,
            )
            # Slots below the floor are -1; the valid count shrinks to match.
            floored = raw_positions - swa_replay_start.to(raw_positions.dtype) + 1
            swa_topk_lengths = torch.minimum(
                torch.clamp(seq_lens_casual, max=SWA_WINDOW), floored.clamp_min(0)
            )

        # the gather, the floor division and the cast in one launch
        page_table = page_table_from_req_to_token(
            req_to_token, req_pool_indices_repeated, max_seq_len, self.page_size
        )

        core_attn_metadata = DSV4AttnMetadata(
            page_size=self.page_size,
            raw_out_loc=out_loc,
            seq_lens_casual=seq_lens_casual,
            cuda_int32_kwargs=self.cuda_int32_kwargs,
            positions_casual=raw_positions,
            page_table=page_table,
            swa_page_indices=swa_page_indices,
            swa_topk_lengths=swa_topk_lengths,
            index_topk=self.index_topk,
            low_ratios=self.low_ratios,
            request_window_layout=request_layout,
        )

        if need_compress:
            core_attn_metadata.init_compression_metadata(
                num_tokens=num_tokens,
                unified_swa_pages=getattr(
                    self.token_to_kv_pool, "unified_swa_pages", 0
                ),
            )
            core_attn_metadata.init_flashmla_related()
        else:
            core_attn_metadata.c4_sparse_topk_lengths = None
            core_attn_metadata.c4_sparse_topk_lengths_raw = None
            core_attn_metadata.c4_sparse_page_indices = None
            core_attn_metadata.c4_sparse_raw_indices = None
            core_attn_metadata.c0_flashmla_metadata = _create_flashmla_metadata()
            core_attn_metadata.c4_flashmla_metadata = None
            core_attn_metadata.c128_flashmla_metadata = None
        return core_attn_metadata

    def get_swa_page_indices(
        self,
        seq_lens_casual: torch.Tensor,
        req_pool_indices_repeated: torch.Tensor,
    ) -> torch.Tensor:
        pos_causal = seq_lens_casual - 1
        num_qo_tokens = seq_lens_casual.size(0)
        offsets = pos_causal.unsqueeze(1) - torch.arange(
            SWA_WINDOW, **self.cuda_int32_kwargs
        ).unsqueeze(0)
        invalid_offset_mask = offsets < 0
        offsets.masked_fill_(invalid_offset_mask, 0)
        raw_indices = self.req_to_token[req_pool_indices_repeated[:, None], offsets]
        assert raw_indices.shape == (num_qo_tokens, SWA_WINDOW)
        raw_indices.masked_fill_(invalid_offset_mask, -1)
        swa_indices = self.token_to_kv_pool.translate_loc_from_full_to_swa(raw_indices)
        # flash_mla attention requires int32 page indices.
        return swa_indices.to(torch.int32)

    get_dspark_swa_page_indices = DeepseekV4AttnBackend.get_dspark_swa_page_indices


class DeepseekV4MultiStepBackend(DeepseekV4HipRadixBackend):
    def __init__(
        self, model_runner: ModelRunner, topk: int, speculative_num_steps: int
    ):
        super().__init__(model_runner)
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends: List[DeepseekV4HipRadixBackend] = []
        for i in range(self.speculative_num_steps):
            self.attn_backends.append(
                DeepseekV4HipRadixBackend(
                    model_runner,
                    speculative_step_id=i,
                    topk=self.topk,
                    speculative_num_steps=self.speculative_num_steps,
                )
            )

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        for attn_backend in self.attn_backends:
            attn_backend.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(
        self,
        forward_batch: ForwardBatch,
        in_capture: bool = False,
    ):
        from types import SimpleNamespace

        actual_forward_mode = getattr(
            forward_batch, "actual_forward_mode", forward_batch.forward_mode
        )
        out_cache_loc = getattr(forward_batch, "out_cache_loc", None)
        step_out_cache_locs = None
        # C4/C128 write locations are baked into each child backend's metadata,
        # so every speculative step must consume its own cache-location row.
        if (
            actual_forward_mode != ForwardMode.IDLE
            and out_cache_loc is not None
            and self.topk > 0
            and self.speculative_num_steps > 1
        ):
            step_out_cache_locs = per_step_draft_out_cache_loc(
                out_cache_loc,
                forward_batch.batch_size,
                self.topk,
                self.speculative_num_steps,
            )

        inner_fb = SimpleNamespace(
            batch_size=forward_batch.batch_size,
            forward_mode=ForwardMode.DECODE,
            # Propagate the real runtime mode so inner backends can detect IDLE
            # and apply their idle substitution.
            actual_forward_mode=actual_forward_mode,
            input_ids=getattr(forward_batch, "input_ids", None),
            positions=getattr(forward_batch, "positions", None),
            req_pool_indices=forward_batch.req_pool_indices,
            seq_lens=forward_batch.seq_lens,
            seq_lens_sum=forward_batch.seq_lens_sum,
            seq_lens_cpu=forward_batch.seq_lens_cpu,
            encoder_lens=None,
            out_cache_loc=out_cache_loc,
            spec_info=forward_batch.spec_info,
        )
        if in_capture:
            for i in range(self.speculative_num_steps):
                if step_out_cache_locs is not None:
                    inner_fb.out_cache_loc = step_out_cache_locs[i]
                self.attn_backends[i].init_forward_metadata_out_graph(
                    inner_fb, in_capture=True
                )
        else:
            if self.speculative_num_steps == 1:
                return
            if step_out_cache_locs is not None:
                inner_fb.out_cache_loc = step_out_cache_locs[0]
            self.attn_backends[0].init_forward_metadata_out_graph(inner_fb)
            temp_metadata = self.attn_backends[0].forward_metadata
            if step_out_cache_locs is not None:
                assert isinstance(temp_metadata, DSV4RawDecodeMetadata)
            for i in range(1, self.speculative_num_steps - 1):
                if step_out_cache_locs is None:
                    step_metadata = temp_metadata
                else:
                    step_metadata = DSV4RawDecodeMetadata(
                        req_pool_indices=temp_metadata.req_pool_indices,
                        seq_lens=temp_metadata.seq_lens,
                        out_cache_loc=step_out_cache_locs[i],
                    )
                self.attn_backends[i].replay_cuda_graph_metadata_from(
                    bs=forward_batch.batch_size,
                    temp_metadata=step_metadata,
                    bucket=_GraphBucket.DECODE_OR_IDLE,
                )

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_forward_metadata(forward_batch)

    def init_forward_metadata_for_breakable_cuda_graph_capture(
        self, forward_batch: ForwardBatch
    ):
        return [
            self.attn_backends[
                i
            ].init_forward_metadata_for_breakable_cuda_graph_capture(forward_batch)
            for i in range(self.speculative_num_steps - 1)
        ]

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(
        self,
        capture_metadata,
        forward_batch: ForwardBatch,
        *,
        static_forward_batch: Optional[ForwardBatch] = None,
    ) -> None:
        assert len(capture_metadata) == self.speculative_num_steps - 1
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[
                i
            ].prepare_forward_metadata_for_breakable_cuda_graph_replay(
                capture_metadata[i],
                forward_batch,
                static_forward_batch=static_forward_batch,
            )

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        for i in range(self.speculative_num_steps):
            self.attn_backends[i].init_cuda_graph_state(max_bs, max_num_tokens)

    def on_after_cuda_graph_warmup(self):
        for backend in self.attn_backends:
            backend.on_after_cuda_graph_warmup()


def _match_num_queries(
    tensor: Optional[torch.Tensor], size: int, *, value: int
) -> Optional[torch.Tensor]:
    if tensor is None or tensor.shape[0] == size:
        return tensor
    if tensor.shape[0] > size:
        return tensor[:size]
    if value == 0:
        return torch.cat(
            [tensor, tensor.new_zeros(size - tensor.shape[0], *tensor.shape[1:])],
            dim=0,
        )
    else:
        return torch.cat(
            [
                tensor,
                tensor.new_full((size - tensor.shape[0], *tensor.shape[1:]), value),
            ],
            dim=0,
        )
