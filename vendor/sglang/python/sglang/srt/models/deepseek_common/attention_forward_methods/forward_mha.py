from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from sglang.kernels.ops.attention.dsa.dequant_k_cache import (
    dequantize_k_cache_paged_dsa,
)
from sglang.kernels.ops.attention.mla_qk_prep import concat_and_cast_mha_k_triton
from sglang.srt.environ import envs
from sglang.srt.layers.attention.index_topk_share import write_mtp_seed
from sglang.srt.layers.attention.tbo_backend import TboAttnBackend
from sglang.srt.layers.dcp import (
    all_gather_kv_cache_for_mha_chunk_extend,
    all_gather_kv_cache_for_mha_extend,
    filter_dcp_local_kv_indices,
)
from sglang.srt.layers.layer_boundary import get_attn_tp_context
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import (
    get_attn_backend,
    get_token_to_kv_pool,
)
from sglang.srt.models.deepseek_common.utils import (
    _is_cuda,
    _is_hip,
    _is_musa,
    _is_npu,
    _use_aiter_gfx95,
)
from sglang.srt.runtime_context import get_exec, get_parallel, get_schedule
from sglang.srt.utils import BumpAllocator, next_power_of_2

if TYPE_CHECKING:
    from sglang.srt.models.deepseek_v2 import DeepseekV2AttentionMLA

if _is_cuda:
    from sglang.kernels.ops.attention.concat_mla import concat_mla_k
elif _is_musa:
    from sgl_kernel import concat_mla_k


def resolve_attn_backend(forward_batch: ForwardBatch):
    backend = get_attn_backend()
    while True:
        if isinstance(backend, TboAttnBackend):
            backend = backend.primary
            continue
        # Hybrid KDA/MLA models route full-attention calls through an outer
        # HybridLinearAttnBackend. Model-side MHA preparation hooks belong to
        # its full-attention child.
        if hasattr(backend, "full_attn_backend"):
            backend = backend.full_attn_backend
            continue
        # A split prefill/decode HybridAttnBackend may itself be the full-attn
        # child. Resolve the backend serving this forward mode as well.
        if (
            hasattr(backend, "prefill_backend")
            and hasattr(backend, "decode_backend")
            and hasattr(backend, "_select_backend")
        ):
            backend = backend._select_backend(forward_batch.forward_mode)
            continue
        return backend


def use_dense_prefix_kv(backend) -> bool:
    """Whether the backend substitutes dense K/V for prefix chunks."""
    return (
        getattr(backend, "pack_prefix_chunk_kv", None) is not None
        and getattr(backend, "pack_all_prefix_chunks", False)
        and not get_parallel().dcp_enabled
    )


def use_packed_prefix_chunks(backend, forward_batch: ForwardBatch) -> bool:
    """Whether the complete prefix can be packed into one bounded buffer."""
    prefix_lens = forward_batch.extend_prefix_lens_cpu
    return (
        use_dense_prefix_kv(backend)
        and prefix_lens is not None
        and sum(prefix_lens) <= forward_batch.get_max_chunk_capacity()
    )


def use_fused_prefix_extend(backend, forward_batch: ForwardBatch) -> bool:
    """Whether the packed prefix and current chunk can share one launch."""
    return getattr(
        backend, "fuse_prefix_into_extend", False
    ) and use_packed_prefix_chunks(backend, forward_batch)


def forward_dsa_indexer_for_mha(
    indexer,
    *,
    hidden_states: torch.Tensor,
    q_lora: torch.Tensor,
    positions: torch.Tensor,
    forward_batch: ForwardBatch,
    layer_id: int,
) -> None:
    """Fill the indexer K cache and publish an MTP seed when requested."""
    spec_info = forward_batch.spec_info
    seed_buf = spec_info.dsa_seed_topk_capture if spec_info is not None else None
    topk_indices = indexer(
        x=hidden_states,
        q_lora=q_lora,
        positions=positions,
        forward_batch=forward_batch,
        layer_id=layer_id,
        return_indices=seed_buf is not None,
    )
    if seed_buf is None:
        return
    if topk_indices is None:
        raise RuntimeError("DSA MHA indexer did not produce the requested MTP seed")

    write_mtp_seed(forward_batch, seed_buf, topk_indices)


# Configs for DeepSeek-V3:
# num_local_heads = 128
# qk_nope_head_dim = 128
# qk_rope_head_dim = 64
# qk_head_dim = qk_nope_head_dim + qk_rope_head_dim = 192
# v_head_dim = 128

# Configs for kv chunking strategy:
# sum_prefix_length:
#   Total number of tokens to be fetched from kv cache for current batch.
#   e.g: For batch with 2 sequences, seq_lens_kv = [1024, 2048], seq_lens_q = [512, 1024], then sum_prefix_length = (1024 - 512) + (2048 - 1024) = 1536
# sum_extended_length:
#   Total number of tokens in the extended part of the current batch. (=sum(seq_lens_q))
# chunked_prefix_cache_threshold:
#   The minimum sum_prefix_length to enable mha with kv chunking, 8192 by default (can be changed with SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD)
#   For batches with smaller sum_prefix_length > 0, MLA kernel with absorption will be used instead.
# max_kv_chunk_capacity:
#   The maximum number of tokens in each kv chunk, 128 * 1024 by default (can be changed with SGLANG_MAX_KV_CHUNK_CAPACITY, or get with forward_batch.get_max_chunk_capacity())

# The forward methods for MHA in DeepSeek models:
#
# 1. forward_normal: AttnForwardMethod.MHA
#    use multi-head attention with empty kv cache (the first batch of chunked prefill, prefix lens = 0)
#    q: [sum_extended_length, num_local_heads, qk_head_dim]
#    k: [sum_extended_length, num_local_heads, qk_head_dim]
#    v: [sum_extended_length, num_local_heads, v_head_dim]
#
# 2. forward_normal_one_shot: AttnForwardMethod.MHA_ONE_SHOT
#    use multi-head attention with short kv prefix length (chunked_prefix_cache_threshold <= sum_prefix_lens <= max_kv_chunk_capacity)
#    the kv latent vectors are fetched from memory pool, with combined kv_indices of prefix part and extended part
#    q: [batch_size, num_local_heads, qk_head_dim]
#    k: [sum_extended_length + sum_prefix_length, num_local_heads, qk_head_dim]
#    v: [sum_extended_length + sum_prefix_length, num_local_heads, v_head_dim]
#
# 3. forward_normal_chunked_kv: AttnForwardMethod.MHA_CHUNKED_KV
#    multiple phases of multi-head attention with chunked kv cache (sum_prefix_length > max_kv_chunk_capacity)
#    For the first phase, it will execute normal forward method, and returns output o_1 and lse_1,
#       q_1: [sum_extended_length, num_local_heads, qk_head_dim],
#       k_1: [sum_extended_length, num_local_heads, qk_head_dim],
#       v_1: [sum_extended_length, num_local_heads, qk_head_dim],
#       acc_o_1, acc_lse_1 = o_1, lse_1
#    For i in range(2, n), (n-1 is the number of prefix chunks), kv latent vectors are fetched from memory pool with prefix kv indices
#       q_i: [sum_extended_length, num_local_heads, qk_head_dim],
#       k_i: [chunk_size, num_local_heads, qk_head_dim],
#       v_i: [chunk_size, num_local_heads, v_head_dim],
#       acc_o_i, acc_lse_i = merge_state(acc_o_{i-1}, acc_lse_{i-1}, o_i, lse_i)
#       The final output is the accumulated output acc_o_n


class DeepseekMHAForwardMixin:
    def init_mha_forward(self: DeepseekV2AttentionMLA):
        self.disable_chunked_prefix_cache = get_schedule().disable_chunked_prefix_cache

        # TODO: Design a finer way to determine the threshold
        self.chunked_prefix_cache_threshold = (
            envs.SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD.get()
        )

    def forward_normal_prepare(
        self: DeepseekV2AttentionMLA,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        zero_allocator: BumpAllocator,
    ):
        if self.q_lora_rank is not None:
            q, latent_cache = (
                get_attn_tp_context()
                .fetch_qkv_latent()
                .split(
                    [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim],
                    dim=-1,
                )
            )

            # DSA Indexer: cache quantized keys, auto-skip topk for sequences <= dsa_index_topk

            if self.use_dsa:
                q_lora = self.q_a_layernorm(q)
                q = self.q_b_proj(q_lora)[0].view(
                    -1, self.num_local_heads, self.qk_head_dim
                )
                if self.should_run_indexer():
                    forward_dsa_indexer_for_mha(
                        self.indexer,
                        hidden_states=hidden_states,
                        q_lora=q_lora,
                        positions=positions,
                        forward_batch=forward_batch,
                        layer_id=self.layer_id,
                    )
            else:
                q = self.q_a_layernorm(q)
                q = self.q_b_proj(q)[0].view(-1, self.num_local_heads, self.qk_head_dim)

        else:
            q = self.q_proj(hidden_states)[0].view(
                -1, self.num_local_heads, self.qk_head_dim
            )
            latent_cache = self.kv_a_proj_with_mqa(hidden_states)[0]

        _, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_a, _ = latent_cache.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent_cache = latent_cache.unsqueeze(1)

        kv_a = self.kv_a_layernorm(kv_a)

        k_pe = latent_cache[:, :, self.kv_lora_rank :]

        # Backend prefill hook: the backend owns the BF16->FP8 transition
        # (fused RoPE + quantize for Q/K, direct FP8 KV-cache write) and
        # returns FP8 tensors ready for its kernel. Backends without the
        # hook fall through to the BF16 path below.
        backend = resolve_attn_backend(forward_batch)
        if hasattr(backend, "prepare_prefill_qkv"):
            q_out, k_out, v_out = backend.prepare_prefill_qkv(
                q=q,
                q_pe=q_pe,
                kv_a=kv_a,
                k_pe=k_pe,
                positions=positions,
                layer=self,
                forward_batch=forward_batch,
            )
            return q_out, k_out, v_out, forward_batch

        if self.rotary_emb is not None:
            q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        q[..., self.qk_nope_head_dim :] = q_pe

        self._set_mla_kv_buffer(latent_cache, kv_a, k_pe, forward_batch)
        if (
            forward_batch.mha_one_shot
            and sum(forward_batch.extend_prefix_lens_cpu) != 0
        ):
            if (
                self.use_dsa
                and self.kv_cache_dtype == "fp8_e4m3"
                and (
                    not get_exec().kernel.dsa_decode_backend == "trtllm"
                    or not get_exec().kernel.dsa_prefill_backend == "trtllm"
                )
            ):
                # FP8 path: dequantize DSA-specific FP8 format to BF16
                kv_a, k_pe = self._get_mla_kv_buffer_from_fp8_for_dsa(forward_batch)
            else:
                # BF16/FP16 path: directly fetch from cache
                if self.dcp_size > 1:
                    kv_a, k_pe = all_gather_kv_cache_for_mha_extend(
                        get_token_to_kv_pool(),
                        self.attn_mha,
                        forward_batch.attn_dcp_metadata.dcp_local_prefix_kv_indices,
                        forward_batch.seq_lens,
                        forward_batch.extend_prefix_lens,
                        forward_batch.extend_prefix_lens_cpu,
                        forward_batch.extend_seq_lens,
                        kv_a,
                        k_pe,
                    )
                else:
                    kv_a, k_pe = self._get_mla_kv_buffer(
                        forward_batch.fetch_mha_one_shot_kv_indices(),
                        q.dtype,
                        forward_batch,
                    )
        kv = self.kv_b_proj(kv_a)[0]
        kv = kv.view(-1, self.num_local_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope = kv[..., : self.qk_nope_head_dim]
        v = kv[..., self.qk_nope_head_dim :]

        k = self._concat_and_cast_mha_k(k_nope, k_pe, forward_batch)
        return q, k, v, forward_batch

    def forward_normal_core(
        self: DeepseekV2AttentionMLA,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        gate: Optional[torch.Tensor] = None,
        key_value_num_tokens: Optional[int] = None,
    ) -> torch.Tensor:
        attn_output = self.attn_mha(
            q,
            k,
            v,
            forward_batch,
            save_kv_cache=False,
            key_value_num_tokens=key_value_num_tokens,
        )
        attn_output = attn_output.reshape(-1, self.num_local_heads * self.v_head_dim)
        if gate is not None:
            attn_output = self._apply_gated(attn_output, gate)
        output, _ = self.o_proj(attn_output)
        return output

    def forward_normal_chunked_kv_prepare(
        self: DeepseekV2AttentionMLA,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        zero_allocator: BumpAllocator,
    ):
        # In normal mha, the k and v tensors will become overly large when the prefix length is long.
        # To avoid this, we split the kv cache into chunks and process them one after another.
        # Since mha is compute friendly, the for loop induced here will not introduce significant overhead.
        # The top comments in https://github.com/vllm-project/vllm/blob/main/vllm/v1/attention/backends/mla/common.py
        # will be helpful for understanding the purpose of this function.

        # Preserve the ROCm fused RMS/quantized projection path for the current
        # chunk; the shared preparation path is primarily the CUDA version.
        if _is_hip:
            return self.forward_normal_rocm_prepare(
                positions, hidden_states, forward_batch, zero_allocator
            )

        # First do normal mha forward to get output for extended part.
        return self.forward_normal_prepare(
            positions, hidden_states, forward_batch, zero_allocator
        )

    def forward_normal_chunked_kv_core(
        self: DeepseekV2AttentionMLA,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        gate: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        has_extend_prefix = forward_batch.extend_prefix_lens_cpu is not None and any(
            forward_batch.extend_prefix_lens_cpu
        )
        backend = resolve_attn_backend(forward_batch)
        prepare_qkv_fn = getattr(backend, "prepare_chunked_prefill_qkv", None)
        if has_extend_prefix and prepare_qkv_fn is not None:
            q, k, v = prepare_qkv_fn(q, k, v, forward_batch)

        fused_prefix = has_extend_prefix and use_fused_prefix_extend(
            backend, forward_batch
        )

        # Only initialize the info once
        if has_extend_prefix and forward_batch.num_prefix_chunks is None:
            forward_batch.prepare_chunked_prefix_cache_info(
                q.device,
                pack_all_prefix_chunks=use_packed_prefix_chunks(backend, forward_batch),
                single_chunk=fused_prefix,
                dense_metadata=use_dense_prefix_kv(backend),
            )
            if hasattr(get_attn_backend(), "init_mha_chunk_metadata"):
                get_attn_backend().init_mha_chunk_metadata(forward_batch)

        if fused_prefix:
            attn_output = self._fused_prefix_extend_attn_mha(q, k, v, forward_batch)
            attn_output = attn_output.reshape(
                -1, self.num_local_heads * self.v_head_dim
            )
            output, _ = self.o_proj(attn_output)
            return output

        forward_batch.mha_return_lse = has_extend_prefix
        # Do mha for extended part without prefix
        forward_batch.set_attn_attend_prefix_cache(False)
        attn_output = self.attn_mha(q, k, v, forward_batch, save_kv_cache=False)

        # Do mha attention with chunked prefix cache if there are any sequence with prefix
        if has_extend_prefix:
            attn_output, lse = attn_output
            forward_batch.set_attn_attend_prefix_cache(True)
            attn_output = self._chunked_prefix_attn_mha(
                q=q,
                accum_output=attn_output,
                accum_lse=lse,
                forward_batch=forward_batch,
            )

        attn_output = attn_output.reshape(-1, self.num_local_heads * self.v_head_dim)
        if gate is not None:
            attn_output = self._apply_gated(attn_output, gate)
        output, _ = self.o_proj(attn_output)
        return output

    def forward_normal_one_shot_prepare(
        self: DeepseekV2AttentionMLA,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        zero_allocator: BumpAllocator,
    ):
        forward_batch.mha_one_shot = True
        return self.forward_normal_prepare(
            positions, hidden_states, forward_batch, zero_allocator
        )

    def forward_normal_one_shot_core(
        self: DeepseekV2AttentionMLA,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        gate: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        has_extend_prefix = any(forward_batch.extend_prefix_lens_cpu)
        # Only initialize the info once
        if has_extend_prefix and forward_batch.num_prefix_chunks is None:
            forward_batch.num_prefix_chunks = 0
            if hasattr(get_attn_backend(), "init_mha_chunk_metadata"):
                get_attn_backend().init_mha_chunk_metadata(forward_batch)
        forward_batch.mha_return_lse = False
        # Do mha for extended part without prefix
        forward_batch.set_attn_attend_prefix_cache(False)
        # K and V cover every token of the sequences, the cached prefix too.
        return self.forward_normal_core(
            q, k, v, forward_batch, gate, key_value_num_tokens=k.shape[0]
        )

    def _fused_prefix_extend_attn_mha(
        self: DeepseekV2AttentionMLA,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Attend the complete prefix and current chunk in one kernel launch."""
        assert forward_batch.num_prefix_chunks == 1, (
            "fused prefix+extend needs the single-chunk layout, got "
            f"{forward_batch.num_prefix_chunks} chunks"
        )
        backend = resolve_attn_backend(forward_batch)
        get_mla_kv_buffer = (
            self._get_mla_kv_buffer_rocm if _is_hip else self._get_mla_kv_buffer
        )

        # With one chunk, these indices are request-major and are described by
        # prefix_chunk_cu_seq_lens[0]. Project and pack the prefix only once.
        kv_a_normed, k_pe = get_mla_kv_buffer(
            forward_batch.prefix_all_kv_indices, torch.bfloat16, forward_batch
        )
        kv = self.kv_b_proj(kv_a_normed)[0]
        kv = kv.view(-1, self.num_local_heads, self.qk_nope_head_dim + self.v_head_dim)
        prefix_k, prefix_v = backend.pack_prefix_chunk_kv(
            kv[..., : self.qk_nope_head_dim],
            k_pe,
            kv[..., self.qk_nope_head_dim :],
        )
        del kv_a_normed, k_pe, kv

        forward_batch.mha_return_lse = False
        forward_batch.set_attn_attend_prefix_cache(False)
        forward_batch.set_prefix_chunk_idx(0)
        forward_batch.fused_prefix_k = prefix_k
        forward_batch.fused_prefix_v = prefix_v
        try:
            return self.attn_mha(q, k, v, forward_batch, save_kv_cache=False)
        finally:
            forward_batch.fused_prefix_k = None
            forward_batch.fused_prefix_v = None

    def _chunked_prefix_attn_mha(
        self: DeepseekV2AttentionMLA,
        q: torch.Tensor,
        accum_output: torch.Tensor,
        accum_lse: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        # kv_b_proj needs BF16 input, but legacy q.dtype was BF16 by accident.
        from sglang.srt.layers.attention.merge_state import merge_state

        backend = resolve_attn_backend(forward_batch)
        pack_fn = getattr(backend, "pack_prefix_chunk_kv", None)
        kv_a_dtype = torch.bfloat16 if pack_fn is not None else q.dtype
        get_mla_kv_buffer = (
            self._get_mla_kv_buffer_rocm if _is_hip else self._get_mla_kv_buffer
        )

        # If the complete prefix fits the capacity, gather/project/pack once.
        # Larger prefixes retain bounded per-chunk materialization.
        packed_prefix_k = None
        packed_prefix_v = None
        pack_all_prefix_chunks = use_packed_prefix_chunks(backend, forward_batch)
        if pack_all_prefix_chunks:
            kv_a_normed, k_pe = get_mla_kv_buffer(
                forward_batch.prefix_all_kv_indices,
                kv_a_dtype,
                forward_batch,
            )
            kv = self.kv_b_proj(kv_a_normed)[0]
            kv = kv.view(
                -1, self.num_local_heads, self.qk_nope_head_dim + self.v_head_dim
            )
            k_nope = kv[..., : self.qk_nope_head_dim]
            v_dense = kv[..., self.qk_nope_head_dim :]
            packed_prefix_k, packed_prefix_v = pack_fn(k_nope, k_pe, v_dense)
            del kv_a_normed, k_pe, kv, k_nope, v_dense

        assert forward_batch.num_prefix_chunks is not None
        packed_offset = 0
        for i in range(forward_batch.num_prefix_chunks):
            forward_batch.set_prefix_chunk_idx(i)

            if pack_all_prefix_chunks:
                chunk_num_tokens = forward_batch.prefix_chunk_num_tokens[i]
                packed_end = packed_offset + chunk_num_tokens
                k = packed_prefix_k[packed_offset:packed_end]
                v = packed_prefix_v[packed_offset:packed_end]
                packed_offset = packed_end
            else:
                kv_indices = forward_batch.prefix_chunk_kv_indices[i]
                kv_a_normed, k_pe = get_mla_kv_buffer(
                    kv_indices, kv_a_dtype, forward_batch
                )
                kv_a_normed, k_pe = all_gather_kv_cache_for_mha_chunk_extend(
                    kv_a_normed,
                    k_pe,
                    forward_batch.prefix_chunk_seq_lens_cpu[i],
                    forward_batch.prefix_chunk_starts_cpu[i],
                )
                kv = self.kv_b_proj(kv_a_normed)[0]
                kv = kv.view(
                    -1,
                    self.num_local_heads,
                    self.qk_nope_head_dim + self.v_head_dim,
                )
                v_dense = kv[..., self.qk_nope_head_dim :]
                k_nope = kv[..., : self.qk_nope_head_dim]

                if pack_fn is not None:
                    k, v = pack_fn(k_nope, k_pe, v_dense)
                else:
                    v = v_dense
                    k = torch.empty(
                        (
                            k_nope.shape[0],
                            self.num_local_heads,
                            self.qk_nope_head_dim + self.qk_rope_head_dim,
                        ),
                        dtype=v.dtype,
                        device=v.device,
                    )
                    k[..., : self.qk_nope_head_dim] = k_nope
                    k[..., self.qk_nope_head_dim :] = k_pe
                del kv_a_normed, k_pe, kv, k_nope, v_dense

            output, lse = self.attn_mha(
                q,
                k,
                v,
                forward_batch,
                save_kv_cache=False,
                # Prefix K/V is independent of the suffix query length. Under
                # FullCG this is the fixed captured chunk extent; per-request
                # active lengths remain encoded in the backend metadata.
                key_value_num_tokens=k.shape[0],
            )
            tmp_output = torch.empty_like(accum_output)
            tmp_lse = torch.empty_like(accum_lse)
            merge_state(
                output,
                lse,
                accum_output,
                accum_lse,
                tmp_output,
                tmp_lse,
            )
            accum_output, accum_lse = tmp_output, tmp_lse
            del k, v, output, lse, tmp_output, tmp_lse

        if pack_all_prefix_chunks:
            assert packed_offset == packed_prefix_k.shape[0]
            del packed_prefix_k, packed_prefix_v

        return accum_output

    def _set_mla_kv_buffer(
        self: DeepseekV2AttentionMLA,
        latent_cache: torch.Tensor,
        kv_a: torch.Tensor,
        k_pe: torch.Tensor,
        forward_batch: ForwardBatch,
    ):
        if _is_cuda:
            # Save latent cache
            get_token_to_kv_pool().set_mla_kv_buffer(
                self.attn_mha,
                KVWriteLoc.for_batch(forward_batch),
                kv_a.unsqueeze(1),
                k_pe,
            )
        elif _is_npu:
            # To reduce a time-costing split operation
            get_token_to_kv_pool().set_kv_buffer(
                self.attn_mha,
                KVWriteLoc.for_batch(forward_batch),
                kv_a.unsqueeze(1),
                k_pe,
            )
        else:
            latent_cache[:, :, : self.kv_lora_rank] = kv_a.unsqueeze(1)
            latent_cache[:, :, self.kv_lora_rank :] = k_pe.clone()

            # Save latent cache
            get_token_to_kv_pool().set_kv_buffer(
                self.attn_mha, KVWriteLoc.for_batch(forward_batch), latent_cache, None
            )

    def _get_mla_kv_buffer(
        self: DeepseekV2AttentionMLA,
        kv_indices: torch.Tensor,
        dst_dtype: torch.dtype,
        forward_batch: ForwardBatch,
    ):
        if _is_cuda or _use_aiter_gfx95:
            kv_a, k_pe = get_token_to_kv_pool().get_mla_kv_buffer(
                self.attn_mha, kv_indices, dst_dtype
            )
            kv_a = kv_a.squeeze(1)
        else:
            latent_cache_buf = get_token_to_kv_pool().get_key_buffer(
                self.attn_mha.layer_id
            )
            latent_cache = latent_cache_buf[kv_indices].contiguous().to(dst_dtype)

            kv_a, k_pe = latent_cache.split(
                [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
            )
            kv_a = kv_a.squeeze(1).contiguous()
        return kv_a, k_pe

    def _get_mla_kv_buffer_from_fp8_for_dsa(
        self: DeepseekV2AttentionMLA,
        forward_batch: ForwardBatch,
    ):
        """
        Dequantize FP8 KV cache to BF16 for MLA attention (DSA-specific format).

        Returns: (kv_a, k_pe) both in BF16
        """
        backend = resolve_attn_backend(forward_batch)
        kv_indices = backend.forward_metadata.page_table_1_flattened
        assert kv_indices is not None, (
            "page_table_1_flattened should have been generated for FP8 MHA path"
        )

        if _use_aiter_gfx95:
            # ROCm (gfx950) stores the FP8 MLA KV in the raw
            # (kv_lora_rank + qk_rope_head_dim) layout, not the scaled 656-byte
            # layout that dequantize_k_cache_paged_dsa expects (it asserts dim==656).
            # Dequantize the raw layout via the pool's HIP-aware path instead —
            # the same routine _get_mla_kv_buffer uses for the BF16 MHA path.
            # Without this, a chunked-prefill split (extend_prefix_lens != 0) that
            # reads cached prefix KV crashes with "576 != 656".
            kv_indices = filter_dcp_local_kv_indices(kv_indices=kv_indices)
            # Read door: the pool never translates, so the production site does.
            # Only the FlashAttention/FlashInfer backends bind a translator; the
            # base class documents its None default as "no translate", and the DSA
            # backend the EAGLE draft model runs on keeps that default. With no
            # translator the ids never went VIRTUAL, so there is nothing to
            # collapse.
            translator = get_attn_backend().kv_index_translator
            if translator is not None:
                kv_indices = translator.translate_dcp_read_ids(kv_indices)
            kv_a, k_pe = get_token_to_kv_pool().get_mla_kv_buffer(
                self.attn_mha, kv_indices, torch.bfloat16
            )
            kv_a = kv_a.squeeze(1).contiguous()
            return kv_a, k_pe

        kv_cache_fp8 = get_token_to_kv_pool().get_key_buffer(self.attn_mha.layer_id)

        kv_latent_bf16 = dequantize_k_cache_paged_dsa(kv_cache_fp8, kv_indices)

        kv_a = kv_latent_bf16[:, :, : self.kv_lora_rank].squeeze(1).contiguous()
        k_pe = kv_latent_bf16[:, :, self.kv_lora_rank :]

        return kv_a, k_pe

    def _concat_and_cast_mha_k(
        self: DeepseekV2AttentionMLA,
        k_nope: torch.Tensor,
        k_pe: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ):
        if self.qk_rope_head_dim == 0:
            assert k_pe is None or k_pe.shape[-1] == 0
            k = k_nope.contiguous()
            if (
                _is_cuda
                and self.current_attention_backend == "fa3"
                and self.kv_cache_dtype != "auto"
            ):
                # fa3 requires k in the pool dtype when KV cache is fp8; the
                # concat branch below does the same cast for roped models.
                k = k.to(get_token_to_kv_pool().dtype)
            return k

        # Temporary for DeepSeek V3/R1 only, but can generalize if needed
        k_shape = (k_nope.shape[0], self.num_local_heads, self.qk_head_dim)
        if (
            (_is_cuda or _is_musa)
            and (self.num_local_heads == 128)
            and (self.qk_nope_head_dim == 128)
            and (self.qk_rope_head_dim == 64)
        ):
            k = k_nope.new_empty(*k_shape)
            concat_mla_k(k=k, k_nope=k_nope, k_rope=k_pe)
        elif (
            _is_cuda
            and next_power_of_2(self.num_local_heads) == self.num_local_heads
            and next_power_of_2(self.qk_nope_head_dim) == self.qk_nope_head_dim
            and next_power_of_2(self.qk_rope_head_dim) == self.qk_rope_head_dim
        ):
            # fa3 mha support fp8 inputs
            if (
                self.current_attention_backend == "fa3"
                and self.kv_cache_dtype != "auto"
            ):
                attn_dtype = get_token_to_kv_pool().dtype
            else:
                attn_dtype = k_nope.dtype
            k = k_nope.new_empty(*k_shape, dtype=attn_dtype)
            concat_and_cast_mha_k_triton(k, k_nope, k_pe)
        else:
            k = k_nope.new_empty(*k_shape)
            k[..., : self.qk_nope_head_dim] = k_nope
            k[..., self.qk_nope_head_dim :] = k_pe
        return k
