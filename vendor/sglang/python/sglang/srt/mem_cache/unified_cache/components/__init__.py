from sglang.srt.mem_cache.unified_cache.components.base import (
    _NUM_COMPONENT_TYPES,
    BASE_COMPONENT_TYPE,
    CacheTransferPhase,
    ComponentData,
    ComponentType,
    EvictLayer,
    ExternalLinkerLoadPhase,
    InternalStateBackup,
    LinkerTransferPhase,
    LRURefreshPhase,
    PrepareLoadBackResult,
    PreparePrefetchResult,
    TreeComponent,
    get_and_increase_time_counter,
    next_component_uuid,
)
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

__all__ = [
    "BASE_COMPONENT_TYPE",
    "ComponentData",
    "ComponentType",
    "ExternalLinkerLoadPhase",
    "InternalStateBackup",
    "LinkerTransferPhase",
    "EvictLayer",
    "FullComponent",
    "CacheTransferPhase",
    "LRURefreshPhase",
    "MambaComponent",
    "PrepareLoadBackResult",
    "PreparePrefetchResult",
    "SWAComponent",
    "TreeComponent",
    "_NUM_COMPONENT_TYPES",
    "next_component_uuid",
    "get_and_increase_time_counter",
]
