# Mixin class for metadata management of Deepseek MHA forward (chunked prefix cache)
# More details can be found in python/sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py

from typing import List, Optional

import torch

from sglang.kernels.ops.attention.kv_indices import (
    create_chunked_prefix_cache_kv_indices,
    create_flashinfer_kv_indices_triton,
)
from sglang.srt.environ import envs
from sglang.srt.layers.dcp.layout import filter_dcp_local_chunk_kv_indices
from sglang.srt.model_executor.forward_context import (
    get_attn_backend,
    get_req_to_token_pool,
    get_token_to_kv_pool,
)


class ForwardBatchDeepSeekMHAMixin:
    # For MLA chunked prefix cache used in chunked prefill
    # Tell attention backend whether the kv cache needs to be attended in current pass
    attn_attend_prefix_cache: Optional[bool] = None
    # Number of prefix cache chunks
    num_prefix_chunks: Optional[int] = None
    # Index of current chunk, used by attention backend
    prefix_chunk_idx: Optional[int] = None
    # Maximum number of tokens in each chunk per sequence. Computed from maximum chunk capacity
    prefix_chunk_len: Optional[int] = None
    # Start positions of prefix cache for each chunk, (num_prefix_chunks, batch_size)
    prefix_chunk_starts: Optional[torch.Tensor] = None
    # Start positions of prefix cache for each chunk, (num_prefix_chunks, batch_size), need prefix_chunk_starts_cpu for dcp all gather kv cache
    prefix_chunk_starts_cpu: Optional[torch.Tensor] = None
    # length of prefix cache for each chunk, (num_prefix_chunks, batch_size)
    prefix_chunk_seq_lens_cpu: Optional[torch.Tensor] = None
    # Lengths of prefix cache for each chunk, (num_prefix_chunks, batch_size)
    prefix_chunk_seq_lens: Optional[torch.Tensor] = None
    # Accumulated lengths of prefix cache for each chunk, (num_prefix_chunks, batch_size + 1)
    prefix_chunk_cu_seq_lens: Optional[torch.Tensor] = None
    # Max lengths of prefix cache for each chunk, (num_prefix_chunks,)
    prefix_chunk_max_seq_lens: Optional[List[int]] = None
    # Per-chunk flag: True if any sequence has kv_len==0 in that chunk.
    # Precomputed on CPU to avoid GPU-CPU sync in the hot path.
    prefix_chunk_has_zero_kv: Optional[List[bool]] = None
    # Number of tokens in each prefix cache chunk, (num_prefix_chunks,)
    prefix_chunk_num_tokens: Optional[List[int]] = None
    # KV Indices for each chunk
    prefix_chunk_kv_indices: Optional[List[torch.Tensor]] = None
    # All chunk KV indices in chunk-major order. The packed dense-prefix path
    # gathers this once, then slices materialized K/V by chunk token count.
    prefix_all_kv_indices: Optional[torch.Tensor] = None
    # Reusable identity indices into a temporary dense prefix K/V buffer.
    prefix_dense_kv_indices: Optional[torch.Tensor] = None
    # Reusable empty prefix indptr for current-chunk-only attention.
    mha_empty_kv_indptr: Optional[torch.Tensor] = None
    # For MLA chunked prefix cache used in chunked prefill
    # Tell attention backend whether lse needs to be returned
    mha_return_lse: Optional[bool] = None
    # Packed dense prefix K/V for one fused prefix+extend attention launch.
    # These are set only for the duration of an attention call.
    fused_prefix_k: Optional[torch.Tensor] = None
    fused_prefix_v: Optional[torch.Tensor] = None
    # Whether to apply MHA_ONE_SHOT forward method
    mha_one_shot: Optional[bool] = None
    # KV Indices for MHA_ONE_SHOT forward method
    mha_one_shot_kv_indices: Optional[torch.Tensor] = None

    def get_max_chunk_capacity(self):
        return envs.SGLANG_MAX_KV_CHUNK_CAPACITY.get()

    def set_prefix_chunk_idx(self, idx: int):
        self.prefix_chunk_idx = idx

    def set_attn_attend_prefix_cache(self, attn_attend_prefix_cache: bool):
        self.attn_attend_prefix_cache = attn_attend_prefix_cache

    def prepare_chunked_kv_indices(
        self,
        device: torch.device,
        pack_all_prefix_chunks: bool = False,
        dense_metadata: bool = False,
    ):
        self.prefix_chunk_kv_indices = []
        req_to_token = get_req_to_token_pool().req_to_token
        translator = get_attn_backend().kv_index_translator
        for idx in range(self.num_prefix_chunks):
            chunk_starts = self.prefix_chunk_starts[idx]
            chunk_seq_lens = self.prefix_chunk_seq_lens[idx]
            chunk_cu_seq_lens = self.prefix_chunk_cu_seq_lens[idx]
            num_chunk_tokens = self.prefix_chunk_num_tokens[idx]

            chunk_kv_indices = torch.empty(
                num_chunk_tokens, dtype=torch.int32, device=device
            )

            if translator.reads_are_translated:
                # The plan's table already holds the chunk's physical ids.
                translator.pack_read_stream(
                    self.kv_loc_plan,
                    req_pool_indices=self.req_pool_indices,
                    seq_lens=chunk_seq_lens,
                    indptr=chunk_cu_seq_lens,
                    out=chunk_kv_indices,
                    kv_start_idx=chunk_starts,
                )
                self.prefix_chunk_kv_indices.append(chunk_kv_indices)
                continue
            create_chunked_prefix_cache_kv_indices[(self.batch_size,)](
                req_to_token,
                self.req_pool_indices,
                chunk_starts,
                chunk_seq_lens,
                chunk_cu_seq_lens,
                chunk_kv_indices,
                req_to_token.shape[1],
            )
            chunk_kv_indices = filter_dcp_local_chunk_kv_indices(
                chunk_kv_indices,
                self.prefix_chunk_starts_cpu[idx],
                self.prefix_chunk_seq_lens_cpu[idx],
            )
            chunk_kv_indices = translator.translate_dcp_read_ids(chunk_kv_indices)
            self.prefix_chunk_kv_indices.append(chunk_kv_indices)

        if not (pack_all_prefix_chunks or dense_metadata):
            return

        # Only the packed path gathers the whole prefix in one operation. The
        # identity indices and empty indptr describe a dense per-chunk buffer
        # and are required for both packed and bounded chunked paths.
        if pack_all_prefix_chunks:
            self.prefix_all_kv_indices = torch.cat(self.prefix_chunk_kv_indices)
        max_dense_chunk_tokens = max(
            chunk_indices.numel() for chunk_indices in self.prefix_chunk_kv_indices
        )
        self.prefix_dense_kv_indices = torch.arange(
            max_dense_chunk_tokens, dtype=torch.int32, device=device
        )
        self.mha_empty_kv_indptr = torch.zeros(
            self.batch_size + 1, dtype=torch.int32, device=device
        )

    # Here we suppose the length of each chunk is equal
    # For example, if we have 4 sequences with prefix length [256, 512, 768, 1024], prefix_chunk_len = 256
    # num_prefix_chunks = cdiv(1024, 256) = 4
    # prefix_chunk_starts = [[0, 0, 0, 0], [256, 256, 256, 256], [512, 512, 512, 512], [768, 768, 768, 768]]
    # prefix_chunk_ends = [[256, 256, 256, 256], [256, 512, 512, 512], [256, 512, 768, 768], [256, 512, 768, 1024]]
    # prefix_chunk_seq_lens = [[256, 256, 256, 256], [0, 256, 256, 256], [0, 0, 256, 256], [0, 0, 0, 256]]
    # TODO: Implement a better way to allocate chunk lengths that uses memory spaces more efficiently.
    def get_prefix_chunk_seq_lens(
        self, prefix_lens: torch.Tensor, num_prefix_chunks: int, prefix_chunk_len: int
    ):
        device = prefix_lens.device
        prefix_chunk_starts = (
            torch.arange(num_prefix_chunks, device=device, dtype=torch.int32)
            .unsqueeze(1)
            .expand(-1, self.batch_size)
            * prefix_chunk_len
        )
        prefix_chunk_ends = torch.min(
            prefix_lens.unsqueeze(0),
            prefix_chunk_starts + prefix_chunk_len,
        ).to(torch.int32)

        prefix_chunk_seq_lens = (
            (prefix_chunk_ends - prefix_chunk_starts).clamp(min=0).to(torch.int32)
        )

        return prefix_chunk_starts, prefix_chunk_seq_lens

    # Called before each attention module if using chunked kv cache for prefill
    # Some of the codes are adapted from https://github.com/vllm-project/vllm/blob/main/vllm/v1/attention/backends/mla/common.py
    def prepare_chunked_prefix_cache_info(
        self,
        device: torch.device,
        pack_all_prefix_chunks: bool = False,
        single_chunk: bool = False,
        dense_metadata: bool = False,
    ):

        from sglang.srt.mem_cache.memory_pool import (
            HybridLinearKVPool,
            MLATokenToKVPool,
        )

        token_to_kv_pool = get_token_to_kv_pool()
        assert isinstance(token_to_kv_pool, MLATokenToKVPool) or (
            isinstance(token_to_kv_pool, HybridLinearKVPool)
            and isinstance(token_to_kv_pool.full_kv_pool, MLATokenToKVPool)
        ), "Currently chunked prefix cache can only be used by Deepseek models"

        if not any(self.extend_prefix_lens_cpu):
            self.num_prefix_chunks = 0
            return

        if self.prefix_chunk_len is not None:
            # Chunked kv cache info already prepared by prior modules
            return

        self.prefix_chunk_idx = -1

        # chunk_capacity is the maximum number of tokens in each chunk
        chunk_capacity = self.get_max_chunk_capacity()
        if single_chunk:
            # The caller has already checked that the full packed prefix fits
            # chunk_capacity. One request-major chunk gives the fused kernel the
            # same per-request layout described by prefix_chunk_cu_seq_lens[0].
            self.prefix_chunk_len = max(self.extend_prefix_lens_cpu)
        else:
            self.prefix_chunk_len = chunk_capacity // self.batch_size

        self.num_prefix_chunks = (
            max(self.extend_prefix_lens_cpu) + self.prefix_chunk_len - 1
        ) // self.prefix_chunk_len

        # Here we compute chunk lens twice to avoid stream sync, once on gpu and once on cpu.
        prefix_chunk_starts_cuda, prefix_chunk_seq_lens_cuda = (
            self.get_prefix_chunk_seq_lens(
                self.extend_prefix_lens,
                self.num_prefix_chunks,
                self.prefix_chunk_len,
            )
        )
        prefix_chunk_starts_cpu, prefix_chunk_seq_lens_cpu = (
            self.get_prefix_chunk_seq_lens(
                torch.tensor(self.extend_prefix_lens_cpu),
                self.num_prefix_chunks,
                self.prefix_chunk_len,
            )
        )
        self.prefix_chunk_starts = prefix_chunk_starts_cuda
        self.prefix_chunk_seq_lens = prefix_chunk_seq_lens_cuda

        # set prefix_chunk_starts_cpu and prefix_chunk_seq_lens_cpu for dcp to gather chunk kv cache with arbitrary lens
        self.prefix_chunk_starts_cpu = prefix_chunk_starts_cpu
        self.prefix_chunk_seq_lens_cpu = prefix_chunk_seq_lens_cpu
        # Metadata for attention backend
        self.prefix_chunk_cu_seq_lens = torch.zeros(
            self.num_prefix_chunks,
            self.batch_size + 1,
            device=device,
            dtype=torch.int32,
        )
        self.prefix_chunk_cu_seq_lens[:, 1:] = prefix_chunk_seq_lens_cuda.cumsum(
            dim=1
        ).to(torch.int32)
        self.prefix_chunk_max_seq_lens = prefix_chunk_seq_lens_cpu.max(
            dim=1
        ).values.tolist()

        self.prefix_chunk_num_tokens = prefix_chunk_seq_lens_cpu.sum(dim=1).tolist()
        assert max(self.prefix_chunk_num_tokens) <= self.get_max_chunk_capacity()

        # Per-chunk flag: does any sequence have kv_len == 0?
        # Pure CPU check (prefix_chunk_seq_lens_cpu is on CPU), no GPU sync.
        self.prefix_chunk_has_zero_kv = [
            bool((prefix_chunk_seq_lens_cpu[i] == 0).any())
            for i in range(self.num_prefix_chunks)
        ]

        # Precompute the kv indices for each chunk
        self.prepare_chunked_kv_indices(device, pack_all_prefix_chunks, dense_metadata)

    def fetch_mha_one_shot_kv_indices(self):
        if self.mha_one_shot_kv_indices is not None:
            return self.mha_one_shot_kv_indices
        batch_size = self.batch_size
        paged_kernel_lens_sum = sum(self.seq_lens_cpu)
        kv_indices = torch.empty(
            paged_kernel_lens_sum,
            dtype=torch.int32,
            device=self.req_pool_indices.device,
        )
        kv_indptr = torch.zeros(
            batch_size + 1,
            dtype=torch.int32,
            device=self.req_pool_indices.device,
        )
        kv_indptr[1:] = torch.cumsum(self.seq_lens, dim=0)
        # None on a backend that never bound a translator, which reads virtual
        # ids; otherwise one gather from the iteration's plan (DCP takes its
        # own branch upstream).
        src = get_attn_backend().kv_index_translator
        if src is None:
            req_to_token = get_req_to_token_pool().req_to_token
            create_flashinfer_kv_indices_triton[(self.batch_size,)](
                req_to_token,
                self.req_pool_indices,
                self.seq_lens,
                kv_indptr,
                None,
                kv_indices,
                req_to_token.shape[1],
            )
        else:
            src.pack_read_stream(
                self.kv_loc_plan,
                req_pool_indices=self.req_pool_indices,
                seq_lens=self.seq_lens,
                indptr=kv_indptr,
                out=kv_indices,
            )
        self.mha_one_shot_kv_indices = kv_indices
        return kv_indices
