# Copyright 2025 SGLang Team
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
"""KV cache placement event recording.

Produces the ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events
consumed by KV-aware routers (e.g. dynamo). A cache holds one recorder and calls
it; the recorder owns the queue and needs nothing back from its owner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StorageMedium,
    kv_event_namespace_seed,
    namespaced_block_hash,
)
from sglang.srt.mem_cache.utils import (
    compute_node_event_hash_values,
    compute_node_hash_values,
    hash_str_to_int64,
)

if TYPE_CHECKING:
    from sglang.srt.lora.lora_registry import LoRARef

# Length of LoRARef.lora_id, a uuid4 or uuid5 hex string. Req adds the id to the
# end of extra_key, so the last 32 characters of extra_key are the id.
_LORA_ID_LEN = 32


class LoRANameTable:
    """Find the LoRA adapter name from the lora_id at the end of extra_key.

    Req adds lora_id to the end of extra_key, so a tree node has only the id.
    The table keeps all entries. A lora_id is not used again, and nodes of an
    unloaded adapter can publish stores until eviction.
    """

    def __init__(self):
        self._names: dict[str, str] = {}

    @classmethod
    def from_lora_refs(cls, lora_refs: Optional[Iterable[LoRARef]]) -> LoRANameTable:
        table = cls()
        for lora_ref in lora_refs or ():
            table.register(lora_id=lora_ref.lora_id, lora_name=lora_ref.lora_name)
        return table

    def register(self, *, lora_id: str, lora_name: str) -> None:
        self._names[lora_id] = lora_name

    def get(self, extra_key: Optional[str]) -> Optional[str]:
        return self.resolve(extra_key)

    def resolve(self, extra_key: Optional[str]) -> Optional[str]:
        if not extra_key:
            return None
        return self._names.get(extra_key[-_LORA_ID_LEN:])


class KvEventLoraNames(LoRANameTable):
    """Public names of selected LoRA namespaces, kept for the publisher lifetime.

    Write-back can publish a host store after the last GPU removal and after
    its request dies, so request or published-block counts cannot bound this.
    """

    def __init__(self):
        # Adapter-id registrations keep the existing Dynamo load-time lookup.
        self._adapter_names: dict[str, str] = {}
        self._names: dict[str, str] = {}

    def register(
        self,
        req: Any = None,
        lora_name: Optional[str] = None,
        *,
        lora_id: Optional[str] = None,
    ) -> None:
        """Name ``req``'s namespace; ``req`` needs ``extra_key`` and ``lora_id``."""
        if lora_id is not None:
            self._adapter_names[lora_id] = lora_name
            return
        if req.lora_id is None:
            return
        # Older IPC senders omit the optional name; admission still resolves an ID.
        lora_name = lora_name or self._adapter_names.get(req.lora_id)
        if not lora_name:
            return
        self._names[req.extra_key] = lora_name

    def get(self, extra_key: Optional[str]) -> Optional[str]:
        return self._names.get(extra_key)

    def resolve(self, extra_key: Optional[str]) -> Optional[str]:
        if not extra_key:
            return None
        return self._names.get(extra_key) or self._adapter_names.get(
            extra_key[-_LORA_ID_LEN:]
        )


class KVCacheEventRecorder:
    """Collects KV placement events for one cache.

    ``enabled=False`` makes every ``record_*`` call a no-op and ``take`` return an
    empty list, so callers never have to guard.
    """

    def __init__(
        self,
        *,
        enabled: bool,
        page_size: int,
        dynamo_format: bool = False,
        lora_names: Optional[KvEventLoraNames] = None,
    ):
        self.enabled = enabled
        self.page_size = page_size
        self.dynamo_format = dynamo_format
        self.lora_names = lora_names if lora_names is not None else KvEventLoraNames()
        self._queue: list = []

    def enqueue(self, event) -> None:
        """Append an event, coalescing it with a compatible queue tail.

        KV event batches already support multiple block hashes.  Combining them
        here avoids emitting one event per page while preserving ordering and
        the parent-linked store chains consumers use to rebuild the cache tree.
        """
        if self._queue:
            tail = self._queue[-1]

            if isinstance(tail, BlockRemoved) and isinstance(event, BlockRemoved):
                if tail.medium == event.medium:
                    tail.block_hashes.extend(event.block_hashes)
                    return

            elif isinstance(tail, BlockStored) and isinstance(event, BlockStored):
                if (
                    tail.medium == event.medium
                    and tail.lora_id == event.lora_id
                    and tail.block_size == event.block_size
                    and tail.cache_salt == event.cache_salt
                    and tail.session_id == event.session_id
                    and tail.lora_name == event.lora_name
                    and tail.block_hashes
                    and event.parent_block_hash == tail.block_hashes[-1]
                ):
                    tail.block_hashes.extend(event.block_hashes)
                    tail.token_ids.extend(event.token_ids)
                    return

        self._queue.append(event)

    def _node_event_hash_values(self, node: Any) -> list:
        """Hash values to publish for ``node``, computing them if not yet set."""
        if node.hash_value is None:
            node.hash_value = compute_node_hash_values(node, self.page_size)
        if node.key.extra_key is None and node.key.cache_salt is None:
            return node.hash_value
        return compute_node_event_hash_values(node, self.page_size)

    def _parent_block_hash(self, node: Any) -> Optional[int]:
        """The hash the first page of ``node`` links back to.

        ``None`` when the parent is the tree root: a root carries an empty
        ``hash_value`` and no event hash, so it contributes no link. Every other
        node on the path has a parent, which is what distinguishes the two.
        """
        parent = node.parent
        if parent is None or parent.parent is None:
            return None
        if node.key.extra_key is not None or node.key.cache_salt is not None:
            parent_hash_values = parent.event_hash_value
            assert parent_hash_values is not None
        else:
            parent_hash_values = parent.hash_value
        if not parent_hash_values:
            return None
        return hash_str_to_int64(parent_hash_values[-1])

    def _namespace_seed(self, node: Any) -> Optional[bytes]:
        if not self.dynamo_format:
            return kv_event_namespace_seed(
                extra_key=(
                    node.key.extra_key
                    if self.lora_names.get(node.key.extra_key) is not None
                    else None
                ),
                cache_salt=None,
            )
        return kv_event_namespace_seed(
            extra_key=node.key.extra_key, cache_salt=node.key.cache_salt
        )

    def record_store(
        self, node: Any, medium=None, *, session_id: Optional[str] = None
    ) -> None:
        # One BlockStored per ``page_size`` chunk.
        # ``medium`` defaults to StorageMedium.GPU but callers may override
        # for lower-tier insertions (e.g. StorageMedium.CPU for host/L2 cache).
        if not self.enabled:
            return
        if medium is None:
            medium = StorageMedium.GPU

        event_hash_values = self._node_event_hash_values(node)
        namespace_seed = self._namespace_seed(node)
        parent_block_hash = self._parent_block_hash(node)
        if parent_block_hash is not None:
            parent_block_hash = namespaced_block_hash(
                parent_block_hash, namespace_seed=namespace_seed
            )
        lora_name = (
            self.lora_names.resolve(node.key.extra_key)
            if self.dynamo_format
            else self.lora_names.get(node.key.extra_key)
        )

        page_index = 0
        logical_len = len(node.key)
        is_bigram = node.key.is_bigram
        raw = node.key.token_ids
        for start in range(0, logical_len, self.page_size):
            end = min(start + self.page_size, logical_len)
            if end <= start:
                continue
            # Preserve historical event payload: bigram pages expose tuples.
            if is_bigram:
                page_tokens = [(raw[j], raw[j + 1]) for j in range(start, end)]
            else:
                page_tokens = list(raw[start:end])

            block_hash = namespaced_block_hash(
                hash_str_to_int64(event_hash_values[page_index]),
                namespace_seed=namespace_seed,
            )

            self.enqueue(
                BlockStored(
                    block_hashes=[block_hash],
                    parent_block_hash=parent_block_hash,
                    token_ids=page_tokens,
                    block_size=len(page_tokens),
                    lora_id=None,
                    medium=medium,
                    cache_salt=node.key.cache_salt,
                    session_id=session_id,
                    lora_name=lora_name,
                )
            )

            parent_block_hash = block_hash
            page_index += 1

    def record_remove(self, node: Any, medium=None) -> None:
        # One BlockRemoved per radix node.
        # ``medium`` defaults to StorageMedium.GPU but callers may override for
        # lower-tier removals (e.g. StorageMedium.CPU when evicting from host).
        if not self.enabled:
            return
        if medium is None:
            medium = StorageMedium.GPU

        # Hash values must match what was stored.
        event_hash_values = self._node_event_hash_values(node)
        namespace_seed = self._namespace_seed(node)

        block_hashes = []
        logical_len = len(node.key)
        page_index = 0
        for start in range(0, logical_len, self.page_size):
            end = min(start + self.page_size, logical_len)
            if end <= start:
                continue

            block_hashes.append(
                namespaced_block_hash(
                    hash_str_to_int64(event_hash_values[page_index]),
                    namespace_seed=namespace_seed,
                )
            )
            page_index += 1

        if block_hashes:
            self.enqueue(BlockRemoved(block_hashes=block_hashes, medium=medium))

    def record_all_cleared(self) -> None:
        if not self.enabled:
            return
        self.enqueue(AllBlocksCleared())

    def take(self) -> list:
        """Atomically takes all events and clears the queue.

        Returns:
            A list of KV cache events.
        """
        if not self.enabled:
            return []
        events = self._queue
        self._queue = []
        return events
