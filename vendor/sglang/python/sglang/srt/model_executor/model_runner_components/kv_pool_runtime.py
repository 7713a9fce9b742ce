from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import msgspec
import torch

from sglang.srt.arg_groups.overrides import post_capture_kv_sizing_planned
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.mem_cache.kv_cache_configurator import mm_runtime_reservation_gb
from sglang.srt.model_executor.cuda_graph_config import Backend
from sglang.srt.model_executor.runner_utils.pool import graph_pool_borrow_enabled
from sglang.srt.platforms import current_platform
from sglang.srt.runtime_context import (
    get_disagg,
    get_exec,
    get_mm,
    get_parallel,
    get_schedule,
    pre_capture_activation_reserve_mb,
)
from sglang.srt.utils.common import get_available_gpu_memory, get_device_memory_capacity

if TYPE_CHECKING:
    from sglang.srt.mem_cache.allocator import BaseTokenToKVPoolAllocator
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

logger = logging.getLogger(__name__)


def is_post_capture_kv_active(
    *,
    server_args: ServerArgs,
    is_draft_worker: bool,
    spec_algorithm: SpeculativeAlgorithm,
    token_to_kv_pool_allocator: Optional[BaseTokenToKVPoolAllocator],
) -> bool:
    if is_draft_worker:
        # A dflash-family draft pool is indexed by the target's token ids, so it
        # follows the target pool's post-capture backing.
        return (
            spec_algorithm.is_dflash_family()
            and token_to_kv_pool_allocator.get_kvcache().post_capture_active
        )
    return post_capture_kv_sizing_planned(server_args) and current_platform.is_cuda()


class PostCaptureKVResize(msgspec.Struct, frozen=True, kw_only=True):
    max_total_num_tokens: int
    full_max_total_num_tokens: Optional[int]
    swa_max_total_num_tokens: Optional[int]
    unified_memory_pool_bytes: Optional[int]
    capped_max_running_requests: Optional[int]


def compute_post_capture_kv_resize(
    model_runner: ModelRunner,
    *,
    draft_runners: tuple[ModelRunner, ...] = (),
) -> PostCaptureKVResize:
    """Resize the KV pool after capture and return the new sizes for the
    orchestrator to assign. Takes the live ModelRunner because it reads
    post-capture GPU memory + the pool objects it must resize in place."""
    pool = model_runner.token_to_kv_pool
    torch.cuda.synchronize()
    free_gb = get_available_gpu_memory(
        model_runner.device,
        model_runner.gpu_id,
        distributed=get_parallel().launch_world_size > 1,
        cpu_group=get_parallel().world_group.cpu_group,
    )
    headroom_gb = model_runner.pre_model_load_memory * (
        1 - model_runner.mem_fraction_static
    )
    decode_cuda_graph_config = get_exec().graph.cuda_graph_config.decode
    decode_max_bs = int(decode_cuda_graph_config.max_bs or 0)
    running_requests = int(model_runner.max_running_requests or decode_max_bs or 1)
    eager_decode_gap = (
        get_disagg().disaggregation_mode != "prefill"
        and decode_cuda_graph_config.backend != Backend.DISABLED
        and decode_max_bs < running_requests
    )
    if eager_decode_gap:
        logger.warning(
            "Post-capture KV sizing: decode CUDA graph max_bs=%d < "
            "max_running_requests=%d; reserving activation headroom",
            decode_max_bs,
            running_requests,
        )
    if eager_decode_gap or mambaish_config(model_runner.model_config) is not None:
        prefill_max_requests = get_schedule().prefill_max_requests
        request_slots = get_exec().graph.cuda_graph_config.prefill.full_prefill_max_req
        # Every prefill batch fits a captured bucket when batches are capped at the
        # request slots; the configured headroom then covers the eager tail.
        capped_full_prefill_role = (
            get_disagg().disaggregation_mode == "prefill"
            and get_exec().graph.cuda_graph_config.prefill.backend == Backend.FULL
            and get_schedule().max_mamba_cache_size is not None
            and prefill_max_requests is not None
            and request_slots is not None
            and prefill_max_requests <= request_slots
        )
        if not capped_full_prefill_role:
            headroom_gb = max(
                headroom_gb,
                pre_capture_activation_reserve_mb(
                    get_device_memory_capacity(model_runner.device)
                )
                / 1024,
            )
    if not graph_pool_borrow_enabled():
        # Borrowing serves the sampling temporaries out of idle graph storage;
        # without it they need real headroom the KV pool must not claim.
        headroom_gb = max(
            headroom_gb,
            model_runner.sampling_prewarm_result.sampling_headroom_bytes / (1 << 30),
        )
    mm_reservation_gb = mm_runtime_reservation_gb(
        is_multimodal=model_runner.model_config.is_multimodal,
        mm_feature_transport=get_mm().mm_feature_transport,
    )
    # Sequential target/draft forwards reuse workspace at unchanged capacities.
    canary_workspace_bytes = max(
        (
            runner.canary_manager.per_forward_workspace_bytes()
            for runner in (model_runner, *draft_runners)
            if runner.canary_manager is not None
        ),
        default=0,
    )
    # Drafts take the target's token count; the target cell already charges their
    # bytes. A draft that aliases the target pool is finalized once, as the target.
    draft_pools = tuple(
        runner.token_to_kv_pool
        for runner in draft_runners
        if runner.token_to_kv_pool is not pool
        and runner.token_to_kv_pool.post_capture_active
    )
    budget_bytes = (
        int(max(0.0, free_gb - headroom_gb - mm_reservation_gb) * (1 << 30))
        + pool.post_capture_backed_bytes
        + sum(draft_pool.post_capture_backed_bytes for draft_pool in draft_pools)
        - canary_workspace_bytes
    )
    config = model_runner.kv_cache_configurator.config_from_budget(
        budget_bytes, cap_tokens=model_runner.max_total_num_tokens
    )
    pool.finalize_backing(config)
    for draft_pool in draft_pools:
        draft_pool.finalize_backing(config)
    model_runner.token_to_kv_pool_allocator.resize(config)
    model_runner.req_to_token_pool.reset_aux_cache_allocator()
    if canary_workspace_bytes:
        logger.info(
            "Post-capture KV sizing: KV-canary per-forward workspace %.2f GB",
            canary_workspace_bytes / (1 << 30),
        )

    capped_max_running_requests = None
    if model_runner.max_running_requests is not None:
        # Re-calculate max_running_requests for the now smaller pool
        capped_reqs = min(
            model_runner.max_running_requests,
            model_runner.kv_cache_configurator.resolve_max_num_reqs(
                config.max_total_num_tokens
            ),
        )
        if capped_reqs < model_runner.max_running_requests:
            logger.warning(
                "Post-capture KV sizing: max_running_requests %d -> %d",
                model_runner.max_running_requests,
                capped_reqs,
            )
            capped_max_running_requests = capped_reqs
    # Two-line summary mirroring the pre-capture pool logs: the resized pool
    # shape (cf. "Use sliding window memory pool") then its backed KV footprint
    # and post-resize free memory (cf. "KV Cache is allocated" + "Memory pool end").
    # Non-hybrid pools leave the full/swa splits unset, so fall back to the single
    # total for the full-layer count.
    full_layer_tokens = (
        config.full_max_total_num_tokens
        if config.full_max_total_num_tokens is not None
        else config.max_total_num_tokens
    )
    swa_layer_tokens = config.swa_max_total_num_tokens or 0
    logger.info(
        "Post-capture KV sizing: full_layer_tokens=%d, swa_layer_tokens=%d",
        full_layer_tokens,
        swa_layer_tokens,
    )
    logger.info(
        "Post-capture KV sizing: KV cache allocated. dtype: %s, #tokens: %d, "
        "KV size: %.2f GB, avail mem=%.2f GB",
        pool.dtype,
        config.max_total_num_tokens,
        pool.post_capture_backed_bytes / (1 << 30),
        get_available_gpu_memory(model_runner.device, model_runner.gpu_id),
    )
    for draft_pool in draft_pools:
        logger.info(
            "Post-capture KV sizing: draft KV cache allocated. dtype: %s, "
            "#tokens: %d, KV size: %.2f GB",
            draft_pool.dtype,
            draft_pool.size,
            draft_pool.post_capture_backed_bytes / (1 << 30),
        )
    return PostCaptureKVResize(
        max_total_num_tokens=config.max_total_num_tokens,
        full_max_total_num_tokens=config.full_max_total_num_tokens,
        swa_max_total_num_tokens=config.swa_max_total_num_tokens,
        unified_memory_pool_bytes=config.unified_memory_pool_bytes,
        capped_max_running_requests=capped_max_running_requests,
    )
