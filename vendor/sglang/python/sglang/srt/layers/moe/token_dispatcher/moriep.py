from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional

from sglang.srt.environ import envs
from sglang.srt.eplb.expert_distribution import (
    _ExpertDistributionRecorderNoop,
    get_global_expert_distribution_recorder,
)
from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
from sglang.srt.layers.dp_attention import get_is_extend_in_batch
from sglang.srt.layers.moe.token_dispatcher.base import (
    BaseDispatcher,
    CombineInput,
    CombineInputFormat,
    DispatchOutput,
    DispatchOutputFormat,
)
from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPPDispatchHooks
from sglang.srt.layers.moe.topk import TopKOutput
from sglang.srt.layers.moe.utils import (
    DeepEPMode,
    is_tbo_enabled,
)
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import (
    get_bool_env_var,
    get_int_env_var,
    is_hip,
)

if TYPE_CHECKING:
    from sglang.srt.single_batch_overlap import CombineOverlapArgs
    import mori

from enum import Enum, auto
from functools import lru_cache

import torch

from sglang.kernels.ops.quantization.fp8_kernel import fp8_dtype

# Blockwise quantization group sizes: number of elements sharing one scale factor
FP8_BLOCK_SIZE = 128
MXFP4_BLOCK_SIZE = 32

MORI_MIN_LOGICAL_RECV_ROWS = 32
MORI_LOGICAL_RECV_ROW_ALIGN = 32

_is_hip = is_hip()
_use_aiter = get_bool_env_var("SGLANG_USE_AITER") and _is_hip

if _use_aiter:
    from aiter import QuantType, get_hip_quant

logger = logging.getLogger(__name__)


def round_logical_recv_rows(cluster_rows: int, pow2_buckets: bool) -> int:
    # Measured on MI355X with DSV4 FP4 AITER fused MoE: latency tracks the logical
    # M and a new M costs no JIT, so power-of-two padding only pays off for a
    # backend that pre-builds power-of-two receive caps.
    if pow2_buckets:
        return max(MORI_MIN_LOGICAL_RECV_ROWS, 1 << (cluster_rows - 1).bit_length())
    align = MORI_LOGICAL_RECV_ROW_ALIGN
    return max(MORI_MIN_LOGICAL_RECV_ROWS, -(-cluster_rows // align) * align)


def mori_recv_bound(local_rows: int, sender_rows: Optional[tuple[int, ...]]) -> int:
    """Return the unrounded receive-row bound, or 0 to keep the full view.

    Verified MORI kernels deduplicate rows per destination rank, so the bound
    comes from sender rows. The caller checks backend/TBO eligibility and
    applies rounding and the physical capacity.
    """
    parallel = get_parallel()
    ep_size = parallel.moe_ep_size
    # ParallelContext already validates rank ranges and topology relationships.
    if ep_size <= 1 or parallel.tp_size != ep_size or parallel.attn_cp_size != 1:
        return 0

    attn_dp_size = parallel.attn_dp_size
    attn_dp_rank = parallel.attn_dp_rank
    attn_tp_size = parallel.attn_tp_size
    attn_tp_rank = parallel.attn_tp_rank

    if attn_dp_size == 1:
        # Use the local tensor_split chunk: DSpark can leave DP token counts stale.
        return attn_tp_size * local_rows + attn_tp_rank
    if (
        sender_rows is None
        or len(sender_rows) != attn_dp_size
        or any(rows < 0 for rows in sender_rows)
    ):
        return 0
    base, extra = divmod(sender_rows[attn_dp_rank], attn_tp_size)
    expected_local_rows = base + int(attn_tp_rank < extra)
    if local_rows != expected_local_rows:
        return 0
    return sum(sender_rows)


def _should_record_expert_distribution() -> bool:
    recorder = get_global_expert_distribution_recorder()
    if recorder.recording:
        return True
    # While capturing, only bake in the count kernel if a recorder is actually
    # configured (non-Noop); otherwise it would replay as dead work every decode
    # step. Configured recorders still bake it in, so start_record() works after
    # capture.
    if torch.get_device_module().is_current_stream_capturing():
        return not isinstance(recorder, _ExpertDistributionRecorderNoop)
    return False


def _record_local_expert_count(local_expert_count: torch.Tensor) -> None:
    # The recorder tracks routed experts only; drop the per-rank fused shared
    # expert slot that follows them.
    num_routed = get_global_expert_location_metadata().num_local_physical_experts
    get_global_expert_distribution_recorder().on_deepep_dispatch_low_latency(
        local_expert_count[:num_routed]
    )


@functools.lru_cache(maxsize=1)
def _aiter_supports_mxfp8_dispatch() -> bool:
    """Whether this aiter can consume fp8 activations with group-32 e8m0 scales.

    Probed rather than assumed, because the failure is silent in the worst way:
    an older per_1x32 quant still returns fp8, but with continuous fp32 scales,
    which the MoE then reads as e8m0 bytes and produces garbage rather than an
    exception. Checking the signature keeps this a startup-time fallback instead
    of a runtime corruption.
    """
    try:
        import inspect

        from aiter import get_hip_quant

        return "scale_type" in inspect.signature(get_hip_quant).parameters or any(
            "scale_type" in inspect.signature(f).parameters
            for f in (get_hip_quant(QuantType.per_1x32),)
        )
    except Exception:
        return False


@functools.lru_cache(maxsize=1)
def _mori_epv2_fp8_direct_cast_saturates() -> bool:
    # Older MORI EPv2 fp8_direct_cast combine emits NaN past the fp8 max; the fix
    # added this helper. Drop once the minimum MORI carries the fix.
    try:
        from mori.ops.dispatch_combine_v2 import intranode_kernels
    except ImportError:
        return False
    return hasattr(intranode_kernels, "_direct_cast_fp8_max")


class MoriEPPDispatchHooks(DeepEPPDispatchHooks):
    def __call__(self, dispatcher: BaseDispatcher):
        for hook_fun in self.hook_dict.values():
            hook_fun(dispatcher)


class MoriEPNormalDispatchOutput(NamedTuple):
    """Mori EP normal dispatch output."""

    hidden_states: torch.Tensor
    hidden_states_scale: Optional[torch.Tensor]
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    origin_topk_ids: torch.Tensor
    origin_topk_weights: torch.Tensor
    out_dtype: torch.dtype
    expert_output: Optional[torch.Tensor] = None
    # Logical MoE input cap selected by the dispatcher; 0 disables trimming.
    recv_cap: int = 0

    @property
    def format(self) -> DispatchOutputFormat:
        return DispatchOutputFormat.DEEPEP_NORMAL


class MoriEPLLDispatchOutput(NamedTuple):
    """Mori EP low latency dispatch output."""

    hidden_states: torch.Tensor
    hidden_states_scale: Optional[torch.Tensor]
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    origin_topk_ids: torch.Tensor
    origin_topk_weights: torch.Tensor
    out_dtype: torch.dtype
    # Logical MoE input cap selected by the dispatcher; 0 disables trimming.
    recv_cap: int = 0

    @property
    def format(self) -> DispatchOutputFormat:
        return DispatchOutputFormat.DEEPEP_LL


assert isinstance(MoriEPNormalDispatchOutput, DispatchOutput)
assert isinstance(MoriEPLLDispatchOutput, DispatchOutput)


class MoriEPNormalCombineInput(NamedTuple):
    """Mori EP combine input."""

    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor

    @property
    def format(self) -> CombineInputFormat:
        return CombineInputFormat.DEEPEP_NORMAL


class MoriEPLLCombineInput(NamedTuple):
    """Mori EP combine input."""

    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor

    @property
    def format(self) -> CombineInputFormat:
        return CombineInputFormat.DEEPEP_LL


assert isinstance(MoriEPNormalCombineInput, CombineInput)
assert isinstance(MoriEPLLCombineInput, CombineInput)


class EpMode(Enum):
    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"
    LOW_LATENCY = "low_latency"


class DispatchDtype(Enum):
    bf16 = "bfloat16"
    fp8 = "float8_blockwise"
    fp4 = "mxfp4_blockwise"
    mxfp8 = "mxfp8_blockwise"


class CombineDtype(Enum):
    bf16 = "bfloat16"
    fp8 = "float8_blockwise"
    fp8_direct_cast = "float8_direct_cast"
    fp4 = "fp4_blockwise"  # packed E2M1, blockwise-scaled; ~half the combine transport of fp8


@dataclass(frozen=True)
class _MoriEPv1LaunchConfig:
    kernel_type: mori.ops.EpDispatchCombineKernelType
    warp_num_per_block: int
    block_num: int
    rdma_block_num: int


@dataclass(frozen=True)
class _MoriEPv2LaunchConfig:
    dispatch_block_num: Optional[int]
    dispatch_warp_num_per_block: Optional[int]
    combine_block_num: Optional[int]
    combine_warp_num_per_block: Optional[int]


def _get_epv1_launch_configs(
    num_max_dispatch_tokens_per_rank: int = 4096,
) -> dict[EpMode, _MoriEPv1LaunchConfig]:
    import mori

    # Selects the inter-node kernel. `InterNodeV1LL` is used if `num_max_dispatch_tokens_per_rank`
    # is less than or equal to the threshold, otherwise `InterNodeV1` is used. The threshold defaults to 256.
    inter_kernel_switch_threshold = get_int_env_var(
        "SGLANG_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD", 256
    )

    inter_kernel_type = (
        mori.ops.EpDispatchCombineKernelType.InterNodeV1LL
        if num_max_dispatch_tokens_per_rank <= inter_kernel_switch_threshold
        else mori.ops.EpDispatchCombineKernelType.InterNodeV1
    )

    return {
        # TODO(billishyahao): need to tune different configs for intra node async
        # Also could be tuned for different AMD platform
        EpMode.INTRA_NODE: _MoriEPv1LaunchConfig(
            kernel_type=mori.ops.EpDispatchCombineKernelType.IntraNode,
            warp_num_per_block=16,
            block_num=80,
            rdma_block_num=0,
        ),
        EpMode.INTER_NODE: _MoriEPv1LaunchConfig(
            kernel_type=inter_kernel_type,
            warp_num_per_block=8,
            block_num=64,
            rdma_block_num=32,
        ),
        EpMode.LOW_LATENCY: _MoriEPv1LaunchConfig(
            kernel_type=mori.ops.EpDispatchCombineKernelType.AsyncLL,
            warp_num_per_block=8,
            block_num=64,
            rdma_block_num=32,
        ),
    }


def _get_epv2_launch_config(tbo_enabled: bool) -> _MoriEPv2LaunchConfig:
    if not tbo_enabled:
        # MORI picks its own schedule.
        return _MoriEPv2LaunchConfig(None, None, None, None)
    # Under TBO a sibling batch computes while this one communicates, so cap the
    # grid to leave CUs for it.
    return _MoriEPv2LaunchConfig(
        dispatch_block_num=32,
        dispatch_warp_num_per_block=4,
        combine_block_num=48,
        combine_warp_num_per_block=4,
    )


# init_mori_op only needs do once in model initial stage
# use lru_cache to reuse the same mori_op instance to avoid the init overhead for mori
@lru_cache(maxsize=4)
def init_mori_op(
    group,
    router_topk,
    num_experts,
    num_local_experts,
    hidden_size,
    params_dtype,
    num_max_dispatch_tokens_per_rank,
    deepep_mode,
    instance_id=0,
    dispatch_dtype=DispatchDtype.bf16,
    combine_dtype=CombineDtype.bf16,
    enable_sdma=False,
    use_external_inp_buf=True,
):

    import mori

    world_size = get_parallel().moe_ep_size
    rank = get_parallel().moe_ep_rank

    gpu_per_node = 8 if world_size >= 8 else world_size

    group_name = f"mori"
    cpu_group = group.cpu_group
    try:
        torch._C._distributed_c10d._register_process_group(group_name, cpu_group)
    except Exception as e:
        if "already registered" in str(e):
            logger.info(
                f"[MORI init] The same process group is already "
                f"registered. Ignoring [{str(e)}]"
            )
        else:
            raise
    else:
        # If new group is newly registered then need to init mori shmem. However
        # if the group is registered already then need to skip init mori shmem
        # and reuse the previous one.
        mori.shmem.shmem_torch_process_group_init(group_name)

    mode = EpMode.INTRA_NODE if world_size <= 8 else EpMode.INTER_NODE
    async_mode = deepep_mode.enable_low_latency() or enable_sdma
    if async_mode:
        mode = EpMode.LOW_LATENCY

    launch_config = _get_epv1_launch_configs(num_max_dispatch_tokens_per_rank)[mode]

    kernel_type = launch_config.kernel_type
    warp_num_per_block = launch_config.warp_num_per_block
    block_num = launch_config.block_num
    rdma_block_num = launch_config.rdma_block_num

    hidden_dim = hidden_size
    scale_dim = 1
    data_type = fp8_dtype
    scale_type_size = torch.float32.itemsize

    if dispatch_dtype == DispatchDtype.bf16:
        data_type = params_dtype
        scale_dim = 0
    elif dispatch_dtype == DispatchDtype.fp8:
        scale_dim = hidden_size // FP8_BLOCK_SIZE
    elif dispatch_dtype == DispatchDtype.mxfp8:
        # fp8 payload with group-32 e8m0 microscales: exactly what the per_1x32
        # MoE kernels consume, so the receive side needs no quant at all.
        scale_dim = hidden_size // MXFP4_BLOCK_SIZE
        scale_type_size = torch.float8_e8m0fnu.itemsize
    elif dispatch_dtype == DispatchDtype.fp4:
        # FP4 kernel still takes the original hidden size and do quantization
        # internally, so hidden_dim is not reduced. The reason is that for FP4
        # quantization, we need to keep the original hidden size to calculate
        # the quantization scale correctly. Don't use packed hidden size for FP4 kernel.
        hidden_dim = hidden_size
        scale_dim = hidden_size // MXFP4_BLOCK_SIZE
        data_type = torch.float4_e2m1fn_x2
        scale_type_size = torch.float8_e8m0fnu.itemsize

        if mode == EpMode.INTRA_NODE:
            if num_max_dispatch_tokens_per_rank < 128:
                block_num = 225
                warp_num_per_block = 5
            else:
                block_num = 256
                warp_num_per_block = 16

    if kernel_type == mori.ops.EpDispatchCombineKernelType.IntraNode:
        # mori's intranode combine ends in a grid-wide barrier every block spins
        # on. A 256-block grid deadlocks on a 192-CU device; clamping to the CU
        # count is a conservative bound, not the measured residency limit.
        cu_count = torch.cuda.get_device_properties(
            torch.cuda.current_device()
        ).multi_processor_count
        block_num = min(block_num, cu_count)

    # Fp8 blockwise combine uses its own internal scale_dim driven which can be
    # overridden by env ``MORI_FP8_COMBINE_SCALE_DIM`` (default 56)
    # See https://github.com/ROCm/mori/blob/96ffa169710f214e76e07abe5008d686fe54522b/python/mori/ops/dispatch_combine.py#L81-L84
    combine_quant_type = "none"
    if combine_dtype == CombineDtype.fp8:
        combine_quant_type = "fp8_blockwise"
    elif combine_dtype == CombineDtype.fp8_direct_cast:
        combine_quant_type = "fp8_direct_cast"
    elif combine_dtype == CombineDtype.fp4:
        combine_quant_type = "fp4_blockwise"

    logger.info(
        f"[MORI init] {world_size=} {rank=} {hidden_size=} {params_dtype=} "
        f"{num_max_dispatch_tokens_per_rank=} {num_local_experts=} "
        f"{router_topk=} {mode=} {dispatch_dtype=} {combine_dtype=} "
        f"{use_external_inp_buf=} "
    )

    def check_mori_compatibility(kwargs: dict) -> None:
        """Remove kwargs not accepted by the installed mori's EpDispatchCombineConfig."""
        import dataclasses

        config_cls = mori.ops.EpDispatchCombineConfig
        valid_kwargs = {f.name for f in dataclasses.fields(config_cls)}

        invalid_kwargs = set(kwargs.keys()) - valid_kwargs
        for arg in invalid_kwargs:
            logger.warning(f"[MORI compat] Removing incompatible argument {arg} ")
            del kwargs[arg]

    # Definition refer to https://github.com/ROCm/mori/blob/f9be5ee2e5ac87256b9523399ae9d4d0e8a54f53/python/mori/ops/dispatch_combine.py#L66-L121
    common_kwargs = dict(
        data_type=data_type,
        rank=rank,
        world_size=world_size,
        hidden_dim=hidden_dim,
        scale_dim=scale_dim,
        scale_type_size=scale_type_size,
        max_token_type_size=params_dtype.itemsize,
        max_num_inp_token_per_rank=num_max_dispatch_tokens_per_rank,
        num_experts_per_rank=num_local_experts,
        num_experts_per_token=router_topk,
        warp_num_per_block=warp_num_per_block,
        block_num=block_num,
        max_total_recv_tokens=get_int_env_var(
            "SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS", 0
        ),
        use_external_inp_buf=use_external_inp_buf,
        kernel_type=kernel_type,
        gpu_per_node=gpu_per_node,
        rdma_block_num=rdma_block_num,
        num_qp_per_pe=2,  # Number of queue pairs per processing element
        quant_type=combine_quant_type,
    )

    check_mori_compatibility(common_kwargs)

    mori_config = mori.ops.EpDispatchCombineConfig(**common_kwargs)
    mori_op = mori.ops.EpDispatchCombineOp(mori_config)
    return mori_op


class CommStreamPool:
    _streams = {}  # key -> torch.cuda.Stream

    @classmethod
    def _make_key(cls, group):
        return (torch.cuda.current_device(), id(group))

    @classmethod
    def get_stream_from_pool(cls, group) -> torch.cuda.Stream:
        key = cls._make_key(group)
        stream = cls._streams.get(key)
        if stream is None:
            stream = torch.cuda.Stream(priority=0)
            cls._streams[key] = stream
        return stream

    @classmethod
    def clear_group(cls, group):
        key = (torch.cuda.current_device(), id(group))
        cls._streams.pop(key, None)


def _init_cco_communicator(group, instance_id: int, per_rank_vmm_gb: int):
    from mori.cco import Communicator

    parallel = get_parallel()
    world_size = parallel.moe_ep_size
    rank = parallel.moe_ep_rank

    uid = Communicator.get_unique_id() if rank == 0 else None
    uid = group.broadcast_object(uid, src=0)
    comm = Communicator.init(
        world_size, rank, uid, per_rank_vmm=per_rank_vmm_gb * (1 << 30)
    )
    logger.info(
        f"[MORI EPv2 init] cco communicator world={world_size} rank={rank} "
        f"instance={instance_id} per_rank_vmm_gb={per_rank_vmm_gb}"
    )
    return comm


def _cco_lsa_size(comm) -> int:
    """Ranks in this rank's cco LSA team, i.e. the ones sharing its flat VA."""
    import mori.cco.cco as _cco
    from mori.cco.communicator import DevCommHandle

    # The Communicator does not expose the team; a device comm without GDA QPs
    # reads it cheaply.
    requirements = _cco.DevCommRequirements()
    requirements.gda_connection_type = _cco.GDA_CONNECTION_NONE
    handle = DevCommHandle(comm, requirements=requirements)
    try:
        return handle.lsa_size
    finally:
        handle.close()


def _epv2_arena_bytes(cfg) -> int:
    """Upper bound of the MORI EPv2 intranode symmetric arena for `cfg`."""
    cap = cfg.effective_max_recv
    topk = cfg.num_experts_per_token
    # The hip backend pads scale rows to 128 B; flydsl uses the unpadded row.
    scale_row = -(-cfg.scale_dim * cfg.scale_type_size // 128) * 128
    per_recv_row = (
        cfg.token_nbytes + cfg.combine_token_nbytes + scale_row + topk * 8 + 4
    )
    total = cap * per_recv_row + cfg.world_size * 12
    if cfg.is_scatter:
        scatter_rows = cfg.world_size * cfg.max_num_inp_token_per_rank
        scatter_row = cfg.hidden_dim * cfg.wire_elem_size + topk * 4
        if cfg.fp8_blockwise:
            scatter_row += cfg.combine_scale_dim * 4
        total += scatter_rows * scatter_row
    # SymmArena aligns each of its (at most 12) regions to 256 B.
    return total + 12 * 256


# Arbitrary floor: the former fixed per-rank cco window.
_EPV2_MIN_PER_RANK_VMM_GB = 4


def _epv2_per_rank_vmm_gb(cfg) -> int:
    # The window only reserves virtual address space, so size it to the arena.
    required_gb = -(-_epv2_arena_bytes(cfg) // (1 << 30))
    return max(_EPV2_MIN_PER_RANK_VMM_GB, required_gb)


# MORI EPv2 per-token scale layout: (scale_dim, bytes per scale) for each dispatch dtype.
_EPV2_DISPATCH_SCALES = {
    DispatchDtype.bf16: (0, 0),
    DispatchDtype.fp8: (FP8_BLOCK_SIZE, torch.float32.itemsize),
    DispatchDtype.fp4: (MXFP4_BLOCK_SIZE, torch.float8_e8m0fnu.itemsize),
    DispatchDtype.mxfp8: (MXFP4_BLOCK_SIZE, torch.float8_e8m0fnu.itemsize),
}
_EPV2_COMBINE_QUANT = {
    CombineDtype.bf16: "none",
    CombineDtype.fp8: "fp8_blockwise",
    CombineDtype.fp8_direct_cast: "fp8_direct_cast",
}


def _epv2_dispatch_torch_dtype(dispatch_dtype: DispatchDtype) -> torch.dtype:
    if dispatch_dtype == DispatchDtype.bf16:
        return torch.bfloat16
    if dispatch_dtype == DispatchDtype.fp4:
        return torch.float4_e2m1fn_x2
    return fp8_dtype


def _supports_dynamic_recv_cap(op) -> bool:
    # MORI quantized combines run in scatter mode, which only takes the full cap.
    return hasattr(op, "prepare_recv_cap") and not op.cfg.is_scatter


# One op (and its own cco window, sized for its arena) per distinct config;
# never evicted, since MoE layers keep using the op they were built with.
@lru_cache(maxsize=None)
def init_mori_epv2_op(
    group,
    router_topk: int,
    num_experts: int,
    num_local_experts: int,
    hidden_size: int,
    params_dtype: torch.dtype,
    max_tokens_per_rank: int,
    instance_id: int = 0,
    max_total_recv_tokens: int = 0,
    dispatch_dtype: DispatchDtype = DispatchDtype.bf16,
    combine_dtype: CombineDtype = CombineDtype.bf16,
    launch_config: _MoriEPv2LaunchConfig = _MoriEPv2LaunchConfig(
        None, None, None, None
    ),
):
    from mori.ops.dispatch_combine_v2 import (
        EpDispatchCombineConfig,
        EpDispatchCombineOp,
    )

    if params_dtype != torch.bfloat16:
        raise ValueError(
            "MORI EPv2 requires BF16 expert/combine output; "
            f"got params_dtype={params_dtype}"
        )
    if combine_dtype not in _EPV2_COMBINE_QUANT:
        raise ValueError(f"unsupported MORI EPv2 combine dtype: {combine_dtype}")
    # MORI EPv2 quantizes the combine wire only on a symmetric bf16 op (scatter mode).
    if combine_dtype != CombineDtype.bf16 and dispatch_dtype != DispatchDtype.bf16:
        raise ValueError(
            f"MORI EPv2 combine dtype {combine_dtype} requires bf16 dispatch; "
            f"got {dispatch_dtype}"
        )
    transport_dtype = _epv2_dispatch_torch_dtype(dispatch_dtype)
    is_asymmetric = transport_dtype != torch.bfloat16
    scale_block, scale_type_size = _EPV2_DISPATCH_SCALES[dispatch_dtype]

    parallel = get_parallel()
    world_size = parallel.moe_ep_size
    rank = parallel.moe_ep_rank
    cfg_kwargs = dict(
        rank=rank,
        world_size=world_size,
        hidden_dim=hidden_size,
        max_num_inp_token_per_rank=max_tokens_per_rank,
        num_experts_per_rank=num_local_experts,
        num_experts_per_token=router_topk,
        data_type=torch.bfloat16,
        dispatch_data_type=transport_dtype if is_asymmetric else None,
        combine_data_type=torch.bfloat16 if is_asymmetric else None,
        scale_dim=hidden_size // scale_block if scale_block else 0,
        scale_type_size=scale_type_size,
        combine_mode="gather",
        quant_type=_EPV2_COMBINE_QUANT[combine_dtype],
        max_total_recv_tokens=max_total_recv_tokens,
    )
    cfg = EpDispatchCombineConfig(
        **cfg_kwargs,
        dispatch_block_num=launch_config.dispatch_block_num,
        combine_block_num=launch_config.combine_block_num,
        warp_num_per_block=launch_config.dispatch_warp_num_per_block,
        combine_warp_num_per_block=launch_config.combine_warp_num_per_block,
    )
    comm = _init_cco_communicator(
        group=group, instance_id=instance_id, per_rank_vmm_gb=_epv2_per_rank_vmm_gb(cfg)
    )
    # Ranks share the flat VA only within the cco LSA team (a host, or a UALink
    # vPOD on gfx1250); a wider EP group needs MORI's internode path, which only
    # the hip backend has. MORI rejects the configs that path cannot run.
    lsa_size = _cco_lsa_size(comm)
    if lsa_size < world_size:
        if "gpu_per_node" not in EpDispatchCombineConfig.__dataclass_fields__:
            raise ValueError(
                f"MORI EPv2 ep_size={world_size} spans more than its cco LSA team "
                f"({lsa_size} GPUs), and this MORI has no internode EPv2; "
                "set SGLANG_MORI_EP_V2=false to use EPv1"
            )
        # The launch config is tuned for the intranode kernels; let MORI's
        # internode tables pick the geometry.
        cfg = EpDispatchCombineConfig(
            **cfg_kwargs, gpu_per_node=lsa_size, kernel_backend="hip"
        )
    op = EpDispatchCombineOp(cfg, comm)
    comm.barrier()
    if _supports_dynamic_recv_cap(op):
        # Pre-compile every power-of-two receive cap _select_recv_cap can pick, so
        # CUDA graph capture never compiles a new tier.
        cap = MORI_MIN_LOGICAL_RECV_ROWS
        while cap <= cfg.effective_max_recv:
            op.prepare_recv_cap(cap)
            cap *= 2
    logger.info(
        f"[MORI EPv2 init] world={world_size} rank={rank} lsa_size={lsa_size} "
        f"hidden={hidden_size} experts={num_experts} local_experts={num_local_experts} "
        f"topk={router_topk} max_tokens={max_tokens_per_rank} "
        f"recv_cap={cfg.effective_max_recv} "
        f"dispatch_dtype={dispatch_dtype} combine_dtype={combine_dtype} "
        f"combine_mode={cfg.combine_mode} launch_config={launch_config} "
        f"schedule={cfg.schedule}"
    )
    return op


class _MoriEPDispatcherImplBase:
    _is_epv2 = False

    def __init__(
        self,
        group: torch.distributed.ProcessGroup,
        router_topk: int,
        permute_fusion: bool,
        num_experts: int,
        num_local_experts: int,
        hidden_size: int,
        params_dtype: torch.dtype,
        deepep_mode: DeepEPMode,
        instance_id: int = 0,
    ):
        self.group = group
        self.router_topk = router_topk
        self.permute_fusion = permute_fusion
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.params_dtype = params_dtype
        self.deepep_mode = deepep_mode
        self.instance_id = instance_id
        self.num_max_dispatch_tokens_per_rank = (
            envs.SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK.get()
        )
        self.dispatch_dtype = DispatchDtype.bf16
        self.combine_dtype = CombineDtype.bf16
        self.quant_config = {}
        self.overlap_args = None
        self.meta_overlap_args = None
        self._comm_stream = None
        self.async_finish = False
        self._tbo_enabled = is_tbo_enabled()
        self._trim_recv = envs.SGLANG_MORI_RECV_BOUND.get()
        self._manual_recv_cap = envs.SGLANG_MORI_MOE_MAX_INPUT_TOKENS.get()
        self._recv_cap_pow2_buckets = False

    @staticmethod
    def _snapshot_sender_rows() -> tuple[int, ...] | None:
        """Copy CPU scheduler metadata; non-int rows would need a device sync."""
        from sglang.srt.layers.dp_attention import get_dp_global_num_tokens

        rows = get_dp_global_num_tokens()
        if not isinstance(rows, (list, tuple)) or not all(
            isinstance(r, int) for r in rows
        ):
            return None
        return tuple(rows)

    def _get_physical_recv_rows(self) -> int:
        raise NotImplementedError

    def _is_recv_layout_verified(self) -> bool:
        raise NotImplementedError

    def _select_recv_cap(self) -> int:
        """Select the logical MoE input cap before dispatch_b; 0 keeps the full view."""
        self._recv_cap = 0
        if self._manual_recv_cap > 0:
            # The caller is responsible for covering all received tokens, as
            # with the original EPv1 override. Do not round an explicit cap.
            self._recv_cap = min(self._manual_recv_cap, self._get_physical_recv_rows())
        elif (
            self._trim_recv
            and not self._tbo_enabled
            and self._is_recv_layout_verified()
        ):
            bound = mori_recv_bound(self._num_tokens, self._dispatch_sender_rows)
            # Empty or unproved bounds keep the full view.
            if bound > 0:
                cap = round_logical_recv_rows(
                    bound, pow2_buckets=self._recv_cap_pow2_buckets
                )
                if cap < self._get_physical_recv_rows():
                    self._recv_cap = cap
        return self._recv_cap

    def _quantize_dispatch_input(self, hidden_states):
        num_tokens = hidden_states.shape[0]
        scale = None
        if self.dispatch_dtype == DispatchDtype.mxfp8:
            # MXFP8 quant on live tokens, before the wire.
            if num_tokens > 0:
                # scale_type must be set explicitly: per_1x32_mx_quant_hip still
                # defaults fp8 output to continuous fp32 scales for backward
                # compatibility, but the MoE kernels (and the 1-byte scale_dim
                # configured above) need the e8m0 byte layout.
                hidden_states, scale = self.mxfp8_quant_func(
                    hidden_states,
                    quant_dtype=fp8_dtype,
                    scale_type=torch.float8_e8m0fnu,
                )
            else:
                hidden_states = torch.empty(
                    hidden_states.shape, dtype=fp8_dtype, device=hidden_states.device
                )
                scale = torch.empty(
                    (0, self.hidden_size // MXFP4_BLOCK_SIZE),
                    dtype=torch.float8_e8m0fnu,
                    device=hidden_states.device,
                )
        elif self.dispatch_dtype == DispatchDtype.fp8:
            # FP8 quant
            if num_tokens > 0:
                # NOTE: aiter is able to handle token=0 case in UT. But for some
                # reason it failed at e2e case. Root cause TBD.
                hidden_states, scale = self.fp8_quant_func(
                    hidden_states, quant_dtype=fp8_dtype
                )
            else:
                hidden_states = torch.empty(
                    hidden_states.shape, dtype=fp8_dtype, device=hidden_states.device
                )
                scale = torch.empty(
                    (0, self.hidden_size // FP8_BLOCK_SIZE),
                    dtype=torch.float32,
                    device=hidden_states.device,
                )

        elif self.dispatch_dtype == DispatchDtype.fp4:
            # FP4 quant
            if num_tokens > 0:
                hidden_states, scale = self.fp4_quant_func(hidden_states, shuffle=False)
            else:
                hidden_states = torch.empty(
                    (0, self.hidden_size // 2),
                    dtype=torch.float4_e2m1fn_x2,
                    device=hidden_states.device,
                )
                scale = torch.empty(
                    (0, self.hidden_size // MXFP4_BLOCK_SIZE),
                    dtype=torch.float8_e8m0fnu,
                    device=hidden_states.device,
                )

        return hidden_states, scale

    def _prepare_topk(self, topk_output):
        return topk_output.topk_weights, topk_output.topk_ids

    def _capture_event_if_async(self):
        if self._comm_stream is None or not self.async_finish:
            return None
        event = torch.cuda.Event(blocking=False, interprocess=False)
        event.record(torch.cuda.current_stream())
        return event

    def dispatch_a(
        self,
        hidden_states: torch.Tensor,
        topk_output: TopKOutput,
    ):
        self._num_tokens = hidden_states.shape[0]
        # Keep metadata attached to this dispatch when a/b are separated or
        # two TBO children interleave.
        self._dispatch_sender_rows = self._snapshot_sender_rows()
        output_dtype = hidden_states.dtype
        hidden_states, scale = self._quantize_dispatch_input(hidden_states)
        topk_weights, topk_ids = self._prepare_topk(topk_output)
        return (
            hidden_states,
            topk_weights,
            topk_ids,
            scale,
            output_dtype,
            self._capture_event_if_async(),
        )

    def dispatch_b(self, *args, **kwargs):
        raise NotImplementedError

    def combine_a(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ):
        return hidden_states, topk_ids, topk_weights, self._capture_event_if_async()

    def combine_b(self, *args, **kwargs):
        raise NotImplementedError

    def set_quant_config(self, quant_config: dict) -> None:
        self.quant_config = quant_config
        weight_dtype = quant_config.get("weight_dtype")
        self.dispatch_dtype = DispatchDtype.bf16
        if weight_dtype == torch.float4_e2m1fn_x2:
            self.dispatch_dtype = DispatchDtype.fp4
        elif weight_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            self.dispatch_dtype = DispatchDtype.fp8
        self.combine_dtype = self._default_combine_dtype(weight_dtype)
        # Combine overrides read the final dispatch dtype, so apply dispatch first.
        self._apply_dispatch_dtype_override()
        self._apply_combine_dtype_override()

    def _default_combine_dtype(self, weight_dtype) -> CombineDtype:
        raise NotImplementedError

    def _apply_dispatch_dtype_override(self):
        """Apply the SGLANG_MORI_DISPATCH_DTYPE override."""
        dispatch_dtype = envs.SGLANG_MORI_DISPATCH_DTYPE.get().lower()
        epv2_dtypes = ("", "auto", "bf16", "fp8", "fp4", "mxfp8")
        if self._is_epv2 and dispatch_dtype not in epv2_dtypes:
            raise ValueError(
                "SGLANG_MORI_DISPATCH_DTYPE must be auto, bf16, fp8, fp4 or mxfp8 "
                f"for EPv2; got {dispatch_dtype!r}"
            )
        if envs.SGLANG_MORI_DISPATCH_DTYPE.is_set():
            if dispatch_dtype != "auto":
                if dispatch_dtype == "bf16":
                    self.dispatch_dtype = DispatchDtype.bf16
                elif dispatch_dtype == "fp8":
                    self.dispatch_dtype = DispatchDtype.fp8
                elif dispatch_dtype == "fp4":
                    self.dispatch_dtype = DispatchDtype.fp4
                elif dispatch_dtype == "mxfp8":
                    if _aiter_supports_mxfp8_dispatch():
                        self.dispatch_dtype = DispatchDtype.mxfp8
                    else:
                        logger.warning_once(
                            "SGLANG_MORI_DISPATCH_DTYPE=mxfp8 requires an aiter "
                            "build whose per_1x32 quant accepts scale_type "
                            "(for the group-32 e8m0 byte layout the MoE kernels "
                            "consume). This aiter does not, so the send-side "
                            "quant would emit continuous fp32 scales and the "
                            "MoE would read them as e8m0 bytes. Falling back to "
                            "bf16 dispatch."
                        )

    def _apply_combine_dtype_override(self):
        raise NotImplementedError

    def set_overlap_args(
        self, combine_overlap_args: CombineOverlapArgs, meta_overlap_args: dict
    ) -> None:
        self.overlap_args = combine_overlap_args
        self.meta_overlap_args = meta_overlap_args

    def clear_overlap_args(self) -> None:
        self.overlap_args = None
        self.meta_overlap_args = None


class _MoriEPv1DispatcherImplBase(_MoriEPDispatcherImplBase):
    def __init__(self, **kwargs):
        try:
            import mori  # noqa: F401
        except ImportError:
            raise ImportError("Mori EP is not installed. Please install.")
        super().__init__(**kwargs)
        self.enable_sdma = get_bool_env_var("MORI_ENABLE_SDMA", "false")
        self.use_external_inp_buf = True
        self._mori_op = None
        self.fp8_quant_func = get_hip_quant(QuantType.per_1x128)
        self.fp4_quant_func = get_hip_quant(QuantType.per_1x32)
        # Same MX entry point; quant_dtype selects fp4x2 vs fp8.
        self.mxfp8_quant_func = get_hip_quant(QuantType.per_1x32)

    @property
    def mori_op(self):
        if self._mori_op is None:
            # If set_quant_config was never called, apply env var override now
            if self.quant_config is None:
                self._apply_dispatch_dtype_override()
            self._mori_op = init_mori_op(
                self.group,
                self.router_topk,
                self.num_experts,
                self.num_local_experts,
                self.hidden_size,
                self.params_dtype,
                self.num_max_dispatch_tokens_per_rank,
                self.deepep_mode,
                self.instance_id,
                self.dispatch_dtype,
                self.combine_dtype,
                self.enable_sdma,
                self.use_external_inp_buf,
            )
        return self._mori_op

    def _default_combine_dtype(self, weight_dtype) -> CombineDtype:
        if weight_dtype == torch.float4_e2m1fn_x2:
            return CombineDtype.fp8
        return CombineDtype.bf16

    def _apply_combine_dtype_override(self):
        if "SGLANG_MORI_COMBINE_DTYPE" in os.environ:
            combine_dtype = os.environ["SGLANG_MORI_COMBINE_DTYPE"].lower()
            if combine_dtype != "auto":
                if combine_dtype == "fp8":
                    self.combine_dtype = CombineDtype.fp8
                elif combine_dtype == "bf16":
                    self.combine_dtype = CombineDtype.bf16
                elif combine_dtype == "fp8_direct_cast":
                    self.combine_dtype = CombineDtype.fp8_direct_cast
                elif combine_dtype == "fp4":
                    self.combine_dtype = CombineDtype.fp4

    def _get_physical_recv_rows(self) -> int:
        # MORI uses this same capacity to construct its dispatch output views.
        return self.mori_op.max_num_tokens_to_recv()

    def _is_recv_layout_verified(self) -> bool:
        import mori

        return self.mori_op.config.kernel_type in (
            mori.ops.EpDispatchCombineKernelType.IntraNode,
            mori.ops.EpDispatchCombineKernelType.AsyncLL,
        )


class _MoriEPDispatcherImplNormal(_MoriEPv1DispatcherImplBase):
    def __init__(self, async_finish: bool, **kwargs):
        super().__init__(**kwargs)
        self.async_finish = async_finish
        self.enable_dual_stream = is_tbo_enabled()
        if self.enable_dual_stream:
            self._comm_stream = CommStreamPool.get_stream_from_pool(self.group)

    def dispatch_b(
        self,
        hidden_states,
        topk_weights,
        topk_ids,
        scale,
        output_dtype,
        previous_event,
    ):

        (
            packed_recv_hidden,
            recv_topk_weights,
            recv_scales,
            recv_topk_ids,
            packed_recv_count,
            done_event,
        ) = self._dispatch_core(
            hidden_states,
            topk_weights,
            topk_ids,
            scale=scale,
            previous_event=previous_event,
        )

        if self._comm_stream and self.async_finish and done_event is not None:
            torch.cuda.current_stream().wait_event(done_event)

        return MoriEPNormalDispatchOutput(
            hidden_states=packed_recv_hidden,
            hidden_states_scale=recv_scales,
            topk_ids=recv_topk_ids,
            topk_weights=recv_topk_weights,
            num_recv_tokens_per_expert=packed_recv_count,
            origin_topk_ids=topk_ids,
            origin_topk_weights=topk_weights,
            out_dtype=output_dtype,
            recv_cap=self._recv_cap,
        )

    def _dispatch_core(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        scale: Optional[torch.Tensor] = None,
        previous_event: Optional[torch.cuda.Event] = None,
    ):
        done_event: Optional[torch.cuda.Event] = None

        record = _should_record_expert_distribution()

        if self._comm_stream:
            compute_stream = torch.cuda.current_stream()
            comm_stream = self._comm_stream  # comm stream

            # Deliberately no `record_stream(comm_stream)`: it would hold every
            # dispatch/combine block in the allocator's deferred-free list until
            # the comm event retires, and with `async_finish` the compute stream
            # never blocks, so `reserved` churns until ROCr runs out of scratch
            # (HSA_STATUS_ERROR_OUT_OF_RESOURCES) -- the failure the non-EP DP
            # TBO path already hit, see `_TBO_PERSIST_BUF` in dp_attention.py.
            # Dropping it outright (rather than a keep-alive as in DeepseekV4
            # op_combine_a) is safe because dispatch_b / combine_b wait_event on
            # the compute stream in the same call, with no TBO yield between.

            with torch.cuda.stream(comm_stream):
                # if (previous_event) stream_wait(comm_stream, previous_event)
                # else stream_wait(comm_stream, compute_stream)

                if previous_event is not None:
                    comm_stream.wait_event(previous_event)
                else:
                    comm_stream.wait_stream(compute_stream)

                dispatch_fn = (
                    self.mori_op.dispatch_send
                    if self.enable_sdma
                    else self.mori_op.dispatch
                )
                (
                    packed_recv_hidden,
                    recv_topk_weights,
                    recv_scales,
                    recv_topk_ids,
                    packed_recv_count,
                ) = dispatch_fn(
                    hidden_states,
                    topk_weights,
                    scale,
                    topk_ids,
                    call_local_expert_count=record,
                )
                if self.enable_sdma:
                    self.mori_op.dispatch_recv()

                if self.async_finish:
                    done_event = torch.cuda.Event(blocking=False, interprocess=False)
                    done_event.record(comm_stream)
                else:
                    compute_stream.wait_stream(comm_stream)

        else:
            (
                packed_recv_hidden,
                recv_topk_weights,
                recv_scales,
                recv_topk_ids,
                packed_recv_count,
            ) = self.mori_op.dispatch(
                hidden_states,
                topk_weights,
                scale,
                topk_ids,
                call_local_expert_count=record,
            )

        # mori local_expert_count is a GPU tensor; route it through the
        # low_latency hook only when the recorder is actually active.
        if record:
            _record_local_expert_count(self.mori_op.local_expert_count)

        return (
            packed_recv_hidden,
            recv_topk_weights,
            recv_scales,
            recv_topk_ids,
            packed_recv_count,
            done_event,
        )

    def combine_b(self, hidden_states, topk_ids, topk_weights, previous_event):
        hidden_states, done_event = self._combine_core(
            hidden_states, topk_ids, topk_weights, previous_event
        )
        if self._comm_stream and self.async_finish and done_event is not None:
            torch.cuda.current_stream().wait_event(done_event)

        return hidden_states

    def _combine_core(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        previous_event: Optional[torch.cuda.Event],
    ):
        done_event: Optional[torch.cuda.Event] = None

        if self._comm_stream:
            compute_stream = torch.cuda.current_stream()
            comm_stream = self._comm_stream

            # No `record_stream(comm_stream)` -- see `_dispatch_core`.

            with torch.cuda.stream(comm_stream):
                if previous_event is not None:
                    comm_stream.wait_event(previous_event)
                else:
                    comm_stream.wait_stream(compute_stream)

                combine_fn = (
                    self.mori_op.combine_send
                    if self.enable_sdma
                    else self.mori_op.combine
                )
                combined_hidden_states = combine_fn(hidden_states, None, topk_ids)[0]
                if self.enable_sdma:
                    self.mori_op.combine_recv()

                if self.async_finish:
                    done_event = torch.cuda.Event(blocking=False, interprocess=False)
                    done_event.record(comm_stream)
                else:
                    compute_stream.wait_stream(comm_stream)

        else:
            combined_hidden_states = self.mori_op.combine(
                hidden_states, None, topk_ids
            )[0]

        return combined_hidden_states, done_event


class _MoriEPDispatcherImplLowLatency(_MoriEPv1DispatcherImplBase):
    def dispatch_a(
        self,
        hidden_states: torch.Tensor,
        topk_output: TopKOutput,
    ):
        import mori

        assert (
            self.mori_op.config.kernel_type
            is mori.ops.EpDispatchCombineKernelType.AsyncLL
        ), "mori asyncll mismatch"

        (
            hidden_states,
            topk_weights,
            topk_ids,
            scale,
            output_dtype,
            _,
        ) = super().dispatch_a(hidden_states, topk_output)

        (
            packed_recv_hidden,
            recv_topk_weights,
            recv_scales,
            recv_topk_ids,
            packed_recv_count,
        ) = self._dispatch_core(hidden_states, topk_weights, topk_ids, scale=scale)

        return (
            packed_recv_hidden,
            recv_topk_weights,
            recv_topk_ids,
            recv_scales,
            packed_recv_count,
            topk_weights,
            topk_ids,
            output_dtype,
        )

    def dispatch_b(
        self,
        hidden_states,
        recv_topk_weights,
        recv_topk_ids,
        recv_scales,
        packed_recv_count,
        topk_weights,
        topk_ids,
        output_dtype,
    ):

        ##TODO(billishyahao): add assertion here to check async
        import mori

        assert (
            self.mori_op.config.kernel_type
            is mori.ops.EpDispatchCombineKernelType.AsyncLL
        ), "mori asyncll mismatch"

        record = _should_record_expert_distribution()
        self.mori_op.dispatch_recv(call_local_expert_count=record)

        if record:
            _record_local_expert_count(self.mori_op.local_expert_count)

        return MoriEPLLDispatchOutput(
            hidden_states=hidden_states,
            hidden_states_scale=recv_scales,
            topk_ids=recv_topk_ids,
            topk_weights=recv_topk_weights,
            num_recv_tokens_per_expert=packed_recv_count,
            origin_topk_ids=topk_ids,
            origin_topk_weights=topk_weights,
            out_dtype=output_dtype,
            recv_cap=self._recv_cap,
        )

    def _dispatch_core(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        scale: Optional[torch.Tensor] = None,
    ):
        ##TODO(billishyahao): add assertion here to check async

        (
            packed_recv_hidden,
            recv_topk_weights,
            recv_scales,
            recv_topk_ids,
            packed_recv_count,
        ) = self.mori_op.dispatch_send(hidden_states, topk_weights, scale, topk_ids)

        return (
            packed_recv_hidden,
            recv_topk_weights,
            recv_scales,
            recv_topk_ids,
            packed_recv_count,
        )

    def combine_a(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        overlap_args: Optional[CombineOverlapArgs] = None,
    ):
        hidden_states = self._combine_core(
            hidden_states,
            topk_ids,
            topk_weights,
            overlap_args=overlap_args,
        )
        return hidden_states, topk_ids, topk_weights, overlap_args

    def combine_b(self, hidden_states, topk_ids, topk_weights, previous_event):
        self.mori_op.combine_recv()
        return hidden_states[0]

    def _combine_core(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        overlap_args: Optional[CombineOverlapArgs] = None,
    ):
        combined_hidden_states = self.mori_op.combine_send(
            hidden_states, None, topk_ids
        )

        return combined_hidden_states


class _MoriEPv2DispatcherImplNormal(_MoriEPDispatcherImplBase):
    _is_epv2 = True

    def __init__(self, async_finish: bool, **kwargs):
        super().__init__(**kwargs)
        if (
            not self.deepep_mode.enable_normal()
            or self.deepep_mode.enable_low_latency()
        ):
            raise ValueError("MORI EPv2 currently supports normal mode only")
        try:
            from mori.cco import Communicator  # noqa: F401
            from mori.ops.dispatch_combine_v2 import EpDispatchCombineOp  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "MORI EPv2 requires a MORI build with cco and dispatch_combine_v2"
            ) from exc

        # EPv2 forwards exactly top-k routed experts and has no fake expert slot.
        os.environ.setdefault("AITER_FLYDSL_EP_NO_FAKE_EXPERT", "1")
        self.async_finish = async_finish
        # Same dual-stream setup as EPv1 normal; dispatch_b/combine_b order the
        # comm stream with the events async_finish records.
        if self._tbo_enabled and async_finish:
            self._comm_stream = CommStreamPool.get_stream_from_pool(self.group)
        self._launch_config = _get_epv2_launch_config(self._tbo_enabled)
        self._mori_op = None
        self.fp8_quant_func = None
        self.fp4_quant_func = None
        self.mxfp8_quant_func = None
        if _use_aiter:
            self.fp8_quant_func = get_hip_quant(QuantType.per_1x128)
            self.fp4_quant_func = get_hip_quant(QuantType.per_1x32)
            self.mxfp8_quant_func = get_hip_quant(QuantType.per_1x32)

    def set_quant_config(self, quant_config: dict) -> None:
        super().set_quant_config(quant_config)
        # All EPv2 quant funcs are bound together, only when Aiter is available.
        if self.dispatch_dtype != DispatchDtype.bf16 and self.fp4_quant_func is None:
            raise RuntimeError(
                f"MORI EPv2 {self.dispatch_dtype} dispatch requires Aiter quantization"
            )
        # Build the op once the dtypes are final; see _initialize_op for the timing.
        if self._mori_op is None:
            self._initialize_op()

    def _default_combine_dtype(self, weight_dtype) -> CombineDtype:
        return CombineDtype.bf16

    def _apply_combine_dtype_override(self):
        if envs.SGLANG_MORI_COMBINE_DTYPE.is_set():
            combine_dtype = envs.SGLANG_MORI_COMBINE_DTYPE.get().lower()
            if combine_dtype == "fp8":
                self.combine_dtype = CombineDtype.fp8
            elif combine_dtype == "fp8_direct_cast":
                self.combine_dtype = CombineDtype.fp8_direct_cast
            elif combine_dtype == "fp4":
                logger.warning_once(
                    "SGLANG_MORI_COMBINE_DTYPE=fp4 is not supported by MORI EPv2; "
                    "falling back to bf16."
                )
            elif combine_dtype not in ("", "auto", "bf16"):
                raise ValueError(
                    "SGLANG_MORI_COMBINE_DTYPE must be auto, bf16, fp8, "
                    f"fp8_direct_cast or fp4; got {combine_dtype!r}"
                )
        if (
            self.combine_dtype != CombineDtype.bf16
            and self.dispatch_dtype != DispatchDtype.bf16
        ):
            # MORI EPv2 rejects a quantized combine on an asymmetric (quantized-dispatch) op.
            logger.warning_once(
                f"MORI EPv2 {self.combine_dtype} combine requires bf16 dispatch, "
                f"got {self.dispatch_dtype}; falling back to bf16 combine."
            )
            self.combine_dtype = CombineDtype.bf16
        if (
            self.combine_dtype == CombineDtype.fp8_direct_cast
            and not _mori_epv2_fp8_direct_cast_saturates()
        ):
            logger.warning_once(
                "This MORI build's EPv2 fp8_direct_cast combine emits NaN instead "
                "of saturating values past the fp8 max, which corrupts models with "
                "large expert outputs such as DeepSeek-V4; falling back to fp8 "
                "(blockwise) combine. Upgrade MORI to use fp8_direct_cast."
            )
            self.combine_dtype = CombineDtype.fp8

    def _initialize_op(self):
        # set_quant_config runs during model loading, before CUDA graph capture,
        # so collective CCO window creation and graph-tier JIT happen safely.
        self._mori_op = init_mori_epv2_op(
            self.group,
            self.router_topk,
            self.num_experts,
            self.num_local_experts,
            self.hidden_size,
            self.params_dtype,
            self.num_max_dispatch_tokens_per_rank,
            self.instance_id,
            envs.SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS.get(),
            self.dispatch_dtype,
            self.combine_dtype,
            self._launch_config,
        )
        # Keep logical caps on the power-of-two ladder init_mori_epv2_op pre-compiled.
        self._recv_cap_pow2_buckets = _supports_dynamic_recv_cap(self._mori_op)

    @property
    def mori_op(self):
        if self._mori_op is None:
            logger.warning_once(
                "MORI EPv2 op is built lazily because set_quant_config was not "
                "called: dtype env overrides are ignored and its CCO window is "
                "allocated after KV cache sizing."
            )
            self._initialize_op()
        return self._mori_op

    def _get_physical_recv_rows(self) -> int:
        return self.mori_op.cfg.effective_max_recv

    def _is_recv_layout_verified(self) -> bool:
        # Older MORI builds lack these fields; keep their full receive view.
        return not getattr(self.mori_op.cfg, "is_internode", True) and getattr(
            self.mori_op, "backend_name", "unknown"
        ) in ("flydsl", "hip")

    def dispatch_a(self, hidden_states: torch.Tensor, topk_output: TopKOutput):
        if hidden_states.dtype != torch.bfloat16:
            raise ValueError(
                "MORI EPv2 expects BF16 activations before transport quantization; "
                f"hidden_states.dtype={hidden_states.dtype}"
            )
        return super().dispatch_a(hidden_states, topk_output)

    def _prepare_topk(self, topk_output):
        return (
            topk_output.topk_weights.to(torch.float32),
            topk_output.topk_ids.to(torch.int32),
        )

    def dispatch_b(
        self, hidden_states, topk_weights, topk_ids, scale, output_dtype, ready_event
    ) -> DispatchOutput:
        kwargs = {"return_routing": True}
        if _supports_dynamic_recv_cap(self.mori_op):
            # A manual cap is an exact MoE input limit, not a MORI graph tier.
            # Keep the full transport view so arbitrary caps need no new JIT
            # specialization during capture; AITER applies the logical slice.
            dispatch_cap = (
                self.mori_op.cfg.effective_max_recv
                if self._manual_recv_cap > 0 or self._recv_cap == 0
                else self._recv_cap
            )
            kwargs.update(recv_cap=dispatch_cap, clone_routing=False)
        if self._comm_stream is None:
            result = self.mori_op.dispatch(
                hidden_states, topk_weights, scale, topk_ids, **kwargs
            )
        else:
            compute_stream = torch.cuda.current_stream()
            keepalive = (hidden_states, topk_weights, topk_ids, scale)
            with torch.cuda.stream(self._comm_stream):
                assert ready_event is not None
                self._comm_stream.wait_event(ready_event)
                result = self.mori_op.dispatch(
                    hidden_states, topk_weights, scale, topk_ids, **kwargs
                )
                done_event = torch.cuda.Event(blocking=False, interprocess=False)
                done_event.record(self._comm_stream)
            compute_stream.wait_event(done_event)
            del keepalive
        (
            recv_hidden,
            recv_weights,
            recv_scales,
            recv_indices,
            total_recv,
            routing,
        ) = result
        if recv_scales is not None:
            # MORI forwards scales as opaque i32 dwords; restore the quantizer layout.
            if self.dispatch_dtype == DispatchDtype.fp8:
                recv_scales = recv_scales.view(torch.float32)[
                    :, : self.hidden_size // FP8_BLOCK_SIZE
                ]
            else:
                recv_scales = recv_scales.view(torch.float8_e8m0fnu)[
                    :, : self.hidden_size // MXFP4_BLOCK_SIZE
                ]
        self._routing = routing
        self._recv_topk_ids = recv_indices
        # Count after dispatch and before combine (combine resets total_recv), on
        # the compute stream that already waited for the dispatch.
        if _should_record_expert_distribution():
            _record_local_expert_count(self.mori_op.local_expert_count())
        # Let AITER write the expert output straight into combine's staging view so
        # combine skips its copy. TBO children own separate arenas (instance_id);
        # combine waits on the compute event recorded after the expert writes.
        expert_output = None
        combine_in_view = getattr(self.mori_op, "combine_in_view", None)
        if combine_in_view is not None:
            expert_output = combine_in_view()[: recv_hidden.shape[0]]
        return MoriEPNormalDispatchOutput(
            hidden_states=recv_hidden,
            hidden_states_scale=recv_scales,
            topk_ids=recv_indices,
            topk_weights=recv_weights,
            num_recv_tokens_per_expert=total_recv,
            origin_topk_ids=topk_ids,
            origin_topk_weights=topk_weights,
            out_dtype=output_dtype,
            expert_output=expert_output,
            recv_cap=self._recv_cap,
        )

    def combine_b(self, hidden_states, topk_ids, topk_weights, ready_event):
        if self._comm_stream is None:
            out, _ = self.mori_op.combine(
                hidden_states, None, self._recv_topk_ids, routing=self._routing
            )
        else:
            compute_stream = torch.cuda.current_stream()
            keepalive = (
                hidden_states,
                topk_ids,
                topk_weights,
                self._recv_topk_ids,
                self._routing,
            )
            with torch.cuda.stream(self._comm_stream):
                assert ready_event is not None
                self._comm_stream.wait_event(ready_event)
                out, _ = self.mori_op.combine(
                    hidden_states, None, self._recv_topk_ids, routing=self._routing
                )
                done_event = torch.cuda.Event(blocking=False, interprocess=False)
                done_event.record(self._comm_stream)
            compute_stream.wait_event(done_event)
            del keepalive
        if not torch.cuda.is_current_stream_capturing():
            del self._routing
        return out


class _Stage(Enum):
    INITIAL = auto()
    AFTER_DISPATCH_A = auto()
    AFTER_DISPATCH_B = auto()
    AFTER_COMBINE_A = auto()


class MoriEPDispatcher(BaseDispatcher):
    def __init__(
        self,
        group: torch.distributed.ProcessGroup,
        router_topk: int,
        permute_fusion: bool = False,
        num_experts: int = None,
        num_local_experts: int = None,
        hidden_size: int = None,
        params_dtype: torch.dtype = None,
        deepep_mode: DeepEPMode = DeepEPMode.AUTO,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        instance_id: int = 0,
    ):
        super().__init__()

        self._is_epv2 = envs.SGLANG_MORI_EP_V2.get()
        if self._is_epv2 and deepep_mode == DeepEPMode.AUTO:
            deepep_mode = DeepEPMode.NORMAL
        self.deepep_mode = deepep_mode

        async_mode = self.deepep_mode.enable_low_latency()
        if (
            not self._is_epv2
            and get_bool_env_var("SGLANG_ROCM_USE_MULTI_STREAM")
            and not async_mode
        ):
            logger.warning_once(
                "SGLANG_ROCM_USE_MULTI_STREAM=1 is set but Mori AsyncLL is "
                "not enabled (--deepep-mode=%s). The alt-stream overlap only "
                "frees up CUs when dispatch/combine runs on the AsyncLL "
                "copy-engine kernel; otherwise it stays on CUs and competes "
                "with the alt-stream work. Pass --deepep-mode low_latency "
                "(or auto) to enable the AsyncLL kernel.",
                self.deepep_mode.value,
            )

        common_kwargs = dict(
            group=group,
            router_topk=router_topk,
            permute_fusion=permute_fusion,
            num_experts=num_experts,
            num_local_experts=num_local_experts,
            hidden_size=hidden_size,
            params_dtype=params_dtype,
            deepep_mode=deepep_mode,
            instance_id=instance_id,
        )

        if self._is_epv2:
            self._normal_dispatcher = _MoriEPv2DispatcherImplNormal(
                async_finish=async_finish, **common_kwargs
            )
        else:
            if self.deepep_mode.enable_low_latency():
                self._low_latency_dispatcher = _MoriEPDispatcherImplLowLatency(
                    **common_kwargs,
                )

            if self.deepep_mode.enable_normal():
                self._normal_dispatcher = _MoriEPDispatcherImplNormal(
                    async_finish=async_finish,
                    **common_kwargs,
                )

        self._stage = _Stage.INITIAL
        self._deepep_dispatch_hooks = MoriEPPDispatchHooks()

        # Mori dispatch produces global topk_ids in [0, num_experts); mask out
        # experts that are not local to this rank.
        self.expert_mask_gpu = None
        if (
            (_use_aiter or self._is_epv2)
            and num_experts is not None
            and num_local_experts is not None
        ):
            ep_rank = get_parallel().moe_ep_rank
            expert_mask = torch.zeros(
                num_experts,
                device=torch.cuda.current_device(),
                dtype=torch.int32,
            )
            start = ep_rank * num_local_experts
            expert_mask[start : start + num_local_experts] = 1
            self.expert_mask_gpu = expert_mask

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_output: TopKOutput,
    ) -> DispatchOutput:
        self.dispatch_a(hidden_states, topk_output)
        if self._deepep_dispatch_hooks is not None:
            self._deepep_dispatch_hooks(self)
        return self.dispatch_b()

    def dispatch_a(
        self,
        hidden_states: torch.Tensor,
        topk_output: TopKOutput,
    ):
        self._update_stage(_Stage.INITIAL, _Stage.AFTER_DISPATCH_A)
        self._num_tokens = hidden_states.shape[0]
        self._dispatch_intermediate_state = self._get_impl().dispatch_a(
            hidden_states=hidden_states, topk_output=topk_output
        )

    def dispatch_b(self):
        self._update_stage(_Stage.AFTER_DISPATCH_A, _Stage.AFTER_DISPATCH_B)
        inner_state = self._dispatch_intermediate_state
        del self._dispatch_intermediate_state
        impl = self._get_impl()
        impl._select_recv_cap()
        return impl.dispatch_b(*inner_state)

    def combine(
        self,
        combine_input: CombineInput,
    ) -> torch.Tensor:
        self.combine_a(combine_input)
        hidden_states = self.combine_b()
        return hidden_states[: self._num_tokens]

    def combine_a(
        self,
        combine_input: CombineInput,
    ):
        hidden_states, topk_ids, topk_weights = combine_input
        self._update_stage(_Stage.AFTER_DISPATCH_B, _Stage.AFTER_COMBINE_A)
        inner_state = self._get_impl().combine_a(
            hidden_states=hidden_states,
            topk_ids=topk_ids,
            topk_weights=topk_weights,
        )
        self._combine_intermediate_state = inner_state

    def combine_b(self):
        self._update_stage(_Stage.AFTER_COMBINE_A, _Stage.INITIAL)
        inner_state = self._combine_intermediate_state
        del self._combine_intermediate_state
        return self._get_impl().combine_b(*inner_state)

    def _get_impl(self) -> _MoriEPDispatcherImplBase:
        if self._is_epv2:
            return self._normal_dispatcher
        is_extend_in_batch = get_is_extend_in_batch()
        resolved_deepep_mode = self.deepep_mode.resolve(is_extend_in_batch)
        if resolved_deepep_mode == DeepEPMode.NORMAL:
            return self._normal_dispatcher
        elif resolved_deepep_mode == DeepEPMode.LOW_LATENCY:
            return self._low_latency_dispatcher
        else:
            raise ValueError(f"Invalid deepep_mode: {self.deepep_mode}")

    def _update_stage(self, old_stage, new_stage):
        assert self._stage == old_stage
        self._stage = new_stage

    def set_quant_config(self, quant_config: dict):
        super().set_quant_config(quant_config)
        if self.deepep_mode.enable_low_latency():
            self._low_latency_dispatcher.set_quant_config(quant_config)
        if self.deepep_mode.enable_normal():
            self._normal_dispatcher.set_quant_config(quant_config)

    def set_overlap_args(
        self, combine_overlap_args: CombineOverlapArgs, meta_overlap_args: dict
    ):
        super().set_overlap_args(combine_overlap_args, meta_overlap_args)
        if self.deepep_mode.enable_low_latency():
            self._low_latency_dispatcher.set_overlap_args(
                combine_overlap_args, meta_overlap_args
            )
        if self.deepep_mode.enable_normal():
            self._normal_dispatcher.set_overlap_args(
                combine_overlap_args, meta_overlap_args
            )

    def clear_overlap_args(self):
        super().clear_overlap_args()
        if self.deepep_mode.enable_low_latency():
            self._low_latency_dispatcher.clear_overlap_args()
        if self.deepep_mode.enable_normal():
            self._normal_dispatcher.clear_overlap_args()

    def register_deepep_dispatch_hook(self, hook):
        return self._deepep_dispatch_hooks.register_hook(hook)
