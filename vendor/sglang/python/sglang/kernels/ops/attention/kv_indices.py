from typing import Optional

import triton
import triton.language as tl

_FLASHMLA_CREATE_KV_BLOCK_SIZE = 4096
FLASHMLA_CREATE_KV_BLOCK_SIZE_TRITON = tl.constexpr(_FLASHMLA_CREATE_KV_BLOCK_SIZE)

# Token-block parallelism for the index-copy kernels below: aim for about
# _TARGET_PROGRAMS programs in total, one extra block per
# _MIN_TOKENS_PER_BLOCK of table width at most, and fall back to the
# historical single-block grid when the base grid is already wide.
_MIN_TOKENS_PER_BLOCK = 8192
_TARGET_PROGRAMS = 512


def kv_indices_num_token_blocks(table_width: int, base_programs: int) -> int:
    cap = (table_width + _MIN_TOKENS_PER_BLOCK - 1) // _MIN_TOKENS_PER_BLOCK
    want = _TARGET_PROGRAMS // max(1, base_programs)
    return max(1, min(cap, want))


# Token-block parallelism pays only on long-context servers; below this the
# spec-decode index launches keep their historical grids.
SPEC_KV_INDEX_BLOCKS_MIN_CONTEXT = 32768


def spec_kv_index_token_blocks(
    table_width: int,
    kv_lens_sum: Optional[int],
    batch_size: int,
    base_programs: Optional[int] = None,
    length_cap: Optional[int] = None,
    context_len: Optional[int] = None,
) -> int:
    """Token blocks per base program for a spec-decode KV-index launch.

    1 below the long-context gate (``context_len``, default ``table_width``).
    Otherwise sized from an upper bound on the longest live row — the launch
    time is set by the longest row, and ``kv_lens_sum`` bounds it from above
    while still a host int (tightened by ``length_cap`` and ``table_width``,
    which also bound any single row). Any block count is correct; it only
    changes the parallelism.
    """
    gate = table_width if context_len is None else context_len
    if gate < SPEC_KV_INDEX_BLOCKS_MIN_CONTEXT or batch_size <= 0:
        return 1
    if kv_lens_sum is None:
        width = table_width
    else:
        width = min(kv_lens_sum, table_width)
        if length_cap is not None:
            width = min(width, length_cap)
    programs = batch_size if base_programs is None else base_programs
    return kv_indices_num_token_blocks(width, programs)


@triton.jit
def create_flashinfer_kv_indices_triton(
    req_to_token_ptr,  # [max_batch, max_context_len] token table; at
    # ENTRY_PAGE_SIZE > 1 a PAGE-granular table (the unified pool's read table)
    req_pool_indices_ptr,
    page_kernel_lens_ptr,
    kv_indptr,
    kv_start_idx,
    kv_indices_ptr,
    # Runtime, not constexpr: the translator's eager table is allocated at the
    # batch's live width, so a constexpr stride would JIT-specialize per width
    # (a recompile every few decode steps at small page sizes).
    req_to_token_ptr_stride,
    ENTRY_PAGE_SIZE: tl.constexpr = 1,
    TOKEN_BLOCK_PARALLEL: tl.constexpr = False,
    token_mapping=None,
):
    """Gather per-request token ids into a flat CSR kv_indices stream.

    ``ENTRY_PAGE_SIZE == 1`` (default): the source table is token-granular and
    entries are emitted verbatim -- byte-identical to the historical kernel.
    ``ENTRY_PAGE_SIZE == ps``: the source is the translator's PAGE-granular
    read table (entries already physical page ids); token ids are rebuilt
    as ``token = entry * ps + pos % ps``, exact because converting an id keeps
    its offset inside the page.
    ``TOKEN_BLOCK_PARALLEL`` (default False): launched on a 2D grid
    ``(batch, num_blocks)``, the programs of a request stride over its copy
    loop together instead of one program crawling the whole context serially
    (which bottlenecks long-context spec decode, where this kernel runs every
    iteration). With the default, the kernel is the historical
    one-program-per-request loop and 1D launch sites are unaffected.
    ``token_mapping`` remaps gathered token ids in the same pass, preserving -1.
    """
    BLOCK_SIZE: tl.constexpr = 512
    pid = tl.program_id(axis=0)
    if TOKEN_BLOCK_PARALLEL:
        blk = tl.program_id(axis=1)
        num_blk = tl.num_programs(axis=1)
    else:
        blk = 0
        num_blk = 1

    # find the req pool idx, this is for batch to token
    req_pool_index = tl.load(req_pool_indices_ptr + pid).to(tl.int64)
    kv_indices_offset = tl.load(kv_indptr + pid)

    kv_start = 0
    kv_end = 0
    if kv_start_idx:
        kv_start = tl.load(kv_start_idx + pid).to(tl.int32)
        kv_end = kv_start
    kv_end += tl.load(page_kernel_lens_ptr + pid).to(tl.int32)

    num_loop = tl.cdiv(kv_end - kv_start, BLOCK_SIZE)
    if TOKEN_BLOCK_PARALLEL:
        # Blocks with no copy work exit early.
        if blk >= num_loop:
            return
    for i in range(blk, num_loop, num_blk):
        # index into req_to_token_ptr needs to be int64
        offset = tl.arange(0, BLOCK_SIZE).to(tl.int64) + i * BLOCK_SIZE
        mask = offset < kv_end - kv_start
        if ENTRY_PAGE_SIZE == 1:
            data = tl.load(
                req_to_token_ptr
                + req_pool_index * req_to_token_ptr_stride
                + kv_start
                + offset,
                mask=mask,
            )
        else:
            pos = kv_start + offset
            entry = tl.load(
                req_to_token_ptr
                + req_pool_index * req_to_token_ptr_stride
                + pos // ENTRY_PAGE_SIZE,
                mask=mask,
            )
            data = entry.to(tl.int64) * ENTRY_PAGE_SIZE + pos % ENTRY_PAGE_SIZE
        if token_mapping is not None:
            data = tl.load(token_mapping + data, mask=mask & (data >= 0), other=-1)
        tl.store(kv_indices_ptr + kv_indices_offset + offset, data, mask=mask)


@triton.jit
def create_chunked_prefix_cache_kv_indices(
    req_to_token_ptr,  # (max_batch, max_context_len,)
    req_pool_indices_ptr,  # (batch_size,)
    chunk_start_idx_ptr,  # (batch_size,)
    chunk_seq_lens_ptr,  # (batch_size,)
    chunk_cu_seq_lens_ptr,  # (batch_size + 1,)
    chunk_kv_indices_ptr,  # (num_chunk_tokens,)
    req_to_token_ptr_stride: tl.constexpr,
):
    BLOCK_SIZE: tl.constexpr = 512
    pid = tl.program_id(axis=0)

    # find the req pool idx, this is for batch to token
    req_pool_index = tl.load(req_pool_indices_ptr + pid)
    chunk_kv_indices_offset = tl.load(chunk_cu_seq_lens_ptr + pid)

    # get the token positions of current chunk
    chunk_start_pos = tl.load(chunk_start_idx_ptr + pid).to(tl.int32)
    chunk_seq_len = tl.load(chunk_seq_lens_ptr + pid).to(tl.int32)

    num_loop = tl.cdiv(chunk_seq_len, BLOCK_SIZE)
    for i in range(num_loop):
        offset = tl.arange(0, BLOCK_SIZE) + i * BLOCK_SIZE
        mask = offset < chunk_seq_len
        data = tl.load(
            req_to_token_ptr
            + req_pool_index * req_to_token_ptr_stride
            + chunk_start_pos
            + offset,
            mask=mask,
        )
        tl.store(
            chunk_kv_indices_ptr + chunk_kv_indices_offset + offset, data, mask=mask
        )


def get_num_page_per_block_flashmla(page_size: int = 64) -> int:
    num_page_per_block = _FLASHMLA_CREATE_KV_BLOCK_SIZE // page_size
    return num_page_per_block


def get_num_kv_index_blocks_flashmla(kv_indices_width: int, page_size: int) -> int:
    """Grid axis-1 size for create_flashmla_kv_indices_triton: the number of
    page-blocks spanning the widest sequence (one CTA per block). kv_indices_width
    is the per-row width of the kv_indices buffer (the kernel's kv_indices_ptr_stride).
    """
    npb = get_num_page_per_block_flashmla(page_size)
    return (kv_indices_width + npb - 1) // npb


@triton.jit
def create_flashmla_kv_indices_triton(
    req_to_token_ptr,  # [max_batch, max_context_len]
    req_pool_indices_ptr,
    page_kernel_lens_ptr,
    kv_start_idx,
    kv_indices_ptr,
    req_to_token_ptr_stride: tl.constexpr,
    kv_indices_ptr_stride: tl.constexpr,
    PAGED_SIZE: tl.constexpr = 64,
):
    # Static-pool builder only: token ids here are physical, entry = token//ps.
    # The unified pool's block table is filled by KVIndexTranslator instead.
    NUM_PAGE_PER_BLOCK: tl.constexpr = (
        FLASHMLA_CREATE_KV_BLOCK_SIZE_TRITON // PAGED_SIZE
    )
    pid = tl.program_id(axis=0)

    # find the req pool idx, this is for batch to token
    req_pool_index = tl.load(req_pool_indices_ptr + pid)

    kv_start = 0
    kv_end = 0
    if kv_start_idx:
        kv_start = tl.load(kv_start_idx + pid).to(tl.int32)
        kv_end = kv_start

    kv_end += tl.load(page_kernel_lens_ptr + pid).to(tl.int32)

    num_paged = tl.cdiv(kv_end - kv_start, PAGED_SIZE)
    num_pages_loop = tl.cdiv(kv_end - kv_start, FLASHMLA_CREATE_KV_BLOCK_SIZE_TRITON)

    # One CTA per page-block (grid axis 1) rather than one CTA looping all blocks;
    # CTAs beyond this sequence's block count are guarded out.
    i = tl.program_id(axis=1)
    if i < num_pages_loop:
        # index into req_to_token_ptr needs to be int64
        paged_offset = (
            tl.arange(0, NUM_PAGE_PER_BLOCK).to(tl.int64) + i * NUM_PAGE_PER_BLOCK
        ) * PAGED_SIZE
        paged_offset_out = tl.arange(0, NUM_PAGE_PER_BLOCK) + i * NUM_PAGE_PER_BLOCK

        mask = paged_offset < num_paged * PAGED_SIZE
        mask_out = paged_offset_out < num_paged

        data = tl.load(
            req_to_token_ptr
            + req_pool_index * req_to_token_ptr_stride
            + kv_start
            + paged_offset,
            mask=mask,
        )
        tl.store(
            kv_indices_ptr + pid * kv_indices_ptr_stride + paged_offset_out,
            data // PAGED_SIZE,
            mask=mask_out,
        )
