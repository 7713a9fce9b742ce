"""DeepSeek V4.1 low-ratio (1 / 2) indexer on ROCm: FlyDSL fp4 paged MQA logits over the split
payload / scale index-K pools, then the top-k v2 transform -- the DeepGEMM path's contract."""

from __future__ import annotations

import functools
import itertools
import logging
from typing import (
    TYPE_CHECKING,
    Callable,
    Dict,
    FrozenSet,
    List,
    Optional,
    Tuple,
    Union,
)

import torch
import triton

from sglang.kernels.ops.attention.dsv4 import topk_transform_paged
from sglang.kernels.ops.attention.dsv4.candidate_blocks_hip import (
    CandidateBlocks,
    cat_candidate_blocks,
    select_candidate_blocks_hip,
    slice_candidate_blocks,
    topk_transform_paged_hip,
    topk_within_candidate_blocks_hip,
    topk_within_candidate_blocks_page8,
    with_candidate_page8_table,
)
from sglang.kernels.ops.attention.dsv4.fp4_indexer_hip import (
    LOW_RATIO_PAGE_TABLE_BUCKET,
    FP4DecodeWorkspace,
    FP4PrefillWorkspace,
    FP4RowgroupDecodeWorkspace,
    FP4RowgroupPrefillWorkspace,
    aiter_fp4_paged_mqa_logits,
    aiter_has_fp4_rowgroup,
    index_q_rope_pack_flydsl,
    index_q_rope_pack_weights_flydsl,
    logits_rows_per_chunk,
    pack_fp4_query_flydsl,
    prepare_fp4_decode_workspace,
    prepare_fp4_prefill_workspace,
    prepare_fp4_rowgroup_decode_workspace,
    prepare_fp4_rowgroup_prefill_workspace,
    rowgroup_paged_mqa_logits,
    rowgroup_prefill_query_start_loc,
    rowgroup_table_columns,
)
from sglang.kernels.ops.attention.dsv4.fp4_indexer_rope_hip import (
    index_k_norm_rope_pack_store_split,
)
from sglang.kernels.ops.gemm.dsv4_indexer_head_weights_hip import indexer_head_weights
from sglang.kernels.ops.gemm.router_gemv_hip import rocm_router_gemv_split_k
from sglang.srt.environ import envs
from sglang.srt.layers.attention.deepseek_v4_backend import (
    _as_int_list,
)

if TYPE_CHECKING:
    from sglang.srt.layers.attention.dsv4.metadata import PagedIndexerMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


# fp32 logits scored per candidate-block chunk stay under this many bytes
_CANDIDATE_SCORE_BUDGET_BYTES = 1 << 30

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _fp4_rowgroup_enabled() -> bool:
    """SGLANG_HIP_FP4_INDEXER_ROWGROUP, off when the installed AITER has no row-group
    kernel (ROCm/aiter#6145)."""
    if not envs.SGLANG_HIP_FP4_INDEXER_ROWGROUP.get():
        return False
    if not aiter_has_fp4_rowgroup():
        logger.warning(
            "SGLANG_HIP_FP4_INDEXER_ROWGROUP is set but the installed AITER has no "
            "row-group FP4 MQA logits kernel (#6145); keeping the schedule kernels."
        )
        return False
    return True


def _score_requests_page8(
    *,
    q_fp4: torch.Tensor,
    q_scale: torch.Tensor,
    weights: torch.Tensor,
    k_payload: torch.Tensor,
    k_scale: torch.Tensor,
    workspace: FP4RowgroupPrefillWorkspace,
    rows: slice,
    req_lo: int,
    rows_per_request: List[int],
    row_ends: torch.Tensor,
) -> torch.Tensor:
    """Full-context logits of a page8 pool for rows, consecutive requests from req_lo on with
    rows_per_request rows each; a request's rows share every key load."""
    assert sum(rows_per_request) == q_fp4.shape[0], (rows_per_request, q_fp4.shape)
    return rowgroup_paged_mqa_logits(
        q_fp4=q_fp4,
        q_scale=q_scale,
        k_payload=k_payload,
        k_scale=k_scale,
        weights=weights,
        weight_scale=1.0,
        block_tables=workspace.request_page_table[
            req_lo : req_lo + len(rows_per_request)
        ],
        query_start_loc=rowgroup_prefill_query_start_loc(
            workspace, rows, rows_per_request
        ),
        row_ends=row_ends,
        max_query_len=max(rows_per_request),
        max_seq_len=workspace.max_seq_len,
        page8=True,
        pages_per_block=8,
        is_decode=False,
    )


def _gemv_head_weight_rows(indexer, x: torch.Tensor) -> bool:
    """Row counts indexer_head_weights / the split-K GEMV serve: a small contiguous bf16 batch."""
    return (
        0 < x.shape[0] <= indexer.weights_proj_hip_max_tokens
        and x.dim() == 2
        and x.dtype == torch.bfloat16
        and x.stride(1) == 1
    )


def _indexer_head_weights(indexer, x: torch.Tensor) -> torch.Tensor:
    """indexer.head_weights(x) as the contiguous bf16 [T, H] the FlyDSL kernels take; decode row
    counts run indexer_head_weights (same two roundings as aiter's GEMM plus the scale)."""
    if _gemv_head_weight_rows(indexer, x):
        return indexer_head_weights(
            x, indexer.weights_proj.weight, indexer.head_weight_scale
        )
    return indexer.head_weights(x).contiguous()


def _indexer_inputs(layer, x, q_lora, pos):
    """(payload, scale) query in the FlyDSL layout and the pre-scaled head weights."""
    indexer = layer.indexer
    # The kernel sums head scores locally, so the indexer heads must be replicated.
    assert indexer.n_local_heads == indexer.n_heads
    if (
        _gemv_head_weight_rows(indexer, x)
        and indexer.n_heads % 16 == 0
        and indexer.n_heads <= 64
        and indexer.index_head_dim == 128
        and layer.freqs_cis.dtype == torch.complex64
    ):
        # decode rows: wq_b, split-K head-weight GEMV, then one launch for RoPE, fp4 pack and reduce
        q, _ = indexer.wq_b(q_lora)
        partials = rocm_router_gemv_split_k(x, indexer.weights_proj.weight)
        return index_q_rope_pack_weights_flydsl(
            q,
            layer.freqs_cis,
            pos,
            indexer.rope_head_dim,
            partials,
            indexer.head_weight_scale,
            num_heads=indexer.n_heads,
        )
    if (
        indexer.n_heads % 16 == 0
        and indexer.n_heads <= 64
        and indexer.index_head_dim == 128
        and indexer.rope_head_dim == 64
        and layer.freqs_cis.dtype == torch.complex64
    ):
        # rows past the GEMV's cap: wq_b, then one launch for RoPE and fp4 pack
        q, _ = indexer.wq_b(q_lora)
        q_fp4, q_scale = index_q_rope_pack_flydsl(
            q, layer.freqs_cis, pos, indexer.rope_head_dim, num_heads=indexer.n_heads
        )
        return q_fp4, q_scale, _indexer_head_weights(indexer, x)
    # [T, H, 128] fp4 grid; the RoPE launch gathers freqs_cis[pos] itself
    q = indexer.queries(q_lora, layer.freqs_cis, positions=pos)
    q_fp4, q_scale = pack_fp4_query_flydsl(q)
    weights = _indexer_head_weights(indexer, x)  # [T, H] bf16, already scaled
    return q_fp4, q_scale, weights


def build_low_ratio_decode_workspaces(
    metadata_by_ratio: Dict[int, PagedIndexerMetadata],
    *,
    max_context_len: int,
    num_requests: Optional[int] = None,
    page8_ratios: FrozenSet[int] = frozenset(),
) -> Dict[int, Union[FP4DecodeWorkspace, FP4RowgroupDecodeWorkspace]]:
    """Capture-safe: everything the schedule kernel touches is pinned in the workspace.
    With the row-group kernel there is no schedule; a request's rows (``num_requests``
    requests of equal row counts, consecutive: decode 1, target-verify its draft rows)
    score as one sequence, on a table as wide as ``max_context_len`` needs. A page8 pool
    is read by the row-group kernel only."""
    rowgroup = _fp4_rowgroup_enabled()
    workspaces = {}
    for ratio, meta in metadata_by_ratio.items():
        if not (rowgroup or ratio in page8_ratios):
            workspaces[ratio] = prepare_fp4_decode_workspace(
                meta.page_table,
                meta.compressed_seq_lens,
                page_table_bucket=LOW_RATIO_PAGE_TABLE_BUCKET,
            )
            continue
        rows = meta.page_table.shape[0]
        rows_per_request = (
            rows // num_requests if num_requests and rows % num_requests == 0 else 1
        )
        workspaces[ratio] = prepare_fp4_rowgroup_decode_workspace(
            meta.page_table,
            rows_per_request,
            page_table_bucket=LOW_RATIO_PAGE_TABLE_BUCKET,
            table_columns=rowgroup_table_columns(
                max_context_len, ratio, LOW_RATIO_PAGE_TABLE_BUCKET
            ),
        )
    return workspaces


def refresh_low_ratio_prefill_workspaces(
    metadata_by_ratio: Dict[int, PagedIndexerMetadata],
    previous: Optional[Dict[int, FP4PrefillWorkspace]],
    *,
    extend_lens: Optional[List[int]],
    max_context_len: int,
    page8_ratios: FrozenSet[int] = frozenset(),
) -> Dict[int, Union[FP4PrefillWorkspace, FP4RowgroupPrefillWorkspace]]:
    """Must run outside CUDA-graph capture; see prepare_fp4_prefill_workspace. A page8 pool
    scores on the row-group kernel, which takes no schedule, on a table as wide as
    ``max_context_len`` needs (without extend_lens, the indexer builds its workspace
    itself)."""
    previous = previous or {}
    workspaces = {}
    for ratio, meta in metadata_by_ratio.items():
        if ratio in page8_ratios:
            if extend_lens is not None:
                workspaces[ratio] = prepare_fp4_rowgroup_prefill_workspace(
                    meta.page_table,
                    extend_lens,
                    page_table_bucket=LOW_RATIO_PAGE_TABLE_BUCKET,
                    table_columns=rowgroup_table_columns(
                        max_context_len, ratio, LOW_RATIO_PAGE_TABLE_BUCKET
                    ),
                )
            continue
        workspaces[ratio] = prepare_fp4_prefill_workspace(
            meta.page_table,
            meta.compressed_seq_lens,
            workspace=previous.get(ratio),
            page_table_bucket=LOW_RATIO_PAGE_TABLE_BUCKET,
        )
    return workspaces


def low_ratio_identity_skip_enabled(
    *, index_topk: int, candidate_topk_blocks: int, candidate_block_size: int
) -> bool:
    """Whether identity requests may bypass scoring under this model config: the score-free
    candidate mask is right only while <= index_topk positions fit the candidate top-k."""
    return triton.cdiv(index_topk, candidate_block_size) <= candidate_topk_blocks


def _fill_identity_request(
    *,
    lc: int,
    slots_j: torch.Tensor,
    lens: torch.Tensor,
    page_rows: torch.Tensor,
    raw_rows: Optional[torch.Tensor],
) -> None:
    """Rows [t, topk] of the -1 filled buffers: column j < lc holds compressed
    position j (its slot / its raw index) when j < lens_row, else -1. An identity
    request publishes no candidates: every reachable block is one."""
    j = torch.arange(lc, device=lens.device)
    reach = j[None, :] < lens[:, None]
    page_rows[:, :lc] = torch.where(reach, slots_j[None, :], -1).to(torch.int32)
    if raw_rows is not None:
        raw_rows[:, :lc] = torch.where(reach, j[None, :], -1).to(torch.int32)


def _decode_batch_max_seq_len(forward_batch) -> Optional[int]:
    """The host-side longest context of a decode batch, None when unknown."""
    seq_lens_cpu = forward_batch.seq_lens_cpu
    if seq_lens_cpu is None or seq_lens_cpu.numel() == 0:
        return None
    return int(seq_lens_cpu.max().item())


def low_ratio_decode_rows_are_identity(backend, forward_batch, ratio: int) -> bool:
    """Decode: every row's compressed context fits index_topk, so nothing needs scoring. Inside a
    captured graph the answer is the variant being captured; eagerly it is the host-side batch
    maximum. Target-verify rows keep the scored path."""
    if not backend.low_ratio_identity_skip or forward_batch is None:
        return False
    if not forward_batch.forward_mode.is_decode():
        return False
    from sglang.srt.model_executor.runner_utils.capture_mode import (
        get_is_capture_mode,
        skip_low_ratio_indexer,
    )

    if get_is_capture_mode():
        return skip_low_ratio_indexer(ratio)
    max_len = _decode_batch_max_seq_len(forward_batch)
    return max_len is not None and max_len // ratio <= backend.index_topk


def low_ratio_candidate_span(hf_text_config) -> Optional[int]:
    """The span (in positions) within which every block of a request is a
    candidate, when the model has a candidate source; None otherwise."""
    # optional HF-config keys: a model without a candidate source lacks them
    if getattr(hf_text_config, "candidate_source_layer_id", -1) < 0:
        return None
    span = getattr(hf_text_config, "candidate_topk_blocks", 0) * getattr(
        hf_text_config, "candidate_block_size", 0
    )
    return span if span > 0 else None


def low_ratio_decode_rows_fit_candidate_span(backend, forward_batch) -> bool:
    """Decode: every request's context fits the candidate span, so two-level top-k equals the plain
    paged top-k. Captured: the variant being captured; eager: the host-side batch maximum."""
    span = backend.low_ratio_candidate_span
    if span is None or forward_batch is None:
        return False
    if not (
        forward_batch.forward_mode.is_decode()
        or forward_batch.forward_mode.is_target_verify()
    ):
        return False
    from sglang.srt.model_executor.runner_utils.capture_mode import (
        get_capture_attention_variant,
        get_is_capture_mode,
    )

    if get_is_capture_mode():
        return get_capture_attention_variant() in (
            "candidate_all",
            "candidate_c2_all",
            "candidate_unfiltered",
        )
    max_len = _decode_batch_max_seq_len(forward_batch)
    if forward_batch.forward_mode.is_target_verify():
        if max_len is None:
            return False
        max_len += backend.speculative_num_draft_tokens
    return max_len is not None and max_len <= span


def low_ratio_index_topk_hip_decode(
    backend, layer, x, q_lora, pos, forward_batch: ForwardBatch
) -> None:
    """One token per request: paged fp4 logits over every visible compressed slot, level-one
    candidate blocks where the layer publishes or consumes them, then the top-k transform
    writes the -1 padded page indices."""
    pool = backend.token_to_kv_pool
    metadata = backend.forward_metadata
    core = metadata.core_metadata
    ratio = layer.compress_ratio
    indexer = layer.indexer
    indexer_metadata = metadata.low_ratio_indexer_metadata(ratio)
    assert indexer_metadata is not None, f"no decode indexer metadata for {ratio = }"
    page_indices = core.sparse_page_indices(ratio)
    raw_indices = core.sparse_raw_indices(ratio)

    if low_ratio_decode_rows_are_identity(backend, forward_batch, ratio):
        # every row takes the transform's sequential branch (len <= topk), which reads no scores
        scores = torch.empty(
            (page_indices.shape[0], 1), dtype=torch.float32, device=pos.device
        )
        topk_transform_paged(
            scores,
            indexer_metadata.compressed_seq_lens,
            indexer_metadata.page_table,
            page_indices,
            indexer_metadata.compressed_page_size,
            raw_indices,
        )
        return

    two_level = indexer.is_candidate_source or indexer.uses_candidates
    if two_level and low_ratio_decode_rows_fit_candidate_span(backend, forward_batch):
        # every block is a candidate: the source publishes nothing, every layer runs the plain top-k
        if indexer.is_candidate_source:
            backend.candidate_masks = None
        two_level = False

    q_fp4, q_scale, weights = _indexer_inputs(layer, x, q_lora, pos)
    k_payload = pool.get_index_k_fp4_payload_buffer(layer.layer_id)
    k_scale = pool.get_index_k_fp4_scale_buffer(layer.layer_id)
    page8 = pool.low_ratio_index_k_page8(layer.layer_id)
    if two_level and indexer.uses_candidates:
        candidates = backend.candidate_masks
        assert (
            isinstance(candidates, CandidateBlocks)
            and candidates.ids.shape[0] == q_fp4.shape[0]
            and candidates.block_size == indexer.candidate_block_size
        ), "candidate blocks missing for decode"
        if page8:
            topk_within_candidate_blocks_page8(
                q_fp4=q_fp4,
                q_scale=q_scale,
                weights=weights,
                k_payload=k_payload,
                k_scale=k_scale,
                candidates=candidates,
                seq_lens=indexer_metadata.compressed_seq_lens,
                page_table=indexer_metadata.page_table,
                page_size=indexer_metadata.compressed_page_size,
                page_indices=core.sparse_page_indices(ratio),
                raw_indices=core.sparse_raw_indices(ratio),
                is_decode=True,
            )
            return
    logits = aiter_fp4_paged_mqa_logits(
        q_fp4=q_fp4,
        q_scale=q_scale,
        k_payload=k_payload,
        k_scale=k_scale,
        weights=weights,
        page_table=indexer_metadata.page_table,
        c4_seq_lens=indexer_metadata.compressed_seq_lens,
        weight_scale=1.0,
        page_table_bucket=LOW_RATIO_PAGE_TABLE_BUCKET,
        is_decode=True,
        decode_workspace=metadata.fp4_low_ratio_decode_workspaces.get(ratio),
        page8=page8,
        rowgroup_table_columns=rowgroup_table_columns(
            backend.max_context_len, ratio, LOW_RATIO_PAGE_TABLE_BUCKET
        ),
    )
    # level one is bounded on device by the compressed lengths: a captured step cannot read them back
    if two_level and indexer.uses_candidates:
        topk_within_candidate_blocks_hip(
            logits,
            indexer_metadata.compressed_seq_lens,
            candidates,
            page_table=indexer_metadata.page_table,
            page_size=indexer_metadata.compressed_page_size,
            page_indices=core.sparse_page_indices(ratio),
            raw_indices=core.sparse_raw_indices(ratio),
        )
        return
    if two_level and indexer.is_candidate_source:
        candidates = select_candidate_blocks_hip(
            logits,
            indexer_metadata.compressed_seq_lens,
            topk_blocks=indexer.candidate_topk_blocks,
            block_size=indexer.candidate_block_size,
        )
        if page8:
            candidates = with_candidate_page8_table(
                candidates,
                indexer_metadata.compressed_seq_lens,
                indexer_metadata.page_table,
                page_size=indexer_metadata.compressed_page_size,
            )
        backend.candidate_masks = candidates
    topk_transform_paged_hip(
        logits,
        indexer_metadata.compressed_seq_lens,
        indexer_metadata.page_table,
        page_indices,
        indexer_metadata.compressed_page_size,
        raw_indices,
    )


def _extend_k_slots(req_to_token, *, ratio, lc_per_req, req_pool_indices, device):
    """Per request, the c1/c2 pool slots of its visible compressed positions, and
    each request's start offset in their concatenation."""
    starts = [0, *itertools.accumulate(lc_per_req)][:-1]
    counts = torch.tensor(lc_per_req, dtype=torch.int64, device=device)
    req_rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), counts)
    j = torch.arange(int(counts.sum()), device=device) - torch.repeat_interleave(
        torch.tensor(starts, dtype=torch.int64, device=device), counts
    )
    slots = req_to_token[req_rows, j * ratio].to(torch.int64) // ratio
    return slots, starts


def low_ratio_index_topk_hip_extend(
    backend,
    layer,
    x,
    q_lora,
    pos,
    forward_batch: ForwardBatch,
) -> None:
    """Ragged prefill: the FlyDSL prefill kernel scores every token's visible compressed positions,
    candidate masks are published or applied per request, one paged top-k selects every row.
    Identity requests are written without scores; an all-identity batch skips the kernel."""
    pool = backend.token_to_kv_pool
    metadata = backend.forward_metadata
    core = metadata.core_metadata
    ratio = layer.compress_ratio
    indexer = layer.indexer
    page_indices = core.sparse_page_indices(ratio)
    raw_indices = core.sparse_raw_indices(ratio)
    page_indices.fill_(-1)
    if raw_indices is not None:
        raw_indices.fill_(-1)

    seq_lens_cpu = _as_int_list(forward_batch.seq_lens_cpu)
    # bounded replay counts cover only each request's tail
    if metadata.late_layer_tail is not None:
        extend_lens_cpu = metadata.late_layer_tail.extend_seq_lens_cpu
    else:
        extend_lens_cpu = _as_int_list(forward_batch.extend_seq_lens_cpu)
    assert seq_lens_cpu is not None and extend_lens_cpu is not None
    lc_per_req = [s // ratio for s in seq_lens_cpu]
    if pos.numel() == 0 or not any(lc_per_req):
        if indexer.is_candidate_source:
            backend.candidate_masks = [None] * len(lc_per_req)
        return

    if backend.low_ratio_identity_skip:
        # identity: every row selects all its visible compressed positions
        is_identity = [s // ratio <= indexer.index_topk for s in seq_lens_cpu]
    else:
        is_identity = [False] * len(seq_lens_cpu)
    compress_lens = ((pos + 1) // ratio).to(torch.int32)
    consume = backend.candidate_masks if indexer.uses_candidates else None
    publish = [] if indexer.is_candidate_source else None
    if any(is_identity):
        # only the score-free fill resolves slots itself; scored rows resolve in the top-k transform
        k_slots, starts = _extend_k_slots(
            backend.req_to_token,
            ratio=ratio,
            lc_per_req=lc_per_req,
            req_pool_indices=forward_batch.req_pool_indices.to(torch.int64),
            device=pos.device,
        )

    def fill_identity_requests(req_lo, req_hi, tok_lo):
        """Identity requests req_lo..req_hi: rows written without scores, None published per request."""
        tok = tok_lo
        for b in range(req_lo, req_hi):
            t_len, lc = extend_lens_cpu[b], lc_per_req[b]
            rows = slice(tok, tok + t_len)
            tok += t_len
            if lc == 0:
                if publish is not None:
                    publish.append(None)
                continue
            _fill_identity_request(
                lc=lc,
                slots_j=k_slots[starts[b] : starts[b] + lc],
                lens=compress_lens[rows],
                page_rows=page_indices[rows],
                raw_rows=None if raw_indices is None else raw_indices[rows],
            )
            if publish is not None:
                publish.append(None)

    if all(is_identity):
        fill_identity_requests(0, len(extend_lens_cpu), 0)
        if publish is not None:
            backend.candidate_masks = publish
        return

    indexer_metadata = metadata.low_ratio_indexer_metadata(ratio)
    assert indexer_metadata is not None, f"no prefill indexer metadata for {ratio = }"
    num_tokens = pos.shape[0]
    assert indexer_metadata.page_table.shape[0] >= num_tokens
    q_fp4, q_scale, weights = _indexer_inputs(layer, x, q_lora, pos)
    k_payload = pool.get_index_k_fp4_payload_buffer(layer.layer_id)
    k_scale = pool.get_index_k_fp4_scale_buffer(layer.layer_id)
    prefill_workspace = metadata.fp4_low_ratio_prefill_workspaces.get(ratio)
    page8 = pool.low_ratio_index_k_page8(layer.layer_id)
    if page8 and not (
        isinstance(prefill_workspace, FP4RowgroupPrefillWorkspace)
        and prefill_workspace.request_page_table.shape[0] == len(extend_lens_cpu)
    ):
        prefill_workspace = prepare_fp4_rowgroup_prefill_workspace(
            indexer_metadata.page_table,
            extend_lens_cpu,
            page_table_bucket=LOW_RATIO_PAGE_TABLE_BUCKET,
            table_columns=rowgroup_table_columns(
                backend.max_context_len, ratio, LOW_RATIO_PAGE_TABLE_BUCKET
            ),
        )

    def score_rows(
        rows: slice, req_lo: int, rows_per_request: List[int]
    ) -> torch.Tensor:
        if page8:
            return _score_requests_page8(
                q_fp4=q_fp4[rows],
                q_scale=q_scale[rows],
                weights=weights[rows],
                k_payload=k_payload,
                k_scale=k_scale,
                workspace=prefill_workspace,
                rows=rows,
                req_lo=req_lo,
                rows_per_request=rows_per_request,
                row_ends=indexer_metadata.compressed_seq_lens[rows],
            )
        return aiter_fp4_paged_mqa_logits(
            q_fp4=q_fp4[rows],
            q_scale=q_scale[rows],
            k_payload=k_payload,
            k_scale=k_scale,
            weights=weights[rows],
            page_table=indexer_metadata.page_table[rows],
            c4_seq_lens=indexer_metadata.compressed_seq_lens[rows],
            weight_scale=1.0,
            page_table_bucket=LOW_RATIO_PAGE_TABLE_BUCKET,
            is_decode=False,
            prefill_workspace=prefill_workspace if rows.start == 0 else None,
        )

    def select_rows_page8_consumer(rows: slice, req_lo, rows_per_request, consume_rows):
        """A consumer on a page8 pool scores only a request's candidate blocks."""

        def full_logits(r: slice, b: int) -> torch.Tensor:
            g = slice(rows.start + r.start, rows.start + r.stop)
            return score_rows(g, req_lo + b, [r.stop - r.start])

        def within(r: slice, candidates, rows_page, rows_raw) -> None:
            g = slice(rows.start + r.start, rows.start + r.stop)
            topk_within_candidate_blocks_page8(
                q_fp4=q_fp4[g],
                q_scale=q_scale[g],
                weights=weights[g],
                k_payload=k_payload,
                k_scale=k_scale,
                candidates=candidates,
                seq_lens=compress_lens[g],
                page_table=indexer_metadata.page_table[g],
                page_size=indexer_metadata.compressed_page_size,
                page_indices=rows_page,
                raw_indices=rows_raw,
                is_decode=False,
            )

        _consume_candidates_per_request(
            extend_lens_cpu=rows_per_request,
            consume=consume_rows,
            compress_lens=compress_lens[rows],
            page_table=indexer_metadata.page_table[rows],
            page_size=indexer_metadata.compressed_page_size,
            page_indices=page_indices[rows],
            raw_indices=raw_indices[rows] if raw_indices is not None else None,
            full_logits=full_logits,
            within=within,
        )

    def select_rows(
        rows: slice, req_lo, req_hi, group_is_identity, consume_rows, publish
    ):
        rows_per_request = (
            [rows.stop - rows.start]
            if req_hi == req_lo + 1
            else extend_lens_cpu[req_lo:req_hi]
        )
        if page8 and consume_rows is not None:
            select_rows_page8_consumer(rows, req_lo, rows_per_request, consume_rows)
            return
        _select_topk_extend_hip(
            indexer=indexer,
            logits=score_rows(rows, req_lo, rows_per_request),
            lc_per_req=lc_per_req[req_lo:req_hi],
            extend_lens_cpu=rows_per_request,
            is_identity=group_is_identity,
            compress_lens=compress_lens[rows],
            page_table=indexer_metadata.page_table[rows],
            page_size=indexer_metadata.compressed_page_size,
            page_indices=page_indices[rows],
            raw_indices=raw_indices[rows] if raw_indices is not None else None,
            consume=consume_rows,
            publish=publish,
        )

    # group requests to fit the pooled logits block; rows are independent, so grouping is exact
    rows_per_chunk = logits_rows_per_chunk(
        indexer_metadata.page_table, LOW_RATIO_PAGE_TABLE_BUCKET
    )
    groups = _request_groups(extend_lens_cpu, rows_per_chunk)
    for req_lo, req_hi, tok_lo, tok_hi in groups:
        group_is_identity = is_identity[req_lo:req_hi]
        if all(group_is_identity):
            fill_identity_requests(req_lo, req_hi, tok_lo)
            continue
        if tok_hi - tok_lo <= rows_per_chunk:
            select_rows(
                slice(tok_lo, tok_hi),
                req_lo,
                req_hi,
                group_is_identity,
                None if consume is None else consume[req_lo:req_hi],
                publish,
            )
            continue
        # a request wider than the logits block: scored in row chunks, its mask published in one piece
        assert req_hi == req_lo + 1, (req_lo, req_hi)
        pieces = []
        for lo in range(tok_lo, tok_hi, rows_per_chunk):
            rows = slice(lo, min(lo + rows_per_chunk, tok_hi))
            piece = [] if publish is not None else None
            consume_rows = None
            if consume is not None:
                consume_rows = [
                    None
                    if consume[req_lo] is None
                    else slice_candidate_blocks(
                        consume[req_lo], slice(lo - tok_lo, rows.stop - tok_lo)
                    )
                ]
            select_rows(rows, req_lo, req_hi, group_is_identity, consume_rows, piece)
            if piece:
                pieces.append(piece[0])
        if publish is not None:
            publish.append(cat_candidate_blocks(pieces))
    if publish is not None:
        if page8:
            assert len(publish) == len(extend_lens_cpu), (len(publish), extend_lens_cpu)
            tok = 0
            for b, candidates in enumerate(publish):
                r = slice(tok, tok + extend_lens_cpu[b])
                tok = r.stop
                if candidates is not None:
                    publish[b] = with_candidate_page8_table(
                        candidates,
                        compress_lens[r],
                        indexer_metadata.page_table[r],
                        page_size=indexer_metadata.compressed_page_size,
                    )
        backend.candidate_masks = publish


def _select_topk_extend_hip(
    *,
    indexer,
    logits: torch.Tensor,
    lc_per_req: List[int],
    extend_lens_cpu: List[int],
    is_identity: List[bool],
    compress_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    page_indices: torch.Tensor,
    raw_indices: Optional[torch.Tensor],
    consume: Optional[List[Optional[CandidateBlocks]]],
    publish: Optional[List[Optional[CandidateBlocks]]],
) -> None:
    """Row t of logits scores its request's compressed positions in columns 0..lc-1, reachable
    up to compress_lens[t]. A source layer publishes one CandidateBlocks per request (None
    for identity / empty), a consumer selects inside its published blocks, others run one paged top-k."""
    assert page_indices.shape[1] == indexer.index_topk, (
        f"the paged top-k selects page_indices.shape[1] = {page_indices.shape[1]} "
        f"slots, the indexer wants {indexer.index_topk}"
    )
    if publish is not None:
        tok_start = 0
        for b, (lc, t_len) in enumerate(zip(lc_per_req, extend_lens_cpu)):
            rows = slice(tok_start, tok_start + t_len)
            tok_start += t_len
            if lc == 0 or t_len == 0 or is_identity[b]:
                # Consumers index the publication by request, so keep the slot.
                publish.append(None)
                continue
            step = max(1, _CANDIDATE_SCORE_BUDGET_BYTES // (lc * 4))
            pieces = []
            for lo in range(0, t_len, step):
                chunk = slice(rows.start + lo, rows.start + min(lo + step, t_len))
                pieces.append(
                    select_candidate_blocks_hip(
                        logits[chunk, :lc],
                        compress_lens[chunk],
                        topk_blocks=indexer.candidate_topk_blocks,
                        block_size=indexer.candidate_block_size,
                    )
                )
            publish.append(cat_candidate_blocks(pieces))
    if consume is not None:
        _consume_candidates_per_request(
            extend_lens_cpu=extend_lens_cpu,
            consume=consume,
            compress_lens=compress_lens,
            page_table=page_table,
            page_size=page_size,
            page_indices=page_indices,
            raw_indices=raw_indices,
            full_logits=lambda rows, b: logits[rows],
            within=lambda rows, candidates, rows_page, rows_raw: (
                topk_within_candidate_blocks_hip(
                    logits[rows],
                    compress_lens[rows],
                    candidates,
                    page_table=page_table[rows],
                    page_size=page_size,
                    page_indices=rows_page,
                    raw_indices=rows_raw,
                )
            ),
        )
        return
    topk_transform_paged_hip(
        logits,
        compress_lens.contiguous(),
        page_table,
        page_indices,
        page_size,
        raw_indices,
    )


def _consume_candidates_per_request(
    *,
    extend_lens_cpu: List[int],
    consume: List[Optional[CandidateBlocks]],
    compress_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    page_indices: torch.Tensor,
    raw_indices: Optional[torch.Tensor],
    full_logits: Callable[[slice, int], torch.Tensor],
    within: Callable[
        [slice, CandidateBlocks, torch.Tensor, Optional[torch.Tensor]], None
    ],
) -> None:
    """A consumer layer's rows, request by request: within(rows, candidates, ...) selects inside
    the published blocks; a request with none runs the paged top-k of full_logits(rows, b)."""
    tok_start = 0
    for b, t_len in enumerate(extend_lens_cpu):
        rows = slice(tok_start, tok_start + t_len)
        tok_start += t_len
        if t_len == 0:
            continue
        rows_page = page_indices[rows]
        rows_raw = raw_indices[rows] if raw_indices is not None else None
        if consume[b] is None:
            topk_transform_paged_hip(
                full_logits(rows, b),
                compress_lens[rows].contiguous(),
                page_table[rows],
                rows_page,
                page_size,
                rows_raw,
            )
        else:
            within(rows, consume[b], rows_page, rows_raw)


def _request_groups(
    extend_lens_cpu: List[int], rows_per_chunk: int
) -> List[Tuple[int, int, int, int]]:
    """Consecutive request groups whose token rows fit rows_per_chunk (a single
    request always forms a group): (req_lo, req_hi, tok_lo, tok_hi)."""
    groups = []
    req_lo, tok_lo, tok = 0, 0, 0
    for r, t_len in enumerate(extend_lens_cpu):
        if r > req_lo and tok + t_len - tok_lo > rows_per_chunk:
            groups.append((req_lo, r, tok_lo, tok))
            req_lo, tok_lo = r, tok
        tok += t_len
    groups.append((req_lo, len(extend_lens_cpu), tok_lo, tok))
    return groups


def store_index_k_split(
    pool, layer, indexer, latent, freqs_cis, pos, out_loc, layer_id: int
) -> None:
    """The c1 / c2 decode index-K store into ROCm's split pools: payload and scales in
    two buffers, where CUDA packs one fused [.., 68]-byte row."""
    index_k_norm_rope_pack_store_split(
        indexer.forward_wk(latent),
        indexer.k_norm.weight.data,
        indexer.k_norm.eps,
        freqs_cis,
        pos,
        out_loc,
        pool.get_index_k_fp4_payload_buffer(layer_id),
        pool.get_index_k_fp4_scale_buffer(layer_id),
        ratio=layer.compress_ratio,
        page8=pool.low_ratio_index_k_page8(layer_id),
    )
