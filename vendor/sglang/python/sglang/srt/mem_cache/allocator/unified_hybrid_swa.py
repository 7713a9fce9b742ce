# Copyright 2023-2026 SGLang Team
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
"""Unified-memory composites for hybrid SWA models: the full-attention and SWA
sub-pools of one `UnifiedKVPool`, and the tri-pool variant that adds mamba state."""

from __future__ import annotations

import logging
import math
from abc import abstractmethod
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

import torch
from torch.profiler import record_function

from sglang.srt.environ import InvariantCheckLevel
from sglang.srt.mem_cache.allocator import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.base import MambaFullCacheDonor
from sglang.srt.mem_cache.allocator.swa import (
    UNIFIED_SWA_SEGMENT_BOUND,
    UNIFIED_SWA_SEGMENT_RELEASED,
    SWATokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.allocator.unified_sub_pool import (
    FloatMultiEndedAllocator,
    MultiEndedAllocator,
    _chain_byte_accounting_violations,
    _end_pair_chain,
    _float_open_short_side,
    _flush_deferred_free_group,
    _full_tokens_before_mamba_recheck,
    _relieve_for_alloc,
    install_move_gate,
)
from sglang.srt.mem_cache.unified_memory_pool import UnifiedKVPool
from sglang.srt.runtime_context import get_disagg, get_memory
from sglang.srt.utils.common import get_num_new_pages
from sglang.srt.utils.invariants import expect, resolve_level
from sglang.srt.utils.rank_consensus_checker import rank_consensus

logger = logging.getLogger(__name__)


class UnifiedSWAAllocatorBase(SWATokenToKVPoolAllocator):
    """Shared FULL/SWA virtual IDs, allocation lifecycle, and index translation.

    Concrete allocators define the two-ended or Mamba/SWA/FULL capacity policy.
    """

    # Parent's `size` property has no setter but base init does `self.size = size`;
    # the no-op setter below absorbs that write.
    @property
    def size(self) -> int:
        return min(self._size_full, self._size_swa)

    @size.setter
    def size(self, value) -> None:
        pass

    def __init__(
        self,
        *,
        unified_buffer: UnifiedKVPool,
        kvcache,  # UnifiedSWAKVPool
        device: str,
        full_max_total_num_tokens: Optional[int] = None,
        swa_max_total_num_tokens: Optional[int] = None,
        page_size: int = 1,
        need_sort: bool = False,
        forward_stream: Optional[torch.cuda.Stream] = None,
        lazy_compaction: bool = False,
    ):
        if (full_max_total_num_tokens is None) != (swa_max_total_num_tokens is None):
            raise ValueError(
                "full_max_total_num_tokens and swa_max_total_num_tokens must "
                "either both be set or both be omitted"
            )
        legacy_capacities = full_max_total_num_tokens is not None
        self._size_full = (
            int(full_max_total_num_tokens)
            if legacy_capacities
            else unified_buffer.max_slots("full") - 1
        )
        self._size_swa = (
            int(swa_max_total_num_tokens)
            if legacy_capacities
            else unified_buffer.max_slots("swa") - 1
        )
        self.page_size = page_size

        # The parent is inherited only for the isinstance contract: skip its
        # static-partition sub-pool allocation, which the unified pool replaces.
        BaseTokenToKVPoolAllocator.__init__(
            self,
            size=self._size_full,
            page_size=page_size,
            dtype=unified_buffer.mha_spec("full").store_dtype,
            device=device,
            kvcache=kvcache,
            need_sort=need_sort,
        )
        self.unified_buffer = unified_buffer
        self._kvcache = kvcache
        self.lazy_compaction = lazy_compaction

        self.full_attn_allocator = MultiEndedAllocator(
            kvcache=kvcache.full_kv_pool,
            unified_buffer=unified_buffer,
            sub_pool_name="full",
            device=device,
            is_id_owner=True,
            page_size=page_size,
            need_sort=need_sort,
            forward_stream=forward_stream,
            lazy_compaction=lazy_compaction,
        )
        self.swa_attn_allocator = self._build_swa_attn_allocator(
            kvcache=kvcache.swa_kv_pool,
            unified_buffer=unified_buffer,
            device=device,
            page_size=page_size,
            need_sort=need_sort,
            forward_stream=forward_stream,
            lazy_compaction=lazy_compaction,
            # swa binds the virtual pages full mints, so it must address
            # full's whole id space.
            virtual_num_pages=self.full_attn_allocator.num_virtual_ids,
        )
        self._wire_peers()

        self._empty_shared_gap_bytes = self.full_attn_allocator._current_gap_bytes()
        if not legacy_capacities:
            self._size_full = self.full_attn_allocator.available_size()
            self._size_swa = min(
                self.swa_attn_allocator.available_size(),
                len(self.full_attn_allocator.free_virtual_ids) * page_size,
            )
        self._full_max_total_num_tokens = self._size_full
        self._swa_max_total_num_tokens = self._size_swa

        # Epoch-keyed memo for the joint capacity view (any chain member's
        # mutation invalidates -- see `MultiEndedAllocator._chain_capacity_epoch`).
        self._joint_avail_memo_epoch: Optional[int] = None
        self._joint_avail_memo_tokens: int = 0

        # The full/SWA KV pools need no allocator wiring (write locations resolved
        # in attention metadata); the composite keeps allocators for read-path translates.
        kvcache.attach_allocators(
            full_allocator=self.full_attn_allocator,
            swa_allocator=self.swa_attn_allocator,
        )
        # Size host pools in tokens; sub-pool `size` counts physical rows.
        kvcache.full_kv_pool.host_capacity_tokens = self._size_full
        kvcache.swa_kv_pool.host_capacity_tokens = self._size_swa
        for name, pool in (
            ("full", kvcache.full_kv_pool),
            ("swa", kvcache.swa_kv_pool),
        ):
            pool.host_capacity_bytes = (
                pool.host_capacity_tokens * unified_buffer.spec(name).entry_bytes()
            )
        # Full-attention transfers use virtual IDs. SWA transfers already use
        # physical IDs from translate_loc_from_full_to_swa.
        kvcache.full_kv_pool.host_transfer_translate = (
            self.full_attn_allocator.translate_kv_loc
        )

        self.free_group = None
        self.free_page_reps_group: Optional[List[torch.Tensor]] = None
        self.full_page_reps_group: List[torch.Tensor] = []
        self.full_free_group: List[torch.Tensor] = []
        # Empty (not None) for the leak checker.
        self.free_pages = torch.empty(0, dtype=torch.int64, device=device)
        self.release_pages = torch.empty(0, dtype=torch.int64, device=device)

        logger.info(
            "[unified-memory-pool] UnifiedSWATokenToKVPoolAllocator ready: "
            "full max_slots=%d (min_slot_index=%d, entry_bytes=%d), "
            "swa max_slots=%d (min_slot_index=%d, entry_bytes=%d), "
            "max capacity full=%d swa=%d, joint available=%d",
            self.full_attn_allocator.max_slots,
            self.full_attn_allocator.min_slot_index,
            self.full_attn_allocator.entry_bytes,
            self.swa_attn_allocator.max_slots,
            self.swa_attn_allocator.min_slot_index,
            self.swa_attn_allocator.entry_bytes,
            self._full_max_total_num_tokens,
            self._swa_max_total_num_tokens,
            self.available_size(),
        )

    # -- construction hooks (the tri-pool subclass overrides both) --

    # -- capacity reporting (three-way split) --

    def available_size(self) -> int:
        """Tokens available for `alloc(N)` / `alloc_extend(N)` (TOKENS)."""
        epoch = self.full_attn_allocator._chain_capacity_epoch()
        if self._joint_avail_memo_epoch != epoch:
            self._joint_avail_memo_tokens = self._compute_available_size()
            self._joint_avail_memo_epoch = epoch
        return self._joint_avail_memo_tokens

    # Slot-conservation views for the leak invariant only; the byte-coordinated
    # value would flag spurious leaks. `allocated_count()` is in TOKENS.
    def _conserve_full_available_size(self) -> int:
        return (
            self._full_max_total_num_tokens - self.full_attn_allocator.allocated_count()
        )

    def _conserve_swa_available_size(self) -> int:
        return (
            self._swa_max_total_num_tokens - self.swa_attn_allocator.allocated_count()
        )

    # Per-side views read by scheduling / eviction: the static-conserve cap bounds
    # the lending side, `schedulable_*` the side grown into the shared gap.
    def full_available_size(self) -> int:
        return min(
            self._conserve_full_available_size(),
            self.schedulable_full_available_size(),
        )

    def swa_available_size(self) -> int:
        return min(
            self._conserve_swa_available_size(),
            self.schedulable_swa_available_size(),
        )

    # Leak-invariant aliases; schedulers take the `min(...)` views above, whose
    # byte term dips below the conserve cap when bytes are lent to a peer.
    def conserve_full_available_size(self) -> int:
        return self._conserve_full_available_size()

    def conserve_swa_available_size(self) -> int:
        return self._conserve_swa_available_size()

    # Byte-coordinated, realizable-with-compaction views (peer drainable holes
    # credited -- see `MultiEndedAllocator.schedulable_available_size`).
    def schedulable_full_available_size(self) -> int:
        return self.full_attn_allocator.schedulable_available_size()

    def schedulable_swa_available_size(self) -> int:
        return self.swa_attn_allocator.schedulable_available_size()

    # `size_full` / `size_swa` bound each side independently; current capacities
    # also account for the peer's live byte usage.

    @property
    def current_full_capacity(self) -> int:
        return self.full_available_size() + self.full_attn_allocator.allocated_count()

    @property
    def current_swa_capacity(self) -> int:
        return self.swa_available_size() + self.swa_attn_allocator.allocated_count()

    @property
    def draft_virtual_id_space(self) -> int:
        return self.full_attn_allocator.max_slots - 1

    def debug_print(self) -> str:
        return (
            f"#full-available={self.full_attn_allocator.available_size()}, "
            f"#swa-available={self.swa_attn_allocator.available_size()}, "
            f"#joint-available={self.available_size()}"
        )

    def get_kvcache(self):
        return self._kvcache

    def translate_kv_loc(
        self,
        loc: torch.Tensor,
        *,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Full-layer read path: virtual TOKEN ids -> full-physical TOKEN ids.
        ``out=`` writes in place, for cuda-graph buffer stability."""
        result = self.full_attn_allocator.translate_kv_loc(loc, out=out)
        return result

    def translate_loc_from_full_to_swa(
        self,
        kv_indices: torch.Tensor,
        *,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """SWA-layer read path: virtual TOKEN ids -> swa-physical TOKEN ids."""
        return self.swa_attn_allocator.translate_kv_loc(kv_indices, out=out)

    @property
    def full_v2p_page_table(self) -> torch.Tensor:
        """Page-level virtual->physical table of the full sub-pool."""
        return self.full_attn_allocator.virtual_to_physical

    @property
    def full_p2v_page_table(self) -> torch.Tensor:
        """Page-level physical->virtual table of the full sub-pool."""
        return self.full_attn_allocator.physical_to_virtual

    def translate_kv_indices_for_transfer(
        self, kv_indices: torch.Tensor
    ) -> torch.Tensor:
        """Virtual TOKEN ids -> full-sub-pool PHYSICAL token ids for the PD
        transfer engine.

        The transfer registers page ENVELOPES and addresses them by PHYSICAL id (see
        `UnifiedMHATokenToKVPool.get_contiguous_buf_infos`). Without this
        override the base identity would put VIRTUAL ids on the wire, which
        address real bytes and so corrupt silently rather than fail.
        """
        return self.full_attn_allocator.translate_kv_loc(kv_indices.to(torch.int64))

    def translate_swa_indices_for_transfer(
        self, kv_indices: torch.Tensor
    ) -> torch.Tensor:
        """Virtual TOKEN ids -> swa-sub-pool PHYSICAL token ids, for the PD
        transfer engine: the same translate as `translate_loc_from_full_to_swa`,
        on int64 ids."""
        return self.swa_attn_allocator.translate_kv_loc(kv_indices.to(torch.int64))

    def _move_gate_targets(self):
        """Every member a compaction gate must cover. A subclass that adds an
        end overrides THIS, and every gate widens with it."""
        return (self.full_attn_allocator, self.swa_attn_allocator)

    def set_disagg_move_gate(self, gate: Callable[[], bool]) -> None:
        install_move_gate(
            self._move_gate_targets(),
            slot="disagg_move_gate",
            gate=gate,
            feature="PD disaggregation",
            lazy_compaction=self.lazy_compaction,
        )

    def set_host_transfer_move_gate(self, gate: Callable[[], bool]) -> None:
        """Block page relocation while host transfers use resolved device indices."""
        install_move_gate(
            self._move_gate_targets(),
            slot="host_transfer_move_gate",
            gate=gate,
            feature="HiCache",
            lazy_compaction=self.lazy_compaction,
        )

    def prewarm_compaction(self) -> None:
        """Prewarm the page-move path of every member that compacts."""
        for allocator in self._move_gate_targets():
            allocator.prewarm_compaction()

    def translate_write_loc(
        self,
        loc: torch.Tensor,
        *,
        out: Optional[torch.Tensor] = None,
        out_width: Optional[int] = None,
    ) -> torch.Tensor:
        """Widened virtual WRITE loc -> physical id. DCP is rejected for this
        composite at argument validation, so it coincides with the read translate."""
        return self.full_attn_allocator.translate_write_loc(
            loc, out=out, out_width=out_width
        )

    @property
    def swa_v2p_page_table(self) -> torch.Tensor:
        """Page-level virtual->physical table of the SWA sub-pool."""
        return self.swa_attn_allocator.virtual_to_physical

    # -- alloc --

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        with record_function("UnifiedSWAAlloc.alloc"):
            if not self.ensure_capacity(need_size, need_size):
                return None
            # Snapshot the virtual PAGES full will consume, to bind them on swa too.
            num_pages = need_size // self.page_size
            fa = self.full_attn_allocator
            new_virtual_pages = fa.free_virtual_ids[:num_pages].clone()

            v_tokens = fa.alloc(need_size)
            # Post-pre-check failure can only be internal-state inconsistency.
            assert v_tokens is not None, (
                "UnifiedSWA.alloc: full.alloc returned None after joint "
                "pre-check passed — internal-state inconsistency"
            )
            self.swa_attn_allocator.alloc_with_virtual(new_virtual_pages)
            return v_tokens

    def _extend_in_virtual_space(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        *,
        num_swa_pages: Optional[int] = None,
    ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """Run the full side's paged extend and report which virtual PAGES it
        newly took. Returns (virtual TOKEN ids, new virtual PAGE ids), or None
        when the joint capacity check cannot fund the allocation.

        Both extend entries share this; they differ only in which of those pages
        the sliding-window side then binds.
        """
        num_new_pages = get_num_new_pages(
            seq_lens=seq_lens_cpu,
            page_size=self.page_size,
            prefix_lens=prefix_lens_cpu,
        )
        need_tokens = num_new_pages * self.page_size
        swa_tokens = (
            need_tokens if num_swa_pages is None else num_swa_pages * self.page_size
        )
        if not self.ensure_capacity(need_tokens, swa_tokens):
            return None

        # free_virtual_ids is rebound (slice/cat), never mutated in place,
        # so this prefix view stays valid for SWA after FULL consumes it.
        fa = self.full_attn_allocator
        new_virtual_pages = fa.free_virtual_ids[:num_new_pages]

        out_indices = fa.alloc_extend(
            prefix_lens,
            prefix_lens_cpu,
            seq_lens,
            seq_lens_cpu,
            last_loc,
            extend_num_tokens,
            num_new_pages=num_new_pages,
        )
        assert out_indices is not None, (
            "UnifiedSWA: full.alloc_extend returned None after joint pre-check "
            "passed — internal-state inconsistency"
        )
        return out_indices, new_virtual_pages

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> Optional[torch.Tensor]:
        """Paged extend; returns virtual TOKEN ids. The same virtual page maps to
        full- and swa-physical, so swa binds exactly what the full kernel consumed."""
        with record_function("UnifiedSWAAlloc.alloc_extend"):
            extended = self._extend_in_virtual_space(
                prefix_lens,
                prefix_lens_cpu,
                seq_lens,
                seq_lens_cpu,
                last_loc,
                extend_num_tokens,
            )
            if extended is None:
                return None
            out_indices, new_virtual_pages = extended
            self.swa_attn_allocator.alloc_with_virtual(new_virtual_pages)
            return out_indices  # virtual TOKEN ids

    def alloc_extend_swa_tail(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        swa_tail_len: int,
    ) -> Optional[torch.Tensor]:
        """Decode-node prealloc: full KV for the whole sequence, sliding-window
        KV for the live window tail only.

        The static composite allocates the two sides independently and records
        a full->swa index mapping. That is not representable here: the two
        sides SHARE one virtual id space (a virtual page names a full-physical
        page and, if bound, a swa-physical one). Load-back installs that binding
        through `set_full_to_swa_mapping`, and `translate_loc_from_full_to_swa`
        resolves the SWA kernel-facing id from the shared virtual id. Running the
        static body would call `alloc_extend` on the swa sub-allocator, which
        asserts it is not the id owner.

        The tail is expressed by binding swa for the TAIL's virtual pages only.
        A new page left unbound has no swa-physical page, which reads as the
        sink and is skipped by `free`'s `swa_v2p_page > 0` mask -- exactly the
        out-of-window state the ratchet produces via `free_swa`.

        Admission prices FULL's new pages and only the new pages in the SWA
        tail. A partial prefix page is already bound and costs no new SWA page.
        """
        assert len(prefix_lens_cpu) == 1
        assert 0 <= swa_tail_len <= extend_num_tokens
        with record_function("UnifiedSWAAlloc.alloc_extend_swa_tail"):
            prefix_len = int(prefix_lens_cpu[0])
            seq_len = int(seq_lens_cpu[0])
            first_new_page = (prefix_len + self.page_size - 1) // self.page_size
            first_tail_page = (seq_len - swa_tail_len) // self.page_size
            num_swa_pages = (
                (seq_len + self.page_size - 1) // self.page_size
                - max(first_new_page, first_tail_page)
                if swa_tail_len
                else 0
            )
            extended = self._extend_in_virtual_space(
                prefix_lens,
                prefix_lens_cpu,
                seq_lens,
                seq_lens_cpu,
                last_loc,
                extend_num_tokens,
                num_swa_pages=num_swa_pages,
            )
            if extended is None:
                return None
            out_indices, new_virtual_pages = extended
            if swa_tail_len > 0 and new_virtual_pages.numel() > 0:
                tail_pages = torch.unique(out_indices[-swa_tail_len:] // self.page_size)
                # Only NEW pages need binding; a tail page carried in from the
                # prefix is already bound on the swa side.
                to_bind = new_virtual_pages[torch.isin(new_virtual_pages, tail_pages)]
                if to_bind.numel() > 0:
                    self.swa_attn_allocator.alloc_with_virtual(to_bind)
            return out_indices  # virtual TOKEN ids

    def alloc_decode(
        self,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
    ) -> Optional[torch.Tensor]:
        """Paged decode: one new token per request, consuming a page only when the
        decode wraps."""
        with record_function("UnifiedSWAAlloc.alloc_decode"):
            num_new_pages = get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True
            )
            need_tokens = num_new_pages * self.page_size
            if not self.ensure_capacity(need_tokens, need_tokens):
                return None

            fa = self.full_attn_allocator
            new_virtual_pages = fa.free_virtual_ids[:num_new_pages].clone()

            out_indices = fa.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
            assert out_indices is not None, (
                "UnifiedSWA.alloc_decode: full.alloc_decode returned None "
                "after joint pre-check passed — internal-state inconsistency"
            )

            if new_virtual_pages.numel() > 0:
                self.swa_attn_allocator.alloc_with_virtual(new_virtual_pages)

            return out_indices  # virtual TOKEN ids

    def is_slot_allocated(self, slot: int) -> bool:
        """Token-slot surface = the full side (which owns the virtual ids)."""
        return self.full_attn_allocator.is_slot_allocated(slot)

    def allocator_state_str(self) -> str:
        return self.full_attn_allocator.allocator_state_str()

    # -- free --

    def free(self, free_index: torch.Tensor) -> None:
        with record_function("UnifiedSWAAlloc.free"):
            if free_index is None or free_index.numel() == 0:
                return
            if self.free_group is not None:
                self.free_group.append(self._copy_for_free_group(free_index))
                return
            # Order is not load-bearing: the per-sub-pool v2p IS the mapping. Only
            # swa needs the tombstone filter; full owns the ids, so all are bound.
            v = free_index.detach().to(torch.int64)
            v_pages = v // self.page_size
            swa_v2p_pages = self.swa_attn_allocator.virtual_to_physical[v_pages]
            # `> 0` strict: -1 = tombstoned, 0 = padding-sink page; both skipped.
            live_token_mask = swa_v2p_pages > 0
            live_tokens = v[live_token_mask]
            if live_tokens.numel() > 0:
                self.swa_attn_allocator.free(live_tokens)
            self.full_attn_allocator.free(v)
            self.full_attn_allocator.clear_inverse_history()
            self.swa_attn_allocator.clear_inverse_history()

    def free_swa(self, free_index: torch.Tensor) -> None:
        """SWA tombstone path: release swa-physical, keep the virtual id and
        full-physical live; `swa.v2p_page[v_page] = -1` IS the tombstone."""
        if free_index is None or free_index.numel() == 0:
            return
        v = free_index.detach().to(torch.int64)
        ps = self.page_size
        v_pages = v // ps
        # `> 0` strict: -1 = tombstoned, page 0 = padding sink (never freeable).
        swa_v2p_pages = self.swa_attn_allocator.virtual_to_physical[v_pages]
        live = v[swa_v2p_pages > 0]
        if live.numel() == 0:
            return
        if ps == 1:
            # token == page and the live filter just deduped against the v2p
            # table, so these ARE unique page ids -- same skip as `_free_lazy`.
            self.swa_attn_allocator.free(live, _pages=live)
        else:
            self.swa_attn_allocator.free(live)
        self.swa_attn_allocator.clear_inverse_history()

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """free_swa() for a kv-row segment whose swa pages are all bound: page reps
        come from `start_pos`, so it is fixed-shape at every page size."""
        if free_index is None or free_index.numel() == 0:
            return
        reps = self.swa_attn_allocator._page_reps(
            free_index.detach().to(torch.int64), start_pos
        )
        self._free_swa_page_reps(reps)
        self.swa_attn_allocator.clear_inverse_history()

    def _free_swa_page_reps(self, reps: torch.Tensor) -> None:
        v_pages = reps // self.page_size
        # Signal-only invariant: avoid launching its lookup and comparison
        # when detection is disabled. This invariant has no recovery action.
        if resolve_level() >= InvariantCheckLevel.WARN:
            expect(
                UNIFIED_SWA_SEGMENT_BOUND,
                self.swa_attn_allocator.virtual_to_physical[v_pages] > 0,
                msg="caller wants free_full_segment",
            )
        self.swa_attn_allocator.free(reps, _pages=v_pages)

    def free_full(self, free_index: torch.Tensor) -> None:
        """Release the full-physical page and the virtual id, leaving the swa
        side alone -- the caller already tombstoned it (`swa.v2p_page == -1`)."""
        if free_index is None or free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.full_free_group.append(self._copy_for_free_group(free_index))
            return
        self.full_attn_allocator.free(free_index.detach().to(torch.int64))
        self.full_attn_allocator.clear_inverse_history()

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Release a kv-row segment's full side; its swa side is already tombstoned."""
        if free_index is None or free_index.numel() == 0:
            return
        reps = self.full_attn_allocator._page_reps(
            free_index.detach().to(torch.int64), start_pos
        )
        # Signal-only invariant: avoid launching its lookup and comparison
        # when detection is disabled. This invariant has no recovery action.
        if resolve_level() >= InvariantCheckLevel.WARN:
            expect(
                UNIFIED_SWA_SEGMENT_RELEASED,
                self.swa_attn_allocator.virtual_to_physical[reps // self.page_size]
                <= 0,
                msg="caller wants free_segment",
            )
        if self.free_page_reps_group is None:
            self._release_page_reps((), (reps,))
        else:
            self.full_page_reps_group.append(reps)

    def set_full_to_swa_mapping(
        self, full_indices: torch.Tensor, swa_indices: torch.Tensor
    ) -> None:
        if full_indices.numel() == 0:
            return
        assert full_indices.numel() == swa_indices.numel()
        full_pages = full_indices.to(torch.int64) // self.page_size
        swa_pages = swa_indices.to(torch.int64) // self.page_size
        self.swa_attn_allocator.bind(full_pages, swa_pages)

    def clear_full_to_swa_mapping(self, full_indices: torch.Tensor) -> None:
        # Paired with set_full_to_swa_mapping: shared mode has no mapping tensor.
        return

    # -- free-group --

    # Not the SWA parent's hooks: those open the parent's paged full allocator
    # as a free group, and this composite's sub-pools defer on their own.
    def free_group_begin(self) -> None:
        BaseTokenToKVPoolAllocator.free_group_begin(self)
        self.free_page_reps_group = []
        self.full_page_reps_group = []
        self.full_free_group = []

    def free_group_end(self) -> None:
        pending, self.free_page_reps_group = self.free_page_reps_group, None
        full_pending, self.full_page_reps_group = self.full_page_reps_group, []
        full_free_group, self.full_free_group = self.full_free_group, []
        BaseTokenToKVPoolAllocator.free_group_end(self)
        if full_free_group:
            self.full_attn_allocator.free(torch.cat(full_free_group))
            self.full_attn_allocator.clear_inverse_history()
        if pending or full_pending:
            self._release_page_reps(pending, full_pending)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Fixed-shape counterpart of `free()` for a segment whose swa pages are all
        bound; see `MultiEndedAllocator._page_reps`."""
        if free_index is None or free_index.numel() == 0:
            return
        reps = self.full_attn_allocator._page_reps(
            free_index.detach().to(torch.int64), start_pos
        )
        if self.free_page_reps_group is None:
            self._release_page_reps((reps,), ())
        else:
            self.free_page_reps_group.append(reps)

    def _release_page_reps(
        self, both: Sequence[torch.Tensor], full_only: Sequence[torch.Tensor]
    ) -> None:
        """Free page reps: `both` on the swa and full sides, `full_only` on full."""
        if both:
            self._free_swa_page_reps(
                both[0] if len(both) == 1 else torch.cat(tuple(both))
            )
        pieces = (*both, *full_only)
        reps = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        self.full_attn_allocator.free(reps, _pages=reps // self.page_size)
        self.full_attn_allocator.clear_inverse_history()
        self.swa_attn_allocator.clear_inverse_history()

    def _joint_capacity_memo_violations(self) -> List[str]:
        """Idle-time twin of `MultiEndedAllocator._capacity_memo_violations`
        for the composite joint view. Empty == healthy."""
        if (
            self._joint_avail_memo_epoch
            != self.full_attn_allocator._chain_capacity_epoch()
        ):
            return []
        actual = self._compute_available_size()
        if self._joint_avail_memo_tokens == actual:
            return []
        return [
            f"[joint] stale available_size memo: "
            f"cached={self._joint_avail_memo_tokens}, actual={actual}"
        ]

    def clear(self) -> None:
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.free_group = None
        self.free_page_reps_group = None
        self.full_page_reps_group = []
        self.full_free_group = []

    # -- Lazy compaction hooks --

    def set_latest_forward_done_event(self, event: Optional[torch.cuda.Event]) -> None:
        """Forward the per-batch `forward_done` event to BOTH sub-allocators."""
        with record_function("UnifiedSWAAlloc.set_latest_forward_done_event"):
            self.full_attn_allocator.set_latest_forward_done_event(event)
            self.swa_attn_allocator.set_latest_forward_done_event(event)

    def set_inflight_forward(
        self,
        forward_done: torch.cuda.Event,
        out_cache_loc_virtual: Optional[torch.Tensor],
    ) -> None:
        """Hand the forward's metadata to BOTH sub-pools; each materializes its own
        write-set via its OWN v2p, and the forward writes both sides per token."""
        with record_function("UnifiedSWAAlloc.set_inflight_forward"):
            self.full_attn_allocator.set_inflight_forward(
                forward_done, out_cache_loc_virtual
            )
            self.swa_attn_allocator.set_inflight_forward(
                forward_done, out_cache_loc_virtual
            )

    @abstractmethod
    def _build_swa_attn_allocator(self, **kwargs) -> MultiEndedAllocator: ...

    @abstractmethod
    def _wire_peers(self) -> None: ...

    @abstractmethod
    def _compute_available_size(self) -> int: ...

    @abstractmethod
    def ensure_capacity(self, full_tokens: int, swa_tokens: int) -> bool: ...

    @abstractmethod
    def _flush_targets(self): ...

    @abstractmethod
    def _ask_float_for_room(self, need_tokens: int) -> None: ...

    def set_hicache_transfer_done_event(self, transfer_key: Hashable, event) -> None:
        self.full_attn_allocator.set_hicache_transfer_done_event(transfer_key, event)
        self.swa_attn_allocator.set_hicache_transfer_done_event(transfer_key, event)


class UnifiedSWATokenToKVPoolAllocator(UnifiedSWAAllocatorBase):
    """Two-ended FULL/SWA allocator with asymmetric shared-byte reservations."""

    def _build_swa_attn_allocator(self, **kwargs) -> MultiEndedAllocator:
        """The swa sub-allocator: an END pool in the 2-pool pair."""
        return MultiEndedAllocator(
            sub_pool_name="swa",
            is_id_owner=False,  # non-owner; consumes virtuals minted by full
            **kwargs,
        )

    def _wire_peers(self) -> None:
        self.full_attn_allocator.bind_peer(self.swa_attn_allocator)
        self.swa_attn_allocator.bind_peer(self.full_attn_allocator)

    def _compute_available_size(self) -> int:
        """Joint byte budget in TOKENS: each composite alloc(1) consumes one
        full-side AND one swa-side page under the same virtual id."""
        fa, sa = self.full_attn_allocator, self.swa_attn_allocator
        e_f = fa.entry_bytes_per_page
        e_s = sa.entry_bytes_per_page
        # Direction-agnostic shared gap: the free byte band between the two pools.
        if fa.grow_direction == "up":
            gap_bytes = max(0, sa._byte_low_frontier() - fa._byte_high_frontier())
        else:
            gap_bytes = max(0, fa._byte_low_frontier() - sa._byte_high_frontier())
        R_f = fa.num_pages - fa.min_page_index - fa._allocated_pages()
        R_s = sa.num_pages - sa.min_page_index - sa._allocated_pages()

        if not self.lazy_compaction:
            pages_by_bytes = gap_bytes // (e_f + e_s)
            return min(pages_by_bytes, R_f, R_s) * self.page_size

        H_f = len(fa._free_phys_pages)
        H_s = len(sa._free_phys_pages)

        K1 = min(H_f, H_s)  # Phase 1: both drain

        # Phase 2: fewer-holes side extends; more-holes side keeps draining.
        if H_f <= H_s:
            e_phase2 = e_f
            K_phase2_max = H_s
        else:
            e_phase2 = e_s
            K_phase2_max = H_f
        K2_room = K_phase2_max - K1
        K2 = min(K2_room, gap_bytes // e_phase2) if e_phase2 > 0 else K2_room
        gap_bytes -= K2 * e_phase2

        K3 = gap_bytes // (e_f + e_s)  # Phase 3: both extend

        K_total = K1 + K2 + K3
        K_total = min(K_total, H_f + R_f, H_s + R_s)  # index-space caps
        return K_total * self.page_size

    def _flush_targets(self):
        """Flush ALL members, including ones that are not short themselves: a
        one-sided hole is unusable, and compacting it yields SHARED gap."""
        return (self.full_attn_allocator, self.swa_attn_allocator)

    def _ask_float_for_room(self, need_tokens: int) -> None:
        """No float in a two-END chain -- nothing can slide."""
        return None

    def prealloc_fits_assumes_reclaim(self) -> bool:
        return True

    def prealloc_ceiling_fits(self, full_tokens: int, swa_tokens: int) -> bool | None:
        return self.can_reserve(full_tokens, swa_tokens, empty_pool=True)

    def reclaim_for_prealloc(
        self, tree_cache, full_tokens: int, swa_tokens: int
    ) -> str | None:
        """Reclaim both sides together: freeing FULL pages can open SWA room
        and the reverse, so the shared envelope is the only gate worth
        re-checking."""
        ready = self.evict_to_free_tokens(
            tree_cache, full_tokens, swa_num_tokens=swa_tokens
        )
        if ready is None:
            ready = self.ensure_capacity(full_tokens, swa_tokens)
        if ready:
            return None
        return (
            "Unified FULL/SWA byte reclamation insufficient: "
            f"needed=({full_tokens}, {swa_tokens})"
        )

    def prealloc_fits(
        self,
        tree_cache,
        full_tokens: int,
        swa_tokens: int,
        *,
        full_budget_tokens: int,
        swa_budget_tokens: int | None = None,
    ) -> bool:
        """Price both sides against the shared byte envelope.

        There is no per-side capacity for the scheduler's budget to be
        compared against, so the gap between that budget and what this side
        can currently hand out is folded back into the demand; `can_reserve`
        then prices the whole ask in bytes. Reachable only for hybrid-SWA
        models, so the tree's `full_*` accounting is the full-attention one.
        """
        full_evictable_tokens = tree_cache.full_evictable_size()
        swa_evictable_tokens = tree_cache.swa_evictable_size()
        full_tokens += (
            self.full_available_size() + full_evictable_tokens - full_budget_tokens
        )
        if swa_budget_tokens is not None:
            swa_tokens += (
                self.swa_available_size() + swa_evictable_tokens - swa_budget_tokens
            )
        return self.can_reserve(
            full_tokens,
            swa_tokens,
            full_evictable_tokens=full_evictable_tokens,
            swa_evictable_tokens=swa_evictable_tokens,
        )

    def reclaim_plan(
        self,
        full_tokens: int | float,
        swa_tokens: int | float,
        *,
        full_evictable_tokens: int = 0,
        swa_evictable_tokens: int = 0,
        empty_pool: bool = False,
        prefer_swa: bool = False,
    ) -> Optional[Tuple[int, int]]:
        """Return cumulative FULL/SWA eviction targets, or None if impossible.

        The tree evicts FULL before SWA. Minimize required SWA reclaim with all
        evictable FULL available, then trim excess FULL reclaim. FULL eviction's
        actual SWA cascade is counted by the tree's shared eviction tracker.
        With ``prefer_swa``, minimize FULL reclaim first and trim SWA instead.
        """
        if full_tokens < 0 or swa_tokens < 0:
            return None

        page_size = self.page_size
        full_pages = (math.ceil(full_tokens) + page_size - 1) // page_size
        swa_pages = (math.ceil(swa_tokens) + page_size - 1) // page_size
        # Restoring host SWA for device-resident FULL can require more new
        # SWA pages than new FULL pages; only the shared budget constrains it.

        compacted = empty_pool or not self.lazy_compaction or self._compaction_allowed()

        def fits(full_reclaim_pages: int, swa_reclaim_pages: int) -> bool:
            return self._fits_page_demand(
                full_pages,
                swa_pages,
                full_reclaim_pages=full_reclaim_pages,
                swa_reclaim_pages=swa_reclaim_pages,
                compacted=compacted,
                empty_pool=empty_pool,
            )

        if empty_pool:
            return (0, 0) if fits(0, 0) else None
        if fits(0, 0):
            return (0, 0)

        max_full_pages = min(
            self.full_attn_allocator.allocated_count() // page_size,
            max(0, int(full_evictable_tokens)) // page_size,
        )
        max_swa_pages = min(
            self.swa_attn_allocator.allocated_count() // page_size,
            max(0, int(swa_evictable_tokens)) // page_size,
        )
        if not fits(max_full_pages, max_swa_pages):
            return None

        def first_fit(high: int, predicate: Callable[[int], bool]) -> int:
            low = 0
            while low < high:
                mid = (low + high) // 2
                if predicate(mid):
                    high = mid
                else:
                    low = mid + 1
            return low

        if prefer_swa:
            full_reclaim_pages = first_fit(
                max_full_pages, lambda value: fits(value, max_swa_pages)
            )
            swa_reclaim_pages = first_fit(
                max_swa_pages, lambda value: fits(full_reclaim_pages, value)
            )
        else:
            swa_reclaim_pages = first_fit(
                max_swa_pages, lambda value: fits(max_full_pages, value)
            )
            full_reclaim_pages = first_fit(
                max_full_pages, lambda value: fits(value, swa_reclaim_pages)
            )
        return (
            full_reclaim_pages * page_size,
            swa_reclaim_pages * page_size,
        )

    def can_reserve(
        self,
        full_tokens: int | float,
        swa_tokens: int | float,
        *,
        full_evictable_tokens: int = 0,
        swa_evictable_tokens: int = 0,
        empty_pool: bool = False,
        require_token_slack: bool = False,
    ) -> bool:
        """Check pending FULL/SWA demand against the shared byte envelope.

        Scheduler admission keeps the historical one-token strict slack at an
        empty-pool boundary. Live admission checks the state reachable after
        reclaiming the currently evictable pages from both sides.
        """
        if full_tokens < 0 or swa_tokens < 0:
            return False
        if require_token_slack and (
            full_tokens >= self.size_full or swa_tokens >= self.size_swa
        ):
            return False

        return (
            self.reclaim_plan(
                full_tokens,
                swa_tokens,
                full_evictable_tokens=full_evictable_tokens,
                swa_evictable_tokens=swa_evictable_tokens,
                empty_pool=empty_pool,
            )
            is not None
        )

    def _compaction_allowed(self) -> bool:
        return all(
            not allocator.moves_blocked()
            for allocator in (self.full_attn_allocator, self.swa_attn_allocator)
        )

    def _fits_page_demand(
        self,
        num_full_pages: int,
        num_swa_pages: int,
        *,
        full_reclaim_pages: int = 0,
        swa_reclaim_pages: int = 0,
        compacted: bool,
        empty_pool: bool = False,
    ) -> bool:
        """Check one FULL/SWA page demand against a single allocator snapshot."""
        if min(num_full_pages, num_swa_pages) < 0:
            return False

        fa, sa = self.full_attn_allocator, self.swa_attn_allocator
        if empty_pool:
            full_live_pages = swa_live_pages = 0
            full_reclaim_pages = swa_reclaim_pages = 0
        else:
            full_live_pages = fa.allocated_count() // self.page_size
            swa_live_pages = sa.allocated_count() // self.page_size
            full_reclaim_pages = min(full_live_pages, max(0, int(full_reclaim_pages)))
            swa_reclaim_pages = min(swa_live_pages, max(0, int(swa_reclaim_pages)))

        full_live_pages -= full_reclaim_pages
        swa_live_pages -= swa_reclaim_pages
        full_total_pages = full_live_pages + num_full_pages
        swa_total_pages = swa_live_pages + num_swa_pages
        virtual_page_capacity = fa.num_virtual_ids - fa.min_page_index
        full_page_capacity = min(
            virtual_page_capacity,
            fa.num_pages - fa.min_page_index,
        )
        swa_page_capacity = min(
            virtual_page_capacity,
            sa.num_pages - sa.min_page_index,
        )
        if full_total_pages > full_page_capacity or swa_total_pages > swa_page_capacity:
            return False

        if compacted:
            full_virtual_room = virtual_page_capacity - full_live_pages
            full_holes = swa_holes = 0
            full_index_room = full_page_capacity - full_live_pages
            swa_index_room = swa_page_capacity - swa_live_pages
            gap_bytes = (
                self._empty_shared_gap_bytes
                - full_live_pages * fa.entry_bytes_per_page
                - swa_live_pages * sa.entry_bytes_per_page
            )
        else:
            full_virtual_room = len(fa.free_virtual_ids) + full_reclaim_pages
            full_holes = len(fa._free_phys_pages) + full_reclaim_pages
            swa_holes = len(sa._free_phys_pages) + swa_reclaim_pages
            full_index_room = fa.num_pages - fa.min_page_index - fa._allocated_pages()
            swa_index_room = sa.num_pages - sa.min_page_index - sa._allocated_pages()
            gap_bytes = fa._current_gap_bytes()

        if num_full_pages > full_virtual_room:
            return False
        if num_full_pages > full_holes + full_index_room:
            return False
        if num_swa_pages > swa_holes + swa_index_room:
            return False
        full_extensions = max(0, num_full_pages - full_holes)
        swa_extensions = max(0, num_swa_pages - swa_holes)
        return (
            full_extensions * fa.entry_bytes_per_page
            + swa_extensions * sa.entry_bytes_per_page
            <= max(0, gap_bytes)
        )

    def ensure_capacity(self, full_tokens: int, swa_tokens: int) -> bool:
        """Gate one allocation and compact both sides on shortfall."""
        if full_tokens < 0 or swa_tokens < 0:
            return False
        if full_tokens == 0 and swa_tokens == 0:
            return True
        page_size = self.page_size
        num_full_pages = (int(full_tokens) + page_size - 1) // page_size
        num_swa_pages = (int(swa_tokens) + page_size - 1) // page_size
        if self._fits_page_demand(
            num_full_pages,
            num_swa_pages,
            compacted=False,
        ):
            return True
        if not self.lazy_compaction or not self._compaction_allowed():
            return False
        if not self._fits_page_demand(
            num_full_pages,
            num_swa_pages,
            compacted=True,
        ):
            return False
        self.full_attn_allocator.flush_for_allocation()
        self.swa_attn_allocator.flush_for_allocation()
        return self._fits_page_demand(
            num_full_pages,
            num_swa_pages,
            compacted=False,
        )

    def create_prefill_budget(self, tree_cache, *, num_mixed_decode_tokens=0):
        from sglang.srt.mem_cache.prefill_budget import SharedSWAPrefillBudget

        return SharedSWAPrefillBudget(
            self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens
        )

    def swa_capacity_and_available(self, *, full_capacity, swa_capacity):
        return (
            (self.current_full_capacity, self.full_available_size()),
            (self.current_swa_capacity, self.swa_available_size()),
        )

    def max_new_tokens_for_memory(
        self,
        input_tokens: int,
        max_new_tokens: int,
        *,
        token_capacity: int,
        sliding_window_size: int | None,
        chunk_size: int | None,
    ) -> int | None:
        from sglang.srt.mem_cache.prefill_budget import estimate_swa_kv_tokens

        def fits(candidate):
            return self.can_reserve(
                input_tokens + candidate + self.page_size,
                estimate_swa_kv_tokens(
                    input_tokens,
                    candidate,
                    sliding_window_size=sliding_window_size,
                    page_size=self.page_size,
                    allocation_limit=chunk_size,
                ),
                empty_pool=True,
                require_token_slack=True,
            )

        if not fits(0):
            return None
        if fits(max_new_tokens):
            return max_new_tokens
        lo, hi = 0, max_new_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def get_extend_allocation_demand(
        self,
        prefix_lens_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        *,
        conservative_num_tokens: int,
        shard_size: int,
    ) -> int:
        if shard_size != 1:
            return conservative_num_tokens
        return self.page_size * get_num_new_pages(
            seq_lens=seq_lens_cpu,
            page_size=self.page_size,
            prefix_lens=prefix_lens_cpu,
        )

    @rank_consensus(same_params=["num_tokens", "swa_num_tokens"], same_results=True)
    def evict_to_free_tokens(
        self, tree_cache, num_tokens: int, *, swa_num_tokens: Optional[int] = None
    ) -> bool | None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        # Read per call: storage attach/detach and PD role switches move both leaves.
        memory = get_memory()
        prefer_swa = (
            memory.enable_hierarchical_cache
            and memory.hicache_storage_backend is not None
        ) or get_disagg().disaggregation_mode == "decode"
        required_swa = num_tokens if swa_num_tokens is None else swa_num_tokens
        _flush_deferred_free_group(
            self,
            (
                self.free_group,
                self.free_page_reps_group,
                self.full_free_group,
                self.full_page_reps_group,
            ),
        )
        reclaim_plan = self.reclaim_plan(
            num_tokens,
            required_swa,
            full_evictable_tokens=tree_cache.full_evictable_size(),
            swa_evictable_tokens=tree_cache.swa_evictable_size(),
            prefer_swa=prefer_swa,
        )
        if reclaim_plan is None:
            return
        full_reclaim, swa_reclaim = reclaim_plan
        if full_reclaim or swa_reclaim:
            tree_cache.evict_for_alloc(
                EvictParams(num_tokens=full_reclaim, swa_num_tokens=swa_reclaim),
                allocation_reclaim_satisfied=lambda: (
                    self.reclaim_plan(num_tokens, required_swa) == (0, 0)
                ),
            )
        # A zero-reclaim plan can still depend on compaction before allocation.
        return self.ensure_capacity(num_tokens, required_swa)

    def verify_byte_accounting(self) -> List[str]:
        return (
            _chain_byte_accounting_violations(
                _end_pair_chain(self.full_attn_allocator, self.swa_attn_allocator)
            )
            + self._joint_capacity_memo_violations()
        )

    def flush_opportunistic(self) -> int:
        """Non-urgent flush of BOTH sub-allocators; sync-free."""
        with record_function("UnifiedSWAAlloc.flush_opportunistic"):
            fa = self.full_attn_allocator
            sa = self.swa_attn_allocator
            if (
                fa._free_phys_pages.numel() == 0
                and not fa._pending_reuse
                and sa._free_phys_pages.numel() == 0
                and not sa._pending_reuse
            ):
                return 0
            return fa.flush_opportunistic() + sa.flush_opportunistic()

    def resize(self, config) -> None:
        """Synchronize allocator capacity after the shared pool is finalized."""
        if not self.unified_buffer.post_capture_active:
            raise RuntimeError(
                "UnifiedSWATokenToKVPoolAllocator.resize requires post-capture backing"
            )
        final_pool_bytes = config.unified_memory_pool_bytes
        if final_pool_bytes is None:
            raise ValueError(
                "UnifiedSWATokenToKVPoolAllocator.resize requires "
                "config.unified_memory_pool_bytes"
            )
        if int(final_pool_bytes) != self.unified_buffer.total_bytes:
            raise RuntimeError(
                "UnifiedKVPool.finalize_backing must run before allocator.resize: "
                f"config has {int(final_pool_bytes)} bytes but the pool exposes "
                f"{self.unified_buffer.total_bytes} bytes"
            )
        for allocator in (self.full_attn_allocator, self.swa_attn_allocator):
            if allocator.allocated_count() != 0 or allocator._pending_reuse:
                raise RuntimeError(
                    f"cannot resize non-empty unified allocator "
                    f"{allocator.sub_pool_name!r}"
                )
        self.full_attn_allocator._set_capacity(self.unified_buffer.max_slots("full"))
        self.swa_attn_allocator._set_capacity(
            self.unified_buffer.max_slots("swa"),
            virtual_num_pages=self.full_attn_allocator.num_virtual_ids,
        )
        self._empty_shared_gap_bytes = self.full_attn_allocator._current_gap_bytes()
        self._size_full = self.full_attn_allocator.available_size()
        self._size_swa = min(
            self.swa_attn_allocator.available_size(),
            len(self.full_attn_allocator.free_virtual_ids) * self.page_size,
        )
        self._full_max_total_num_tokens = self._size_full
        self._swa_max_total_num_tokens = self._size_swa
        self._kvcache.size = self.full_attn_allocator.max_slots - 1
        self._kvcache.size_swa = self.swa_attn_allocator.max_slots - 1
        for allocator, pool, host_capacity in (
            (self.full_attn_allocator, self._kvcache.full_kv_pool, self._size_full),
            (self.swa_attn_allocator, self._kvcache.swa_kv_pool, self._size_swa),
        ):
            pool._num_pages = allocator.num_pages
            pool.size = allocator.num_pages * self.page_size - self.page_size
            pool.host_capacity_tokens = host_capacity
            pool.host_capacity_bytes = (
                host_capacity
                * self.unified_buffer.spec(allocator.sub_pool_name).entry_bytes()
            )


class UnifiedMambaSWATokenToKVPoolAllocator(UnifiedSWAAllocatorBase):
    """Tri-pool composite for models with full KV + SWA KV + mamba/conv state
    (both `mambaish_config` and `is_hybrid_swa`).

    Chain (low byte -> high byte):

        [ mamba/conv (grow-up END) | swa (FLOAT middle) | full (grow-down END) ]

    The ends never relocate, so they take the per-request state pool and the
    unbounded per-step grower; SWA is window-capped with the cheapest slots to
    move, and its out-of-window tombstones become float holes recycled in place.
    Per-request state is served through `mamba_allocator`, wrapped by
    `UnifiedMambaSlotAllocator`.
    """

    def __init__(
        self,
        *,
        unified_buffer: UnifiedKVPool,
        kvcache,  # UnifiedSWAKVPool
        mamba_kvcache,  # UnifiedMambaPool (req_to_token_pool.mamba_pool)
        device: str,
        full_max_total_num_tokens: int,
        swa_max_total_num_tokens: int,
        page_size: int = 1,
        need_sort: bool = False,
        forward_stream: Optional[torch.cuda.Stream] = None,
        lazy_compaction: bool = False,
    ):
        super().__init__(
            unified_buffer=unified_buffer,
            kvcache=kvcache,
            device=device,
            full_max_total_num_tokens=full_max_total_num_tokens,
            swa_max_total_num_tokens=swa_max_total_num_tokens,
            page_size=page_size,
            need_sort=need_sort,
            forward_stream=forward_stream,
            lazy_compaction=lazy_compaction,
        )
        # Per-request state END pool (grow-up; page_size=1 -- state is
        # per-request, orthogonal to KV paging).
        self.mamba_allocator = MultiEndedAllocator(
            kvcache=mamba_kvcache,
            unified_buffer=unified_buffer,
            sub_pool_name="mamba",
            device=device,
            is_id_owner=True,
            page_size=1,
            need_sort=need_sort,
            forward_stream=forward_stream,
            lazy_compaction=lazy_compaction,
        )
        # Chain wiring: mamba <-> swa(float) <-> full.
        self.mamba_allocator.bind_high_peer(self.swa_attn_allocator)
        self.swa_attn_allocator.bind_low_peer(self.mamba_allocator)
        self.swa_attn_allocator.bind_high_peer(self.full_attn_allocator)
        self.full_attn_allocator.bind_low_peer(self.swa_attn_allocator)

        # None, not empty: `free_pages is None` is the leak checker's documented
        # skip contract; its mamba census would mix physical and virtual ids.
        self.free_pages = None
        self.release_pages = None

        logger.info(
            "[unified-memory-pool] UnifiedMambaSWATokenToKVPoolAllocator ready: "
            "chain=[mamba(up) | swa(float) | full(down)], "
            "mamba max_slots=%d (entry_bytes=%d), joint available=%d",
            self.mamba_allocator.max_slots,
            self.mamba_allocator.entry_bytes,
            self.available_size(),
        )

    # -- construction hooks --

    def _build_swa_attn_allocator(self, **kwargs) -> MultiEndedAllocator:
        # The swa side is the FLOAT middle: it never runs the lazy event pipeline
        # regardless of the composite's flag (frees mark holes, allocs reuse them).
        kwargs["lazy_compaction"] = False
        return FloatMultiEndedAllocator(
            sub_pool_name="swa",
            is_id_owner=False,  # non-owner; consumes virtuals minted by full
            **kwargs,
        )

    def _wire_peers(self) -> None:
        # Chain wired in __init__ once the mamba end exists.
        return

    # -- capacity --

    def can_reserve(
        self,
        full_tokens: int | float,
        swa_tokens: int | float,
        *,
        full_evictable_tokens: int = 0,
        swa_evictable_tokens: int = 0,
        empty_pool: bool = False,
        require_token_slack: bool = False,
    ) -> bool:
        if (
            full_tokens < 0
            or swa_tokens < 0
            or full_evictable_tokens
            or swa_evictable_tokens
            or empty_pool
        ):
            return False
        return self._fits_page_demand(
            math.ceil(full_tokens / self.page_size),
            math.ceil(swa_tokens / self.page_size),
        )

    def prealloc_fits(
        self,
        tree_cache,
        full_tokens: int,
        swa_tokens: int,
        *,
        full_budget_tokens: int,
        swa_budget_tokens: int | None = None,
    ) -> bool:
        """Price the pair on the float chain's grid, then against the budgets.

        Each side's `available_size` takes `schedulable_available_size()`,
        which credits the peer's drainable holes, so the two are backed by the
        same bytes and a pair that fits each side alone can fail together. The
        budgets still apply on top: they carry decode headroom this allocator
        cannot see.
        """
        page_size = self.page_size
        if not self._fits_page_demand(
            -(-full_tokens // page_size), -(-swa_tokens // page_size)
        ):
            return False
        return full_tokens <= full_budget_tokens and (
            swa_budget_tokens is None or swa_tokens <= swa_budget_tokens
        )

    def ensure_capacity(self, full_tokens: int, swa_tokens: int) -> bool:
        if full_tokens < 0 or swa_tokens < 0:
            return False
        if self.can_reserve(full_tokens, swa_tokens):
            return True
        if full_tokens != swa_tokens:
            for allocator in self._flush_targets():
                allocator.flush_for_allocation()
            if self.can_reserve(full_tokens, swa_tokens):
                return True
            _float_open_short_side(
                self.swa_attn_allocator,
                {
                    self.full_attn_allocator: -(-full_tokens // self.page_size),
                    self.swa_attn_allocator: -(-swa_tokens // self.page_size),
                    self.mamba_allocator: 0,
                },
            )
            return self.can_reserve(full_tokens, swa_tokens)
        need_tokens = -(-int(full_tokens) // self.page_size) * self.page_size
        if not self._token_id_capacity(need_tokens):
            return False
        if need_tokens <= self.available_size():
            return True
        if self._token_end_reclaim_satisfied(need_tokens):
            # The certificate preserves FLOAT holes in place. Absorbing FLOAT
            # boundaries first would describe a different allocation layout.
            self.full_attn_allocator.flush_for_allocation()
            self.mamba_allocator.flush_for_allocation()
            return need_tokens <= self.available_size()
        if self._token_float_high_target(need_tokens) is not None:
            self.full_attn_allocator.flush_for_allocation()
            self.mamba_allocator.flush_for_allocation()
            if not self._token_id_capacity(need_tokens):
                return False
            if need_tokens <= self.available_size():
                return True
            # Recompute from actual frontiers: no credit for another END flush.
            target = self._token_float_high_target(need_tokens, flush_ends=False)
            if target is None:
                return False
            self.swa_attn_allocator.make_room(side="high", min_bytes=target)
            return self._token_id_capacity(need_tokens) and (
                need_tokens <= self.available_size()
            )
        if self._token_allocation_byte_shortfall(need_tokens) > 0:
            return False
        return _relieve_for_alloc(self, need_tokens)

    def _token_id_capacity(self, num_tokens: int) -> bool:
        sa = self.swa_attn_allocator
        return (
            num_tokens // self.page_size
            <= self.full_attn_allocator.free_virtual_ids.numel()
            and num_tokens // self.page_size
            <= sa.num_pages - sa.min_page_index - sa._live_pages()
        )

    def _token_reclaim_satisfied(self, num_tokens: int) -> bool:
        """Pure sufficient recovery query; False leaves FLOAT geometry unknown."""
        return self._token_end_reclaim_satisfied(num_tokens) or (
            self._token_float_high_target(num_tokens) is not None
        )

    def _token_end_frontiers(self, num_tokens: int, *, flush_ends: bool = True):
        """FULL before/after allocation and Mamba after permitted END flushes.

        Pending reuse is never credited. Unflushed FULL holes remain allocatable.
        """
        fa, ma = self.full_attn_allocator, self.mamba_allocator

        def end_credit(member):
            if not flush_ends or not member.lazy_compaction:
                return 0
            if member.moves_blocked():
                return 0
            return member._free_phys_pages.numel()

        full_credit, state_credit = end_credit(fa), end_credit(ma)
        full_holes = fa._free_phys_pages.numel() if fa.lazy_compaction else 0
        pages = num_tokens // self.page_size
        full_extension = max(0, pages - (full_holes - full_credit))
        full_before = fa._byte_low_frontier() + full_credit * fa.entry_bytes_per_page
        full_after = full_before - full_extension * fa.entry_bytes_per_page
        state_after = ma._byte_high_frontier() - state_credit * ma.entry_bytes_per_page
        return full_before, full_after, state_after

    def _token_end_reclaim_satisfied(self, num_tokens: int) -> bool:
        """Sufficient allocation certificate requiring only allowed END flushes."""
        if not self._token_id_capacity(num_tokens):
            return False
        if num_tokens <= self.available_size():
            return True
        fa, sa = self.full_attn_allocator, self.swa_attn_allocator
        _, full_after, state_after = self._token_end_frontiers(num_tokens)
        pages = num_tokens // self.page_size
        if full_after < fa.min_page_index * fa.entry_bytes_per_page:
            return False
        if sa._is_frontier_transparent():
            return pages <= sa.pages_in_band(low_byte=state_after, high_byte=full_after)
        if full_after < sa._byte_high_frontier():
            return False
        swa_extension = max(0, pages - sa._hole_pages())
        return swa_extension <= max(
            sa.pages_in_band(low_byte=state_after, high_byte=sa._byte_low_frontier()),
            sa.pages_in_band(low_byte=sa._byte_high_frontier(), high_byte=full_after),
        )

    def _token_float_high_target(
        self, num_tokens: int, *, flush_ends: bool = True
    ) -> Optional[int]:
        """Absolute HIGH band target after END preparation; None means unknown.

        Reserve fresh LOW destinations for every moved FLOAT page and fresh HIGH
        pages for SWA after FULL allocation. No FLOAT hole positions or pending
        reuse are credited. The callback performs no movement or device reads.
        """
        if not self._token_id_capacity(num_tokens):
            return None
        fa, sa = self.full_attn_allocator, self.swa_attn_allocator
        if sa._is_frontier_transparent():
            return None
        if sa.moves_blocked():
            return None
        full_before, full_after, state_after = self._token_end_frontiers(
            num_tokens, flush_ends=flush_ends
        )
        if full_after < fa.min_page_index * fa.entry_bytes_per_page:
            return None
        e_s = sa.entry_bytes_per_page
        low = max(-(-state_after // e_s), sa.min_page_index)
        high = min(full_before // e_s, sa.num_pages)
        high_after = min(full_after // e_s, sa.num_pages)
        limit = high_after - num_tokens // self.page_size
        retreat = sa.high_wm_page - limit
        if retreat <= 0 or sa.low_wm_page - low < retreat:
            return None
        # The far gap supplies all retreat destinations even with adverse holes.
        # Retreating HIGH to limit leaves the requested SWA pages after FULL.
        return (high - limit) * e_s

    def _token_allocation_byte_shortfall(
        self,
        num_tokens: int,
        *,
        full_reclaim: int = 0,
        swa_reclaim: int = 0,
        state_reclaim: int = 0,
    ) -> int:
        """Optimistic byte lower bound; zero does not certify FLOAT geometry."""
        fa, sa, ma = (
            self.full_attn_allocator,
            self.swa_attn_allocator,
            self.mamba_allocator,
        )
        live_bytes = sum(
            max(0, member.allocated_count() - reclaim) * member.entry_bytes
            for member, reclaim in (
                (fa, full_reclaim),
                (sa, swa_reclaim),
                (ma, state_reclaim),
            )
        )
        sink_bytes = min(
            member.min_page_index * member.entry_bytes_per_page
            for member in (fa, sa, ma)
        )
        required_bytes = (
            num_tokens
            // self.page_size
            * (fa.entry_bytes_per_page + sa.entry_bytes_per_page)
        )
        return max(
            0,
            required_bytes + live_bytes + sink_bytes - self.unified_buffer.total_bytes,
        )

    def _fits_page_demand(self, full_pages: int, swa_pages: int) -> bool:
        """Price FULL first, then SWA in one contiguous band on the float grid."""
        fa, sa = self.full_attn_allocator, self.swa_attn_allocator
        h_f = len(fa._free_phys_pages) if fa.lazy_compaction else 0
        h_s = sa._hole_pages()
        r_f = fa.num_pages - fa.min_page_index - fa._allocated_pages()
        r_s = sa.num_pages - sa.min_page_index - sa._allocated_pages()
        if full_pages > h_f + r_f or swa_pages > h_s + r_s:
            return False
        full_bytes = max(0, full_pages - h_f) * fa.entry_bytes_per_page
        if full_bytes > fa._current_gap_bytes():
            return False
        ext_s = max(0, swa_pages - h_s)
        full_low_after = fa._byte_low_frontier() - full_bytes
        if sa._is_frontier_transparent():
            room = sa.pages_in_band(
                low_byte=sa._chain_high_frontier_below_bytes(),
                high_byte=full_low_after,
            )
            return ext_s <= room
        p_low = sa.pages_in_band(
            low_byte=sa._chain_high_frontier_below_bytes(),
            high_byte=sa._byte_low_frontier(),
        )
        p_high = sa.pages_in_band(
            low_byte=sa._byte_high_frontier(),
            high_byte=full_low_after,
        )
        return ext_s <= max(p_low, p_high)

    def _compute_available_size(self) -> int:
        """Joint TOKENS for equal FULL/SWA demand, using the same page predicate
        as tail allocation. FULL takes the high band before SWA binds its pages.
        """
        fa, sa = self.full_attn_allocator, self.swa_attn_allocator
        h_f = len(fa._free_phys_pages) if fa.lazy_compaction else 0
        h_s = sa._hole_pages()
        r_f = fa.num_pages - fa.min_page_index - fa._allocated_pages()
        r_s = sa.num_pages - sa.min_page_index - sa._allocated_pages()
        # Allocator state is stable throughout this query. Snapshot the band
        # geometry once instead of walking the chain at every binary-search step.
        full_gap = fa._current_gap_bytes()
        full_low = fa._byte_low_frontier()
        full_page_bytes = fa.entry_bytes_per_page
        swa_chain_low = sa._chain_high_frontier_below_bytes()
        if sa._is_frontier_transparent():
            swa_high_band_low = swa_chain_low
            swa_low_room = 0
        else:
            swa_high_band_low = sa._byte_high_frontier()
            swa_low_room = sa.pages_in_band(
                low_byte=swa_chain_low, high_byte=sa._byte_low_frontier()
            )

        lo_n, hi_n = 0, min(h_f + r_f, h_s + r_s)
        while lo_n < hi_n:
            mid = (lo_n + hi_n + 1) // 2
            full_bytes = max(0, mid - h_f) * full_page_bytes
            swa_room = max(
                swa_low_room,
                sa.pages_in_band(
                    low_byte=swa_high_band_low, high_byte=full_low - full_bytes
                ),
            )
            if full_bytes <= full_gap and max(0, mid - h_s) <= swa_room:
                lo_n = mid
            else:
                hi_n = mid - 1
        return lo_n * self.page_size

    def _move_gate_targets(self):
        """All three members. The mamba end compacts independently and its slot
        envelopes move as `StateType.MAMBA`, so leaving it out of a gate would
        let a conv/SSM slot relocate under an in-flight transfer."""
        return (
            self.full_attn_allocator,
            self.swa_attn_allocator,
            self.mamba_allocator,
        )

    def _flush_targets(self):
        """All three members, float FIRST: its zero-copy boundary absorption must
        land before the deficit math prices a relocation it already covered."""
        return (
            self.swa_attn_allocator,
            self.full_attn_allocator,
            self.mamba_allocator,
        )

    def _alloc_demand(self, need_tokens: int):
        """Demand VECTOR for one composite allocation, in PAGES per band. A token
        never draws a state slot, so mamba is an explicit 0, not an omission."""
        need_n = -(-need_tokens // self.page_size)
        return {
            self.full_attn_allocator: need_n,
            self.swa_attn_allocator: need_n,
            self.mamba_allocator: 0,
        }

    def _ask_float_for_room(self, need_tokens: int) -> None:
        """Composite shortfall: hand the demand vector to the shared policy;
        the float is whichever demanded band floats."""
        demand = self._alloc_demand(need_tokens)
        flt = None
        for b in demand:
            if isinstance(b, FloatMultiEndedAllocator):
                flt = b
        _float_open_short_side(flt, demand)

    def mamba_full_cache_donor(self) -> MambaFullCacheDonor:
        return self

    def flush_deferred_full_frees(self) -> None:
        """Expose grouped composite frees while preserving the group scope."""
        _flush_deferred_free_group(
            self,
            (
                self.free_group,
                self.free_page_reps_group,
                self.full_page_reps_group,
                self.full_free_group,
            ),
        )

    def full_tokens_before_mamba_recheck(self, target_size: int) -> int:
        return _full_tokens_before_mamba_recheck(
            self.full_attn_allocator, self.mamba_allocator, target_size
        )

    def prepare_mamba_allocation(self, target_size: int) -> None:
        """Expose Full reclaim, then move the SWA float away from Mamba."""
        self.flush_deferred_full_frees()
        if target_size <= self.mamba_allocator.available_size():
            return
        self.full_attn_allocator.flush_for_allocation()
        _relieve_for_alloc(self.mamba_allocator, target_size)

    def mamba_slot_full_token_cost(self) -> int:
        """Full-token-equivalents one mamba/conv slot removes from the shared buffer:
        a tri-pool token costs e_f + e_s bytes, and the quotient is rounded UP."""
        e_tok = (
            self.full_attn_allocator.entry_bytes + self.swa_attn_allocator.entry_bytes
        )
        return -(-self.mamba_allocator.entry_bytes_per_page // e_tok)

    def debug_print(self) -> str:
        sa = self.swa_attn_allocator
        return (
            super().debug_print()
            + f", #mamba-available={self.mamba_allocator.available_size()}"
            + f", swa-float span=[{sa.low_wm_page},{sa.high_wm_page}) "
            + f"holes={sa._hole_pages()}"
        )

    # -- lifecycle fanout (adds the mamba end) --

    def clear(self) -> None:
        super().clear()
        self.mamba_allocator.clear()

    def set_latest_forward_done_event(self, event: Optional[torch.cuda.Event]) -> None:
        super().set_latest_forward_done_event(event)
        self.mamba_allocator.set_latest_forward_done_event(event)

    def set_inflight_forward(
        self,
        forward_done: torch.cuda.Event,
        out_cache_loc_virtual: Optional[torch.Tensor],
    ) -> None:
        # The mamba state is written by the conv kernels, not through
        # `out_cache_loc`, so its in-flight write-set is None.
        super().set_inflight_forward(forward_done, out_cache_loc_virtual)
        self.mamba_allocator.set_inflight_forward(forward_done, None)

    def create_prefill_budget(self, tree_cache, *, num_mixed_decode_tokens=0):
        # Mamba competes for the shared gap too; retain the tri-pool's existing
        # token and state-slot admission until it has a three-way reservation.
        return SWATokenToKVPoolAllocator.create_prefill_budget(
            self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens
        )

    def max_new_tokens_for_memory(self, *args, **kwargs):
        return BaseTokenToKVPoolAllocator.max_new_tokens_for_memory(
            self, *args, **kwargs
        )

    def swa_capacity_and_available(self, *, full_capacity, swa_capacity):
        return (
            (full_capacity, self.conserve_full_available_size()),
            (swa_capacity, self.conserve_swa_available_size()),
        )

    def get_extend_allocation_demand(
        self,
        prefix_lens_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        *,
        conservative_num_tokens: int,
        shard_size: int,
    ) -> int:
        if shard_size != 1:
            return conservative_num_tokens
        return self.page_size * get_num_new_pages(
            seq_lens=seq_lens_cpu,
            page_size=self.page_size,
            prefix_lens=prefix_lens_cpu,
        )

    @rank_consensus(same_params=["num_tokens"], same_results=True)
    def evict_to_free_tokens(self, tree_cache, num_tokens: int) -> bool | None:
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        if num_tokens <= 0:
            return True
        if self.free_group is not None:
            self.flush_deferred_full_frees()
        num_tokens = -(-num_tokens // self.page_size) * self.page_size
        # Immediate capacity needs no reclaim plan or layout preparation.
        if self._token_id_capacity(num_tokens) and num_tokens <= self.available_size():
            return True

        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        full_reclaim = tree_cache.full_evictable_size()
        swa_reclaim = tree_cache.swa_evictable_size()
        state_reclaim = tree_cache.mamba_evictable_size()
        fa, sa, ma = (
            self.full_attn_allocator,
            self.swa_attn_allocator,
            self.mamba_allocator,
        )
        if (
            num_tokens // self.page_size
            > fa.free_virtual_ids.numel() + full_reclaim // self.page_size
            or num_tokens // self.page_size
            > sa.num_pages
            - sa.min_page_index
            - sa._live_pages()
            + swa_reclaim // self.page_size
            or self._token_allocation_byte_shortfall(
                num_tokens,
                full_reclaim=full_reclaim,
                swa_reclaim=swa_reclaim,
                state_reclaim=state_reclaim,
            )
            > 0
        ):
            return False
        if self.ensure_capacity(num_tokens, num_tokens):
            return True

        # Quotas are cumulative logical counts within each phase. Token reclaim
        # precedes state reclaim so Mamba-first tree ordering cannot skip it.
        state_freed = 0
        if full_reclaim or swa_reclaim:
            result = tree_cache.evict_for_alloc(
                EvictParams(num_tokens=num_tokens, swa_num_tokens=num_tokens),
                allocation_reclaim_satisfied=lambda: self._token_reclaim_satisfied(
                    num_tokens
                ),
            )
            state_freed = result.mamba_num_evicted
            if (
                result.num_tokens_evicted
                or result.swa_num_tokens_evicted
                or state_freed
            ) and self.ensure_capacity(num_tokens, num_tokens):
                return True

        pair_bytes = (
            num_tokens
            // self.page_size
            * (fa.entry_bytes_per_page + sa.entry_bytes_per_page)
        )
        state_quota = max(0, -(-pair_bytes // ma.entry_bytes) - state_freed)
        if state_quota and tree_cache.mamba_evictable_size():
            result = tree_cache.evict_for_alloc(
                EvictParams(mamba_num=state_quota),
                allocation_reclaim_satisfied=lambda: self._token_reclaim_satisfied(
                    num_tokens
                ),
            )
            if (
                result.num_tokens_evicted
                or result.swa_num_tokens_evicted
                or result.mamba_num_evicted
            ):
                return self.ensure_capacity(num_tokens, num_tokens)
        return (
            self._token_id_capacity(num_tokens) and num_tokens <= self.available_size()
        )

    def verify_byte_accounting(self) -> List[str]:
        return (
            _chain_byte_accounting_violations(
                [
                    self.mamba_allocator,
                    self.swa_attn_allocator,
                    self.full_attn_allocator,
                ]
            )
            + self._joint_capacity_memo_violations()
        )

    def flush_opportunistic(self) -> int:
        """Per-step reclaim across the whole chain. The float participates for its
        deferred boundary absorption, which is where its single D2H is paid."""
        fa, ma = self.full_attn_allocator, self.mamba_allocator
        sa = self.swa_attn_allocator
        if (
            fa._free_phys_pages.numel() == 0
            and not fa._pending_reuse
            and ma._free_phys_pages.numel() == 0
            and not ma._pending_reuse
            and sa._free_phys_pages.numel() == 0
        ):
            return 0
        return (
            fa.flush_opportunistic()
            + ma.flush_opportunistic()
            + sa.flush_opportunistic()
        )
