"""The radix tree mechanism.

``UnifiedTreeCore`` owns the tree's member-var state -- the tree structure (root
node), the per-component LRU lists, the per-component size counters, the
evictable device/host leaf sets, and the empty match result -- plus ``reset()``.
It also defines the tree's building blocks (``UnifiedTreeNode``,
``UnifiedLRUList``).

The cache builds the component drivers and passes them in; the tree holds them
(``self.components_by_type``) to drive their tree-level hooks. The components hold the
cache for cache-level logic, but the TreeCore itself never touches it.
"""

# TODO(Jialin): Split this file into smaller cohesive modules (e.g. tree
# building blocks, insert/match walks, eviction drivers).

from __future__ import annotations

import logging
import sys
from array import array
from collections import defaultdict
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

import msgspec
import torch

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    DecLockRefResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    _dfs_weight_order,
)
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.hicache_storage import (
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.cache_action import (
    BackupKV,
    CacheAction,
    ComponentAction,
    FreeDeviceKV,
    FreeDeviceKVFullOnly,
    UpdatePendingBackupOnNodeSplit,
)
from sglang.srt.mem_cache.unified_cache.components import (
    _NUM_COMPONENT_TYPES,
    BASE_COMPONENT_TYPE,
    CacheTransferPhase,
    ComponentData,
    ComponentType,
    EvictLayer,
    InternalStateBackup,
    LinkerTransferPhase,
    LRURefreshPhase,
    TreeComponent,
    get_and_increase_time_counter,
)
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import (
    BufferBackupSnapshot,
    BufferBackupState,
    DecSwaLockOnlyResult,
    DemoteResult,
    DriveHostEvictionResult,
    DropSubtreeNoHostResult,
    EvictDeviceLeafResult,
    EvictDeviceNextNodeResult,
    InsertStepResult,
    NodeId,
    RadixCacheWalkResult,
    TreePathNodeInfo,
    UnifiedTreeCoreInterface,
)
from sglang.srt.mem_cache.utils import (
    compute_node_hash_values,
    get_eviction_strategy,
    split_node_hash_value,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

logger = logging.getLogger(__name__)

# 42 bits: digest * 1000003 (< 2^20) stays under 2^62, so the update never
# overflows int64 with plain (non-wrapping) arithmetic in the Rust port, and
# the TP consistency check can still all_reduce [digest, -digest] in int64.
_RECLAIM_DIGEST_MASK = (1 << 42) - 1


class StorageBackupSpec(NamedTuple):
    """A node's device->storage backup spec, gathered tree-side."""

    host_value: torch.Tensor
    token_ids: array
    hash_value: list[str]
    prefix_keys: Optional[list[str]]
    comp_xfers: dict[ComponentType, list[PoolTransfer]]


class UnifiedTreeNode:
    counter = 0

    def __init__(self, tree_components: tuple[ComponentType, ...], priority: int = 0):
        # Plain dict (not defaultdict): a missing-key read must raise, never
        # silently mint an unregistered node outside the TreeCore arena.
        self.children: dict[Any, UnifiedTreeNode] = {}
        self.parent: UnifiedTreeNode | None = None
        self.key: Optional[RadixKey] = None
        self.component_types = tree_components
        # list indexed by ComponentType (int enum 0..N-1)
        self.component_data: list[ComponentData] = [
            ComponentData() for _ in range(_NUM_COMPONENT_TYPES)
        ]
        self.last_access_time = get_and_increase_time_counter()
        self.creation_time = get_and_increase_time_counter()
        self.hash_value = None
        # Namespace-aware hashes used only for external KV events.
        self.event_hash_value: Optional[list[str]] = None
        self.hit_count = 0
        # T-LRU only (0 under other policies): tokens root -> self, and the
        # branch's high-water depth, which survives tail trimming.
        self._tlru_cached_prefix_len = 0
        self._tlru_history_len = 0
        self.external_cache_stored = False
        self.priority = priority
        self.lru_prev: list[UnifiedTreeNode | None] = [None] * (
            _NUM_COMPONENT_TYPES * 2
        )
        self.lru_next: list[UnifiedTreeNode | None] = [None] * (
            _NUM_COMPONENT_TYPES * 2
        )
        self.id = UnifiedTreeNode.counter
        UnifiedTreeNode.counter += 1
        self.write_through_pending_id: Optional[int] = None
        # Anchor NodeId of an in-flight H->D load-back reading this node's
        # host slots; such host copies must not be reclaimed until the ack.
        self.load_back_pending_id: Optional[int] = None
        # Logical-page KV sharding: rotation base of the chain this node's Full
        # KV pages belong to — the owner rank of position-page P along the chain
        # is (rotation_base + P) % shard_size. A host-side mirror of the
        # loc-derived owners (the Full value is a device tensor; reading it
        # would put a D2H sync on the alloc path): set at insert from the
        # inserting request's host base, copied on split, read through
        # req.last_node at alloc time. None when sharding is off.
        self.rotation_base: Optional[int] = None

    def component(self, component_type: ComponentType) -> ComponentData:
        return self.component_data[component_type]

    @property
    def backuped(self) -> bool:
        """Tree-level: Full KV present on host."""
        return self.component_data[ComponentType.FULL].host_value is not None

    @property
    def evicted(self) -> bool:
        """Tree-level: Full KV not on device (non-root with value=None)."""
        return (
            self.parent is not None
            and self.component_data[ComponentType.FULL].value is None
        )

    def __lt__(self, other: UnifiedTreeNode):
        return self.last_access_time < other.last_access_time

    def get_last_hash_value(self) -> Optional[str]:
        if self.hash_value is None or len(self.hash_value) == 0:
            return None
        return self.hash_value[-1]

    def get_prefix_hash_values(self, node: UnifiedTreeNode) -> list[str]:
        chunks = []
        while node is not None and node.hash_value is not None:
            chunks.append(node.hash_value)
            node = node.parent
        return [value for chunk in reversed(chunks) for value in chunk]


def _set_tlru_lens_and_raise_history(
    node: UnifiedTreeNode, parent: UnifiedTreeNode
) -> None:
    """Record a new node's path depth and raise the branch high-water mark.

    The walk stops early only at an ancestor whose subtree already reached this
    depth (e.g. under a deeper sibling); a conversation that keeps setting a new
    high-water mark walks its whole root path, so an insert costs O(path nodes)
    in the worst case. The path length is bounded by the number of node segments
    (roughly extend/split operations, not tokens), and the walk only runs under
    --radix-eviction-policy tlru.
    """
    assert node.key is not None
    node._tlru_cached_prefix_len = parent._tlru_cached_prefix_len + len(node.key)
    if node._tlru_history_len < node._tlru_cached_prefix_len:
        node._tlru_history_len = node._tlru_cached_prefix_len
    cur = parent
    while cur is not None and cur._tlru_history_len < node._tlru_cached_prefix_len:
        cur._tlru_history_len = node._tlru_cached_prefix_len
        cur = cur.parent


class UnifiedLRUList:
    def __init__(
        self,
        component_type: ComponentType,
        tree_components: tuple[ComponentType, ...],
        use_host_ptr: bool = False,
        is_referenced: Optional[Callable[[UnifiedTreeNode], bool]] = None,
    ):
        self.component_type = component_type
        # Pointer slot: host LRU uses offset slots so device/host pointers
        # never collide on the same node.
        self._pt: int = component_type + (_NUM_COMPONENT_TYPES if use_host_ptr else 0)
        self.head = UnifiedTreeNode(tree_components)
        self.tail = UnifiedTreeNode(tree_components)
        self.head.lru_next[self._pt] = self.tail
        self.tail.lru_prev[self._pt] = self.head
        self.cache: dict[int, UnifiedTreeNode] = {}
        # Session partition: [head .. mid) holds session-referenced nodes and
        # (mid .. tail] unreferenced ones, so evictions directly walks (tail -> head).
        self._is_referenced = is_referenced
        self.mid: Optional[UnifiedTreeNode] = None
        self.cursor: Optional[UnifiedTreeNode] = None
        if is_referenced is not None:
            self.mid = UnifiedTreeNode(tree_components)
            self.cursor = UnifiedTreeNode(tree_components)
            for ct in tree_components:
                for node in (self.mid, self.cursor):
                    node.component_data[ct].lock_ref = 1
                    node.component_data[ct].host_lock_ref = 1
            self._add_node_after(self.head, self.mid)

    def _add_node_after(self, prev_node: UnifiedTreeNode, new_node: UnifiedTreeNode):
        pt = self._pt
        new_node.lru_prev[pt] = prev_node
        new_node.lru_next[pt] = prev_node.lru_next[pt]
        prev_node.lru_next[pt].lru_prev[pt] = new_node
        prev_node.lru_next[pt] = new_node

    def _add_node(self, node: UnifiedTreeNode):
        if self._is_referenced is None or self._is_referenced(node):
            self._add_node_after(self.head, node)
        else:
            self._add_node_after(self.mid, node)

    def _remove_node(self, node: UnifiedTreeNode):
        pt = self._pt
        node.lru_prev[pt].lru_next[pt] = node.lru_next[pt]
        node.lru_next[pt].lru_prev[pt] = node.lru_prev[pt]
        # Clear self pointers to break reference cycles among evicted nodes.
        node.lru_prev[pt] = None
        node.lru_next[pt] = None

    def insert_mru(self, node: UnifiedTreeNode):
        assert node.id not in self.cache
        self.cache[node.id] = node
        self._add_node(node)

    def insert_after(self, prev_node: UnifiedTreeNode, node: UnifiedTreeNode):
        assert prev_node.id in self.cache
        assert node.id not in self.cache
        self.cache[node.id] = node
        self._add_node_after(prev_node, node)

    def remove_node(self, node: UnifiedTreeNode):
        assert node.id in self.cache
        del self.cache[node.id]
        self._remove_node(node)

    def reset_node_mru(self, node: UnifiedTreeNode):
        assert node.id in self.cache
        self._remove_node(node)
        self._add_node(node)

    def cursor_begin(self):
        if self.cursor.lru_prev[self._pt] is not None:
            self._remove_node(self.cursor)
        self._add_node_after(self.tail.lru_prev[self._pt], self.cursor)

    def cursor_next(self, *, host_lock: bool = False):
        pt = self._pt
        ct = self.component_type
        x = self.cursor.lru_prev[pt]
        while x is not self.head:
            cd = x.component_data[ct]
            if (cd.host_lock_ref if host_lock else cd.lock_ref) == 0:
                break
            x = x.lru_prev[pt]
        if x is self.head:
            return None
        self._remove_node(self.cursor)
        self._add_node_after(x.lru_prev[pt], self.cursor)
        return x

    def cursor_end(self):
        """Unlink the walk-cursor sentinel after a walk."""
        self._remove_node(self.cursor)

    def reset_node_and_parents_mru(
        self,
        node: UnifiedTreeNode,
        root_node: UnifiedTreeNode,
        should_include,
    ):
        is_referenced = self._is_referenced
        prev_ref = self.head
        prev_unref = self.head if self.mid is None else self.mid
        while node != root_node:
            if should_include(node):
                assert node.id in self.cache
                part = is_referenced is None or is_referenced(node)
                self._remove_node(node)
                if part:
                    self._add_node_after(prev_ref, node)
                    prev_ref = node
                else:
                    self._add_node_after(prev_unref, node)
                    prev_unref = node
            node = node.parent

    def reset_node_and_window_ancestors_mru(
        self,
        node: UnifiedTreeNode,
        root_node: UnifiedTreeNode,
        window_size: int,
        should_include,
    ):
        is_referenced = self._is_referenced
        prev_ref = self.head
        prev_unref = self.head if self.mid is None else self.mid
        accumulated = 0
        while node != root_node and accumulated < window_size:
            if should_include(node):
                assert node.id in self.cache
                part = is_referenced is None or is_referenced(node)
                self._remove_node(node)
                if part:
                    self._add_node_after(prev_ref, node)
                    prev_ref = node
                else:
                    self._add_node_after(prev_unref, node)
                    prev_unref = node
            accumulated += len(node.key)
            node = node.parent

    def in_list(self, node: Optional[UnifiedTreeNode]):
        return node is not None and node.id in self.cache

    def get_prev_no_lock(self, node: UnifiedTreeNode, check_id: bool = True):
        if check_id:
            assert node.id in self.cache
        pt = self._pt
        ct = self.component_type
        x = node.lru_prev[pt]
        while x.component_data[ct].lock_ref > 0:
            x = x.lru_prev[pt]
        if x == self.head:
            return None
        return x

    def get_prev_no_host_lock(self, node: UnifiedTreeNode, check_id: bool = True):
        """Host-LRU walker: skip nodes whose component host_lock_ref > 0."""
        if check_id:
            assert node.id in self.cache
        pt = self._pt
        ct = self.component_type
        x = node.lru_prev[pt]
        while x.component_data[ct].host_lock_ref > 0:
            x = x.lru_prev[pt]
        if x == self.head:
            return None
        return x

    def get_lru_no_lock(self):
        return self.get_prev_no_lock(self.tail, check_id=False)

    def get_lru_no_host_lock(self):
        return self.get_prev_no_host_lock(self.tail, check_id=False)


# WALK -> OVERLAP (live nodes) -> COMMIT (leaf + hooks) -> TAIL (refresh + backup).
class _InsertPhase(Enum):
    WALK = auto()
    OVERLAP = auto()
    COMMIT = auto()
    TAIL = auto()


class _InsertWalkState(msgspec.Struct):
    """In-flight resumable-insert state persisted across step barriers."""

    phase: _InsertPhase
    node: UnifiedTreeNode
    key: RadixKey
    value: torch.Tensor
    params: InsertParams
    priority: int
    result: InsertResult
    total_prefix_length: int = 0
    is_new_leaf: bool = False
    target_node: Optional[UnifiedTreeNode] = None
    overlap_node: Optional[UnifiedTreeNode] = None
    overlap_prefix_len: int = 0
    # Emitted actions awaiting the next barrier flush (or the final step).
    pending_actions: list[CacheAction | ComponentAction] = []


class UnifiedTreeCore(UnifiedTreeCoreInterface):
    """The radix tree mechanism: owns the tree structure, per-node values, the
    per-component LRUs, the size/leaf bookkeeping, and the component drivers,
    plus ``reset()``.

    """

    def __init__(
        self,
        params: CacheInitParams,
        components: dict[ComponentType, TreeComponent],
    ):
        self.page_size = params.page_size
        self.is_eagle = params.is_eagle and ComponentType.MAMBA not in components
        self.enable_hicache = False
        self.is_host_memory_buffer_only = False
        self.enable_storage = False
        self.enable_external_cache_linker = False
        self.write_through_threshold = 256
        self.is_write_back = False
        self.has_swa_host_pool = False
        self.enable_session_radix_cache = params.enable_session_radix_cache
        self.eviction_strategy = get_eviction_strategy(
            params.eviction_policy.lower(), params.eviction_policy_config
        )
        # The node _tlru_* lens are read only by TLRUStrategy.get_priority;
        # every other policy skips the per-insert bookkeeping entirely.
        self.tlru_bookkeeping = params.eviction_policy.lower() == "tlru"

        # ``device`` is derived from the construction-time allocator; the
        # allocator/pool themselves are owned by the cache, not the tree.
        if params.token_to_kv_pool_allocator:
            self.device = params.token_to_kv_pool_allocator.device
        else:
            self.device = torch.device("cpu")

        # The cache builds and owns the component drivers; the tree references
        # them to drive their tree-level hooks, attaching itself as tree_core.
        assert components
        self.component_types = tuple(components.keys())
        self.components_by_type: dict[ComponentType, TreeComponent] = components
        for component in components.values():
            component.tree_core = self
        self.components: tuple[TreeComponent, ...] = tuple(
            self.components_by_type.values()
        )

        self.kv_events = KVCacheEventRecorder(
            enabled=params.enable_kv_cache_events,
            page_size=self.page_size,
            dynamo_format=params.dynamo_kv_event_format,
            lora_names=params.kv_event_lora_names,
        )

        self.reset()

    # ==== Tree API ====

    def _session_lru_predicate(self, ct: ComponentType):
        if not self.enable_session_radix_cache or ct is ComponentType.FULL:
            return None
        return lambda node: node.component_data[ct].session_ref > 0

    def reset(self) -> None:
        """Rebuild the root, LRUs, sizes, evictable-leaf sets, and the empty
        match result."""
        # End suspended walks while their session-cursor sentinels still
        # belong to the old LRUs, clearing any pending internal victim.
        for component in self.components:
            if component.is_evict_device_ongoing:
                component.evict_device_end()
        # Internal victims awaiting the controller's backup and finish call.
        self._pending_internal_evictions: dict[ComponentType, NodeId] = {}
        # Maintains the NodeId -> active tree node mapping.
        self._node_arena: dict[NodeId, UnifiedTreeNode] = {}

        # The single in-flight resumable insert, if suspended at a barrier.
        self._ongoing_insert_walk_state: Optional[_InsertWalkState] = None
        self._tracked_unbacked_tokens = 0
        self._is_tracking_unbacked_tokens = False

        self.root_node = self._new_node()
        self.root_node.priority = -sys.maxsize
        self.root_node.key = RadixKey(array("q"), None)
        self.root_node.component_data[BASE_COMPONENT_TYPE].value = []
        self.root_node.hash_value = []
        for ct in self.component_types:
            self.root_node.component_data[ct].lock_ref = 1

        self.component_evictable_size_ = {ct: 0 for ct in self.component_types}
        self.component_protected_size_ = {ct: 0 for ct in self.component_types}

        self.lru_lists = {
            ct: UnifiedLRUList(
                ct, self.component_types, is_referenced=self._session_lru_predicate(ct)
            )
            for ct in self.component_types
        }

        self.evictable_device_leaves: set[UnifiedTreeNode] = set()
        self.evictable_host_leaves: set[UnifiedTreeNode] = set()
        self.host_lru_lists = {
            ct: UnifiedLRUList(
                ct,
                self.component_types,
                use_host_ptr=True,
                is_referenced=self._session_lru_predicate(ct),
            )
            for ct in self.component_types
        }
        # Full KV on both tiers -> redundant host copy, reclaimed first by
        # write_back; insertion-ordered dict keeps victims TP-deterministic.
        self.full_host_duplicates: dict[NodeId, UnifiedTreeNode] = {}
        # Rolling digest of reclaim victim ids, cross-checked across TP ranks.
        self.write_back_duplicate_reclaim_digest: int = 0

        self._empty_device_indices = torch.empty(
            (0,), dtype=torch.int64, device=self.device
        )
        self._empty_match_result = MatchResult(
            device_prefix_len=0,
            last_device_node=self.root_node.id,
            last_host_node=self.root_node.id,
            best_match_node=self.root_node.id,
            cache_actions=[],
        )

    def node_by_id(self, node_id: NodeId) -> UnifiedTreeNode:
        """Resolve a NodeId back to its tree node.

        TODO(Jialin): Make TreeCore-internal after the Unified Radix Cache split.
        """
        return self._node_arena[node_id]

    def is_write_through_compatible(self) -> bool:
        for node in self._node_arena.values():
            if node is self.root_node:
                continue
            full_host = node.component_data[BASE_COMPONENT_TYPE].host_value
            if full_host is None:
                if any(
                    node.component_data[ct].host_value is not None
                    for ct in self.component_types
                    if ct != BASE_COMPONENT_TYPE
                ):
                    return False
            elif node.parent is not self.root_node and not node.parent.backuped:
                return False
        return True

    def is_backuped(self, node_id: NodeId) -> bool:
        """Whether the node's KV is already backed up to host."""
        return self._node_arena[node_id].backuped

    def is_root(self, node_id: NodeId) -> bool:
        """Whether the node is the tree root."""
        return self.node_by_id(node_id) is self.root_node

    supports_rotation_base = True

    def rotation_base_of(self, node_id: NodeId) -> Optional[int]:
        """Logical-page KV sharding: the node's chain rotation base, or None
        when sharding is off (and on the root, which starts no chain)."""
        return self.node_by_id(node_id).rotation_base

    def rotation_phase_of(self, node_id: NodeId) -> Optional[int]:
        """Logical-page KV sharding: rotation_base plus the node's first
        position-page (host backups draw slots of the same owners)."""
        node = self.node_by_id(node_id)
        if node.rotation_base is None:
            return None
        prefix_len = 0
        parent = node.parent
        while parent is not None:
            prefix_len += len(parent.key)
            parent = parent.parent
        return node.rotation_base + prefix_len // self.page_size

    def get_last_hash_value(self, node_id: NodeId) -> Optional[str]:
        """The node's last page hash, or None when it was never hashed."""
        return self.node_by_id(node_id).get_last_hash_value()

    def get_prefix_hash_values(self, node_id: NodeId) -> list[str]:
        """The hash chain of the node's ancestors, in root-to-parent order."""
        node = self.node_by_id(node_id)
        return node.get_prefix_hash_values(node.parent)

    def get_hash_values(self, node_id: NodeId) -> list[str]:
        """The hash values owned by this node, excluding its ancestors."""
        return self.node_by_id(node_id).hash_value or []

    def snapshot_buffer_backup(
        self, node_id: NodeId, pass_prefix_keys: bool
    ) -> Optional[BufferBackupSnapshot]:
        node = self._node_arena.get(node_id)
        if (
            node is None
            or node is self.root_node
            or not node.hash_value
            or node.component_data[BASE_COMPONENT_TYPE].value is None
        ):
            return None
        parent = node.parent
        assert parent is not None and node.key is not None
        return BufferBackupSnapshot(
            node_id=node.id,
            parent_node_id=parent.id,
            parent_is_root=parent is self.root_node,
            parent_last_hash=parent.get_last_hash_value(),
            hash_values=list(node.hash_value),
            key=RadixKey(
                array("q", node.key.raw_token_ids()),
                extra_key=node.key.extra_key,
                is_bigram=node.key.is_bigram,
                cache_salt=node.key.cache_salt,
            ),
            prefix_keys=(
                node.get_prefix_hash_values(parent) if pass_prefix_keys else None
            ),
        )

    def validate_buffer_backup(
        self, node_id: NodeId, expected_key_length: int
    ) -> Optional[BufferBackupState]:
        node = self._node_arena.get(node_id)
        if (
            node is None
            or node.component_data[BASE_COMPONENT_TYPE].value is None
            or len(node.key) != expected_key_length
        ):
            return None
        parent = node.parent
        if parent is None:
            return None
        return BufferBackupState(
            parent_node_id=parent.id,
            parent_is_root=parent is self.root_node,
            parent_last_hash=parent.get_last_hash_value(),
        )

    def backfill_missing_hash_values(self) -> int:
        """Hash every node that was built while storage was disabled.

        Page hashes chain from the parent's last hash, so a node whose parent has
        none restarts the chain mid-sequence: its keys then encode only a suffix
        of the prefix they claim to represent, which would alias unrelated
        requests that happen to start with those tokens. Walks parent-before-child
        so each node hashes against an already-filled parent. Returns the number
        of nodes filled.
        """
        filled = 0
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            # The root anchors every chain and is seeded with an empty hash list.
            if node is not self.root_node and node.hash_value is None:
                node.hash_value = compute_node_hash_values(node, self.page_size)
                filled += 1
            stack.extend(node.children.values())
        return filled

    def root_node_handle(self, extra_key: Optional[str] = None) -> NodeId:
        """The NodeId anchoring matches; the single root serves every namespace."""
        return self.root_node.id

    def dfs_weight_order(self, node_ids: Sequence[NodeId]) -> list[int]:
        return _dfs_weight_order(self.root_node, node_ids, self.node_by_id)

    def collect_path_info(
        self, end_node_ids: Sequence[NodeId]
    ) -> tuple[tuple[TreePathNodeInfo, ...], ...]:
        paths = []
        for node_id in end_node_ids:
            node = self.node_by_id(node_id)
            chain = []
            while node is not self.root_node:
                chain.append(node)
                node = node.parent
            path = []
            start = 0
            for node in reversed(chain):
                end = start + len(node.key)
                value = node.component_data[BASE_COMPONENT_TYPE].value
                path.append(
                    TreePathNodeInfo(
                        node.id,
                        node.parent.id,
                        start,
                        end,
                        None if value is None else len(value),
                        len(node.children),
                    )
                )
                start = end
            paths.append(tuple(path))
        return tuple(paths)

    def _new_node(self, priority: int = 0) -> UnifiedTreeNode:
        """Create and register a tree node in the arena."""
        node = UnifiedTreeNode(self.component_types, priority=priority)
        self._register_node(node)
        return node

    def _register_node(self, node: UnifiedTreeNode) -> None:
        """Register a tree node in the arena."""
        self._node_arena[node.id] = node

    def _unregister_node(self, node: UnifiedTreeNode) -> None:
        """Drop a tree node from the arena."""
        self._node_arena.pop(node.id, None)

    def inc_lock_ref(
        self, node_id: NodeId, skip_lock_components: Sequence[ComponentType] = ()
    ) -> IncLockRefResult:
        node = self.node_by_id(node_id)
        skipped = tuple(skip_lock_components)
        # The receipt records the anchor and what was locked; the paired dec
        # replays exactly that.
        result = IncLockRefResult(node_id=node.id, skipped_lock_components=skipped)
        for component in self.components:
            if component.component_type in skipped:
                continue
            result = component.acquire_component_lock(node=node, result=result)
        self._update_evictable_leaf_sets(node)
        return result

    @staticmethod
    def _assert_receipt_anchor(node: UnifiedTreeNode, params: DecLockRefParams) -> None:
        """A receipt releases only the node its acquire returned; a mispaired
        or unanchored one would silently release (or steal) another holder's segment."""
        assert params.node_id == node.id, (
            f"lock receipt anchored on node {params.node_id} released on node {node.id}"
        )

    def _release_components(
        self,
        node: UnifiedTreeNode,
        params: DecLockRefParams,
        *,
        lock_host: bool = False,
        skip_swa_and_below: bool = False,
    ) -> None:
        """Release each component this receipt acquired. Auxiliaries go first
        so Full, whose walk refreshes leaf membership on every node it
        unlocks, sees their final refs; the auxiliary walks also refresh the
        nodes they unlock, so the order is not load-bearing for the sets."""
        swa_priority = None
        if skip_swa_and_below:
            swa_component = self.components_by_type.get(ComponentType.SWA)
            if swa_component is not None:
                swa_priority = swa_component.eviction_priority(is_leaf=False)
        for component in reversed(self.components):
            ct = component.component_type
            if ct in params.skipped_lock_components:
                continue
            if swa_priority is not None and (
                ct == ComponentType.SWA
                or component.eviction_priority(is_leaf=False) < swa_priority
            ):
                continue
            component.release_component_lock(
                node=node, params=params, lock_host=lock_host
            )

    def dec_lock_ref(
        self,
        node_id: NodeId,
        params: DecLockRefParams,
        skip_swa: bool = False,
    ) -> DecLockRefResult:
        node = self.node_by_id(node_id)
        self._assert_receipt_anchor(node, params)
        # After an SWA early release (dec_swa_lock_only), SWA and the
        # lower-priority components it dropped are already released.
        self._release_components(node, params, skip_swa_and_below=skip_swa)
        self._update_evictable_leaf_sets(node)
        # TODO: delta is not aggregated from components; no caller uses it yet.
        return DecLockRefResult()

    def inc_full_pin(self, node_id: NodeId) -> None:
        """Pin only the FULL device slots on the node's root path; the SWA segment
        lock is left alone since its receipt does not survive a window re-attach."""
        node = self.node_by_id(node_id)
        self.components_by_type[BASE_COMPONENT_TYPE].acquire_component_lock(
            node=node, result=IncLockRefResult()
        )
        self._update_evictable_leaf_sets(node)

    def dec_full_pin(self, node_id: NodeId) -> None:
        node = self.node_by_id(node_id)
        self.components_by_type[BASE_COMPONENT_TYPE].release_component_lock(
            node=node, params=None
        )
        self._update_evictable_leaf_sets(node)

    def dec_window_lock_only(
        self,
        node_id: NodeId,
        component_type: ComponentType,
        params: DecLockRefParams,
    ) -> DecSwaLockOnlyResult:
        result = DecSwaLockOnlyResult()
        node = self.node_by_id(node_id)
        self._assert_receipt_anchor(node, params)
        if node is self.root_node or component_type in params.skipped_lock_components:
            return result
        self.components_by_type[component_type].release_window_lock(
            node,
            params.get_lock_uuid(component_type),
            result.device_frees,
            result.host_frees,
            cache_actions=result.cache_actions,
        )
        return result

    def dec_swa_lock_only(
        self,
        node_id: NodeId,
        params: DecLockRefParams,
    ) -> DecSwaLockOnlyResult:
        """Early-release the SWA portion of a request's tree lock, plus any
        strictly-lower-priority locks (e.g. Mamba) co-located on the node."""
        result = DecSwaLockOnlyResult()
        node = self.node_by_id(node_id)
        self._assert_receipt_anchor(node, params)
        if node is self.root_node:
            return result
        swa_component = self.components_by_type.get(ComponentType.SWA)
        if swa_component is None:
            return result
        swa_component.release_window_lock(
            node,
            params.get_lock_uuid(ComponentType.SWA),
            result.device_frees,
            result.host_frees,
            cache_actions=result.cache_actions,
        )

        # Drop strictly-lower-priority locks co-located on the node, skipping
        # any the paired inc never took (matters for FULL+SWA+MAMBA models).
        swa_priority = swa_component.eviction_priority(is_leaf=False)
        for comp in reversed(self.components):
            if comp.component_type in params.skipped_lock_components:
                continue
            if comp.eviction_priority(is_leaf=False) < swa_priority:
                comp.release_component_lock(node, params)
        return result

    def inc_host_lock_ref(self, node_id: NodeId) -> IncLockRefResult:
        node = self.node_by_id(node_id)
        result = IncLockRefResult(node_id=node.id)
        for component in self.components:
            result = component.acquire_component_lock(
                node=node, result=result, lock_host=True
            )
        self._update_evictable_leaf_sets(node)
        return result

    def dec_host_lock_ref(
        self, node_id: NodeId, params: DecLockRefParams
    ) -> DecLockRefResult:
        node = self.node_by_id(node_id)
        self._assert_receipt_anchor(node, params)
        self._release_components(node, params, lock_host=True)
        self._update_evictable_leaf_sets(node)
        return DecLockRefResult()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        key, _ = key.maybe_to_bigram_view(self.is_eagle)
        if len(key) == 0:
            return self._empty_match_result
        key = key.page_aligned(self.page_size)
        if len(key) == 0:
            return self._empty_match_result

        return self._match_prefix_helper(key, params)

    def _create_match_validators(
        self, params: MatchPrefixParams, match_device_only: bool
    ) -> tuple[Callable[[UnifiedTreeNode], bool], ...]:
        return tuple(
            comp.create_match_validator(match_device_only=match_device_only)
            for comp in self.components
        )

    def _match_prefix_helper(
        self, key: RadixKey, params: MatchPrefixParams
    ) -> MatchResult:
        # Non-HiCache mode has only device-resident matches, so the scheduler
        # device anchor follows the best match. In HiCache mode, host-backed
        # nodes can also match, so we separately track the best device-resident
        # match for scheduler prefix indices and locking.
        node = self.root_node
        key_offset = 0
        child_key = key.child_key_at(key_offset, self.page_size)
        value: list[torch.Tensor] = []
        best_match_node = node
        best_match_device_node = node
        best_match_device_value_len = 0
        full_kv_hit_length = 0
        action: Optional[CacheAction | ComponentAction] = None
        separate_device_match = self.enable_hicache
        validators = self._create_match_validators(
            params, match_device_only=not separate_device_match
        )
        device_validators = (
            self._create_match_validators(params, match_device_only=True)
            if separate_device_match
            else validators
        )

        def _all_valid(validators, node):
            return all([validator(node) for validator in validators])

        def _update_best_if_valid(node):
            nonlocal best_match_node
            nonlocal best_match_device_value_len, best_match_device_node
            matched = _all_valid(validators, node)
            if matched:
                best_match_node = node

            if not separate_device_match:
                if matched:
                    best_match_device_value_len = len(value)
                    best_match_device_node = node
                return
            if _all_valid(device_validators, node):
                best_match_device_value_len = len(value)
                best_match_device_node = node

        while key_offset < len(key) and child_key in node.children:
            child = node.children[child_key]

            # HiCache: dead node (evicted + not backuped) — stop traversal
            if child.evicted and not child.backuped:
                break

            prefix_len = child.key.match_at(key, key_offset, page_size=self.page_size)
            full_kv_hit_length += prefix_len
            if prefix_len < len(child.key):
                node, action = self._split_node(child.key, child, prefix_len)
                if not node.evicted:
                    value.append(node.component_data[BASE_COMPONENT_TYPE].value)
                _update_best_if_valid(node)
                break

            if not child.evicted:
                value.append(child.component_data[BASE_COMPONENT_TYPE].value)
            node = child
            _update_best_if_valid(node)
            key_offset += prefix_len
            if key_offset < len(key):
                child_key = key.child_key_at(key_offset, self.page_size)

        return self._match_post_processor(
            params,
            value,
            best_match_node,
            best_match_device_node,
            best_match_device_value_len,
            full_kv_hit_length,
            action,
            last_visited_node_id=node.id if node is not self.root_node else None,
            device_validators=device_validators,
        )

    def match_full_device_prefix(self, key: RadixKey) -> tuple[int, NodeId, int]:
        """Read-only FULL-device match, independent of auxiliary components; the
        third result counts the whole deepest node (a partial match pins it all)."""
        key, _ = key.maybe_to_bigram_view(self.is_eagle)
        key = key.page_aligned(self.page_size)
        node = self.root_node
        matched_len = 0
        pinned_len = 0
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                break
            value = child.component_data[BASE_COMPONENT_TYPE].value
            if value is None:
                break
            prefix_len = child.key.match(key, page_size=self.page_size)
            if prefix_len == 0:
                break
            matched_len += prefix_len
            node = child
            pinned_len += len(child.key)
            if prefix_len < len(child.key):
                break
            key = key[prefix_len:]
        return matched_len, node.id, pinned_len

    def _match_post_processor(
        self,
        params: MatchPrefixParams,
        value: list[torch.Tensor],
        best_match_node: UnifiedTreeNode,
        best_match_device_node: UnifiedTreeNode,
        best_match_device_value_len: int,
        full_kv_hit_length: int,
        action: Optional[CacheAction | ComponentAction],
        last_visited_node_id: Optional[NodeId],
        device_validators: tuple[Callable[[UnifiedTreeNode], bool], ...],
    ) -> MatchResult:
        node_update = best_match_node
        for comp in self.components:
            if comp.component_type == BASE_COMPONENT_TYPE:
                continue  # Full uses last_access_time, not LRU
            comp.refresh_lru(LRURefreshPhase.MATCH_END, node_update, self.root_node)

        cur_time = get_and_increase_time_counter()
        while node_update:
            node_update.last_access_time = cur_time
            cur_time -= 0.00001
            node_update = node_update.parent

        # last_host_node will be used as the starting node for the subsequent
        # `prefetch_from_storage` flow. We directly use best_match_node here,
        # because best_match_node represents the node where all components
        # have reached consensus on both device & host availability.
        last_host_node = (
            best_match_node if self.enable_hicache else best_match_device_node
        )

        result = MatchResult(
            device_prefix_len=sum(len(v) for v in value[:best_match_device_value_len]),
            last_device_node=best_match_device_node,
            last_host_node=last_host_node,
            best_match_node=best_match_node,
            last_visited_node_id=last_visited_node_id,
            host_hit_length=0,
            full_kv_hit_length=full_kv_hit_length,
        )

        for component in self.components:
            result = component.finalize_match_result_in_tree_core(
                result=result,
                params=params,
                value_chunks=value,
                best_value_len=best_match_device_value_len,
            )
        # Expose only NodeIds outside TreeCore.
        return result._replace(
            last_device_node=result.last_device_node.id,
            last_host_node=result.last_host_node.id,
            best_match_node=result.best_match_node.id,
            cache_actions=[action] if action is not None else [],
        )

    @property
    def empty_match_result(self) -> MatchResult:
        """A shared empty MatchResult (zero device prefix + boundary NodeIds)."""
        return self._empty_match_result

    def is_full_device_evicted(self, node_id: NodeId) -> bool:
        """Whether the node's FULL device value has been evicted."""
        return self.node_by_id(node_id).evicted

    def collect_full_device_indices(
        self, from_node_id: NodeId, until_node_id: NodeId
    ) -> torch.Tensor:
        """Concatenate FULL device values from ``from_node`` up to (exclusive)
        ``until_node``, in root order; empty tensor if the path is empty."""
        until_node = self.node_by_id(until_node_id)
        prefix_chunks: list[torch.Tensor] = []
        node = self.node_by_id(from_node_id)
        while node is not until_node:
            value = node.component_data[BASE_COMPONENT_TYPE].value
            assert value is not None
            prefix_chunks.append(value)
            node = node.parent
        if not prefix_chunks:
            return self._empty_device_indices
        prefix_chunks.reverse()
        return torch.cat(prefix_chunks)

    def _touch_node(self, node: UnifiedTreeNode):
        node.last_access_time = get_and_increase_time_counter()
        if node != self.root_node:
            for comp in self.components:
                if comp.component_type == BASE_COMPONENT_TYPE:
                    continue
                comp.refresh_lru(LRURefreshPhase.WALKDOWN, node, self.root_node)

    def _inc_hit_count_and_check(self, node: UnifiedTreeNode) -> bool:
        """Increment hit count; check whether a write backup should be fired."""
        if node.evicted:
            return False
        if self.is_write_back:
            return False
        node.hit_count += 1

        if self.enable_external_cache_linker:
            return (
                self._needs_external_linker_offload(node)
                and node.hit_count >= self.write_through_threshold
            )

        return (
            self.enable_hicache
            and not node.backuped
            and node.hit_count >= self.write_through_threshold
        )

    @staticmethod
    def _needs_external_linker_offload(node: UnifiedTreeNode) -> bool:
        """Whether neither a confirmed nor an in-flight external copy exists."""
        return not node.external_cache_stored and node.write_through_pending_id is None

    def begin_insert(self, params: InsertParams) -> InsertStepResult:
        """Start the insert, running to its first barrier or completion."""
        # Insert walks are single-flight; a live walk means re-entrancy.
        if self._ongoing_insert_walk_state is not None:
            raise RuntimeError("concurrent insert walks")
        key = params.key
        value = params.value
        key, value = key.maybe_to_bigram_view(self.is_eagle, value)
        key = key.page_aligned(self.page_size)
        if value is not None:
            value = value[: len(key)]
        else:
            value = torch.tensor(key.token_ids[: len(key)], dtype=torch.int64)

        priority = params.priority
        if priority is None:
            priority = 0
        self._touch_node(self.root_node)
        self.root_node.priority = max(self.root_node.priority, priority)
        if len(key) == 0:
            return InsertStepResult(
                actions=[],
                result=InsertResult(
                    prefix_len=0,
                    mamba_exist=True,
                    last_device_node=self.root_node.id,
                ),
            )

        if params.rotation_base is not None:
            conflict = self._rotation_conflict(key, params.rotation_base)
            if conflict is not None:
                total_prefix_length, node = conflict
                return InsertStepResult(
                    actions=[],
                    result=InsertResult(
                        prefix_len=total_prefix_length,
                        last_device_node=node.id,
                        rotation_tail_declined=True,
                        adopted_ranges={} if params.track_adopted_ranges else None,
                    ),
                )

        self._ongoing_insert_walk_state = _InsertWalkState(
            phase=_InsertPhase.WALK,
            node=self.root_node,
            key=key,
            value=value,
            params=params,
            priority=priority,
            result=InsertResult(
                prefix_len=0,
                adopted_ranges={} if params.track_adopted_ranges else None,
            ),
        )
        return self._advance_insert()

    def _rotation_conflict(
        self, key: RadixKey, rotation_base: int
    ) -> Optional[tuple[int, UnifiedTreeNode]]:
        """Logical-page KV sharding: refuse an insert that would splice two
        rotation runs into one cached path.

        Read-only mirror of ``_insert_walk_step``'s matching. Returns
        ``(matched_len, deepest_matched_node)`` when the chain this key lands on
        was allocated under a different rotation base than the inserting
        request's pages, else None.

        Grafting across a base discontinuity would create a cached path whose
        page owners are not one cyclic run — the padded-allgather / ``k // N``
        translation contract — so later readers would crash on a negative pad or
        silently read the wrong rank's scratch rows. Such a discontinuity means
        two requests sharing a prefix were planned in pipelined batches before
        either's insert landed, or the match was capped below the cached prefix.

        Unlike the flat radix tree, the unified insert transfers page ownership
        at three points, not just the tail graft: the tail leaf
        (``_add_new_node``), an evicted node restored from the request's fresh
        pages (``_unevict_node_on_insert``), and a component re-pointing a
        matched node's Full value at the request's pages
        (``update_component_on_insert_overlap``). All three are downstream of
        this same predicate, so it is evaluated once, up front, and declines the
        whole insert — which also keeps the walk's duplicate frees from running,
        as the declined request stays on its own pages.
        """
        node = self.root_node
        total_prefix_length = 0
        while len(key) > 0:
            child_key = key.child_key(self.page_size)
            if child_key not in node.children:
                break
            child = node.children[child_key]
            prefix_len = child.key.match(key, page_size=self.page_size)
            node = child
            total_prefix_length += prefix_len
            key = key[prefix_len:]
            if prefix_len < len(child.key):
                # The walk would split here; the fragment inherits this base.
                break
        if node is self.root_node or node.rotation_base == rotation_base:
            return None
        return total_prefix_length, node

    def resume_insert(self) -> InsertStepResult:
        """Continue the suspended insert after its step actions were executed."""
        if self._ongoing_insert_walk_state is None:
            raise RuntimeError("no in-flight insert")
        return self._advance_insert()

    def has_ongoing_insert(self) -> bool:
        """Whether an insert walk is suspended at a barrier."""
        return self._ongoing_insert_walk_state is not None

    def end_insert(self) -> list[CacheAction | ComponentAction]:
        """Finish the insert (idempotent); returns still-pending actions to drain."""
        state = self._ongoing_insert_walk_state
        self._ongoing_insert_walk_state = None
        return state.pending_actions if state is not None else []

    def _advance_insert(self) -> InsertStepResult:
        """Run the in-flight insert to its next barrier or to completion."""
        state = self._ongoing_insert_walk_state
        while True:
            flushed_len = len(state.pending_actions)
            if state.phase is _InsertPhase.WALK:
                self._insert_walk_step(state)
            elif state.phase is _InsertPhase.OVERLAP:
                self._insert_overlap_step(state)
            elif state.phase is _InsertPhase.COMMIT:
                self._insert_commit_step(state)
            elif state.phase is _InsertPhase.TAIL:
                self._insert_tail_step(state)
                self._ongoing_insert_walk_state = None
                return InsertStepResult(
                    actions=state.pending_actions, result=state.result
                )
            else:
                raise AssertionError(f"unsupported insert phase: {state.phase}")
            new_actions = state.pending_actions[flushed_len:]
            # Suspend only when a step emitted a non-deferrable action.
            if new_actions and not all(map(self._is_deferrable_action, new_actions)):
                flushed = state.pending_actions
                state.pending_actions = []
                return InsertStepResult(actions=flushed)

    @staticmethod
    def _is_deferrable_action(action: CacheAction | ComponentAction) -> bool:
        """Fire-and-forget actions safe to batch until the next barrier."""
        return isinstance(
            action,
            (FreeDeviceKV, FreeDeviceKVFullOnly, UpdatePendingBackupOnNodeSplit),
        )

    def _insert_walk_step(self, state: _InsertWalkState) -> None:
        """Process one walked node, appending its barrier actions to the state."""
        key = state.key
        child_key = key.child_key(self.page_size) if len(key) else None
        if child_key not in state.node.children:
            state.phase = _InsertPhase.COMMIT
            return
        step_actions = state.pending_actions
        node = state.node.children[child_key]
        self._touch_node(node)
        prefix_len = node.key.match(key, page_size=self.page_size)
        if prefix_len < len(node.key):
            node, action = self._split_node(node.key, node, prefix_len)
            if action is not None:
                step_actions.append(action)
        node.priority = max(node.priority, state.priority)

        if node.evicted:
            self._unevict_node_on_insert(
                node,
                state.value[:prefix_len],
                session_id=state.params.session_id,
            )
            state.result.record_adopted_range(
                BASE_COMPONENT_TYPE,
                state.total_prefix_length,
                state.total_prefix_length + prefix_len,
            )
            # FULL was restored from the request's fresh KV. Aux
            # components (e.g. SWA) may still hold tombstones and need
            # to rebuild their value from the same slice.
            for component in self.components:
                if component.component_type == BASE_COMPONENT_TYPE:
                    continue
                component.recover_after_unevict(
                    node=node,
                    prefix_len=prefix_len,
                    total_prefix_len=state.total_prefix_length,
                    params=state.params,
                    result=state.result,
                    cache_actions=step_actions,
                )
            self._finish_insert_walk_node(state, node, prefix_len)
            return
        state.overlap_node = node
        state.overlap_prefix_len = prefix_len
        state.phase = _InsertPhase.OVERLAP
        # Finish ordinary overlaps now; resource barriers resume in OVERLAP.
        self._insert_overlap_step(state)

    def _insert_overlap_step(self, state: _InsertWalkState) -> None:
        """Claim overlapping slots after any backend-specific resource barrier."""
        node = state.overlap_node
        assert node is not None
        prefix_len = state.overlap_prefix_len
        value_slice = state.value[:prefix_len]
        consumed_from = prefix_len
        for component in self.components:
            comp_consumed_from = component.update_component_on_insert_overlap(
                node=node,
                prefix_len=prefix_len,
                total_prefix_len=state.total_prefix_length,
                value_slice=value_slice,
                params=state.params,
                result=state.result,
                cache_actions=state.pending_actions,
            )
            consumed_from = min(consumed_from, comp_consumed_from)

        dup_start = max(0, state.params.prev_prefix_len - state.total_prefix_length)
        if dup_start < consumed_from:
            # Below the request's SWA eviction floor only FULL is still ours.
            dup = value_slice[dup_start:consumed_from]
            abs_start = state.total_prefix_length + dup_start
            swa_already_freed = min(
                max(state.params.get_evicted_seqlen(ComponentType.SWA) - abs_start, 0),
                dup.numel(),
            )
            if swa_already_freed > 0:
                state.pending_actions.append(
                    FreeDeviceKVFullOnly([dup[:swa_already_freed]])
                )
            if swa_already_freed < dup.numel():
                state.pending_actions.append(FreeDeviceKV([dup[swa_already_freed:]]))
        self._finish_insert_walk_node(state, node, prefix_len)

    def _finish_insert_walk_node(
        self, state: _InsertWalkState, node: UnifiedTreeNode, prefix_len: int
    ) -> None:
        # Nodes this request already inserted were counted back then.
        node_end = state.total_prefix_length + prefix_len
        if node_end > state.params.inserted_len and self._inc_hit_count_and_check(node):
            state.pending_actions.append(self._build_backup_kv_action(node))
        state.node = node
        state.total_prefix_length += prefix_len
        state.key = state.key[prefix_len:]
        state.value = state.value[prefix_len:]
        state.overlap_node = None
        state.overlap_prefix_len = 0
        state.phase = _InsertPhase.WALK

    def _insert_commit_step(self, state: _InsertWalkState) -> None:
        """Create the tail leaf and run the component commit hooks."""
        # Create new leaf for remaining suffix. A leaf survives on its Full
        # value alone; auxiliary components (SWA, Mamba) may legitimately hold
        # only a tombstone for this span (e.g. the whole leaf is outside the SWA
        # window). Materialize it anyway so the Full KV stays cacheable.
        if len(state.key):
            state.result.record_adopted_range(
                BASE_COMPONENT_TYPE,
                state.total_prefix_length,
                state.total_prefix_length + len(state.key),
            )
            state.target_node = self._add_new_node(
                state.node,
                state.key,
                state.value,
                priority=state.priority,
                session_id=state.params.session_id,
                rotation_base=state.params.rotation_base,
            )
            state.is_new_leaf = True
        else:
            state.target_node = state.node

        # Finalize: let each component attach its data to the target node.
        # e.g. Mamba attaches mamba_value to the leaf node
        # All hooks run before their emitted actions execute; an action failure
        # fail-stops the process, so partial-commit state is never observed.
        state.result.prefix_len = state.total_prefix_length
        state.result.last_device_node = state.target_node.id
        for component in self.components:
            component.commit_insert_component_data(
                node=state.target_node,
                is_new_leaf=state.is_new_leaf,
                params=state.params,
                result=state.result,
                cache_actions=state.pending_actions,
            )
        state.phase = _InsertPhase.TAIL

    def _needs_incremental_component_backup(self, node: UnifiedTreeNode) -> bool:
        return any(
            component.needs_incremental_backup(node)
            for component in self.components
            if component.component_type != BASE_COMPONENT_TYPE
        )

    def _should_backup_after_insert(self, state: _InsertWalkState) -> bool:
        """Check whether the insert target needs a Host backup."""
        if self.is_write_back:
            return False
        if state.is_new_leaf:
            leaf_end = state.total_prefix_length + len(state.target_node.key)
            return (
                leaf_end > state.params.inserted_len
                and self._inc_hit_count_and_check(state.target_node)
            )

        node = state.target_node
        return (
            self.enable_hicache
            and node.backuped
            and node.write_through_pending_id is None
            and self._needs_incremental_component_backup(node)
        )

    def _insert_tail_step(self, state: _InsertWalkState) -> None:
        """Refresh the LRUs and append the insert backup: a new-leaf write-through,
        or an SWA window publish on an existing backed node."""
        if state.target_node is not self.root_node:
            for component in self.components:
                if component.component_type == BASE_COMPONENT_TYPE:
                    continue
                component.refresh_lru(
                    LRURefreshPhase.INSERT_END, state.target_node, self.root_node
                )

        if self._should_backup_after_insert(state):
            state.pending_actions.append(
                self._build_backup_kv_action(
                    state.target_node, write_back=self.is_write_back
                )
            )

    def _split_node(
        self, key: RadixKey, child: UnifiedTreeNode, split_len: int
    ) -> tuple[UnifiedTreeNode, Optional[CacheAction | ComponentAction]]:
        new_node = self._new_node(priority=child.priority)
        new_node.children = {key[split_len:].child_key(self.page_size): child}
        new_node.parent = child.parent
        new_node.key = child.key[:split_len]
        new_node.hit_count = child.hit_count
        new_node.external_cache_stored = child.external_cache_stored
        new_node.creation_time = child.creation_time
        if self.tlru_bookkeeping:
            # A split adds no depth to the branch: the new parent sits at
            # split_len tokens and inherits the branch's high-water mark, while
            # child keeps its own depth because its path length is unchanged.
            new_node._tlru_cached_prefix_len = (
                new_node.parent._tlru_cached_prefix_len + split_len
            )
            new_node._tlru_history_len = child._tlru_history_len
        # Split fragments stay on the anchor's root path for the ack's walk.
        new_node.load_back_pending_id = child.load_back_pending_id
        # The rotation base is constant along a chain (position-page P keeps
        # owner (b + P) % N on both sides of the split).
        new_node.rotation_base = child.rotation_base

        child.parent = new_node
        child.key = child.key[split_len:]
        new_node.hash_value, child.hash_value = split_node_hash_value(
            child.hash_value, split_len, self.page_size
        )
        new_node.event_hash_value, child.event_hash_value = split_node_hash_value(
            child.event_hash_value, split_len, self.page_size
        )

        for component in self.components:
            component.redistribute_on_node_split(new_parent=new_node, child=child)
        new_node.parent.children[key.child_key(self.page_size)] = new_node

        # Buffer-mode dependencies are tracked by the cache, without an ack here.
        action: Optional[CacheAction | ComponentAction] = None
        ack_id = child.write_through_pending_id
        if ack_id is not None:
            new_node.write_through_pending_id = ack_id
        if ack_id is not None or self.is_host_memory_buffer_only:
            action = UpdatePendingBackupOnNodeSplit(
                ack_id=ack_id,
                old_node_id=child.id,
                new_node_id=new_node.id,
                new_child_node_id=child.id,
            )

        # Splitting does not access the suffix; retain its recency and place
        # the inherited prefix beside it, in the same session partition.
        self._for_each_component_lru(
            new_node,
            lambda lru, node: lru.insert_after(child, node),
            skip_existing=True,
        )
        child.last_access_time = get_and_increase_time_counter()

        self._update_evictable_leaf_sets(new_node)
        self._update_evictable_leaf_sets(child)
        # Only the new fragment needs qualifying; the child keeps its id.
        self._update_duplicate_tracking(new_node)
        return new_node, action

    def _add_new_node(
        self,
        parent: UnifiedTreeNode,
        key: RadixKey,
        value: torch.Tensor,
        priority: int = 0,
        session_id: Optional[str] = None,
        rotation_base: Optional[int] = None,
    ) -> UnifiedTreeNode:
        new_node = self._new_node(priority=priority)
        new_node.parent = parent
        new_node.key = key
        if self.tlru_bookkeeping:
            _set_tlru_lens_and_raise_history(new_node, parent)
        # Chain-constant under sharding: the pre-flight decline in
        # begin_insert() guarantees this tail continues the matched prefix's
        # rotation, so stamping the inserting request's base keeps every node
        # on a root path carrying the same base.
        new_node.rotation_base = rotation_base
        new_node.component_data[BASE_COMPONENT_TYPE].value = value.clone()
        parent.children[key.child_key(self.page_size)] = new_node
        self.component_evictable_size_[BASE_COMPONENT_TYPE] += self.components_by_type[
            BASE_COMPONENT_TYPE
        ].reclaimable_value_len(new_node)
        if self.enable_storage or self.enable_external_cache_linker:
            new_node.hash_value = compute_node_hash_values(new_node, self.page_size)

        self._update_evictable_leaf_sets(new_node)
        self._update_evictable_leaf_sets(parent)
        self.kv_events.record_store(new_node, session_id=session_id)
        return new_node

    def _unevict_node_on_insert(
        self,
        node: UnifiedTreeNode,
        fresh_value: torch.Tensor,
        session_id: Optional[str] = None,
    ) -> None:
        """Restore an evicted node's Full device value from fresh KV indices
        during insert."""
        ct = BASE_COMPONENT_TYPE
        cd = node.component_data[ct]
        assert cd.value is None
        cd.value = fresh_value.clone()
        n = self.components_by_type[ct].reclaimable_value_len(node)
        if cd.lock_ref > 0:
            self.component_protected_size_[ct] += n
        else:
            self.component_evictable_size_[ct] += n
        self._update_evictable_leaf_sets(node)
        # A backuped node restored from fresh KV is a duplicate right away.
        self._update_duplicate_tracking(node)
        if node.parent is not None:
            self._update_evictable_leaf_sets(node.parent)
        self.kv_events.record_store(
            node,
            medium=StorageMedium.GPU,
            session_id=session_id,
        )

    def _update_evictable_leaf_sets(self, node: UnifiedTreeNode) -> None:
        """Update both device and host leaf sets for a node."""
        if self._is_device_leaf(node):
            self.evictable_device_leaves.add(node)
        else:
            self.evictable_device_leaves.discard(node)

        if self._is_host_leaf(node):
            self.evictable_host_leaves.add(node)
        else:
            self.evictable_host_leaves.discard(node)

    def _update_duplicate_tracking(self, node: UnifiedTreeNode) -> None:
        """Register where duplicates are born (acks, split, unevict);
        deregistration is lazy, so entries may be stale and re-checked live."""
        if self._is_settled_full_host_duplicate(node):
            self.full_host_duplicates.setdefault(node.id, node)
        else:
            self.full_host_duplicates.pop(node.id, None)

    def _is_settled_full_host_duplicate(self, node: UnifiedTreeNode) -> bool:
        """Full KV present on both tiers with no in-flight DMA on the node's
        host slots; mid-transfer nodes join the tracking at their ack."""
        cd = node.component_data[BASE_COMPONENT_TYPE]
        return (
            node is not self.root_node
            and cd.value is not None
            and cd.host_value is not None
            and node.write_through_pending_id is None
            and node.load_back_pending_id is None
        )

    def _for_each_component_lru(
        self,
        node: UnifiedTreeNode,
        lru_op,
        target: EvictLayer = EvictLayer.DEVICE,
        skip_existing: bool = False,
    ):
        """Apply lru_op to each aux component's LRU that has data on this node.
        If skip_existing=True, skip components already in the target LRU list."""
        lru_dict = self.host_lru_lists if target is EvictLayer.HOST else self.lru_lists
        for ct in self.component_types:
            if ct == BASE_COMPONENT_TYPE:
                continue  # Full uses leaf sets, not LRU
            cd = node.component_data[ct]
            if (cd.host_value if target is EvictLayer.HOST else cd.value) is not None:
                lru = lru_dict[ct]
                if skip_existing and lru.in_list(node):
                    continue
                lru_op(lru, node)

    def evict_device_start(
        self, component_type: ComponentType, request_cnt: int
    ) -> None:
        """Begin a component's device-eviction walk for up to request_cnt tokens."""
        self.components_by_type[component_type].evict_device_start(request_cnt)

    def _begin_tracking_unbacked_tokens(self) -> None:
        assert not self._is_tracking_unbacked_tokens
        assert self._tracked_unbacked_tokens == 0
        self._is_tracking_unbacked_tokens = True

    def _finish_tracking_unbacked_tokens(self) -> int:
        assert self._is_tracking_unbacked_tokens
        self._is_tracking_unbacked_tokens = False
        result = self._tracked_unbacked_tokens
        self._tracked_unbacked_tokens = 0
        return result

    def evict_device_next_node(
        self, component_type: ComponentType, tracker: dict[ComponentType, int]
    ) -> EvictDeviceNextNodeResult:
        """Advance one component eviction step and report whether it progressed."""
        result = EvictDeviceNextNodeResult()
        # The walk reads running totals for its doneness check; the result
        # carries only this step's delta.
        component = self.components_by_type[component_type]
        assert component_type not in self._pending_internal_evictions, (
            f"finish the pending internal {component_type.name} eviction "
            "before advancing"
        )
        updated_tracker = defaultdict(int, tracker)
        self._begin_tracking_unbacked_tokens()
        try:
            step = component.evict_device_next_node(
                updated_tracker,
                result.device_frees,
                result.host_frees,
                cache_actions=result.cache_actions,
            )
        finally:
            result.unbacked_tokens = self._finish_tracking_unbacked_tokens()
        for ct, n in updated_tracker.items():
            delta = n - tracker.get(ct, 0)
            if delta:
                result.tracker[ct] = delta
        if isinstance(step, InternalStateBackup):
            assert component_type in (ComponentType.MAMBA, ComponentType.SWA)
            self._pending_internal_evictions[component_type] = step.node_id
            if component_type == ComponentType.MAMBA:
                result.mamba_backup_node_id = step.node_id
            else:
                result.swa_backup_node_id = step.node_id
                result.swa_backup_num_tokens = step.num_tokens
        else:
            result.node_id = step
        result.made_progress = (
            result.node_id is not None
            or result.mamba_backup_node_id is not None
            or result.swa_backup_node_id is not None
            or bool(result.tracker)
            or bool(result.cache_actions)
            or any(result.device_frees.values())
            or any(result.host_frees.values())
        )
        return result

    def finish_mamba_state_eviction(self, node_id: NodeId) -> EvictDeviceNextNodeResult:
        return self._finish_internal_component_eviction(ComponentType.MAMBA, node_id)

    def finish_swa_state_eviction(self, node_id: NodeId) -> EvictDeviceNextNodeResult:
        return self._finish_internal_component_eviction(ComponentType.SWA, node_id)

    def _finish_internal_component_eviction(
        self, component_type: ComponentType, node_id: NodeId
    ) -> EvictDeviceNextNodeResult:
        """Resume an internal tombstone after the controller's backup attempt."""
        component = self.components_by_type[component_type]
        assert component.is_evict_device_ongoing, (
            f"{component_type.name} device eviction not started"
        )
        assert self._pending_internal_evictions.get(component_type) == node_id, (
            f"no matching pending internal {component_type.name} eviction"
        )
        del self._pending_internal_evictions[component_type]
        # Consuming the pending request advances the walk even if I/O changed
        # this victim's eligibility. No frees occur before backup completion.
        result = EvictDeviceNextNodeResult(made_progress=True)
        node = self._node_arena.get(node_id)
        lru = self.lru_lists[component_type]
        enabled = self.enable_session_radix_cache
        if (
            node is None
            or node.component_data[component_type].value is None
            or node.component_data[component_type].lock_ref > 0
            or (
                component_type == ComponentType.MAMBA
                and node.load_back_pending_id is not None
            )
            or not lru.in_list(node)
        ):
            if enabled:
                component._evict_device_cursor = lru.cursor_next()
            return result
        if (
            node in self.evictable_device_leaves
            and (not enabled or component._can_evict_leaf_atomically(node))
        ) or (
            component_type == ComponentType.MAMBA
            and node.component_data[BASE_COMPONENT_TYPE].value is None
        ):
            # Re-select changed leaves through the normal walk; internal
            # finish must not accidentally perform an atomic Full eviction.
            component._evict_device_cursor = node
            return result
        self._begin_tracking_unbacked_tokens()
        try:
            self._evict_component_and_detach_lru(
                node,
                component,
                target=EvictLayer.DEVICE,
                tracker=result.tracker,
                device_frees=result.device_frees,
                host_frees=result.host_frees,
                cache_actions=result.cache_actions,
            )
            self._cascade_evict(
                node,
                component,
                result.tracker,
                device_frees=result.device_frees,
                host_frees=result.host_frees,
                cache_actions=result.cache_actions,
            )
        finally:
            result.unbacked_tokens = self._finish_tracking_unbacked_tokens()
        if enabled:
            component._evict_device_cursor = lru.cursor_next()
        return result

    def evict_device_end(self, component_type: ComponentType) -> None:
        """Finish a component's device-eviction walk."""
        self.components_by_type[component_type].evict_device_end()
        self._pending_internal_evictions.pop(component_type, None)

    def evict_device_leaf(
        self, node_id: NodeId, is_write_back: bool
    ) -> EvictDeviceLeafResult:
        """Evict one device leaf (demote if backuped, delete if write-through);
        for an unbacked write-back node, the result carries the BackupKV for
        the cache to execute and then demote."""
        result = EvictDeviceLeafResult()
        node = self.node_by_id(node_id)
        assert self._is_device_leaf(node), f"node {node.id} is not a D-leaf"
        self._begin_tracking_unbacked_tokens()
        try:
            if not node.backuped:
                if is_write_back:
                    result.backup_kv = self._build_backup_kv_action(
                        node, write_back=True
                    )
                    return result
                # Write-through: node has no backup, delete entirely.
                self._delete_unbacked_device_leaf(
                    node,
                    result.tracker,
                    device_frees=result.device_frees,
                    host_frees=result.host_frees,
                    cache_actions=result.cache_actions,
                )
                return result
            self._demote(
                node,
                result.tracker,
                device_frees=result.device_frees,
                host_frees=result.host_frees,
                cache_actions=result.cache_actions,
            )
            return result
        finally:
            result.unbacked_tokens = self._finish_tracking_unbacked_tokens()

    def drop_subtree_no_host(self, node_id: NodeId) -> DropSubtreeNoHostResult:
        """Write-back fallback when a D-leaf's D->H backup fails under host
        memory pressure: drop the subtree rooted at the unbacked leaf so
        device eviction keeps making progress instead of leaving its KV
        unevictable until host space frees up."""
        result = DropSubtreeNoHostResult(is_dropped=False)
        node = self.node_by_id(node_id)
        assert self._is_device_leaf(node), f"node {node.id} is not a D-leaf"
        # A failed backup never issues the D->H copy, so the subtree root has
        # no host state and no in-flight DMA reading its device slots.
        assert not node.backuped and node.write_through_pending_id is None
        if node.load_back_pending_id is not None or any(
            cd.lock_ref > 0 or cd.host_lock_ref > 0 for cd in node.component_data
        ):
            return result
        descendants: list[UnifiedTreeNode] = []
        stack = list(node.children.values())
        while stack:
            cur = stack.pop()
            if (
                cur.write_through_pending_id is not None
                or cur.load_back_pending_id is not None
                or any(
                    cd.lock_ref > 0 or cd.host_lock_ref > 0 for cd in cur.component_data
                )
            ):
                return result
            descendants.append(cur)
            stack.extend(cur.children.values())
        for desc in reversed(descendants):
            # Host-only by construction: a device descendant would contradict
            # this node being a D-leaf, and D-leaves evict before ancestors.
            assert desc.evicted and desc.backuped, f"node {desc.id} not host-only"
            assert desc.write_through_pending_id is None
            self._release_all_component_layers(
                desc,
                StorageMedium.CPU,
                result.tracker,
                result.device_frees,
                result.host_frees,
                cache_actions=result.cache_actions,
            )
            self._remove_leaf_from_parent(desc)
        self._delete_unbacked_device_leaf(
            node,
            result.tracker,
            device_frees=result.device_frees,
            host_frees=result.host_frees,
            cache_actions=result.cache_actions,
        )
        result.is_dropped = True
        return result

    def _release_all_component_layers(
        self,
        node: UnifiedTreeNode,
        medium: StorageMedium,
        tracker: dict[ComponentType, int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        """Free every component layer on the node and detach it from the LRU
        lists and evictable leaf sets."""
        self.kv_events.record_remove(node, medium=medium)
        for comp in self.components:
            self._evict_component_and_detach_lru(
                node,
                comp,
                target=EvictLayer.ALL,
                tracker=tracker,
                device_frees=device_frees,
                host_frees=host_frees,
                cache_actions=cache_actions,
            )
        self.evictable_device_leaves.discard(node)
        self.evictable_host_leaves.discard(node)

    def _delete_unbacked_device_leaf(
        self,
        node: UnifiedTreeNode,
        tracker: dict[ComponentType, int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        """Delete a device leaf that has no host backup, freeing all layers."""
        self._release_all_component_layers(
            node,
            StorageMedium.GPU,
            tracker,
            device_frees,
            host_frees,
            cache_actions=cache_actions,
        )
        parent = node.parent
        self._remove_leaf_from_parent(node)
        self._update_evictable_leaf_sets(parent)
        self._iteratively_delete_tombstone_leaf(
            node,
            tracker,
            device_frees=device_frees,
            host_frees=host_frees,
            cache_actions=cache_actions,
        )

    def drive_host_eviction(
        self, component_type: ComponentType, num_tokens: int
    ) -> DriveHostEvictionResult:
        """Evict a component's host-side resources; no-op if absent. Under
        write_back, FULL pressure reclaims redundant Full host copies first
        (skipped if SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM=1)."""
        result = DriveHostEvictionResult()
        comp = self.components_by_type.get(component_type)
        if comp is not None:
            if (
                not envs.SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM.get()
                and self.is_write_back
                and component_type == BASE_COMPONENT_TYPE
            ):
                self._reclaim_full_host_duplicates(
                    num_tokens,
                    result.tracker,
                    result.device_frees,
                    result.host_frees,
                    cache_actions=result.cache_actions,
                )
            comp.drive_host_eviction(
                num_tokens,
                result.tracker,
                result.device_frees,
                result.host_frees,
                cache_actions=result.cache_actions,
            )
        return result

    def evict_excess_path_states(
        self,
        tail_node_id: NodeId,
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        self.components_by_type[ComponentType.MAMBA]._evict_excess_path_states(
            self.node_by_id(tail_node_id),
            device_frees,
            host_frees,
            cache_actions=cache_actions,
        )

    def _reclaim_full_host_duplicates(
        self,
        num_tokens: int,
        tracker: dict[ComponentType, int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        """Reclaim Full host duplicates until num_tokens are freed; pass 1
        spares evictable D-leaves (imminent free demotes), pass 2 takes them."""
        swept_ids: list[NodeId] = []
        for spare_imminent_demotes in (True, False):
            if tracker[BASE_COMPONENT_TYPE] >= num_tokens:
                break
            for node in self.full_host_duplicates.values():
                if tracker[BASE_COMPONENT_TYPE] >= num_tokens:
                    break
                cd = node.component_data[BASE_COMPONENT_TYPE]
                if cd.value is None or cd.host_value is None:
                    swept_ids.append(node.id)  # stale entry
                    continue
                if spare_imminent_demotes and node in self.evictable_device_leaves:
                    continue
                if not self._can_reclaim_full_host_duplicate(node):
                    continue
                self._release_full_host_duplicate(
                    node, tracker, device_frees, host_frees, cache_actions=cache_actions
                )
                swept_ids.append(node.id)  # released -> no longer a duplicate
        # Sweep after the walk: the dict must not be mutated mid-iteration.
        for nid in swept_ids:
            self.full_host_duplicates.pop(nid, None)

    def _can_reclaim_full_host_duplicate(self, node: UnifiedTreeNode) -> bool:
        """Full on both tiers, no in-flight DMA, no Full host lock; checked
        live because tracking may be stale."""
        cd = node.component_data[BASE_COMPONENT_TYPE]
        if node is self.root_node or cd.value is None or cd.host_value is None:
            return False
        if (
            node.write_through_pending_id is not None
            or node.load_back_pending_id is not None
        ):
            return False
        return cd.host_lock_ref == 0

    def _release_full_host_duplicate(
        self,
        node: UnifiedTreeNode,
        tracker: dict[ComponentType, int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        """Free only the Full host layer; aux host slices stay under their own
        pools' LRU (a host-only aux slice may be a sole copy)."""
        assert self._can_reclaim_full_host_duplicate(node)
        self.kv_events.record_remove(node, medium=StorageMedium.CPU)
        self._evict_component_and_detach_lru(
            node,
            self.components_by_type[BASE_COMPONENT_TYPE],
            target=EvictLayer.HOST,
            tracker=tracker,
            device_frees=device_frees,
            host_frees=host_frees,
            cache_actions=cache_actions,
        )
        self.write_back_duplicate_reclaim_digest = (
            self.write_back_duplicate_reclaim_digest * 1000003 + node.id + 1
        ) & _RECLAIM_DIGEST_MASK

    def _evict_host_leaf(
        self,
        node: UnifiedTreeNode,
        tracker: dict[ComponentType, int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        """Atomically evict all components on a host leaf.

        All freed tokens are accumulated into *tracker*."""
        assert self._is_host_leaf(node), f"node {node.id} is not an H-leaf"

        self.kv_events.record_remove(node, medium=StorageMedium.CPU)
        for comp in self.components:
            _, hf = self._evict_component_and_detach_lru(
                node,
                comp,
                target=EvictLayer.ALL,
                tracker=None,
                device_frees=device_frees,
                host_frees=host_frees,
                cache_actions=cache_actions,
            )
            tracker[comp.component_type] += hf
        self.evictable_host_leaves.discard(node)
        self._remove_leaf_from_parent(node)
        self._iteratively_delete_tombstone_leaf(
            node, tracker, device_frees, host_frees, cache_actions=cache_actions
        )

    def demote(self, node_id: NodeId) -> DemoteResult:
        """Release a node's device KV once its host copy exists; the node stays in the
        tree, now host-only."""
        result = DemoteResult()
        self._demote(
            self.node_by_id(node_id),
            result.tracker,
            result.device_frees,
            result.host_frees,
            cache_actions=result.cache_actions,
        )
        return result

    def _demote(
        self,
        node: UnifiedTreeNode,
        tracker: dict[ComponentType, int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        assert not node.evicted and node.backuped
        trigger = self.components_by_type[BASE_COMPONENT_TYPE]
        self._evict_component_and_detach_lru(
            node,
            trigger,
            target=EvictLayer.DEVICE,
            tracker=tracker,
            device_frees=device_frees,
            host_frees=host_frees,
            cache_actions=cache_actions,
        )
        self._cascade_evict(
            node,
            trigger,
            tracker,
            device_frees=device_frees,
            host_frees=host_frees,
            cache_actions=cache_actions,
        )
        self.kv_events.record_remove(node, medium=StorageMedium.GPU)

        # after device eviction, insert aux components into host LRU.
        self._for_each_component_lru(
            node, UnifiedLRUList.insert_mru, target=EvictLayer.HOST, skip_existing=True
        )
        self._update_evictable_leaf_sets(node.parent)

    def _cascade_evict(
        self,
        node: UnifiedTreeNode,
        trigger: TreeComponent,
        tracker: dict[ComponentType, int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
        target: EvictLayer = EvictLayer.DEVICE,
    ):
        """Cascade eviction from trigger to lower-or-equal priority components."""

        is_leaf = self._is_cascade_evict_leaf(node, target)
        base_evicted = False

        for comp in self.components:
            if self._should_cascade_evict_component(
                node, trigger, comp, target, is_leaf
            ):
                self._evict_component_and_detach_lru(
                    node,
                    comp,
                    target=target,
                    tracker=tracker,
                    device_frees=device_frees,
                    host_frees=host_frees,
                    cache_actions=cache_actions,
                )
                if comp.component_type == BASE_COMPONENT_TYPE:
                    base_evicted = True

        # Now that all components (including SWA which depends on Full.value)
        # have been freed, we can safely tombstone Full.value.
        # This is deferred from evict_component because free_swa needs it.
        if (
            target is EvictLayer.DEVICE
            and trigger.component_type == BASE_COMPONENT_TYPE
        ):
            node.component_data[trigger.component_type].value = None

        if EvictLayer.DEVICE in target and base_evicted:
            node.component_data[BASE_COMPONENT_TYPE].value = None

        self._update_evictable_leaf_sets(node)

    def _is_cascade_evict_leaf(self, node: UnifiedTreeNode, target: EvictLayer) -> bool:
        if target == EvictLayer.DEVICE:
            return node in self.evictable_device_leaves
        if target == EvictLayer.HOST:
            return node in self.evictable_host_leaves
        return False

    @staticmethod
    def _should_cascade_evict_component(
        node: UnifiedTreeNode,
        trigger: TreeComponent,
        comp: TreeComponent,
        target: EvictLayer,
        is_leaf: bool,
    ) -> bool:
        """Return whether a component is an unlocked cascade-eviction target."""
        trigger_priority = trigger.eviction_priority(is_leaf)
        if comp.eviction_priority(is_leaf) > trigger_priority:
            return False
        if comp is trigger or not comp.node_has_component_data(node, target):
            return False

        cd = node.component_data[comp.component_type]
        # A comp whose TRUE internal priority outranks the trigger is only a
        # candidate because leaf-collapse flattened priorities; a lock on it is
        # a legitimate pin and must be spared. A lock on a strictly-lower-
        # priority tier is a real strand and must trip the assertions below.
        if comp.eviction_priority(is_leaf=False) >= trigger.eviction_priority(
            is_leaf=False
        ):
            if EvictLayer.DEVICE in target and cd.lock_ref != 0:
                return False
            if EvictLayer.HOST in target and cd.host_lock_ref != 0:
                return False
            if cd.session_ref > 0 and trigger.session_ref(node) == 0:
                return False
        if EvictLayer.DEVICE in target:
            assert cd.lock_ref == 0
        if EvictLayer.HOST in target:
            assert cd.host_lock_ref == 0
        return True

    def _remove_leaf_from_parent(self, node: UnifiedTreeNode):
        for component in self.components:
            component.discard_deleted_session_leaf(node)

        key = node.key.child_key(self.page_size)
        v = node.parent.children.pop(key, None)
        assert v == node
        # Deleted nodes must not linger in duplicate tracking as ghosts.
        self.full_host_duplicates.pop(node.id, None)
        self._unregister_node(node)

    def _evict_component_and_detach_lru(
        self,
        node: UnifiedTreeNode,
        comp: TreeComponent,
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
        target: EvictLayer = EvictLayer.DEVICE,
        tracker: Optional[dict[ComponentType, int]] = None,
    ) -> tuple[int, int]:
        had_host_copy = node.component_data[comp.component_type].host_value is not None
        device_freed, host_freed = comp.evict_component(
            node,
            target=target,
            device_frees=device_frees,
            host_frees=host_frees,
            cache_actions=cache_actions,
        )
        if tracker is not None:
            if EvictLayer.DEVICE in target:
                tracker[comp.component_type] += device_freed
            elif EvictLayer.HOST in target:
                tracker[comp.component_type] += host_freed
        if (
            self._is_tracking_unbacked_tokens
            and comp.component_type == BASE_COMPONENT_TYPE
            and device_freed > 0
            and not had_host_copy
        ):
            self._tracked_unbacked_tokens += device_freed

        # Detach from the appropriate LRU list(s)
        ct = comp.component_type
        for layer, lru_lists in (
            (EvictLayer.DEVICE, self.lru_lists),
            (EvictLayer.HOST, self.host_lru_lists),
        ):
            if layer in target:
                lru = lru_lists[ct]
                if lru.in_list(node):
                    lru.remove_node(node)
        return device_freed, host_freed

    def _iteratively_delete_tombstone_leaf(
        self,
        deleted_node: UnifiedTreeNode,
        tracker: dict[ComponentType, int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ):
        """Walk up from *deleted_node* and cascade-delete childless ancestors.

        Only the Full (base) component decides whether a node survives:
          - Full device present  → keep as D-leaf
          - Full host present    → keep as H-leaf
          - neither              → evict all remaining data, delete, continue up
        """
        self._iteratively_delete_tombstone_ancestors(
            deleted_node.parent,
            tracker,
            device_frees,
            host_frees,
            cache_actions=cache_actions,
        )

    def _iteratively_delete_tombstone_ancestors(
        self,
        cur: UnifiedTreeNode,
        tracker: dict[ComponentType, int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        """Delete childless tombstone ancestors until a live or locked node is reached."""
        ct = BASE_COMPONENT_TYPE
        while cur != self.root_node and len(cur.children) == 0:
            if any(
                cd.lock_ref > 0 or cd.host_lock_ref > 0 for cd in cur.component_data
            ):
                break

            has_device = cur.component_data[ct].value is not None
            has_host = cur.component_data[ct].host_value is not None

            if has_device:
                self._update_evictable_leaf_sets(cur)
                break

            # Full device absent — clean up orphaned aux device data.
            for comp in self.components_by_type.values():
                if comp.node_has_component_data(cur):
                    self._evict_component_and_detach_lru(
                        cur,
                        comp,
                        target=EvictLayer.DEVICE,
                        tracker=tracker,
                        device_frees=device_frees,
                        host_frees=host_frees,
                        cache_actions=cache_actions,
                    )

            if has_host:
                self._update_evictable_leaf_sets(cur)
                break

            # Full absent on both layers — evict remaining host data, delete.
            for comp in self.components_by_type.values():
                if comp.node_has_component_data(cur, target=EvictLayer.HOST):
                    self._evict_component_and_detach_lru(
                        cur,
                        comp,
                        target=EvictLayer.HOST,
                        tracker=tracker,
                        device_frees=device_frees,
                        host_frees=host_frees,
                        cache_actions=cache_actions,
                    )

            self.evictable_host_leaves.discard(cur)
            self._remove_leaf_from_parent(cur)
            parent = cur.parent
            self._update_evictable_leaf_sets(parent)
            cur = parent

    def _is_device_leaf(self, node: UnifiedTreeNode) -> bool:
        """D-leaf: Full device value present, no child with Full KV on device,
        unlocked, not root.

        Only the Full (base) component is required; auxiliary components
        (Mamba, SWA) are not mandatory for D-leaf membership."""
        ct = BASE_COMPONENT_TYPE
        if node is self.root_node or node.evicted:
            return False
        if any(cd.lock_ref > 0 for cd in node.component_data):
            return False
        if any(
            child.component_data[ct].value is not None
            for child in node.children.values()
        ):
            return False
        return True

    def _is_host_leaf(self, node: UnifiedTreeNode) -> bool:
        """H-leaf: evicted, Full host value present, no children, unlocked on
        both tiers, not root.

        Only the Full (base) component host_value is required; auxiliary
        components are not mandatory for H-leaf membership. In-flight DMA
        marks need no check: marked nodes are never ``evicted``."""
        if node is self.root_node or not node.evicted:
            return False
        if not node.backuped:
            return False
        if any(cd.host_lock_ref > 0 for cd in node.component_data):
            return False
        # Segment locks count evicted nodes too: a device-locked candidate is
        # a live segment's anchor, and _evict_host_leaf would delete it.
        if any(cd.lock_ref > 0 for cd in node.component_data):
            return False
        if len(node.children) > 0:
            return False
        return True

    # ==== HiCache ====

    def set_hicache_enabled(self) -> None:
        self.enable_hicache = True

    def set_host_memory_buffer_only(self) -> None:
        self.is_host_memory_buffer_only = True

    def insert_host(
        self,
        node_id: NodeId,
        key: RadixKey,
        host_value: torch.Tensor,
        hash_value: list[str],
    ) -> InsertResult:
        """Insert a host-side (backuped) tree path descending from the given node."""
        node = self.node_by_id(node_id)
        total_len = len(key)
        self._touch_node(node)
        if total_len == 0:
            return InsertResult(prefix_len=0, mamba_exist=True)

        child_key = key.child_key(self.page_size)
        matched_length = 0
        host_prefix_len = 0
        refilled_host_node = None
        cache_actions: list[CacheAction | ComponentAction] = []
        while len(key) > 0 and child_key in node.children:
            node = node.children[child_key]
            self._touch_node(node)
            prefix_len = node.key.match(key, page_size=self.page_size)

            matched_host_value = host_value[:prefix_len]
            matched_hash_value = hash_value[: prefix_len // self.page_size]

            key = key[prefix_len:]
            host_value = host_value[prefix_len:]
            hash_value = hash_value[prefix_len // self.page_size :]
            matched_length += prefix_len

            if prefix_len < len(node.key):
                node, action = self._split_node(node.key, node, prefix_len)
                if action is not None:
                    cache_actions.append(action)

            if not self.is_write_back:
                full_data = node.component_data[BASE_COMPONENT_TYPE]
                if full_data.host_value is None:
                    full_data.host_value = matched_host_value.clone()
                    if node.hash_value is None:
                        node.hash_value = list(matched_hash_value)
                    self.kv_events.record_store(node, medium=StorageMedium.CPU)
                    self._update_evictable_leaf_sets(node)
                    if node.parent is not None:
                        self._update_evictable_leaf_sets(node.parent)
                    self._update_duplicate_tracking(node)
                    refilled_host_node = node
                else:
                    assert refilled_host_node is None, (
                        "write-through host-prefix invariant broken: encountered "
                        f"backed node {node.id} below a refilled host tombstone"
                    )
                    host_prefix_len += prefix_len

            if len(key):
                child_key = key.child_key(self.page_size)

        result = InsertResult(
            prefix_len=(matched_length if self.is_write_back else host_prefix_len),
            total_len=total_len,
            cache_actions=cache_actions,
        )
        if len(key) == 0:
            if node is not self.root_node and (
                refilled_host_node is not None
                or node.component_data[BASE_COMPONENT_TYPE].host_value is not None
            ):
                result.inserted_host_node = node.id
            return result

        # Drop the refill only under write-through (a non-write-back policy).
        if node is not self.root_node and not node.backuped and not self.is_write_back:
            logger.info(
                "HiCache prefetch dropped %d-token refill under un-backed-up node %d",
                len(host_value),
                node.id,
            )
            result.host_insert_dropped = True
            return result

        new_node = self._new_node(priority=node.priority)
        new_node.parent = node
        new_node.key = key
        if self.tlru_bookkeeping:
            _set_tlru_lens_and_raise_history(new_node, node)
        new_node.hash_value = hash_value
        new_node.component_data[BASE_COMPONENT_TYPE].host_value = host_value.clone()
        node.children[child_key] = new_node
        self._update_evictable_leaf_sets(new_node)
        self._update_evictable_leaf_sets(node)
        result.inserted_host_node = new_node.id
        self.kv_events.record_store(new_node, medium=StorageMedium.CPU)
        return result

    def build_backup_spec(self, node_id: NodeId):
        """Read a node's device->host backup spec (device value + component transfers) now."""
        return self._build_backup_spec(self.node_by_id(node_id))

    def buffer_backup_pool_keys(
        self, node_id: NodeId, hash_values: list[str]
    ) -> dict[ComponentType, dict[PoolName, list[str]]]:
        node = self.node_by_id(node_id)
        named: dict[ComponentType, dict[PoolName, list[str]]] = {}
        for comp in self.components:
            pool_keys = comp.buffer_backup_keys(node, hash_values)
            if pool_keys:
                named[comp.component_type] = pool_keys
        return named

    def build_backup_kv_action(self, node_id: NodeId) -> BackupKV:
        return self._build_backup_kv_action(self.node_by_id(node_id))

    def _build_backup_spec(self, node: UnifiedTreeNode):
        """Gather missing Full and component transfers for Host backup."""
        device_value = node.component_data[BASE_COMPONENT_TYPE].value
        assert device_value is not None
        if node.backuped:
            device_value = device_value[:0]

        comp_xfers: dict[ComponentType, list] = {}
        for comp in self.components:
            if comp.component_type == BASE_COMPONENT_TYPE:
                continue
            cd = node.component_data[comp.component_type]
            if cd.host_value is not None and not comp.needs_incremental_backup(node):
                continue
            t = comp.build_hicache_transfers(node, CacheTransferPhase.BACKUP_HOST)
            if t:
                comp_xfers[comp.component_type] = t
        return device_value, comp_xfers

    def build_storage_backup_spec(
        self, node_id: NodeId, pass_prefix_keys: bool
    ) -> Optional[StorageBackupSpec]:
        """Gather a node's device->storage backup spec; None if the node is not backuped."""
        node = self.node_by_id(node_id)
        if not node.backuped:
            return None
        prefix_keys = None
        if pass_prefix_keys:
            prefix_keys = node.get_prefix_hash_values(node.parent)
        comp_xfers: dict[ComponentType, list[PoolTransfer]] = {}
        for comp in self.components:
            if comp.component_type == BASE_COMPONENT_TYPE:
                continue
            transfers = comp.build_hicache_transfers(
                node, CacheTransferPhase.BACKUP_STORAGE
            )
            if transfers:
                comp_xfers[comp.component_type] = transfers
        return StorageBackupSpec(
            host_value=node.component_data[BASE_COMPONENT_TYPE].host_value,
            token_ids=node.key.token_ids,
            hash_value=node.hash_value,
            prefix_keys=prefix_keys,
            comp_xfers=comp_xfers,
        )

    def build_hicache_transfers(
        self,
        component_type: ComponentType,
        node_id: NodeId,
        phase: CacheTransferPhase,
        *,
        host_indices: Optional[torch.Tensor] = None,
        token_ids: Optional[Sequence[int]] = None,
        prefetch_tokens: int = 0,
        staging_tokens: int = 0,
        last_hash: Optional[str] = None,
    ) -> Optional[list[PoolTransfer]]:
        """Route a build_hicache_transfers call to the component for the given type."""
        return self.components_by_type[component_type].build_hicache_transfers(
            self.node_by_id(node_id),
            phase,
            host_indices=host_indices,
            token_ids=token_ids,
            prefetch_tokens=prefetch_tokens,
            staging_tokens=staging_tokens,
            last_hash=last_hash,
        )

    def build_load_back_spec(
        self, node_id: NodeId, req: Optional[Req] = None
    ) -> tuple[PoolTransfer, dict[ComponentType, list[PoolTransfer]]]:
        """Build the H->D load-back KV transfer plus per-component aux transfers."""
        # Component hooks take primitives, not Req: extract its fields here.
        mamba_pool_idx = req.kv.mamba_pool_idx if req is not None else None
        node = self.node_by_id(node_id)
        kv_xfer = self.components_by_type[BASE_COMPONENT_TYPE].build_hicache_transfers(
            node, CacheTransferPhase.LOAD_BACK
        )[0]
        comp_xfers: dict[ComponentType, list[PoolTransfer]] = {}
        for comp in self.components:
            if comp.component_type == BASE_COMPONENT_TYPE:
                continue
            t = comp.build_hicache_transfers(
                node, CacheTransferPhase.LOAD_BACK, mamba_pool_idx=mamba_pool_idx
            )
            if t:
                comp_xfers[comp.component_type] = t
        # Reject transfers that would claim a node pinned by another load-back
        # anchor; the empty spec makes the caller back off and recompute.
        if any(
            self.node_by_id(nid).load_back_pending_id not in (None, node_id)
            for xfers in ([kv_xfer], *comp_xfers.values())
            for xfer in xfers
            for nid in xfer.nodes_to_load or ()
        ):
            empty_kv = PoolTransfer(
                name=PoolName.KV,
                host_indices=torch.empty((0,), dtype=torch.int64, device="cpu"),
                nodes_to_load=[],
            )
            return empty_kv, {}
        return kv_xfer, comp_xfers

    def prefetch_anchor_info(
        self, node_id: NodeId
    ) -> tuple[Optional[str], Optional[str]]:
        """The anchor node's key extra_key and cache_salt."""
        node = self.node_by_id(node_id)
        if node.key is None:
            return None, None
        return node.key.extra_key, node.key.cache_salt

    def _build_backup_kv_action(
        self, node: UnifiedTreeNode, write_back: bool = False
    ) -> BackupKV:
        """Build the backup action for a node; write-through also chains its
        unbacked ancestors."""
        chain = [node]
        if not write_back:
            ancestor = node.parent
            while (
                ancestor is not None
                and ancestor is not self.root_node
                and not ancestor.backuped
                and not ancestor.external_cache_stored
                and (
                    not self.enable_external_cache_linker
                    or ancestor.write_through_pending_id is None
                )
            ):
                chain.append(ancestor)
                ancestor = ancestor.parent
            # write_through: Ancestors first to preserve backup invariant
            chain.reverse()
        return BackupKV([target.id for target in chain])

    def commit_hicache_transfers(
        self,
        node_id: NodeId,
        phase: CacheTransferPhase,
        comp_xfers: dict[ComponentType, list[PoolTransfer]],
        *,
        cache_actions: list[CacheAction | ComponentAction],
        insert_result: Optional[InsertResult] = None,
        pool_storage_result: Optional[PoolTransferResult] = None,
    ) -> None:
        """Commit each component's HiCache transfers onto the node."""
        node = self.node_by_id(node_id)
        for ct, xfers in comp_xfers.items():
            self.components_by_type[ct].commit_hicache_transfer(
                node,
                phase,
                xfers,
                cache_actions=cache_actions,
                insert_result=insert_result,
                pool_storage_result=pool_storage_result,
            )

    def commit_backup(
        self,
        node_id: NodeId,
        host_indices: torch.Tensor,
        comp_xfers: dict[ComponentType, list[PoolTransfer]],
    ) -> None:
        """Commit a successful backup to the node."""
        node = self.node_by_id(node_id)
        cache_actions: list[CacheAction | ComponentAction] = []
        if host_indices.numel() > 0:
            kv_xfer = PoolTransfer(name=PoolName.KV, host_indices=host_indices)
            self.components_by_type[BASE_COMPONENT_TYPE].commit_hicache_transfer(
                node,
                CacheTransferPhase.BACKUP_HOST,
                transfers=[kv_xfer],
                cache_actions=cache_actions,
            )
        for ct, xfers in comp_xfers.items():
            self.components_by_type[ct].commit_hicache_transfer(
                node,
                CacheTransferPhase.BACKUP_HOST,
                transfers=xfers,
                cache_actions=cache_actions,
            )
        assert not cache_actions  # BACKUP_HOST emits no actions

    def commit_load_back(
        self,
        node_id: NodeId,
        device_indices: torch.Tensor,
        kv_xfer: PoolTransfer,
        comp_xfers: dict[ComponentType, list[PoolTransfer]],
    ) -> list[CacheAction | ComponentAction]:
        """Commit a successful H->D load-back onto the node; the SWA full->swa mapping
        rebuild is deferred to the orchestration layer."""
        node = self.node_by_id(node_id)
        cache_actions: list[CacheAction | ComponentAction] = []
        if self.is_write_back:
            # Pin Full KV host slots against duplicate reclaim until the ack.
            # Auxiliary pools have independent host locks and may legitimately
            # load the same radix node under a different anchor.
            for nid in kv_xfer.nodes_to_load or ():
                pinned = self.node_by_id(nid)
                assert pinned.load_back_pending_id in (None, node_id), (
                    f"node {nid} pinned by load-back "
                    f"{pinned.load_back_pending_id}, new anchor {node_id}"
                )
                pinned.load_back_pending_id = node_id
        kv_xfer.device_indices = device_indices
        self.components_by_type[BASE_COMPONENT_TYPE].commit_hicache_transfer(
            node,
            CacheTransferPhase.LOAD_BACK,
            [kv_xfer],
            cache_actions=cache_actions,
        )
        for nid in kv_xfer.nodes_to_load or ():
            self.kv_events.record_store(self.node_by_id(nid), medium=StorageMedium.GPU)
        for ct, xfers in comp_xfers.items():
            self.components_by_type[ct].commit_hicache_transfer(
                node,
                CacheTransferPhase.LOAD_BACK,
                xfers,
                cache_actions=cache_actions,
            )
        self._update_evictable_leaf_sets(node)
        return cache_actions

    def finish_load_back(self, anchor_node_id: NodeId) -> None:
        """Finalize H->D load-back state along the anchor's root path.

        Write-back clears source-node pins at ack time. Write-through does not
        use those pins, but still refreshes duplicate tracking after the device
        copies become visible. Split fragments stay on the path, so the walk
        covers them.
        """
        node = self.node_by_id(anchor_node_id)
        while node is not None and node is not self.root_node:
            if self.is_write_back:
                if node.load_back_pending_id != anchor_node_id:
                    node = node.parent
                    continue
                node.load_back_pending_id = None
            self._update_duplicate_tracking(node)
            node = node.parent

    def mark_write_through_pending(
        self, node_ids: list[NodeId], ack_id: NodeId
    ) -> list[NodeId]:
        """Stamp ack_id on every covered node; returns them ancestors first."""
        marked: list[tuple[int, NodeId]] = []
        for node_id in node_ids:
            node = self.node_by_id(node_id)
            assert node.write_through_pending_id in (
                None,
                ack_id,
            ), f"node {node.id} is already pending under a different write-through ack"
            node.write_through_pending_id = ack_id
            marked.append((self._depth_from_root(node), node_id))
        marked.sort()
        return [node_id for _, node_id in marked]

    @staticmethod
    def _depth_from_root(node: UnifiedTreeNode) -> int:
        depth = 0
        while node.parent is not None:
            depth += 1
            node = node.parent
        return depth

    def build_external_linker_offload_transfers(
        self, node_id: NodeId
    ) -> Optional[list[PoolTransfer]]:
        """Build transfers for a node with no stored or pending external copy."""
        node = self.node_by_id(node_id)
        if not self._needs_external_linker_offload(node):
            return None

        transfers = []
        for component in self.components:
            transfer = component.build_external_linker_transfer(
                LinkerTransferPhase.OFFLOAD, node, None
            )
            if transfer is not None:
                transfers.append(transfer)
        return transfers

    def mark_external_cache_stored_path(
        self, from_node_id: NodeId, until_node_id: NodeId
    ) -> None:
        """Mark an externally restored path, excluding its existing anchor."""
        until_node = self.node_by_id(until_node_id)
        node = self.node_by_id(from_node_id)
        path = []
        while node is not until_node:
            if node.parent is None:
                raise RuntimeError(
                    f"node {until_node_id} is not an ancestor of node {from_node_id}"
                )
            path.append(node)
            node = node.parent

        for node in path:
            node.external_cache_stored = True

    def mark_external_linker_offload_pending(self, node_id: NodeId) -> None:
        """Publish an accepted external offload as pending."""
        node = self.node_by_id(node_id)
        if not self._needs_external_linker_offload(node):
            raise AssertionError(
                f"invalid external offload state for node {node_id}: "
                f"stored={node.external_cache_stored}, "
                f"pending={node.write_through_pending_id}"
            )
        node.write_through_pending_id = node_id

    def finish_external_linker_offload(
        self, node_ids: Sequence[NodeId], ack_id: NodeId, success: bool
    ) -> None:
        """Finalize external-store state for an offload and its split fragments."""
        nodes = [self.node_by_id(node_id) for node_id in node_ids]
        for node_id, node in zip(node_ids, nodes):
            if node.write_through_pending_id != ack_id:
                raise AssertionError(
                    f"invalid external offload state for node {node_id}: "
                    f"expected pending={ack_id}; got "
                    f"stored={node.external_cache_stored}, "
                    f"pending={node.write_through_pending_id}"
                )
        for node in nodes:
            node.write_through_pending_id = None
            node.external_cache_stored |= success

    def finish_write_through(self, node_ids: list[NodeId], ack_id: int) -> None:
        """Clear the write-through-pending mark (when it matches ack_id) and record the
        host store event for each acked node."""
        for node_id in node_ids:
            node = self.node_by_id(node_id)
            if node.write_through_pending_id == ack_id:
                node.write_through_pending_id = None
                # The backed-up copy becomes a tracked duplicate only now.
                self._update_duplicate_tracking(node)
            self.kv_events.record_store(node, medium=StorageMedium.CPU)

    def _walk_span(self, key: RadixKey, end: int):
        """Yield nodes and their matched spans along ``key`` through ``end``."""
        node = self.root_node
        pos = 0
        remaining = key
        while pos < end and len(remaining) > 0:
            child = node.children.get(remaining.child_key(self.page_size))
            if child is None or (child.evicted and not child.backuped):
                return
            prefix_len = child.key.match(remaining, page_size=self.page_size)
            if prefix_len == 0:
                return
            yield child, pos, prefix_len
            if prefix_len < len(child.key):
                return
            node = child
            pos += prefix_len
            remaining = remaining[prefix_len:]

    def swa_tombstone_ranges(
        self,
        key: RadixKey,
        start: int,
        end: int,
        component_type: ComponentType = ComponentType.SWA,
    ) -> list[tuple[int, int]]:
        """Return the maximal SWA-tombstoned ranges within ``[start, end)``."""
        ranges: list[tuple[int, int]] = []
        for child, pos, prefix_len in self._walk_span(key, end):
            seg_end = pos + prefix_len
            if seg_end <= start:
                continue
            if child.component_data[component_type].value is not None:
                continue
            lo, hi = max(start, pos), min(end, seg_end)
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
            if hi >= end:
                break
        return ranges

    def attach_swa_window(
        self,
        key: RadixKey,
        window_start: int,
        window_end: int,
        swa_values: torch.Tensor,
        component_type: ComponentType = ComponentType.SWA,
    ) -> list[CacheAction | ComponentAction]:
        """Attach a loaded SWA slice to an existing tombstoned tree span."""
        assert len(swa_values) == window_end - window_start, (
            f"attach_swa_window size mismatch: got {len(swa_values)} "
            f"for [{window_start}, {window_end})"
        )
        actions: list[CacheAction | ComponentAction] = []
        covered = window_start
        for child, pos, prefix_len in list(self._walk_span(key, window_end)):
            seg_end = pos + prefix_len
            if seg_end <= window_start:
                continue
            seg_start = max(pos, window_start)
            assign_end = min(seg_end, window_end)
            assert child.component_data[component_type].value is None, (
                f"attach_swa_window over live SWA at [{seg_start}, {assign_end}) "
                f"of [{window_start}, {window_end})"
            )
            self._attach_swa_segment(
                child,
                pos,
                seg_start,
                assign_end,
                swa_values[seg_start - window_start : assign_end - window_start],
                actions,
                component_type,
            )
            covered = assign_end
            if covered >= window_end:
                break
        assert covered == window_end, (
            f"attach_swa_window covered {covered} of [{window_start}, {window_end})"
        )
        return actions

    def _attach_swa_segment(
        self,
        node: UnifiedTreeNode,
        node_start: int,
        seg_start: int,
        seg_end: int,
        values: torch.Tensor,
        actions: list[CacheAction | ComponentAction],
        component_type: ComponentType,
    ) -> None:
        target = node
        if seg_start > node_start:
            _, action = self._split_node(target.key, target, seg_start - node_start)
            if action is not None:
                actions.append(action)
        if seg_start + len(target.key) > seg_end:
            fragment, action = self._split_node(target.key, target, seg_end - seg_start)
            if action is not None:
                actions.append(action)
            target = fragment
        self.set_component_device_value(target.id, component_type, values.clone())

    def set_component_device_value(
        self, node_id: NodeId, component_type: ComponentType, value: torch.Tensor
    ) -> None:
        """Store an auxiliary component's device value onto a node."""
        # Full uses leaf sets, not LRU; its stores go through the insert paths.
        assert component_type != BASE_COMPONENT_TYPE
        node = self.node_by_id(node_id)
        cd = node.component_data[component_type]
        cd.value = value
        host_lru = self.host_lru_lists[component_type]
        if host_lru.in_list(node):
            host_lru.remove_node(node)
        self.lru_lists[component_type].insert_mru(node)
        # A value materialized under lock is protected; the last release
        # moves it to evictable.
        ledger = self.components_by_type[component_type].reclaimable_value_len(node)
        if cd.lock_ref > 0:
            self.component_protected_size_[component_type] += ledger
        else:
            self.component_evictable_size_[component_type] += ledger

    def adjust_component_size(
        self, node_id: NodeId, component_type: ComponentType, delta: int
    ) -> None:
        node = self.node_by_id(node_id)
        if component_type not in self.components_by_type:
            raise ValueError(f"component is not enabled: {component_type}")
        cd = node.component_data[component_type]
        if node is self.root_node or cd.value is None:
            return
        sizes = (
            self.component_protected_size_
            if cd.lock_ref > 0
            else self.component_evictable_size_
        )
        updated = sizes[component_type] + delta
        if updated < 0:
            raise ValueError(f"component size cannot be negative: {updated}")
        sizes[component_type] = updated

    def get_component_device_value(
        self, node_id: NodeId, component_type: ComponentType
    ) -> Optional[torch.Tensor]:
        """The component's device value on the node, or None if evicted."""
        return self.node_by_id(node_id).component_data[component_type].value

    def component_has_host_value_only(
        self, node_id: NodeId, component_type: ComponentType
    ) -> bool:
        """Whether the component's data is device-evicted but host-backed."""
        cd = self.node_by_id(node_id).component_data[component_type]
        return cd.value is None and cd.host_value is not None

    # ==== Others ====

    def sanity_check(
        self,
        ongoing_write_through: list[tuple[int, NodeId]],
        ongoing_load_back: list[tuple[int, NodeId]],
    ) -> None:
        """Verify tree-structure, leaf-set, LRU, size, and ongoing-op invariants; raise
        AssertionError on any violation. ongoing_* args are (id, node_id) pairs.
        """
        errors: list[str] = []
        E = errors.append
        all_nodes = self._collect_all_nodes()
        all_node_set = set(all_nodes)
        FCT = BASE_COMPONENT_TYPE

        # ── PART 1: Tree Structure ──
        # Root state
        if self.root_node.component_data[FCT].value is None:
            E("[Root] root missing Full device value")
        if self.root_node.component_data[FCT].lock_ref <= 0:
            E(
                f"[Root] root Full lock_ref={self.root_node.component_data[FCT].lock_ref}"
            )
        if self.root_node.parent is not None:
            E("[Root] root has a parent pointer")
        # Parent ↔ child bidirectional consistency
        for node in all_nodes:
            for child in node.children.values():
                if child.parent is not node:
                    pid = child.parent.id if child.parent else None
                    E(f"[Tree] child {child.id} parent={pid}, expected {node.id}")
                if child.key is None:
                    E(f"[Tree] node {child.id} has no key")

        # ── PART 2: Per-node state machine and leaf qualification ──
        expected_dev_leaves: set[UnifiedTreeNode] = set()
        expected_hst_leaves: set[UnifiedTreeNode] = set()
        expected_duplicates: set[UnifiedTreeNode] = set()

        for node in all_nodes:
            if node is self.root_node:
                continue
            nid = node.id
            full_dev = node.component_data[FCT].value is not None
            full_hst = node.component_data[FCT].host_value is not None

            # Full is the tree backbone, so aux data requires Full data.
            for ct in self.component_types:
                if ct == FCT:
                    continue
                cd = node.component_data[ct]
                if cd.value is not None and not full_dev:
                    E(f"node {nid} {ct} device present but Full.value=None")
                if cd.host_value is not None and not full_hst:
                    # write_back reclaim takes only the Full host layer; an
                    # aux host slice may outlive it while Full device is live.
                    if not (self.is_write_back and full_dev):
                        E(f"node {nid} {ct} host present but Full.host_value=None")

            # Every node must keep Full data on at least one layer.
            if not full_dev and not full_hst:
                E(f"node {nid} dead: no Full device and no Full host")

            # Parent prefixes must keep data whenever the child does.
            if node.parent is not None and node.parent is not self.root_node:
                p_dev = node.parent.component_data[FCT].value is not None
                p_hst = node.parent.component_data[FCT].host_value is not None
                if full_dev and not p_dev:
                    E(f"node {nid} device present but parent {node.parent.id} evicted")
                if full_hst and not p_hst and not self.is_write_back:
                    E(f"node {nid} backed up but parent {node.parent.id} not backed up")

            # Lock hierarchy and counters must stay sane.
            fl = node.component_data[FCT].lock_ref
            for ct in self.component_types:
                cd = node.component_data[ct]
                if cd.lock_ref < 0:
                    E(f"node {nid} {ct} lock_ref={cd.lock_ref}")
                if cd.host_lock_ref < 0:
                    E(f"node {nid} {ct} host_lock_ref={cd.host_lock_ref}")
                if ct != FCT and fl < cd.lock_ref:
                    E(f"node {nid} full_lock={fl} < {ct}_lock={cd.lock_ref}")
                # Locked tombstones are legal: segment locks count every
                # node in [start, boundary], data-bearing or not.

            # Collect expected leaf qualification (single pass)
            if self._is_device_leaf(node):
                expected_dev_leaves.add(node)
            if self._is_host_leaf(node):
                expected_hst_leaves.add(node)
            if self._is_settled_full_host_duplicate(node):
                expected_duplicates.add(node)

        # ── PART 3: Tracking structures ──

        # Device leaf set must match the expected leaves.
        if self.evictable_device_leaves != expected_dev_leaves:
            extra = self.evictable_device_leaves - expected_dev_leaves
            missing = expected_dev_leaves - self.evictable_device_leaves
            if extra:
                E(f"D-leaf extra: {[n.id for n in list(extra)[:5]]}")
            if missing:
                E(f"D-leaf missing: {[n.id for n in list(missing)[:5]]}")

        # Host leaf set must match the expected leaves.
        if self.evictable_host_leaves != expected_hst_leaves:
            extra = self.evictable_host_leaves - expected_hst_leaves
            missing = expected_hst_leaves - self.evictable_host_leaves
            if extra:
                E(f"H-leaf extra: {[n.id for n in list(extra)[:5]]}")
            if missing:
                E(f"H-leaf missing: {[n.id for n in list(missing)[:5]]}")

        # Lazy deregistration: stale extras are legal; settled duplicates must
        # be tracked and entries must not outlive their node.
        expected_ids = {n.id for n in expected_duplicates}
        dup_ids = set(self.full_host_duplicates.keys())
        if expected_ids - dup_ids:
            E(f"Duplicate missing: {list(expected_ids - dup_ids)[:5]}")
        ghost_ids = dup_ids - {n.id for n in all_nodes}
        if ghost_ids:
            E(f"Duplicate ghosts: {list(ghost_ids)[:5]}")

        # D-leaf ∩ H-leaf = ∅
        overlap = self.evictable_device_leaves & self.evictable_host_leaves
        if overlap:
            E(
                f"[Leaf] {len(overlap)} in both sets: {[n.id for n in list(overlap)[:5]]}"
            )

        if self.enable_session_radix_cache:
            for component in self.components:
                component.validate_session_state(all_node_set, E)

        # Stale nodes: leaf sets must only contain tree-reachable nodes
        stale = self.evictable_device_leaves - all_node_set
        if stale:
            E(
                f"{len(stale)} stale nodes in device_leaves: {[n.id for n in list(stale)[:5]]}"
            )
        stale = self.evictable_host_leaves - all_node_set
        if stale:
            E(
                f"{len(stale)} stale nodes in host_leaves: {[n.id for n in list(stale)[:5]]}"
            )

        # Per-component LRU tracking
        for ct in self.component_types:
            lru = self.lru_lists[ct]
            if ct == FCT:
                # Full uses leaf sets, not LRU
                if len(lru.cache) > 0:
                    E(f"Full device LRU not empty: {len(lru.cache)}")
                if len(self.host_lru_lists[ct].cache) > 0:
                    E(f"Full host LRU not empty: {len(self.host_lru_lists[ct].cache)}")
            else:
                # Aux device values must match the device LRU.
                tree_ids = {
                    n.id
                    for n in all_nodes
                    if n is not self.root_node
                    and n.component_data[ct].value is not None
                }
                lru_ids = set(lru.cache.keys())
                if tree_ids != lru_ids:
                    E(
                        f"{ct} device LRU: "
                        f"+tree={tree_ids - lru_ids}, +lru={lru_ids - tree_ids}"
                    )
                # Aux host-only states must match the host LRU. A host lock
                # delists its node, so locked nodes are exempt on both sides.
                host_lru = self.host_lru_lists[ct]
                host_locked_ids = {
                    n.id for n in all_nodes if n.component_data[ct].host_lock_ref > 0
                }
                s3_ids = {
                    n.id
                    for n in all_nodes
                    if n is not self.root_node
                    and n.component_data[ct].value is None
                    and n.component_data[ct].host_value is not None
                } - host_locked_ids
                host_lru_ids = set(host_lru.cache.keys()) - host_locked_ids
                if s3_ids != host_lru_ids:
                    E(
                        f"{ct} host LRU: "
                        f"+S3={s3_ids - host_lru_ids}, +lru={host_lru_ids - s3_ids}"
                    )
                # The same aux node must not appear in both device and host LRU.
                inv5_overlap = lru_ids & host_lru_ids
                if inv5_overlap:
                    E(f"{ct} in both device and host LRU: {inv5_overlap}")
                # Linked-list integrity
                self._check_lru_linked_list(lru, ct, "device", errors)
                self._check_lru_linked_list(host_lru, ct, "host", errors)

        # ── PART 4: Size Accounting ──
        for ct in self.component_types:
            evictable = 0
            protected = 0
            for n in all_nodes:
                if n is self.root_node:
                    continue
                cd = n.component_data[ct]
                if cd.value is not None:
                    toks = self.components_by_type[ct].reclaimable_value_len(n)
                    if cd.lock_ref > 0:
                        protected += toks
                    else:
                        evictable += toks
            if self.component_evictable_size_[ct] != evictable:
                E(
                    f"[Size] {ct} evictable={self.component_evictable_size_[ct]} "
                    f"!= recomputed={evictable}"
                )
            if self.component_protected_size_[ct] != protected:
                E(
                    f"[Size] {ct} protected={self.component_protected_size_[ct]} "
                    f"!= recomputed={protected}"
                )

        # ── PART 5: Ongoing Operations ──
        for nid, node_id in ongoing_write_through:
            n = self._node_arena.get(node_id)
            if n is None or n not in all_node_set:
                E(f"[Ongoing] write_through node {nid} not in tree")
            elif n.component_data[FCT].lock_ref <= 0:
                E(
                    f"[Ongoing] write_through node {nid} lock_ref={n.component_data[FCT].lock_ref}"
                )
        for nid, node_id in ongoing_load_back:
            n = self._node_arena.get(node_id)
            if n is None or n not in all_node_set:
                E(f"[Ongoing] load_back node {nid} not in tree")
            elif n.component_data[FCT].lock_ref <= 0:
                E(
                    f"[Ongoing] load_back node {nid} lock_ref={n.component_data[FCT].lock_ref}"
                )
        # Every in-flight H->D mark must belong to a live load-back; a leaked
        # mark would pin the node's host copy against reclaim forever.
        ongoing_load_ids = {node_id for _, node_id in ongoing_load_back}
        for node in all_nodes:
            if (
                node.load_back_pending_id is not None
                and node.load_back_pending_id not in ongoing_load_ids
            ):
                E(
                    f"[Ongoing] node {node.id} load_back_pending_id="
                    f"{node.load_back_pending_id} has no live load-back"
                )

        if errors:
            msg = (
                f"Sanity check FAILED ({len(errors)} violations "
                f"across {len(all_nodes)} nodes):\n"
                + "\n".join(f"  {e}" for e in errors)
            )
            logger.error(msg)
            self.pretty_print()
            raise AssertionError(msg)

    def _collect_all_nodes(self) -> list[UnifiedTreeNode]:
        nodes = []
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _check_lru_linked_list(
        self,
        lru: UnifiedLRUList,
        ct: ComponentType,
        label: str,
        errors: list[str],
    ) -> None:
        """Walk a LRU doubly-linked list, collect integrity errors."""
        pt = lru._pt  # use LRU's own pointer slot
        visited: set[int] = set()
        x = lru.head.lru_next[pt]
        prev = lru.head
        while x is not None and x != lru.tail:
            if x.lru_prev[pt] != prev:
                errors.append(f"[{label}][{ct}] broken prev at node {x.id}")
            if x is lru.mid or x is lru.cursor:
                prev = x
                x = x.lru_next[pt]
                continue
            if x.id not in lru.cache:
                errors.append(f"[{label}][{ct}] node {x.id} in list not cache")
            if x.id in visited:
                errors.append(f"[{label}][{ct}] cycle at node {x.id}")
                break
            visited.add(x.id)
            prev = x
            x = x.lru_next[pt]
        if x is None:
            errors.append(
                f"[{label}][{ct}] broken chain: lru_next is None "
                f"after node {prev.id if hasattr(prev, 'id') else 'head'}"
            )
        if len(visited) != len(lru.cache):
            errors.append(
                f"[{label}][{ct}] list={len(visited)} != cache={len(lru.cache)}"
            )

    def pretty_print(self) -> None:
        stack = [(self.root_node, 0)]
        while stack:
            node, indent = stack.pop()
            component_str = " ".join(
                f"{ct}={'yes' if node.component_data[ct].value is not None else 'no'}"
                for ct in self.component_types
            )
            print(
                " " * indent,
                f"[{node.id}]",
                len(node.key),
                f"full_lock={node.component_data[BASE_COMPONENT_TYPE].lock_ref}",
                component_str,
            )
            for child in node.children.values():
                stack.append((child, indent + 2))

    def evictable_size(self) -> int:
        return self.component_evictable_size_.get(BASE_COMPONENT_TYPE, 0)

    def protected_size(self) -> int:
        return self.component_protected_size_.get(BASE_COMPONENT_TYPE, 0)

    def component_evictable_size(self, component_type: ComponentType) -> int:
        """Evictable token count for one component (0 if the component is absent)."""
        return self.component_evictable_size_.get(component_type, 0)

    def component_protected_size(self, component_type: ComponentType) -> int:
        return self.component_protected_size_.get(component_type, 0)

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def full_protected_size(self) -> int:
        return self.protected_size()

    def swa_evictable_size(self) -> int:
        return self.component_evictable_size_.get(ComponentType.SWA, 0)

    def mamba_evictable_size(self) -> int:
        return self.component_evictable_size_.get(ComponentType.MAMBA, 0)

    def swa_protected_size(self) -> int:
        return self.component_protected_size_.get(ComponentType.SWA, 0)

    def mamba_protected_size(self) -> int:
        return self.component_protected_size_.get(ComponentType.MAMBA, 0)

    def total_size(self) -> tuple[int, int]:
        total_size = 0
        total_aux_size = 0
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            full_value = node.component_data[BASE_COMPONENT_TYPE].value
            if full_value is not None:
                total_size += len(full_value)
            for ct in self.component_types:
                if ct == BASE_COMPONENT_TYPE:
                    continue
                value = node.component_data[ct].value
                if value is not None:
                    total_aux_size += len(value)
            for child in node.children.values():
                stack.append(child)
        return total_size, total_aux_size

    def walk_for_kv_canary(
        self, unlocked_only: bool, swa_resident_only: bool
    ) -> RadixCacheWalkResult:
        """Flatten every FULL device slot into (slot, position, prev-slot) rows for the KV-canary sweep."""
        slots: list[int] = []
        positions: list[int] = []
        prev_slots: list[int] = []
        swa_filter = swa_resident_only and ComponentType.SWA in self.components_by_type

        def _dfs(node: UnifiedTreeNode, depth: int, parent_last_slot: int) -> None:
            value = node.component_data[BASE_COMPONENT_TYPE].value
            node_slots = value.tolist() if isinstance(value, torch.Tensor) else []

            emit = node is not self.root_node
            if unlocked_only:
                # Unified SWA owns an independent component lock. A node can still
                # hold Full KV for a running request while its SWA slots are unused.
                lock_ct = ComponentType.SWA if swa_filter else BASE_COMPONENT_TYPE
                emit = emit and node.component_data[lock_ct].lock_ref == 0
            if swa_filter:
                emit = emit and node.component_data[ComponentType.SWA].value is not None

            # Skipped nodes still advance the chain/depth so descendants stay consistent.
            chain_last_slot = parent_last_slot
            for j, slot in enumerate(node_slots):
                if emit:
                    slots.append(slot)
                    positions.append(depth + j)
                    prev_slots.append(parent_last_slot if j == 0 else node_slots[j - 1])
                chain_last_slot = slot

            # Device-evicted nodes hold no slots but still span their key length.
            if node is self.root_node or node.key is None:
                child_depth = depth + len(node_slots)
            else:
                child_depth = depth + len(node.key)
            for child in node.children.values():
                _dfs(child, child_depth, chain_last_slot)

        _dfs(self.root_node, 0, -1)
        return RadixCacheWalkResult(
            slot_indices=torch.tensor(slots, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            prev_slot_indices=torch.tensor(prev_slots, dtype=torch.int64),
        )

    def all_values_flatten(self) -> torch.Tensor:
        values = []

        def _dfs(node: UnifiedTreeNode):
            for child in node.children.values():
                v = child.component_data[BASE_COMPONENT_TYPE].value
                if v is not None:
                    values.append(v)
                _dfs(child)

        _dfs(self.root_node)
        if values:
            return torch.cat(values)
        return torch.tensor([], dtype=torch.int64, device=self.device)

    def _all_component_values_flatten(
        self, component_type: ComponentType
    ) -> torch.Tensor:
        if component_type not in self.components_by_type:
            return torch.tensor([], dtype=torch.int64, device=self.device)

        values = []

        def _dfs(node: UnifiedTreeNode):
            value = node.component_data[component_type].value
            if value is not None:
                values.append(value)
            for child in node.children.values():
                _dfs(child)

        _dfs(self.root_node)
        if values:
            return torch.cat(values)
        return torch.tensor([], dtype=torch.int64, device=self.device)

    def all_mamba_values_flatten(self) -> torch.Tensor:
        return self._all_component_values_flatten(ComponentType.MAMBA)
