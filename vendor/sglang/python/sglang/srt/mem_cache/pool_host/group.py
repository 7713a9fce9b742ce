from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import HostKVCache, shared_host_layout_domains


@dataclass
class PoolEntry:
    name: PoolName
    host_pool: Any
    device_pool: Any
    layer_mapper: Callable[[int], int | None]
    is_primary_index_anchor: bool = False
    # Reclaim callbacks receive the absolute allocation size n. The host
    # callback evicts n slots; the device callback makes alloc(n) feasible.
    host_evict_fn: Callable[[int], Any] | None = None
    device_evict_fn: Callable[[int], Any] | None = None
    device_alloc_fn: Callable[[int], Any] | None = None
    device_free_fn: Callable[[Any], Any] | None = None
    packed_draft_device_pools: tuple[Any, ...] = ()


class HostPoolGroup:
    """Allocation facade for an anchor host pool and its side pools."""

    def __init__(self, entries: list[PoolEntry]):
        if not entries:
            raise ValueError("HostPoolGroup requires at least one pool entry.")
        if len({entry.name for entry in entries}) != len(entries):
            raise ValueError("HostPoolGroup pool names must be unique.")

        anchors = [entry for entry in entries if entry.is_primary_index_anchor]
        if len(anchors) > 1:
            raise ValueError("HostPoolGroup requires at most one anchor pool.")

        self.entries = list(entries)
        self.entry_map = {entry.name: entry for entry in entries}
        self.anchor_entry = anchors[0] if anchors else entries[0]

        self.layout = self.anchor_entry.host_pool.layout
        self.page_size = self.anchor_entry.host_pool.page_size
        self.device = self.anchor_entry.host_pool.device
        self.size = self.anchor_entry.host_pool.size
        self.logical_size = self.anchor_entry.host_pool.logical_size
        self._refresh_transfer_capabilities()

    def _refresh_transfer_capabilities(self) -> None:
        child_write_back_jit = [
            entry.host_pool.can_use_write_back_jit for entry in self.entries
        ]
        self.can_use_write_back_jit = all(child_write_back_jit)
        self.supports_per_pool_backup_indices = any(child_write_back_jit)

    def add_entry(self, entry: PoolEntry) -> None:
        if entry.name in self.entry_map:
            raise ValueError(f"Host pool {entry.name} is already registered.")
        if entry.is_primary_index_anchor:
            raise ValueError("Cannot replace the anchor of an existing HostPoolGroup.")
        self.entries.append(entry)
        self.entry_map[entry.name] = entry
        self._refresh_transfer_capabilities()

    def get_entry(self, name: PoolName | None = None) -> PoolEntry:
        return self.anchor_entry if name is None else self.entry_map[name]

    def get_pool(self, name: PoolName):
        return self.get_entry(name).host_pool

    @contextmanager
    def layout_lease(self):
        domains = shared_host_layout_domains(entry.host_pool for entry in self.entries)
        for domain in domains:
            domain.acquire_layout()
        try:
            yield
        finally:
            for domain in reversed(domains):
                domain.release_layout()

    def get_page_buffer_element_size(self, split_factor: int = 1):
        anchor_pool = self.anchor_entry.host_pool
        if (
            not isinstance(anchor_pool, HostKVCache)
            or anchor_pool.shared_allocation_domain is None
        ):
            return anchor_pool.get_page_buffer_element_size(split_factor)

        element_sizes = set()
        for entry in self.entries:
            element_size = entry.host_pool.get_page_buffer_element_size(split_factor)
            if element_size is None:
                return None
            element_sizes.add(element_size)
        return element_sizes.pop() if len(element_sizes) == 1 else None

    def get_contiguous_buf_infos(self, pool_names: set[PoolName] | None = None):
        """Return (device_buffers, host_buffers), each (ptrs, sizes, item_sizes)."""
        host_by_device_ptr = {}
        device_infos = ([], [], [])
        for entry in self.entries:
            if pool_names is not None and entry.name not in pool_names:
                continue
            host = entry.host_pool
            pools = (entry.device_pool, *entry.packed_draft_device_pools)
            for pool in pools:
                dense_mha = (
                    isinstance(pool, MHATokenToKVPool)
                    and pool.kv_cache_layout == "nhd"
                    and pool.v_head_dim == pool.head_dim
                )
                if (
                    not dense_mha
                    or pool.layer_shard_enabled
                    or pool.page_size != self.page_size
                ):
                    raise ValueError(
                        "Host receive requires dense NHD MHA target and "
                        "draft KV with matching page sizes"
                    )
                buffers = pool.k_buffer + pool.v_buffer
                infos = pool.get_contiguous_buf_infos()
                expected = (
                    [buffer.data_ptr() for buffer in buffers],
                    [buffer.nbytes for buffer in buffers],
                    [buffer[0].nbytes * self.page_size for buffer in buffers],
                )
                if infos != expected or any(
                    not buffer.is_contiguous() for buffer in buffers
                ):
                    raise ValueError(
                        "Host receive requires contiguous per-layer KV buffers "
                        "without embedded state"
                    )
                for combined, values in zip(device_infos, infos, strict=True):
                    combined.extend(values)

            # Packed MHA stores target/draft K followed by target/draft V,
            # while the wire lists target K/V followed by draft K/V. Associate
            # each host view with its device buffer before applying wire order.
            device_buffers = [b for p in pools for b in p.k_buffer] + [
                b for p in pools for b in p.v_buffer
            ]
            for device_buffer, host_buffer in zip(
                device_buffers, host.host_kv_data_refs, strict=True
            ):
                if (
                    not host_buffer.is_contiguous()
                    or host_buffer.shape[1:] != device_buffer.shape[1:]
                ):
                    raise ValueError(
                        "KV transfer requires matching contiguous per-layer "
                        "device and host buffers"
                    )
                host_by_device_ptr[device_buffer.data_ptr()] = (
                    host_buffer.data_ptr(),
                    host_buffer.nbytes,
                    host.token_stride_size * self.page_size,
                )
        infos = [host_by_device_ptr[ptr] for ptr in device_infos[0]]
        host_infos = (
            [info[0] for info in infos],
            [info[1] for info in infos],
            [info[2] for info in infos],
        )
        return device_infos, host_infos

    def alloc(
        self,
        need_size: int,
        *,
        pool: PoolName | None = None,
        reclaim: Callable[[int], Any] | None = None,
        start_owner: int | None = None,
    ) -> torch.Tensor | None:
        """Allocate from one pool, optionally reclaiming once before retrying."""
        host_pool = self.get_entry(pool).host_pool
        # Only KV-sharded host pools take start_owner.
        kwargs = {} if start_owner is None else {"start_owner": start_owner}
        indices = host_pool.alloc(need_size, **kwargs)
        if indices is None and reclaim is not None:
            reclaim(need_size)
            indices = host_pool.alloc(need_size, **kwargs)
        return indices

    def free(self, indices: torch.Tensor, *, pool: PoolName | None = None) -> int:
        return self.get_entry(pool).host_pool.free(indices)

    def resolve_host_transfers(
        self,
        transfers: list[PoolTransfer] | None,
        *,
        primary_device_indices: torch.Tensor | None = None,
        primary_host_indices: torch.Tensor | None = None,
    ) -> list[PoolTransfer] | None:
        """Allocate unresolved side-pool host indices atomically.

        On failure, every allocation made by this call is released and the
        corresponding transfer is restored to its unresolved state.
        """
        if not transfers:
            return None

        allocated: list[tuple[PoolTransfer, torch.Tensor]] = []
        derived_transfers: list[PoolTransfer] = []

        def rollback() -> None:
            for transfer, indices in allocated:
                self.free(indices, pool=transfer.name)
                transfer.host_indices = None

        # Reclaiming one pool can evict another's slots. Keep allocation order
        # identical across TP ranks even when transfers come from a Rust HashMap.
        for transfer in sorted(transfers, key=lambda transfer: transfer.name):
            if transfer.indices_from_pool is not None:
                derived_transfers.append(transfer)
                continue
            if transfer.host_indices is not None or transfer.device_indices is None:
                continue
            entry = self.entry_map.get(transfer.name)
            if entry is None:
                continue
            indices = self.alloc(
                len(transfer.device_indices),
                pool=transfer.name,
                reclaim=entry.host_evict_fn,
            )
            if indices is None:
                rollback()
                return None
            transfer.host_indices = indices
            allocated.append((transfer, indices))

        for transfer in derived_transfers:
            if transfer.indices_from_pool == self.anchor_entry.name:
                transfer.host_indices = primary_host_indices
                if transfer.device_indices is None:
                    transfer.device_indices = primary_device_indices
                continue

            source = next(
                (
                    candidate
                    for candidate in transfers
                    if candidate.indices_from_pool is None
                    and candidate.name == transfer.indices_from_pool
                ),
                None,
            )
            if source is None:
                rollback()
                return None
            transfer.host_indices = source.host_indices
            if transfer.device_indices is None:
                transfer.device_indices = source.device_indices
        return transfers

    def release_transfers(self, transfers: list[PoolTransfer] | None) -> int:
        """Release independently allocated side-pool indices.

        Derived transfers share another pool's indices and are deliberately
        skipped so each allocation is released exactly once.
        """
        released = 0
        for transfer in transfers or []:
            if transfer.indices_from_pool is not None or transfer.host_indices is None:
                continue
            released += self.free(transfer.host_indices, pool=transfer.name)
        return released

    @property
    def kv_buffer(self):
        return self.anchor_entry.host_pool.kv_buffer

    @property
    def v_buffer(self):
        return getattr(self.anchor_entry.host_pool, "v_buffer", None)

    @property
    def index_k_buffer(self):
        return getattr(self.anchor_entry.host_pool, "index_k_buffer", None)

    @property
    def index_k_scale_buffer(self):
        # Delegate to the anchor pool so NpuMemcacheStore sees the same
        # buffer set as get_page_buffer_meta (which also delegates), keeping
        # the per-page component-key count consistent (k, v, index_k, scale).
        return getattr(self.anchor_entry.host_pool, "index_k_scale_buffer", None)

    @property
    def dsa_kv_cache_store_fp8(self):
        # Delegate so the L3 store skips the dead v component exactly when
        # get_page_buffer_meta (which also delegates) skips it.
        return getattr(self.anchor_entry.host_pool, "dsa_kv_cache_store_fp8", False)

    @property
    def size_per_token(self):
        return self.anchor_entry.host_pool.size_per_token

    @property
    def stores_page_envelope(self) -> bool:
        return self.anchor_entry.host_pool.stores_page_envelope

    def clear(self) -> None:
        for entry in self.entries:
            entry.host_pool.clear()

    def destroy(self) -> None:
        for entry in self.entries:
            entry.host_pool.destroy()

    def available_size(self, pool: PoolName | None = None):
        return self.get_entry(pool).host_pool.available_size()
