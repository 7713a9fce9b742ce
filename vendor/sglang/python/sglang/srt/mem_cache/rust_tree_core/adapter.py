"""The Rust TreeCore adapter: satisfies ``UnifiedTreeCoreInterface`` over the
``mem_cache`` extension's ``RustUnifiedTreeCoreBinding``."""

from __future__ import annotations

import sys
from array import array
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StorageMedium,
    kv_event_namespace_seed,
    namespaced_block_hash,
)
from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    DecLockRefResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.events import KvEventLoraNames
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.rust_tree_core.extension import bindings
from sglang.srt.mem_cache.unified_cache.cache_action import (
    BackupKV,
    FreeComponentDeviceSlot,
    FreeComponentHostSlot,
    FreeDeviceKV,
    FreeDeviceKVFullOnly,
    MambaEvictExcessPathStates,
    RebuildFullToSWAMapping,
    RecoverSWAWithLockedFull,
    SWARebuild,
    UpdatePendingBackupOnNodeSplit,
)
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components import CacheTransferPhase
from sglang.srt.mem_cache.unified_cache.unified_tree_core import StorageBackupSpec
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
    get_eviction_strategy,
)
from sglang.srt.runtime_context import get_exec, mamba_cache_chunk_size
from sglang.srt.utils import assert_int64_array

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
    from sglang.srt.mem_cache.unified_cache.cache_action import (
        CacheAction,
        ComponentAction,
    )
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeNode


def _tlru_float_config(native_bindings, threshold, next_prompt_estimate):
    """Pass numeric values without changing Python's integer/float distinction."""
    if not all(
        isinstance(value, (int, float)) for value in (threshold, next_prompt_estimate)
    ):
        raise TypeError("T-LRU parameters must be integer or floating-point numbers")
    threshold = float(threshold)
    if isinstance(next_prompt_estimate, int):
        return native_bindings.TlruFloatConfig(
            threshold, 0.0, integer_estimate=next_prompt_estimate
        )
    return native_bindings.TlruFloatConfig(threshold, float(next_prompt_estimate))


def _radix_key_buffer(key: RadixKey) -> array:
    """The key's token ids honoring `limit`; view-independent since the
    binding derives its own atoms."""
    token_ids = key.raw_token_ids()
    assert_int64_array(token_ids, "tree key token ids")
    return token_ids


def _kv_event_from_tagged(
    event: tuple, lora_names: KvEventLoraNames, dynamo_format: bool = False
):
    """Build the Python KV cache event for one of the binding's tagged tuples.

    Rust hashes are LoRA-agnostic; the trailing extra_key selects the LoRA
    namespace, applied here as in KVCacheEventRecorder.
    """
    tag = event[0]
    if tag == "block_stored":
        lora_name = (
            lora_names.resolve(event[8]) if dynamo_format else lora_names.get(event[8])
        )
        seed = (
            kv_event_namespace_seed(extra_key=event[8], cache_salt=None)
            if not dynamo_format and lora_name is not None
            else None
        )
        parent = event[2]
        return BlockStored(
            block_hashes=[
                namespaced_block_hash(h, namespace_seed=seed) for h in event[1]
            ],
            parent_block_hash=(
                None
                if parent is None
                else namespaced_block_hash(parent, namespace_seed=seed)
            ),
            token_ids=event[3],
            block_size=event[4],
            lora_id=None,
            medium=StorageMedium(event[5]),
            cache_salt=event[6],
            session_id=event[7],
            lora_name=lora_name,
        )
    if tag == "block_removed":
        seed = (
            kv_event_namespace_seed(extra_key=event[3], cache_salt=None)
            if not dynamo_format and lora_names.get(event[3]) is not None
            else None
        )
        return BlockRemoved(
            block_hashes=[
                namespaced_block_hash(h, namespace_seed=seed) for h in event[1]
            ],
            medium=StorageMedium(event[2]),
        )
    if tag == "all_blocks_cleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown kv event tag: {tag}")


def _cache_action_from_tagged(action: tuple) -> CacheAction:
    """Build the Python CacheAction for one of the binding's tagged tuples."""
    tag = action[0]
    if tag == "free_device_kv":
        return FreeDeviceKV(indices=list(action[1]))
    if tag == "free_device_kv_full_only":
        return FreeDeviceKVFullOnly(indices=list(action[1]))
    if tag == "backup_kv":
        return BackupKV(node_ids=list(action[1]))
    if tag == "mamba_evict_excess_path_states":
        return MambaEvictExcessPathStates(tail_node_id=action[1])
    if tag == "update_pending_backup_on_node_split":
        return UpdatePendingBackupOnNodeSplit(
            ack_id=action[1],
            old_node_id=action[2],
            new_node_id=action[3],
            new_child_node_id=action[4],
        )
    if tag == "free_component_device_slot":
        return FreeComponentDeviceSlot(
            component_type=ComponentType(action[1]), indices=list(action[2])
        )
    if tag == "free_component_host_slot":
        return FreeComponentHostSlot(
            component_type=ComponentType(action[1]), host_indices=list(action[2])
        )
    if tag == "rebuild_full_to_swa_mapping":
        return RebuildFullToSWAMapping(
            full_indices=list(action[1]), swa_indices=list(action[2])
        )
    if tag == "recover_swa_with_locked_full":
        return RecoverSWAWithLockedFull(
            node_id=action[1], kept_full=action[2], incoming_full=action[3]
        )
    if tag == "swa_rebuild":
        return SWARebuild(node_id=action[1], source_value=action[2])
    raise ValueError(f"unknown cache action tag: {tag}")


def _cache_actions_from_tagged(actions: Sequence[tuple]) -> list[CacheAction]:
    """Build the Python CacheActions for the binding's tagged tuples, in order."""
    return [_cache_action_from_tagged(action) for action in actions]


def _inc_lock_ref_result_from_binding(result) -> IncLockRefResult:
    return IncLockRefResult(
        delta=result.delta,
        node_id=result.node_id,
        skipped_lock_components=tuple(
            ComponentType(ct) for ct in result.skipped_lock_components
        ),
        component_lock_uuids={
            ComponentType(ct): uuid for ct, uuid in result.component_lock_uuids.items()
        },
        component_host_lock_uuids={
            ComponentType(ct): uuid
            for ct, uuid in result.component_host_lock_uuids.items()
        },
    )


def _dec_lock_ref_params_to_binding(bindings_module, params: DecLockRefParams):
    """Use the owning module's type for both production and inspection bindings."""
    return bindings_module.DecLockRefParamsBinding(
        node_id=params.node_id,
        skipped_lock_components=[int(ct) for ct in params.skipped_lock_components],
        component_lock_uuids={
            int(ct): uuid for ct, uuid in params.component_lock_uuids.items()
        },
        component_host_lock_uuids={
            int(ct): uuid for ct, uuid in params.component_host_lock_uuids.items()
        },
    )


def _transfer_to_binding(transfer: PoolTransfer) -> tuple:
    """The binding's (name, host_indices, device_indices, nodes_to_load, keys,
    hit_policy) tuple."""
    return (
        transfer.name.value,
        transfer.host_indices,
        transfer.device_indices,
        transfer.nodes_to_load,
        transfer.keys,
        transfer.hit_policy.value,
    )


def _transfer_from_binding(transfer: tuple) -> PoolTransfer:
    """Build the Python PoolTransfer for one of the binding's transfer tuples."""
    name, host_indices, device_indices, nodes_to_load, keys, hit_policy = transfer
    return PoolTransfer(
        name=PoolName(name),
        host_indices=host_indices,
        device_indices=device_indices,
        keys=keys,
        hit_policy=PoolHitPolicy(hit_policy),
        nodes_to_load=nodes_to_load,
    )


def _comp_xfers_to_binding(
    comp_xfers: dict[ComponentType, list[PoolTransfer]],
) -> dict[int, list[tuple]]:
    """Rekey per-component transfers by the binding's component values."""
    return {
        int(ct): [_transfer_to_binding(x) for x in xfers]
        for ct, xfers in comp_xfers.items()
    }


def _comp_xfers_from_binding(
    comp_xfers: dict[int, list[tuple]],
) -> dict[ComponentType, list[PoolTransfer]]:
    """Rekey the binding's per-component transfer tuples by ComponentType."""
    return {
        ComponentType(ct): [_transfer_from_binding(x) for x in xfers]
        for ct, xfers in comp_xfers.items()
    }


def _tracker_to_binding(tracker: dict[ComponentType, int]) -> dict[int, int]:
    """Rekey a ComponentType tracker by the binding's component values."""
    return {int(component): freed for component, freed in tracker.items()}


class _RustKVCacheEventRecorder:
    """Expose the Rust event queue through the Python recorder interface."""

    def __init__(
        self,
        binding,
        enabled: bool,
        lora_names: KvEventLoraNames,
        dynamo_format: bool = False,
    ):
        self._binding = binding
        self.enabled = enabled
        self._lora_names = lora_names
        self._dynamo_format = dynamo_format

    def record_all_cleared(self) -> None:
        self._binding.record_all_cleared_event()

    def take(self) -> list:
        events = [
            _kv_event_from_tagged(event, self._lora_names, self._dynamo_format)
            for event in self._binding.take_events()
        ]
        return events


class RustUnifiedTreeCore(UnifiedTreeCoreInterface):
    """A TreeCore backed by the Rust extension binding."""

    _bindings = bindings
    supports_rotation_base = True

    def _cache_action_from_tagged(self, action: tuple) -> CacheAction | ComponentAction:
        return _cache_action_from_tagged(action)

    def _cache_actions_from_tagged(
        self, actions: Sequence[tuple]
    ) -> list[CacheAction | ComponentAction]:
        return [self._cache_action_from_tagged(action) for action in actions]

    def _insert_step_from_binding(self, step) -> InsertStepResult:
        """Build the interface step for the binding's step (result on the final one)."""
        result = None
        if step.result is not None:
            # A stepped insert delivers all actions through steps, never the result.
            assert not step.result.cache_actions
            result = InsertResult(
                prefix_len=step.result.prefix_len,
                last_device_node=step.result.last_device_node,
                mamba_exist=step.result.mamba_exist,
                swa_branch_inserted=step.result.swa_branch_inserted,
                host_insert_dropped=step.result.host_insert_dropped,
                rotation_tail_declined=step.result.rotation_tail_declined,
                adopted_ranges=(
                    {
                        ComponentType(component_type): list(ranges)
                        for component_type, ranges in step.result.adopted_ranges.items()
                    }
                    if step.result.adopted_ranges is not None
                    else None
                ),
            )
        return InsertStepResult(
            actions=self._cache_actions_from_tagged(step.actions), result=result
        )

    def _match_result_from_binding(self, result) -> MatchResult:
        """Build the Python MatchResult for the binding's match result."""
        return MatchResult(
            device_prefix_len=result.device_prefix_len,
            last_device_node=result.last_device_node_id,
            last_host_node=result.last_host_node_id,
            best_match_node=result.best_match_node_id,
            last_visited_node_id=result.last_visited_node_id,
            full_device_match_len=result.full_device_match_len,
            host_hit_length=result.host_hit_length,
            swa_host_hit_length=result.swa_host_hit_length,
            swa_branching_seqlen=result.swa_branching_seqlen,
            mamba_host_hit_length=result.mamba_host_hit_length,
            mamba_branching_seqlen=result.mamba_branching_seqlen,
            full_kv_hit_length=result.full_kv_hit_length,
            cache_actions=self._cache_actions_from_tagged(result.cache_actions),
        )

    def _fill_evict_result(self, binding_result, result):
        """Map a binding eviction step into an interface step result; both carry
        this step's deltas, frees, and actions."""
        for component, delta in binding_result.tracker.items():
            result.tracker[ComponentType(component)] = delta
        for component, tensors in binding_result.new_device_frees.items():
            result.device_frees[ComponentType(component)].extend(tensors)
        for component, tensors in binding_result.new_host_frees.items():
            result.host_frees[ComponentType(component)].extend(tensors)
        result.cache_actions.extend(
            self._cache_actions_from_tagged(binding_result.cache_actions)
        )
        return result

    def __init__(self, params: CacheInitParams):
        assert params.tree_components is not None
        self.tree_components = tuple(params.tree_components)

        # TODO(Jialin): Port session-reference-aware TreeCore support from #29173.
        if params.enable_session_radix_cache:
            raise ValueError(
                "--enable-session-radix-cache is not supported by the Rust TreeCore"
            )

        # TODO(Jialin): Port custom component registration from #25754 and
        # C128 support from #33676.
        unsupported_components = set(self.tree_components) - {
            ComponentType.FULL,
            ComponentType.SWA,
            ComponentType.MAMBA,
        }
        if unsupported_components:
            names = ", ".join(
                sorted(component.name for component in unsupported_components)
            )
            raise ValueError(f"Rust TreeCore does not support components: {names}")
        if params.component_registry_override:
            raise ValueError(
                "Rust TreeCore does not support component_registry_override"
            )
        # Validate the same constructor options as Python before passing the
        # configured eviction parameters to the native strategy.
        eviction_strategy = get_eviction_strategy(
            params.eviction_policy, params.eviction_policy_config
        )
        tlru_tail_budget = 0
        tlru_float_config = None
        if params.eviction_policy.lower() == "tlru":
            threshold = eviction_strategy.threshold
            next_prompt_estimate = eviction_strategy.next_prompt_estimate
            if isinstance(threshold, int) and isinstance(next_prompt_estimate, int):
                # Subtract before clamping to preserve arbitrary-size integers.
                tlru_tail_budget = min(
                    max(threshold - next_prompt_estimate, 0), 2 * sys.maxsize + 1
                )
            else:
                tlru_float_config = _tlru_float_config(
                    self._bindings, threshold, next_prompt_estimate
                )
        if ComponentType.SWA in self.tree_components and (
            params.sliding_window_size is None or params.sliding_window_size <= 0
        ):
            raise ValueError(
                "the SWA tree component requires a positive sliding_window_size"
            )

        self._page_size = params.page_size
        self._swa_backup_index_mapper: Optional[
            Callable[[torch.Tensor], torch.Tensor]
        ] = None
        allocator = params.token_to_kv_pool_allocator
        if allocator is not None and ComponentType.SWA in self.tree_components:
            from sglang.srt.mem_cache.allocator.unified_hybrid_swa import (
                UnifiedSWAAllocatorBase,
            )

            if isinstance(allocator, UnifiedSWAAllocatorBase):
                self._swa_backup_index_mapper = (
                    allocator.translate_swa_indices_for_transfer
                )
        self.is_eagle = (
            params.is_eagle and ComponentType.MAMBA not in self.tree_components
        )

        # The cache owns allocation; keep its allocator for resolving current
        # unified SWA addresses when building a host backup.
        self._allocator = params.token_to_kv_pool_allocator
        if params.token_to_kv_pool_allocator:
            device = torch.device(params.token_to_kv_pool_allocator.device)
            # A bare "cuda" means the process's current device, not cuda:0.
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self.device = device
        else:
            self.device = torch.device("cpu")

        self.enable_kv_cache_events = params.enable_kv_cache_events
        has_mamba = ComponentType.MAMBA in self.tree_components
        mamba_max_states_per_path = (
            get_exec().mamba.mamba_max_states_per_path if has_mamba else -1
        )

        self._binding = self._binding_class()(
            self._bindings.TreeCoreInitParamsBinding(
                eviction_policy=params.eviction_policy,
                slru_protected_threshold=getattr(
                    eviction_strategy, "protected_threshold", 2
                ),
                tlru_tail_budget=tlru_tail_budget,
                tlru_float_config=tlru_float_config,
                page_size=params.page_size,
                is_write_back=False,
                enable_hicache=False,
                write_through_threshold=256,
                device=str(self.device),
                # Rust's tree window has the same cache-history contract as
                # SWAComponent, including the fused draft's front rows.
                swa_sliding_window_size=params.swa_retain_window,
                swa_req_ring=not params.swa_gates_prefix_match,
                enable_kv_cache_events=params.enable_kv_cache_events,
                dynamo_kv_event_format=params.dynamo_kv_event_format,
                mamba_cache_chunk_size=(
                    mamba_cache_chunk_size() if has_mamba else None
                ),
                mamba_max_states_per_path=(
                    mamba_max_states_per_path
                    if mamba_max_states_per_path >= 0
                    else None
                ),
            ),
            [int(component) for component in self.tree_components],
        )
        self.kv_events = _RustKVCacheEventRecorder(
            self._binding,
            enabled=params.enable_kv_cache_events,
            lora_names=params.kv_event_lora_names,
            dynamo_format=params.dynamo_kv_event_format,
        )
        # The default-root empty result, prebuilt once from the binding.
        self._empty_match_result = self._match_result_from_binding(
            self._binding.empty_match_result()
        )

    def _binding_class(self) -> type:
        """The extension binding class this core constructs."""
        if self.is_eagle:
            return self._bindings.RustBigramUnifiedTreeCoreBinding
        return self._bindings.RustUnifiedTreeCoreBinding

    # ==== Tree API ====

    def reset(self) -> None:
        self._binding.reset()
        # Node handles are never re-minted, so the fresh root gets a new one.
        self._empty_match_result = self._match_result_from_binding(
            self._binding.empty_match_result()
        )

    def node_by_id(self, node_id: NodeId) -> UnifiedTreeNode:
        # TODO(Jialin): Move the remaining Python-node consumers to
        # backend-neutral APIs: sessions (#29173), C128 (#33676).
        raise NotImplementedError("node_by_id: not yet ported to the Rust tree core")

    @property
    def root_node(self) -> UnifiedTreeNode:
        raise NotImplementedError("root_node: not yet ported to the Rust tree core")

    def swa_tombstone_ranges(
        self,
        key: RadixKey,
        start: int,
        end: int,
        component_type: ComponentType = ComponentType.SWA,
    ) -> list[tuple[int, int]]:
        if component_type != ComponentType.SWA:
            raise NotImplementedError("The Rust tree core supports one SWA window")
        return self._binding.swa_tombstone_ranges(
            self._bindings.MatchParamsBinding(
                key=_radix_key_buffer(key),
                extra_key=key.extra_key,
                cache_salt=key.cache_salt,
            ),
            start,
            end,
        )

    def attach_swa_window(
        self,
        key: RadixKey,
        window_start: int,
        window_end: int,
        swa_values: torch.Tensor,
        component_type: ComponentType = ComponentType.SWA,
    ) -> list[CacheAction | ComponentAction]:
        if component_type != ComponentType.SWA:
            raise NotImplementedError("The Rust tree core supports one SWA window")
        return self._cache_actions_from_tagged(
            self._binding.attach_swa_window(
                self._bindings.MatchParamsBinding(
                    key=_radix_key_buffer(key),
                    extra_key=key.extra_key,
                    cache_salt=key.cache_salt,
                ),
                window_start,
                window_end,
                swa_values,
            )
        )

    def inc_lock_ref(
        self,
        node_id: NodeId,
        skip_lock_components: Sequence[ComponentType] = (),
    ) -> IncLockRefResult:
        result = self._binding.inc_lock_ref(
            node_id, [int(ct) for ct in skip_lock_components]
        )
        return _inc_lock_ref_result_from_binding(result)

    def dec_lock_ref(
        self,
        node_id: NodeId,
        params: DecLockRefParams,
        skip_swa: bool = False,
    ) -> DecLockRefResult:
        self._binding.dec_lock_ref(
            node_id, _dec_lock_ref_params_to_binding(self._bindings, params), skip_swa
        )
        return DecLockRefResult()

    def dec_window_lock_only(
        self,
        node_id: NodeId,
        component_type: ComponentType,
        params: DecLockRefParams,
    ) -> DecSwaLockOnlyResult:
        result = DecSwaLockOnlyResult()
        new_device_frees, new_host_frees, actions = self._binding.dec_window_lock_only(
            node_id,
            int(component_type),
            _dec_lock_ref_params_to_binding(self._bindings, params),
        )
        for component, tensors in new_device_frees.items():
            result.device_frees[ComponentType(component)].extend(tensors)
        for component, tensors in new_host_frees.items():
            result.host_frees[ComponentType(component)].extend(tensors)
        result.cache_actions.extend(self._cache_actions_from_tagged(actions))
        return result

    def dec_swa_lock_only(
        self,
        node_id: NodeId,
        params: DecLockRefParams,
    ) -> DecSwaLockOnlyResult:
        result = DecSwaLockOnlyResult()
        new_device_frees, new_host_frees, actions = self._binding.dec_swa_lock_only(
            node_id, _dec_lock_ref_params_to_binding(self._bindings, params)
        )
        for component, tensors in new_device_frees.items():
            result.device_frees[ComponentType(component)].extend(tensors)
        for component, tensors in new_host_frees.items():
            result.host_frees[ComponentType(component)].extend(tensors)
        result.cache_actions.extend(self._cache_actions_from_tagged(actions))
        return result

    # ==== Device eviction (driven step-wise by the Controller's evict()) ====

    def evict_device_start(
        self, component_type: ComponentType, request_cnt: int
    ) -> None:
        self._binding.evict_device_start(int(component_type), request_cnt)

    def evict_device_next_node(
        self, component_type: ComponentType, tracker: dict[ComponentType, int]
    ) -> EvictDeviceNextNodeResult:
        binding_result = self._binding.evict_device_next_node(
            int(component_type), _tracker_to_binding(tracker)
        )
        result = EvictDeviceNextNodeResult(
            node_id=binding_result.node_id,
            made_progress=binding_result.made_progress,
            unbacked_tokens=binding_result.unbacked_tokens,
            mamba_backup_node_id=binding_result.mamba_backup_node_id,
            swa_backup_node_id=binding_result.swa_backup_node_id,
            swa_backup_num_tokens=binding_result.swa_backup_num_tokens,
        )
        return self._fill_evict_result(binding_result, result)

    def finish_mamba_state_eviction(self, node_id: NodeId) -> EvictDeviceNextNodeResult:
        binding_result = self._binding.finish_mamba_state_eviction(node_id)
        result = EvictDeviceNextNodeResult(
            node_id=binding_result.node_id,
            made_progress=binding_result.made_progress,
            unbacked_tokens=binding_result.unbacked_tokens,
        )
        return self._fill_evict_result(binding_result, result)

    def finish_swa_state_eviction(self, node_id: NodeId) -> EvictDeviceNextNodeResult:
        binding_result = self._binding.finish_swa_state_eviction(node_id)
        result = EvictDeviceNextNodeResult(
            node_id=binding_result.node_id,
            made_progress=binding_result.made_progress,
            unbacked_tokens=binding_result.unbacked_tokens,
        )
        return self._fill_evict_result(binding_result, result)

    def evict_device_leaf(
        self, node_id: NodeId, is_write_back: bool
    ) -> EvictDeviceLeafResult:
        # The binding reads is_write_back from the core's current config.
        assert is_write_back == self.is_write_back, (
            "is_write_back must match the core's current config"
        )
        binding_result = self._binding.evict_device_leaf(node_id)
        backup = binding_result.backup_kv
        result = EvictDeviceLeafResult(
            unbacked_tokens=binding_result.unbacked_tokens,
            backup_kv=self._cache_action_from_tagged(backup)
            if backup is not None
            else None,
        )
        return self._fill_evict_result(binding_result, result)

    def demote(self, node_id: NodeId) -> DemoteResult:
        binding_result = self._binding.demote(node_id)
        return self._fill_evict_result(binding_result, DemoteResult())

    def evict_device_end(self, component_type: ComponentType) -> None:
        self._binding.evict_device_end(int(component_type))

    def inc_host_lock_ref(self, node_id: NodeId) -> IncLockRefResult:
        result = self._binding.inc_host_lock_ref(node_id)
        return _inc_lock_ref_result_from_binding(result)

    def dec_host_lock_ref(
        self, node_id: NodeId, params: DecLockRefParams
    ) -> DecLockRefResult:
        self._binding.dec_host_lock_ref(
            node_id, _dec_lock_ref_params_to_binding(self._bindings, params)
        )
        return DecLockRefResult()

    def evictable_size(self) -> int:
        return self._binding.evictable_size()

    def protected_size(self) -> int:
        return self._binding.protected_size()

    def component_evictable_size(self, component_type: ComponentType) -> int:
        return self._binding.component_evictable_size(int(component_type))

    def component_protected_size(self, component_type: ComponentType) -> int:
        return self._binding.component_protected_size(int(component_type))

    def full_evictable_size(self) -> int:
        return self._binding.full_evictable_size()

    def full_protected_size(self) -> int:
        return self._binding.full_protected_size()

    def swa_evictable_size(self) -> int:
        return self._binding.component_evictable_size(int(ComponentType.SWA))

    def mamba_evictable_size(self) -> int:
        return self._binding.component_evictable_size(int(ComponentType.MAMBA))

    def swa_protected_size(self) -> int:
        return self._binding.component_protected_size(int(ComponentType.SWA))

    def mamba_protected_size(self) -> int:
        return self._binding.component_protected_size(int(ComponentType.MAMBA))

    def total_size(self) -> tuple[int, int]:
        return self._binding.total_size()

    def all_values_flatten(self) -> torch.Tensor:
        return self._binding.all_values_flatten()

    def walk_for_kv_canary(
        self, unlocked_only: bool, swa_resident_only: bool
    ) -> RadixCacheWalkResult:
        result = self._binding.walk_for_kv_canary(unlocked_only, swa_resident_only)
        return RadixCacheWalkResult(
            slot_indices=result.slot_indices,
            positions=result.positions,
            prev_slot_indices=result.prev_slot_indices,
        )

    def _record_all_cleared_event(self) -> None:
        self.kv_events.record_all_cleared()

    def take_events(self) -> list:
        return self.kv_events.take()

    def all_mamba_values_flatten(self) -> torch.Tensor:
        return self._binding.all_mamba_values_flatten()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        result = self._binding.match_prefix(
            self._bindings.MatchParamsBinding(
                key=_radix_key_buffer(key),
                extra_key=key.extra_key,
                cache_salt=key.cache_salt,
            )
        )
        return self._match_result_from_binding(result)

    def match_full_device_prefix(self, key: RadixKey) -> tuple[int, NodeId, int]:
        return self._binding.match_full_device_prefix(
            self._bindings.MatchParamsBinding(
                key=_radix_key_buffer(key),
                extra_key=key.extra_key,
                cache_salt=key.cache_salt,
            )
        )

    def inc_full_pin(self, node_id: NodeId) -> None:
        self._binding.inc_full_pin(node_id)

    def dec_full_pin(self, node_id: NodeId) -> None:
        self._binding.dec_full_pin(node_id)

    @property
    def empty_match_result(self) -> MatchResult:
        return self._empty_match_result

    def is_full_device_evicted(self, node_id: NodeId) -> bool:
        return self._binding.is_full_device_evicted(node_id)

    def collect_full_device_indices(
        self, from_node_id: NodeId, until_node_id: NodeId
    ) -> torch.Tensor:
        return self._binding.collect_full_device_indices(from_node_id, until_node_id)

    def begin_insert(self, params: InsertParams) -> InsertStepResult:
        key = params.key
        key_buffer = _radix_key_buffer(key)
        value = params.value
        if value is None:
            # The binding always receives a value tensor; fall back to the
            # token ids materialized on the core's device.
            value = torch.tensor(key_buffer, dtype=torch.int64, device=self.device)
        step = self._binding.begin_insert(
            self._bindings.InsertParamsBinding(
                key=key_buffer,
                value=value,
                extra_key=key.extra_key,
                cache_salt=key.cache_salt,
                session_id=params.session_id,
                mamba_value=params.mamba_value,
                prev_prefix_len=params.prev_prefix_len,
                swa_evicted_seqlen=params.get_evicted_seqlen(ComponentType.SWA),
                swa_branching_seqlen=params.swa_branching_seqlen,
                inserted_len=params.inserted_len,
                priority=0 if params.priority is None else params.priority,
                track_adopted_ranges=params.track_adopted_ranges,
                rotation_base=params.rotation_base,
            )
        )
        return self._insert_step_from_binding(step)

    def resume_insert(self) -> InsertStepResult:
        return self._insert_step_from_binding(self._binding.resume_insert())

    def has_ongoing_insert(self) -> bool:
        return self._binding.has_ongoing_insert()

    def end_insert(self) -> list[CacheAction | ComponentAction]:
        return self._cache_actions_from_tagged(self._binding.end_insert())

    def drive_host_eviction(
        self, component_type: ComponentType, num_tokens: int
    ) -> DriveHostEvictionResult:
        binding_result = self._binding.drive_host_eviction(
            int(component_type),
            num_tokens,
            envs.SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM.get(),
        )
        return self._fill_evict_result(binding_result, DriveHostEvictionResult())

    def evict_excess_path_states(
        self,
        tail_node_id: NodeId,
        device_frees: dict[ComponentType, list[torch.Tensor]],
        host_frees: dict[ComponentType, list[torch.Tensor]],
        cache_actions: list[CacheAction | ComponentAction],
    ) -> None:
        binding_result = self._binding.evict_excess_path_states(tail_node_id)
        for component, tensors in binding_result.new_device_frees.items():
            device_frees[ComponentType(component)].extend(tensors)
        for component, tensors in binding_result.new_host_frees.items():
            host_frees[ComponentType(component)].extend(tensors)
        cache_actions.extend(
            self._cache_actions_from_tagged(binding_result.cache_actions)
        )

    # ==== HiCache ====

    def set_hicache_enabled(self) -> None:
        self._binding.set_hicache_enabled()

    def set_host_memory_buffer_only(self) -> None:
        self._binding.set_host_memory_buffer_only()

    @property
    def is_host_memory_buffer_only(self) -> bool:
        return self._binding.is_host_memory_buffer_only()

    @property
    def page_size(self) -> int:
        # Read-only: the Rust core freezes it at construction.
        return self._page_size

    @property
    def enable_hicache(self) -> bool:
        return self._binding.enable_hicache()

    @property
    def has_swa_host_pool(self) -> bool:
        return self._binding.has_swa_host_pool()

    @has_swa_host_pool.setter
    def has_swa_host_pool(self, value: bool) -> None:
        # The Rust core has no unset path; reject a True -> False transition.
        assert value or not self.has_swa_host_pool
        if value:
            self._binding.set_has_swa_host_pool()

    @property
    def write_through_threshold(self) -> int:
        return self._binding.write_through_threshold()

    @write_through_threshold.setter
    def write_through_threshold(self, value: int) -> None:
        # The cache assigns tree_core.write_through_threshold at HiCache init.
        self._binding.set_write_through_threshold(value)

    @property
    def is_write_back(self) -> bool:
        return self._binding.is_write_back()

    @is_write_back.setter
    def is_write_back(self, value: bool) -> None:
        # The cache assigns tree_core.is_write_back at HiCache init; forward it.
        self._binding.set_is_write_back(value)

    @property
    def enable_storage(self) -> bool:
        return self._binding.enable_storage()

    @enable_storage.setter
    def enable_storage(self, value: bool) -> None:
        # The cache assigns tree_core.enable_storage at storage init; forward it.
        self._binding.set_enable_storage(value)

    @property
    def enable_external_cache_linker(self) -> bool:
        return self._binding.enable_external_cache_linker()

    @enable_external_cache_linker.setter
    def enable_external_cache_linker(self, value: bool) -> None:
        self._binding.set_enable_external_cache_linker(value)

    def insert_host(
        self,
        node_id: NodeId,
        key: RadixKey,
        host_value: torch.Tensor,
        hash_value: list[str],
    ) -> InsertResult:
        result = self._binding.insert_host(
            node_id,
            key.extra_key,
            _radix_key_buffer(key),
            host_value,
            list(hash_value),
            key.cache_salt,
        )
        return InsertResult(
            prefix_len=result.prefix_len,
            total_len=result.total_len,
            last_device_node=result.last_device_node,
            inserted_host_node=result.inserted_host_node,
            host_insert_dropped=result.host_insert_dropped,
            mamba_exist=result.mamba_exist,
            cache_actions=self._cache_actions_from_tagged(result.cache_actions),
        )

    def build_backup_kv_action(self, node_id: NodeId) -> BackupKV:
        action = self._cache_action_from_tagged(
            self._binding.build_backup_kv_action(node_id)
        )
        assert isinstance(action, BackupKV)
        return action

    def build_backup_spec(
        self, node_id: NodeId
    ) -> tuple[torch.Tensor, dict[ComponentType, list[PoolTransfer]]]:
        device_value, comp_xfers = self._binding.build_backup_spec(node_id)
        comp_xfers = _comp_xfers_from_binding(comp_xfers)
        self._refresh_swa_backup_indices(comp_xfers.get(ComponentType.SWA, ()))
        return device_value, comp_xfers

    def _refresh_swa_backup_indices(self, transfers: Sequence[PoolTransfer]) -> None:
        if not transfers:
            return
        if self._swa_backup_index_mapper is None:
            return
        for transfer in transfers:
            if transfer.name != PoolName.SWA or not transfer.nodes_to_load:
                continue
            # Compaction can relocate SWA rows after the tree records them.
            # FULL virtual IDs retain their meaning across that relocation.
            full_values = [
                self.get_component_device_value(node_id, ComponentType.FULL)
                for node_id in transfer.nodes_to_load
            ]
            transfer.device_indices = self._swa_backup_index_mapper(
                torch.cat(full_values)
            ).to(torch.int64)

    def build_storage_backup_spec(
        self, node_id: NodeId, pass_prefix_keys: bool
    ) -> Optional[StorageBackupSpec]:
        spec = self._binding.build_storage_backup_spec(node_id, pass_prefix_keys)
        if spec is None:
            return None
        # Token ids cross the boundary as raw int64 bytes, not per-token ints.
        token_ids = array("q")
        token_ids.frombytes(spec.token_ids)
        return StorageBackupSpec(
            host_value=spec.host_value,
            token_ids=token_ids,
            hash_value=spec.hash_value,
            prefix_keys=spec.prefix_keys,
            comp_xfers=_comp_xfers_from_binding(spec.comp_xfers),
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
        transfers = self._binding.build_hicache_transfers(
            int(component_type),
            node_id,
            phase.value,
            host_indices,
            # TODO: Forward token ids when Rust Mamba prefetch consumes them.
            None,
            prefetch_tokens,
            staging_tokens,
            last_hash,
        )
        if transfers is None:
            return None
        transfers = [_transfer_from_binding(transfer) for transfer in transfers]
        if phase == CacheTransferPhase.BACKUP_HOST:
            self._refresh_swa_backup_indices(transfers)
        return transfers

    def build_load_back_spec(
        self, node_id: NodeId, req: Optional[Req] = None
    ) -> tuple[PoolTransfer, dict[ComponentType, list[PoolTransfer]]]:
        # Component hooks take primitives, not Req: extract its fields here.
        mamba_pool_idx = req.kv.mamba_pool_idx if req is not None else None
        kv_xfer, comp_xfers = self._binding.build_load_back_spec(
            node_id, mamba_pool_idx
        )
        kv_xfer = _transfer_from_binding(kv_xfer)
        comp_xfers = _comp_xfers_from_binding(comp_xfers)
        return kv_xfer, comp_xfers

    def prefetch_anchor_info(
        self, node_id: NodeId
    ) -> tuple[Optional[str], Optional[str]]:
        return self._binding.prefetch_anchor_info(node_id)

    def is_write_through_compatible(self) -> bool:
        return self._binding.is_write_through_compatible()

    def is_backuped(self, node_id: NodeId) -> bool:
        return self._binding.node_backuped(node_id)

    def is_root(self, node_id: NodeId) -> bool:
        return self._binding.is_root(node_id)

    def get_last_hash_value(self, node_id: NodeId) -> Optional[str]:
        return self._binding.get_last_hash_value(node_id)

    def get_prefix_hash_values(self, node_id: NodeId) -> list[str]:
        return self._binding.get_prefix_hash_values(node_id)

    def get_hash_values(self, node_id: NodeId) -> list[str]:
        return self._binding.get_hash_values(node_id)

    def snapshot_buffer_backup(
        self, node_id: NodeId, pass_prefix_keys: bool
    ) -> Optional[BufferBackupSnapshot]:
        snapshot = self._binding.snapshot_buffer_backup(node_id, pass_prefix_keys)
        if snapshot is None:
            return None
        token_ids = array("q")
        token_ids.frombytes(snapshot.key_token_ids)
        return BufferBackupSnapshot(
            node_id=snapshot.node_id,
            parent_node_id=snapshot.parent_node_id,
            parent_is_root=snapshot.parent_is_root,
            parent_last_hash=snapshot.parent_last_hash,
            hash_values=snapshot.hash_values,
            key=RadixKey(
                token_ids,
                extra_key=snapshot.extra_key,
                is_bigram=snapshot.is_bigram,
                cache_salt=snapshot.cache_salt,
            ),
            prefix_keys=snapshot.prefix_keys,
        )

    def validate_buffer_backup(
        self, node_id: NodeId, expected_key_length: int
    ) -> Optional[BufferBackupState]:
        state = self._binding.validate_buffer_backup(node_id, expected_key_length)
        if state is None:
            return None
        return BufferBackupState(
            parent_node_id=state.parent_node_id,
            parent_is_root=state.parent_is_root,
            parent_last_hash=state.parent_last_hash,
        )

    def backfill_missing_hash_values(self) -> int:
        return self._binding.backfill_missing_hash_values()

    def root_node_handle(self, extra_key: Optional[str] = None) -> NodeId:
        return self._binding.root_node_handle(extra_key)

    def rotation_base_of(self, node_id: NodeId) -> Optional[int]:
        return self._binding.rotation_base_of(node_id)

    def dfs_weight_order(self, node_ids: Sequence[NodeId]) -> list[int]:
        return self._binding.dfs_weight_order(list(node_ids))

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
        actions, mamba_exist = self._binding.commit_hicache_transfers(
            node_id,
            phase.value,
            _comp_xfers_to_binding(comp_xfers),
            (
                None
                if insert_result is None
                else (
                    insert_result.total_len,
                    insert_result.inserted_host_node,
                    insert_result.mamba_exist,
                )
            ),
            (
                None
                if pool_storage_result is None
                else (
                    pool_storage_result.kv_hit_pages,
                    dict(pool_storage_result.extra_pool_hit_pages),
                )
            ),
        )
        if insert_result is not None and mamba_exist is not None:
            insert_result.mamba_exist = mamba_exist
        cache_actions.extend(self._cache_actions_from_tagged(actions))

    def commit_backup(
        self,
        node_id: NodeId,
        host_indices: torch.Tensor,
        comp_xfers: dict[ComponentType, list[PoolTransfer]],
    ) -> None:
        self._binding.commit_backup(
            node_id, host_indices, _comp_xfers_to_binding(comp_xfers)
        )

    def commit_load_back(
        self,
        node_id: NodeId,
        device_indices: torch.Tensor,
        kv_xfer: PoolTransfer,
        comp_xfers: dict[ComponentType, list[PoolTransfer]],
    ) -> list[CacheAction | ComponentAction]:
        actions = self._binding.commit_load_back(
            node_id,
            device_indices,
            _transfer_to_binding(kv_xfer),
            _comp_xfers_to_binding(comp_xfers),
        )
        return self._cache_actions_from_tagged(actions)

    def drop_subtree_no_host(self, node_id: NodeId) -> DropSubtreeNoHostResult:
        binding_result = self._binding.drop_subtree_no_host(node_id)
        result = DropSubtreeNoHostResult(is_dropped=binding_result.dropped)
        return self._fill_evict_result(binding_result, result)

    def mark_write_through_pending(
        self, node_ids: list[NodeId], ack_id: NodeId
    ) -> list[NodeId]:
        return self._binding.mark_write_through_pending(list(node_ids), ack_id)

    def finish_write_through(self, node_ids: list[NodeId], ack_id: int) -> None:
        self._binding.finish_write_through(list(node_ids), ack_id)

    def finish_load_back(self, anchor_node_id: NodeId) -> None:
        self._binding.finish_load_back(anchor_node_id)

    def build_external_linker_offload_transfers(
        self, node_id: NodeId
    ) -> Optional[list[PoolTransfer]]:
        transfers = self._binding.build_external_linker_offload_transfers(node_id)
        if transfers is None:
            return None
        return [_transfer_from_binding(transfer) for transfer in transfers]

    def mark_external_cache_stored_path(
        self, from_node_id: NodeId, until_node_id: NodeId
    ) -> None:
        self._binding.mark_external_cache_stored_path(from_node_id, until_node_id)

    def mark_external_linker_offload_pending(self, node_id: NodeId) -> None:
        self._binding.mark_external_linker_offload_pending(node_id)

    def finish_external_linker_offload(
        self, node_ids: Sequence[NodeId], ack_id: NodeId, success: bool
    ) -> None:
        self._binding.finish_external_linker_offload(list(node_ids), ack_id, success)

    @property
    def write_back_duplicate_reclaim_digest(self) -> int:
        return self._binding.write_back_duplicate_reclaim_digest()

    def adjust_component_size(
        self, node_id: NodeId, component_type: ComponentType, delta: int
    ) -> None:
        self._binding.adjust_component_size(node_id, int(component_type), delta)

    def collect_path_info(
        self, end_node_ids: Sequence[NodeId]
    ) -> tuple[tuple[TreePathNodeInfo, ...], ...]:
        paths = self._binding.collect_path_info(list(end_node_ids))
        return tuple(tuple(TreePathNodeInfo(*node) for node in path) for path in paths)

    def set_component_device_value(
        self, node_id: NodeId, component_type: ComponentType, value: torch.Tensor
    ) -> None:
        self._binding.set_component_device_value(
            node_id, int(component_type), value.to(torch.int64)
        )

    def get_component_device_value(
        self, node_id: NodeId, component_type: ComponentType
    ) -> Optional[torch.Tensor]:
        return self._binding.get_component_device_value(node_id, int(component_type))

    def component_has_host_value_only(
        self, node_id: NodeId, component_type: ComponentType
    ) -> bool:
        return self._binding.component_has_host_value_only(node_id, int(component_type))

    # ==== Others ====

    def sanity_check(
        self,
        ongoing_write_through: list[tuple[int, NodeId]],
        ongoing_load_back: list[tuple[int, NodeId]],
    ) -> None:
        self._binding.sanity_check(ongoing_write_through, ongoing_load_back)

    def pretty_print(self) -> None:
        self._binding.pretty_print()
