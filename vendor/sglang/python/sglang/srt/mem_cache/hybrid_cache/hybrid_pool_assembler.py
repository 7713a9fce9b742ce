from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolName,
    SidecarPoolSpec,
)
from sglang.srt.mem_cache.hybrid_cache.host_pool_config import (
    HostPoolGroupConfig,
    check_packed_kv_rows,
    is_mla_pool,
    prepare_host_pool_config,
    with_packed_draft_layer_mapping,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
)
from sglang.srt.mem_cache.memory_pool_host import (
    DeepSeekV4PagedHostPool,
    DeepSeekV4StateHostPool,
    LogicalHostPool,
)
from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin
from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.common import get_allocator_type
from sglang.srt.mem_cache.pool_host.host_pool_decl import HostPoolDecl
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import (
    MHATokenToKOnlyPoolHost,
    get_mha_host_pool_cls,
)
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.page_interleave import (
    PageInterleaveHostPool,
)
from sglang.srt.mem_cache.pool_host.qsa import QSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.unified import UnifiedPageEnvelopeHostPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.runtime_context import get_memory, get_parallel, get_serving
from sglang.srt.utils import is_npu

if TYPE_CHECKING:
    import torch

    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.device_pool_info import DevicePoolInfo
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def _get_allocator_type() -> str:
    return get_allocator_type()


def _evict_swa_for_device_alloc(cache: UnifiedRadixCache, required_size: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    available_size = cache.token_to_kv_pool_allocator.swa_available_size()
    shortfall = max(0, required_size - available_size)
    if shortfall > 0:
        cache.evict_for_alloc(EvictParams(swa_num_tokens=shortfall))


def _evict_mamba_for_device_alloc(cache: UnifiedRadixCache, required_size: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    available_size = (
        cache.req_to_token_pool.mamba_allocator.schedulable_available_size()
    )
    shortfall = max(0, required_size - available_size)
    if shortfall > 0:
        cache.evict_for_alloc(EvictParams(mamba_num=shortfall))


def _make_layer_mapper(
    layer_mapping: dict[int, int],
    transfer_layer_id_max: int,
) -> Callable[[int], Optional[int]]:
    # The exclusive transfer-ID bound includes holes for uncached layers;
    # each pool skips IDs absent from its mapping.
    def mapper(layer_id: int) -> Optional[int]:
        if not 0 <= layer_id < transfer_layer_id_max:
            return None
        return layer_mapping.get(layer_id)

    return mapper


def _stage_local_layer_mapping(
    layer_mapping: dict[int, int], start_layer: int
) -> dict[int, int]:
    return {
        global_layer - start_layer: pool_layer
        for global_layer, pool_layer in layer_mapping.items()
    }


class _DeepSeekV4LayerMappings(NamedTuple):
    transfer_layer_id_max: int
    full: dict[int, int]
    swa: dict[int, int]
    c4: dict[int, int]
    c128: dict[int, int]
    c4_state: dict[int, int]
    c4_state_global_layers: list[int]


def _resolve_deepseek_v4_layer_mappings(
    kvcache: Any,
) -> _DeepSeekV4LayerMappings:
    transfer_layer_id_max = kvcache.end_layer - kvcache.start_layer
    full = {layer: layer for layer in range(transfer_layer_id_max)}
    swa = full.copy() if kvcache.swa_kv_pool is not None else {}

    c4, c128, c4_state_global_layers = {}, {}, []
    for local_layer, item in enumerate(
        kvcache.layer_mapping[kvcache.start_layer : kvcache.end_layer]
    ):
        if item.compress_ratio == 4:
            c4[local_layer] = item.compress_layer_id
            c4_state_global_layers.append(kvcache.start_layer + local_layer)
        elif item.compress_ratio == 128:
            c128[local_layer] = item.compress_layer_id

    return _DeepSeekV4LayerMappings(
        transfer_layer_id_max=transfer_layer_id_max,
        full=full,
        swa=swa,
        c4=c4,
        c128=c128,
        c4_state={layer: index for index, layer in enumerate(c4)},
        c4_state_global_layers=c4_state_global_layers,
    )


def _mha_host_inputs(pool, drafts=()):
    info = pool.get_device_pool_infos()[0].buffer_info
    return (
        get_mha_host_pool_cls(info),
        info,
        dict(
            device_capacity_tokens=(
                pool.size
                if pool.host_capacity_tokens is None
                else pool.host_capacity_tokens
            ),
            start_layer=pool.start_layer,
            end_layer=pool.end_layer,
            draft_buffer_infos=tuple(
                draft.get_device_pool_infos()[0].buffer_info for draft in drafts
            ),
            write_back_staging=pool.hicache_write_back_staging,
        ),
    )


def build_kv_host_pool(
    *,
    kv_pool: Any,
    page_size: int,
    use_mla: Optional[bool] = None,
    override_kv_cache_dim: Optional[int] = None,
    host_size: Optional[float] = None,
    mtp_draft_device_pools: tuple[Any, ...] = (),
    pool_label: str = "kv",
):
    if use_mla is None:
        use_mla = is_mla_pool(kv_pool)
    if use_mla:
        kv_host_pool_cls = MLATokenToKVPoolHost
        host_input = kv_pool.get_device_pool_infos()[0].buffer_info
        mha_kwargs = {}
    else:
        kv_host_pool_cls, host_input, mha_kwargs = _mha_host_inputs(
            kv_pool, mtp_draft_device_pools
        )
    if use_mla and override_kv_cache_dim is None:
        # An fp8 DSA store is wider than kv_lora_rank + qk_rope_head_dim. The
        # device pool already resolved the row width.
        override_kv_cache_dim = kv_pool.kv_cache_dim
    if use_mla or is_npu():
        check_packed_kv_rows(
            kv_pool=kv_pool, drafts=mtp_draft_device_pools, use_mla=use_mla
        )
    kwargs = {}
    if override_kv_cache_dim is not None:
        kwargs["override_kv_cache_dim"] = override_kv_cache_dim
    if use_mla:
        kwargs.update(
            device_capacity_tokens=kv_pool.size
            if kv_pool.host_capacity_tokens is None
            else kv_pool.host_capacity_tokens,
            start_layer=kv_pool.start_layer,
            end_layer=kv_pool.end_layer,
            draft_buffer_infos=tuple(
                pool.get_device_pool_infos()[0].buffer_info
                for pool in mtp_draft_device_pools
            ),
            layer_shard_enabled=kv_pool.layer_shard_enabled,
            target_layer_num=(
                (kv_pool.layer_num + kv_pool.layer_shard_size - 1)
                // kv_pool.layer_shard_size
                if kv_pool.layer_shard_enabled
                else kv_pool.layer_num
            ),
        )
    else:
        kwargs.update(mha_kwargs)
    parallel = get_parallel()
    if parallel.dcp_enabled:
        assert use_mla, (
            "HiCache + DCP is only wired for the MLA host pool; the MHA host "
            "pool has no DCP index translation."
        )
        kwargs["dcp_size"] = parallel.attn_dcp_size
        kwargs["dcp_rank"] = parallel.attn_dcp_rank
    host_pool = kv_host_pool_cls(
        host_input,
        get_memory().hicache_ratio,
        get_memory().hicache_size if host_size is None else host_size,
        page_size,
        get_memory().hicache_mem_layout,
        allocator_type=_get_allocator_type(),
        pool_label=pool_label,
        **kwargs,
    )
    if isinstance(kv_pool, PageInterleaveKVPoolMixin):
        return PageInterleaveHostPool(host_pool, kv_pool.placement)
    return host_pool


def _split_hicache_size(
    hicache_size: int, kv_pools: tuple[Any, ...]
) -> tuple[float, ...]:
    device_pool_sizes = []
    for kv_pool in kv_pools:
        size_bytes = getattr(kv_pool, "host_capacity_bytes", None)
        if size_bytes is None:
            size_bytes = kv_pool.get_kv_size_bytes()
        device_pool_sizes.append(
            sum(size_bytes) if isinstance(size_bytes, tuple) else size_bytes
        )
    total_device_pool_size = sum(device_pool_sizes)
    return tuple(
        hicache_size * size_bytes / total_device_pool_size
        for size_bytes in device_pool_sizes
    )


def build_pool_entry(
    *,
    name: PoolName,
    host_pool: Any,
    device_pool: Any,
    layer_mapping: dict[int, int],
    transfer_layer_id_max: int,
    is_anchor: bool = False,
    host_evict_fn: Optional[Callable[[int], Any]] = None,
    device_evict_fn: Optional[Callable[[int], Any]] = None,
    device_alloc_fn: Optional[Callable[[int], Any]] = None,
    device_free_fn: Optional[Callable[[Any], Any]] = None,
    packed_draft_device_pools: tuple[Any, ...] = (),
) -> PoolEntry:
    return PoolEntry(
        name=name,
        host_pool=host_pool,
        device_pool=device_pool,
        layer_mapper=_make_layer_mapper(layer_mapping, transfer_layer_id_max),
        is_primary_index_anchor=is_anchor,
        host_evict_fn=host_evict_fn,
        device_evict_fn=device_evict_fn,
        device_alloc_fn=device_alloc_fn,
        device_free_fn=device_free_fn,
        packed_draft_device_pools=packed_draft_device_pools,
    )


def build_kv_only_group(
    *,
    page_size: int,
    kv_pool: Any,
    full_layer_mapping: dict[int, int],
    use_mla: bool,
    override_kv_cache_dim: Optional[int] = None,
    host_size: Optional[float] = None,
    mtp_draft_device_pools: tuple[Any, ...] = (),
) -> HostPoolGroup:
    """Anchor-only host pool group for a flat MHA/MLA device pool."""
    transfer_layer_id_max = len(full_layer_mapping)
    kv_host_pool = build_kv_host_pool(
        kv_pool=kv_pool,
        page_size=page_size,
        use_mla=use_mla,
        override_kv_cache_dim=override_kv_cache_dim,
        host_size=host_size,
        mtp_draft_device_pools=mtp_draft_device_pools,
    )
    if mtp_draft_device_pools:
        full_layer_mapping = with_packed_draft_layer_mapping(
            full_layer_mapping,
            transfer_layer_start=transfer_layer_id_max,
            target_device_layer_num=kv_pool.layer_num,
            draft_layer_num=len(mtp_draft_device_pools),
        )
    return HostPoolGroup(
        [
            build_pool_entry(
                name=PoolName.KV,
                host_pool=kv_host_pool,
                device_pool=kv_pool,
                layer_mapping=full_layer_mapping,
                transfer_layer_id_max=transfer_layer_id_max
                + len(mtp_draft_device_pools),
                is_anchor=True,
                packed_draft_device_pools=mtp_draft_device_pools,
            )
        ]
    )


def _swa_allocation_callbacks(allocator) -> dict:
    """Keep allocation and rollback in the same ID space for every SWA stack."""
    from sglang.srt.mem_cache.allocator.unified_sub_pool import MultiEndedAllocator

    if isinstance(allocator, MultiEndedAllocator):
        # Unified SWA loads into physical reservations, bound before the H2D.
        return dict(
            device_alloc_fn=allocator.alloc_physical,
            device_free_fn=allocator.cancel_physical_reservation,
        )
    if allocator is None:
        return {}
    return dict(device_alloc_fn=allocator.alloc, device_free_fn=allocator.free)


def _uses_unified_page_envelope_host(
    full_kv_pool: Any,
    swa_kv_pool: Any,
    use_mla: bool,
    mtp_device_pools: tuple[Any, ...] = (),
) -> bool:
    from sglang.srt.mem_cache.unified_memory_pool import UnifiedMHATokenToKVPool

    return (
        not use_mla
        and not mtp_device_pools
        and all(
            isinstance(pool, UnifiedMHATokenToKVPool)
            for pool in (full_kv_pool, swa_kv_pool)
        )
        and {full_kv_pool.grow_direction, swa_kv_pool.grow_direction} == {"up", "down"}
        and HybridCacheController.supports_page_envelope_host(
            get_memory().hicache_storage_backend
        )
    )


def build_hybrid_swa_group(
    *,
    page_size: int,
    full_kv_pool: Any,
    swa_kv_pool: Any,
    full_layer_mapping: dict[int, int],
    swa_layer_mapping: dict[int, int],
    use_mla: bool,
    kv_host_size: Optional[float] = None,
    swa_host_size: Optional[float] = None,
    host_full_evict_fn: Optional[Callable[[int], Any]] = None,
    host_swa_evict_fn: Optional[Callable[[int], Any]] = None,
    device_swa_evict_fn: Optional[Callable[[int], Any]] = None,
    swa_attn_allocator: Any = None,
    mtp_full_device_pools: tuple[Any, ...] = (),
    mtp_swa_device_pools: tuple[Any, ...] = (),
    mtp_swa_full_device_pools: tuple[Any, ...] = (),
    transfer_layer_id_max: Optional[int] = None,
) -> HostPoolGroup:
    """Anchor (full) + SWA host pool group for a hybrid-SWA device pool."""
    if transfer_layer_id_max is None:
        transfer_layer_id_max = (
            max(full_layer_mapping.keys() | swa_layer_mapping.keys()) + 1
        )
    if mtp_swa_full_device_pools and kv_host_size:
        # The sidecar has the anchor's token capacity. Reserve its bytes from
        # the full-KV budget rather than exceeding an explicit --hicache-size.
        anchor_pools = (full_kv_pool, *mtp_full_device_pools)
        shares = _split_hicache_size(
            kv_host_size, (*anchor_pools, *mtp_swa_full_device_pools)
        )
        kv_host_size = sum(shares[: len(anchor_pools)])
    if _uses_unified_page_envelope_host(
        full_kv_pool,
        swa_kv_pool,
        use_mla,
        mtp_full_device_pools + mtp_swa_device_pools + mtp_swa_full_device_pools,
    ):
        memory = get_memory()
        kv_host_pool, swa_host_pool = (
            UnifiedPageEnvelopeHostPool.build_hybrid_swa_pool_pair(
                device_pools=(full_kv_pool, swa_kv_pool),
                host_to_device_ratio=memory.hicache_ratio,
                host_size=memory.hicache_size,
                page_size=page_size,
                layout=memory.hicache_mem_layout,
                allocator_type=_get_allocator_type(),
                mtp_draft_device_pools=mtp_swa_device_pools,
            )
        )
        has_shared_arena = True
    else:
        has_shared_arena = False
        kv_host_pool = build_kv_host_pool(
            kv_pool=full_kv_pool,
            page_size=page_size,
            use_mla=use_mla,
            host_size=kv_host_size,
            mtp_draft_device_pools=mtp_full_device_pools,
            pool_label="full",
        )
        swa_host_pool = build_kv_host_pool(
            kv_pool=swa_kv_pool,
            page_size=page_size,
            use_mla=use_mla,
            host_size=swa_host_size,
            mtp_draft_device_pools=mtp_swa_device_pools,
            pool_label="swa",
        )
    if mtp_full_device_pools:
        full_layer_mapping = with_packed_draft_layer_mapping(
            full_layer_mapping,
            transfer_layer_start=transfer_layer_id_max,
            target_device_layer_num=full_kv_pool.layer_num,
            draft_layer_num=len(mtp_full_device_pools),
        )
    if mtp_swa_device_pools:
        swa_layer_mapping = with_packed_draft_layer_mapping(
            swa_layer_mapping,
            transfer_layer_start=transfer_layer_id_max,
            target_device_layer_num=swa_kv_pool.layer_num,
            draft_layer_num=len(mtp_swa_device_pools),
        )
    group = HostPoolGroup(
        [
            build_pool_entry(
                name=PoolName.KV,
                host_pool=kv_host_pool,
                device_pool=full_kv_pool,
                layer_mapping=full_layer_mapping,
                transfer_layer_id_max=transfer_layer_id_max
                + len(mtp_full_device_pools),
                is_anchor=True,
                host_evict_fn=host_full_evict_fn if has_shared_arena else None,
                packed_draft_device_pools=mtp_full_device_pools,
            ),
            build_pool_entry(
                name=PoolName.SWA,
                host_pool=swa_host_pool,
                device_pool=swa_kv_pool,
                layer_mapping=swa_layer_mapping,
                transfer_layer_id_max=transfer_layer_id_max + len(mtp_swa_device_pools),
                host_evict_fn=host_swa_evict_fn,
                device_evict_fn=device_swa_evict_fn,
                **_swa_allocation_callbacks(swa_attn_allocator),
                packed_draft_device_pools=mtp_swa_device_pools,
            ),
        ]
    )
    if mtp_swa_full_device_pools:
        # SWA drafts with full-token addressing may have different head geometry
        # from full attention. Use a separate host pool with KV indices instead of
        # packing their bytes into either target pool.
        first, *rest = mtp_swa_full_device_pools
        host_cls, host_input, host_kwargs = _mha_host_inputs(first, tuple(rest))
        draft_host_pool = host_cls(
            host_input,
            host_to_device_ratio=kv_host_pool.size / first.size,
            host_size=0,
            page_size=page_size,
            layout=get_memory().hicache_mem_layout,
            allocator_type=_get_allocator_type(),
            **host_kwargs,
            pool_label="draft_swa",
        )
        group.add_entry(
            build_pool_entry(
                name=PoolName.DRAFT_SWA,
                host_pool=draft_host_pool,
                device_pool=first,
                layer_mapping=with_packed_draft_layer_mapping(
                    {0: 0},
                    transfer_layer_start=transfer_layer_id_max,
                    target_device_layer_num=first.layer_num,
                    draft_layer_num=len(rest),
                ),
                transfer_layer_id_max=transfer_layer_id_max + len(rest),
                packed_draft_device_pools=tuple(rest),
            )
        )
    return group


def _mtp_swa_device_pools(
    params: CacheInitParams, *, full_indices: bool
) -> tuple[Any, ...]:
    return tuple(
        pool.swa_kv_pool
        for pool in params.mtp_draft_device_pools
        if pool.swa_kv_pool.layer_num and pool.swa_uses_full_indices == full_indices
    )


def _mtp_swa_sidecar_specs(group: HostPoolGroup) -> list[SidecarPoolSpec]:
    if PoolName.DRAFT_SWA not in group.entry_map:
        return []
    return [SidecarPoolSpec(PoolName.DRAFT_SWA, indices_from_pool=PoolName.KV)]


def build_kv_only_stack(
    *,
    params: CacheInitParams,
    kv_pool: Any,
    full_layer_mapping: dict[int, int],
    load_cache_event,
    storage_backend: Optional[str],
    use_mla: bool,
    override_kv_cache_dim: Optional[int] = None,
    prefetch_threshold: int = 256,
    model_name: Optional[str] = None,
    storage_backend_extra_config: Optional[dict] = None,
    enable_storage_metrics: bool = False,
) -> tuple[HostPoolGroup, HybridCacheController]:
    transfer_layer_id_max = len(full_layer_mapping)
    host_pool_group = build_kv_only_group(
        page_size=params.page_size,
        kv_pool=kv_pool,
        full_layer_mapping=full_layer_mapping,
        use_mla=use_mla,
        override_kv_cache_dim=override_kv_cache_dim,
        mtp_draft_device_pools=params.mtp_draft_device_pools,
    )
    cache_controller = HybridCacheController(
        params.token_to_kv_pool_allocator,
        host_pool_group,
        params.page_size,
        params.tp_cache_group,
        load_cache_event=load_cache_event,
        attn_cp_group=params.attn_cp_cache_group,
        attn_tp_group=params.attn_tp_cache_group,
        pp_group=params.pp_cache_group,
        write_policy=get_memory().hicache_write_policy,
        io_backend=get_memory().hicache_io_backend,
        storage_backend=storage_backend,
        prefetch_threshold=prefetch_threshold,
        model_name=model_name,
        storage_backend_extra_config=storage_backend_extra_config,
        transfer_layer_id_max=transfer_layer_id_max,
        enable_storage_metrics=enable_storage_metrics,
        host_memory_mode=get_memory().hicache_host_memory_mode,
    )
    return host_pool_group, cache_controller


def build_hybrid_swa_stack(
    *,
    params: CacheInitParams,
    full_kv_pool: Any,
    swa_kv_pool: Any,
    full_layer_mapping: dict[int, int],
    swa_layer_mapping: dict[int, int],
    load_cache_event,
    storage_backend: Optional[str],
    use_mla: bool,
    host_full_evict_fn: Optional[Callable[[int], Any]] = None,
    host_swa_evict_fn: Optional[Callable[[int], Any]] = None,
    device_swa_evict_fn: Optional[Callable[[int], Any]] = None,
    prefetch_threshold: int = 256,
    model_name: Optional[str] = None,
    storage_backend_extra_config: Optional[dict] = None,
    enable_storage_metrics: bool = False,
) -> tuple[HostPoolGroup, HybridCacheController]:
    transfer_layer_id_max = (
        max(full_layer_mapping.keys() | swa_layer_mapping.keys()) + 1
    )
    # Each draft depth may use full or sliding-window attention.
    mtp_full_device_pools = tuple(
        pool.full_kv_pool
        for pool in params.mtp_draft_device_pools
        if pool.full_kv_pool.layer_num
    )
    mtp_swa_device_pools = _mtp_swa_device_pools(params, full_indices=False)

    kv_host_size = swa_host_size = None
    memory = get_memory()
    if memory.hicache_size > 0 and not _uses_unified_page_envelope_host(
        full_kv_pool, swa_kv_pool, use_mla, params.mtp_draft_device_pools
    ):
        kv_host_size, swa_host_size = _split_hicache_size(
            memory.hicache_size, (full_kv_pool, swa_kv_pool)
        )

    host_pool_group = build_hybrid_swa_group(
        page_size=params.page_size,
        full_kv_pool=full_kv_pool,
        swa_kv_pool=swa_kv_pool,
        full_layer_mapping=full_layer_mapping,
        swa_layer_mapping=swa_layer_mapping,
        use_mla=use_mla,
        kv_host_size=kv_host_size,
        swa_host_size=swa_host_size,
        host_full_evict_fn=host_full_evict_fn,
        host_swa_evict_fn=host_swa_evict_fn,
        device_swa_evict_fn=device_swa_evict_fn,
        # For SWA hybrid, device allocation goes through the inner allocator.
        swa_attn_allocator=params.token_to_kv_pool_allocator.swa_attn_allocator,
        mtp_full_device_pools=mtp_full_device_pools,
        mtp_swa_device_pools=mtp_swa_device_pools,
        mtp_swa_full_device_pools=_mtp_swa_device_pools(params, full_indices=True),
    )
    cache_controller = HybridCacheController(
        params.token_to_kv_pool_allocator,
        host_pool_group,
        params.page_size,
        params.tp_cache_group,
        load_cache_event=load_cache_event,
        attn_cp_group=params.attn_cp_cache_group,
        attn_tp_group=params.attn_tp_cache_group,
        pp_group=params.pp_cache_group,
        write_policy=get_memory().hicache_write_policy,
        io_backend=get_memory().hicache_io_backend,
        storage_backend=storage_backend,
        prefetch_threshold=prefetch_threshold,
        model_name=model_name,
        storage_backend_extra_config=storage_backend_extra_config,
        transfer_layer_id_max=transfer_layer_id_max,
        enable_storage_metrics=enable_storage_metrics,
        host_memory_mode=get_memory().hicache_host_memory_mode,
    )
    return host_pool_group, cache_controller


def _deepseek_v4_num_host_pages(
    *,
    params: CacheInitParams,
    kvcache: Any,
    page_size: int,
    swa_page_size: int,
) -> tuple[int, int, int]:
    allocator = params.token_to_kv_pool_allocator
    device_full_size = getattr(allocator, "size_full", kvcache.size)
    device_full_pages = (device_full_size + page_size - 1) // page_size

    device_swa_pages = (kvcache.swa_size + swa_page_size - 1) // swa_page_size

    if get_memory().hicache_size > 0:
        raise ValueError(
            "DeepSeek V4 HiCache currently does not support --hicache-size; "
            "use --hicache-ratio instead."
        )
    ratio = get_memory().hicache_ratio
    full_host_pages = int(device_full_pages * ratio)
    swa_host_pages = int(device_swa_pages * ratio)

    # NPU sizes the independent C128 host pool from its device page count.
    # For example, host pages = device pages * hicache_ratio.
    # GPU keeps the FULL page count because C128 is a KV-derived sidecar.
    c128_host_pages = full_host_pages
    c128_attn_allocator = getattr(allocator, "c128_attn_allocator", None)
    if c128_attn_allocator is not None:
        c128_host_pages = int(c128_attn_allocator.num_pages * ratio)
    return full_host_pages, swa_host_pages, c128_host_pages


def _dsv4_compressed_region_buffers(kvcache: Any, ratio: int) -> tuple[list, int]:
    """
    Resolve ``(device_buffers, item_bytes)`` for a DeepSeek V4 C4/C128 main-KV
    HiCache pool, hiding the device KV layout from the stack builder.
    """
    if getattr(kvcache, "_unified_kv", False):
        return kvcache.unified_region_buffers(ratio)
    pool = kvcache.c4_kv_pool if ratio == 4 else kvcache.c128_kv_pool
    return pool.kv_buffer, pool.bytes_per_page_padded


def _require_single_row_dsv4_swa_pages(
    *, logical_page_size: int, physical_page_size: int, consumer: str
) -> None:
    """Reject consumers that cannot map one logical SWA page to many rows."""
    if logical_page_size != physical_page_size:
        raise ValueError(
            f"{consumer} does not support the DeepSeek-V4 direct SWA KV layout "
            f"({logical_page_size}-token logical pages stored as "
            f"{physical_page_size}-token physical rows). Disable "
            "SGLANG_OPT_SM120_DIRECT_SWA_KV for this configuration."
        )


def _dsv4_page_aligned_only(pool: Any) -> bool:
    """Whether a pool may only move whole pages: the token-granular copy
    (``transfer_cache_dsv4_mla``) hardcodes the V4 data/scale row split."""
    layout = getattr(pool, "kv_layout", None)
    return layout is not None and layout.value != "v4"


@dataclass(frozen=True)
class _IndexerRegion:
    """One page-contiguous indexer buffer group to mirror on the host."""

    name: PoolName
    device_buffers: list
    item_bytes: int
    slot_page_size: int
    # FP4 page rows group their slots instead of laying tokens out flat, so the
    # fused-row token-granular copy does not apply and transfers must be whole
    # pages. The fused FP8 row has no such restriction.
    page_aligned_only: bool


def _dsv4_indexer_regions(kvcache: Any, page_size: int) -> list[_IndexerRegion]:
    """
    Resolve the indexer HiCache regions, hiding the FP8/FP4 split from the
    stack builder. FP8 keeps key and scale fused in one buffer, while FP4
    stores payload and scale separately, so it maps to two host pools.
    """
    import torch

    pool = kvcache.c4_indexer_kv_pool
    if getattr(pool, "has_npu_storage", False):
        # NPU stores C4 int8 K and fp16 scale in separate PA_ND buffers.  Keep
        # the FULL logical page geometry for HiCache indices. The transfer path
        # derives the native C4 page geometry from these device buffers.
        k_buffers = pool.index_k_buffer
        scale_buffers = pool.index_scale_buffer
        return [
            _IndexerRegion(
                name=PoolName.DEEPSEEK_V4_C4_INDEXER,
                device_buffers=k_buffers,
                item_bytes=int(k_buffers[0][0].numel() * k_buffers[0].element_size()),
                slot_page_size=page_size,
                page_aligned_only=False,
            ),
            _IndexerRegion(
                name=PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE,
                device_buffers=scale_buffers,
                item_bytes=int(
                    scale_buffers[0][0].numel() * scale_buffers[0].element_size()
                ),
                slot_page_size=page_size,
                page_aligned_only=False,
            ),
        ]

    fused = pool.index_k_with_scale_buffer
    if fused is not None:
        return [
            _IndexerRegion(
                name=PoolName.DEEPSEEK_V4_C4_INDEXER,
                device_buffers=fused,
                item_bytes=fused[0].shape[1] * fused[0].element_size(),
                slot_page_size=page_size,
                page_aligned_only=False,
            )
        ]

    payload_ref = pool.index_k_payload_buffer[0]
    scale_ref = pool.index_k_scale_buffer[0]
    # A page row covers ``page_slots`` C4 slots, i.e. one tree page of tokens
    # after 4:1 compression.
    page_slots = payload_ref.shape[3]
    if scale_ref.shape[3] != page_slots:
        raise ValueError(
            "FP4 indexer payload and scale must agree on slots per page: "
            f"payload={page_slots}, scale={scale_ref.shape[3]}"
        )
    if page_size % page_slots != 0:
        raise ValueError(
            f"Tree page size {page_size} must be a multiple of the FP4 indexer "
            f"slots per page {page_slots}"
        )
    payload = [b.view(torch.uint8).flatten(1) for b in pool.index_k_payload_buffer]
    scale = [b.view(torch.uint8).flatten(1) for b in pool.index_k_scale_buffer]
    return [
        _IndexerRegion(
            name=PoolName.DEEPSEEK_V4_C4_INDEXER,
            device_buffers=payload,
            item_bytes=payload[0].shape[1],
            slot_page_size=page_size,
            page_aligned_only=True,
        ),
        _IndexerRegion(
            name=PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE,
            device_buffers=scale,
            item_bytes=scale[0].shape[1],
            slot_page_size=page_size,
            page_aligned_only=True,
        ),
    ]


def _dsv4_low_ratio_regions(
    kvcache: Any, page_size: int
) -> list[tuple[PoolName, Any, list, dict[int, int]]]:
    """(name, device_pool, buffers, layer_mapping) per shared source KV and
    indexer buffer group, in FULL-page units."""
    import torch

    regions = []
    for ratio, names in (
        (
            1,
            (
                PoolName.DEEPSEEK_V4_C1,
                PoolName.DEEPSEEK_V4_C1_INDEXER,
                PoolName.DEEPSEEK_V4_C1_INDEXER_SCALE,
            ),
        ),
        (
            2,
            (
                PoolName.DEEPSEEK_V4_C2,
                PoolName.DEEPSEEK_V4_C2_INDEXER,
                PoolName.DEEPSEEK_V4_C2_INDEXER_SCALE,
            ),
        ),
    ):
        sources = getattr(kvcache, "sources_by_ratio", {}).get(ratio, [])
        if not sources:
            continue
        kv_pool = kvcache.kv_pools[ratio]
        index_pool = kvcache.index_pools[ratio]
        assert page_size % ratio == 0
        slots_per_page = page_size // ratio
        assert slots_per_page % index_pool.page_size == 0
        index_pages_per_full_page = slots_per_page // index_pool.page_size
        layer_mapping = {
            source - kvcache.start_layer: index for index, source in enumerate(sources)
        }
        regions.append((names[0], kv_pool, kv_pool.kv_buffer, layer_mapping))
        if index_pool.index_k_with_scale_buffer is not None:
            index_regions = [(names[1], index_pool.index_k_with_scale_buffer)]
        else:
            index_regions = [
                (names[1], index_pool.index_k_payload_buffer),
                (names[2], index_pool.index_k_scale_buffer),
            ]
        for name, buffers in index_regions:
            # Drop only the padding rows past the FULL page address space.
            rows = []
            for buffer in buffers:
                full_pages = buffer.shape[0] // index_pages_per_full_page
                rows.append(
                    buffer[: full_pages * index_pages_per_full_page]
                    .view(torch.uint8)
                    .reshape(full_pages, -1)
                )
            regions.append((name, index_pool, rows, layer_mapping))
    return regions


def _dsv4_low_ratio_entries(
    kvcache: Any, page_size: int, num_host_pages: int, transfer_layer_id_max: int
):
    """Mirror shared KV; ratio-2 request state is rebuilt at page boundaries."""
    entries = []
    for name, device_pool, buffers, layer_mapping in _dsv4_low_ratio_regions(
        kvcache, page_size
    ):
        entries.append(
            build_pool_entry(
                name=name,
                host_pool=DeepSeekV4PagedHostPool(
                    pool_name=str(name),
                    device_buffers=buffers,
                    item_bytes=buffers[0].shape[1] * buffers[0].element_size(),
                    num_host_pages=num_host_pages,
                    slot_page_size=page_size,
                    layout=get_memory().hicache_mem_layout,
                    allocator_type=_get_allocator_type(),
                    page_aligned_only=True,
                ),
                device_pool=device_pool,
                layer_mapping=layer_mapping,
                transfer_layer_id_max=transfer_layer_id_max,
            )
        )
    return entries


def _dsv4_rope_sibling(
    kvcache: Any, ratio: int
) -> Optional[tuple[PoolName, list, int]]:
    """
    ``(name, device_buffers, item_bytes)`` for the bf16 rope half of an fp8
    two-pool unified_kv row; None for every other layout, which keeps the whole
    row in one buffer.
    """
    if not getattr(kvcache, "_unified_kv", False):
        return None
    region = kvcache.unified_rope_region_buffers(ratio)
    if region is None:
        return None
    buffers, item_bytes = region
    name = (
        PoolName.DEEPSEEK_V4_C4_ROPE if ratio == 4 else PoolName.DEEPSEEK_V4_C128_ROPE
    )
    return name, buffers, item_bytes


def _build_dsv4_rope_entry(
    kvcache: Any,
    ratio: int,
    *,
    device_pool: Any,
    layer_mapping: dict[int, int],
    num_host_pages: int,
    slot_page_size: int,
    transfer_layer_id_max: int,
) -> Optional[PoolEntry]:
    sibling = _dsv4_rope_sibling(kvcache, ratio)
    if sibling is None:
        return None
    name, device_buffers, item_bytes = sibling
    return build_pool_entry(
        name=name,
        host_pool=DeepSeekV4PagedHostPool(
            pool_name=str(name),
            device_buffers=device_buffers,
            item_bytes=item_bytes,
            num_host_pages=num_host_pages,
            slot_page_size=slot_page_size,
            layout=get_memory().hicache_mem_layout,
            allocator_type=_get_allocator_type(),
            page_aligned_only=True,
        ),
        device_pool=device_pool,
        layer_mapping=layer_mapping,
        transfer_layer_id_max=transfer_layer_id_max,
    )


def build_deepseek_v4_hicache_stack(
    *,
    params: CacheInitParams,
    kvcache: Any,
    load_cache_event,
    storage_backend: Optional[str],
    host_swa_evict_fn: Optional[Callable[[int], Any]] = None,
    device_swa_evict_fn: Optional[Callable[[int], Any]] = None,
    host_c128_evict_fn: Optional[Callable[[int], Any]] = None,
    prefetch_threshold: int = 256,
    model_name: Optional[str] = None,
    storage_backend_extra_config: Optional[dict] = None,
    enable_storage_metrics: bool = False,
    layer_mappings: Optional[_DeepSeekV4LayerMappings] = None,
) -> tuple[HostPoolGroup, HybridCacheController]:
    page_size = params.page_size
    layer_mappings = layer_mappings or _resolve_deepseek_v4_layer_mappings(kvcache)
    transfer_layer_id_max = layer_mappings.transfer_layer_id_max
    full_layer_mapping = layer_mappings.full

    is_unified_kv = getattr(kvcache, "_unified_kv", False)
    has_paged_swa = not is_unified_kv and kvcache.swa_kv_pool is not None
    mtp_swa_device_buffers = []
    if not has_paged_swa:
        # Unified KV and encoder replay rebuild SWA state; keep it out of host cache.
        swa_layer_mapping = {}
    else:
        _require_single_row_dsv4_swa_pages(
            logical_page_size=kvcache.swa_page_size,
            physical_page_size=kvcache.swa_kv_pool.page_size,
            consumer="DeepSeek-V4 HiCache",
        )
        if len(kvcache.swa_kv_pool.kv_buffer) != transfer_layer_id_max:
            raise ValueError(
                "DeepSeek V4 SWA KV pool must be PP-stage-local: "
                f"got {len(kvcache.swa_kv_pool.kv_buffer)} buffers for "
                f"{transfer_layer_id_max} local layers"
            )
        swa_layer_mapping = layer_mappings.swa
        # Keep every uncompressed draft SWA layer after the target SWA layers.
        # NextN has one layer per pool, while DSpark keeps all stages in one pool.
        mtp_swa_device_buffers = [
            buffer
            for pool in params.mtp_draft_device_pools
            for buffer in pool.swa_kv_pool.kv_buffer
        ]
        swa_layer_mapping = with_packed_draft_layer_mapping(
            swa_layer_mapping,
            transfer_layer_start=transfer_layer_id_max,
            target_device_layer_num=transfer_layer_id_max,
            draft_layer_num=len(mtp_swa_device_buffers),
        )

    c4_layer_mapping = layer_mappings.c4
    c128_layer_mapping = layer_mappings.c128
    c4_state_mapping = layer_mappings.c4_state
    c4_state_global_layers = layer_mappings.c4_state_global_layers
    (
        num_host_pages,
        swa_num_host_pages,
        c128_num_host_pages,
    ) = _deepseek_v4_num_host_pages(
        params=params,
        kvcache=kvcache,
        page_size=page_size,
        swa_page_size=kvcache.swa_page_size,
    )

    logical_host_pool = LogicalHostPool(
        num_host_pages * page_size, page_size, layout=get_memory().hicache_mem_layout
    )
    entries = [
        build_pool_entry(
            name=PoolName.KV,
            host_pool=logical_host_pool,
            device_pool=kvcache,
            layer_mapping=full_layer_mapping,
            transfer_layer_id_max=transfer_layer_id_max,
            is_anchor=True,
        ),
    ]

    if has_paged_swa:
        swa_host_pool = DeepSeekV4PagedHostPool(
            pool_name=str(PoolName.SWA),
            device_buffers=[
                *kvcache.swa_kv_pool.kv_buffer,
                *mtp_swa_device_buffers,
            ],
            item_bytes=kvcache.swa_kv_pool.bytes_per_page_padded,
            num_host_pages=swa_num_host_pages,
            slot_page_size=kvcache.swa_page_size,
            layout=get_memory().hicache_mem_layout,
            allocator_type=_get_allocator_type(),
            page_aligned_only=_dsv4_page_aligned_only(kvcache.swa_kv_pool),
        )
        swa_attn_allocator = params.token_to_kv_pool_allocator.swa_attn_allocator
        entries.append(
            build_pool_entry(
                name=PoolName.SWA,
                host_pool=swa_host_pool,
                device_pool=kvcache.swa_kv_pool,
                layer_mapping=swa_layer_mapping,
                transfer_layer_id_max=transfer_layer_id_max
                + len(mtp_swa_device_buffers),
                host_evict_fn=host_swa_evict_fn,
                device_evict_fn=device_swa_evict_fn,
                device_alloc_fn=swa_attn_allocator.alloc,
                device_free_fn=swa_attn_allocator.free,
                packed_draft_device_pools=tuple(mtp_swa_device_buffers),
            )
        )

    if c4_layer_mapping:
        c4_device_buffers, c4_item_bytes = _dsv4_compressed_region_buffers(kvcache, 4)
        # C4 is KV-derived, so its HiCache indices stay in the FULL logical
        # coordinate space. NPU transfer code derives the native C4 page size
        # (for example 32 rather than 128) from the device-buffer shape.
        c4_host_pool = DeepSeekV4PagedHostPool(
            pool_name=str(PoolName.DEEPSEEK_V4_C4),
            device_buffers=c4_device_buffers,
            item_bytes=c4_item_bytes,
            num_host_pages=num_host_pages,
            slot_page_size=page_size,
            layout=get_memory().hicache_mem_layout,
            allocator_type=_get_allocator_type(),
            page_aligned_only=is_unified_kv
            or _dsv4_page_aligned_only(kvcache.c4_kv_pool),
        )
        entries.append(
            build_pool_entry(
                name=PoolName.DEEPSEEK_V4_C4,
                host_pool=c4_host_pool,
                device_pool=kvcache.c4_kv_pool,
                layer_mapping=c4_layer_mapping,
                transfer_layer_id_max=transfer_layer_id_max,
            )
        )
        for region in _dsv4_indexer_regions(kvcache, page_size):
            entries.append(
                build_pool_entry(
                    name=region.name,
                    host_pool=DeepSeekV4PagedHostPool(
                        pool_name=str(region.name),
                        device_buffers=region.device_buffers,
                        item_bytes=region.item_bytes,
                        num_host_pages=num_host_pages,
                        slot_page_size=region.slot_page_size,
                        layout=get_memory().hicache_mem_layout,
                        allocator_type=_get_allocator_type(),
                        page_aligned_only=region.page_aligned_only,
                    ),
                    device_pool=kvcache.c4_indexer_kv_pool,
                    layer_mapping=c4_layer_mapping,
                    transfer_layer_id_max=transfer_layer_id_max,
                )
            )

        # Build c4 rope buffer when using unified fp8 kv
        c4_rope_entry = _build_dsv4_rope_entry(
            kvcache,
            4,
            device_pool=kvcache.c4_kv_pool,
            layer_mapping=c4_layer_mapping,
            num_host_pages=num_host_pages,
            slot_page_size=page_size,
            transfer_layer_id_max=transfer_layer_id_max,
        )
        if c4_rope_entry is not None:
            entries.append(c4_rope_entry)

        if not is_unified_kv:
            c4_state_host_pool = DeepSeekV4StateHostPool(
                pool_name=str(PoolName.DEEPSEEK_V4_C4_STATE),
                state_pools=[
                    kvcache.compress_state_pools[layer_id]
                    for layer_id in c4_state_global_layers
                ],
                num_host_pages=swa_num_host_pages,
                swa_page_size=kvcache.swa_page_size,
                layout=get_memory().hicache_mem_layout,
                allocator_type=_get_allocator_type(),
            )
            c4_indexer_state_host_pool = DeepSeekV4StateHostPool(
                pool_name=str(PoolName.DEEPSEEK_V4_C4_INDEXER_STATE),
                state_pools=[
                    kvcache.indexer_compress_state_pools[layer_id]
                    for layer_id in c4_state_global_layers
                ],
                num_host_pages=swa_num_host_pages,
                swa_page_size=kvcache.swa_page_size,
                layout=get_memory().hicache_mem_layout,
                allocator_type=_get_allocator_type(),
            )
            entries.extend(
                [
                    build_pool_entry(
                        name=PoolName.DEEPSEEK_V4_C4_STATE,
                        host_pool=c4_state_host_pool,
                        device_pool=None,
                        layer_mapping=c4_state_mapping,
                        transfer_layer_id_max=transfer_layer_id_max,
                    ),
                    build_pool_entry(
                        name=PoolName.DEEPSEEK_V4_C4_INDEXER_STATE,
                        host_pool=c4_indexer_state_host_pool,
                        device_pool=None,
                        layer_mapping=c4_state_mapping,
                        transfer_layer_id_max=transfer_layer_id_max,
                    ),
                ]
            )

    if c128_layer_mapping:
        c128_device_buffers, c128_item_bytes = _dsv4_compressed_region_buffers(
            kvcache, 128
        )
        # NPU C128 host views use kernel_page_size, for example 16 instead of 128.
        # GPU pools lack this attribute and fall back to the global page_size.
        _c128_pool = getattr(kvcache, "c128_kv_pool", None)
        c128_slot_page_size = getattr(_c128_pool, "kernel_page_size", page_size)
        # NPU derives the independent C128 host budget from its device pool.
        c128_attn_allocator = getattr(
            params.token_to_kv_pool_allocator, "c128_attn_allocator", None
        )
        c128_host_pool = DeepSeekV4PagedHostPool(
            pool_name=str(PoolName.DEEPSEEK_V4_C128),
            device_buffers=c128_device_buffers,
            item_bytes=c128_item_bytes,
            num_host_pages=c128_num_host_pages,
            slot_page_size=c128_slot_page_size,
            layout=get_memory().hicache_mem_layout,
            allocator_type=_get_allocator_type(),
            page_aligned_only=is_unified_kv
            or _dsv4_page_aligned_only(kvcache.c128_kv_pool),
        )
        # C128 state pool is intentionally not registered with hicache.
        # page_size=256 % 128 == 0, so state pool is not consumed on load.
        entries.extend(
            [
                build_pool_entry(
                    name=PoolName.DEEPSEEK_V4_C128,
                    host_pool=c128_host_pool,
                    device_pool=kvcache.c128_kv_pool,
                    layer_mapping=c128_layer_mapping,
                    transfer_layer_id_max=transfer_layer_id_max,
                    # NPU C128 uses bare allocator callbacks for independent indices.
                    # FULL leaf eviction also frees each attached C128 host value.
                    # GPU keeps its KV-derived sidecar callbacks unset.
                    host_evict_fn=host_c128_evict_fn,
                    device_alloc_fn=(
                        c128_attn_allocator.alloc
                        if c128_attn_allocator is not None
                        else None
                    ),
                    device_free_fn=(
                        c128_attn_allocator.free
                        if c128_attn_allocator is not None
                        else None
                    ),
                ),
            ]
        )
        # Build c128 rope buffer when using unified fp8 kv
        c128_rope_entry = _build_dsv4_rope_entry(
            kvcache,
            128,
            device_pool=kvcache.c128_kv_pool,
            layer_mapping=c128_layer_mapping,
            num_host_pages=c128_num_host_pages,
            slot_page_size=c128_slot_page_size,
            transfer_layer_id_max=transfer_layer_id_max,
        )
        if c128_rope_entry is not None:
            entries.append(c128_rope_entry)

    entries.extend(
        _dsv4_low_ratio_entries(
            kvcache, page_size, num_host_pages, transfer_layer_id_max
        )
    )

    host_pool_group = HostPoolGroup(entries)
    cache_controller = HybridCacheController(
        params.token_to_kv_pool_allocator,
        host_pool_group,
        page_size,
        params.tp_cache_group,
        load_cache_event=load_cache_event,
        attn_cp_group=params.attn_cp_cache_group,
        attn_tp_group=params.attn_tp_cache_group,
        pp_group=params.pp_cache_group,
        write_policy=get_memory().hicache_write_policy,
        io_backend=get_memory().hicache_io_backend,
        storage_backend=storage_backend,
        prefetch_threshold=prefetch_threshold,
        model_name=model_name,
        storage_backend_extra_config=storage_backend_extra_config,
        transfer_layer_id_max=transfer_layer_id_max,
        enable_storage_metrics=enable_storage_metrics,
        host_memory_mode=get_memory().hicache_host_memory_mode,
    )
    return host_pool_group, cache_controller


def build_mamba_host_pool(
    mamba_pool,
    pool_info: DevicePoolInfo,
    *,
    host_size: float,
    layout: str,
    mtp_draft_device_pools=(),
):
    draft_buffer_infos = []
    for draft_pool in mtp_draft_device_pools:
        (draft_info,) = draft_pool.get_device_pool_infos()
        draft_info.buffer_info.validate(layer_ids=draft_info.layer_ids)
        draft_buffer_infos.append(draft_info.buffer_info)
    capacity = mamba_pool.host_capacity_tokens
    if capacity is None:
        capacity = mamba_pool.size
    return MambaPoolHost(
        pool_info.buffer_info,
        get_memory().hicache_ratio,
        host_size,
        device_capacity=capacity,
        mtp_draft_buffer_infos=draft_buffer_infos,
        allocator_type=_get_allocator_type(),
        layout=layout,
    )


def build_hybrid_mamba_stack(
    *,
    params: CacheInitParams,
    decls: tuple[HostPoolDecl, ...],
    mamba_pool: Any,
    full_layer_mapping: dict[int, int],
    start_layer: int,
    load_cache_event,
    storage_backend: Optional[str],
    use_mla: bool,
    qsa_pool: Any = None,
    host_mamba_evict_fn: Optional[Callable[[int], Any]] = None,
    device_mamba_evict_fn: Optional[Callable[[int], Any]] = None,
    prefetch_threshold: int = 256,
    model_name: Optional[str] = None,
    storage_backend_extra_config: Optional[dict] = None,
    enable_storage_metrics: bool = False,
) -> tuple[HostPoolGroup, HybridCacheController, HostPoolGroupConfig]:
    """KV plus every pool the hybrid pool declares (e.g. a sparse indexer),
    then the Mamba state pool, which keeps its own host path."""
    (mamba_info,) = mamba_pool.get_device_pool_infos()
    mamba_info.buffer_info.validate(layer_ids=mamba_info.layer_ids)
    # Controller IDs are stage-local; Info IDs follow the physical layer axis.
    mamba_layer_mapping = {
        layer - start_layer: index for index, layer in enumerate(mamba_info.layer_ids)
    }
    transfer_layer_id_max = (
        max(full_layer_mapping.keys() | mamba_layer_mapping.keys()) + 1
    )
    mamba_allocator = params.req_to_token_pool.mamba_allocator
    qsa_draft_pools = params.mtp_draft_device_pools if qsa_pool is not None else ()
    config = prepare_host_pool_config(
        decls=decls,
        full_layer_mapping=full_layer_mapping,
        transfer_layer_id_max=transfer_layer_id_max,
        transfer_page_size=params.page_size,
        packed_draft_device_pools=params.mtp_draft_device_pools,
    )
    root = config.pools[0]
    kv_pool = root.decl.device_pool
    kv_host_size, mamba_host_size = None, 0
    if get_memory().hicache_size > 0:
        kv_host_size, mamba_host_size = _split_hicache_size(
            get_memory().hicache_size, (kv_pool, mamba_pool)
        )
    if qsa_pool is not None and kv_host_size is not None:
        kv_bytes = sum(kv_pool.get_kv_size_bytes())
        index_bytes = sum(
            b.nbytes
            for pool in (qsa_pool, *qsa_draft_pools)
            for b in pool.qsa_compressed_k_buffer_pool
        )
        kv_host_size *= kv_bytes / (kv_bytes + index_bytes)
    kv_host_pool = build_kv_host_pool(
        kv_pool=kv_pool,
        page_size=params.page_size,
        use_mla=use_mla,
        host_size=kv_host_size,
        mtp_draft_device_pools=root.packed_draft_device_pools,
    )
    # MambaPoolHost only supports page_first_direct; the global layout may be
    # page_first_kv_split (e.g. MLA + KDA hybrid on NPU). The Mamba/KDA state
    # pool has no separate K/V buffers, so kv_split does not apply; override
    # to page_first_direct.
    mamba_layout = (
        "page_first_direct"
        if get_memory().hicache_mem_layout == "page_first_kv_split"
        else get_memory().hicache_mem_layout
    )
    mamba_host_pool = build_mamba_host_pool(
        mamba_pool,
        mamba_info,
        host_size=mamba_host_size,
        layout=mamba_layout,
        mtp_draft_device_pools=params.mtp_draft_mamba_pools,
    )
    mamba_layer_mapping = with_packed_draft_layer_mapping(
        mamba_layer_mapping,
        transfer_layer_start=transfer_layer_id_max,
        target_device_layer_num=len(mamba_info.layer_ids),
        draft_layer_num=len(params.mtp_draft_mamba_pools),
    )
    entries = _build_pool_entries(config=config, root_host_pool=kv_host_pool) + [
        build_pool_entry(
            name=PoolName.MAMBA,
            host_pool=mamba_host_pool,
            device_pool=mamba_pool,
            layer_mapping=mamba_layer_mapping,
            transfer_layer_id_max=transfer_layer_id_max
            + len(params.mtp_draft_mamba_pools),
            host_evict_fn=host_mamba_evict_fn,
            device_evict_fn=device_mamba_evict_fn,
            device_alloc_fn=mamba_allocator.alloc,
            device_free_fn=mamba_allocator.free,
            packed_draft_device_pools=params.mtp_draft_mamba_pools,
        ),
    ]
    if qsa_pool is not None:
        entries.append(
            build_pool_entry(
                name=PoolName.INDEXER,
                host_pool=QSAIndexerPoolHost(
                    qsa_pool,
                    kv_host_pool,
                    allocator_type=_get_allocator_type(),
                    mtp_draft_device_pools=qsa_draft_pools,
                ),
                device_pool=qsa_pool,
                # The KV config carries the packed draft tail layers.
                layer_mapping=root.layer_mapping,
                transfer_layer_id_max=root.transfer_layer_id_max,
                packed_draft_device_pools=qsa_draft_pools,
            )
        )
    host_pool_group = HostPoolGroup(entries)
    cache_controller = HybridCacheController(
        params.token_to_kv_pool_allocator,
        host_pool_group,
        params.page_size,
        params.tp_cache_group,
        load_cache_event=load_cache_event,
        attn_cp_group=params.attn_cp_cache_group,
        attn_tp_group=params.attn_tp_cache_group,
        pp_group=params.pp_cache_group,
        write_policy=get_memory().hicache_write_policy,
        io_backend=get_memory().hicache_io_backend,
        storage_backend=storage_backend,
        prefetch_threshold=prefetch_threshold,
        model_name=model_name,
        storage_backend_extra_config=storage_backend_extra_config,
        transfer_layer_id_max=transfer_layer_id_max,
        enable_storage_metrics=enable_storage_metrics,
        host_memory_mode=get_memory().hicache_host_memory_mode,
    )
    return host_pool_group, cache_controller, config


def build_hybrid_mamba_swa_stack(
    *,
    params: CacheInitParams,
    full_kv_pool: Any,
    swa_kv_pool: Any,
    mamba_pool: Any,
    full_layer_mapping: dict[int, int],
    swa_layer_mapping: dict[int, int],
    start_layer: int,
    page_size: int,
    tp_group,
    load_cache_event,
    attn_cp_group: Optional[torch.distributed.ProcessGroup] = None,
    attn_tp_group: Optional[torch.distributed.ProcessGroup] = None,
    pp_group: Optional[torch.distributed.ProcessGroup] = None,
    storage_backend: Optional[str],
    host_swa_evict_fn: Optional[Callable[[int], Any]] = None,
    device_swa_evict_fn: Optional[Callable[[int], Any]] = None,
    host_mamba_evict_fn: Optional[Callable[[int], Any]] = None,
    device_mamba_evict_fn: Optional[Callable[[int], Any]] = None,
    prefetch_threshold: int = 256,
    model_name: Optional[str] = None,
    storage_backend_extra_config: Optional[dict] = None,
    enable_storage_metrics: bool = False,
) -> tuple[HostPoolGroup, HybridCacheController]:
    (mamba_info,) = mamba_pool.get_device_pool_infos()
    mamba_info.buffer_info.validate(layer_ids=mamba_info.layer_ids)
    # Controller IDs are stage-local; Info IDs follow the physical layer axis.
    mamba_layer_mapping = {
        layer - start_layer: index for index, layer in enumerate(mamba_info.layer_ids)
    }
    transfer_layer_id_max = (
        max(
            full_layer_mapping.keys()
            | swa_layer_mapping.keys()
            | mamba_layer_mapping.keys()
        )
        + 1
    )
    swa_attn_allocator = params.token_to_kv_pool_allocator.swa_attn_allocator
    mamba_allocator = params.req_to_token_pool.mamba_allocator
    kv_host_size, swa_host_size, mamba_host_size = None, None, 0
    if get_memory().hicache_size > 0:
        kv_host_size, swa_host_size, mamba_host_size = _split_hicache_size(
            get_memory().hicache_size, (full_kv_pool, swa_kv_pool, mamba_pool)
        )
    host_pool_group = build_hybrid_swa_group(
        page_size=page_size,
        full_kv_pool=full_kv_pool,
        swa_kv_pool=swa_kv_pool,
        full_layer_mapping=full_layer_mapping,
        swa_layer_mapping=swa_layer_mapping,
        use_mla=False,
        kv_host_size=kv_host_size,
        swa_host_size=swa_host_size,
        host_swa_evict_fn=host_swa_evict_fn,
        device_swa_evict_fn=device_swa_evict_fn,
        swa_attn_allocator=swa_attn_allocator,
        mtp_full_device_pools=tuple(
            pool.full_kv_pool
            for pool in params.mtp_draft_device_pools
            if pool.full_kv_pool.layer_num
        ),
        mtp_swa_device_pools=_mtp_swa_device_pools(params, full_indices=False),
        mtp_swa_full_device_pools=_mtp_swa_device_pools(params, full_indices=True),
        transfer_layer_id_max=transfer_layer_id_max,
    )
    mamba_host_pool = build_mamba_host_pool(
        mamba_pool,
        mamba_info,
        host_size=mamba_host_size,
        layout=get_memory().hicache_mem_layout,
        mtp_draft_device_pools=params.mtp_draft_mamba_pools,
    )
    mamba_layer_mapping = with_packed_draft_layer_mapping(
        mamba_layer_mapping,
        transfer_layer_start=transfer_layer_id_max,
        target_device_layer_num=len(mamba_info.layer_ids),
        draft_layer_num=len(params.mtp_draft_mamba_pools),
    )
    host_pool_group.add_entry(
        build_pool_entry(
            name=PoolName.MAMBA,
            host_pool=mamba_host_pool,
            device_pool=mamba_pool,
            layer_mapping=mamba_layer_mapping,
            transfer_layer_id_max=transfer_layer_id_max
            + len(params.mtp_draft_mamba_pools),
            host_evict_fn=host_mamba_evict_fn,
            device_evict_fn=device_mamba_evict_fn,
            device_alloc_fn=mamba_allocator.alloc,
            device_free_fn=mamba_allocator.free,
            packed_draft_device_pools=params.mtp_draft_mamba_pools,
        ),
    )
    cache_controller = HybridCacheController(
        params.token_to_kv_pool_allocator,
        host_pool_group,
        page_size,
        tp_group,
        load_cache_event=load_cache_event,
        attn_cp_group=attn_cp_group,
        attn_tp_group=attn_tp_group,
        pp_group=pp_group,
        write_policy=get_memory().hicache_write_policy,
        io_backend=get_memory().hicache_io_backend,
        storage_backend=storage_backend,
        prefetch_threshold=prefetch_threshold,
        model_name=model_name,
        storage_backend_extra_config=storage_backend_extra_config,
        transfer_layer_id_max=transfer_layer_id_max,
        enable_storage_metrics=enable_storage_metrics,
        host_memory_mode=get_memory().hicache_host_memory_mode,
    )
    return host_pool_group, cache_controller


def build_host_pool_group(
    *,
    config: HostPoolGroupConfig,
) -> HostPoolGroup:
    """Allocate host pools and transfer entries from prepared configs."""
    root = config.pools[0]
    root_host_pool = build_kv_host_pool(
        kv_pool=root.decl.device_pool,
        page_size=config.transfer_page_size,
        mtp_draft_device_pools=root.packed_draft_device_pools,
    )
    return HostPoolGroup(
        _build_pool_entries(config=config, root_host_pool=root_host_pool)
    )


def _build_pool_entries(
    *, config: HostPoolGroupConfig, root_host_pool: Any
) -> list[PoolEntry]:
    host_pools = {config.pools[0].decl.pool_name: root_host_pool}
    entries = []
    for pool_config in config.pools:
        decl = pool_config.decl
        if not decl.is_layout_root:
            host_pools[decl.pool_name] = decl.host_pool_builder.build(
                decl=decl,
                anchor_host=host_pools[decl.layout_source],
                allocator_type=_get_allocator_type(),
                packed_draft_device_pools=pool_config.packed_draft_device_pools,
            )
        entries.append(
            build_pool_entry(
                name=decl.pool_name,
                host_pool=host_pools[decl.pool_name],
                device_pool=decl.device_pool,
                layer_mapping=pool_config.layer_mapping,
                transfer_layer_id_max=pool_config.transfer_layer_id_max,
                is_anchor=decl.is_primary,
                packed_draft_device_pools=pool_config.packed_draft_device_pools,
            )
        )
    return entries


def _build_mha_mla_host_pool(
    *,
    pool: Any,
    host_to_device_ratio: float,
    page_size: int,
    layout: str,
    allocator_type: str,
    pool_label: str,
    host_token_capacity: int | None = None,
):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    # The global layout is page_first_kv_split only when the target model
    # uses MLA; that layout is MLA-specific, so MHA draft pools must use
    # the non-MLA layout (NPU default: page_first_direct).
    if isinstance(pool, MHATokenToKVPool) and layout == "page_first_kv_split":
        layout = "page_first_direct"

    kwargs = dict(
        host_to_device_ratio=host_to_device_ratio,
        host_size=0,
        page_size=page_size,
        layout=layout,
        allocator_type=allocator_type,
        pool_label=pool_label,
        host_token_capacity=host_token_capacity,
    )
    if isinstance(pool, MHATokenToKVPool):
        host_cls, host_input, host_kwargs = _mha_host_inputs(pool)
        return host_cls(host_input, **host_kwargs, **kwargs)
    return MLATokenToKVPoolHost(
        pool.get_device_pool_infos()[0].buffer_info,
        device_capacity_tokens=pool.size
        if pool.host_capacity_tokens is None
        else pool.host_capacity_tokens,
        start_layer=pool.start_layer,
        end_layer=pool.end_layer,
        target_layer_num=pool.layer_num,
        override_kv_cache_dim=pool.kv_cache_dim,
        **kwargs,
    )


def build_full_draft_pools(
    *,
    draft_kv_pool: Any,
    tree_cache: Any,
) -> tuple[list[SidecarPoolSpec], list[PoolEntry]]:
    """Build draft KV/DSA sidecars whose indices follow target full KV."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, HybridLinearKVPool
    from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

    pool = draft_kv_pool
    if isinstance(pool, HybridLinearKVPool):
        # Hybrid draft runners keep their sole attention layer in this sub-pool.
        pool = pool.full_kv_pool
    if pool.layer_num == 0:
        return [], []

    controller = tree_cache.cache_controller
    host_pool_group = controller.mem_pool_host
    if pool.layer_num > controller.transfer_layer_id_max:
        raise ValueError("Draft HiCache layers exceed the target transfer stages")

    # Note(kpham-sgl): DCP x DSpark draft KV is replicated and spans the virtual
    # loc space, so match the target host's logical_size instead of physical size.
    draft_host_pool = _build_mha_mla_host_pool(
        pool=pool,
        host_to_device_ratio=host_pool_group.logical_size / pool.size,
        page_size=controller.page_size,
        layout=get_memory().hicache_mem_layout,
        allocator_type=_get_allocator_type(),
        pool_label="draft",
        host_token_capacity=host_pool_group.logical_size,
    )
    draft_layer_mapping = {i: i for i in range(pool.layer_num)}

    specs = [
        SidecarPoolSpec(
            pool_name=PoolName.DRAFT,
            indices_from_pool=PoolName.KV,
        )
    ]
    entries = [
        build_pool_entry(
            name=PoolName.DRAFT,
            host_pool=draft_host_pool,
            device_pool=pool,
            layer_mapping=draft_layer_mapping,
            transfer_layer_id_max=draft_host_pool.layer_num,
        )
    ]

    if isinstance(pool, DSATokenToKVPool) and pool.index_k_with_scale_buffer:
        from sglang.srt.mem_cache.pool_host.dsa import (
            DSAIndexerPoolHost,
            make_dsa_indexer_pool_decl,
        )

        # Separate draft indexer: its own host pool laid out on the draft KV
        # host pool, but transfer indices still follow the target KV anchor.
        indexer_decl = make_dsa_indexer_pool_decl(pool, name=PoolName.DRAFT_INDEXER)
        indexer_host_pool = DSAIndexerPoolHost(
            decl=indexer_decl,
            anchor_host=draft_host_pool,
            allocator_type=_get_allocator_type(),
        )
        specs.append(indexer_decl.sidecar_spec())
        entries.append(
            build_pool_entry(
                name=PoolName.DRAFT_INDEXER,
                host_pool=indexer_host_pool,
                device_pool=pool,
                layer_mapping=draft_layer_mapping,
                transfer_layer_id_max=indexer_host_pool.layer_num,
            )
        )

    if isinstance(draft_kv_pool, QSATokenToKVPool):
        specs.append(SidecarPoolSpec(PoolName.DRAFT_INDEXER, PoolName.KV))
        entries.append(
            build_pool_entry(
                name=PoolName.DRAFT_INDEXER,
                host_pool=QSAIndexerPoolHost(
                    draft_kv_pool,
                    draft_host_pool,
                    allocator_type=_get_allocator_type(),
                ),
                device_pool=draft_kv_pool,
                layer_mapping=draft_layer_mapping,
                transfer_layer_id_max=draft_host_pool.layer_num,
            )
        )

    return specs, entries


def build_swa_draft_pools(
    *,
    draft_kv_pool: Any,
    tree_cache: Any,
) -> tuple[list[SidecarPoolSpec], list[PoolEntry]]:
    """Build a draft SWA sidecar whose indices follow target SWA."""
    draft_swa_pool = draft_kv_pool.swa_kv_pool
    if draft_swa_pool is None:
        raise NotImplementedError(
            "HiCache draft SWA sidecar requires a non-unified draft SWA pool."
        )
    if draft_swa_pool.layer_num == 0:
        return [], []
    controller = tree_cache.cache_controller
    host_pool_group = controller.mem_pool_host
    target_swa_host_pool = host_pool_group.entry_map[PoolName.SWA].host_pool

    if isinstance(target_swa_host_pool, DeepSeekV4PagedHostPool):
        _require_single_row_dsv4_swa_pages(
            logical_page_size=target_swa_host_pool.slot_page_size,
            physical_page_size=draft_swa_pool.page_size,
            consumer="DeepSeek-V4 MTP SWA HiCache sidecar",
        )
        host_pool = DeepSeekV4PagedHostPool(
            pool_name=str(PoolName.DRAFT_SWA),
            device_buffers=draft_swa_pool.kv_buffer,
            item_bytes=draft_swa_pool.bytes_per_page_padded,
            num_host_pages=target_swa_host_pool.num_host_pages,
            slot_page_size=draft_swa_pool.page_size,
            layout=target_swa_host_pool.layout,
            allocator_type=_get_allocator_type(),
        )
    else:
        host_pool = _build_mha_mla_host_pool(
            pool=draft_swa_pool,
            host_to_device_ratio=target_swa_host_pool.size / draft_swa_pool.size,
            page_size=target_swa_host_pool.page_size,
            layout=target_swa_host_pool.layout,
            allocator_type=_get_allocator_type(),
            pool_label="draft_swa",
        )

    layer_mapping = {i: i for i in range(draft_swa_pool.layer_num)}
    spec = SidecarPoolSpec(
        pool_name=PoolName.DRAFT_SWA,
        indices_from_pool=PoolName.SWA,
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )
    entry = build_pool_entry(
        name=PoolName.DRAFT_SWA,
        host_pool=host_pool,
        device_pool=draft_swa_pool,
        layer_mapping=layer_mapping,
        transfer_layer_id_max=host_pool.layer_num,
    )
    return [spec], [entry]


def validate_fused_hicache_draft(
    *,
    target_config: Optional[KVCacheConfigurator] = None,
    draft_device_pools: Optional[tuple[Any, ...]] = None,
    tree_cache: Any = None,
) -> None:
    """Validate fusion at sizing, draft binding, and host registration.

    Sizing supplies only the target config. Draft binding also supplies the
    device pools; registration supplies the pools and the completed cache so
    its page envelopes and shared buffer can be checked.
    """
    if target_config is not None and not (
        target_config.spec_algorithm.is_dflash()
        and target_config.is_hybrid_swa
        and target_config.mambaish_config is None
        and get_memory().hicache_storage_backend is None
    ):
        raise NotImplementedError(
            "--enable-hierarchical-cache fused draft KV requires DFLASH, a "
            "hybrid-SWA target without Mamba, and L2-only storage."
        )

    if draft_device_pools is not None:
        from sglang.srt.mem_cache.unified_draft_pool import UnifiedDraftKVPool

        if not (
            len(draft_device_pools) == 1
            and isinstance(draft_device_pools[0], UnifiedDraftKVPool)
            and draft_device_pools[0]._host_sub_pool_name == "full"
        ):
            raise NotImplementedError(
                "HiCache fused draft KV requires a full-attention DFLASH draft."
            )

    if tree_cache is None:
        return
    assert draft_device_pools is not None

    entries = tree_cache.cache_controller.mem_pool_host.entry_map
    if any(
        name not in entries
        or not isinstance(entries[name].host_pool, UnifiedPageEnvelopeHostPool)
        for name in (PoolName.KV, PoolName.SWA)
    ):
        raise NotImplementedError(
            "Fused DFLASH HiCache requires unified hybrid-SWA page-envelope host "
            "pools; the selected storage backend or host layout does not preserve "
            "the fused draft bytes."
        )
    target = entries[PoolName.KV].device_pool
    if draft_device_pools[0]._unified_buffer is not target._unified_buffer:
        raise ValueError("Fused DFLASH HiCache draft must share the target FULL pool.")


def build_hicache_draft_sidecars(
    *,
    draft_device_pools: tuple[Any, ...],
    tree_cache: Any,
) -> tuple[list[SidecarPoolSpec], list[PoolEntry]]:
    """Compose the full and SWA draft-sidecar paths."""
    from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

    assert len(draft_device_pools) == 1
    draft_kv_pool = draft_device_pools[0]
    builder = (
        build_swa_draft_pools
        if isinstance(draft_kv_pool, BaseSWAKVPool)
        else build_full_draft_pools
    )
    return builder(
        draft_kv_pool=draft_kv_pool,
        tree_cache=tree_cache,
    )


_COMPONENT_HOST_ATTR: dict[ComponentType, tuple[str, str]] = {
    ComponentType.FULL: ("full_kv_pool_host", "_full_kv_pool_host"),
    ComponentType.SWA: ("swa_kv_pool_host", "_swa_kv_pool_host"),
    ComponentType.MAMBA: ("mamba_pool_host", "_mamba_pool_host"),
    ComponentType.C128: ("c128_kv_pool_host", "_c128_kv_pool_host"),
}


@dataclass
class StackBuildResult:
    host_pool_group: HostPoolGroup
    cache_controller: HybridCacheController
    component_host_pools: dict[ComponentType, Any]
    sidecars: list[SidecarPoolSpec] = field(default_factory=list)
    # Mamba state lives in req_to_token_pool, not in kvcache, so its
    # layer_transfer_counter has to be wired separately.
    register_req_to_token_counter: bool = False
    pools_desc: str = ""
    pool_declarations: Optional[tuple[HostPoolDecl, ...]] = None


class StackStrategy:
    def matches(self, kvcache: Any, components: set[ComponentType]) -> bool:
        raise NotImplementedError

    def build_direct_linker_pool_group(
        self,
        *,
        kvcache: Any,
        params: CacheInitParams,
        page_size: int,
    ):
        raise ValueError(
            "The selected hybrid pool strategy does not support the direct "
            f"external linker: {type(self).__name__}."
        )

    def build(
        self,
        *,
        cache: UnifiedRadixCache,
        kvcache: Any,
        params: CacheInitParams,
        server_args: ServerArgs,
        load_cache_event,
        storage_backend: Optional[str] = None,
        storage_backend_extra_config: Optional[dict] = None,
        prefetch_threshold: int = 256,
        model_name: Optional[str] = None,
        enable_storage_metrics: bool = False,
    ) -> StackBuildResult:
        raise NotImplementedError


def _delegate_c128_host_evict(cache, n: int) -> int:
    """Delegate C128 host pressure to FULL leaf eviction.

    For example, ``n`` C128 slots request ``n * 128`` FULL tokens."""
    return cache.evict_host(n * 128, ComponentType.FULL)


class _DeepSeekV4Strategy(StackStrategy):
    def matches(self, kvcache, components):
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

        if not isinstance(kvcache, DeepSeekV4TokenToKVPool):
            return False
        return components in (
            {ComponentType.FULL, ComponentType.SWA},
            {ComponentType.FULL, ComponentType.SWA, ComponentType.C128},
        ) or (components == {ComponentType.FULL} and kvcache.swa_kv_pool is None)

    def build_direct_linker_pool_group(self, *, kvcache, params, page_size):
        from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
            _build_deepseek_v4_device_pool_group,
        )

        return _build_deepseek_v4_device_pool_group(
            kvcache, page_size, params.mtp_draft_device_pools
        )

    def build(
        self,
        *,
        cache,
        kvcache,
        params,
        server_args,
        load_cache_event,
        storage_backend=None,
        storage_backend_extra_config=None,
        prefetch_threshold=256,
        model_name=None,
        enable_storage_metrics=False,
    ):
        layer_mappings = _resolve_deepseek_v4_layer_mappings(kvcache)
        host_pool_group, cache_controller = build_deepseek_v4_hicache_stack(
            params=params,
            kvcache=kvcache,
            load_cache_event=load_cache_event,
            storage_backend=storage_backend,
            host_swa_evict_fn=lambda n: cache.evict_host(n, ComponentType.SWA),
            device_swa_evict_fn=lambda n: _evict_swa_for_device_alloc(cache, n),
            # NPU delegates C128 host pressure to FULL host-leaf eviction.
            # _delegate_c128_host_evict converts C128 slots to FULL tokens.
            host_c128_evict_fn=(
                (lambda n: _delegate_c128_host_evict(cache, n))
                if ComponentType.C128 in cache.components
                else None
            ),
            prefetch_threshold=prefetch_threshold,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
            enable_storage_metrics=enable_storage_metrics,
            layer_mappings=layer_mappings,
        )
        # NPU drives C128 as an independent tree component, so adding a KV-derived
        # sidecar would duplicate transfers. Add that sidecar only on GPU.
        # The *_ROPE entries only resolve under unified fp8 kv; entry_map filters
        # them out everywhere else.
        _sidecar_srcs = [
            (PoolName.DEEPSEEK_V4_C1, PoolName.KV),
            (PoolName.DEEPSEEK_V4_C1_INDEXER, PoolName.KV),
            (PoolName.DEEPSEEK_V4_C1_INDEXER_SCALE, PoolName.KV),
            (PoolName.DEEPSEEK_V4_C2, PoolName.KV),
            (PoolName.DEEPSEEK_V4_C2_INDEXER, PoolName.KV),
            (PoolName.DEEPSEEK_V4_C2_INDEXER_SCALE, PoolName.KV),
            (PoolName.DEEPSEEK_V4_C4, PoolName.KV),
            (PoolName.DEEPSEEK_V4_C4_ROPE, PoolName.KV),
            (PoolName.DEEPSEEK_V4_C4_INDEXER, PoolName.KV),
            (PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE, PoolName.KV),
            (PoolName.DEEPSEEK_V4_C4_STATE, PoolName.SWA),
            (PoolName.DEEPSEEK_V4_C4_INDEXER_STATE, PoolName.SWA),
            (PoolName.DEEPSEEK_V4_C128_STATE, PoolName.SWA),
        ]
        if ComponentType.C128 not in cache.components:
            _sidecar_srcs.append((PoolName.DEEPSEEK_V4_C128, PoolName.KV))
            _sidecar_srcs.append((PoolName.DEEPSEEK_V4_C128_ROPE, PoolName.KV))
        sidecars = [
            SidecarPoolSpec(
                pool_name=name,
                indices_from_pool=src,
                hit_policy=(
                    PoolHitPolicy.TRAILING_PAGES
                    if src == PoolName.SWA
                    else PoolHitPolicy.ALL_PAGES
                ),
            )
            for name, src in _sidecar_srcs
            if name in host_pool_group.entry_map
        ]
        component_host_pools = {
            ComponentType.FULL: host_pool_group.get_pool(PoolName.KV),
        }
        if PoolName.SWA in host_pool_group.entry_map:
            component_host_pools[ComponentType.SWA] = host_pool_group.get_pool(
                PoolName.SWA
            )
        if (
            ComponentType.C128 in cache.components
            and PoolName.DEEPSEEK_V4_C128 in host_pool_group.entry_map
        ):
            component_host_pools[ComponentType.C128] = host_pool_group.get_pool(
                PoolName.DEEPSEEK_V4_C128
            )

        return StackBuildResult(
            host_pool_group=host_pool_group,
            cache_controller=cache_controller,
            component_host_pools=component_host_pools,
            sidecars=sidecars,
            pools_desc="KV + SWA + DeepSeekV4 sidecars",
        )


class _MambaStrategy(StackStrategy):
    def matches(self, kvcache, components):
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

        return isinstance(kvcache, HybridLinearKVPool) and components == {
            ComponentType.FULL,
            ComponentType.MAMBA,
        }

    def build_direct_linker_pool_group(self, *, kvcache, params, page_size):
        from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
            _build_mamba_device_pool_group,
        )

        return _build_mamba_device_pool_group(kvcache, params, page_size)

    def build(
        self,
        *,
        cache,
        kvcache,
        params,
        server_args,
        load_cache_event,
        storage_backend=None,
        storage_backend_extra_config=None,
        prefetch_threshold=256,
        model_name=None,
        enable_storage_metrics=False,
    ):
        from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

        qsa_pool = kvcache if isinstance(kvcache, QSATokenToKVPool) else None
        full_layer_mapping = _stage_local_layer_mapping(
            kvcache.full_attention_layer_id_mapping, kvcache.start_layer
        )
        host_pool_group, cache_controller, config = build_hybrid_mamba_stack(
            params=params,
            decls=kvcache.host_pool_decls(),
            mamba_pool=params.req_to_token_pool.mamba_pool,
            full_layer_mapping=full_layer_mapping,
            start_layer=kvcache.start_layer,
            load_cache_event=load_cache_event,
            storage_backend=storage_backend,
            use_mla=kvcache.use_mla,
            qsa_pool=qsa_pool,
            host_mamba_evict_fn=lambda n: cache.evict_host(n, ComponentType.MAMBA),
            device_mamba_evict_fn=lambda n: _evict_mamba_for_device_alloc(cache, n),
            prefetch_threshold=prefetch_threshold,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
            enable_storage_metrics=enable_storage_metrics,
        )
        return StackBuildResult(
            host_pool_group=host_pool_group,
            cache_controller=cache_controller,
            component_host_pools={
                ComponentType.FULL: host_pool_group.get_pool(PoolName.KV),
                ComponentType.MAMBA: host_pool_group.get_pool(PoolName.MAMBA),
            },
            sidecars=[
                c.decl.sidecar_spec() for c in config.pools if not c.decl.is_primary
            ]
            + (
                [SidecarPoolSpec(PoolName.INDEXER, PoolName.KV)]
                if qsa_pool is not None
                else []
            ),
            pool_declarations=tuple(c.decl for c in config.pools),
            register_req_to_token_counter=True,
            pools_desc=" + ".join(
                [c.decl.pool_name.value.upper() for c in config.pools]
                + ["MAMBA"]
                + (["INDEXER"] if qsa_pool is not None else [])
            ),
        )


def _swa_layer_mappings(kvcache) -> tuple[dict[int, int], dict[int, int]]:
    full = {
        gid - kvcache.start_layer: lid
        for gid, (lid, is_swa) in kvcache.layers_mapping.items()
        if not is_swa
    }
    swa = {
        gid - kvcache.start_layer: lid
        for gid, (lid, is_swa) in kvcache.layers_mapping.items()
        if is_swa
    }
    return full, swa


class _SwaStrategy(StackStrategy):
    def matches(self, kvcache, components):
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        return (
            isinstance(kvcache, SWAKVPool)
            and not isinstance(kvcache, DeepSeekV4TokenToKVPool)
            and components == {ComponentType.FULL, ComponentType.SWA}
        )

    def build(
        self,
        *,
        cache,
        kvcache,
        params,
        server_args,
        load_cache_event,
        storage_backend=None,
        storage_backend_extra_config=None,
        prefetch_threshold=256,
        model_name=None,
        enable_storage_metrics=False,
    ):
        full_layer_mapping, swa_layer_mapping = _swa_layer_mappings(kvcache)
        host_pool_group, cache_controller = build_hybrid_swa_stack(
            params=params,
            full_kv_pool=kvcache.full_kv_pool,
            swa_kv_pool=kvcache.swa_kv_pool,
            full_layer_mapping=full_layer_mapping,
            swa_layer_mapping=swa_layer_mapping,
            load_cache_event=load_cache_event,
            storage_backend=storage_backend,
            use_mla=False,
            host_full_evict_fn=lambda n: cache.evict_host(n, ComponentType.FULL),
            host_swa_evict_fn=lambda n: cache.evict_host(n, ComponentType.SWA),
            device_swa_evict_fn=lambda n: _evict_swa_for_device_alloc(cache, n),
            prefetch_threshold=prefetch_threshold,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
            enable_storage_metrics=enable_storage_metrics,
        )
        return StackBuildResult(
            host_pool_group=host_pool_group,
            cache_controller=cache_controller,
            component_host_pools={
                ComponentType.FULL: host_pool_group.get_pool(PoolName.KV),
                ComponentType.SWA: host_pool_group.get_pool(PoolName.SWA),
            },
            pools_desc="Full + SWA",
            sidecars=_mtp_swa_sidecar_specs(host_pool_group),
        )


class _MambaSwaStrategy(StackStrategy):
    def matches(self, kvcache, components):
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        return (
            isinstance(kvcache, SWAKVPool)
            and not isinstance(kvcache, DeepSeekV4TokenToKVPool)
            and components
            == {ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA}
        )

    def build_direct_linker_pool_group(self, *, kvcache, params, page_size):
        from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
            _build_mamba_swa_device_pool_group,
        )

        return _build_mamba_swa_device_pool_group(kvcache, params, page_size)

    def build(
        self,
        *,
        cache,
        kvcache,
        params,
        server_args,
        load_cache_event,
        attn_cp_group=None,
        attn_tp_group=None,
        storage_backend=None,
        storage_backend_extra_config=None,
        prefetch_threshold=256,
        model_name=None,
        enable_storage_metrics=False,
    ):
        full_layer_mapping, swa_layer_mapping = _swa_layer_mappings(kvcache)
        host_pool_group, cache_controller = build_hybrid_mamba_swa_stack(
            params=params,
            full_kv_pool=kvcache.full_kv_pool,
            swa_kv_pool=kvcache.swa_kv_pool,
            mamba_pool=params.req_to_token_pool.mamba_pool,
            full_layer_mapping=full_layer_mapping,
            swa_layer_mapping=swa_layer_mapping,
            start_layer=kvcache.start_layer,
            page_size=cache.page_size,
            tp_group=params.tp_cache_group,
            load_cache_event=load_cache_event,
            attn_cp_group=attn_cp_group,
            attn_tp_group=attn_tp_group,
            pp_group=params.pp_cache_group,
            storage_backend=storage_backend,
            host_swa_evict_fn=lambda n: cache.evict_host(n, ComponentType.SWA),
            device_swa_evict_fn=lambda n: _evict_swa_for_device_alloc(cache, n),
            host_mamba_evict_fn=lambda n: cache.evict_host(n, ComponentType.MAMBA),
            device_mamba_evict_fn=lambda n: _evict_mamba_for_device_alloc(cache, n),
            prefetch_threshold=prefetch_threshold,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
            enable_storage_metrics=enable_storage_metrics,
        )
        return StackBuildResult(
            host_pool_group=host_pool_group,
            cache_controller=cache_controller,
            component_host_pools={
                ComponentType.FULL: host_pool_group.get_pool(PoolName.KV),
                ComponentType.SWA: host_pool_group.get_pool(PoolName.SWA),
                ComponentType.MAMBA: host_pool_group.get_pool(PoolName.MAMBA),
            },
            register_req_to_token_counter=True,
            pools_desc="KV + SWA + MAMBA",
            sidecars=_mtp_swa_sidecar_specs(host_pool_group),
        )


class _MiniMaxSparseStrategy(StackStrategy):
    def matches(self, kvcache, components):
        from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

        return isinstance(kvcache, MiniMaxSparseKVPool) and components == {
            ComponentType.FULL
        }

    def build(
        self,
        *,
        cache,
        kvcache,
        params,
        server_args,
        load_cache_event,
        storage_backend=None,
        storage_backend_extra_config=None,
        prefetch_threshold=256,
        model_name=None,
        enable_storage_metrics=False,
    ):
        host_pool_group, cache_controller = build_minimax_sparse_hicache_stack(
            params=params,
            sparse_pool=kvcache,
            load_cache_event=load_cache_event,
            storage_backend=storage_backend,
            prefetch_threshold=prefetch_threshold,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
            enable_storage_metrics=enable_storage_metrics,
        )
        sidecars = []
        pools_desc = "KV"
        if kvcache.index_k_pool is not None:
            sidecars.append(
                SidecarPoolSpec(
                    pool_name=PoolName.INDEXER,
                    indices_from_pool=PoolName.KV,
                )
            )
            pools_desc = "KV + INDEXER(k-only)"
        return StackBuildResult(
            host_pool_group=host_pool_group,
            cache_controller=cache_controller,
            component_host_pools={
                ComponentType.FULL: host_pool_group.get_pool(PoolName.KV),
            },
            sidecars=sidecars,
            pools_desc=pools_desc,
        )


class _PlainKvStrategy(StackStrategy):
    def matches(self, kvcache, components):
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
        from sglang.srt.mem_cache.memory_pool import (
            DSATokenToKVPool,
            HybridLinearKVPool,
            MiniMaxSparseKVPool,
        )
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        if isinstance(
            kvcache,
            (
                SWAKVPool,
                HybridLinearKVPool,
                DSATokenToKVPool,
                MiniMaxSparseKVPool,
                DeepSeekV4TokenToKVPool,
            ),
        ):
            return False
        return components == {ComponentType.FULL}

    def build(
        self,
        *,
        cache,
        kvcache,
        params,
        server_args,
        load_cache_event,
        storage_backend=None,
        storage_backend_extra_config=None,
        prefetch_threshold=256,
        model_name=None,
        enable_storage_metrics=False,
    ):
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

        full_kv_pool = kvcache
        use_mla = isinstance(kvcache, MLATokenToKVPool)
        full_layer_mapping = {i: i for i in range(full_kv_pool.layer_num)}
        host_pool_group, cache_controller = build_kv_only_stack(
            params=params,
            kv_pool=full_kv_pool,
            full_layer_mapping=full_layer_mapping,
            load_cache_event=load_cache_event,
            storage_backend=storage_backend,
            use_mla=use_mla,
            prefetch_threshold=prefetch_threshold,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
            enable_storage_metrics=enable_storage_metrics,
        )
        return StackBuildResult(
            host_pool_group=host_pool_group,
            cache_controller=cache_controller,
            component_host_pools={
                ComponentType.FULL: host_pool_group.get_pool(PoolName.KV),
            },
            pools_desc="KV",
        )


class _DsaStrategy(StackStrategy):
    def matches(self, kvcache, components):
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        return isinstance(kvcache, DSATokenToKVPool) and components == {
            ComponentType.FULL
        }

    def build_direct_linker_pool_group(self, *, kvcache, params, page_size):
        from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
            _build_dsa_device_pool_group,
        )

        return _build_dsa_device_pool_group(
            kvcache, page_size, params.mtp_draft_device_pools
        )

    def build(
        self,
        *,
        cache,
        kvcache,
        params,
        server_args,
        load_cache_event,
        storage_backend=None,
        storage_backend_extra_config=None,
        prefetch_threshold=256,
        model_name=None,
        enable_storage_metrics=False,
    ):
        config = prepare_host_pool_config(
            decls=kvcache.host_pool_decls(),
            full_layer_mapping={i: i for i in range(kvcache.layer_num)},
            transfer_layer_id_max=kvcache.layer_num,
            transfer_page_size=params.page_size,
            packed_draft_device_pools=params.mtp_draft_device_pools,
        )
        host_pool_group = build_host_pool_group(config=config)
        cache_controller = HybridCacheController(
            params.token_to_kv_pool_allocator,
            host_pool_group,
            config.transfer_page_size,
            params.tp_cache_group,
            load_cache_event=load_cache_event,
            attn_cp_group=params.attn_cp_cache_group,
            attn_tp_group=params.attn_tp_cache_group,
            pp_group=params.pp_cache_group,
            write_policy=get_memory().hicache_write_policy,
            io_backend=get_memory().hicache_io_backend,
            storage_backend=storage_backend,
            prefetch_threshold=prefetch_threshold,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
            # The controller adds packed draft transfers after target layers.
            transfer_layer_id_max=kvcache.layer_num,
            enable_storage_metrics=enable_storage_metrics,
            host_memory_mode=get_memory().hicache_host_memory_mode,
        )
        return StackBuildResult(
            host_pool_group=host_pool_group,
            cache_controller=cache_controller,
            component_host_pools={
                ComponentType.FULL: host_pool_group.get_pool(PoolName.KV),
            },
            sidecars=[
                c.decl.sidecar_spec() for c in config.pools if not c.decl.is_primary
            ],
            pools_desc=" + ".join(c.decl.pool_name.value.upper() for c in config.pools),
            pool_declarations=tuple(c.decl for c in config.pools),
        )


# Resolved first-to-last; _PlainKvStrategy is the catch-all fallback.
_STRATEGIES: list[StackStrategy] = [
    _DeepSeekV4Strategy(),
    _MambaStrategy(),
    _SwaStrategy(),
    _MambaSwaStrategy(),
    _DsaStrategy(),
    _MiniMaxSparseStrategy(),
    _PlainKvStrategy(),
]


def register_stack_strategy(strategy: StackStrategy) -> None:
    """Prepend a strategy so downstream forks can plug in (kvcache, components)
    combinations not in the built-in list."""
    _STRATEGIES.insert(0, strategy)


def _select_strategy(kvcache: Any, components: set[ComponentType]) -> StackStrategy:
    for strategy in _STRATEGIES:
        if strategy.matches(kvcache, components):
            return strategy
    raise AssertionError(
        f"No matching HiCache strategy for kvcache={type(kvcache).__name__}, "
        f"components={sorted(c.name for c in components)}"
    )


# Strategies that assemble from host_pool_decls(), so every declared pool has an
# entry by construction. A miss here is a bug, not an unsupported combination.
_DECLARATION_VERIFIED_STRATEGIES: tuple[type, ...] = (_DsaStrategy, _MambaStrategy)


def _check_declared_pools_present(
    *, kvcache: Any, result: StackBuildResult, strategy: StackStrategy
) -> None:
    entries = result.host_pool_group.entry_map
    decls = result.pool_declarations
    if decls is None:
        decls = kvcache.host_pool_decls()
    missing = [d.pool_name.value for d in decls if d.pool_name not in entries]
    if not missing:
        return
    msg = (
        f"{type(kvcache).__name__} declares host pools {missing} that "
        f"{type(strategy).__name__} did not assemble"
    )
    if isinstance(strategy, _DECLARATION_VERIFIED_STRATEGIES):
        raise ValueError(msg)
    # Pre-declaration strategies: restoring KV without these pools (e.g. the
    # indexer's key buffers) corrupts sparse attention after a host hit.
    # Loud until the path is migrated.
    logger.error("%s; host restore of these pools is unsupported on this path", msg)


def _apply_stack_result(
    cache: UnifiedRadixCache,
    kvcache: Any,
    params: CacheInitParams,
    result: StackBuildResult,
) -> None:
    cache.host_pool_group = result.host_pool_group
    cache.cache_controller = result.cache_controller

    for ct, host_pool in result.component_host_pools.items():
        cache_attr, component_attr = _COMPONENT_HOST_ATTR[ct]
        setattr(cache, cache_attr, host_pool)
        setattr(cache.components[ct], component_attr, host_pool)

    for sidecar in result.sidecars:
        cache.register_sidecar_pool(sidecar)

    kvcache.register_layer_transfer_counter(result.cache_controller.layer_done_counter)
    if isinstance(kvcache, PageInterleaveKVPoolMixin):
        # Packed draft KV and indexer loads finish before target layer zero is
        # ready. Their independent gather streams must consume that same event.
        for draft_pool in params.mtp_draft_device_pools:
            draft_pool.register_layer_transfer_counter(
                result.cache_controller.layer_done_counter
            )
    if result.register_req_to_token_counter:
        params.req_to_token_pool.register_layer_transfer_counter(
            result.cache_controller.layer_done_counter
        )

    logger.info(
        "Attached hybrid pool stack to UnifiedRadixCache: pools=%s, transfer_layer_id_max=%s",
        result.pools_desc,
        result.cache_controller.transfer_layer_id_max,
    )


def attach_hybrid_pool_to_unified_cache(
    cache: UnifiedRadixCache,
    params: CacheInitParams,
    server_args: ServerArgs,
    *,
    load_cache_event,
    storage_backend: Optional[str] = None,
    storage_extra_config: Optional[dict] = None,
    storage_prefetch_threshold: int = 256,
) -> None:
    """Attach HostPoolGroup + HybridCacheController to UnifiedRadixCache."""
    try:
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        components = set(cache.components.keys())
        strategy = _select_strategy(kvcache, components)
        result = strategy.build(
            cache=cache,
            kvcache=kvcache,
            params=params,
            server_args=server_args,
            load_cache_event=load_cache_event,
            storage_backend=storage_backend,
            storage_backend_extra_config=storage_extra_config,
            prefetch_threshold=storage_prefetch_threshold,
            model_name=get_serving().served_model_name,
            enable_storage_metrics=cache._enable_metrics_flag,
        )
        _check_declared_pools_present(kvcache=kvcache, result=result, strategy=strategy)
        _apply_stack_result(cache, kvcache, params, result)
    except Exception:
        logger.exception("attach_hybrid_pool_to_unified_cache failed")
        raise


def build_minimax_sparse_hicache_stack(
    *,
    params: CacheInitParams,
    sparse_pool: Any,
    load_cache_event,
    storage_backend: Optional[str],
    prefetch_threshold: int = 256,
    model_name: Optional[str] = None,
    storage_backend_extra_config: Optional[dict] = None,
    enable_storage_metrics: bool = False,
) -> tuple[HostPoolGroup, HybridCacheController]:
    """KV (main_pool) + INDEXER (index_k_pool) host stack for MiniMax M3 sparse."""
    # Mappings are stage-local keyed (controller iterates 0..transfer_layer_id_max).
    # PP>1 stays gated below pending end-to-end validation of the sparse host path.
    if params.pp_size > 1:
        raise NotImplementedError(
            "MiniMax-M3 sparse HiCache does not support pipeline parallelism "
            "(pp_size>1) yet."
        )
    # The Unified-tree strategy path does not reject value-bearing index layers.
    if sparse_pool.index_kv_pool is not None:
        raise ValueError(
            "MiniMax sparse HiCache currently supports index-k-only sparse layers; "
            "index_kv_pool (value-bearing) layers are not cached/restored yet."
        )
    main_pool = sparse_pool.main_pool
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.minimax_m3_nvfp4_pool import MiniMaxM3Nvfp4KVPool

    nvfp4 = isinstance(sparse_pool, MiniMaxM3Nvfp4KVPool)
    host_size = get_memory().hicache_size
    if nvfp4:
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_bytes
        from sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4 import (
            MiniMaxM3Nvfp4IndexKPoolHost,
            MiniMaxM3Nvfp4MainKVPoolHost,
        )

        if get_memory().hicache_io_backend not in ("kernel", "direct"):
            raise ValueError("M3.1 NVFP4 HiCache requires kernel or direct IO")
        if get_memory().hicache_mem_layout not in (
            "layer_first",
            "page_first",
            "page_first_direct",
        ):
            raise ValueError("Unsupported M3.1 NVFP4 HiCache memory layout")
        index_pool = sparse_pool.index_k_pool
        main_bytes = sum(main_pool.get_kv_size_bytes()) / main_pool.total_slots
        index_bytes = sum(index_pool.get_kv_size_bytes()) / index_pool.total_slots
        draft_bytes = 0
        for draft_pool in params.sidecar_draft_device_pools:
            if (
                type(draft_pool) is not MHATokenToKVPool
                or draft_pool.size != main_pool.size
                or draft_pool.page_size != params.page_size
                or draft_pool.start_layer != 0
                or draft_pool.layer_num > main_pool.layer_num
            ):
                raise ValueError(
                    "M3.1 NVFP4 HiCache requires a dense MHA draft with matching "
                    "token capacity/page size and at most as many layers as the target"
                )
            draft_bytes += sum(draft_pool.get_kv_size_bytes()) / (
                draft_pool.size + draft_pool.page_size
            )
        total_bytes = main_bytes + index_bytes + draft_bytes
        # --hicache-size covers main KV, index payload/scales and draft sidecars.
        host_size *= main_bytes / total_bytes
        slots = (
            int(host_size * 1e9 // main_bytes)
            if host_size > 0
            else int(main_pool.size * get_memory().hicache_ratio)
        )
        slots = (slots // params.page_size + 1) * params.page_size
        if slots * total_bytes > host_memory_budget_bytes():
            raise ValueError(
                "Not enough host memory for M3.1 NVFP4 KV, index and draft caches"
            )
    start_layer = main_pool.start_layer
    transfer_layer_id_max = main_pool.layer_num
    # Stage-local keys (0..transfer_layer_id_max) match the controller's per-layer
    # load loop; values index the host pool's local layer buffer.
    full_layer_mapping = {
        layer_id: layer_id for layer_id in range(transfer_layer_id_max)
    }

    if nvfp4:
        kv_host_pool = MiniMaxM3Nvfp4MainKVPoolHost(
            main_pool.get_device_pool_infos()[0].buffer_info,
            get_memory().hicache_ratio,
            host_size,
            params.page_size,
            get_memory().hicache_mem_layout,
            allocator_type=_get_allocator_type(),
            device_capacity_tokens=main_pool.size,
            start_layer=main_pool.start_layer,
            end_layer=main_pool.end_layer,
        )
    else:
        kv_host_pool = build_kv_host_pool(
            kv_pool=main_pool,
            page_size=params.page_size,
            use_mla=False,
            host_size=host_size,
        )
    entries = [
        build_pool_entry(
            name=PoolName.KV,
            host_pool=kv_host_pool,
            device_pool=main_pool,
            layer_mapping=full_layer_mapping,
            transfer_layer_id_max=transfer_layer_id_max,
            is_anchor=True,
        ),
    ]

    index_k_pool = sparse_pool.index_k_pool
    if index_k_pool is not None:
        if nvfp4:
            index_host_pool = MiniMaxM3Nvfp4IndexKPoolHost(
                index_k_pool.get_device_pool_infos()[0].buffer_info,
                kv_host_pool,
                get_memory().hicache_mem_layout,
                allocator_type=_get_allocator_type(),
                start_layer=index_k_pool.start_layer,
                end_layer=index_k_pool.end_layer,
            )
        else:
            index_host_pool = MHATokenToKOnlyPoolHost(
                index_k_pool,
                kv_host_pool,
                get_memory().hicache_mem_layout,
                allocator_type=_get_allocator_type(),
            )
        entries.append(
            build_pool_entry(
                name=PoolName.INDEXER,
                host_pool=index_host_pool,
                device_pool=index_k_pool,
                layer_mapping={
                    gid - start_layer: sub_id
                    for gid, sub_id in sparse_pool.index_k_layer_id_mapping.items()
                },
                transfer_layer_id_max=transfer_layer_id_max,
            )
        )

    host_pool_group = HostPoolGroup(entries)
    cache_controller = HybridCacheController(
        params.token_to_kv_pool_allocator,
        host_pool_group,
        params.page_size,
        params.tp_cache_group,
        load_cache_event=load_cache_event,
        attn_cp_group=params.attn_cp_cache_group,
        attn_tp_group=params.attn_tp_cache_group,
        write_policy=get_memory().hicache_write_policy,
        io_backend=get_memory().hicache_io_backend,
        storage_backend=storage_backend,
        prefetch_threshold=prefetch_threshold,
        model_name=model_name,
        storage_backend_extra_config=storage_backend_extra_config,
        pp_group=params.pp_cache_group,
        transfer_layer_id_max=transfer_layer_id_max,
        enable_storage_metrics=enable_storage_metrics,
    )
    return host_pool_group, cache_controller
