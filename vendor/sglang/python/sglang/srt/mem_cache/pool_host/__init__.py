from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

__all__ = [
    "HostKVCache",
    "HostPoolGroup",
    "HostTensorAllocator",
    "PoolEntry",
]
