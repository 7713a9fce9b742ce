from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.layers.attention.dsa.kpool_plan import (
    init_kpool_extend_metadata,
    init_kpool_write_plan,
    init_kpool_write_plan_capture,
    init_pooled_paged_mqa_metadata,
    update_kpool_write_plan,
    update_pooled_paged_mqa_metadata,
)
from sglang.srt.layers.cp.interleave_kpool import local_query_inputs

if TYPE_CHECKING:
    from sglang.srt.layers.attention.dsa.dsa_backend_mtp_precompute import (
        PrecomputedMetadata,
    )
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod
    from sglang.srt.layers.attention.dsa_backend import _DSA_IMPL_T, DSAMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


@dataclass
class _KPoolForwardInputs:
    full_real_page_table: Optional[torch.Tensor] = None
    full_seqlens_expanded: Optional[torch.Tensor] = None


class DeepseekSparseAttnBackendKPoolMixin:
    """KPool-specific metadata and tail handling for the DSA backend."""

    def _check_kpool_tail_backend(
        self,
        topk_indices: Optional[torch.Tensor],
        dsa_impl: _DSA_IMPL_T,
        phase: str,
    ) -> None:
        # q8 prefill consumes the tail columns as ragged ids, like the history
        # picks. Only over a bfloat16 pool: gathering packed fp8 rows through
        # kpool tail columns is untested, so that combination keeps the guard.
        if (
            dsa_impl == "flashmla_sparse_q8"
            and phase == "prefill"
            and not self.dsa_kv_cache_store_fp8
        ):
            return
        if (
            topk_indices is None
            or self.dsa_index_kpool <= 1
            or dsa_impl in ("fa3", "tilelang", "trtllm")
        ):
            return
        raise NotImplementedError(
            "index_kpool > 1 appends tail tokens to topk_indices and is "
            f"currently only supported by the FA3/TileLang/TRTLLM DSA {phase} "
            "backend."
        )

    def _resolve_kpool_tail_backend(
        self,
        topk_indices: Optional[torch.Tensor],
        dsa_impl: _DSA_IMPL_T,
    ) -> _DSA_IMPL_T:
        if (
            topk_indices is None
            or self.dsa_index_kpool <= 1
            or dsa_impl != "flashmla_sparse"
        ):
            return dsa_impl
        if self.device_sm_major >= 10:
            return "trtllm"
        if self.device_sm_major == 9:
            return "fa3"
        return dsa_impl

    def _kpool_index_page_size(self) -> int:
        return self.token_to_kv_pool.index_page_size

    def _build_kpool_paged_mqa_schedule_metadata(self) -> bool:
        if self.device_sm_major == 9:
            return self.num_q_heads in (32, 64)
        return True

    def _init_kpool_metadata(
        self,
        metadata: DSAMetadata,
        forward_batch: ForwardBatch,
        topk_transform_method: Optional[TopkTransformMethod] = None,
        kpool_inputs: Optional[_KPoolForwardInputs] = None,
    ) -> DSAMetadata:
        if self.dsa_index_kpool <= 1:
            return metadata

        forward_mode = forward_batch.forward_mode
        index_page_size = self._kpool_index_page_size()
        build_schedule_metadata = self._build_kpool_paged_mqa_schedule_metadata()
        if forward_mode.is_extend_without_speculative():
            assert topk_transform_method is not None
            assert kpool_inputs is not None
            return init_kpool_extend_metadata(
                metadata,
                forward_batch,
                kpool=self.dsa_index_kpool,
                physical_page_size=self.physical_page_size,
                index_page_size=index_page_size,
                topk_transform_method=topk_transform_method,
                full_real_page_table=kpool_inputs.full_real_page_table,
                full_seqlens_expanded=kpool_inputs.full_seqlens_expanded,
                **local_query_inputs(forward_batch, metadata),
            )

        metadata = init_pooled_paged_mqa_metadata(
            metadata,
            metadata.cache_seqlens_int32,
            forward_mode,
            kpool=self.dsa_index_kpool,
            physical_page_size=self.physical_page_size,
            index_page_size=index_page_size,
            build_schedule_metadata=build_schedule_metadata,
        )

        if forward_mode.is_decode_or_idle():
            return init_kpool_write_plan(
                metadata,
                forward_batch,
                kpool=self.dsa_index_kpool,
                physical_page_size=self.physical_page_size,
                real_page_table=metadata.real_page_table,
                num_draft_tokens=1,
                write_start=(forward_batch.seq_lens - 1).to(torch.int32),
                index_page_size=index_page_size,
                build_schedule_metadata=build_schedule_metadata,
            )

        if forward_mode.is_target_verify():
            return init_kpool_write_plan(
                metadata,
                forward_batch,
                kpool=self.dsa_index_kpool,
                physical_page_size=self.physical_page_size,
                real_page_table=metadata.real_page_table,
                num_draft_tokens=self.speculative_num_draft_tokens,
                write_start=forward_batch.seq_lens.to(torch.int32),
                index_page_size=index_page_size,
                build_schedule_metadata=build_schedule_metadata,
            )

        if forward_mode.is_draft_extend_v2():
            spec_info = forward_batch.spec_info
            effective_n_per_batch = (
                spec_info.num_accept_tokens
                if spec_info is not None
                and getattr(spec_info, "num_accept_tokens", None) is not None
                else None
            )
            return init_kpool_write_plan(
                metadata,
                forward_batch,
                kpool=self.dsa_index_kpool,
                physical_page_size=self.physical_page_size,
                real_page_table=metadata.real_page_table,
                num_draft_tokens=self.speculative_num_draft_tokens,
                write_start=(
                    forward_batch.seq_lens - self.speculative_num_draft_tokens
                ).to(torch.int32),
                index_page_size=index_page_size,
                effective_n_per_batch=effective_n_per_batch,
                build_schedule_metadata=build_schedule_metadata,
            )

        return metadata

    def _init_kpool_metadata_capture(
        self, metadata: DSAMetadata, bs: int, forward_mode: ForwardMode
    ) -> DSAMetadata:
        if self.dsa_index_kpool <= 1:
            return metadata

        index_page_size = self._kpool_index_page_size()
        build_schedule_metadata = self._build_kpool_paged_mqa_schedule_metadata()
        metadata = init_pooled_paged_mqa_metadata(
            metadata,
            metadata.cache_seqlens_int32,
            forward_mode,
            kpool=self.dsa_index_kpool,
            physical_page_size=self.physical_page_size,
            index_page_size=index_page_size,
            build_schedule_metadata=build_schedule_metadata,
        )

        if (
            forward_mode.is_decode_or_idle()
            or forward_mode.is_target_verify()
            or forward_mode.is_draft_extend_v2()
        ):
            is_decode = forward_mode.is_decode_or_idle()
            is_v2 = forward_mode.is_draft_extend_v2()
            metadata = init_kpool_write_plan_capture(
                metadata,
                max_bs=bs,
                kpool=self.dsa_index_kpool,
                physical_page_size=self.physical_page_size,
                num_draft_tokens=(
                    1 if is_decode else self.speculative_num_draft_tokens
                ),
                device=self.device,
                is_verify=not is_decode,
                index_page_size=index_page_size,
                is_v2=is_v2,
                build_schedule_metadata=build_schedule_metadata,
            )

        return metadata

    def _update_kpool_metadata_replay(
        self,
        metadata: DSAMetadata,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        forward_mode: ForwardMode,
        effective_n_per_batch: Optional[torch.Tensor] = None,
    ) -> None:
        if self.dsa_index_kpool <= 1:
            return

        index_page_size = self._kpool_index_page_size()
        build_schedule_metadata = self._build_kpool_paged_mqa_schedule_metadata()
        update_pooled_paged_mqa_metadata(
            metadata,
            metadata.cache_seqlens_int32,
            forward_mode,
            kpool=self.dsa_index_kpool,
            physical_page_size=self.physical_page_size,
            index_page_size=index_page_size,
            build_schedule_metadata=build_schedule_metadata,
        )

        if not (
            forward_mode.is_decode_or_idle()
            or forward_mode.is_target_verify()
            or forward_mode.is_draft_extend_v2()
        ):
            return

        is_decode = forward_mode.is_decode_or_idle()
        is_v2 = forward_mode.is_draft_extend_v2()
        if is_decode:
            write_start = seq_lens.to(torch.int32) - 1
        elif is_v2:
            write_start = seq_lens.to(torch.int32) - self.speculative_num_draft_tokens
        else:
            # Target verify: write_start == seq_lens exactly; the plan kernel
            # casts on load, so skip the per-replay int32 alloc + conversion.
            write_start = seq_lens
        update_kpool_write_plan(
            metadata,
            write_start=write_start,
            req_pool_indices=req_pool_indices,
            real_page_table=metadata.real_page_table,
            kpool=self.dsa_index_kpool,
            physical_page_size=self.physical_page_size,
            num_draft_tokens=(1 if is_decode else self.speculative_num_draft_tokens),
            forward_mode=forward_mode,
            index_page_size=index_page_size,
            effective_n_per_batch=effective_n_per_batch,
        )

    def _update_kpool_metadata_from_precomputed(
        self,
        metadata: DSAMetadata,
        precomputed: PrecomputedMetadata,
        forward_mode: ForwardMode,
    ) -> None:
        if self.dsa_index_kpool <= 1:
            return

        index_page_size = self._kpool_index_page_size()
        build_schedule_metadata = self._build_kpool_paged_mqa_schedule_metadata()
        update_pooled_paged_mqa_metadata(
            metadata,
            precomputed.cache_seqlens,
            forward_mode,
            kpool=self.dsa_index_kpool,
            physical_page_size=self.physical_page_size,
            index_page_size=index_page_size,
            build_schedule_metadata=build_schedule_metadata,
        )

        if not (forward_mode.is_decode_or_idle() or forward_mode.is_target_verify()):
            return

        is_verify = forward_mode.is_target_verify()
        write_start = precomputed.cache_seqlens.to(torch.int32)
        write_start = (
            write_start - self.speculative_num_draft_tokens
            if is_verify
            else write_start - 1
        )
        update_kpool_write_plan(
            metadata,
            write_start=write_start,
            req_pool_indices=precomputed.req_pool_indices,
            real_page_table=metadata.real_page_table,
            kpool=self.dsa_index_kpool,
            physical_page_size=self.physical_page_size,
            num_draft_tokens=self.speculative_num_draft_tokens if is_verify else 1,
            forward_mode=forward_mode,
            index_page_size=index_page_size,
        )
