from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    EvictParams,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.common import free_swa_out_of_window_slots
from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.unified_cache.cache_action import (
    FreeComponentDeviceSlot,
    FreeComponentHostSlot,
    FreeDeviceKVFullOnly,
    RebuildFullToSWAMapping,
    RecoverEvictedSWA,
    RecoverSWAWithLockedFull,
    SWARebuild,
)
from sglang.srt.mem_cache.unified_cache.components.base import (
    BASE_COMPONENT_TYPE,
    CacheTransferPhase,
    ComponentType,
    EvictLayer,
    ExternalLinkerLoadPhase,
    InternalStateBackup,
    LinkerTransferPhase,
    LRURefreshPhase,
    PreparePrefetchResult,
    TreeComponent,
    next_component_uuid,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.cache_action import (
        CacheAction,
        ComponentAction,
    )
    from sglang.srt.mem_cache.unified_radix_cache import (
        NodeId,
        UnifiedRadixCache,
        UnifiedTreeNode,
    )


class SWAComponent(TreeComponent):
    """Sliding window attention component.

    Each SWA node stores translated SWA pool indices as its component
    value, independent of the full attention indices on the same tree node.
    When SWA data is evicted from an internal node the node is tombstoned
    — its SWA component value becomes None while the full attention
    value stays intact.
    """

    def __init__(self, cache: UnifiedRadixCache, params: CacheInitParams):
        from sglang.srt.mem_cache.allocator.hisparse import (
            DeepSeekV4HiSparseTokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

        # DeepSeek V4 HiSparse forces --disable-radix-cache, where this component
        # only frees through free_swa_segment / free / free_group_*, which the
        # HiSparse allocator defines.
        assert isinstance(
            params.token_to_kv_pool_allocator,
            (SWATokenToKVPoolAllocator, DeepSeekV4HiSparseTokenToKVPoolAllocator),
        ), (
            f"SWAComponent requires an SWA allocator, got {type(params.token_to_kv_pool_allocator)}"
        )
        if params.sliding_window_size is None or params.sliding_window_size <= 0:
            raise ValueError("SWAComponent requires a positive sliding_window_size")

        super().__init__(cache, params)
        self._session_leaf_covered_len: dict[str, dict[UnifiedTreeNode, int]] = {}
        # This is the tree's required history, including widened draft reads;
        # it does not change the model's attention window.
        self.sliding_window_size = params.swa_retain_window
        self.gates_prefix_match = params.swa_gates_prefix_match
        self.full_window_pages = (
            self.sliding_window_size + params.page_size - 1
        ) // params.page_size
        # HiCache state: set to host SWA pool when HiCache enabled
        self._swa_kv_pool_host = None

    component_type = ComponentType.SWA
    pool_name = PoolName.SWA
    _independent = False

    def restore_buffer_mapping(self, full_indices, window_indices):
        self.cache._apply_cache_action(
            RebuildFullToSWAMapping([full_indices], [window_indices])
        )

    def _collect_unbacked_swa_nodes(
        self, node: UnifiedTreeNode
    ) -> list[UnifiedTreeNode]:
        """Nodes whose SWA data needs a host backup, deepest first.

        Buffer mode stages one node per FIFO backup intent; cache mode backs
        up every device-only node within one sliding window of ``node``.
        """
        if not self.tree_core.has_swa_host_pool:
            return []
        if self.tree_core.is_host_memory_buffer_only:
            cd = node.component_data[self.component_type]
            return [node] if cd.value is not None else []
        return self._collect_unbacked_swa_nodes_in_window(node)

    def _collect_unbacked_swa_nodes_in_window(
        self, node: UnifiedTreeNode
    ) -> list[UnifiedTreeNode]:
        ct = self.component_type
        covered = 0
        unbacked: list[UnifiedTreeNode] = []
        cur = node
        while (
            cur is not self.tree_core.root_node and covered < self.sliding_window_size
        ):
            if cur.write_through_pending_id is not None:
                break

            cd = cur.component_data[ct]
            value = cd.value if cd.value is not None else cd.host_value
            if value is None:
                break
            covered += len(value)
            if cd.value is not None and cd.host_value is None:
                unbacked.append(cur)
            cur = cur.parent
        return unbacked

    def needs_incremental_backup(self, node: UnifiedTreeNode) -> bool:
        return bool(self._collect_unbacked_swa_nodes(node))

    def reset_session_state(self) -> None:
        super().reset_session_state()
        self._session_leaf_covered_len = {}

    def _walk_session_coverage(
        self,
        leaf: UnifiedTreeNode,
        span: int,
        delta: int,
    ) -> int:
        node = leaf
        covered = 0
        while node is not self.tree_core.root_node and covered < span:
            cd = node.component_data[self.component_type]
            if delta < 0:
                assert cd.session_ref > 0
            prev_ref = cd.session_ref
            cd.session_ref += delta
            if (prev_ref == 0) != (cd.session_ref == 0):
                self._refresh_session_partition(node)
            covered += len(node.key)
            node = node.parent
        return covered

    def _inc_session_coverage(self, session_id: str, leaf: UnifiedTreeNode) -> None:
        covered_by_leaf = self._session_leaf_covered_len.setdefault(session_id, {})
        assert leaf not in covered_by_leaf
        target_span = self.sliding_window_size + self.tree_core.page_size
        covered = self._walk_session_coverage(leaf, target_span, 1)
        assert covered > 0
        covered_by_leaf[leaf] = covered

    def _dec_session_coverage(self, session_id: str, leaf: UnifiedTreeNode) -> None:
        covered_by_leaf = self._session_leaf_covered_len.get(session_id)
        assert covered_by_leaf is not None and leaf in covered_by_leaf
        covered_len = covered_by_leaf.pop(leaf)
        if not covered_by_leaf:
            self._session_leaf_covered_len.pop(session_id, None)
        actual = self._walk_session_coverage(leaf, covered_len, -1)
        assert actual == covered_len

    def _advance_session_coverage(
        self,
        session_id: str,
        leaf: UnifiedTreeNode,
        old_ancestor: Optional[UnifiedTreeNode],
    ) -> None:
        self._inc_session_coverage(session_id, leaf)
        if old_ancestor is not None:
            self._dec_session_coverage(session_id, old_ancestor)

    def _recede_session_coverage(
        self,
        session_id: str,
        leaf: UnifiedTreeNode,
        fallback: Optional[UnifiedTreeNode],
    ) -> None:
        self._dec_session_coverage(session_id, leaf)
        if fallback is not None:
            self._inc_session_coverage(session_id, fallback)

    def validate_session_state(
        self,
        reachable_nodes: set[UnifiedTreeNode],
        report_error: Callable[[str], None],
    ) -> None:
        super().validate_session_state(reachable_nodes, report_error)
        ct = self.component_type

        for session_id, covered_by_leaf in self._session_leaf_covered_len.items():
            for leaf, covered_len in covered_by_leaf.items():
                if leaf not in self._session_leaves.get(session_id, ()):
                    report_error(
                        f"{ct} session {session_id!r} coverage leaf {leaf.id} is not indexed"
                    )
                if covered_len <= 0:
                    report_error(
                        f"{ct} session {session_id!r} leaf {leaf.id} covered_len={covered_len}"
                    )

        for session_id, leaves in self._session_leaves.items():
            covered_by_leaf = self._session_leaf_covered_len.get(session_id, {})
            for leaf in leaves:
                if leaf not in covered_by_leaf:
                    report_error(
                        f"{ct} session {session_id!r} leaf {leaf.id} has no coverage record"
                    )

    def _translate_full_to_swa(self, full_indices: torch.Tensor) -> torch.Tensor:
        swa_indices = (
            self.cache.token_to_kv_pool_allocator.translate_swa_indices_for_transfer(
                full_indices
            )
        )
        # Tree component values use int64 indices; normalize transfer ids at the
        # tree boundary.
        return swa_indices.to(torch.int64)

    def _unified_allocator(self):
        """The unified SWA composite, or None when running on the static pool."""
        from sglang.srt.mem_cache.allocator.unified_hybrid_swa import (
            UnifiedSWAAllocatorBase,
        )

        allocator = self.cache.token_to_kv_pool_allocator
        if isinstance(allocator, UnifiedSWAAllocatorBase):
            return allocator
        return None

    def _page_pairs(
        self, full_value: torch.Tensor, incoming_full_value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids of two token ranges that address the SAME logical tokens.

        Dedupes by FIRST OCCURRENCE with one shared mask rather than
        `torch.unique`: unique sorts by id value, and allocation hands out
        virtual ids in no particular order, so sorting would pair page k of one
        range with an unrelated page of the other. One mask keeps the pairing
        positional, hence logical.
        """
        page_size = self.tree_core.page_size
        kept = full_value.detach().to(torch.int64) // page_size
        incoming = incoming_full_value.detach().to(torch.int64) // page_size
        assert kept.numel() == incoming.numel(), (
            f"locked-full recovery needs a 1:1 token correspondence, got "
            f"{kept.numel()} kept vs {incoming.numel()} incoming"
        )
        starts = torch.ones_like(kept, dtype=torch.bool)
        starts[1:] = kept[1:] != kept[:-1]
        incoming_starts = torch.ones_like(incoming, dtype=torch.bool)
        incoming_starts[1:] = incoming[1:] != incoming[:-1]
        assert torch.equal(starts, incoming_starts), (
            "the two ranges break into pages at different offsets, so no "
            "page-granular ownership transfer expresses the token mapping"
        )
        return kept[starts], incoming[starts]

    def _transfer_swa_pages(
        self,
        allocator,
        full_value: torch.Tensor,
        incoming_full_value: torch.Tensor,
    ) -> None:
        """Move swa page OWNERSHIP from the incoming ids onto the node's ids.

        The static recipe re-points the node's locked full ids at the incoming
        swa pages through `full_to_swa_index_mapping`. Under the unified pool
        the swa sub-pool's v2p IS that mapping, so the same move is a rebind:
        give the node's virtual pages the incoming pages' physical pages, then
        tombstone the incoming ones. No page is allocated or freed, so no
        capacity changes — only ownership does.
        """
        swa = allocator.swa_attn_allocator
        kept_pages, incoming_pages = self._page_pairs(full_value, incoming_full_value)
        physical = swa.virtual_to_physical[incoming_pages]
        # `> 0` strict: -1 = tombstoned, 0 = the padding sink. The incoming ids
        # were just allocated by the in-flight request, so every page must be
        # live; a violation means we would hand the node the sink and serve
        # zeros, which is worth a hard failure rather than silent corruption.
        assert bool((physical > 0).all()), (
            f"incoming swa pages must all be live, got {physical.tolist()}"
        )
        swa.bind(kept_pages, physical)
        swa.virtual_to_physical.index_fill_(0, incoming_pages, -1)
        swa.clear_inverse_history()

    def _set_swa(
        self, kept_full: torch.Tensor, incoming_full: torch.Tensor
    ) -> torch.Tensor:
        """Move incoming SWA mappings to kept Full IDs and return SWA indices."""
        unified = self._unified_allocator()
        if unified is not None:
            self._transfer_swa_pages(unified, kept_full, incoming_full)
            return self._translate_full_to_swa(kept_full)

        allocator = self.cache.token_to_kv_pool_allocator
        swa_value = self._translate_full_to_swa(incoming_full)
        allocator.clear_full_to_swa_mapping(incoming_full)
        allocator.set_full_to_swa_mapping(kept_full, swa_value)
        return swa_value

    def refresh_lru(
        self,
        phase: LRURefreshPhase,
        node: UnifiedTreeNode,
        root_node: UnifiedTreeNode,
    ) -> None:
        match phase:
            case LRURefreshPhase.WALKDOWN:
                # Walk-down would refresh every visited ancestor to MRU,
                # but most are outside the active sliding window and must
                # stay evictable. Window-bounded refresh runs at
                # MATCH_END / INSERT_END instead.
                return
            case LRURefreshPhase.MATCH_END | LRURefreshPhase.INSERT_END:
                self.tree_core.lru_lists[
                    self.component_type
                ].reset_node_and_window_ancestors_mru(
                    node,
                    root_node,
                    self.sliding_window_size + self.tree_core.page_size,
                    self.node_has_component_data,
                )
            case _:
                raise ValueError(f"Unknown LRURefreshPhase: {phase}")

    def create_match_validator(
        self, match_device_only: bool = False
    ) -> Callable[[UnifiedTreeNode], bool]:
        sliding_window_size = self.sliding_window_size
        ct = self.component_type
        state = {"len": float("inf")}
        gates_prefix_match = self.gates_prefix_match

        def validator(node: UnifiedTreeNode) -> bool:
            cd = node.component_data[ct]
            # HiCache: a host-only tombstone is a valid match boundary too
            # — load_back will restore SWA from host before use.
            if cd.value is None and (match_device_only or cd.host_value is None):
                state["len"] = 0
                if not gates_prefix_match and (node.backuped or not node.evicted):
                    return True
                return False
            state["len"] += len(node.key)
            return state["len"] >= sliding_window_size

        return validator

    def finalize_match_result_in_tree_core(
        self,
        result: MatchResult,
        params: MatchPrefixParams,
        value_chunks: list[torch.Tensor],
        best_value_len: int,
    ) -> MatchResult:
        ct = self.component_type
        swa_boundary_len = result.device_prefix_len + result.host_hit_length

        # Full KV may extend beyond the latest reusable SWA window. The branching
        # point is the last page-aligned position within the Full-KV hit that lies
        # beyond the current SWA boundary.
        aligned_seqlen = (
            result.full_kv_hit_length // self.tree_core.page_size
        ) * self.tree_core.page_size
        branching_seqlen = aligned_seqlen if aligned_seqlen > swa_boundary_len else None

        n_swa = 0
        swa_host_hit = 0
        node = result.best_match_node
        root = self.tree_core.root_node
        while node is not root and n_swa < self.sliding_window_size:
            cd = node.component_data[ct]
            if cd.value is not None:
                n_swa += len(cd.value)
            elif cd.host_value is not None:
                # TODO(hzh): load_back may currently restore a full host-tombstone
                # segment whose length exceeds sliding_window_size. Once
                # load_back is constrained to fetch only one sliding window
                # worth of pages, cap swa_host_hit at sliding_window_size
                # here so the scheduler budget matches the actual device-pool
                # consumption.
                swa_host_hit += len(cd.host_value)
                n_swa += len(cd.host_value)
            else:
                break
            node = node.parent

        return result._replace(
            swa_host_hit_length=max(result.swa_host_hit_length, swa_host_hit),
            swa_branching_seqlen=branching_seqlen,
        )

    @staticmethod
    def _segments(*, node, start, end):
        # Earlier components may have split the original insertion span.
        segments = []
        while end > start:
            node_start = end - len(node.key)
            assert node_start >= start
            segments.append((node, node_start, end))
            end, node = node_start, node.parent
        return reversed(segments)

    def _clip_to_window(self, *, node, start, end, window_start, cache_actions):
        if node.component_data[self.component_type].value is not None:
            return None
        assert window_start % self.tree_core.page_size == 0, (
            f"{self.component_type}: swa_evicted_seqlen must be page-aligned, {window_start=}"
        )
        live_start = max(start, window_start)
        if live_start >= end:
            return None
        if live_start > start:
            _, action = self.tree_core._split_node(node.key, node, live_start - start)
            if action is not None:
                cache_actions.append(action)
        return live_start

    def _publish_window(self, *, node, cache_actions):
        cache_actions.append(
            SWARebuild(node.id, node.component_data[BASE_COMPONENT_TYPE].value)
        )

    def _recover_from_incoming(
        self, *, node, incoming_full, start, end, result, cache_actions
    ):
        full_cd = node.component_data[BASE_COMPONENT_TYPE]
        old_full = full_cd.value
        # A locked SWA tombstone also has Full locked, so only an unlocked
        # Full value can be replaced by the incoming ids.
        if full_cd.lock_ref > 0:
            cache_actions.append(
                RecoverSWAWithLockedFull(node.id, old_full, incoming_full)
            )
            return
        result.record_adopted_range(BASE_COMPONENT_TYPE, start, end)
        full_cd.value = incoming_full.clone()
        cache_actions.append(FreeDeviceKVFullOnly([old_full]))
        self._publish_window(node=node, cache_actions=cache_actions)

    def update_component_on_insert_overlap(
        self,
        node: UnifiedTreeNode,
        prefix_len: int,
        total_prefix_len: int,
        value_slice: torch.Tensor,
        params: InsertParams,
        result: InsertResult,
        cache_actions: list[CacheAction | ComponentAction],
    ) -> int:
        if params.prev_prefix_len >= total_prefix_len + prefix_len:
            return prefix_len

        window_start = params.get_evicted_seqlen(self.component_type)
        if self._independent:
            window_start = max(window_start, params.prev_prefix_len)
        consumed_from = prefix_len
        for fragment, start, end in self._segments(
            node=node, start=total_prefix_len, end=total_prefix_len + prefix_len
        ):
            live_start = self._clip_to_window(
                node=fragment,
                start=start,
                end=end,
                window_start=window_start,
                cache_actions=cache_actions,
            )
            if live_start is None:
                continue
            result.record_adopted_range(self.component_type, live_start, end)
            self._recover_from_incoming(
                node=fragment,
                incoming_full=value_slice[
                    live_start - total_prefix_len : end - total_prefix_len
                ],
                start=live_start,
                end=end,
                result=result,
                cache_actions=cache_actions,
            )
            if not self._independent:
                consumed_from = min(consumed_from, live_start - total_prefix_len)
        return consumed_from

    def _populate_range(
        self, *, node, start, end, params, result, cap_leaf, cache_actions
    ):
        for fragment, start, end in self._segments(node=node, start=start, end=end):
            live_start = self._clip_to_window(
                node=fragment,
                start=start,
                end=end,
                window_start=params.get_evicted_seqlen(self.component_type),
                cache_actions=cache_actions,
            )
            if live_start is None:
                continue
            parent = (
                self._maybe_split_leaf_for_swa_lock(fragment, cache_actions)
                if cap_leaf
                else None
            )
            # Older fragments publish first so the tail remains more-MRU.
            if parent is not None:
                self._publish_window(node=parent, cache_actions=cache_actions)
            self._publish_window(node=fragment, cache_actions=cache_actions)
            result.record_adopted_range(self.component_type, live_start, end)

    def recover_after_unevict(
        self,
        node: UnifiedTreeNode,
        prefix_len: int,
        total_prefix_len: int,
        params: InsertParams,
        result: InsertResult,
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        # _unevict_node_on_insert already wrote the request's fresh KV slice
        # into the base value. We just need to rebuild SWA from that slice for
        # the in-window portion. There is no old SWA slot to free here.
        self._populate_range(
            node=node,
            start=total_prefix_len,
            end=total_prefix_len + prefix_len,
            params=params,
            result=result,
            cap_leaf=self._independent,
            cache_actions=cache_actions,
        )

    def commit_insert_component_data(
        self,
        node: UnifiedTreeNode,
        is_new_leaf: bool,
        params: InsertParams,
        result: InsertResult,
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        branching_seqlen = params.swa_branching_seqlen
        if branching_seqlen is not None:
            assert params.key is not None
            result.swa_branch_inserted = len(params.key) >= branching_seqlen

        if not is_new_leaf:
            return

        # Another window may have split this leaf; use the full aligned insert span.
        end = (
            len(params.key) // self.tree_core.page_size * self.tree_core.page_size
            if self._independent
            else result.prefix_len + len(node.key)
        )
        self._populate_range(
            node=node,
            start=result.prefix_len,
            end=end,
            params=params,
            result=result,
            cap_leaf=True,
            cache_actions=cache_actions,
        )

    def _maybe_split_leaf_for_swa_lock(
        self,
        leaf: UnifiedTreeNode,
        cache_actions: list[CacheAction | ComponentAction],
    ) -> Optional[UnifiedTreeNode]:
        """Cap a fresh in-window SWA leaf at one page-aligned window so locking it pins
        only one window of SWA pool, not the whole (long chunked-prefill) leaf; return
        the split-off parent (older window) or None. The SWA value is stamped later, so
        this runs on the tombstone leaf.
        """
        ct = self.component_type
        cd = leaf.component_data[ct]
        if leaf is self.tree_core.root_node or cd.lock_ref > 0:
            return None

        page_size = self.tree_core.page_size
        # Smallest page-aligned size that still covers the sliding window.
        tail_size = (self.sliding_window_size + page_size - 1) // page_size * page_size
        leaf_len = len(leaf.key)
        if leaf_len <= tail_size:
            return None
        split_at = leaf_len - tail_size
        if page_size > 1 and (split_at % page_size != 0 or leaf_len % page_size != 0):
            return None

        new_parent, action = self.tree_core._split_node(leaf.key, leaf, split_at)
        assert action is None or action.ack_id is None, (
            "fresh SWA leaf cannot be write-through-pending"
        )
        if action is not None:
            cache_actions.append(action)
        return new_parent

    def redistribute_on_node_split(
        self, new_parent: UnifiedTreeNode, child: UnifiedTreeNode
    ):
        new_parent.component_data[self.component_type].lock_ref = child.component_data[
            self.component_type
        ].lock_ref
        new_parent.component_data[
            self.component_type
        ].host_lock_ref = child.component_data[self.component_type].host_lock_ref
        new_parent.component_data[
            self.component_type
        ].session_ref = child.component_data[self.component_type].session_ref
        assert new_parent.component_data[self.component_type].session_ids is None

        child_swa_value = child.component_data[self.component_type].value
        if child_swa_value is not None:
            split_len = len(new_parent.key)
            new_parent.component_data[self.component_type].value = child_swa_value[
                :split_len
            ].clone()
            child.component_data[self.component_type].value = child_swa_value[
                split_len:
            ].clone()
        else:
            new_parent.component_data[self.component_type].value = None

        child_swa_host_value = child.component_data[self.component_type].host_value
        if child_swa_host_value is not None:
            split_len = len(new_parent.key)
            new_parent.component_data[
                self.component_type
            ].host_value = child_swa_host_value[:split_len].clone()
            child.component_data[self.component_type].host_value = child_swa_host_value[
                split_len:
            ].clone()
            parent_swa_data = new_parent.component_data[self.component_type]
            child_swa_data = child.component_data[self.component_type]
            parent_swa_data.host_lock_ref = child_swa_data.host_lock_ref

            host_lru = self.tree_core.host_lru_lists[self.component_type]
            # Host-locked halves stay out of the host LRU: in-flight IO
            # holds them, and host acquire removed the node at 0->1.
            if (
                new_parent.component_data[self.component_type].value is None
                and parent_swa_data.host_lock_ref == 0
            ):
                if host_lru.in_list(child):
                    host_lru.insert_after(child, new_parent)
                else:
                    host_lru.insert_mru(new_parent)
            if (
                child.component_data[self.component_type].value is None
                and child_swa_data.host_lock_ref == 0
                and not host_lru.in_list(child)
            ):
                host_lru.insert_mru(child)

        # The window-boundary uuids mark the node's older edge, which the
        # split moves to the parent — both tiers migrate with it.
        new_parent.component_data[self.component_type].metadata["uuid"] = (
            child.component_data[self.component_type].metadata.get("uuid")
        )
        child.component_data[self.component_type].metadata.pop("uuid", None)
        new_parent.component_data[self.component_type].metadata["host_uuid"] = (
            child.component_data[self.component_type].metadata.get("host_uuid")
        )
        child.component_data[self.component_type].metadata.pop("host_uuid", None)

    def evict_component(
        self,
        node: UnifiedTreeNode,
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
        target: EvictLayer = EvictLayer.DEVICE,
    ) -> tuple[int, int]:
        ct = self.component_type
        cd = node.component_data[ct]
        freed = 0
        host_freed = 0

        # Device layer
        if EvictLayer.DEVICE in target and cd.value is not None:
            # Pass full indices to free_swa so slots with no SWA pair are
            # skipped. Freeing swa_value directly would double free those
            # entries since they all map to the same sentinel slot.
            device_frees[self.component_type].append(
                node.component_data[BASE_COMPONENT_TYPE].value
            )
            freed = self.reclaimable_value_len(node)
            self.tree_core.component_evictable_size_[ct] -= freed
            cd.value = None

        # Host layer
        host_lru = self.tree_core.host_lru_lists[ct]
        if EvictLayer.HOST in target and cd.host_value is not None:
            host_freed = len(cd.host_value)
            host_frees[ct].append(cd.host_value)
            cd.host_value = None
            if host_lru.in_list(node):
                host_lru.remove_node(node)

        # After device tombstone: if host_value remains, move into host LRU
        if (
            target is EvictLayer.DEVICE
            and cd.value is None
            and cd.host_value is not None
        ):
            if not host_lru.in_list(node):
                host_lru.insert_mru(node)

        return freed, host_freed

    def eviction_priority(self, is_leaf: bool) -> int:
        return 0 if is_leaf else 1

    def _evict_device_start(self, request_cnt: int) -> None:
        """Begin the device-eviction walk from this component's LRU cursor."""
        self._evict_device_request_cnt = request_cnt
        if self.tree_core.enable_session_radix_cache:
            lru = self.tree_core.lru_lists[self.component_type]
            lru.cursor_begin()
            self._evict_device_cursor = lru.cursor_next()
        else:
            self._evict_device_cursor = self.tree_core.lru_lists[
                self.component_type
            ].get_lru_no_lock()

    def _evict_device_next_node(
        self,
        tracker: dict[ComponentType, int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> NodeId | InternalStateBackup | None:
        """Advance one device-eviction step and return a leaf, if selected.

        An internal tombstone is one complete step so the caller can apply its
        pending frees and recheck allocator capacity before the next mutation.
        If the previous node's eviction removed the cursor, the walk resumes
        from the partition sentinel with session refs on, else it restarts at
        the LRU tail.
        """
        ct = self.component_type
        lru = self.tree_core.lru_lists[ct]
        enabled = self.tree_core.enable_session_radix_cache
        if self._evict_device_cursor is not None and not lru.in_list(
            self._evict_device_cursor
        ):
            self._evict_device_cursor = (
                lru.cursor_next() if enabled else lru.get_lru_no_lock()
            )
        if (
            tracker[ct] >= self._evict_device_request_cnt
            or self._evict_device_cursor is None
            or not lru.in_list(self._evict_device_cursor)
        ):
            return None

        x = self._evict_device_cursor
        assert x.component_data[ct].value is not None
        if x in self.tree_core.evictable_device_leaves and (
            not enabled or self._can_evict_leaf_atomically(x)
        ):
            self._evict_device_cursor = (
                lru.cursor_next() if enabled else lru.get_prev_no_lock(x)
            )
            return x.id
        if not enabled:
            self._evict_device_cursor = lru.get_prev_no_lock(x)
        cd = x.component_data[ct]
        if (
            self.tree_core.enable_hicache
            and self.tree_core.is_write_back
            and self.tree_core.has_swa_host_pool
            and cd.host_value is None
            and not x.backuped
            and x.component_data[BASE_COMPONENT_TYPE].value is not None
        ):
            # Reserve the whole unbacked window, not just this victim, before
            # its best-effort host backup and resumed internal tombstone.
            needed = sum(
                len(node.component_data[ct].value)
                for node in self._collect_unbacked_swa_nodes(x)
            )
            if needed:
                if ct == ComponentType.SWA:
                    return InternalStateBackup(node_id=x.id, num_tokens=needed)
                # Custom SWA component types use Python's inherited inline
                # path; the shared finish hook is for built-in SWA only.
                if (
                    self._swa_kv_pool_host is not None
                    and self._swa_kv_pool_host.available_size() < needed
                ):
                    self.cache.evict_host(needed, ct)
                self.cache.backup_node_for_write_back(x.id)
        self.tree_core._evict_component_and_detach_lru(
            x,
            self,
            target=EvictLayer.DEVICE,
            tracker=tracker,
            device_frees=device_frees,
            host_frees=host_frees,
            cache_actions=cache_actions,
        )
        self.tree_core._cascade_evict(
            x,
            self,
            tracker,
            device_frees=device_frees,
            host_frees=host_frees,
            cache_actions=cache_actions,
        )
        if enabled:
            self._evict_device_cursor = lru.cursor_next()
        return None

    def _evict_device_end(self) -> None:
        """Clear the device-eviction walk cursor state."""
        if self.tree_core.enable_session_radix_cache:
            self.tree_core.lru_lists[self.component_type].cursor_end()
        self._evict_device_cursor = None

    def acquire_component_lock(
        self,
        node: UnifiedTreeNode,
        result: IncLockRefResult,
        lock_host: bool = False,
    ) -> IncLockRefResult:
        """Lock the contiguous segment covering the trailing window.

        Every node in [node, boundary] is counted, tombstones included, so
        the paired release decrements the same contiguous segment with no
        carried skip state. Coverage is position-based (len(cur.key)); the
        boundary node is always uuid-stamped, so a release without a uuid
        means the segment reached the root. Ledger/LRU transitions track
        only data-bearing nodes; a value materialized later under lock is
        credited to protected by set_component_device_value.
        """
        ct = self.component_type
        root = self.tree_core.root_node
        sliding_window_size = self.sliding_window_size
        covered = 0
        swa_uuid = None
        uuid_key = "host_uuid" if lock_host else "uuid"
        lru = (
            self.tree_core.host_lru_lists[ct]
            if lock_host
            else self.tree_core.lru_lists[ct]
        )

        cur = node
        while cur != root and covered < sliding_window_size:
            comp = cur.component_data[ct]
            value = comp.host_value if lock_host else comp.value
            ref = comp.host_lock_ref if lock_host else comp.lock_ref
            if ref == 0 and value is not None:
                if lock_host:
                    if lru.in_list(cur):
                        lru.remove_node(cur)
                else:
                    key_len = self.reclaimable_value_len(cur)
                    self.tree_core.component_evictable_size_[ct] -= key_len
                    self.tree_core.component_protected_size_[ct] += key_len
            if lock_host:
                comp.host_lock_ref = ref + 1
            else:
                comp.lock_ref = ref + 1
            covered += len(cur.key)
            if covered >= sliding_window_size:
                if comp.metadata.get(uuid_key) is None:
                    comp.metadata[uuid_key] = next_component_uuid(ct)
                swa_uuid = comp.metadata[uuid_key]
            cur = cur.parent

        result.set_lock_uuid(ct, swa_uuid, lock_host=lock_host)
        return result

    def release_component_lock(
        self,
        node: UnifiedTreeNode,
        params: DecLockRefParams,
        lock_host: bool = False,
    ) -> None:
        ct = self.component_type
        root = self.tree_core.root_node
        if node is root:
            return
        swa_uuid_for_lock = params.get_lock_uuid(ct, lock_host=lock_host)
        dec_swa = True
        uuid_key = "host_uuid" if lock_host else "uuid"

        cur = node
        while cur != root and dec_swa:
            comp = cur.component_data[ct]
            ref = comp.host_lock_ref if lock_host else comp.lock_ref
            # Acquire counted every segment node and splits copy refs, so a
            # zero here means the release does not mirror its acquire.
            assert ref > 0, (
                f"SWA segment release hit {'host_' if lock_host else ''}"
                f"lock_ref=0 on node {cur.id}"
            )
            value = comp.host_value if lock_host else comp.value
            if ref == 1 and value is not None:
                if lock_host:
                    if comp.value is None:
                        host_lru = self.tree_core.host_lru_lists[ct]
                        if not host_lru.in_list(cur):
                            host_lru.insert_mru(cur)
                else:
                    key_len = self.reclaimable_value_len(cur)
                    self.tree_core.component_evictable_size_[ct] += key_len
                    self.tree_core.component_protected_size_[ct] -= key_len
            if lock_host:
                comp.host_lock_ref = ref - 1
            else:
                comp.lock_ref = ref - 1
            if ref == 1:
                # This may have been the last lock holding the node out of
                # the evictable-leaf sets; refresh it here rather than rely
                # on the Full walk running after this one.
                self.tree_core._update_evictable_leaf_sets(cur)
            if swa_uuid_for_lock and comp.metadata.get(uuid_key) == swa_uuid_for_lock:
                dec_swa = False
            cur = cur.parent

    def release_window_lock(
        self,
        node: UnifiedTreeNode,
        swa_uuid_for_lock: Optional[int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        """Early-release the SWA lock along [node, swa_uuid_for_lock]; this
        method touches only SWA state. The wrapping ``dec_swa_lock_only`` also
        drops strictly-lower-priority co-located locks (e.g. Mamba) per the
        receipt; the Full lock stays so the request's prefix is protected.

        Called when a request's decode position has advanced past the sliding
        window. The caller must invoke this at most once per
        (node, swa_uuid_for_lock) pair.
        """
        ct = self.component_type
        root = self.tree_core.root_node

        cur = node
        while cur is not root:
            cd = cur.component_data[ct]
            assert cd.lock_ref > 0, (
                f"SWA window release hit lock_ref=0 on node {cur.id}"
            )
            cd.lock_ref -= 1
            if cd.lock_ref == 0:
                self.tree_core._update_evictable_leaf_sets(cur)
            if cd.lock_ref == 0 and cd.value is not None:
                value_len = self.reclaimable_value_len(cur)
                self.tree_core.component_protected_size_[ct] -= value_len
                self.tree_core.component_evictable_size_[ct] += value_len
                if self.tree_core._is_device_leaf(cur):
                    self.tree_core._evict_component_and_detach_lru(
                        cur,
                        self,
                        target=EvictLayer.DEVICE,
                        device_frees=device_frees,
                        host_frees=host_frees,
                        cache_actions=cache_actions,
                    )

            if swa_uuid_for_lock and cd.metadata.get("uuid") == swa_uuid_for_lock:
                break
            cur = cur.parent

    def prepare_for_caching_req(
        self,
        req: Req,
        insert_params: InsertParams,
        token_ids_len: int,
        is_finished: bool,
    ) -> Optional[int]:
        # Unfinished requests can already have an SWA-evicted prefix; preserve
        # that boundary so insertion creates a tombstone instead of live SWA KV.
        insert_params.set_evicted_seqlen(
            self.component_type, req.kv.get_evicted_seqlen(self.component_type)
        )

        # A recurrent checkpoint must stay attached to its exact token prefix.
        # Let MambaComponent select the insertion length for hybrid caches.
        if self.cache.is_mamba_enabled:
            return None

        branching_seqlen = req.swa_branching_seqlen
        if branching_seqlen is None or branching_seqlen <= req.kv.cache_protected_len:
            return None

        # An EAGLE key with N bigrams spans N + 1 raw tokens.
        effective_cache_len = branching_seqlen + int(self.tree_core.is_eagle)
        if effective_cache_len > token_ids_len:
            return None

        # Record the logical SWA branch boundary for insertion.
        insert_params.swa_branching_seqlen = branching_seqlen
        return effective_cache_len

    def _free_out_of_window_slots(self, req: Req, pre_len: int) -> None:
        if self.sliding_window_size is None:
            return
        free_swa_out_of_window_slots(
            req,
            pre_len,
            sliding_window_size=self.sliding_window_size,
            page_size=self.cache.page_size,
            req_to_token_pool=self.cache.req_to_token_pool,
            token_to_kv_pool_allocator=self.cache.token_to_kv_pool_allocator,
            retain_floor=self.cache.swa_retain_floor(req),
        )

    def free_out_of_window_slots(
        self, req: Req, pre_len: int, insert_params: InsertParams
    ) -> None:
        self._free_out_of_window_slots(req, pre_len)
        insert_params.set_evicted_seqlen(
            self.component_type, req.kv.get_evicted_seqlen(self.component_type)
        )

    def cleanup_after_caching_req(
        self,
        req: Req,
        is_finished: bool,
        insert_result: Optional[InsertResult] = None,
        insert_params: Optional[InsertParams] = None,
    ) -> None:
        if insert_result is not None and insert_result.swa_branch_inserted:
            req.swa_branching_seqlen = None

        # Free unused SWA slots after inserting the branch.
        if (
            not is_finished
            and insert_result is not None
            and insert_result.swa_branch_inserted
            and envs.SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS.get()
        ):
            forward_key_len = len(req.get_fill_ids()) - int(self.tree_core.is_eagle)
            self._free_out_of_window_slots(req, forward_key_len - 1)

    # ---- HiCache Hooks ----

    def prepare_prefetch(
        self,
        node_id: NodeId,
        *,
        prefetch_tokens: int = 0,
    ) -> PreparePrefetchResult:
        # unified_kv keeps SWA as a device-only ring -- nothing to prefetch into.
        if self._swa_kv_pool_host is None:
            return PreparePrefetchResult()
        sw_pages = self.full_window_pages
        if sw_pages == 0:
            return PreparePrefetchResult()
        prefetch_pages = prefetch_tokens // self.cache.page_size
        if prefetch_pages >= sw_pages:
            num_pages = sw_pages
        elif prefetch_pages > 0 and self.tree_core.is_root(node_id):
            # At root the sequence is shorter than the window, so its whole
            # SWA is the window -- complete, not a partial fetch.
            num_pages = prefetch_pages
        else:
            # Mid-tree short span: the window head would have to come from the
            # device prefix, which the match validator does not promise.
            return PreparePrefetchResult()
        return PreparePrefetchResult(staging_tokens=num_pages * self.cache.page_size)

    def alloc_prefetch_staging(self, num_tokens: int) -> Optional[torch.Tensor]:
        assert self._swa_kv_pool_host is not None
        host_indices = self._swa_kv_pool_host.alloc(num_tokens)
        if host_indices is None:
            self.cache.evict_host(num_tokens, self.component_type)
            host_indices = self._swa_kv_pool_host.alloc(num_tokens)
        return host_indices

    def buffer_backup_keys(
        self, node: UnifiedTreeNode, hash_values: list[str]
    ) -> dict[PoolName, list[str]]:
        # Buffer mode stages the node's own SWA rows, one key per page from
        # the chain's tail, so admission needs no transfer (and no device op).
        if not self.tree_core.is_host_memory_buffer_only:
            return {}
        cd = node.component_data[self.component_type]
        if not self.tree_core.has_swa_host_pool or cd.value is None:
            return {self.pool_name: []}
        rows = (
            node.component_data[BASE_COMPONENT_TYPE].value
            if self._unified_allocator() is not None
            else cd.value
        )
        num_pages = len(rows) // self._swa_kv_pool_host.page_size
        if num_pages == 0 or num_pages > len(hash_values):
            return {self.pool_name: []}
        return {self.pool_name: list(hash_values[-num_pages:])}

    def build_hicache_transfers(
        self,
        node: UnifiedTreeNode,
        phase: CacheTransferPhase,
        *,
        mamba_pool_idx: Optional[torch.Tensor] = None,
        host_indices: Optional[torch.Tensor] = None,
        token_ids: Optional[Sequence[int]] = None,
        prefetch_tokens: int = 0,
        staging_tokens: int = 0,
        last_hash: Optional[str] = None,
    ) -> Optional[list[PoolTransfer]]:
        ct = self.component_type

        # unified_kv keeps SWA as a device-only ring.
        if not self.tree_core.has_swa_host_pool and self.tree_core.enable_hicache:
            return None

        if phase == CacheTransferPhase.BACKUP_HOST:
            unbacked_swa_nodes = self._collect_unbacked_swa_nodes(node)
            if not unbacked_swa_nodes:
                return None
            unbacked_swa_nodes.reverse()
            return [
                PoolTransfer(
                    name=self.pool_name,
                    device_indices=(
                        self._translate_full_to_swa(
                            torch.cat(
                                [
                                    n.component_data[BASE_COMPONENT_TYPE].value
                                    for n in unbacked_swa_nodes
                                ]
                            )
                        )
                        if self._unified_allocator() is not None
                        else torch.cat(
                            [n.component_data[ct].value for n in unbacked_swa_nodes]
                        )
                    ).to(torch.int64),
                    nodes_to_load=[n.id for n in unbacked_swa_nodes],
                )
            ]

        if phase == CacheTransferPhase.LOAD_BACK:
            # `node` is best_match_node; the SWA validator guarantees every
            # ancestor within `sliding_window_size` has value or host_value.
            n_swa = 0
            backed_up: list[torch.Tensor] = []
            nodes: list = []
            cur = node
            while (
                cur is not self.tree_core.root_node and n_swa < self.sliding_window_size
            ):
                cd = cur.component_data[ct]
                assert cd.host_value is not None or cd.value is not None
                if cd.value is not None:
                    # device exists, skip it
                    n_swa += len(cd.value)
                else:
                    # host only, collect it
                    backed_up.append(cd.host_value)
                    nodes.append(cur)
                    n_swa += len(cd.host_value)
                cur = cur.parent

            if not backed_up:
                return None

            backed_up.reverse()
            nodes.reverse()

            return [
                PoolTransfer(
                    name=self.pool_name,
                    host_indices=torch.cat(backed_up),
                    device_indices=None,
                    nodes_to_load=[n.id for n in nodes],
                )
            ]

        if phase == CacheTransferPhase.BACKUP_STORAGE:
            cd = node.component_data[ct]
            if cd.host_value is None or not node.hash_value:
                return None
            num_pages = len(cd.host_value) // self.tree_core.page_size
            if num_pages == 0:
                return None
            return [
                PoolTransfer(
                    name=self.pool_name,
                    host_indices=cd.host_value[-num_pages * self.tree_core.page_size :],
                    keys=node.hash_value[-num_pages:],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                )
            ]

        if phase == CacheTransferPhase.PREFETCH:
            # Staging is allocated once the hit is known; the placeholders carry
            # the planned page count and _sync_trailing_keys fills the real hashes.
            num_pages = staging_tokens // self.tree_core.page_size
            if num_pages == 0:
                return None
            return [
                PoolTransfer(
                    name=self.pool_name,
                    keys=["__placeholder__"] * num_pages,
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                )
            ]

        return None

    def build_external_linker_transfer(
        self,
        phase: LinkerTransferPhase,
        node: Optional[UnifiedTreeNode],
        keys: Optional[Sequence[str]],
    ) -> Optional[PoolTransfer]:
        page = self.cache.page_size
        window_pages = (self.sliding_window_size + page - 1) // page

        if phase == LinkerTransferPhase.OFFLOAD:
            if node is None or not node.hash_value:
                return None
            value = node.component_data[self.component_type].value
            if value is None or len(value) < page:
                return None

            num_pages = len(value) // page
            return PoolTransfer(
                name=self.pool_name,
                device_indices=value[-num_pages * page :].to(torch.int64),
                keys=node.hash_value[-num_pages:],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )

        if not keys:
            return None

        # `keys` already start at the first device-uncached page, so the trailing
        # window is simply their tail.
        tail_keys = list(keys[max(0, len(keys) - window_pages) :])
        if not tail_keys:
            return None

        transfer = PoolTransfer(
            name=self.pool_name,
            keys=tail_keys,
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )
        if phase == LinkerTransferPhase.LOAD:
            num_tokens = len(tail_keys) * page
            allocator = self.cache.token_to_kv_pool_allocator.swa_attn_allocator
            shortfall = max(0, num_tokens - allocator.available_size())
            if shortfall:
                self.cache.evict(EvictParams(swa_num_tokens=shortfall))
            transfer.device_indices = allocator.alloc(num_tokens)
            if transfer.device_indices is None:
                return None
            transfer.device_indices = transfer.device_indices.to(torch.int64)
        return transfer

    def update_external_linker_load(
        self,
        phase: ExternalLinkerLoadPhase,
        req: Req,
        full_transfer: PoolTransfer,
        transfer: PoolTransfer,
        prefix_len: int,
    ) -> Optional[PoolTransfer]:
        if phase == ExternalLinkerLoadPhase.ABORT:
            self.cache.token_to_kv_pool_allocator.swa_attn_allocator.free(
                transfer.device_indices
            )
            return None

        allocator = self.cache.token_to_kv_pool_allocator
        if phase == ExternalLinkerLoadPhase.PREPARE:
            swa_len = len(transfer.device_indices)
            allocator.set_full_to_swa_mapping(
                full_transfer.device_indices[-swa_len:], transfer.device_indices
            )
            page = self.cache.page_size
            window = ((self.sliding_window_size + page - 1) // page) * page
            boundary = max(0, prefix_len - window)
            if req.kv is None:
                from sglang.srt.managers.schedule_batch import ReqKvInfo

                req.kv = ReqKvInfo(kv_allocated_len=prefix_len)
            req.kv.set_evicted_seqlen(
                self.component_type,
                max(req.kv.get_evicted_seqlen(self.component_type), boundary),
            )
        return transfer

    def commit_hicache_transfer(
        self,
        node: UnifiedTreeNode,
        phase: CacheTransferPhase,
        transfers: list[PoolTransfer] = (),
        *,
        cache_actions: list[CacheAction | ComponentAction],
        insert_result: Optional[InsertResult] = None,
        pool_storage_result: Optional[PoolTransferResult] = None,
    ) -> None:
        ct = self.component_type

        if phase == CacheTransferPhase.BACKUP_HOST:
            if not transfers or transfers[0].host_indices is None:
                return
            xfer = transfers[0]
            offset = 0
            for node_id in xfer.nodes_to_load or [node.id]:
                target = self.tree_core.node_by_id(node_id)
                cd = target.component_data[ct]
                assert cd.value is not None and cd.host_value is None
                size = len(cd.value)
                cd.host_value = xfer.host_indices[offset : offset + size].clone()
                offset += size
            assert offset == len(xfer.host_indices)
            return

        if phase == CacheTransferPhase.LOAD_BACK:
            assert transfers and transfers[0].device_indices is not None
            xfer = transfers[0]
            device_indices = xfer.device_indices

            full_chunks: list[torch.Tensor] = []
            swa_chunks: list[torch.Tensor] = []
            offset = 0
            for nid in xfer.nodes_to_load or []:
                n = self.tree_core.node_by_id(nid)
                cd_n = n.component_data[ct]
                cd_full_n = n.component_data[BASE_COMPONENT_TYPE]
                n_tokens = len(cd_n.host_value)
                swa_chunk = device_indices[offset : offset + n_tokens].clone()
                self.tree_core.set_component_device_value(
                    n.id, self.component_type, swa_chunk
                )
                assert cd_full_n.value is not None and len(cd_full_n.value) == n_tokens
                full_chunks.append(cd_full_n.value)
                swa_chunks.append(swa_chunk)
                offset += n_tokens
            assert offset == len(xfer.host_indices)
            # rebuild the mapping for the loaded SWA chunk, defer to orchestrator level
            if full_chunks:
                cache_actions.append(RebuildFullToSWAMapping(full_chunks, swa_chunks))
            return

        if phase == CacheTransferPhase.PREFETCH:
            self._commit_prefetch(
                node,
                transfers,
                cache_actions=cache_actions,
                insert_result=insert_result,
                pool_storage_result=pool_storage_result,
            )
            return

    def _release_swa_host(
        self,
        host_indices: torch.Tensor,
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        if host_indices is not None and host_indices.numel() > 0:
            cache_actions.append(
                FreeComponentHostSlot([host_indices], component_type=ComponentType.SWA)
            )

    def _attach_swa_host_value(
        self, node: UnifiedTreeNode, host_indices: torch.Tensor
    ) -> None:
        """Write host_indices into node's SWA host_value and refresh tree state."""
        ct = self.component_type
        cd = node.component_data[ct]
        cd.host_value = host_indices.clone()
        host_lru = self.tree_core.host_lru_lists[ct]
        if cd.value is None and not host_lru.in_list(node):
            host_lru.insert_mru(node)
        self.tree_core._update_evictable_leaf_sets(node)
        if node.parent:
            self.tree_core._update_evictable_leaf_sets(node.parent)

    def _commit_prefetch(
        self,
        anchor,
        transfers: list[PoolTransfer],
        *,
        cache_actions: list[CacheAction | ComponentAction],
        insert_result: Optional[InsertResult] = None,
        pool_storage_result: Optional[PoolTransferResult] = None,
    ) -> None:
        """Fill the prefetched SWA window onto the leaf→anchor path.

        All-or-nothing over one full window: ``loaded_pages`` is the cross-rank
        MIN, so ``loaded_pages < window_pages`` drops the whole window (keeps the
        tree identical across TP ranks). Otherwise map the buffer to token range
        ``[loaded_start, total_len)`` and walk leaf→anchor, filling SWA
        tombstones and releasing slices that already have host_value.
        """
        if not transfers:
            return
        ct = self.component_type
        page_size = self.tree_core.page_size
        host_indices = transfers[0].host_indices
        window_require_pages = (
            host_indices.numel() // page_size if host_indices is not None else 0
        )
        loaded_pages = (
            pool_storage_result.extra_pool_hit_pages.get(self.pool_name, 0)
            if pool_storage_result
            else 0
        )
        target = (
            self.tree_core.node_by_id(insert_result.inserted_host_node)
            if insert_result is not None
            and insert_result.inserted_host_node is not None
            else None
        )
        if anchor is not self.tree_core.root_node:
            # Cache-mode graft commit only (buffer fills never reach here):
            # a hit-shrunk window mid-tree is missing its head — drop it.
            # Root anchors are complete windows of their own.
            if window_require_pages < self.full_window_pages:
                self._release_swa_host(host_indices, cache_actions)
                return
        if (
            target is None
            or window_require_pages == 0
            or loaded_pages < window_require_pages
        ):
            self._release_swa_host(host_indices, cache_actions)
            return

        # Buffer covers token range [loaded_start, total_len).
        loaded_start = insert_result.total_len - window_require_pages * page_size

        # Walk leaf → anchor; ``pos`` is the right edge of ``cur`` in tokens.
        pos, cur = insert_result.total_len, target
        while cur is not anchor and pos > loaded_start:
            node_start = pos - len(cur.key)
            # Intersection of cur's range and the buffer.
            fill_start = max(node_start, loaded_start)
            fill_len = pos - fill_start
            buf_off = fill_start - loaded_start
            slice_ = host_indices[buf_off : buf_off + fill_len]

            cd = cur.component_data[ct]
            if cd.host_value is None and fill_len > 0:
                # Tombstone: split off the in-buffer tail if needed, then fill.
                if fill_start > node_start:
                    _, action = self.tree_core._split_node(
                        cur.key, cur, fill_start - node_start
                    )
                    if action is not None:
                        cache_actions.append(action)
                self._attach_swa_host_value(cur, slice_)
            else:
                # Already has SWA (or empty overlap): drop this slice.
                self._release_swa_host(slice_, cache_actions)

            pos = node_start
            cur = cur.parent

        # Buffer prefix that fell outside the anchor→leaf path.
        if pos > loaded_start:
            self._release_swa_host(host_indices[: pos - loaded_start], cache_actions)

    def drive_host_eviction(
        self,
        num_tokens: int,
        tracker: dict[ComponentType, int],
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        """Evict SWA host resources.
        Internal nodes: private tombstone (free SWA host only).
        Host leaves: atomic eviction via _evict_host_leaf."""
        ct = self.component_type
        host_lru = self.tree_core.host_lru_lists[ct]
        enabled = self.tree_core.enable_session_radix_cache
        if enabled:
            host_lru.cursor_begin()
            x = host_lru.cursor_next(host_lock=True)
        else:
            x = host_lru.get_lru_no_host_lock()
        while tracker[ct] < num_tokens and x is not None and host_lru.in_list(x):
            if not enabled:
                x_next = host_lru.get_prev_no_host_lock(x)
            cd = x.component_data[ct]
            if x in self.tree_core.evictable_host_leaves and (
                not enabled or self._can_evict_leaf_atomically(x)
            ):
                self.tree_core._evict_host_leaf(
                    x, tracker, device_frees, host_frees, cache_actions=cache_actions
                )
            else:
                assert cd.host_value is not None
                self.tree_core._evict_component_and_detach_lru(
                    x,
                    self,
                    target=EvictLayer.HOST,
                    tracker=tracker,
                    device_frees=device_frees,
                    host_frees=host_frees,
                    cache_actions=cache_actions,
                )
                self.tree_core._cascade_evict(
                    x,
                    self,
                    tracker,
                    device_frees=device_frees,
                    host_frees=host_frees,
                    target=EvictLayer.HOST,
                    cache_actions=cache_actions,
                )
            if enabled:
                x = host_lru.cursor_next(host_lock=True)
            else:
                x = x_next
        if enabled:
            host_lru.cursor_end()

    def free_host_values(self, host_values: list[torch.Tensor]) -> None:
        if self._swa_kv_pool_host is None:
            return
        for host_value in host_values:
            self.cache.host_pool_group.free(host_value, pool=self.pool_name)

    def apply_component_action(self, action: ComponentAction) -> None:
        alloc = self.cache.token_to_kv_pool_allocator
        if isinstance(action, FreeComponentDeviceSlot):
            for indices in action.indices:
                # Component values are page-aligned copies of a kv row.
                alloc.free_swa_segment(indices, start_pos=0)
            return
        if isinstance(action, FreeComponentHostSlot):
            for host_indices in action.host_indices:
                if host_indices is not None and host_indices.numel() > 0:
                    self.cache.cache_controller.append_host_mem_release(
                        extra_pools=[
                            PoolTransfer(name=self.pool_name, host_indices=host_indices)
                        ]
                    )
            return
        if isinstance(action, RebuildFullToSWAMapping):
            assert len(action.full_indices) == len(action.swa_indices)
            for full, swa in zip(action.full_indices, action.swa_indices):
                alloc.set_full_to_swa_mapping(full, swa)
            return
        if isinstance(action, RecoverEvictedSWA):
            self._set_swa(action.kept_full, action.incoming_full)
            return
        if isinstance(action, RecoverSWAWithLockedFull):
            # Keep the locked full; hand the node the INCOMING ids' swa pages,
            # freeing only the incoming full, then store the swa on the node.
            swa_value = self._set_swa(action.kept_full, action.incoming_full)
            unified = self._unified_allocator()
            if unified is not None:
                # The composite skips the detached SWA side and releases Full.
                unified.free(action.incoming_full)
            else:
                alloc.free_full_segment(action.incoming_full, start_pos=0)
            self.tree_core.set_component_device_value(
                action.node_id, self.component_type, swa_value
            )
            return
        if isinstance(action, SWARebuild):
            # Translate the node's source full value to SWA and store it on the node.
            swa_value = self._translate_full_to_swa(action.source_value)
            self.tree_core.set_component_device_value(
                action.node_id, self.component_type, swa_value
            )
            return
        raise AssertionError(
            f"SWAComponent: unhandled ComponentAction {type(action).__name__}"
        )
