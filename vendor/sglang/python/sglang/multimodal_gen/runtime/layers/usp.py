# Copied and adapted from: https://github.com/hao-ai-lab/FastVideo

import contextlib
import logging
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._attention import _cp_options

from sglang.kernels.ops.diffusion import pack_qkv_destination_major, usp_merge_heads
from sglang.multimodal_gen.runtime.distributed.parallel_state import (
    get_ring_ctx,
    get_sp_group,
    get_ulysses_parallel_rank,
    get_ulysses_parallel_world_size,
)
from sglang.multimodal_gen.runtime.platforms import current_platform
from sglang.srt.utils.common import torch_release

_cp_options.enable_load_balance = False
SHM_ALLTOALL_MAX_BYTES = 32 * 1024 * 1024

if TYPE_CHECKING:
    from sglang.multimodal_gen.runtime.layers.attention.backends.attention_backend import (
        AttentionImpl,
    )

logger = logging.getLogger(__name__)


_A2A_STAGING_BUFFERS: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}
# depth of open uncached_a2a_staging() blocks
_UNCACHED_STAGING = 0


@contextlib.contextmanager
def uncached_a2a_staging():
    """Run the Ulysses exchanges inside the block over NCCL on per-call buffers.

    For a one-off exchange the steady state never repeats (the pipelined
    attention's first-sight reference): the staging cache and the IPC
    transports' staging pairs would otherwise stay allocated at its size. An
    all-to-all is a permutation, so the transport never changes its bytes.
    """
    global _UNCACHED_STAGING
    _UNCACHED_STAGING += 1
    try:
        yield
    finally:
        _UNCACHED_STAGING -= 1


# Accelerators whose device module exposes is_current_stream_capturing() and can
# run the packed-QKV relayout kernel. "cuda" also covers ROCm, where is_cuda is True.
_A2A_DEVICE_TYPES = ("cuda", "xpu")


def drop_a2a_staging_buffers() -> None:
    """Release the cached all-to-all staging buffers on this rank.

    The cache only ever grows to the largest message seen, so a warmup probe
    at the full serving shape leaves buffers sized for it behind; the caller
    releases them at a point every rank reaches together.
    """
    if not _A2A_STAGING_BUFFERS:
        return
    device_module = torch.get_device_module()
    if device_module.is_available():
        device_module.synchronize()
    _A2A_STAGING_BUFFERS.clear()


def _a2a_staging_buffer(
    role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Reusable staging buffer for a Ulysses collective.

    A buffer of a given role is fully consumed (in stream order) before the
    next collective with the same role overwrites it. Keep one grow-only
    backing allocation per (role, dtype, device), then return an exact-shape
    view into that allocation. This removes per-block allocator churn without
    retaining one device tensor for every request shape seen by the worker.
    Bypassed under autograd and graph capture: a buffer first allocated while
    capturing would live in the graph's private memory pool and must not be
    shared with eager replays.
    """
    if (
        _UNCACHED_STAGING
        or torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or device.type not in _A2A_DEVICE_TYPES
        or torch.get_device_module(device).is_current_stream_capturing()
    ):
        return torch.empty(shape, dtype=dtype, device=device)

    device_index = device.index
    if device_index is None:
        device_index = torch.get_device_module(device).current_device()
    key = (role, dtype, device_index)
    required_numel = math.prod(shape)
    buffer = _A2A_STAGING_BUFFERS.get(key)
    if buffer is None or buffer.numel() < required_numel:
        # The previous same-role collective is fully consumed by contract, so
        # drop its cache reference before allocating a larger backing buffer.
        # Any outstanding tensor view still keeps the old storage alive.
        _A2A_STAGING_BUFFERS.pop(key, None)
        del buffer
        buffer = torch.empty(required_numel, dtype=dtype, device=device)
        _A2A_STAGING_BUFFERS[key] = buffer
    return buffer[:required_numel].view(shape)


def _usp_all_to_all_single(x: torch.Tensor, role: str | None = None) -> torch.Tensor:
    sp_group = get_sp_group()
    ulysses_pg = sp_group.ulysses_group
    assert ulysses_pg is not None, "Ulysses process group is not initialized."
    x_shape = x.shape
    x = x.flatten().contiguous()
    if x.is_cuda and not _UNCACHED_STAGING and not torch.compiler.is_compiling():
        from sglang.multimodal_gen.runtime.distributed.device_communicators.ipc_a2a_multi import (
            IPC_A2A_MULTI,
            ipc_a2a_multi_ready,
        )

        if ipc_a2a_multi_ready(ulysses_pg):
            world_size = torch.distributed.get_world_size(group=ulysses_pg)
            received = IPC_A2A_MULTI.exchange(x.view(world_size, -1))
            if received is not None:
                return received.view(x_shape)
    if role is None:
        output = torch.empty_like(x)
    else:
        output = _a2a_staging_buffer(role, x.shape, x.dtype, x.device)

    # USP calls this collective many times per denoising step and waits
    # immediately, so avoid the extra wrapper overhead of functional collectives.
    handle = sp_group.ulysses_shm_handle
    input_bytes = x.numel() * x.element_size()
    if (
        current_platform.is_cpu()
        and handle is not None
        and handle >= 0
        and input_bytes <= SHM_ALLTOALL_MAX_BYTES
    ):
        torch.ops.sgl_kernel.shm_alltoall(output, x, sp_group.ulysses_shm_handle)
    else:
        torch.distributed.all_to_all_single(output, x, group=ulysses_pg)

    return output.reshape(x_shape)


def _usp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` from every Ulysses rank along dim 0, rank order."""
    ulysses_pg = get_sp_group().ulysses_group
    assert ulysses_pg is not None, "Ulysses process group is not initialized."
    x = x.contiguous()
    output = torch.empty(
        (get_ulysses_parallel_world_size() * x.shape[0], *x.shape[1:]),
        dtype=x.dtype,
        device=x.device,
    )
    dist.all_gather_into_tensor(output, x, group=ulysses_pg)
    return output


def _usp_all_to_all_single_varlen(
    x: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
) -> torch.Tensor:
    ulysses_pg = get_sp_group().ulysses_group
    assert ulysses_pg is not None, "Ulysses process group is not initialized."
    x = x.flatten().contiguous()
    output = torch.empty(sum(output_split_sizes), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(
        output,
        x,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=ulysses_pg,
    )
    return output


def _ipc_ready_group():
    """The ulysses group when the 2-rank IPC transport is usable, else None."""
    from sglang.multimodal_gen.runtime.distributed.device_communicators.ipc_a2a import (
        ipc_a2a_ready,
    )

    # The transport's custom-class handles cannot be traced; a compiled graph
    # keeps the NCCL all-to-all (traceable) instead of breaking here.
    if _UNCACHED_STAGING or torch.compiler.is_compiling():
        return None
    group = get_sp_group().ulysses_group
    return group if ipc_a2a_ready(group) else None


def _ipc_varlen_fast(x, seq_lens, head_dim, direction):
    """2-rank IPC path for the varlen A2A pair; None when unavailable."""
    if head_dim != 2:
        return None
    group = _ipc_ready_group()
    if group is None:
        return None
    from sglang.multimodal_gen.runtime.distributed.device_communicators.ipc_a2a import (
        IPC_A2A,
    )

    r = IPC_A2A.rank
    off = [0, seq_lens[0]]
    if direction == "input":
        # [b, s_local, h_global, d] -> [b, sum(seq_lens), h_global/2, d]
        b, s_local, h_global, d = x.shape
        half = h_global // 2
        peer_len = seq_lens[1 - r]
        send = x[:, :, (1 - r) * half : (2 - r) * half].contiguous()
        out = x.new_empty(b, seq_lens[0] + seq_lens[1], half, d)
        out.narrow(1, off[r], s_local).copy_(x[:, :, r * half : (r + 1) * half])
        theirs = IPC_A2A.exchange(group, send, (b, peer_len, half, d))
        if theirs is None:
            return None
        out.narrow(1, off[1 - r], peer_len).copy_(theirs)
        return out
    # output: [b, s_global, h_local, d] -> [b, seq_lens[r], 2*h_local, d].
    # The staging buffer IS the gathered result: each rank writes its head
    # half of the peer's slot directly; no intermediate copy.
    b, s_global, h_local, d = x.shape
    my_len = seq_lens[r]
    peer_len = seq_lens[1 - r]
    n_out = b * my_len * 2 * h_local * d
    n_peer_out = b * peer_len * 2 * h_local * d
    pair = IPC_A2A.get_staging(n_out, n_peer_out, x.dtype, group)
    if pair is None:
        return None
    local, peer = pair
    slot = IPC_A2A.next_slot()
    pst = peer[slot].narrow(0, 0, n_peer_out).view(b, peer_len, 2 * h_local, d)
    pst[:, :, r * h_local : (r + 1) * h_local].copy_(
        x.narrow(1, off[1 - r], peer_len), non_blocking=True
    )
    IPC_A2A.signal()
    out = local[slot].narrow(0, 0, n_out).view(b, my_len, 2 * h_local, d)
    out[:, :, r * h_local : (r + 1) * h_local].copy_(x.narrow(1, off[r], my_len))
    IPC_A2A.wait()
    return out


def _ipc_input_a2a_qkv(q, k, v):
    """The three input A2As of one attention as a single IPC exchange;
    None when unavailable."""
    if get_ulysses_parallel_world_size() != 2:
        return None
    # One staging slot is sized from `q` and reused for all three, so unequal
    # k/v lengths would copy mismatched extents into it. The general exchange
    # guards the same way and handles them.
    if q.shape != k.shape or q.shape != v.shape:
        return None
    group = _ipc_ready_group()
    if group is None:
        return None
    from sglang.multimodal_gen.runtime.distributed.device_communicators.ipc_a2a import (
        IPC_A2A,
    )

    b, s_local, h_global, d = q.shape
    half = h_global // 2
    r = IPC_A2A.rank
    n = b * s_local * half * d
    pair = IPC_A2A.get_staging(3 * n, 3 * n, q.dtype, group)
    if pair is None:
        return None
    local, peer = pair
    slot = IPC_A2A.next_slot()
    outs = []
    for i, t in enumerate((q, k, v)):
        send = t[:, :, (1 - r) * half : (2 - r) * half].contiguous()
        peer[slot].narrow(0, i * n, n).copy_(send.view(-1), non_blocking=True)
        out = t.new_empty(b, 2 * s_local, half, d)
        out.narrow(1, r * s_local, s_local).copy_(t[:, :, r * half : (r + 1) * half])
        outs.append(out)
    IPC_A2A.signal_and_wait()
    for i, out in enumerate(outs):
        theirs = local[slot].narrow(0, i * n, n).view(b, s_local, half, d)
        out.narrow(1, (1 - r) * s_local, s_local).copy_(theirs)
    return tuple(outs)


def _ipc_input_a2a_qkv_segmented(txt_q, img_q, txt_k, img_k, txt_v, img_v, local_pad):
    """Joint-attention input A2A that reads the (txt, img) pair directly in
    join_seqs layout [txt_real | img | txt_pad], skipping the per-projection
    joint cats. The staging buffer IS the gathered q/k/v: each rank writes its
    own sequence span of the peer's slot; returns (q, k, v) staging views or
    None when unavailable."""
    if get_ulysses_parallel_world_size() != 2:
        return None
    group = _ipc_ready_group()
    if group is None:
        return None
    from sglang.multimodal_gen.runtime.distributed.device_communicators.ipc_a2a import (
        IPC_A2A,
    )

    b, txt_len, h_global, d = txt_q.shape
    img_len = img_q.shape[1]
    half = h_global // 2
    r = IPC_A2A.rank
    L = txt_len + img_len
    real = txt_len - local_pad
    n = b * 2 * L * half * d
    pair = IPC_A2A.get_staging(3 * n, 3 * n, txt_q.dtype, group)
    if pair is None:
        return None
    local, peer = pair
    slot = IPC_A2A.next_slot()
    ph = slice((1 - r) * half, (2 - r) * half)
    lh = slice(r * half, (r + 1) * half)
    base = r * L
    outs = []
    peer_dsts, peer_srcs = [], []
    loc_dsts, loc_srcs = [], []
    for i, (txt, img) in enumerate(((txt_q, img_q), (txt_k, img_k), (txt_v, img_v))):
        pst = peer[slot].narrow(0, i * n, n).view(b, 2 * L, half, d)
        pspan = pst[:, base : base + L]
        peer_dsts += [pspan[:, 0:real], pspan[:, real : real + img_len]]
        peer_srcs += [txt[:, 0:real, ph], img[:, :, ph]]
        if local_pad:
            peer_dsts.append(pspan[:, real + img_len :])
            peer_srcs.append(txt[:, real:, ph])
        out = local[slot].narrow(0, i * n, n).view(b, 2 * L, half, d)
        lspan = out[:, base : base + L]
        loc_dsts += [lspan[:, 0:real], lspan[:, real : real + img_len]]
        loc_srcs += [txt[:, 0:real, lh], img[:, :, lh]]
        if local_pad:
            loc_dsts.append(lspan[:, real + img_len :])
            loc_srcs.append(txt[:, real:, lh])
        outs.append(out)
    torch._foreach_copy_(peer_dsts, peer_srcs)
    # signal as soon as the peer's data is in flight; our local-half writes
    # overlap with the peer's wait
    IPC_A2A.signal()
    torch._foreach_copy_(loc_dsts, loc_srcs)
    IPC_A2A.wait()
    return tuple(outs)


def _usp_input_all_to_all(x: torch.Tensor, head_dim: int = 1) -> torch.Tensor:
    """
    Perform Ulysses-style input all-to-all over the head dimension.

    Default layout expects heads at dim=1 and sequence at dim=2:
        [b, h, s_local, d] -> [b, h_local, s_global, d]

    If heads are at dim=2 (input is [b, s_local, h, d]), set head_dim=2, and the
    function returns [b, s_global, h_local, d], preserving the original
    head/sequence dim ordering.

    Args:
        x: A 4D tensor with layout [b, *, *, d] where '*' are sequence and heads
        head_dim: Which dimension index corresponds to heads (1 or 2)

    Returns:
        Tensor with the same dim order as input, with heads sharded and sequence gathered.
    """
    world_size = get_ulysses_parallel_world_size()
    if world_size <= 1:
        return x

    if world_size == 2 and head_dim == 2:
        fast = _ipc_varlen_fast(x, [x.shape[1], x.shape[1]], 2, "input")
        if fast is not None:
            return fast

    assert x.ndim == 4, f"x must have 4 dimensions, got {x.ndim}"
    assert head_dim in (1, 2), f"head_dim must be 1 or 2, got {head_dim}"

    # Move the dimension to be split (h_global) to dim 0 for all_to_all_single
    if head_dim == 1:
        b, h_global, s_local, d = x.shape
        # Shape transition: [b, h_global, s_local, d] -> [h_global, b, s_local, d]
        permute_order = (1, 0, 2, 3)
    else:  # head_dim == 2
        b, s_local, h_global, d = x.shape
        # Shape transition: [b, s_local, h_global, d] -> [h_global, b, s_local, d]
        permute_order = (2, 0, 1, 3)

    assert h_global % world_size == 0, (
        f"h_global ({h_global}) must be divisible by world_size ({world_size})"
    )

    h_local, s_global = h_global // world_size, s_local * world_size

    x = x.permute(permute_order).contiguous()
    x = _usp_all_to_all_single(x, role="usp_input")
    x = x.reshape(world_size, h_local, b, s_local, d)

    # Reorder dims to place 'world_size' adjacent to 's_local' to merge them into 's_global'
    if head_dim == 1:
        # Shape transition: [world_size, h_local, b, s_local, d] -> [b, h_local, world_size, s_local, d]
        x = x.permute(2, 1, 0, 3, 4).contiguous().reshape(b, h_local, s_global, d)
    else:  # head_dim == 2
        # Shape transition: [world_size, h_local, b, s_local, d] -> [b, world_size, s_local, h_local, d]
        x = x.permute(2, 0, 3, 1, 4).contiguous().reshape(b, s_global, h_local, d)

    return x


def _usp_input_all_to_all_packed_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exchange 3D Q/K/V with one destination-major Ulysses collective."""
    world_size = get_ulysses_parallel_world_size()
    if world_size <= 1:
        return q, k, v

    assert q.ndim == 3 and q.shape == k.shape == v.shape
    s_local, h_global, head_size = q.shape
    assert h_global % world_size == 0
    h_local = h_global // world_size

    if (
        q.device.type in _A2A_DEVICE_TYPES
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.dtype == k.dtype == v.dtype
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and not torch.compiler.is_compiling()
    ):
        packed = pack_qkv_destination_major(
            q,
            k,
            v,
            world_size,
            out=_a2a_staging_buffer(
                "usp_packed_qkv_src",
                (world_size, s_local, h_local, 3 * head_size),
                q.dtype,
                q.device,
            ),
        )
    else:
        packed = torch.empty(
            (world_size, s_local, h_local, 3 * head_size),
            dtype=q.dtype,
            device=q.device,
        )
        for index, tensor in enumerate((q, k, v)):
            head_shards = tensor.view(s_local, world_size, h_local, head_size).permute(
                1, 0, 2, 3
            )
            packed[..., index * head_size : (index + 1) * head_size].copy_(head_shards)

    packed = _usp_all_to_all_single(packed, role="usp_packed_qkv_recv")
    packed = packed.reshape(s_local * world_size, h_local, 3 * head_size)
    q, k, v = packed.split(head_size, dim=-1)
    return q, k, v


def _packed_qkv_row_view_is_free(x: torch.Tensor) -> bool:
    """True when ``x.view(b * s_local, h, d)`` costs no copy.

    The pack kernel reads q/k/v through explicit row/head strides, so only the
    head_size dim has to be unit-stride; full contiguity is not required. The
    batch and sequence dims still have to merge into one, which is free when
    batch is 1 or when the two dims are already adjacent in memory.
    """
    batch, seq_local = x.shape[0], x.shape[1]
    return x.stride(-1) == 1 and (batch == 1 or x.stride(0) == seq_local * x.stride(1))


def _can_use_packed_qkv_a2a_4d(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int
) -> bool:
    return (
        q.device.type in _A2A_DEVICE_TYPES
        and q.ndim == 4
        and q.shape == k.shape == v.shape
        and q.dtype == k.dtype == v.dtype
        and q.dtype in (torch.float16, torch.bfloat16)
        and _packed_qkv_row_view_is_free(q)
        and _packed_qkv_row_view_is_free(k)
        and _packed_qkv_row_view_is_free(v)
        and q.shape[2] % world_size == 0
        and not torch.compiler.is_compiling()
    )


def _usp_input_all_to_all_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ulysses input exchange for Q/K/V with heads at dim=2.

    [b, s_local, h, d] x3 -> [b, s_global, h_local, d] x3. Q/K/V are packed
    destination-major by one relayout kernel and exchanged in a single
    collective instead of three; only data movement changes, so the result is
    bit-identical to the unpacked path, which stays as the fallback for
    ineligible inputs (CPU, GQA-mismatched shapes, layouts whose row view
    would copy).
    Adapted from the NVlabs Sana sol-engine branch (Apache-2.0).
    """
    world_size = get_ulysses_parallel_world_size()
    if world_size <= 1:
        return q, k, v
    if not _can_use_packed_qkv_a2a_4d(q, k, v, world_size):
        return (
            _usp_input_all_to_all(q, head_dim=2),
            _usp_input_all_to_all(k, head_dim=2),
            _usp_input_all_to_all(v, head_dim=2),
        )

    b, s_local, h_global, d = q.shape
    h_local = h_global // world_size
    rows = b * s_local
    packed = pack_qkv_destination_major(
        q.view(rows, h_global, d),
        k.view(rows, h_global, d),
        v.view(rows, h_global, d),
        world_size,
        out=_a2a_staging_buffer(
            "usp_packed_qkv_src", (world_size, rows, h_local, 3 * d), q.dtype, q.device
        ),
    )
    packed = _usp_all_to_all_single(packed, role="usp_packed_qkv_recv")
    if b == 1:
        # Received chunks are already sequence-major: rank j's rows arrive at
        # offset j * s_local, so flattening the leading dims is a free view.
        packed = packed.view(1, world_size * s_local, h_local, 3 * d)
    else:
        packed = (
            packed.view(world_size, b, s_local, h_local, 3 * d)
            .permute(1, 0, 2, 3, 4)
            .contiguous()
            .view(b, world_size * s_local, h_local, 3 * d)
        )
    q, k, v = packed.split(d, dim=-1)
    # Copy out before the staging buffer is recycled by the next collective.
    return q.contiguous(), k.contiguous(), v.contiguous()


def _usp_input_all_to_all_varlen(
    x: torch.Tensor, seq_lens: list[int], head_dim: int = 1
) -> torch.Tensor:
    """
    Perform Ulysses-style input all-to-all over the head dimension with variable
    local sequence lengths.

    Default layout expects heads at dim=1 and sequence at dim=2:
        [b, h, s_local, d] -> [b, h_local, s_global, d]

    If heads are at dim=2 (input is [b, s_local, h, d]), set head_dim=2, and the
    function returns [b, s_global, h_local, d], preserving the original
    head/sequence dim ordering.

    Args:
        x: A 4D tensor with layout [b, *, *, d] where '*' are sequence and heads
        seq_lens: Local sequence lengths for each rank in the Ulysses group
        head_dim: Which dimension index corresponds to heads (1 or 2)

    Returns:
        Tensor with the same dim order as input, with heads sharded and sequence gathered.
    """
    world_size = get_ulysses_parallel_world_size()
    if world_size <= 1:
        return x

    if world_size == 2:
        fast = _ipc_varlen_fast(x, seq_lens, head_dim, "input")
        if fast is not None:
            return fast

    assert x.ndim == 4, f"x must have 4 dimensions, got {x.ndim}"
    assert head_dim in (1, 2), f"head_dim must be 1 or 2, got {head_dim}"
    assert len(seq_lens) == world_size, (
        f"seq_lens must have length {world_size}, got {len(seq_lens)}"
    )

    rank = get_ulysses_parallel_rank()

    # Move the dimension to be split (h_global) to dim 0 for all_to_all_single
    if head_dim == 1:
        b, h_global, s_local, d = x.shape
        # Shape transition: [b, h_global, s_local, d] -> [h_global, b, s_local, d]
        permute_order = (1, 0, 2, 3)
    else:  # head_dim == 2
        b, s_local, h_global, d = x.shape
        # Shape transition: [b, s_local, h_global, d] -> [h_global, b, s_local, d]
        permute_order = (2, 0, 1, 3)

    assert s_local == seq_lens[rank], (
        f"s_local ({s_local}) must equal seq_lens[{rank}] ({seq_lens[rank]})"
    )
    assert h_global % world_size == 0, (
        f"h_global ({h_global}) must be divisible by world_size ({world_size})"
    )

    h_local = h_global // world_size

    x = x.permute(permute_order).contiguous()
    x = x.reshape(world_size, h_local, b, s_local, d)
    input_split_sizes = [h_local * b * s_local * d] * world_size
    output_split_sizes = [h_local * b * seq_len * d for seq_len in seq_lens]
    x = _usp_all_to_all_single_varlen(x, output_split_sizes, input_split_sizes)

    chunks = []
    offset = 0
    for seq_len, split_size in zip(seq_lens, output_split_sizes):
        chunk = x[offset : offset + split_size].reshape(h_local, b, seq_len, d)
        chunks.append(chunk)
        offset += split_size
    x = torch.cat(chunks, dim=2)

    if head_dim == 1:
        # Shape transition: [h_local, b, s_global, d] -> [b, h_local, s_global, d]
        x = x.permute(1, 0, 2, 3).contiguous()
    else:  # head_dim == 2
        # Shape transition: [h_local, b, s_global, d] -> [b, s_global, h_local, d]
        x = x.permute(1, 2, 0, 3).contiguous()

    return x


def _usp_output_all_to_all(x: torch.Tensor, head_dim: int = 1) -> torch.Tensor:
    """
    Perform Ulysses-style output all-to-all over the head dimension (inverse of input).

    Default layout expects heads at dim=1 and sequence at dim=2:
        [b, h_local, s, d] -> [b, h, s_local, d]

    If heads are at dim=2 (input is [b, s_global, h // world_size, d]), set head_dim=2,
    and the function returns [b, s_local, h, d], preserving the original head/sequence
    dim ordering.

    Args:
        x: A 4D tensor with layout [b, *, *, d] where '*' are sequence and heads
        head_dim: Which dimension index corresponds to heads (1 or 2)

    Returns:
        Tensor with the same dim order as input, with heads gathered and sequence sharded.
    """
    world_size = get_ulysses_parallel_world_size()
    if world_size <= 1:
        return x

    if world_size == 2 and head_dim == 2 and x.shape[1] % 2 == 0:
        half_len = x.shape[1] // 2
        fast = _ipc_varlen_fast(x, [half_len, half_len], 2, "output")
        if fast is not None:
            return fast

    assert x.ndim == 4, f"x must have 4 dimensions, got {x.ndim}"
    assert head_dim in (1, 2), f"head_dim must be 1 or 2, got {head_dim}"

    # Move the dimension to be split (s_global) to dim 0 for all_to_all_single
    if head_dim == 1:
        b, h_local, s_global, d = x.shape
        # Shape transition: [b, h_local, s_global, d] -> [s_global, b, h_local, d]
        permute_order = (2, 0, 1, 3)
    else:  # head_dim == 2
        b, s_global, h_local, d = x.shape
        # Shape transition: [b, s_global, h_local, d] -> [s_global, b, h_local, d]
        permute_order = (1, 0, 2, 3)

    assert s_global % world_size == 0, (
        f"s_global ({s_global}) must be divisible by world_size ({world_size})"
    )

    s_local, h_global = s_global // world_size, h_local * world_size

    x = x.permute(permute_order).contiguous()
    x = _usp_all_to_all_single(x, role="usp_output")
    x = x.reshape(world_size, s_local, b, h_local, d)

    # Reorder dims to place 'world_size' adjacent to 'h_local' to merge them into 'h_global'
    if head_dim == 1:
        # Shape transition: [world_size, s_local, b, h_local, d] -> [b, world_size, h_local, s_local, d]
        x = x.permute(2, 0, 3, 1, 4).contiguous().reshape(b, h_global, s_local, d)
    else:  # head_dim == 2
        # Shape transition: [world_size, s_local, b, h_local, d] -> [b, s_local, world_size, h_local, d]
        x = usp_merge_heads(x).reshape(b, s_local, h_global, d)

    return x


def _usp_output_all_to_all_varlen(
    x: torch.Tensor, seq_lens: list[int], head_dim: int = 1
) -> torch.Tensor:
    """
    Perform Ulysses-style output all-to-all over the head dimension (inverse of input)
    with variable local sequence lengths.

    Default layout expects heads at dim=1 and sequence at dim=2:
        [b, h_local, s, d] -> [b, h, s_local, d]

    If heads are at dim=2 (input is [b, s_global, h // world_size, d]), set head_dim=2,
    and the function returns [b, s_local, h, d], preserving the original head/sequence
    dim ordering.

    Args:
        x: A 4D tensor with layout [b, *, *, d] where '*' are sequence and heads
        seq_lens: Local sequence lengths for each rank in the Ulysses group
        head_dim: Which dimension index corresponds to heads (1 or 2)

    Returns:
        Tensor with the same dim order as input, with heads gathered and sequence sharded.
    """
    world_size = get_ulysses_parallel_world_size()
    if world_size <= 1:
        return x

    if world_size == 2:
        fast = _ipc_varlen_fast(x, seq_lens, head_dim, "output")
        if fast is not None:
            return fast

    assert x.ndim == 4, f"x must have 4 dimensions, got {x.ndim}"
    assert head_dim in (1, 2), f"head_dim must be 1 or 2, got {head_dim}"
    assert len(seq_lens) == world_size, (
        f"seq_lens must have length {world_size}, got {len(seq_lens)}"
    )

    rank = get_ulysses_parallel_rank()

    # Move the sequence dimension to dim 2 for splitting across seq_lens
    if head_dim == 1:
        b, h_local, s_global, d = x.shape
        # Shape transition: [b, h_local, s_global, d] -> [h_local, b, s_global, d]
        permute_order = (1, 0, 2, 3)
    else:  # head_dim == 2
        b, s_global, h_local, d = x.shape
        # Shape transition: [b, s_global, h_local, d] -> [h_local, b, s_global, d]
        permute_order = (2, 0, 1, 3)

    assert s_global == sum(seq_lens), (
        f"s_global ({s_global}) must equal sum(seq_lens) ({sum(seq_lens)})"
    )

    s_local = seq_lens[rank]

    x = x.permute(permute_order).contiguous()
    input_chunks = []
    start = 0
    for seq_len in seq_lens:
        end = start + seq_len
        input_chunks.append(x[:, :, start:end, :].contiguous().reshape(-1))
        start = end
    x = torch.cat(input_chunks, dim=0)
    input_split_sizes = [h_local * b * seq_len * d for seq_len in seq_lens]
    output_split_sizes = [h_local * b * s_local * d] * world_size
    x = _usp_all_to_all_single_varlen(x, output_split_sizes, input_split_sizes)

    chunks = []
    offset = 0
    for split_size in output_split_sizes:
        chunk = x[offset : offset + split_size].reshape(h_local, b, s_local, d)
        chunks.append(chunk)
        offset += split_size
    x = torch.cat(chunks, dim=0)

    if head_dim == 1:
        # Shape transition: [h_global, b, s_local, d] -> [b, h_global, s_local, d]
        x = x.permute(1, 0, 2, 3).contiguous()
    else:  # head_dim == 2
        # Shape transition: [h_global, b, s_local, d] -> [b, s_local, h_global, d]
        x = x.permute(1, 2, 0, 3).contiguous()

    return x


def ring_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_impl: "AttentionImpl",
    is_causal: bool = False,
    dropout_p: float = 0.0,
    return_softmax_lse: bool = False,
):
    """
    Ring Attention implementation.

    This function implements Ring Attention, a strategy for distributed attention
    computation that reduces peak memory usage. It accepts a generic attention
    implementation (`attn_impl`) which is called by the underlying PyTorch
    distributed attention primitive.

    Args:
        query, key, value: The input tensors for attention.
        attn_impl: An instance of an attention implementation backend
                   (e.g., FlashAttentionImpl) whose `forward` method will be
                   used as the computational kernel.
        is_causal: Whether to apply causal masking.
        dropout_p: Dropout probability.
    """
    # torch.distributed.tensor.experimental._attention is not a public API,
    from torch.distributed.tensor.experimental._attention import (
        _templated_ring_attention,
    )

    ring_pg = get_sp_group().ring_group
    assert ring_pg is not None, "Ring process group is not initialized."

    # Ring attention primitives expect tensors in [B, H, S, D] layout.
    # We permute the inputs here.
    query = torch.permute(query, [0, 2, 1, 3]).contiguous()
    key = torch.permute(key, [0, 2, 1, 3]).contiguous()
    value = torch.permute(value, [0, 2, 1, 3]).contiguous()

    # Create an adapter function that matches the signature expected by
    # _templated_ring_attention. The `attn_impl` already has dropout and
    # causal settings configured during its initialization.

    # Note: Please be aware that Attention Backend and Ring Attention may require different QKV tensor shapes.
    # For example, FlashAttention expects the format to be BSHD.
    def attn_callable_adapter(q, k, v, *args, **kwargs):
        # We ignore the dropout_p and is_causal passed by _templated_ring_attention
        # and rely on the pre-configured attn_impl.
        # The `attn_metadata` is not available here, so we pass None.
        # This is a limitation we must accept when using this experimental API.
        q = torch.permute(q, [0, 2, 1, 3])
        k = torch.permute(k, [0, 2, 1, 3])
        v = torch.permute(v, [0, 2, 1, 3])
        # logger.warning(f"Warning: return_softmax_lse is only supported for FlashAttentionImpl")
        output, softmax_lse, *rest = attn_impl.forward(
            q,
            k,
            v,
            attn_metadata=None,
            return_softmax_lse=True,
        )
        output = torch.permute(output, [0, 2, 1, 3])
        return output, softmax_lse, *rest

    # Starting from torch 2.6.0, _templated_ring_attention expects an integer
    # segment_id for the attention function.
    use_segment_id = torch_release >= (2, 6)

    attn_kwargs = dict(
        op=attn_callable_adapter,
        dropout_p=dropout_p,
        is_causal=is_causal,
        query=query,
        key=key,
        value=value,
        group=ring_pg,  # https://github.com/pytorch/pytorch/blob/c907c778f42ba2fdaf25b733dd25baf9779c6a12/torch/distributed/tensor/experimental/_context_parallel/_attention.py#L309
    )

    if use_segment_id:
        # For torch >= 2.6, segment_id is required. The value '1' is a placeholder
        # as we are not using complex segmentation features.
        out, lse, *_ = _templated_ring_attention(
            seq_dim=1,  # segment_id
            **attn_kwargs,
        )
    else:
        out, lse, *_ = _templated_ring_attention(
            **attn_kwargs,
        )

    # Permute the output back to [B, S, H, D] layout.
    output = torch.permute(out, [0, 2, 1, 3])
    if return_softmax_lse:
        return output, lse
    return output


def _merge_attention_partials(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> torch.Tensor:
    """Merge two attention partials computed over disjoint KV sets.

    `out_*` are `[B, S, H, D]`; `lse_*` are the dense-FA LSE layout `[B, H, S]`.
    Each partial is self-normalized over its own KV, so the exact combine is a
    two-term logsumexp reweighting; done in fp32 for stability.
    """
    lse_a = lse_a.transpose(1, 2).unsqueeze(-1).to(torch.float32)
    lse_b = lse_b.transpose(1, 2).unsqueeze(-1).to(torch.float32)
    new_lse = torch.logaddexp(lse_a, lse_b)
    return out_a.to(torch.float32) * torch.exp(lse_a - new_lse) + out_b.to(
        torch.float32
    ) * torch.exp(lse_b - new_lse)


def _ring_merge_attention(
    out_acc: torch.Tensor | None,
    lse_acc: torch.Tensor | None,
    step_out: torch.Tensor,
    step_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax combine of one more ring step's partial attention.

    `step_out` is `[T, H, D]` or `[B, T, H, D]`; `step_lse` is
    `[H, T]` or `[B, H, T]`. Both are already self-normalized over their own KV
    chunk, so combining chunks is the standard two-term logsumexp merge
    (exact up to float rounding); done in fp32 for stability.
    """
    step_lse = step_lse.transpose(-2, -1).unsqueeze(-1).to(torch.float32)
    step_out = step_out.to(torch.float32)
    if out_acc is None:
        return step_out, step_lse
    new_lse = torch.logaddexp(lse_acc, step_lse)
    out_acc = out_acc * torch.exp(lse_acc - new_lse) + step_out * torch.exp(
        step_lse - new_lse
    )
    return out_acc, new_lse


def _ring_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_impl: "AttentionImpl",
    real_seq_len: int,
    ring_ws: int,
) -> torch.Tensor:
    """Ring-rotated varlen attention over one rank's local packed chunk.

    `q, k, v` are `[T, H, D]` or `[B, T, H, D]`, with equal lengths per batch.
    They contain this rank's full local ring chunk (`ring_chunk_len` rows,
    real rows followed by however many of this chunk's rows are padding).
    KV is P2P-rotated around the ring one hop per step (send this step's
    buffer to the next rank, receive the following step's buffer from the
    previous rank) so the hop for step+1 overlaps this step's attention
    compute -- unlike a single blocking all_gather, no step waits on the
    full ring's transfer before its own compute can start. Each hop's
    *real* prefix is attended locally and merged via online softmax.
    Padding rows never contribute to any KV chunk (their output is unused
    downstream, but must not be corrupted by attending across the padding
    boundary), and a chunk that is entirely padding is skipped outright.
    """
    ring_pg = get_sp_group().ring_group
    assert ring_pg is not None, "Ring process group is not initialized."
    ring_chunk_len = q.shape[-3]
    _, ring_rank = get_ring_ctx()

    # `isend`/`irecv` (unlike collectives) address peers by global rank even
    # under a sub-group, so resolve this ring's neighbors once up front.
    next_global_rank = torch.distributed.get_global_rank(
        ring_pg, (ring_rank + 1) % ring_ws
    )
    prev_global_rank = torch.distributed.get_global_rank(
        ring_pg, (ring_rank - 1) % ring_ws
    )

    # K and V travel as one stacked buffer so each hop is a single P2P
    # send/recv pair instead of two; stacking also makes the buffer
    # contiguous, so no separate .contiguous() call is needed.
    kv0 = torch.stack((k, v))
    kv_bufs = [kv0, torch.empty_like(kv0)]
    cur = 0

    out_acc: torch.Tensor | None = None
    lse_acc: torch.Tensor | None = None
    pending_ops = None
    for step in range(ring_ws):
        nxt = 1 - cur
        if step < ring_ws - 1:
            # kick off next hop before this step's compute so the transfer
            # overlaps it; wait for completion only after issuing compute.
            pending_ops = torch.distributed.batch_isend_irecv(
                [
                    torch.distributed.P2POp(
                        torch.distributed.isend,
                        kv_bufs[cur],
                        next_global_rank,
                        group=ring_pg,
                    ),
                    torch.distributed.P2POp(
                        torch.distributed.irecv,
                        kv_bufs[nxt],
                        prev_global_rank,
                        group=ring_pg,
                    ),
                ]
            )

        src_rank = (ring_rank - step) % ring_ws
        remote_used = min(
            max(real_seq_len - src_rank * ring_chunk_len, 0), ring_chunk_len
        )
        if remote_used > 0:
            key = kv_bufs[cur][0, ..., :remote_used, :, :]
            value = kv_bufs[cur][1, ..., :remote_used, :, :]
            if q.ndim == 3:
                step_out, step_lse = attn_impl.forward_ring_kv_chunk(q, key, value)
            else:
                step_out, step_lse, *_ = attn_impl.forward(
                    q, key, value, attn_metadata=None, return_softmax_lse=True
                )
            out_acc, lse_acc = _ring_merge_attention(
                out_acc, lse_acc, step_out, step_lse
            )

        if pending_ops is not None:
            for op in pending_ops:
                op.wait()
            pending_ops = None
            cur = nxt
    return out_acc.to(q.dtype)
