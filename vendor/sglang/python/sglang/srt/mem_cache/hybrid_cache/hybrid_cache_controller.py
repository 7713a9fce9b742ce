from __future__ import annotations

import json
import logging
import os
import threading
import time
from array import array
from dataclasses import dataclass, field, replace
from enum import Enum, auto
from queue import Empty, Queue
from typing import TYPE_CHECKING, Any, Callable, List, Optional

import torch

from sglang.srt.managers.cache_controller import (
    CacheOperation,
)
from sglang.srt.managers.cache_controller import (
    HiCacheController as BaseHiCacheController,
)
from sglang.srt.managers.cache_controller import (
    LayerDoneCounter,
    PrefetchAck,
)
from sglang.srt.managers.cache_controller import (
    StorageOperation as BaseStorageOperation,
)
from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    count_pool_hits,
)
from sglang.srt.mem_cache.l2_transfer import L2Transfer
from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.base import uses_shared_host_layout
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool
from sglang.srt.mem_cache.pool_host.unified import UnifiedPageEnvelopeHostPool
from sglang.srt.mem_cache.radix_cache import RadixKey

if TYPE_CHECKING:
    from sglang.srt.mem_cache.allocator import BaseTokenToKVPoolAllocator

from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.utils import broadcast_pyobj

logger = logging.getLogger(__name__)

# Pool boundaries are nonnegative; an omitted rank must dominate MIN so
# a peer cannot establish presence of that rank's storage shard.
_NO_POOL_VERDICT = -1


@dataclass(frozen=True)
class PPPrefetchPoolSpec:
    name: PoolName
    num_slots: int
    keys: Optional[List[str]] = None
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    indices_from_pool: Optional[PoolName] = None

    @classmethod
    def from_transfer(cls, transfer: PoolTransfer) -> PPPrefetchPoolSpec:
        return cls(
            name=transfer.name,
            num_slots=(
                int(transfer.host_indices.numel())
                if transfer.host_indices is not None
                and transfer.indices_from_pool is None
                else 0
            ),
            keys=list(transfer.keys) if transfer.keys is not None else None,
            hit_policy=transfer.hit_policy,
            indices_from_pool=transfer.indices_from_pool,
        )


@dataclass
class PPPrefetchTicket:
    handle: CacheRequestHandle
    prefetch_key: RadixKey
    last_hash: Optional[str]
    prefix_keys: Optional[List[str]]
    matched_prefix_tokens: List[int]
    pool_specs: tuple[PPPrefetchPoolSpec, ...]


class PPPrefetchDecision(Enum):
    SKIPPED = auto()  # Initial storage miss or skipped prefetch.
    TICKETED = auto()  # Ticket issued, awaiting consumption.
    CANCELLED = auto()  # Cancelled before local ticket registration.


@dataclass
class PPPrefetchState:
    ticket: PPPrefetchTicket
    operation: PrefetchOperation
    release_requested: bool = False
    ready_event: threading.Event = field(default_factory=threading.Event, repr=False)
    consumed: bool = False


def _trailing_chain_groups(
    prefix_keys: Optional[List[str]],
    span_hashes: List[str],
    transfers: list[PoolTransfer],
) -> list[tuple[HiCacheStorageExtraInfo, list[PoolTransfer]]]:
    """One extra_info per tail length so prefix_keys + keys stays contiguous."""
    if prefix_keys is None:
        return [(HiCacheStorageExtraInfo(prefix_keys=None), transfers)]
    groups: dict[int, list[PoolTransfer]] = {}
    for transfer in transfers:
        covered = len(span_hashes) - len(transfer.keys or ())
        groups.setdefault(covered, []).append(transfer)
    return [
        (
            HiCacheStorageExtraInfo(prefix_keys=prefix_keys + span_hashes[:covered]),
            group,
        )
        for covered, group in groups.items()
    ]


class StorageOperation(BaseStorageOperation):
    def __init__(
        self,
        host_indices: torch.Tensor,
        token_ids: List[int],
        last_hash: Optional[str] = None,
        hash_value: Optional[List[str]] = None,
        prefix_keys: Optional[List[str]] = None,
        pool_transfers: Optional[list[PoolTransfer]] = None,
    ):
        super().__init__(host_indices, token_ids, last_hash, hash_value, prefix_keys)
        self.pool_transfers = pool_transfers
        self.pool_storage_result = PoolTransferResult.empty()


class PrefetchOperation(StorageOperation):
    def __init__(
        self,
        handle: CacheRequestHandle,
        token_ids: List[int],
        last_hash: Optional[str] = None,
        prefix_keys: Optional[List[str]] = None,
        pool_transfers: Optional[list[PoolTransfer]] = None,
        assume_stored: bool = False,
    ):
        self.handle = handle
        self.request_id = handle.rid
        self._lock = threading.Lock()
        self._terminated_flag = False
        self.storage_hit_count = 0
        # KV pages the hit-time plan skips in front of the KV transfer: the
        # device trim, then the span head a component's block groups serve.
        self.prefetch_kv_page_offset = 0
        self.group_skip_pages = 0
        self.start_time = time.monotonic()
        # Take the whole span as present instead of querying for it; the read
        # itself is fail-soft, so a wrong guess shortens the fetch.
        self.assume_stored = assume_stored
        super().__init__(
            None,
            token_ids,
            last_hash,
            prefix_keys=prefix_keys,
            pool_transfers=pool_transfers,
        )
        self.pool_transfers_done = not bool(pool_transfers)
        # The hit query's verdict per pool, as the chain prefix length (in
        # pages) up to which the pool is present; rank-reduced with the
        # folded hit count. Empty until the query ran on this rank.
        self.query_pool_hit_pages: dict[PoolName, int] = {}
        self.buffer_host_occupied_units: Optional[int] = None
        # The Python transfer worker leaves the unfinished tail to the ACK drain;
        # a controller that releases it itself must set this False.
        self.ack_releases_incomplete_host_indices = True
        # Buffer mode may trim already-device-resident FULL pages after the
        # query. Trailing sidecars still use the untrimmed hit endpoint.
        self.sidecar_hash_values: Optional[list[str]] = None
        self.sidecar_hit_pages = 0
        # Cut by the stop policy, not a storage shortfall: the span is still stored.
        self.deadline_expired = False

    def mark_terminate(self):
        with self._lock:
            self._terminated_flag = True

    def is_terminated(self) -> bool:
        with self._lock:
            return self._terminated_flag


@dataclass(frozen=True)
class PrefetchSubmission:
    operation: Optional[PrefetchOperation] = None
    decision: Optional[bool] = None


class HybridCacheController(BaseHiCacheController):
    is_kv_sharded: bool = False

    def __init__(
        self,
        token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator,
        mem_pool_host: Any,
        page_size: int,
        tp_group: torch.distributed.ProcessGroup,
        load_cache_event: threading.Event,
        attn_cp_group: Optional[torch.distributed.ProcessGroup] = None,
        attn_tp_group: Optional[torch.distributed.ProcessGroup] = None,
        pp_group: Optional[torch.distributed.ProcessGroup] = None,
        write_policy: str = "write_through_selective",
        io_backend: str = "",
        storage_backend: Optional[str] = None,
        prefetch_threshold: int = 256,
        model_name: Optional[str] = None,
        storage_backend_extra_config: Optional[dict] = None,
        transfer_layer_id_max: Optional[int] = None,
        enable_storage_metrics: bool = False,
        host_memory_mode: str = "cache",
    ):
        startup_storage_backend = storage_backend
        self.is_kv_sharded = isinstance(
            mem_pool_host.anchor_entry.host_pool, PageInterleaveHostPool
        )
        self.extra_host_mem_release_queues: dict[PoolName, Queue[torch.Tensor]] = {}
        self.pp_prefetch_command_group = None
        self.pp_prefetch_command_thread = None
        self.pp_prefetch_command_queue: Queue[Optional[PPPrefetchTicket]] = Queue()
        self.pp_prefetch_state_lock = threading.Lock()
        self.pp_prefetch_states: dict[str, PPPrefetchState] = {}
        self.pp_prefetch_decisions: dict[str, PPPrefetchDecision] = {}
        super().__init__(
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            mem_pool_host=mem_pool_host,
            page_size=page_size,
            tp_group=tp_group,
            load_cache_event=load_cache_event,
            attn_cp_group=attn_cp_group,
            attn_tp_group=attn_tp_group,
            pp_group=pp_group,
            write_policy=write_policy,
            io_backend=io_backend,
            storage_backend=None,
            prefetch_threshold=prefetch_threshold,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
            enable_storage_metrics=enable_storage_metrics,
            host_memory_mode=host_memory_mode,
        )
        # Hybrid transfer IDs span every component pool, including holes for
        # uncached layers that the anchor pool alone cannot describe.
        if (
            transfer_layer_id_max is not None
            and transfer_layer_id_max != self.transfer_layer_id_max
        ):
            self.transfer_layer_id_max = transfer_layer_id_max
            self.layer_done_counter = LayerDoneCounter(self.transfer_layer_id_max)

        self.storage_host_pool = mem_pool_host.anchor_entry.host_pool
        if startup_storage_backend is not None:
            self.attach_storage_backend(
                storage_backend=startup_storage_backend,
                prefetch_threshold=prefetch_threshold,
                model_name=model_name,
                storage_backend_extra_config=storage_backend_extra_config,
                host_pools=getattr(mem_pool_host, "entries", None),
            )

    def _start_storage_threads(self):
        super()._start_storage_threads()
        self._init_extra_host_mem_release_queues()
        if self.pp_prefetch_command_group is not None:
            self.pp_prefetch_command_queue = Queue()
            self.pp_prefetch_command_thread = threading.Thread(
                target=self.pp_prefetch_command_thread_func, daemon=True
            )
            self.pp_prefetch_command_thread.start()

    def _stop_pp_prefetch_thread(self) -> None:
        thread = self.pp_prefetch_command_thread
        if thread is None:
            return
        if thread.is_alive() and getattr(self, "pp_rank", 0) == 0:
            self.pp_prefetch_command_queue.put(None)
        thread.join(timeout=10)
        if thread.is_alive():
            raise RuntimeError("Failed to stop PP HiCache ticket thread cleanly.")
        self.pp_prefetch_command_thread = None

    def _stop_storage_threads(self):
        self._stop_pp_prefetch_thread()
        super()._stop_storage_threads()

    @staticmethod
    def supports_page_envelope_host(storage_backend: str | None) -> bool:
        """Only opt in backends whose FULL object is the complete shared page."""
        return storage_backend is None or storage_backend == "mori"

    # The per-pool v2 burst runs after super() returns; on_host_pools_registered()
    # fires at its end, so the base class leaves the firing to us.
    _registers_host_pools_after_super_attach = True

    def attach_storage_backend(
        self,
        storage_backend: str,
        prefetch_threshold: int = 256,
        model_name: Optional[str] = None,
        storage_backend_extra_config: Optional[dict] = None,
        host_pools: Optional[list[PoolEntry]] = None,
    ):
        if isinstance(
            self.storage_host_pool, UnifiedPageEnvelopeHostPool
        ) and not self.supports_page_envelope_host(storage_backend):
            # A runtime backend switch cannot replace the existing host arena.
            raise ValueError(
                f"Storage backend {storage_backend!r} requires separate host pools. "
                "Restart with this backend selected to create compatible host pools."
            )
        enable_pp_ticket = (
            self.host_memory_mode == "buffer_only"
            and self.pp_group is not None
            and torch.distributed.get_world_size(group=self.pp_group) > 1
        )
        if enable_pp_ticket and self.pp_prefetch_command_group is None:
            from sglang.srt.distributed.parallel_state import (
                create_custom_parallel_group,
            )

            self.pp_prefetch_command_group = create_custom_parallel_group(
                group_ranks=torch.distributed.get_process_group_ranks(self.pp_group),
                backend="gloo",
            )

        try:
            super().attach_storage_backend(
                storage_backend=storage_backend,
                prefetch_threshold=prefetch_threshold,
                model_name=model_name,
                storage_backend_extra_config=storage_backend_extra_config,
            )
        except Exception:
            if self.pp_prefetch_command_group is not None:
                torch.distributed.destroy_process_group(self.pp_prefetch_command_group)
                self.pp_prefetch_command_group = None
            raise

        for entry in host_pools or []:
            self.storage_backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
        self.storage_backend.on_host_pools_registered()

    def detach_storage_backend(self):
        super().detach_storage_backend()
        if self.pp_prefetch_command_group is not None:
            torch.distributed.destroy_process_group(self.pp_prefetch_command_group)
            self.pp_prefetch_command_group = None
        with self.pp_prefetch_state_lock:
            self.pp_prefetch_states.clear()
            self.pp_prefetch_decisions.clear()

    def register_host_pool_entry(self, entry: PoolEntry) -> None:
        if not isinstance(self.mem_pool_host, HostPoolGroup):
            raise TypeError("Dynamic HiCache sidecars require HostPoolGroup.")
        self.mem_pool_host.add_entry(entry)
        if not entry.is_primary_index_anchor:
            self.extra_host_mem_release_queues.setdefault(entry.name, Queue())
        if self.enable_storage and self.storage_backend is not None:
            self.storage_backend.register_mem_host_pool_v2(entry.host_pool, entry.name)

    @staticmethod
    def parse_storage_backend_extra_config(
        storage_backend_extra_config: Optional[str],
    ) -> tuple[dict, int, float, float, bool]:
        extra_config = {}
        if storage_backend_extra_config:
            if storage_backend_extra_config.startswith("@"):
                path = storage_backend_extra_config[1:]
                ext = os.path.splitext(path)[1].lower()
                with open(path, "rb" if ext == ".toml" else "r") as f:
                    if ext == ".json":
                        extra_config = json.load(f)
                    elif ext == ".toml":
                        import tomllib

                        extra_config = tomllib.load(f)
                    elif ext in (".yaml", ".yml"):
                        import yaml

                        extra_config = yaml.safe_load(f)
                    else:
                        raise ValueError(
                            f"Unsupported config file {path} (config format: {ext})"
                        )
            else:
                extra_config = json.loads(storage_backend_extra_config)

        prefetch_threshold = extra_config.pop("prefetch_threshold", 256)
        prefetch_timeout_base = extra_config.pop("prefetch_timeout_base", 1)
        prefetch_timeout_per_ki_token = extra_config.pop(
            "prefetch_timeout_per_ki_token", 0.25
        )
        hicache_storage_pass_prefix_keys = extra_config.pop(
            "hicache_storage_pass_prefix_keys", False
        )

        if not isinstance(prefetch_threshold, int):
            raise ValueError(
                f"prefetch_threshold must be int, got {type(prefetch_threshold).__name__}"
            )
        if not isinstance(prefetch_timeout_base, (int, float)):
            raise ValueError(
                f"prefetch_timeout_base must be number, got {type(prefetch_timeout_base).__name__}"
            )
        if not isinstance(prefetch_timeout_per_ki_token, (int, float)):
            raise ValueError(
                "prefetch_timeout_per_ki_token must be number, got "
                f"{type(prefetch_timeout_per_ki_token).__name__}"
            )
        if not isinstance(hicache_storage_pass_prefix_keys, bool):
            raise ValueError(
                "hicache_storage_pass_prefix_keys must be bool, got "
                f"{type(hicache_storage_pass_prefix_keys).__name__}"
            )

        return (
            extra_config,
            prefetch_threshold,
            float(prefetch_timeout_base),
            float(prefetch_timeout_per_ki_token),
            hicache_storage_pass_prefix_keys,
        )

    def clear_storage_backend(self) -> bool:
        if not self.enable_storage:
            logger.warning("Hierarchical cache storage backend is not enabled.")
            return False
        if not hasattr(self.storage_backend, "clear"):
            logger.warning(
                "Storage backend %s does not support clear operation.",
                type(self.storage_backend).__name__,
            )
            return False
        self.storage_backend.clear()
        return True

    def _init_extra_host_mem_release_queues(self) -> None:
        self.extra_host_mem_release_queues = {}
        entries = getattr(self.mem_pool_host, "entries", None) or []
        anchor_entry = getattr(self.mem_pool_host, "anchor_entry", None)
        for entry in entries:
            if entry is anchor_entry or entry.is_primary_index_anchor:
                continue
            self.extra_host_mem_release_queues[entry.name] = Queue()

    def _append_host_mem_release_pages(
        self, release_queue: Queue, host_indices: torch.Tensor, page_size: int
    ) -> None:
        if host_indices.numel() == 0:
            return
        for page in host_indices.split(page_size):
            release_queue.put(page)

    def append_host_mem_release(
        self,
        host_indices: Optional[torch.Tensor] = None,
        extra_pools: Optional[list[PoolTransfer]] = None,
    ):
        if host_indices is not None:
            self._append_host_mem_release_pages(
                self.host_mem_release_queue,
                host_indices,
                self.mem_pool_host.page_size,
            )
        for transfer in extra_pools or []:
            if transfer.host_indices is None or transfer.host_indices.numel() == 0:
                continue
            entry = self.mem_pool_host.entry_map.get(transfer.name)
            if (
                entry is None
                or entry.is_primary_index_anchor
                or transfer.indices_from_pool is not None
            ):
                continue
            release_queue = self.extra_host_mem_release_queues.get(transfer.name)
            if release_queue is None:
                continue
            self._append_host_mem_release_pages(
                release_queue, transfer.host_indices, entry.host_pool.page_size
            )

    def reset(self):
        self._stop_pp_prefetch_thread()
        super().reset()
        with self.pp_prefetch_state_lock:
            self.pp_prefetch_states.clear()
            self.pp_prefetch_decisions.clear()
        if self.enable_storage and self.pp_prefetch_command_group is not None:
            self.pp_prefetch_command_queue = Queue()
            self.pp_prefetch_command_thread = threading.Thread(
                target=self.pp_prefetch_command_thread_func, daemon=True
            )
            self.pp_prefetch_command_thread.start()
        if self.enable_storage:
            self.host_mem_release_queue.queue.clear()
            for release_queue in self.extra_host_mem_release_queues.values():
                release_queue.queue.clear()
            self.prefetch_tokens_occupied = 0

    def allocate_host_transfers(
        self,
        device_indices: torch.Tensor,
        extra_pools: Optional[list[PoolTransfer]] = None,
        *,
        reclaim: Optional[Callable[[int], Any]] = None,
        start_owner: Optional[int] = None,
    ) -> Optional[tuple[torch.Tensor, Optional[list[PoolTransfer]]]]:
        if self._uses_shared_host_domain(extra_pools):
            allocation = self.allocate_shared_host_transfers(
                device_indices, extra_pools
            )
            anchor = self.mem_pool_host.anchor_entry
            if (
                allocation is None
                and reclaim is not None
                and anchor.host_evict_fn is None
            ):
                reclaim(len(device_indices))
                allocation = self.allocate_shared_host_transfers(
                    device_indices, extra_pools
                )
            return allocation

        host_indices = self.mem_pool_host.alloc(
            len(device_indices), reclaim=reclaim, start_owner=start_owner
        )
        if host_indices is None:
            return None
        pool_transfers = self.mem_pool_host.resolve_host_transfers(
            extra_pools,
            primary_device_indices=device_indices,
            primary_host_indices=host_indices,
        )
        if pool_transfers is None and extra_pools:
            self.mem_pool_host.free(host_indices)
            return None
        return host_indices, pool_transfers

    def write(
        self,
        device_indices: torch.Tensor,
        priority: Optional[int] = None,
        node_id: int = -1,
        extra_pools: Optional[list[PoolTransfer]] = None,
        flush: bool = True,
        start_owner: Optional[int] = None,
    ) -> Optional[torch.Tensor]:
        allocation = self.allocate_host_transfers(
            device_indices, extra_pools, start_owner=start_owner
        )
        if allocation is None:
            return None
        host_indices, pool_transfers = allocation

        self.write_queue.append(
            CacheOperation(
                host_indices,
                device_indices,
                node_id,
                priority,
                pool_transfers=pool_transfers or None,
            )
        )
        if flush:
            self.start_writing()
        return host_indices

    def _uses_shared_host_domain(
        self, extra_pools: Optional[list[PoolTransfer]]
    ) -> bool:
        anchor_pool = self.mem_pool_host.anchor_entry.host_pool
        if not uses_shared_host_layout(anchor_pool):
            return False
        domain = anchor_pool.shared_allocation_domain
        for transfer in extra_pools or []:
            if (
                transfer.indices_from_pool is not None
                or transfer.host_indices is not None
                or transfer.device_indices is None
            ):
                continue
            entry = self.mem_pool_host.entry_map.get(transfer.name)
            if entry is not None and (
                not uses_shared_host_layout(entry.host_pool)
                or entry.host_pool.shared_allocation_domain is not domain
            ):
                return False
        return True

    def _alloc_shared_host_requests_with_reclaim(
        self, requests: list[tuple[PoolName, int]]
    ) -> Optional[list[torch.Tensor]]:
        entries = [self.mem_pool_host.entry_map[name] for name, _ in requests]
        domain = entries[0].host_pool.shared_allocation_domain
        if domain is None or any(
            entry.host_pool.shared_allocation_domain is not domain for entry in entries
        ):
            raise ValueError("Host pools do not share one allocation domain.")
        domain_requests = [
            (entry.host_pool.pool_label, need_size)
            for entry, (_, need_size) in zip(entries, requests, strict=True)
        ]

        # Scheduler drains commit the same logical host allocations and frees
        # across attention ranks. Layout compaction waits for local I/O before
        # allocating; transfer readiness does not change the capacity decision.
        allocated = domain.alloc_many(domain_requests)
        if allocated is not None:
            return allocated

        pools = [entry.host_pool for entry in entries]
        requested_bytes = sum(
            need_size * pool.size_per_token
            for pool, (_, need_size) in zip(pools, requests, strict=True)
        )
        requested_names = list(dict.fromkeys(name for name, _ in reversed(requests)))
        candidates = [self.mem_pool_host.entry_map[name] for name in requested_names]
        candidates.extend(
            entry
            for entry in self.mem_pool_host.entries
            if entry.name not in requested_names
            and uses_shared_host_layout(entry.host_pool)
            and entry.host_pool.shared_allocation_domain is domain
        )

        # alloc_many compacts the shared layout before reporting failure. Reclaim
        # only the remaining byte or per-side logical-slot shortfall, retrying
        # after every successful eviction. The callbacks release only evictable
        # tree entries; protected retraction backups remain safe.
        while True:
            made_progress = False
            for entry in candidates:
                if entry.host_evict_fn is None:
                    continue
                pool = entry.host_pool
                shortfall_bytes = max(
                    pool.page_size * pool.size_per_token,
                    requested_bytes - domain.free_bytes(),
                )
                tokens = (
                    (
                        (shortfall_bytes + pool.size_per_token - 1)
                        // pool.size_per_token
                        + pool.page_size
                        - 1
                    )
                    // pool.page_size
                    * pool.page_size
                )
                evicted = entry.host_evict_fn(tokens)
                if evicted <= 0:
                    continue
                made_progress = True
                allocated = domain.alloc_many(domain_requests)
                if allocated is not None:
                    return allocated
            if not made_progress:
                return None

    def allocate_shared_host_transfers(
        self,
        kv_device_indices: torch.Tensor,
        extra_pools: Optional[list[PoolTransfer]] = None,
    ) -> Optional[tuple[torch.Tensor, Optional[list[PoolTransfer]]]]:
        """Atomically reserve the anchor and all independent host side pools."""
        requests = [(self.mem_pool_host.anchor_entry.name, len(kv_device_indices))]
        request_transfers: list[PoolTransfer] = []
        for transfer in extra_pools or []:
            if transfer.indices_from_pool is not None:
                continue
            entry = self.mem_pool_host.entry_map.get(transfer.name)
            if (
                entry is None
                or transfer.host_indices is not None
                or transfer.device_indices is None
            ):
                continue
            requests.append((transfer.name, len(transfer.device_indices)))
            request_transfers.append(transfer)

        allocated = self._alloc_shared_host_requests_with_reclaim(requests)
        if allocated is None:
            return None
        host_indices = allocated[0]
        for transfer, indices in zip(request_transfers, allocated[1:], strict=True):
            transfer.host_indices = indices

        resolved = self.mem_pool_host.resolve_host_transfers(
            extra_pools,
            primary_device_indices=kv_device_indices,
            primary_host_indices=host_indices,
        )
        if resolved is None and extra_pools:
            for (name, _), indices in zip(requests, allocated, strict=True):
                self.mem_pool_host.free(indices, pool=name)
            for transfer in request_transfers:
                transfer.host_indices = None
            return None
        return host_indices, resolved

    def _shared_prefetch_requests(
        self, operation: PrefetchOperation, need_size: int
    ) -> tuple[list[tuple[PoolName, int]], list[PoolTransfer]]:
        anchor = self.mem_pool_host.anchor_entry
        pool_transfers = operation.pool_transfers or []
        requests = [(anchor.name, need_size)]
        sidecar_hit_pages = (
            operation.sidecar_hit_pages
            if operation.sidecar_hash_values is not None
            else need_size // self.page_size
        )
        independent_transfers = []
        for transfer in pool_transfers:
            if transfer.indices_from_pool is not None:
                continue
            if transfer.host_indices is not None:
                raise AssertionError(
                    "Shared prefetch pools must be allocated atomically."
                )
            entry = self.mem_pool_host.entry_map.get(transfer.name)
            if entry is None:
                continue
            num_pages = len(transfer.keys or [])
            if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                num_pages = min(num_pages or 1, sidecar_hit_pages)
            requests.append((transfer.name, num_pages * entry.host_pool.page_size))
            independent_transfers.append(transfer)
        return requests, independent_transfers

    def can_fit_prefetch_host_buffers(
        self, operation: StorageOperation, need_size: int, *, empty: bool = True
    ) -> bool:
        anchor = self.mem_pool_host.anchor_entry
        if not uses_shared_host_layout(anchor.host_pool):
            return super().can_fit_prefetch_host_buffers(operation, need_size)
        domain = anchor.host_pool.shared_allocation_domain
        requests, _ = self._shared_prefetch_requests(operation, need_size)
        domain_requests = [
            (self.mem_pool_host.entry_map[name].host_pool.pool_label, size)
            for name, size in requests
        ]
        return domain.can_fit_many_then(domain_requests, (), empty=empty)

    def prefetch_rate_limited(self) -> bool:
        if self.host_memory_mode == "buffer_only" and uses_shared_host_layout(
            self.mem_pool_host.anchor_entry.host_pool
        ):
            # Shared-arena occupancy includes the Full and SWA byte footprint.
            return self.prefetch_tokens_occupied >= self.prefetch_capacity_limit
        return super().prefetch_rate_limited()

    def alloc_prefetch_host_buffers(
        self, operation: StorageOperation, need_size: int
    ) -> Optional[torch.Tensor]:
        """Atomically allocate every prefetch slice from a shared arena."""
        anchor = self.mem_pool_host.anchor_entry
        if not uses_shared_host_layout(anchor.host_pool):
            return super().alloc_prefetch_host_buffers(operation, need_size)

        requests, independent_transfers = self._shared_prefetch_requests(
            operation, need_size
        )

        allocated = self._alloc_shared_host_requests_with_reclaim(requests)
        if allocated is None:
            return None
        self._sync_trailing_keys(
            operation.pool_transfers or [],
            operation.sidecar_hash_values or operation.hash_value,
            (
                operation.sidecar_hit_pages
                if operation.sidecar_hash_values is not None
                else need_size // self.page_size
            ),
        )
        for transfer, indices in zip(independent_transfers, allocated[1:], strict=True):
            transfer.host_indices = indices
        return allocated[0]

    def allocate_storage_hit(
        self,
        operation: StorageOperation,
        hit_tokens: int,
        *,
        allow_partial: bool,
        min_tokens: int,
        evict_host: Callable[[int], int],
    ) -> tuple[Optional[torch.Tensor], int]:
        host_indices = self.alloc_prefetch_host_buffers(operation, hit_tokens)
        shared = uses_shared_host_layout(self.mem_pool_host.anchor_entry.host_pool)
        if host_indices is None and not shared:
            evict_host(hit_tokens)
            host_indices = self.alloc_prefetch_host_buffers(operation, hit_tokens)
        if host_indices is not None or not allow_partial:
            return host_indices, hit_tokens

        if shared:
            low, high = 0, hit_tokens // self.page_size
            while low < high:
                mid = (low + high + 1) // 2
                if self.can_fit_prefetch_host_buffers(
                    operation, mid * self.page_size, empty=False
                ):
                    low = mid
                else:
                    high = mid - 1
            alloc_len = low * self.page_size
        else:
            available = self.mem_pool_host.available_size()
            alloc_len = min(hit_tokens, available - available % self.page_size)
        if alloc_len >= min_tokens:
            host_indices = self.alloc_prefetch_host_buffers(operation, alloc_len)
        return host_indices, alloc_len

    def free_prefetch_host_buffers(
        self, operation: StorageOperation, host_indices: torch.Tensor
    ) -> None:
        """Roll back an unsubmitted prefetch's anchor and independent pools."""
        pool_transfers = operation.pool_transfers or []
        self.mem_pool_host.free(host_indices)
        for transfer in pool_transfers:
            if transfer.indices_from_pool is not None or transfer.host_indices is None:
                continue
            entry = self.mem_pool_host.entry_map.get(transfer.name)
            if entry is not None:
                entry.host_pool.free(transfer.host_indices)
            transfer.host_indices = None

    def _move_op_indices(
        self, op: CacheOperation
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[list[PoolTransfer]]]:
        return self.move_hybrid_indices(op)

    def _move_write_operation(
        self, op: CacheOperation
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[list[PoolTransfer]]]:
        host_group = self.mem_pool_host
        if self.is_kv_sharded:
            return self.move_hybrid_indices(op, write_back_jit=True)
        if self.io_backend != "kernel" or host_group.layout != "page_first":
            return self.move_hybrid_indices(op)
        if not host_group.supports_per_pool_backup_indices:
            if not host_group.can_use_write_back_jit:
                return self.move_hybrid_indices(op)
            return op.host_indices, op.device_indices, op.pool_transfers

        return self.move_hybrid_indices(op, write_back_jit=True)

    def _l2_transfers(
        self,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        pool_transfers: Optional[list[PoolTransfer]] = None,
    ) -> list[L2Transfer]:
        anchor = self.mem_pool_host.anchor_entry
        transfers = []
        if host_indices.numel() > 0:
            transfers.append(
                L2Transfer(
                    host_pool=anchor.host_pool,
                    device_pool=anchor.device_pool,
                    host_indices=host_indices,
                    device_indices=device_indices,
                    layer_mapper=anchor.layer_mapper,
                )
            )
        for pool_transfer in pool_transfers or []:
            if (
                pool_transfer.host_indices is None
                or pool_transfer.device_indices is None
            ):
                raise ValueError(f"Unresolved L2 transfer for {pool_transfer.name}.")
            if (
                pool_transfer.host_indices.numel() == 0
                and pool_transfer.device_indices.numel() == 0
            ):
                continue
            entry = self.mem_pool_host.entry_map[pool_transfer.name]
            transfers.append(
                L2Transfer(
                    host_pool=entry.host_pool,
                    device_pool=entry.device_pool,
                    host_indices=pool_transfer.host_indices,
                    device_indices=pool_transfer.device_indices,
                    layer_mapper=entry.layer_mapper,
                )
            )
        return transfers

    def _l2_load_transfers(
        self,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        pool_transfers: Optional[list[PoolTransfer]] = None,
    ) -> list[L2Transfer]:
        transfers = self._l2_transfers(host_indices, device_indices, pool_transfers)
        transfers_by_entry = {
            (id(t.host_pool), id(t.device_pool)): t for t in transfers
        }
        for entry in self.mem_pool_host.entry_map.values():
            target_transfer = transfers_by_entry.get(
                (id(entry.host_pool), id(entry.device_pool))
            )
            if target_transfer is None or target_transfer.layer_mapper is None:
                continue
            for depth, draft_device_pool in enumerate(entry.packed_draft_device_pools):
                draft_host_layer = target_transfer.layer_mapper(
                    self.transfer_layer_id_max + depth
                )
                if draft_host_layer is None:
                    continue

                # Finish every draft before the final target-layer event,
                # including chains deeper than the target model.
                def draft_layer_mapper(
                    layer_id: int,
                    *,
                    expected_layer_id: int = min(depth, self.transfer_layer_id_max - 1),
                    host_layer_id: int = draft_host_layer,
                ) -> Optional[int]:
                    if layer_id == expected_layer_id:
                        return host_layer_id
                    return None

                transfers.append(
                    L2Transfer(
                        host_pool=target_transfer.host_pool,
                        device_pool=draft_device_pool,
                        host_indices=target_transfer.host_indices,
                        device_indices=target_transfer.device_indices,
                        layer_mapper=draft_layer_mapper,
                        is_draft=True,
                    )
                )
        return transfers

    def _num_tokens_by_pool(self, op: CacheOperation) -> dict[str, int]:
        """Per-pool token counts for a merged transfer op (anchor + extra
        pools), shared by D->H write and H->D load acks; sidecar transfers
        reusing another pool's indices are excluded."""
        counts = {self.mem_pool_host.anchor_entry.name.value: len(op.device_indices)}
        for transfer in op.pool_transfers or []:
            if transfer.indices_from_pool is not None or transfer.host_indices is None:
                continue
            name = transfer.name.value
            counts[name] = counts.get(name, 0) + len(transfer.host_indices)
        return counts

    def _transfer_num_bytes(self, op: CacheOperation) -> int:
        """Total bytes moved by a merged transfer op across all pools.

        Sidecar transfers riding another pool's indices are included here but
        excluded from the per-pool token counts.
        """
        anchor = self.mem_pool_host.anchor_entry

        def transferred_tokens(indices):
            if self.is_kv_sharded:
                return int(
                    anchor.host_pool.placement.local_mask(
                        indices, anchor.host_pool.shard_rank
                    ).sum()
                )
            return len(indices)

        kv_tokens = (
            transferred_tokens(op.host_indices)
            if self.is_kv_sharded
            else len(op.device_indices)
        )
        num_bytes = kv_tokens * anchor.host_pool.size_per_token
        # Slot counts of the pools sidecars can ride on.
        source_len = {self.mem_pool_host.anchor_entry.name: kv_tokens}
        for t in op.pool_transfers or []:
            if t.indices_from_pool is None and t.host_indices is not None:
                source_len[t.name] = transferred_tokens(t.host_indices)
        for t in op.pool_transfers or []:
            entry = self.mem_pool_host.entry_map.get(t.name)
            if entry is None:
                continue
            if t.indices_from_pool is not None:
                num_slots = source_len.get(t.indices_from_pool, 0)
            else:
                num_slots = (
                    transferred_tokens(t.host_indices)
                    if t.host_indices is not None
                    else 0
                )
            num_bytes += num_slots * entry.host_pool.size_per_token
        return num_bytes

    def load(
        self,
        host_indices: torch.Tensor,
        priority: Optional[int] = None,
        node_id: int = -1,
        extra_pools: Optional[list[PoolTransfer]] = None,
        *,
        device_indices: Optional[torch.Tensor] = None,
        anchor_indices: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """Queue an H2D of ``host_indices`` into freshly allocated FULL rows,
        or into caller-owned ``device_indices`` (kept on failure); side pools
        bind their device slots against ``anchor_indices`` (default: the KV
        destination rows)."""
        need_load_kv = host_indices.numel() > 0
        caller_owned = device_indices is not None

        full_allocator = getattr(
            self.mem_pool_device_allocator,
            "full_attn_allocator",
            self.mem_pool_device_allocator,
        )
        if caller_owned:
            assert len(device_indices) == len(host_indices)
        elif not need_load_kv:
            device_indices = torch.empty((0,), dtype=torch.int64, device=self.device)
        else:
            if isinstance(full_allocator, PageInterleavePoolAllocator):
                # Loaded pages keep their host copies' owners; host slots share
                # the device placement, so the first page id gives the class.
                device_indices = full_allocator.alloc_cyclic(
                    start_class=int(host_indices[0]) // full_allocator.page_size,
                    need_size=len(host_indices),
                )
            else:
                device_indices = full_allocator.alloc(len(host_indices))
            if device_indices is None:
                return None

        pool_transfers = self._resolve_device_transfers(
            extra_pools,
            kv_device_indices=(
                anchor_indices if anchor_indices is not None else device_indices
            ),
            kv_host_indices=host_indices,
        )
        if pool_transfers is None and extra_pools:
            if need_load_kv and not caller_owned:
                full_allocator.free(device_indices)
            return None

        self.load_queue.append(
            CacheOperation(
                host_indices,
                device_indices,
                node_id,
                priority,
                pool_transfers=pool_transfers or None,
            )
        )
        return device_indices

    def prefetch(
        self,
        handle: CacheRequestHandle,
        new_input_tokens: List[int],
        last_hash: Optional[str] = None,
        prefix_keys: Optional[List[str]] = None,
        extra_pools: Optional[list[PoolTransfer]] = None,
        assume_stored: bool = False,
    ) -> PrefetchOperation:
        operation = PrefetchOperation(
            handle,
            new_input_tokens,
            last_hash,
            prefix_keys=prefix_keys,
            pool_transfers=extra_pools,
            assume_stored=assume_stored,
        )
        self.prefetch_queue.put(operation)
        return operation

    def get_prefetch_submission(self, rid: str) -> Optional[PrefetchSubmission]:
        if self.pp_prefetch_command_group is None:
            return None
        if self.storage_config.pp_rank != 0:
            return PrefetchSubmission()
        with self.pp_prefetch_state_lock:
            state = self.pp_prefetch_states.get(rid)
            if state is not None:
                return PrefetchSubmission(decision=not state.consumed)
            if rid not in self.pp_prefetch_decisions:
                return None
            decision = self.pp_prefetch_decisions[rid]
        return PrefetchSubmission(decision=decision is PPPrefetchDecision.TICKETED)

    def submit_prefetch(
        self,
        handle: CacheRequestHandle,
        prefetch_key: RadixKey,
        last_hash: Optional[str],
        prefix_keys: Optional[List[str]],
        matched_prefix_tokens: Optional[List[int]],
        pool_transfers: Optional[list[PoolTransfer]],
        assume_stored: bool = False,
    ) -> PrefetchSubmission:
        if self.pp_prefetch_command_group is None:
            return PrefetchSubmission(
                operation=self.prefetch(
                    handle,
                    prefetch_key,
                    last_hash,
                    prefix_keys,
                    extra_pools=pool_transfers,
                    assume_stored=assume_stored,
                )
            )

        if self.storage_config.pp_rank != 0:
            raise RuntimeError("Only PP0 can submit a PP prefetch ticket.")

        rid = handle.rid
        ticket = PPPrefetchTicket(
            handle=handle,
            prefetch_key=RadixKey(
                array("q", prefetch_key.token_ids),
                extra_key=prefetch_key.extra_key,
                cache_salt=prefetch_key.cache_salt,
                is_bigram=prefetch_key.is_bigram,
            ),
            last_hash=last_hash,
            prefix_keys=list(prefix_keys) if prefix_keys else None,
            matched_prefix_tokens=list(matched_prefix_tokens or []),
            pool_specs=tuple(
                PPPrefetchPoolSpec.from_transfer(transfer)
                for transfer in pool_transfers or []
            ),
        )
        operation = PrefetchOperation(
            handle,
            ticket.prefetch_key,
            last_hash,
            prefix_keys=ticket.prefix_keys,
            pool_transfers=pool_transfers,
        )

        # Every rank queries and allocates in ticket order on the worker.
        # Admission waits for the normal completion ACK, including misses.
        operation.is_pp_broadcast = True
        state = PPPrefetchState(ticket=ticket, operation=operation)
        with self.pp_prefetch_state_lock:
            if rid in self.pp_prefetch_states:
                raise RuntimeError(f"Duplicate PP prefetch request id: {rid}")
            self.pp_prefetch_states[rid] = state
            self.pp_prefetch_decisions[rid] = PPPrefetchDecision.TICKETED

        self.pp_prefetch_command_queue.put(ticket)
        return PrefetchSubmission(operation=operation, decision=True)

    def _allocate_pp_prefetch_buffers(
        self, ticket: PPPrefetchTicket, operation: PrefetchOperation
    ) -> bool:
        allocated: list[tuple[PoolName, torch.Tensor]] = []

        def alloc(
            name: PoolName, size: int, num_pages: int = 0
        ) -> Optional[torch.Tensor]:
            try:
                if size == 0 and num_pages:
                    size = num_pages * self.mem_pool_host.get_pool(name).page_size
                indices = self.mem_pool_host.alloc(size, pool=name)
            except Exception:
                for pool, owned in reversed(allocated):
                    self.mem_pool_host.free(owned, pool=pool)
                raise
            if indices is not None:
                allocated.append((name, indices))
            return indices

        host_indices = alloc(PoolName.KV, operation.storage_hit_count)
        if host_indices is None:
            return False

        existing = {
            transfer.name: transfer for transfer in operation.pool_transfers or []
        }
        sources: dict[PoolName, torch.Tensor] = {PoolName.KV: host_indices}
        transfers: list[PoolTransfer] = []
        for spec in ticket.pool_specs:
            transfer = existing.get(spec.name)
            if spec.indices_from_pool is None:
                indices = transfer.host_indices if transfer is not None else None
                if indices is None:
                    indices = alloc(
                        spec.name,
                        spec.num_slots,
                        min(
                            len(spec.keys or []),
                            operation.storage_hit_count // self.page_size,
                        ),
                    )
                if indices is None:
                    for name, owned in reversed(allocated):
                        self.mem_pool_host.free(owned, pool=name)
                    return False
                sources[spec.name] = indices
            else:
                indices = sources.get(spec.indices_from_pool)
                if indices is None:
                    for name, owned in reversed(allocated):
                        self.mem_pool_host.free(owned, pool=name)
                    return False
            transfers.append(
                PoolTransfer(
                    name=spec.name,
                    host_indices=indices,
                    keys=list(spec.keys) if spec.keys is not None else None,
                    hit_policy=spec.hit_policy,
                    indices_from_pool=spec.indices_from_pool,
                )
            )

        operation.host_indices = host_indices
        operation.pool_transfers = transfers or None
        operation.pool_transfers_done = not bool(transfers)
        self.prefetch_tokens_occupied += len(host_indices)
        return True

    def _free_pp_prefetch_state(self, state: PPPrefetchState) -> None:
        operation = state.operation
        if operation.host_indices is not None:
            self.mem_pool_host.free(operation.host_indices, pool=PoolName.KV)
            self.prefetch_tokens_occupied -= len(operation.host_indices)
            operation.host_indices = None
        for transfer in operation.pool_transfers or []:
            if transfer.indices_from_pool is None and transfer.host_indices is not None:
                self.mem_pool_host.free(transfer.host_indices, pool=transfer.name)
                transfer.host_indices = None

    def is_pp_prefetch_ready(self, rid: str) -> bool:
        with self.pp_prefetch_state_lock:
            state = self.pp_prefetch_states.get(rid)
            if state is None or state.consumed:
                return False
            thread = self.pp_prefetch_command_thread
            if thread is not None and not thread.is_alive():
                raise RuntimeError(f"PP HiCache ticket thread exited: req={rid}")
            return state.ready_event.is_set()

    def take_ready_pp_prefetch(self, rid: str) -> Optional[PPPrefetchState]:
        with self.pp_prefetch_state_lock:
            state = self.pp_prefetch_states.get(rid)
        if state is None or state.consumed:
            return None
        state.ready_event.wait()
        with self.pp_prefetch_state_lock:
            if self.pp_prefetch_states.get(rid) is not state or state.consumed:
                return None
            # Keep the ticket for deduplication until the request finishes.
            state.consumed = True
            self.pp_prefetch_decisions.pop(rid, None)
            if (
                state.operation.host_indices is None
                or state.operation.completed_tokens == 0
            ):
                self._free_pp_prefetch_state(state)
            return state

    def release_pp_prefetch(self, rid: str) -> bool:
        """Retire a ticket; free only buffers not handed to buffer mode."""
        with self.pp_prefetch_state_lock:
            decision = self.pp_prefetch_decisions.pop(rid, None)
            state = self.pp_prefetch_states.get(rid)
            if state is None:
                if decision not in (None, PPPrefetchDecision.SKIPPED):
                    # Request rejection may precede local ticket registration.
                    self.pp_prefetch_decisions[rid] = PPPrefetchDecision.CANCELLED
                    return True
                return False
            if state.consumed:
                self.pp_prefetch_states.pop(rid)
                return False  # Buffer mode owns any remaining staging buffers.
            state.release_requested = True
            if state.ready_event.is_set():
                self._free_pp_prefetch_state(state)
                self.pp_prefetch_states.pop(rid, None)
            return True

    def pp_prefetch_command_thread_func(self) -> None:
        group = self.pp_prefetch_command_group
        assert group is not None
        rank = torch.distributed.get_rank()
        source = torch.distributed.get_process_group_ranks(group)[0]
        is_source = self.storage_config.pp_rank == 0

        while True:
            objects = []
            if is_source:
                try:
                    objects = [self.pp_prefetch_command_queue.get(timeout=60)]
                except Empty:
                    pass  # Complete idle broadcasts before the group times out.
            try:
                objects = broadcast_pyobj(objects, rank, group, src=source)
                if not objects:
                    continue
                ticket = objects[0]
                if ticket is None:
                    return

                rid = ticket.handle.rid
                with self.pp_prefetch_state_lock:
                    state = self.pp_prefetch_states.get(rid)
                    if state is None:
                        operation = PrefetchOperation(
                            ticket.handle,
                            ticket.prefetch_key,
                            ticket.last_hash,
                            prefix_keys=ticket.prefix_keys,
                            # Keep sidecar ACKs aligned even if allocation fails.
                            pool_transfers=[
                                PoolTransfer(
                                    name=spec.name,
                                    keys=spec.keys,
                                    hit_policy=spec.hit_policy,
                                    indices_from_pool=spec.indices_from_pool,
                                )
                                for spec in ticket.pool_specs
                            ]
                            or None,
                        )
                        operation.is_pp_broadcast = True
                        state = PPPrefetchState(ticket=ticket, operation=operation)
                        self.pp_prefetch_states[rid] = state
                    decision = self.pp_prefetch_decisions.get(rid)
                    if decision is PPPrefetchDecision.CANCELLED:
                        state.release_requested = True
                        self.pp_prefetch_decisions.pop(rid)
                    operation = state.operation

                try:
                    hash_value, storage_hit_count = self._storage_hit_query(operation)
                    storage_hit_count = min(
                        storage_hit_count,
                        self.mem_pool_host.available_size(pool=PoolName.KV),
                    )
                    storage_hit_count -= storage_hit_count % self.page_size
                    operation.storage_hit_count = storage_hit_count
                    if (
                        storage_hit_count == 0
                        or storage_hit_count < self.prefetch_threshold
                        or not self._allocate_pp_prefetch_buffers(ticket, operation)
                    ):
                        storage_hit_count = 0
                except Exception:
                    logger.exception(
                        "PP HiCache query or allocation failed for req=%s.", rid
                    )
                    operation.query_pool_hit_pages = {}
                    hash_value, storage_hit_count = [], 0

                # A failed query/allocation votes zero in the same MIN as hits.
                storage_hit_count = self._sync_prefetch_hit_query(
                    operation, storage_hit_count
                )
                if operation.host_indices is not None:
                    tail = operation.host_indices[storage_hit_count:]
                    if tail.numel():
                        self.mem_pool_host.free(tail, pool=PoolName.KV)
                        self.prefetch_tokens_occupied -= len(tail)
                        operation.host_indices = operation.host_indices[
                            :storage_hit_count
                        ]
                operation.hash_value = hash_value[: storage_hit_count // self.page_size]
                operation.storage_hit_count = storage_hit_count
                operation.storage_start = len(ticket.matched_prefix_tokens)
                operation.pool_storage_result = PoolTransferResult.empty()
                if storage_hit_count == 0:
                    if operation.host_indices is None:
                        operation.host_indices = torch.empty(0, dtype=torch.int64)
                    operation.mark_terminate()
                if operation.pool_transfers:
                    self._resolve_sidecar_kv_derived_pool_transfers(operation)
                self.prefetch_buffer.put(operation)
            except Exception:
                logger.exception("PP HiCache ticket processing failed.")
                # Query/allocation failures already follow the agreed ACK path.
                # An unexpected failure cannot safely continue the collectives.
                return
            finally:
                if is_source and objects:
                    self.pp_prefetch_command_queue.task_done()

    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: List[int],
        hash_value: Optional[List[str]] = None,
        prefix_keys: Optional[List[str]] = None,
        extra_pools: Optional[list[PoolTransfer]] = None,
    ) -> int:
        operation = StorageOperation(
            host_indices,
            token_ids,
            hash_value=hash_value,
            prefix_keys=prefix_keys,
            pool_transfers=extra_pools,
        )
        self.backup_queue.put(operation)
        return operation.id

    def _storage_hit_query(self, operation) -> tuple[list[str], int]:
        hash_value = get_storage_hash_str(
            operation.token_ids, operation.last_hash, page_size=self.page_size
        )
        operation.all_hash_values = hash_value

        if operation.assume_stored:
            # A prior hit on a suffix of this span proved it stored, and writes
            # are prefix-covered, so re-querying only adds a round trip. Nothing
            # is verified now, so no pool gets a verdict to learn from.
            kv_hit_pages = len(hash_value)
            operation.pool_storage_result.update_kv_hit_pages(kv_hit_pages)
            operation.query_pool_hit_pages = {}
            return hash_value, kv_hit_pages * self.page_size

        extra_info = HiCacheStorageExtraInfo(
            prefix_keys=operation.prefix_keys.copy() if operation.prefix_keys else None,
        )
        if operation.pool_transfers:
            hit_result = self.storage_backend.batch_exists_v2(
                hash_value, operation.pool_transfers, extra_info
            )
        else:
            kv_hit_count = self.storage_backend.batch_exists(hash_value, extra_info)
            hit_result = PoolTransferResult(
                kv_hit_pages=kv_hit_count, extra_pool_hit_pages={}
            )

        kv_hit_pages = hit_result.kv_hit_pages
        operation.pool_storage_result.update_kv_hit_pages(kv_hit_pages)
        operation.pool_storage_result.restorable_prefix_pages = (
            hit_result.restorable_prefix_pages
        )
        # Each pool's own boundary (the KV pool's where the backend reports
        # it, else the folded cut); the beliefs heal pool by pool. A pool the
        # backend did not report carries no verdict.
        pool_hits = hit_result.extra_pool_hit_pages
        operation.query_pool_hit_pages = {
            PoolName.KV: pool_hits.get(PoolName.KV, kv_hit_pages)
        }
        for transfer in operation.pool_transfers or ():
            if transfer.name in pool_hits:
                operation.query_pool_hit_pages[transfer.name] = pool_hits[transfer.name]

        return (
            hash_value[:kv_hit_pages],
            kv_hit_pages * self.page_size,
        )

    def _sync_prefetch_hit_query(self, operation, storage_hit_count: int) -> int:
        """One MIN collective for the folded hit count and every pool's own
        boundary, so per-pool beliefs stay rank-identical. A pool omitted
        by any rank heals from the folded cut without learning presence."""
        if any(
            transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES
            for transfer in operation.pool_transfers or []
        ):
            # A trailing state can exist at 512 and 1024 but not at 768. Taking
            # MIN of each rank's longest hit would choose a missing checkpoint,
            # so reduce one restorable flag per prefix length instead. Use the
            # request span (identical on every rank) for the collective shape,
            # including when one rank skipped its query due to cancellation.
            hits = [0] * (len(operation.token_ids) // self.page_size + 1)
            hits[0] = 1
            if storage_hit_count > 0:
                pages = operation.pool_storage_result.restorable_prefix_pages
                if pages is None:
                    # Backends without sparse-boundary results keep their
                    # contiguous-prefix contract. File and Mooncake return a set.
                    pages = range(1, storage_hit_count // self.page_size + 1)
                # Callers may cap the hit to allocated host space after the
                # query; a checkpoint past that cap has nowhere to load.
                for page in pages:
                    if 0 < page <= storage_hit_count // self.page_size:
                        hits[page] = 1
        else:
            hits = [storage_hit_count]
        pools = list(PoolName)
        local = operation.query_pool_hit_pages
        packed = torch.tensor(
            hits + [local.get(pool, _NO_POOL_VERDICT) for pool in pools],
            dtype=torch.int,
        )
        self._all_reduce(
            packed,
            torch.distributed.ReduceOp.MIN,
            self.prefetch_hits_sync_groups,
        )
        reduced = packed.tolist()
        operation.query_pool_hit_pages = {
            pool: pages
            for pool, pages in zip(pools, reduced[len(hits) :], strict=True)
            if pages != _NO_POOL_VERDICT
        }
        if len(hits) == 1:
            return int(reduced[0])
        restorable = reduced[: len(hits)]
        return max(i for i, ok in enumerate(restorable) if ok) * self.page_size

    def _move_pool_indices(
        self, host_pool, host_indices, device_indices, *, write_back_jit: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if uses_shared_host_layout(host_pool):
            return host_indices, device_indices
        if write_back_jit and host_pool.can_use_write_back_jit:
            if host_indices.is_cuda:
                host_indices = host_indices.cpu()
            return host_indices, device_indices
        return self.move_indices(host_indices, device_indices)

    def move_hybrid_indices(
        self, operation: CacheOperation, *, write_back_jit: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[list[PoolTransfer]]]:
        if self.is_kv_sharded:
            return self._move_kv_shard_indices(operation, write_back_jit=write_back_jit)
        host_indices, device_indices = self._move_pool_indices(
            self.mem_pool_host.anchor_entry.host_pool,
            operation.host_indices,
            operation.device_indices,
            write_back_jit=write_back_jit,
        )
        resolved_pool_transfers = None
        if operation.pool_transfers:
            resolved_pool_transfers = []
            for transfer in operation.pool_transfers:
                transfer_host_indices, transfer_device_indices = (
                    self._move_pool_indices(
                        self.mem_pool_host.entry_map[transfer.name].host_pool,
                        transfer.host_indices,
                        transfer.device_indices,
                        write_back_jit=write_back_jit,
                    )
                )
                # Tree-owned transfers keep their original radix-tree indices.
                resolved_pool_transfers.append(
                    replace(
                        transfer,
                        host_indices=transfer_host_indices,
                        device_indices=transfer_device_indices,
                    )
                )
        return host_indices, device_indices, resolved_pool_transfers

    def _move_kv_shard_indices(
        self, operation: CacheOperation, *, write_back_jit: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[list[PoolTransfer]]]:
        """Prepare owner-local indices without changing tree/queue-owned state."""
        anchor = self.mem_pool_host.anchor_entry.host_pool
        local_indices = {}

        def prepare(host_pool, host, device):
            # KV-derived indexers use the anchor's ownership, even though their
            # native host pools do not carry a placement of their own.
            key = (id(host), id(device))
            if key not in local_indices:
                local_indices[key] = anchor.owned_rows(host, device)
            host, device = local_indices[key]
            if host.numel() == 0:
                return host, device
            return self._move_pool_indices(
                host_pool, host, device, write_back_jit=write_back_jit
            )

        host_indices, device_indices = prepare(
            anchor, operation.host_indices, operation.device_indices
        )
        resolved_pool_transfers = None
        if operation.pool_transfers:
            resolved_pool_transfers = []
            for transfer in operation.pool_transfers:
                if transfer.host_indices is None or transfer.device_indices is None:
                    raise ValueError(f"Unresolved L2 transfer for {transfer.name}.")
                host, device = prepare(
                    self.mem_pool_host.entry_map[transfer.name].host_pool,
                    transfer.host_indices,
                    transfer.device_indices,
                )
                if host.numel() == 0:
                    continue
                resolved_pool_transfers.append(
                    replace(transfer, host_indices=host, device_indices=device)
                )
        # An empty owner still submits an empty operation and publishes its ACK.
        return host_indices, device_indices, resolved_pool_transfers

    def _page_transfer(self, operation: PrefetchOperation) -> bool:
        with self.mem_pool_host.layout_lease():
            return self._page_transfer_with_stable_layout(operation)

    def _page_transfer_with_stable_layout(self, operation: PrefetchOperation) -> None:
        # KV pools and KV-derived pools first — determines actual completed page count
        kv_completed_pages = super()._page_transfer(operation)

        # Read non-KV derived sidecar pool, e.g. SWA, Mamba.
        self._page_transfer_sidecar(operation, kv_completed_pages)

    def _page_transfer_sidecar(
        self, operation: PrefetchOperation, kv_completed_pages: int
    ) -> None:
        if operation.pool_transfers is None:
            return

        # Extra pools only after KV fully completes. If KV terminated early
        # (IO failure, timeout, TP mismatch), skip extra IO entirely to avoid
        # data misalignment.
        pool_hits: dict[str, int] = {}
        if not operation.is_terminated() and kv_completed_pages == len(
            operation.hash_value
        ):
            # KV-derived sidecar pools are handled in CacheController._page_transfer_kv_batch.
            # Only handle non-KV-derived sidecar pools here.
            transfers_nonkv = [
                transfer
                for transfer in operation.pool_transfers
                if transfer.indices_from_pool != PoolName.KV
            ]
            sidecar_hashes = operation.sidecar_hash_values or operation.hash_value
            sidecar_hit_pages = (
                operation.sidecar_hit_pages
                if operation.sidecar_hash_values is not None
                else kv_completed_pages
            )
            self._sync_trailing_keys(transfers_nonkv, sidecar_hashes, sidecar_hit_pages)
            self._resolve_sidecar_nonkv_derived_pool_transfers(operation)
            try:
                results = {}
                for extra_info, transfers in _trailing_chain_groups(
                    operation.prefix_keys,
                    sidecar_hashes,
                    transfers_nonkv,
                ):
                    results.update(
                        self.storage_backend.batch_get_v2(
                            transfers, extra_info=extra_info
                        )
                    )
                pool_hits = count_pool_hits(results)
            except Exception:
                logger.exception(
                    "HiCache sidecar prefetch failed for request %s",
                    operation.request_id,
                )
        # Emit PrefetchAck to prefetch_sync_queue, even the operation has been canceled by the
        # scheduler thread.  The prefetch sync thread expects the same number of PrefetchAck objects
        # to perform all_reduce.
        self.prefetch_sync_queue.put(
            PrefetchAck(
                rid=operation.request_id,
                operation=operation,
                pool_hits=pool_hits,
            )
        )
        return

    def trim_prefetch_full_head(self, operation, trim_tokens: int) -> None:
        """Drop a device-resident FULL head after the availability query;
        trailing sidecars keep the untrimmed hit endpoint."""
        if trim_tokens <= 0:
            return
        assert trim_tokens % self.page_size == 0
        trim_pages = trim_tokens // self.page_size
        original_hashes = list(operation.hash_value)
        assert trim_pages <= len(original_hashes)
        if operation.sidecar_hash_values is None:
            operation.sidecar_hash_values = original_hashes
            operation.sidecar_hit_pages = len(original_hashes)
        operation.hash_value = original_hashes[trim_pages:]
        operation.prefetch_kv_page_offset += trim_pages
        operation.storage_hit_count -= trim_tokens
        operation.storage_start += trim_tokens

    def _page_backup(self, operation):
        with self.mem_pool_host.layout_lease():
            return self._page_backup_with_stable_layout(operation)

    def _page_backup_with_stable_layout(self, operation):
        # Write primary KV only on its selected shard writer. Rank-sharded
        # sidecars can still need every TP rank.
        backup_transfers = [
            transfer
            for transfer in operation.pool_transfers or []
            if self.should_backup(transfer)
        ]

        if backup_transfers:
            self._resolve_sidecar_kv_derived_pool_transfers(operation)
            self._resolve_sidecar_nonkv_derived_pool_transfers(operation)
            results = {}
            for extra_info, transfers in _trailing_chain_groups(
                operation.prefix_keys, operation.hash_value, backup_transfers
            ):
                results.update(
                    self.storage_backend.batch_set_v2(transfers, extra_info=extra_info)
                )
            pool_hits = count_pool_hits(results)
            operation.pool_storage_result.update_extra_pool_hit_pages(pool_hits)

        if not self.backup_skip:
            super()._page_backup(operation)
        else:
            sidecar_ok = bool(backup_transfers)
            if sidecar_ok:
                for transfer in backup_transfers:
                    result = results.get(transfer.name)
                    if result is None:
                        result = results.get(transfer.name.value)
                    expected = len(transfer.keys or [])
                    if expected == 0 and transfer.host_indices is not None:
                        expected = int(transfer.host_indices.numel())
                    if (
                        not isinstance(result, (list, tuple))
                        or len(result) != expected
                        or not all(bool(ok) for ok in result)
                    ):
                        sidecar_ok = False
                        break
            operation.completed_tokens = (
                len(operation.hash_value) * self.page_size if sidecar_ok else 0
            )

    def should_backup(self, transfer: PoolTransfer) -> bool:
        if not self.backup_skip:
            return True

        # Kimi-K3 Mamba/KDA state is TP-sharded even when the primary MLA KV
        # pool is replicated.
        if transfer.name == PoolName.MAMBA:
            return True

        # Mooncake gives MHA draft and draft-SWA objects rank-specific keys.
        # MLA/DeepSeek-V4 draft pools remain TP0-only.
        if self.storage_backend_type == "mooncake" and transfer.name in (
            PoolName.DRAFT,
            PoolName.DRAFT_SWA,
        ):
            entry = self.mem_pool_host.entry_map.get(transfer.name)
            return entry is not None and isinstance(
                entry.host_pool, MHATokenToKVPoolHost
            )

        return False

    def backup_thread_func(self):
        """Back up rank-sharded sidecars on every TP rank.

        The base implementation skips the entire operation on non-zero MLA TP
        ranks. That optimization is valid for replicated MLA KV, but not for
        hybrid rank-sharded pools such as Kimi-K3 Mamba state.
        """
        while not self.storage_stop_event.is_set():
            try:
                operation = self.backup_queue.get(block=True, timeout=1)
                if operation is None:
                    continue
                self._page_backup_or_log(operation)
                self.ack_backup_queue.put(operation)
            except Empty:
                continue

    def _resolve_sidecar_kv_derived_pool_transfers(self, operation):
        for transfer in operation.pool_transfers:
            if transfer.indices_from_pool == PoolName.KV:
                transfer.host_indices = operation.host_indices
                transfer.keys = operation.hash_value

    def _resolve_sidecar_nonkv_derived_pool_transfers(self, operation):
        for transfer in operation.pool_transfers:
            if transfer.indices_from_pool is None:
                continue
            if transfer.indices_from_pool != PoolName.KV:
                source = next(
                    (
                        t
                        for t in operation.pool_transfers
                        if t.indices_from_pool is None
                        and t.name == transfer.indices_from_pool
                    ),
                    None,
                )
                if source is None:
                    raise AssertionError(
                        "Storage sidecar derived pool source missing: "
                        f"{transfer.name} from {transfer.indices_from_pool}."
                    )
                transfer.host_indices = source.host_indices
                if transfer.keys is None:
                    transfer.keys = source.keys
            else:
                pass

    def _sync_trailing_keys(
        self,
        pool_transfers: list[PoolTransfer],
        all_hashes: list[str],
        kv_hit_pages: int,
    ) -> None:
        """Re-align trailing-page sidecar keys after KV hit truncation.

        When the storage hit is shorter than the original target prefix, each
        pool transfer's keys must be updated to the last N hashes of the actual
        hit range instead of the last N hashes of the original target range.
        For mamba (N=1) this is just the last hit page hash; for SWA (N>1) it
        is a sliding window of the last N hit pages.
        """
        for transfer in pool_transfers:
            if transfer.hit_policy != PoolHitPolicy.TRAILING_PAGES:
                continue
            trailing_n = len(transfer.keys) if transfer.keys else 1
            transfer.keys = all_hashes[max(0, kv_hit_pages - trailing_n) : kv_hit_pages]
            if transfer.host_indices is None or transfer.indices_from_pool is not None:
                continue
            entry = self.mem_pool_host.entry_map.get(transfer.name)
            pool_page_size = (
                entry.host_pool.page_size if entry is not None else self.page_size
            )
            needed = len(transfer.keys) * pool_page_size
            if transfer.host_indices.numel() > needed:
                # The hit undershot the pre-allocated window buffer. Backends
                # fetch keys zipped against the buffer head, so shrink the
                # transfer to match and release the tail now — otherwise the
                # length mismatch makes batch_get_v2 fetch nothing and the
                # whole window is silently lost downstream.
                self.append_host_mem_release(
                    extra_pools=[
                        PoolTransfer(
                            name=transfer.name,
                            host_indices=transfer.host_indices[needed:],
                        )
                    ]
                )
                transfer.host_indices = transfer.host_indices[:needed]

    def _resolve_device_transfers(
        self,
        extra_pools: Optional[list[PoolTransfer]],
        kv_device_indices: Optional[torch.Tensor] = None,
        kv_host_indices: Optional[torch.Tensor] = None,
    ) -> Optional[list[PoolTransfer]]:
        """Allocate unresolved side-pool device indices atomically."""
        if not extra_pools:
            return None
        newly_allocated: list[tuple[PoolTransfer, Callable, torch.Tensor]] = []
        derived_transfers: list[PoolTransfer] = []

        def rollback_allocated() -> None:
            for prev_pool, prev_free_fn, prev_indices in reversed(newly_allocated):
                prev_free_fn(prev_indices)
                prev_pool.device_indices = None

        for pool in extra_pools:
            if pool.indices_from_pool is not None:
                derived_transfers.append(pool)
                continue
            entry = self.mem_pool_host.entry_map.get(pool.name)
            if entry is None:
                continue
            if pool.device_indices is not None or pool.host_indices is None:
                continue
            # device_alloc_fn / device_free_fn override entry.device_pool's
            # methods for pools whose device_pool is a raw KV pool (layout)
            # rather than an allocator (e.g. SWA).
            alloc_fn = entry.device_alloc_fn or entry.device_pool.alloc
            free_fn = entry.device_free_fn or entry.device_pool.free
            evict_fn = entry.device_evict_fn
            size = len(pool.host_indices)
            indices = alloc_fn(size)
            if indices is None and evict_fn:
                evict_fn(size)
                indices = alloc_fn(size)
            if indices is None:
                # Atomic rollback: free everything we successfully allocated.
                rollback_allocated()
                return None
            pool.device_indices = indices
            newly_allocated.append((pool, free_fn, indices))

        # Assign indices to deferred pools from their source.
        for pool in derived_transfers:
            if pool.indices_from_pool == PoolName.KV:
                pool.host_indices = kv_host_indices
                if pool.device_indices is None:
                    pool.device_indices = kv_device_indices
                continue

            source = next(
                (
                    transfer
                    for transfer in extra_pools
                    if transfer.indices_from_pool is None
                    and transfer.name == pool.indices_from_pool
                ),
                None,
            )
            if source is None:
                rollback_allocated()
                return None
            pool.host_indices = source.host_indices
            if pool.device_indices is None:
                pool.device_indices = source.device_indices
        return extra_pools

    def _reduce_prefetch_ack(self, ack: PrefetchAck) -> None:
        # Handle KV-derived pool.
        super()._reduce_prefetch_ack(ack)

        # Handle other sidecar pools, e.g. SWA, Mamba.
        if ack.pool_hits is not None:
            # "for ... in PoolName" ensures the same order across all ranks.
            # On prefetch failure, pool_hits may be empty dict.
            packed = torch.tensor(
                [ack.pool_hits.get(pool.value, 0) for pool in PoolName],
                dtype=torch.int,
            )
            self._all_reduce(
                packed,
                torch.distributed.ReduceOp.MIN,
                self.prefetch_completion_sync_groups,
            )
            for i, pool in enumerate(PoolName):
                ack.pool_hits[pool.value] = packed[i].item()

    def prefetch_sync_thread_func(self) -> None:
        """Synchronize progressive ACKs and publish PP ticket completion."""
        while not self.storage_stop_event.is_set():
            try:
                ack = self.prefetch_sync_queue.get(block=True, timeout=1)
                if ack is None:
                    continue
                self._reduce_prefetch_ack(ack)
                if not getattr(ack.operation, "is_pp_broadcast", False):
                    self.ack_prefetch_queue.put(ack)
                    continue

                operation = ack.operation
                if ack.completed_tokens is not None:
                    operation.completed_tokens = ack.completed_tokens
                if ack.pool_hits is not None:
                    operation.pool_storage_result.update_extra_pool_hit_pages(
                        ack.pool_hits
                    )
                    operation.pool_transfers_done = True
                if not ack.completed_req:
                    continue

                with self.pp_prefetch_state_lock:
                    state = self.pp_prefetch_states.get(operation.request_id)
                    if state is None:
                        continue
                    operation.hash_value = operation.hash_value[
                        : operation.completed_tokens // self.page_size
                    ]
                    operation.storage_hit_count = operation.completed_tokens
                    state.ready_event.set()
                    if state.release_requested:
                        self._free_pp_prefetch_state(state)
                        self.pp_prefetch_states.pop(operation.request_id, None)
            except Empty:
                continue
