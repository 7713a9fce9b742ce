from sglang.srt.mem_cache.storage.npu_memcache.npu_memcache_store import (
    NpuMemcacheStore,
)
