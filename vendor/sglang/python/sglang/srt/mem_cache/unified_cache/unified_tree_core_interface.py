"""Interface of the TreeCore: the radix tree mechanism that owns the tree
structure, per-node values, the LRU(s), and bookkeeping. The Controller drives a
TreeCore exclusively through this surface, so an alternative implementation (e.g.
a Rust TreeCore) can satisfy it without subclassing the Python tree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from typing import TYPE_CHECKING, Optional, Sequence

import msgspec

from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

# Tree node id -- the node handle used outside the TreeCore. The concrete tree
# node is a TreeCore-internal type.
NodeId = int


class BaseEvictionResult(msgspec.Struct):
    """Base of the eviction step results: the component-keyed device/host
    values the step freed, for the Controller to drain right after the call
    returns, plus `tracker` -- the step's per-component evicted counts for the
    Controller to accumulate. Free the values, then drain cache actions."""

    device_frees: dict[ComponentType, list[torch.Tensor]] = msgspec.field(
        default_factory=lambda: defaultdict(list)
    )
    host_frees: dict[ComponentType, list[torch.Tensor]] = msgspec.field(
        default_factory=lambda: defaultdict(list)
    )
    tracker: dict[ComponentType, int] = msgspec.field(
        default_factory=lambda: defaultdict(int)
    )
    cache_actions: list[CacheAction | ComponentAction] = msgspec.field(
        default_factory=list
    )

    def __del__(self) -> None:
        # Drop tripwire: every returned resource must be drained before disposal.
        assert (
            not self.device_frees and not self.host_frees and not self.cache_actions
        ), "BaseEvictionResult dropped with undrained resources"


class EvictDeviceNextNodeResult(BaseEvictionResult):
    """One device-walk step.

    ``node_id`` selects a leaf for the Controller to evict. ``made_progress``
    also covers an internal tombstone that returned no leaf, distinguishing it
    from true walk exhaustion. ``mamba_backup_node_id`` and
    ``swa_backup_node_id`` pause an internal eviction until the Controller
    finishes its best-effort host backup. ``swa_backup_num_tokens`` includes
    all unbacked SWA segments in the backup window, not just the victim.
    """

    node_id: Optional[NodeId] = None
    made_progress: bool = False
    unbacked_tokens: int = 0
    mamba_backup_node_id: Optional[NodeId] = None
    swa_backup_node_id: Optional[NodeId] = None
    swa_backup_num_tokens: int = 0


class EvictDeviceLeafResult(BaseEvictionResult):
    backup_kv: Optional[BackupKV] = None
    unbacked_tokens: int = 0


class DemoteResult(BaseEvictionResult):
    pass


class DropSubtreeNoHostResult(BaseEvictionResult):
    is_dropped: bool = False


class DriveHostEvictionResult(BaseEvictionResult):
    pass


class DecSwaLockOnlyResult(BaseEvictionResult):
    pass


class RadixCacheWalkResult(msgspec.Struct, frozen=True, kw_only=True):
    """Flat (slot, position, prev-slot) rows emitted by the KV-canary walk."""

    slot_indices: torch.Tensor
    positions: torch.Tensor
    prev_slot_indices: torch.Tensor


class BufferBackupSnapshot(msgspec.Struct, frozen=True):
    node_id: NodeId
    parent_node_id: NodeId
    parent_is_root: bool
    parent_last_hash: Optional[str]
    hash_values: list[str]
    key: RadixKey
    prefix_keys: Optional[list[str]]


class BufferBackupState(msgspec.Struct, frozen=True):
    parent_node_id: NodeId
    parent_is_root: bool
    parent_last_hash: Optional[str]


class TreePathNodeInfo(msgspec.Struct, frozen=True):
    """A node's key span on its root-to-node path."""

    node_id: NodeId
    parent_id: NodeId
    # Half-open offsets from the root, in tokens (bigrams for bigram trees).
    path_start: int
    path_end: int
    # Logical FULL device indices; None when the value is absent.
    full_value_len: Optional[int]
    num_children: int


class InsertStepResult(msgspec.Struct, frozen=True):
    """One step of a resumable insert: the Controller executes ``actions``, then
    resumes while ``result`` is None; ``result`` is set on the final step."""

    actions: list[CacheAction | ComponentAction]
    result: Optional[InsertResult] = None


if TYPE_CHECKING:
    import torch

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import (
        DecLockRefParams,
        DecLockRefResult,
        IncLockRefResult,
        InsertParams,
        InsertResult,
        MatchPrefixParams,
        MatchResult,
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
    )
    from sglang.srt.mem_cache.unified_cache.components import (
        CacheTransferPhase,
    )
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import (
        StorageBackupSpec,
        UnifiedTreeNode,
    )


class UnifiedTreeCoreInterface(ABC):
    """Methods the Controller invokes on the Tree Core. The Controller treats the
    Tree Core as opaque behind this surface, which grows as tree operations
    migrate onto the TreeCore."""

    # ==== Tree-owned state the Controller reads (or, via its facade setters, writes) ====
    page_size: int
    is_eagle: bool
    device: torch.device
    enable_hicache: bool
    enable_storage: bool
    enable_external_cache_linker: bool
    write_through_threshold: int
    is_write_back: bool
    has_swa_host_pool: bool
    # Whether the host tier stages one node per FIFO backup intent.
    is_host_memory_buffer_only: bool
    kv_events: KVCacheEventRecorder

    # ==== Tree API ====

    def take_events(self) -> list:
        """Hand the queued KV placement events to the Controller."""
        return self.kv_events.take()

    @abstractmethod
    def reset(self) -> None:
        """Drop the entire tree and reinitialize empty state."""
        ...

    @abstractmethod
    def node_by_id(self, node_id: NodeId) -> UnifiedTreeNode:
        """Resolve a NodeId -- the tree-node identity the Controller passes
        across the boundary (e.g. MatchResult fields, lock-ref args) -- back to
        its tree node.

        TODO(Jialin): Remove after the Unified Radix Cache split.
        """
        ...

    @abstractmethod
    def is_write_through_compatible(self) -> bool:
        """Whether current host ownership satisfies write-through invariants.

        Read-only; the caller must have drained in-flight cache operations.
        """
        ...

    @abstractmethod
    def is_backuped(self, node_id: NodeId) -> bool:
        """Whether the node's KV is already backed up to host."""
        ...

    @abstractmethod
    def is_root(self, node_id: NodeId) -> bool:
        """Whether the node is the tree root."""
        ...

    # Logical-page KV sharding: whether this core stamps and honors
    # UnifiedTreeNode.rotation_base. A core that does not cannot serve a
    # sharded allocator (it would never decline a cross-base graft), and
    # UnifiedRadixCache.__init__ rejects that pairing at construction.
    supports_rotation_base: bool = False

    def rotation_base_of(self, node_id: NodeId) -> Optional[int]:
        """Logical-page KV sharding: the node's chain rotation base, or None
        when sharding is off (and on the root, which starts no chain).

        Concrete, not abstract: a core that does not track rotation bases
        stays constructible, and its None means "sharding is off" -- never
        "sharding is on but unknown", which the constructor gate rules out.
        """
        return None

    def rotation_phase_of(self, node_id: NodeId) -> Optional[int]:
        """Logical-page KV sharding: the rotation base plus the node's first
        position-page, i.e. the owner of its first page modulo the shard
        size; None when sharding is off. Concrete for the same reason as
        ``rotation_base_of``."""
        return None

    @abstractmethod
    def get_last_hash_value(self, node_id: NodeId) -> Optional[str]:
        """The node's last page hash, or None when it was never hashed."""
        ...

    @abstractmethod
    def get_prefix_hash_values(self, node_id: NodeId) -> list[str]:
        """The hash chain of the node's ancestors, in root-to-parent order."""
        ...

    @abstractmethod
    def get_hash_values(self, node_id: NodeId) -> list[str]:
        """The hash values owned by this node, excluding its ancestors."""
        ...

    @abstractmethod
    def snapshot_buffer_backup(
        self, node_id: NodeId, pass_prefix_keys: bool
    ) -> Optional[BufferBackupSnapshot]:
        """Snapshot an eligible buffer-only backup node."""
        ...

    @abstractmethod
    def validate_buffer_backup(
        self, node_id: NodeId, expected_key_length: int
    ) -> Optional[BufferBackupState]:
        """Validate a queued backup and return its current parent state."""
        ...

    @abstractmethod
    def backfill_missing_hash_values(self) -> int:
        """Hash every node built while storage was disabled; return how many.

        Called when a storage backend is attached at runtime: nodes already in
        the tree carry no hash, and hashing their descendants against them would
        restart the page hash chain mid-sequence.
        """
        ...

    @abstractmethod
    def root_node_handle(self, extra_key: Optional[str] = None) -> NodeId:
        """The NodeId anchoring matches for the namespace."""
        ...

    @abstractmethod
    def dfs_weight_order(self, node_ids: Sequence[NodeId]) -> list[int]:
        """Return input indices in depth-first, subtree-weight order."""
        ...

    @abstractmethod
    def collect_path_info(
        self, end_node_ids: Sequence[NodeId]
    ) -> tuple[tuple[TreePathNodeInfo, ...], ...]:
        """Copy root-to-node paths, excluding roots, in input order.

        Roots produce empty paths; missing handles raise KeyError. Callers must
        serialize with tree mutations; native backends hold one lock per batch.
        """
        ...

    @abstractmethod
    def inc_lock_ref(
        self, node_id: NodeId, skip_lock_components: Sequence[ComponentType] = ()
    ) -> IncLockRefResult:
        """Bump the reference count on a node's component locks. Components in
        ``skip_lock_components`` are left untaken; the receipt records the
        anchor node and the skipped set so the paired release mirrors them."""
        ...

    @abstractmethod
    def dec_lock_ref(
        self,
        node_id: NodeId,
        params: DecLockRefParams,
        skip_swa: bool = False,
    ) -> DecLockRefResult:
        """Decrease the reference count on a node's component locks. The
        receipt is required: a release must replay its acquire's evidence."""
        ...

    @abstractmethod
    def dec_swa_lock_only(
        self,
        node_id: NodeId,
        params: DecLockRefParams,
    ) -> DecSwaLockOnlyResult:
        """Decrease only the SWA (and lower-priority co-located) reference
        counts; the result carries the freed slots."""
        ...

    def dec_window_lock_only(
        self,
        node_id: NodeId,
        component_type: ComponentType,
        params: DecLockRefParams,
    ) -> DecSwaLockOnlyResult:
        """Release one window's receipt without releasing peer components."""
        raise NotImplementedError("This tree core does not support independent windows")

    # ==== Device eviction (driven step-wise by the Controller's evict()) ====

    @abstractmethod
    def evict_device_start(
        self, component_type: ComponentType, request_cnt: int
    ) -> None:
        """Begin a device-eviction walk for one component."""
        ...

    @abstractmethod
    def evict_device_next_node(
        self, component_type: ComponentType, tracker: dict[ComponentType, int]
    ) -> EvictDeviceNextNodeResult:
        """Advance one eviction step.

        A missing ``node_id`` is exhausted only when ``made_progress`` is also
        false. ``tracker`` is the caller's running totals, read for doneness.
        """
        ...

    @abstractmethod
    def evict_device_leaf(
        self, node_id: NodeId, is_write_back: bool
    ) -> EvictDeviceLeafResult:
        """Evict a leaf's device value; the result carries a BackupKV when a
        D->H backup must run (write_back) before the node can be demoted."""
        ...

    @abstractmethod
    def finish_mamba_state_eviction(self, node_id: NodeId) -> EvictDeviceNextNodeResult:
        """Resume the pending internal Mamba eviction after its backup attempt.

        The controller must finish any submitted D->H transfer before calling.
        A failed allocation still permits eviction to make device space.
        """
        ...

    @abstractmethod
    def finish_swa_state_eviction(self, node_id: NodeId) -> EvictDeviceNextNodeResult:
        """Resume the pending internal SWA eviction after its backup attempt.

        The controller must finish any submitted D->H transfer before calling.
        A failed allocation still permits eviction to make device space.
        """
        ...

    @abstractmethod
    def drop_subtree_no_host(self, node_id: NodeId) -> DropSubtreeNoHostResult:
        """Drop an unbacked D-leaf's subtree when its write-back backup failed
        under host pressure; declines (is_dropped=False) if any node is locked."""
        ...

    @abstractmethod
    def demote(self, node_id: NodeId) -> DemoteResult:
        """Demote a backed-up node: drop its device value after a successful backup."""
        ...

    @abstractmethod
    def evict_device_end(self, component_type: ComponentType) -> None:
        """Finish the component's device-eviction walk."""
        ...

    @abstractmethod
    def inc_host_lock_ref(self, node_id: NodeId) -> IncLockRefResult:
        """Bump the reference count on a node's host-side component locks."""
        ...

    @abstractmethod
    def dec_host_lock_ref(
        self, node_id: NodeId, params: DecLockRefParams
    ) -> DecLockRefResult:
        """Decrease the reference count on a node's host-side component locks."""
        ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def component_evictable_size(self, component_type: ComponentType) -> int:
        """Evictable token count for one component (0 if the component is absent)."""
        ...

    def component_protected_size(self, component_type: ComponentType) -> int:
        """Protected token count for one component (0 if absent)."""
        raise NotImplementedError("This tree core does not expose per-component sizes")

    @abstractmethod
    def adjust_component_size(
        self, node_id: NodeId, component_type: ComponentType, delta: int
    ) -> None:
        """Adjust protected/evictable tokens after the component backing changes.

        Roots and nodes without device values are no-ops. Missing handles raise
        KeyError; disabled components raise ValueError.
        Negative totals raise ValueError without updating the count. Rust also
        rejects fixed-width overflow; Python integers are unbounded.
        """
        ...

    @abstractmethod
    def full_evictable_size(self) -> int: ...

    @abstractmethod
    def full_protected_size(self) -> int: ...

    @abstractmethod
    def swa_evictable_size(self) -> int: ...

    @abstractmethod
    def mamba_evictable_size(self) -> int: ...

    @abstractmethod
    def swa_protected_size(self) -> int: ...

    @abstractmethod
    def mamba_protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> tuple[int, int]:
        """(full_tokens, aux_tokens) summed across the whole tree."""
        ...

    @abstractmethod
    def all_values_flatten(self) -> torch.Tensor: ...

    @abstractmethod
    def all_mamba_values_flatten(self) -> torch.Tensor: ...

    @abstractmethod
    def walk_for_kv_canary(
        self, unlocked_only: bool, swa_resident_only: bool
    ) -> RadixCacheWalkResult:
        """Flatten every FULL device slot into (slot, position, prev-slot) rows
        for the KV-canary sweep."""
        ...

    @abstractmethod
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Match a key; returns the device prefix length + boundary NodeIds."""
        ...

    @abstractmethod
    def match_full_device_prefix(self, key: RadixKey) -> tuple[int, NodeId, int]:
        """Return (matched tokens, deepest node, FULL tokens pinned by it)."""
        ...

    @abstractmethod
    def inc_full_pin(self, node_id: NodeId) -> None:
        """Pin only FULL device values on the node's root path."""
        ...

    @abstractmethod
    def dec_full_pin(self, node_id: NodeId) -> None:
        """Release a pin acquired by inc_full_pin."""
        ...

    def supports_fast_match_prefix(self) -> bool:
        """Whether matching every waiting request is cheap enough for scheduling."""
        return False

    @property
    @abstractmethod
    def empty_match_result(self) -> MatchResult:
        """A shared empty MatchResult (zero device prefix + boundary NodeIds)."""
        ...

    @abstractmethod
    def is_full_device_evicted(self, node_id: NodeId) -> bool:
        """Whether the node's FULL device value has been evicted."""
        ...

    @abstractmethod
    def collect_full_device_indices(
        self, from_node_id: NodeId, until_node_id: NodeId
    ) -> torch.Tensor:
        """Concatenate FULL device values from from_node up to (exclusive) until_node."""
        ...

    @abstractmethod
    def begin_insert(self, params: InsertParams) -> InsertStepResult:
        """Start the (single-flight) insert, running to its first barrier or completion."""
        ...

    @abstractmethod
    def resume_insert(self) -> InsertStepResult:
        """Continue the suspended insert after its step actions were executed."""
        ...

    @abstractmethod
    def has_ongoing_insert(self) -> bool:
        """Whether an insert walk is suspended at a barrier."""
        ...

    @abstractmethod
    def end_insert(self) -> list[CacheAction | ComponentAction]:
        """Finish the insert (idempotent); returns still-pending actions to drain."""
        ...

    @abstractmethod
    def drive_host_eviction(
        self, component_type: ComponentType, num_tokens: int
    ) -> DriveHostEvictionResult:
        """Evict a component's host-side resources; no-op if the component is absent."""
        ...

    @abstractmethod
    def evict_excess_path_states(
        self,
        tail_node_id: NodeId,
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        """Evict shallow Mamba device checkpoints beyond the per-path cap on the
        tail's root path, collecting freed values and actions into the caller's
        buffers. The caller frees values, then drains actions, even on error."""
        ...

    # ==== HiCache ====

    @abstractmethod
    def set_hicache_enabled(self) -> None:
        """Mark the host tier (HiCache) as wired."""
        ...

    @abstractmethod
    def set_host_memory_buffer_only(self) -> None:
        """Mark the host tier as buffer-only: one node staged per backup intent."""
        ...

    @abstractmethod
    def insert_host(
        self,
        node_id: NodeId,
        key: RadixKey,
        host_value: torch.Tensor,
        hash_value: list[str],
    ) -> InsertResult:
        """Insert a host-side (backuped) tree path descending from the given node."""
        ...

    @abstractmethod
    def build_backup_spec(
        self, node_id: NodeId
    ) -> tuple[torch.Tensor, dict[ComponentType, list[PoolTransfer]]]:
        """Read a node's device->host backup spec (device value + transfers) now."""
        ...

    def buffer_backup_pool_keys(
        self, node_id: NodeId, hash_values: list[str]
    ) -> dict[ComponentType, dict[PoolName, list[str]]]:
        """Per component, the storage keys per pool a buffer-mode backup of
        the node writes (``TreeComponent.buffer_backup_keys``); Rust cores name none."""
        return {}

    def build_backup_kv_action(self, node_id: NodeId) -> BackupKV:
        """The write-through backup action for a node and its unstored
        ancestors; only component-requested buffer backups need it."""
        raise NotImplementedError(
            f"{type(self).__name__} does not expose build_backup_kv_action"
        )

    @abstractmethod
    def build_storage_backup_spec(
        self, node_id: NodeId, pass_prefix_keys: bool
    ) -> Optional[StorageBackupSpec]:
        """Gather a node's device->storage backup spec; None if not backuped."""
        ...

    @abstractmethod
    def build_hicache_transfers(
        self,
        component_type: ComponentType,
        node_id: NodeId,
        phase: CacheTransferPhase,
        *,
        # TODO(Jialin): Remove the legacy `host_indices` argument from the
        # interface and bindings. Prefetch uses `staging_tokens`;
        # `PoolTransfer.host_indices` is populated after the storage hit.
        host_indices: Optional[torch.Tensor] = None,
        token_ids: Optional[Sequence[int]] = None,
        prefetch_tokens: int = 0,
        staging_tokens: int = 0,
        last_hash: Optional[str] = None,
    ) -> Optional[list[PoolTransfer]]:
        """Build a component's HiCache transfers for the given node and phase."""
        ...

    @abstractmethod
    def build_load_back_spec(
        self, node_id: NodeId, req: Optional[Req] = None
    ) -> tuple[PoolTransfer, dict[ComponentType, list[PoolTransfer]]]:
        """Build the H->D load-back KV transfer plus per-component aux transfers."""
        ...

    @abstractmethod
    def prefetch_anchor_info(
        self, node_id: NodeId
    ) -> tuple[Optional[str], Optional[str]]:
        """The anchor node's key extra_key and cache_salt."""
        ...

    @abstractmethod
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
        ...

    @abstractmethod
    def commit_backup(
        self,
        node_id: NodeId,
        host_indices: torch.Tensor,
        comp_xfers: dict[ComponentType, list[PoolTransfer]],
    ) -> None:
        """Commit a successful backup to the node."""
        ...

    @abstractmethod
    def commit_load_back(
        self,
        node_id: NodeId,
        device_indices: torch.Tensor,
        kv_xfer: PoolTransfer,
        comp_xfers: dict[ComponentType, list[PoolTransfer]],
    ) -> list[CacheAction | ComponentAction]:
        """Commit a successful H->D load-back onto the node; returns any cache actions."""
        ...

    @abstractmethod
    def finish_load_back(self, anchor_node_id: NodeId) -> None:
        """Clear the in-flight H->D marks on the anchor's root path at ack time."""
        ...

    # ==== External Cache Linker ====

    @abstractmethod
    def build_external_linker_offload_transfers(
        self, node_id: NodeId
    ) -> Optional[list[PoolTransfer]]:
        """Build direct device-to-external-store transfers for an eligible node.

        Return None when the node is stored externally or has an offload pending.
        """
        ...

    @abstractmethod
    def mark_external_cache_stored_path(
        self, from_node_id: NodeId, until_node_id: NodeId
    ) -> None:
        """Mark the path from ``from_node_id`` to, but excluding, ``until_node_id``."""
        ...

    @abstractmethod
    def mark_external_linker_offload_pending(self, node_id: NodeId) -> None:
        """Publish an accepted external offload as pending."""
        ...

    @abstractmethod
    def finish_external_linker_offload(
        self, node_ids: Sequence[NodeId], ack_id: NodeId, success: bool
    ) -> None:
        """Finish one external offload for every current fragment of its node.

        A successful write confirms external storage. A failed redundant write
        preserves storage already confirmed independently by a concurrent load.
        """
        ...

    # Order-sensitive digest of write_back duplicate-reclaim victim ids,
    # cross-checked across TP ranks; cores that never reclaim keep 0.
    write_back_duplicate_reclaim_digest: int = 0

    @abstractmethod
    def mark_write_through_pending(
        self, node_ids: list[NodeId], ack_id: NodeId
    ) -> list[NodeId]:
        """Mark every node covered by one in-flight write-through backup, and return
        them ancestors first: publish links each host store event to its parent."""
        ...

    @abstractmethod
    def finish_write_through(self, node_ids: list[NodeId], ack_id: int) -> None:
        """Clear the write-through-pending mark (when it matches ack_id) and record the
        host store event for each acked node."""
        ...

    @abstractmethod
    def swa_tombstone_ranges(
        self,
        key: RadixKey,
        start: int,
        end: int,
        component_type: ComponentType = ComponentType.SWA,
    ) -> list[tuple[int, int]]:
        """Return maximal missing SWA ranges within the matched [start, end) span."""
        ...

    @abstractmethod
    def attach_swa_window(
        self,
        key: RadixKey,
        window_start: int,
        window_end: int,
        swa_values: torch.Tensor,
        component_type: ComponentType = ComponentType.SWA,
    ) -> list[CacheAction | ComponentAction]:
        """Attach a loaded SWA window to tombstoned spans, returning split actions.

        The shared pipeline supplies page-aligned logical token offsets and
        int64 values on the core's device. The entire span must be matched and
        tombstoned before publication.
        """
        ...

    @abstractmethod
    def set_component_device_value(
        self, node_id: NodeId, component_type: ComponentType, value: torch.Tensor
    ) -> None:
        """Store an auxiliary (non-Full) component's device value onto a node."""
        ...

    @abstractmethod
    def get_component_device_value(
        self, node_id: NodeId, component_type: ComponentType
    ) -> Optional[torch.Tensor]:
        """The component's device value on the node, or None if evicted."""
        ...

    @abstractmethod
    def component_has_host_value_only(
        self, node_id: NodeId, component_type: ComponentType
    ) -> bool:
        """Whether the component's data is device-evicted but host-backed."""
        ...

    # ==== Others ====

    @abstractmethod
    def sanity_check(
        self,
        ongoing_write_through: list[tuple[int, NodeId]],
        ongoing_load_back: list[tuple[int, NodeId]],
    ) -> None:
        """Verify tree invariants and raise AssertionError on any violation.

        ongoing_write_through/ongoing_load_back are (id, node_id) pairs for in-flight ops.
        """
        ...

    @abstractmethod
    def pretty_print(self) -> None:
        """Print the tree structure for debugging."""
        ...
