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

"""KV pools striped at logical-page granularity across a shard group.

Per-layer pool tensors keep the stock shape and size — identical rows on every
rank; only the written rows differ: each rank persists the rows it owns under
the pure placement bijection (``mem_cache/page_interleave.py``).

Central consequence for the forward pass: during a sharded prefill, extend
attention never reads the KV pool — a rank's pool holds only its stripe of
the prefix *and* of the current chunk. Attention reads a per-layer assembled
scratch slot laid out ``[prefix region | chunk region | trash page]``:

- The prefix is NCCL-allgathered from the shard group into the slot one layer
  ahead, on a dedicated side stream with a dedicated ``PyNcclCommunicator``.
  Under rotated owner-classed allocation the owners of a cached prefix's
  pages are exactly cyclic, so per-rank owned counts differ by <= 1: each
  rank sends its own prefix pages in local-page order, padded to
  ``ceil(prefix_pages / N)`` pages with the (never referenced) trash page —
  a *regular* in-place allgather, owner-major output, no reorder pass.
- Symmetric gather scratch (``SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER``,
  NCCL >= 2.31.2, single-node shard groups): both slots are carved out of one
  ``ncclMemAlloc`` buffer registered as a symmetric window. Every rank carves
  the same offsets, because CE addresses a peer's buffer by the local offset
  into the window.
  The dedicated gather communicator requests ``NCCL_CTA_POLICY_ZERO``
  for eligible copy-engine transfers. Leave the global ``NCCL_CTA_POLICY``
  unset so forward-pass communicators retain their default policy.
- The chunk region is staged locally on the compute stream where the write
  path already holds the full chunk (GQA CP allgathers K/V before the pool
  write; MLA latent is replicated across the shard group at write time).
- The trash page absorbs padded/dummy locations (the reserved logical pages
  covering loc < N*ps, and any location outside the current batch's plan).

Scratch addressing goes through a per-batch ``logical page -> scratch
page`` lookup (``_page_pos``, one int32 per logical page, rebuilt in
``begin_shard_extend``): purely local, mirrored by construction, and valid
for any consumer index vector (attention page tables, MLA prefix
``kv_indices``), not just whole-prefix position arithmetic.

Layer-ahead pipelining needs no model changes: acquiring layer ``l``'s slot
for reading kicks layer ``l+1``'s gather. Reads happen in SPMD lockstep on
every rank, so the collective order is symmetric by construction.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from sglang.kernels.ops.attention.dsa.dequant_k_cache import (
    dequantize_k_cache_paged_dsa,
)
from sglang.kernels.ops.kvcache import dsa_index_k_cache
from sglang.srt.distributed.device_communicators.pynccl import PyNcclCommunicator
from sglang.srt.distributed.device_communicators.pynccl_allocator import (
    allocate_symmetric_buffer,
)
from sglang.srt.distributed.device_communicators.pynccl_wrapper import (
    NCCL_CTA_POLICY_ZERO,
    NCCLLibrary,
)
from sglang.srt.distributed.parallel_state import in_the_same_node_as
from sglang.srt.environ import envs
from sglang.srt.mem_cache import page_interleave
from sglang.srt.mem_cache.index_key_cache import IndexKeyCache
from sglang.srt.mem_cache.memory_pool import (
    GPU_MEMORY_TYPE_KV_CACHE,
    DSATokenToKVPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    RadixAttention,
    unwrap_write_loc,
)
from sglang.srt.mem_cache.utils import get_mla_kv_buffer_triton
from sglang.srt.utils import ceil_div, get_bool_env_var, is_cuda
from sglang.srt.utils.common import ceil_align

if TYPE_CHECKING:
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.mem_cache.page_interleave import PageShardSpec

logger = logging.getLogger(__name__)

# (shape, dtype) of one scratch tensor.
_TensorSpec = Tuple[Tuple[int, ...], torch.dtype]

_NUM_SCRATCH_SLOTS = 2
# NCCL_WIN_REQUIRED_ALIGNMENT in nccl.h. NCCL checks it only at the window
# base; starting every slot tensor on it is a conservative choice.
_SCRATCH_ALIGN_BYTES = 4096
# NCCL 2.31.2 fixes internal CE synchronization buffer initialization and the
# two-rank multicast-team setup race (upstream commit 430afbc). Zeroing our
# scratch cannot initialize NCCL's internal buffers.
_NCCL_SYMMETRIC_SCRATCH_MIN_VERSION = 23102


def _symmetric_scratch_supported(
    *, memory_saver_enabled: bool, custom_mem_pool, shard_group: GroupCoordinator
) -> bool:
    """Collective over ``shard_group``: every rank returns the same verdict."""
    # ncclMemAlloc memory sits outside both the memory-saver region and a
    # custom mem pool, so either one keeps the torch-allocated scratch.
    if (
        not envs.SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER.get()
        or memory_saver_enabled
        or custom_mem_pool is not None
        or not is_cuda()
        or NCCLLibrary().ncclGetRawVersion() < _NCCL_SYMMETRIC_SCRATCH_MIN_VERSION
    ):
        return False
    # Across nodes NCCL would run the windowed allgather on its hierarchical
    # path (inter-node RMA proxy puts); only the in-node CE path is verified.
    return all(in_the_same_node_as(shard_group.cpu_group, source_rank=0))


def _symmetric_scratch_layout(
    specs: Dict[str, _TensorSpec], num_slots: int
) -> Tuple[List[Dict[str, int]], int]:
    """Byte offset of every slot tensor in one buffer, and the buffer size.

    Depends only on ``specs``, so it is identical on every rank.
    """
    offsets = []
    nbytes = 0
    for _ in range(num_slots):
        slot_offsets = {}
        for name, (shape, dtype) in specs.items():
            slot_offsets[name] = nbytes
            nbytes += ceil_align(
                math.prod(shape) * dtype.itemsize, _SCRATCH_ALIGN_BYTES
            )
        offsets.append(slot_offsets)
    return offsets, nbytes


def _view_bytes(
    buf: torch.Tensor, offset: int, shape: Tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    return buf[offset : offset + nbytes].view(dtype).view(shape)


class _ScratchSlot:
    """One half of the double buffer: scratch tensors + ready event.

    ``resident_key`` identifies what the slot currently holds — ``(layer_id,
    epoch)`` — so repeated reads of the same layer skip the re-gather and a
    new batch (epoch bump) retires stale residency without any invalidation
    walk.
    """

    def __init__(self, tensors: Dict[str, torch.Tensor], device_module):
        self.tensors = tensors
        self.ready = device_module.Event()
        self.resident_key: Optional[Tuple[int, int]] = None


class PageInterleaveKVPoolMixin:
    """Shard-generic state and mechanics; mixed into concrete pools below.

    Subclasses call ``_init_page_shard_state`` after the base pool has created
    its buffers, and implement ``_scratch_tensor_specs`` (per-slot tensor
    shapes and dtypes) and ``_gather_pairs`` (pool buffer -> scratch tensor
    pairs of one layer).
    """

    # ---- init ---------------------------------------------------------------

    def _init_page_shard_state(
        self, shard_spec: PageShardSpec, shard_group: GroupCoordinator
    ):
        spec = shard_spec
        assert spec.shard_size > 1, "page-interleave sharding needs shard_size > 1"
        assert spec.shard_size == shard_group.world_size
        assert spec.shard_rank == shard_group.rank_in_group
        assert spec.page_size == self.page_size
        # The batch's prefix region is split into equal per-rank gather
        # blocks, so it must be a multiple of the full-group span. The chunk
        # region is per-page; admission checks both regions against this spec.
        assert spec.max_prefix_tokens % spec.logical_page_size == 0
        assert spec.chunk_tokens % spec.page_size == 0

        self.shard_spec = spec
        self.shard_group = shard_group
        self.placement = page_interleave.PageInterleavePlacement(spec)
        self.shard_rank = spec.shard_rank
        self.shard_size = spec.shard_size
        self.device_module = torch.get_device_module(self.device)

        # Check the pool's storage device before probing its NCCL shard group.
        self._use_symmetric_scratch = False
        if torch.device(self.device).type == "cuda":
            self._use_symmetric_scratch = _symmetric_scratch_supported(
                memory_saver_enabled=self.memory_saver_adapter.enabled,
                custom_mem_pool=self.custom_mem_pool,
                shard_group=shard_group,
            )
        # Dedicated communicator + stream so the layer-ahead gathers never
        # interleave with the group's main collectives.
        self.kv_gather_comm: PyNcclCommunicator = PyNcclCommunicator(
            group=shard_group.cpu_group,
            device=shard_group.device,
            cta_policy=NCCL_CTA_POLICY_ZERO if self._use_symmetric_scratch else None,
        )
        self.kv_gather_stream = self.device_module.Stream()

        # Scratch: [prefix | chunk | trash page], double-buffered.
        scratch_rows = spec.scratch_rows
        self._chunk_base = spec.max_prefix_tokens
        self._trash_base = spec.max_prefix_tokens + spec.chunk_tokens
        slot_tensors, self._scratch_window_registered = self._alloc_scratch(
            scratch_rows
        )
        self._slots = [
            _ScratchSlot(tensors, self.device_module) for tensors in slot_tensors
        ]
        with self._torch_alloc_context():
            # Per-batch absolute scratch-page index of every logical page.
            # Unplanned pages initially target the trash page. Logical page
            # ids run [0, N * (size/ps + 1)) — N per physical page of one
            # rank's pool incl. the reserved padded page.
            self._page_pos = torch.full(
                (spec.shard_size * (self.size // spec.page_size + 2),),
                self._trash_base // spec.page_size,
                dtype=torch.int32,
                device=self.device,
            )

        self._epoch = 0
        self._shard_extend_active = False
        self._block_pages = 0
        # Strictly larger than any local physical page id: the owner-major
        # sort key of logical page l is (l % N) * stride + l // N.
        self._local_page_stride = self.size // spec.page_size + 2
        self._debug_plan_checks = get_bool_env_var("SGLANG_DEBUG_MEMORY_POOL")
        self._send_pages: Optional[torch.Tensor] = None
        self._send_rows: Optional[torch.Tensor] = None
        self._write_plan_key = None
        self._write_plan: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._translate_cache: Dict[Tuple[int, int], torch.Tensor] = {}

        scratch_bytes = sum(
            tensor.numel() * tensor.element_size()
            for slot in self._slots
            for tensor in slot.tensors.values()
        )
        logger.info(
            "Page-interleave KV sharding enabled: shard_rank=%d shard_size=%d "
            "page_size=%d prefix_tokens=%d chunk_tokens=%d scratch_rows=%d x2 "
            "(%.2f MiB per rank, charged against the KV budget), "
            "NCCL symmetric scratch=%s. "
            "Batch admission is limited by this scratch capacity.",
            self.shard_rank,
            self.shard_size,
            spec.page_size,
            spec.max_prefix_tokens,
            spec.chunk_tokens,
            scratch_rows,
            scratch_bytes / (1024 * 1024),
            self._scratch_window_registered,
        )

    @contextmanager
    def _torch_alloc_context(self):
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            with (
                torch.cuda.use_mem_pool(self.custom_mem_pool)
                if self.custom_mem_pool
                else nullcontext()
            ):
                yield

    def _alloc_scratch(self, rows: int) -> Tuple[List[Dict[str, torch.Tensor]], bool]:
        """Every slot's tensors, and whether they sit in a symmetric window."""
        specs = self._scratch_tensor_specs(rows)
        if self._use_symmetric_scratch:
            return self._alloc_symmetric_scratch(specs)
        with self._torch_alloc_context():
            slots = [
                {
                    name: torch.zeros(shape, dtype=dtype, device=self.device)
                    for name, (shape, dtype) in specs.items()
                }
                for _ in range(_NUM_SCRATCH_SLOTS)
            ]
        return slots, False

    def _alloc_symmetric_scratch(
        self, specs: Dict[str, _TensorSpec]
    ) -> Tuple[List[Dict[str, torch.Tensor]], bool]:
        offsets, nbytes = _symmetric_scratch_layout(specs, num_slots=_NUM_SCRATCH_SLOTS)
        buf, registered = allocate_symmetric_buffer(self.kv_gather_comm, nbytes)
        if not registered:
            logger.warning(
                "NCCL returned no symmetric window for the KV-shard gather "
                "scratch (NCCL_CUMEM_ENABLE=0, NCCL_WIN_ENABLE=0, or ranks "
                "without CUDA P2P?); the prefix allgather falls back to NCCL "
                "SM kernels."
            )
        slots = [
            {
                name: _view_bytes(
                    buf, offset=slot_offsets[name], shape=shape, dtype=dtype
                )
                for name, (shape, dtype) in specs.items()
            }
            for slot_offsets in offsets
        ]
        return slots, registered

    def set_kv_buffer_prefix_valid(self, *args, **kwargs):
        raise NotImplementedError(
            "prefix-valid commit is unsupported under logical-page KV sharding "
            "(it writes pool rows directly, bypassing the ownership filter)"
        )

    # ---- subclass hooks -------------------------------------------------------

    def _scratch_tensor_specs(self, rows: int) -> Dict[str, _TensorSpec]:
        raise NotImplementedError

    def _gather_pairs(self, local_layer: int) -> List[Tuple[torch.Tensor, str]]:
        """(pool buffer of ``local_layer``, scratch tensor name) pairs."""
        raise NotImplementedError

    def _gather_send_rows(self, name: str) -> torch.Tensor:
        """Source indices in a gather pair's first dimension (tokens by default)."""
        return self._send_rows

    # ---- per-batch plan -------------------------------------------------------

    def begin_shard_extend(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens_cpu: List[int],
        seq_lens_cpu: List[int],
    ) -> None:
        """Capture the batch's gather plan and kick the first layer's gather.

        Called once per scheduled extend batch, at attention-metadata build
        time (after ``req_to_token`` holds the batch's allocation). All inputs
        are mirrored across ranks, so every rank derives the identical plan.
        """
        spec = self.shard_spec
        ps, shard_size = spec.page_size, spec.shard_size

        # Per-request page samples. One logical page per position-page
        # (whole-page draws + ps-aligned chunk starts), so stride-ps sampling
        # enumerates each request's pages in position order — no run
        # collapsing. block_pages (the padded allgather block) is the
        # sync-free host bound sum_i ceil(K_i / N): each request's prefix is
        # ONE cyclic rotation run (graft-declined inserts + per-request
        # bases), so a rank owns at most ceil(K_i / N) of its pages, and the
        # cross-request dedup below only shrinks per-rank counts.
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        prefix_parts = []
        chunk_parts = []
        block_pages = 0
        for i in range(len(prefix_lens_cpu)):
            prefix_len, seq_len = int(prefix_lens_cpu[i]), int(seq_lens_cpu[i])
            assert prefix_len % ps == 0, (
                f"sharded prefill requires physical-page-aligned prefixes "
                f"(the radix-tree match quantum), got prefix_len="
                f"{prefix_len}, page_size={ps}"
            )
            row = req_to_token[req_pool_indices[i]]
            if prefix_len:
                pages_i = row[:prefix_len:ps].long() // ps
                prefix_parts.append(pages_i)
                block_pages += ceil_div(prefix_len // ps, shard_size)
                if self._debug_plan_checks:
                    # Owner-congruence: each request's prefix owners must be
                    # exactly cyclic — the block bound above relies on it. A
                    # broken rotation would overflow a rank's block and the
                    # translation would silently address the wrong scratch
                    # rows. Fail loud instead (debug mode syncs).
                    owners = pages_i % shard_size
                    expected = (
                        int(owners[0])
                        + torch.arange(
                            owners.numel(), dtype=torch.int64, device=self.device
                        )
                    ) % shard_size
                    assert torch.equal(owners, expected), (
                        f"sharded prefix owners of request {i} are not "
                        f"cyclic — rotation base out of sync "
                        f"(owners[:16]={owners[:16].tolist()})"
                    )
            if seq_len > prefix_len:
                chunk_parts.append(row[prefix_len:seq_len:ps].long() // ps)

        # A prefix page shared by several requests gathers into ONE scratch
        # slot (torch.unique sorts — deterministic, mirrored); chunk pages
        # are per-request fresh allocations, disjoint by construction.
        prefix_pages = torch.unique(torch.cat(prefix_parts)) if prefix_parts else empty
        chunk_pages = torch.cat(chunk_parts) if chunk_parts else empty
        n_prefix = prefix_pages.numel()
        n_chunk = chunk_pages.numel()
        n_prefix_slots = shard_size * block_pages
        assert n_prefix_slots * ps <= spec.max_prefix_tokens, (
            f"prefix ({n_prefix} pages, padded gather span "
            f"{n_prefix_slots * ps} tokens) exceeds the scratch prefix "
            f"capacity ({spec.max_prefix_tokens}) — the PrefillAdder scratch "
            f"reservation should have deferred this batch"
        )
        assert n_chunk * ps <= spec.chunk_tokens, (
            f"chunk ({n_chunk * ps} tokens) exceeds the scratch chunk "
            f"capacity ({spec.chunk_tokens})"
        )

        self._page_pos.fill_(self._trash_base // ps)
        if n_prefix:
            # Owner-major slot assignment: sort the batch's unique pages by
            # (owner, local page) so rank r's pages are contiguous at
            # r * block_pages in local-page order — the same order rank r
            # packs its send block below, on every rank (mirrored).
            owners = prefix_pages % shard_size
            local_pages = prefix_pages // shard_size
            order = torch.argsort(owners * self._local_page_stride + local_pages)
            sorted_pages = prefix_pages[order]
            sorted_owners = owners[order]
            counts = torch.bincount(sorted_owners, minlength=shard_size)
            starts = torch.cumsum(counts, 0) - counts
            within = (
                torch.arange(n_prefix, dtype=torch.int64, device=self.device)
                - starts[sorted_owners]
            )
            self._page_pos[sorted_pages] = (sorted_owners * block_pages + within).to(
                torch.int32
            )
        if n_chunk:
            self._page_pos[chunk_pages] = torch.arange(
                self._chunk_base // ps,
                self._chunk_base // ps + n_chunk,
                dtype=torch.int32,
                device=self.device,
            )

        self._epoch += 1
        self._block_pages = block_pages
        self._shard_extend_active = True
        self._translate_cache.clear()
        if block_pages:
            # This rank's owned pages in slot order (already local-sorted) —
            # logical page l is its local physical page l // N — padded to
            # the regular allgather block with the reserved trash page
            # (local page 0), whose rows the plan never references.
            own_local = sorted_pages[sorted_owners == self.shard_rank] // shard_size
            n_pad = block_pages - own_local.numel()
            if n_pad:
                own_local = torch.cat(
                    [
                        own_local,
                        torch.zeros((n_pad,), dtype=torch.int64, device=self.device),
                    ]
                )
            self._send_pages = own_local
            self._send_rows = (
                own_local[:, None] * ps
                + torch.arange(ps, dtype=torch.int64, device=self.device)
            ).reshape(-1)
            self._prefetch_layer(self.start_layer)
        else:
            self._send_pages = None
            self._send_rows = None

    def end_shard_extend(self) -> None:
        """Mark no sharded extend in flight (non-extend forward modes)."""
        self._shard_extend_active = False

    # ---- translation ----------------------------------------------------------

    def translate_loc_to_scratch(self, loc: torch.Tensor) -> torch.Tensor:
        """Logical token slots -> rows of the current batch's scratch slots.

        ``_page_pos`` holds every logical page's absolute scratch page slot:
        prefix pages owner-major in ``[0, N * block_pages)`` (rank ``l % N``'s
        pages contiguous at ``rank * block_pages``, local-page order), chunk
        pages in batch-sequence order at ``_chunk_base``, and anything outside
        the plan at the trash page.
        """
        ps = self.shard_spec.page_size
        loc64 = loc.long()
        scratch_page = self._page_pos[loc64 // ps].long()
        return scratch_page * ps + loc64 % ps

    # ---- the layer-ahead gather -------------------------------------------------

    def _prefetch_layer(self, layer_id: int) -> None:
        """Kick the allgather assembling ``layer_id``'s prefix into its slot,
        on the gather stream. Idempotent per ``(layer_id, epoch)``."""
        local_layer = layer_id - self.start_layer
        if local_layer >= self.layer_num:
            return
        slot = self._slots[layer_id % 2]
        key = (layer_id, self._epoch)
        if slot.resident_key == key:
            return
        # Order the gather after all prior compute-stream work: the
        # previous tenant's reads (attention of layer_id - 2) and the pool
        # writes that produced the prefix rows.
        self.kv_gather_stream.wait_stream(self.device_module.current_stream())
        with self.device_module.stream(self.kv_gather_stream):
            if self.layer_transfer_counter is not None:
                # HiCache loads this layer's rows on its own stream, and the gather
                # bypasses the waiting base getters.
                self.layer_transfer_counter.wait_until(local_layer)
            for pool_buf, name in self._gather_pairs(local_layer):
                send_rows = self._gather_send_rows(name)
                block = send_rows.numel()
                scratch = slot.tensors[name]
                send = scratch[self.shard_rank * block : (self.shard_rank + 1) * block]
                torch.index_select(pool_buf, 0, send_rows, out=send)
                # In-place regular allgather: send is exactly the rank's
                # block of the output, every rank contributes `block` rows.
                with self.kv_gather_comm.change_state(enable=True):
                    self.kv_gather_comm.all_gather(
                        scratch[: self.shard_size * block], send
                    )
            slot.ready.record(self.kv_gather_stream)
        slot.resident_key = key

    def _acquire_slot_for_read(self, layer_id: int) -> _ScratchSlot:
        """Block the compute stream on the slot's ready event (a no-op when
        the layer-ahead gather already landed) and kick the next layer's
        gather. A residency miss is a caller bug — the batch plan captured by
        ``begin_shard_extend`` must have prefetched this layer."""
        assert self._shard_extend_active, (
            "sharded pool read outside an active sharded extend batch "
            "(begin_shard_extend not called?)"
        )
        slot = self._slots[layer_id % 2]
        if self._block_pages:
            assert slot.resident_key == (layer_id, self._epoch), (
                f"prefix scratch miss for layer {layer_id} "
                f"(resident={slot.resident_key}, epoch={self._epoch})"
            )
            self.device_module.current_stream().wait_event(slot.ready)
            self._prefetch_layer(layer_id + 1)
        return slot

    def _translate_loc_cached(self, loc: torch.Tensor) -> torch.Tensor:
        """Per-batch memoized ``translate_loc_to_scratch`` for the per-layer
        callers: the same loc tensors (``out_cache_loc`` at every layer's
        ``set_kv_buffer``; the prefix ``kv_indices`` at every layer's
        ``get_mla_kv_buffer``) arrive at all layers of a forward, and the
        plan is frozen per batch — so each distinct loc tensor is translated
        once per batch instead of once per layer. ``begin_shard_extend`` clears
        the cache when it installs a new plan."""
        key = (loc.data_ptr(), loc.numel())
        rows = self._translate_cache.get(key)
        if rows is None:
            rows = self.translate_loc_to_scratch(loc)
            self._translate_cache[key] = rows
        return rows

    # ---- write plan (owner filter), cached per (loc tensor, epoch) --------------

    def _get_write_plan(self, loc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(owned positions into ``loc``, their local physical rows).

        The same ``out_cache_loc`` tensor is passed for every layer of a
        forward, so the owner filter is computed once per batch, not per
        layer.
        """
        key = (loc.data_ptr(), loc.numel(), self._epoch)
        if self._write_plan_key != key:
            owned_idx = torch.nonzero(
                self.placement.local_mask(loc, self.shard_rank)
            ).squeeze(1)
            local_rows = self.placement.local_index(loc[owned_idx])
            self._write_plan_key = key
            self._write_plan = (owned_idx, local_rows)
        return self._write_plan


class PageInterleaveMHATokenToKVPool(PageInterleaveKVPoolMixin, MHATokenToKVPool):
    """MHA/GQA pool striped across the attention CP group.

    The write path relies on the prefill CP strategy materializing the full
    chunk's K/V before ``set_kv_buffer`` receives the full (unsplit)
    ``out_cache_loc`` on every rank. Each rank persists only its stripe and
    stages the full chunk into the current layer's scratch chunk region
    (extend attention reads prefix *and* chunk through the scratch page table).
    """

    def __init__(
        self,
        *args,
        shard_spec: PageShardSpec,
        shard_group: GroupCoordinator,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        assert not self.use_hnd, "KV sharding supports the NHD layout only"
        assert self.kv_cache_layout == "nhd", (
            f"KV sharding supports the NHD layout only, got {self.kv_cache_layout}"
        )
        assert not self.post_capture_active
        self._init_page_shard_state(shard_spec, shard_group)

    def _scratch_tensor_specs(self, rows: int) -> Dict[str, _TensorSpec]:
        return {
            "k": ((rows, self.head_num, self.head_dim), self.store_dtype),
            "v": ((rows, self.head_num, self.v_head_dim), self.store_dtype),
        }

    def _gather_pairs(self, local_layer: int):
        return [
            (self.k_buffer[local_layer], "k"),
            (self.v_buffer[local_layer], "v"),
        ]

    def set_kv_buffer(
        self,
        layer: RadixAttention,
        loc_info,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        layer_id_override: Optional[int] = None,
        dcp_kv_mask: Optional[torch.Tensor] = None,
    ):
        assert dcp_kv_mask is None, "DCP is mutually exclusive with KV sharding"
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = (
            layer_id_override if layer_id_override is not None else layer.layer_id
        )

        if cache_k.dtype != self.dtype:
            if k_scale is not None:
                cache_k = cache_k / k_scale
            if v_scale is not None:
                cache_v = cache_v / v_scale
            cache_k = cache_k.to(self.dtype)
            cache_v = cache_v.to(self.dtype)
        if self.store_dtype != self.dtype:
            cache_k = cache_k.view(self.store_dtype)
            cache_v = cache_v.view(self.store_dtype)

        if self._shard_extend_active:
            # Stage the full chunk into this layer's slot on the compute
            # stream: ordered before this layer's attention read for free
            # and disjoint from the gather stream, which only writes the
            # prefix region. Padded locations translate to the trash page.
            slot = self._slots[layer_id % 2]
            rows = self._translate_loc_cached(loc)
            slot.tensors["k"][rows] = cache_k
            slot.tensors["v"][rows] = cache_v

        owned_idx, local_rows = self._get_write_plan(loc)
        if owned_idx.numel() > 0:
            self._store_kv_layer(
                layer_id - self.start_layer,
                local_rows,
                cache_k.index_select(0, owned_idx),
                cache_v.index_select(0, owned_idx),
            )

    def get_key_buffer(self, layer_id: int):
        if self._shard_extend_active:
            slot = self._acquire_slot_for_read(layer_id)
            k = slot.tensors["k"]
            return k.view(self.dtype) if self.store_dtype != self.dtype else k
        return super().get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int):
        if self._shard_extend_active:
            slot = self._acquire_slot_for_read(layer_id)
            v = slot.tensors["v"]
            return v.view(self.dtype) if self.store_dtype != self.dtype else v
        return super().get_value_buffer(layer_id)


class PageInterleaveMLATokenToKVPool(PageInterleaveKVPoolMixin, MLATokenToKVPool):
    """MLA latent pool striped across its shard group (the attn-CP group when
    prefill CP is active, the attn-TP group otherwise — see
    ``page_interleave.get_kv_shard_group``).

    The latent KV reaching the write path is identical on every shard-group
    rank (``ReplicatedLinear`` projection across attn-TP; the prefill CP
    strategy's latent-KV rebuild across attn-CP), so the write filter needs no
    compute-time communication. Read consumers, all served from the assembled
    scratch: the chunked-prefix MHA path fetches prefix rows through
    ``get_mla_kv_buffer``; the absorbed-MLA and one-shot paths read
    ``get_key_buffer``/``get_value_buffer`` through the translated page
    table. The current chunk is staged into the slot at write time so the
    page-table consumers cover ``[prefix | chunk]`` uniformly.
    """

    def __init__(
        self,
        *args,
        shard_spec: PageShardSpec,
        shard_group: GroupCoordinator,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        assert not self.use_dsa, "DSA models are not supported by KV sharding yet"
        self._init_page_shard_state(shard_spec, shard_group)

    def _scratch_tensor_specs(self, rows: int) -> Dict[str, _TensorSpec]:
        return {"kv": ((rows, 1, self.kv_cache_dim), self.store_dtype)}

    def _gather_pairs(self, local_layer: int):
        return [(self.kv_buffer[local_layer], "kv")]

    def _scratch_kv(self, slot: _ScratchSlot) -> torch.Tensor:
        kv = slot.tensors["kv"]
        if self.store_dtype != self.dtype:
            return kv.view(self.dtype)
        return kv

    def set_kv_buffer(
        self,
        layer: RadixAttention,
        loc_info,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        layer_id_override: Optional[int] = None,
    ):
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = (
            layer_id_override if layer_id_override is not None else layer.layer_id
        )
        if self._shard_extend_active:
            # Stage the full chunk into this layer's slot (compute
            # stream): the absorbed / one-shot readers cover the current
            # chunk through the translated page table too.
            slot = self._slots[layer_id % 2]
            rows = self._translate_loc_cached(loc)
            staged_k = cache_k
            if staged_k.dtype != self.dtype:
                staged_k = staged_k.to(self.dtype)
            self._scratch_kv(slot)[rows] = staged_k
        owned_idx, local_rows = self._get_write_plan(loc)
        if owned_idx.numel() == 0:
            return
        super().set_kv_buffer(
            layer,
            local_rows,
            cache_k.index_select(0, owned_idx),
            cache_v,
            layer_id_override=layer_id_override,
        )

    def set_mla_kv_buffer(
        self,
        layer: RadixAttention,
        loc_info,
        cache_k_nope: torch.Tensor,
        cache_k_rope: torch.Tensor,
        layer_id_override: Optional[int] = None,
    ):
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = (
            layer_id_override if layer_id_override is not None else layer.layer_id
        )
        if self._shard_extend_active:
            slot = self._slots[layer_id % 2]
            rows = self._translate_loc_cached(loc)
            self._write_mla_kv_buffer(
                slot.tensors["kv"], rows, cache_k_nope, cache_k_rope
            )
        owned_idx, local_rows = self._get_write_plan(loc)
        if owned_idx.numel() == 0:
            return
        super().set_mla_kv_buffer(
            layer,
            local_rows,
            cache_k_nope.index_select(0, owned_idx),
            cache_k_rope.index_select(0, owned_idx),
            layer_id_override=layer_id_override,
        )

    def get_kv_buffer_shape(self):
        # Shape probes (e.g. the eager runner's DCP-metadata prep) must not
        # route through the attention getters below — they may run before
        # this batch's metadata build while the previous batch's shard-extend
        # flag is still set.
        k = self.kv_buffer[0]
        return k.shape, k[..., : self.kv_lora_rank].shape

    def get_key_buffer(self, layer_id: int):
        # During a sharded extend the pool holds only this rank's stripe;
        # page-table readers (absorbed MLA, incl. the CP zigzag wrapper) get
        # the assembled scratch — metadata.page_table is already translated
        # to scratch rows.
        if self._shard_extend_active:
            return self._scratch_kv(self._acquire_slot_for_read(layer_id))
        return super().get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int):
        if self._shard_extend_active:
            kv = self._scratch_kv(self._acquire_slot_for_read(layer_id))
            return kv[..., : self.kv_lora_rank]
        return super().get_value_buffer(layer_id)

    def get_mla_kv_buffer(
        self,
        layer: RadixAttention,
        loc: torch.Tensor,
        dst_dtype: Optional[torch.dtype] = None,
    ):
        slot = self._acquire_slot_for_read(layer.layer_id)
        rows = self._translate_loc_cached(loc)
        kv_buffer = slot.tensors["kv"]
        if self.store_dtype != self.dtype:
            kv_buffer = kv_buffer.view(self.dtype)
        dst_dtype = dst_dtype or self.dtype
        cache_k_nope = torch.empty(
            (loc.shape[0], 1, self.kv_lora_rank),
            dtype=dst_dtype,
            device=kv_buffer.device,
        )
        cache_k_rope = torch.empty(
            (loc.shape[0], 1, self.qk_rope_head_dim),
            dtype=dst_dtype,
            device=kv_buffer.device,
        )
        get_mla_kv_buffer_triton(kv_buffer, rows, cache_k_nope, cache_k_rope)
        return cache_k_nope, cache_k_rope


class _PageInterleaveIndexKeyCache(IndexKeyCache):
    """Packed indexer pages using the latent pool's ownership and scratch plan."""

    def get_buffer(self, layer_id: int) -> torch.Tensor:
        pool = self.pool
        local = self.get_local_buffer(layer_id)
        if pool._shard_extend_active:
            slot = pool._acquire_slot_for_read(layer_id)
            # Raw getters preserve the empty skip-topk placeholder, but still
            # advance layer prefetch rather than exposing stale scratch bytes.
            return slot.tensors["index_k"] if local.shape[0] else local
        return local

    def _scratch_pages(self, layer_id: int, page_indices: torch.Tensor) -> torch.Tensor:
        assert self.pool._shard_extend_active, (
            "logical indexer page reads require begin_shard_extend"
        )
        assert self.buffer[layer_id - self.pool.start_layer].shape[0], (
            "cannot read indexer keys for a skip-topk layer"
        )
        return self.pool._page_pos[page_indices.long()]

    def get_k_and_scale(
        self,
        layer_id: int,
        seq_len_tensor: torch.Tensor,
        page_indices: torch.Tensor,
        seq_len_sum: int,
        max_seq_len: int,
    ):
        return super().get_k_and_scale(
            layer_id,
            seq_len_tensor,
            self._scratch_pages(layer_id, page_indices),
            seq_len_sum,
            max_seq_len,
        )

    def write_targets(
        self, layer_id: int, loc: torch.Tensor
    ) -> List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """(buffer, token slots, selected token rows or None) for a write.

        During an extend every token is staged at its scratch slot; owned
        tokens also persist at their local slots. Writers apply their own
        quantization to each target, so sharded bytes match unsharded ones.
        """
        if loc.numel() == 0:
            return []
        pool = self.pool
        local = self.buffer[layer_id - pool.start_layer]
        assert local.shape[0], "cannot write indexer keys for a skip-topk layer"
        targets = []
        if pool._shard_extend_active:
            targets.append(
                (
                    pool._slots[layer_id % 2].tensors["index_k"],
                    pool.translate_loc_to_scratch(loc),
                    None,
                )
            )
        # Indexer callers may reuse or mutate their location tensors. Compute
        # fresh indices instead of memoizing only their pointer and length.
        owned_idx = torch.nonzero(
            pool.placement.local_mask(loc, pool.shard_rank)
        ).squeeze(1)
        if owned_idx.numel():
            targets.append(
                (local, pool.placement.local_index(loc[owned_idx]), owned_idx)
            )
        return targets

    def store_quantized(
        self,
        layer_id: int,
        loc: torch.Tensor,
        index_k: torch.Tensor,
        index_k_scale: torch.Tensor,
    ) -> None:
        for buf, slots, rows in self.write_targets(layer_id, loc):
            dsa_index_k_cache.SetKAndS.execute(
                pool=self.pool,
                buf=buf,
                loc=slots,
                index_k=index_k if rows is None else index_k.index_select(0, rows),
                index_k_scale=(
                    index_k_scale
                    if rows is None
                    else index_k_scale.index_select(0, rows)
                ),
            )


class PageInterleaveDSATokenToKVPool(PageInterleaveMLATokenToKVPool, DSATokenToKVPool):
    """DSA latent and indexer caches sharing one logical-page shard plan.

    The buffers use different units along their first dimension:
    - Latent KV: [num_tokens, 1, kv_cache_dim], one token per row.
    - Indexer: [num_pages, page_size * (128 + 4)] in uint8, one page per row.
      Each page packs all 128-element FP8 keys first, followed by one FP32
      scale per token. With page_size=64, one indexer row contains 8448 bytes.

    For example, local page 2 corresponds to latent rows 128..191 but indexer
    row 2 when page_size=64. The ``_gather_send_rows`` hook therefore selects
    ``_send_rows`` for latent KV and ``_send_pages`` for the indexer, letting
    the shared gather compute rank offsets and block sizes in the correct
    units while retaining the same page ownership order and scratch plan.
    Prefix gathers copy complete packed indexer pages; chunk stores stage
    every token and persist only the owning rank's tokens.

    ``get_index_k_scale_buffer`` accepts logical page IDs during an active
    sharded extend. Consumers of the raw ``get_index_k_with_scale_buffer``
    must translate their page IDs with the batch's scratch plan themselves,
    just as consumers of ``get_key_buffer`` do. Outside an extend, raw getters
    expose owner-local storage; ``index_key_cache.get_local_buffer`` always
    exposes that storage.

    This is a pool-level implementation. Model-runner selection still
    requires separate integration.
    """

    def __init__(
        self,
        *args,
        shard_spec: PageShardSpec,
        shard_group: GroupCoordinator,
        **kwargs,
    ):
        # Initialize both DSA buffers before allocating their shared scratch;
        # the ordinary sharded MLA constructor deliberately rejects use_dsa.
        DSATokenToKVPool.__init__(self, *args, **kwargs)
        assert self.index_buf_size == self.size, (
            "page-interleave DSA requires equal latent and indexer capacities"
        )
        # Indexer locations are translated in token units, which equal k-pool
        # slots only when every page keeps all of its tokens.
        assert self.index_kpool == 1, (
            f"page-interleave DSA does not support index_kpool={self.index_kpool}"
        )
        self._init_page_shard_state(shard_spec, shard_group)

    def _create_index_key_cache(self) -> IndexKeyCache:
        return _PageInterleaveIndexKeyCache(self, self.index_buf_size)

    def _scratch_tensor_specs(self, rows: int) -> Dict[str, _TensorSpec]:
        specs = super()._scratch_tensor_specs(rows)
        specs["index_k"] = (
            self.index_key_cache._buffer_shape(rows // self.page_size),
            self.index_k_with_scale_buffer_dtype,
        )
        return specs

    def _gather_pairs(self, local_layer: int):
        pairs = super()._gather_pairs(local_layer)
        index_k = self.index_k_with_scale_buffer[local_layer]
        if index_k.shape[0]:
            pairs.append((index_k, "index_k"))
        return pairs

    def _gather_send_rows(self, name: str) -> torch.Tensor:
        # The indexer's first dimension counts complete pages, while latent
        # storage counts tokens. Both use the exact same page ownership order.
        if name == "index_k":
            return self._send_pages
        return super()._gather_send_rows(name)

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        return self.index_key_cache.get_buffer(layer_id)

    def set_kv_buffer(
        self,
        layer: RadixAttention,
        loc_info,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        layer_id_override: Optional[int] = None,
    ):
        if self.dsa_kv_cache_store_fp8:
            raise NotImplementedError(
                "packed DSA latent writes require set_mla_kv_buffer"
            )
        return super().set_kv_buffer(
            layer, loc_info, cache_k, cache_v, layer_id_override
        )

    def get_mla_kv_buffer(
        self,
        layer: RadixAttention,
        loc: torch.Tensor,
        dst_dtype: Optional[torch.dtype] = None,
    ):
        """Read logical rows as separate NoPE and RoPE tensors.

        Packed FP8 rows contain scales and BF16 RoPE bytes, so decode them
        after gathering instead of using the ordinary MLA row-copy kernel.
        The DSA decoder produces BF16 by default; an explicit ``dst_dtype``
        converts those decoded values to the requested type.
        """
        if not self.dsa_kv_cache_store_fp8:
            return super().get_mla_kv_buffer(layer, loc, dst_dtype)

        slot = self._acquire_slot_for_read(layer.layer_id)
        rows = self.translate_loc_to_scratch(loc)
        kv = dequantize_k_cache_paged_dsa(self._scratch_kv(slot), rows)
        if dst_dtype is not None:
            kv = kv.to(dst_dtype)
        return (
            kv[..., : self.kv_lora_rank].contiguous(),
            kv[..., self.kv_lora_rank :].contiguous(),
        )

    def get_value_buffer(self, layer_id: int):
        if self.dsa_kv_cache_store_fp8:
            raise NotImplementedError(
                "packed DSA latent reads require the raw key buffer and a DSA backend"
            )
        return super().get_value_buffer(layer_id)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        raise NotImplementedError(
            "DSA cache relocation requires a transfer between logical-page owners"
        )

    def get_cpu_copy(self, indices, mamba_indices=None):
        raise NotImplementedError(
            "DSA CPU offload is unsupported under logical-page KV sharding"
        )

    def load_cpu_copy(self, kv_cache_cpu_dict, indices, mamba_indices=None):
        raise NotImplementedError(
            "DSA CPU restore is unsupported under logical-page KV sharding"
        )
