from __future__ import annotations

import logging
import os
import threading
from typing import Optional, Sequence

import numpy as np
import torch

from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.pool_host.base import (
    HostKVCache,
    host_memory_budget_bytes,
    sync_fixed_hicache_size,
    synchronized,
)
from sglang.srt.mem_cache.pool_host.common import (
    ALLOC_MEMORY_FUNCS,
    get_allocator_from_storage,
)
from sglang.srt.utils import is_cuda, is_hip, is_npu, is_xpu

_is_cuda = is_cuda()
_is_hip = is_hip()
_is_npu = is_npu()
_is_xpu = is_xpu()
transfer_state_per_layer_direct_pf_lf = None
transfer_state_all_layer_direct_lf_pf = None
transfer_mamba_state = None
if _is_cuda or _is_hip:
    from sgl_kernel.kvcacheio import (
        transfer_kv_all_layer_direct_lf_pf,
        transfer_kv_direct,
        transfer_kv_per_layer_direct_pf_lf,
        transfer_kv_per_layer_mla,
    )
if _is_cuda or _is_hip:
    from sglang.kernels.ops.mamba.transfer_mamba import (
        transfer_kv_mamba_lf_pf,
        transfer_kv_mamba_pf_lf,
    )
if _is_npu:
    from sgl_kernel_npu.kvcacheio import TransferDirection

    try:
        from sgl_kernel_npu.kvcacheio import transfer_mamba_state
    except ImportError:
        transfer_mamba_state = None
    try:
        from sgl_kernel_npu.kvcacheio import (
            transfer_state_all_layer_direct_lf_pf,
            transfer_state_per_layer_direct_pf_lf,
        )
    except ImportError:
        pass

logger = logging.getLogger(__name__)


_NPU_HICACHE_MAMBA_IO_ENV = "SGLANG_NPU_HICACHE_MAMBA_IO"
_NPU_HICACHE_MAMBA_IO_MODES = {"sync", "async"}


def _npu_hicache_mamba_io_mode() -> str:
    mode = os.getenv(_NPU_HICACHE_MAMBA_IO_ENV, "sync").strip().lower()
    if mode not in _NPU_HICACHE_MAMBA_IO_MODES:
        raise ValueError(
            f"{_NPU_HICACHE_MAMBA_IO_ENV} must be one of "
            f"{sorted(_NPU_HICACHE_MAMBA_IO_MODES)}, got {mode!r}."
        )
    return mode


class MambaPoolHost(HostKVCache):
    mtp_draft_buffer_infos: tuple[MambaStateBufferInfo, ...] = ()

    # Class-level defaults so a model without side state, and the test stubs that
    # skip __init__, still read an empty pair rather than raising.
    slot_state_device_tensors: tuple = ()
    slot_state_buffers: tuple = ()

    def __init__(
        self,
        buffer_info: MambaStateBufferInfo,
        host_to_device_ratio: float,
        host_size: int,
        *,
        device_capacity: int,
        pin_memory: bool = True,
        device: str = "cpu",
        allocator_type: str = "default",
        layout: str = "layer_first",
        mtp_draft_buffer_infos: Sequence[MambaStateBufferInfo] = (),
    ):
        buffer_info.validate()
        self.buffer_info = buffer_info
        self.device_pool = None
        self._buffer_device = buffer_info.temporal.device
        self.mtp_draft_buffer_infos = tuple(mtp_draft_buffer_infos)
        self.page_size = 1

        assert layout in [
            "page_first",
            "page_first_direct",
        ], f"Unsupported layout: {layout}"

        if _is_xpu:
            raise ValueError(
                "HiCache does not support hybrid Mamba models on XPU: the Mamba KV "
                "transfer kernels are JIT-built from CUDA source. "
                "Launch without HiCache host offload "
                "(--enable-hierarchical-cache, "
                "--disaggregation-decode-retraction-backup=host_pool)."
            )

        self.layout = layout
        self.pin_memory = pin_memory
        self.device = device
        self.allocator = get_allocator_from_storage(allocator_type)
        self.num_mamba_layers = buffer_info.temporal.shape[0] + len(
            self.mtp_draft_buffer_infos
        )

        buffer_infos = (buffer_info, *self.mtp_draft_buffer_infos)
        for draft_info in self.mtp_draft_buffer_infos:
            draft_info.validate()
            assert draft_info.temporal.shape[0] == 1
            assert len(draft_info.conv) == len(buffer_info.conv)
            for target, draft in zip(
                (*buffer_info.conv, buffer_info.temporal),
                (*draft_info.conv, draft_info.temporal),
                strict=True,
            ):
                assert target.shape[1:] == draft.shape[1:]
                assert target.dtype == draft.dtype
                assert target.device == draft.device

        self.temporal_device_layers = [
            layer for info in buffer_infos for layer in info.temporal.unbind(0)
        ]
        self.conv_device_layers = [
            [layer for info in buffer_infos for layer in info.conv[i].unbind(0)]
            for i in range(len(buffer_info.conv))
        ]

        self.conv_state_shapes = [
            conv_state.shape[2:] for conv_state in self.buffer_info.conv
        ]
        self.temporal_state_shape = self.buffer_info.temporal.shape[2:]
        self.temporal_state_elem_size = int(np.prod(self.temporal_state_shape))
        self.conv_state_elem_sizes = [
            int(np.prod(conv_shape)) for conv_shape in self.conv_state_shapes
        ]
        self.conv_dtype = self.buffer_info.conv[0].dtype
        self.temporal_dtype = self.buffer_info.temporal.dtype
        self.dtype = self.conv_dtype
        # Registered side states share the checkpoint slot with conv/temporal,
        # so a host round trip that skips them leaves the previous occupant's rows.
        self.slot_state_device_tensors = [
            buf for info in buffer_infos for buf in info.extra_checkpoint_buffers
        ]
        self.slot_state_buffers = []
        self.size_per_token = self.get_size_per_token()

        if host_size > 0:
            self.size = sync_fixed_hicache_size(
                int(host_size * 1e9 // self.size_per_token), host_size
            )
        else:
            self.size = int(device_capacity * host_to_device_ratio)

        self.page_num = self.size // self.page_size + 1
        self.size = self.page_num * self.page_size

        if self.size <= device_capacity:
            logger.warning(
                "HiCache host KV pool (%d tokens) is smaller than the device pool (%d tokens);"
                "L2 cache effectiveness is reduced."
                "Consider increasing --hicache-ratio (or --hicache-size) for higher L2 cache hit rate.",
                self.size,
                device_capacity,
            )

        requested_bytes = self.size * self.size_per_token
        available_bytes = host_memory_budget_bytes(requested_bytes)
        if requested_bytes > available_bytes:
            raise ValueError(
                f"Not enough host memory available. Requesting "
                f"{requested_bytes / 1e9:.2f} GB but only have "
                f"{available_bytes / 1e9:.2f} GB free. Please reduce the "
                f"size of the hierarchical cache."
            )
        logger.info(
            "Allocating %.2f GB host memory for hierarchical Mamba cache (%d state slots, layout=%s).",
            requested_bytes / 1e9,
            self.size,
            self.layout,
        )

        self.temporal_device_ptrs = torch.tensor(
            [layer.data_ptr() for layer in self.temporal_device_layers],
            dtype=torch.uint64,
            device=self._buffer_device,
        )
        self.conv_device_ptrs = [
            torch.tensor(
                [layer.data_ptr() for layer in layers],
                dtype=torch.uint64,
                device=self._buffer_device,
            )
            for layers in self.conv_device_layers
        ]

        self.kv_buffer = self.init_kv_buffer()
        self._configure_npu_mamba_io()
        self._init_write_back_staging_buffers()
        self.lock = threading.RLock()
        self.clear()

    def _configure_npu_mamba_io(self) -> None:
        mode = _npu_hicache_mamba_io_mode()
        if mode == "sync":
            logger.info("NPU HiCache Mamba state transfer mode: sync torch fallback.")
            return

        required_ops = (
            transfer_state_per_layer_direct_pf_lf,
            transfer_state_all_layer_direct_lf_pf,
        )
        required_torch_ops = (
            "transfer_state_per_layer_direct_pf_lf",
            "transfer_state_all_layer_direct_lf_pf",
        )
        if any(op is None for op in required_ops) or any(
            not hasattr(torch.ops.npu, op_name) for op_name in required_torch_ops
        ):
            raise RuntimeError(
                "NPU HiCache Mamba async state transfer requires "
                "the per-layer PF->LF and all-layer LF->PF direct operators "
                "from sgl-kernel-npu."
            )

        logger.info("NPU HiCache Mamba state transfer mode: native async.")

    def init_kv_buffer(self):
        _host_alloc = ALLOC_MEMORY_FUNCS[self._buffer_device.type]

        def alloc_func(dims, *, dtype, device, pin_memory, allocator):
            # conv-only linear attention has no ssm state: mmap can't map the
            # 0-element temporal buffer, so hand back a plain empty tensor.
            if np.prod(dims) == 0:
                return torch.empty(dims, dtype=dtype, device=device)
            return _host_alloc(
                dims,
                dtype=dtype,
                device=device,
                pin_memory=pin_memory,
                allocator=allocator,
                registration_granularity_bytes=(
                    int(np.prod(dims[1:])) * dtype.itemsize
                ),
            )

        if self.layout in ["page_first", "page_first_direct"]:
            # page-first: (page_num, num_layers, 1, *shape) — per-page data is contiguous
            temporal_dims = (
                self.size,
                self.num_mamba_layers,
                1,
            ) + self.temporal_state_shape
            self.temporal_buffer = alloc_func(
                temporal_dims,
                dtype=self.temporal_dtype,
                device=self.device,
                pin_memory=self.pin_memory,
                allocator=self.allocator,
            )
            self.conv_buffer = []
            for conv_shape in self.conv_state_shapes:
                conv_dims = (self.size, self.num_mamba_layers, 1) + conv_shape
                self.conv_buffer.append(
                    alloc_func(
                        conv_dims,
                        dtype=self.conv_dtype,
                        device=self.device,
                        pin_memory=self.pin_memory,
                        allocator=self.allocator,
                    )
                )
        else:
            # layer-first: (num_layers, size, *shape)
            temporal_dims = (
                self.num_mamba_layers,
                self.size,
            ) + self.temporal_state_shape
            self.temporal_buffer = alloc_func(
                temporal_dims,
                dtype=self.temporal_dtype,
                device=self.device,
                pin_memory=self.pin_memory,
                allocator=self.allocator,
            )
            self.conv_buffer = []
            for conv_shape in self.conv_state_shapes:
                conv_dims = (self.num_mamba_layers, self.size) + conv_shape
                self.conv_buffer.append(
                    alloc_func(
                        conv_dims,
                        dtype=self.conv_dtype,
                        device=self.device,
                        pin_memory=self.pin_memory,
                        allocator=self.allocator,
                    )
                )
        # Side state keeps its own dtype and its own slot axis (axis 0 of the
        # per-layer view the device pool yields).
        self.slot_state_buffers = [
            alloc_func(
                (self.size,) + tuple(state.shape[1:]),
                dtype=state.dtype,
                device=self.device,
                pin_memory=self.pin_memory,
                allocator=self.allocator,
            )
            for state in self.slot_state_device_tensors
        ]
        # destroy() unregisters via kv_buffer; without this list the pinned
        # registrations leak past the buffers' mmap. 0-element buffers
        # (conv-only models' temporal state) were never registered.
        return [
            buf
            for buf in (
                self.temporal_buffer,
                *self.conv_buffer,
                *self.slot_state_buffers,
            )
            if buf.numel() > 0
        ]

    def _init_write_back_staging_buffers(self):
        self.temporal_staging_buffer = None
        self.conv_staging_buffers = [None] * len(self.conv_buffer)
        # Must be True: HostPoolGroup computes can_use_write_back_jit as AND of
        # all pools. When True, start_writing() keeps indices on CPU, which MLA's
        # staged write-back kernel requires. MambaPoolHost's own backup path does
        # not check this flag — it routes by layout + io_backend instead.
        self.can_use_write_back_jit = True
        self._temporal_can_use_jit = False
        self._conv_can_use_jit = [False] * len(self.conv_buffer)

    def get_hybrid_pool_buffer(self):
        # Expose all mamba host tensors that need Mooncake buffer registration.
        return [self.temporal_buffer, *self.conv_buffer, *self.slot_state_buffers]

    def _iter_page_tensors(self, index: int):
        if self.layout in ["page_first", "page_first_direct"]:
            yield self.temporal_buffer[index]
            for conv_buf in self.conv_buffer:
                yield conv_buf[index]
        else:
            yield self.temporal_buffer[:, index : index + self.page_size]
            for conv_buf in self.conv_buffer:
                yield conv_buf[:, index : index + self.page_size]
        for state_buf in self.slot_state_buffers:
            yield state_buf[index : index + self.page_size]

    @staticmethod
    def _flatten_tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.contiguous().view(torch.uint8).reshape(-1)

    @synchronized
    def clear(self):
        self.mem_state = torch.zeros(
            (self.size,), dtype=torch.uint8, device=self.device
        )
        self.free_slots = torch.arange(self.size, dtype=torch.int64)
        self.release_slots = []
        self.num_release_slots = 0

    def available_size(self):
        return len(self.free_slots) + self.num_release_slots

    @synchronized
    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        assert need_size % self.page_size == 0, (
            "The requested size should be a multiple of the page size."
        )
        if need_size > self.available_size():
            return None

        if need_size > len(self.free_slots):
            self._merge_release_slots()

        select_index = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return select_index

    @synchronized
    def free(self, indices: torch.Tensor) -> int:
        indices_cpu = indices.cpu()
        if indices_cpu.numel() == 0:
            return 0

        self.release_slots.append(indices_cpu)
        self.num_release_slots += len(indices_cpu)
        return len(indices)

    def get_size_per_token(self):
        conv_total_size = sum(
            conv_elem_size * self.conv_dtype.itemsize
            for conv_elem_size in self.conv_state_elem_sizes
        )
        temporal_size = self.temporal_state_elem_size * self.temporal_dtype.itemsize
        # Side-state rows are per-slot, not per-layer: each entry is already a
        # single layer's view, so its own row size is added once.
        side_size = sum(
            state[0].numel() * state.element_size()
            for state in self.slot_state_device_tensors
        )
        return (conv_total_size + temporal_size) * self.num_mamba_layers + side_size

    def get_ksize_per_token(self):
        return self.get_size_per_token()

    @staticmethod
    def _item_size_per_index(tensor: torch.Tensor) -> int:
        if tensor.shape[0] == 0:
            return 0
        return int(tensor[0].numel() * tensor.element_size())

    @staticmethod
    def _slots_are_strided(tensor: torch.Tensor) -> bool:
        """Whether slot stride differs from the slot size transfer kernels expect."""
        return (
            tensor.dim() >= 1
            and tensor.shape[0] > 0
            and tensor.stride(0) != tensor[0].numel()
        )

    @staticmethod
    def _copy_tensor(
        src: torch.Tensor,
        dst: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        io_backend: str,
    ) -> None:
        if src_indices.numel() == 0:
            return
        # Unified conv/SSM views span a whole state envelope per slot. Stage
        # contiguously for transfer kernels; torch indexing respects the strides
        # and runs on the caller's transfer stream.
        if MambaPoolHost._slots_are_strided(src):
            staged = src.index_select(0, src_indices.to(src.device))
            MambaPoolHost._copy_tensor(
                staged,
                dst,
                torch.arange(staged.shape[0], device=staged.device),
                dst_indices,
                io_backend,
            )
            return
        if MambaPoolHost._slots_are_strided(dst):
            staged = torch.empty(
                (dst_indices.numel(), *dst.shape[1:]),
                dtype=dst.dtype,
                device=dst.device,
            )
            MambaPoolHost._copy_tensor(
                src,
                staged,
                src_indices,
                torch.arange(staged.shape[0], device=staged.device),
                io_backend,
            )
            dst.index_copy_(0, dst_indices.to(dst.device), staged)
            return
        if io_backend == "kernel":
            # TODO: Rename the interface for clarity.
            # Here, transfer_kv_per_layer_mla is reused to transfer the Mamba state.
            # This has nothing to do with MLA; it's only reused because this interface happens to transfer a single Pool.
            transfer_kv_per_layer_mla(
                src=src,
                dst=dst,
                src_indices=src_indices,
                dst_indices=dst_indices,
                item_size=MambaPoolHost._item_size_per_index(src),
            )
        elif io_backend == "direct":
            transfer_kv_direct(
                src_layers=[src],
                dst_layers=[dst],
                src_indices=src_indices,
                dst_indices=dst_indices,
                page_size=1,
            )
        elif io_backend == "kernel_ascend":
            # Per-layer indexed copy: this method transfers a single layer
            # (layer_first layout). The all-layer kernel path is handled by
            # _copy_tensor_all_layers_lf_pf / load_to_device_per_layer.
            dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(
                dst.device
            )
        else:
            raise ValueError(f"Unsupported io_backend: {io_backend}")

    @staticmethod
    def _copy_tensor_pf_lf(
        src: torch.Tensor,
        dst: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        layer_id: int,
        num_layers: int,
        io_backend: str,
    ) -> None:
        if src_indices.numel() == 0:
            return
        if MambaPoolHost._slots_are_strided(dst):
            # Transfer into contiguous staging, then scatter into the strided view.
            staged = torch.empty(
                (dst_indices.numel(), *dst.shape[1:]),
                dtype=dst.dtype,
                device=dst.device,
            )
            MambaPoolHost._copy_tensor_pf_lf(
                src,
                staged,
                src_indices,
                torch.arange(staged.shape[0], device=staged.device),
                layer_id,
                num_layers,
                io_backend,
            )
            dst.index_copy_(0, dst_indices.to(dst.device), staged)
            return
        if io_backend == "kernel":
            item_size = MambaPoolHost._item_size_per_index(dst)
            # Mamba JIT kernel expects all index tensors on CUDA.
            # host_indices may be on CPU (kept there by start_writing when
            # can_use_write_back_jit is True on the HostPoolGroup).
            if src_indices.device.type != "cuda":
                src_indices = src_indices.to(dst_indices.device, non_blocking=True)
            transfer_kv_mamba_pf_lf(
                src=src,
                dst=dst,
                src_indices=src_indices,
                dst_indices=dst_indices,
                layer_id=layer_id,
                item_size=item_size,
                src_layout_dim=item_size * num_layers,
            )
        elif io_backend == "direct":
            transfer_kv_per_layer_direct_pf_lf(
                src_ptrs=[src],
                dst_ptrs=[dst],
                src_indices=src_indices,
                dst_indices=dst_indices,
                layer_id=layer_id,
                page_size=1,
            )
        elif io_backend == "kernel_ascend":
            if _npu_hicache_mamba_io_mode() == "async":
                transfer_state_per_layer_direct_pf_lf(
                    src=src,
                    dst=dst,
                    src_indices=src_indices,
                    dst_indices=dst_indices,
                    layer_id=layer_id,
                )
            else:
                host_indices = src_indices.to(dtype=torch.int64, device=src.device)
                device_indices = dst_indices.to(dtype=torch.int64, device=dst.device)
                values = (
                    src.select(1, layer_id).index_select(0, host_indices).select(1, 0)
                )
                dst.index_copy_(0, device_indices, values.to(device=dst.device))
        else:
            raise ValueError(f"Unsupported io_backend: {io_backend}")

    @staticmethod
    def _copy_tensor_all_layers_lf_pf(
        src_layers: torch.Tensor | Sequence[torch.Tensor],
        dst: torch.Tensor,
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        num_layers: int,
        io_backend: str,
        src_ptrs: torch.Tensor,
        staging: Optional[torch.Tensor] = None,
        can_use_jit: bool = False,
    ) -> None:
        if src_indices.numel() == 0:
            return
        if MambaPoolHost._slots_are_strided(src_layers[0]):
            # Stage contiguous slots per layer and pass the staging buffer's pointers.
            staged = torch.stack(
                [
                    src_layers[i].index_select(0, src_indices.to(src_layers.device))
                    for i in range(num_layers)
                ]
            )
            staged_ptrs = torch.tensor(
                [staged[i].data_ptr() for i in range(num_layers)],
                dtype=torch.uint64,
                device=staged.device,
            )
            MambaPoolHost._copy_tensor_all_layers_lf_pf(
                staged,
                dst,
                torch.arange(staged.shape[1], device=staged.device),
                dst_indices,
                num_layers,
                io_backend,
                staged_ptrs,
                staging=staging,
                can_use_jit=can_use_jit,
            )
            return
        if io_backend == "kernel":
            item_size = MambaPoolHost._item_size_per_index(src_layers[0])
            transfer_kv_mamba_lf_pf(
                src_ptrs=src_ptrs,
                dst=dst,
                src_indices=src_indices,
                dst_indices=dst_indices,
                item_size=item_size,
                dst_layout_dim=item_size * num_layers,
                num_layers=num_layers,
            )
        elif io_backend == "direct":
            src_ptrs = [src_layers[i] for i in range(num_layers)]
            transfer_kv_all_layer_direct_lf_pf(
                src_ptrs=src_ptrs,
                dst_ptrs=[dst],
                src_indices=src_indices,
                dst_indices=dst_indices,
                page_size=1,
            )
        elif io_backend == "kernel_ascend":
            if not isinstance(src_layers, torch.Tensor):
                # Packed drafts live in separate allocations; the NPU bulk
                # kernels require a single contiguous layer-first tensor.
                host_indices = dst_indices.to(dtype=torch.int64, device=dst.device)
                for layer_id, src in enumerate(src_layers):
                    device_indices = src_indices.to(
                        dtype=torch.int64, device=src.device
                    )
                    values = src.index_select(0, device_indices).to(device=dst.device)
                    dst[:, layer_id, 0].index_copy_(0, host_indices, values)
            elif _npu_hicache_mamba_io_mode() == "async":
                transfer_state_all_layer_direct_lf_pf(
                    device_states=[src_layers],
                    host_states=[dst],
                    device_indices=src_indices,
                    host_indices=dst_indices,
                )
            elif transfer_mamba_state is not None:
                # NPU: mirror the load path — the dedicated kernel transfers all
                # layers at once via a single 2D strided copy
                # (device layer-first -> host page-first).
                transfer_mamba_state(
                    device_buf=src_layers,
                    host_buf=dst,
                    device_indices=src_indices,
                    host_indices=dst_indices,
                    direction=TransferDirection.D2H,
                )
            else:
                # Per-layer fallback when the dedicated kernel is unavailable.
                device_indices = src_indices.to(
                    dtype=torch.int64, device=src_layers.device
                )
                host_indices = dst_indices.to(dtype=torch.int64, device=dst.device)
                values = (
                    src_layers.index_select(1, device_indices)
                    .movedim(0, 1)
                    .unsqueeze(2)
                    .contiguous()
                    .to(device=dst.device)
                )
                dst.index_copy_(0, host_indices, values)
        else:
            raise ValueError(f"Unsupported io_backend: {io_backend}")

    def load_to_device_per_layer(
        self,
        device_pool,
        host_indices,
        device_indices,
        layer_id,
        io_backend="kernel",
        *,
        is_draft: bool = False,
    ):
        temporal_layers = (
            self.temporal_device_layers
            if self.mtp_draft_buffer_infos
            else self.buffer_info.temporal
        )
        conv_layers = (
            self.conv_device_layers
            if self.mtp_draft_buffer_infos
            else self.buffer_info.conv
        )

        # Side state is not per-layer, so it rides on the first layer's call --
        # before that layer's completion event, which is what every reader of a
        # restored slot waits on.
        if layer_id == 0:
            self._transfer_slot_states(host_indices, device_indices, to_device=True)
        if self.layout in ["page_first", "page_first_direct"]:
            if (
                io_backend == "kernel_ascend"
                and transfer_mamba_state is not None
                and not self.mtp_draft_buffer_infos
            ):
                # NPU: transfer all layers at once via dedicated kernel.
                # layer_id == 0 covers every layer, so later calls must skip.
                if layer_id == 0:
                    # no ssm state on conv-only models: a 0-size batched
                    # transfer errors, same guard as the per-layer path below
                    if self.temporal_state_elem_size > 0:
                        transfer_mamba_state(
                            device_buf=self.buffer_info.temporal,
                            host_buf=self.temporal_buffer,
                            device_indices=device_indices,
                            host_indices=host_indices,
                            direction=TransferDirection.H2D,
                        )
                    for conv_idx in range(len(self.conv_state_shapes)):
                        transfer_mamba_state(
                            device_buf=self.buffer_info.conv[conv_idx],
                            host_buf=self.conv_buffer[conv_idx],
                            device_indices=device_indices,
                            host_indices=host_indices,
                            direction=TransferDirection.H2D,
                        )
            else:
                # no ssm state on conv-only models: nothing to transfer
                if self.temporal_state_elem_size > 0:
                    self._copy_tensor_pf_lf(
                        src=self.temporal_buffer,
                        dst=temporal_layers[layer_id],
                        src_indices=host_indices,
                        dst_indices=device_indices,
                        layer_id=layer_id,
                        num_layers=self.num_mamba_layers,
                        io_backend=io_backend,
                    )
                for conv_idx in range(len(self.conv_state_shapes)):
                    self._copy_tensor_pf_lf(
                        src=self.conv_buffer[conv_idx],
                        dst=conv_layers[conv_idx][layer_id],
                        src_indices=host_indices,
                        dst_indices=device_indices,
                        layer_id=layer_id,
                        num_layers=self.num_mamba_layers,
                        io_backend=io_backend,
                    )
        else:
            self._copy_tensor(
                self.temporal_buffer[layer_id],
                temporal_layers[layer_id],
                host_indices,
                device_indices,
                io_backend,
            )
            for conv_idx in range(len(self.conv_state_shapes)):
                self._copy_tensor(
                    self.conv_buffer[conv_idx][layer_id],
                    conv_layers[conv_idx][layer_id],
                    host_indices,
                    device_indices,
                    io_backend,
                )

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend="kernel"
    ):
        temporal_layers = (
            self.temporal_device_layers
            if self.mtp_draft_buffer_infos
            else self.buffer_info.temporal
        )
        conv_layers = (
            self.conv_device_layers
            if self.mtp_draft_buffer_infos
            else self.buffer_info.conv
        )
        if self.layout in ["page_first", "page_first_direct"]:
            if io_backend == "kernel" and host_indices.device != device_indices.device:
                # The mamba JIT kernel wants both index tensors on the device;
                # the staged MHA/MLA write path hands us CPU host indices.
                # Convert once here rather than per conv/temporal tensor.
                host_indices = host_indices.to(device_indices.device, non_blocking=True)
            # no ssm state on conv-only models: a 0-size batched memcpy errors
            if self.temporal_state_elem_size > 0:
                self._copy_tensor_all_layers_lf_pf(
                    src_layers=temporal_layers,
                    dst=self.temporal_buffer,
                    src_indices=device_indices,
                    dst_indices=host_indices,
                    num_layers=self.num_mamba_layers,
                    io_backend=io_backend,
                    staging=self.temporal_staging_buffer,
                    can_use_jit=self._temporal_can_use_jit,
                    src_ptrs=self.temporal_device_ptrs,
                )
            for conv_idx in range(len(self.conv_state_shapes)):
                self._copy_tensor_all_layers_lf_pf(
                    src_layers=conv_layers[conv_idx],
                    dst=self.conv_buffer[conv_idx],
                    src_indices=device_indices,
                    dst_indices=host_indices,
                    num_layers=self.num_mamba_layers,
                    io_backend=io_backend,
                    staging=self.conv_staging_buffers[conv_idx],
                    can_use_jit=self._conv_can_use_jit[conv_idx],
                    src_ptrs=self.conv_device_ptrs[conv_idx],
                )
        else:
            for layer_id in range(self.num_mamba_layers):
                self._copy_tensor(
                    temporal_layers[layer_id],
                    self.temporal_buffer[layer_id],
                    device_indices,
                    host_indices,
                    io_backend,
                )
                for conv_idx in range(len(self.conv_state_shapes)):
                    self._copy_tensor(
                        conv_layers[conv_idx][layer_id],
                        self.conv_buffer[conv_idx][layer_id],
                        device_indices,
                        host_indices,
                        io_backend,
                    )
        self._transfer_slot_states(host_indices, device_indices, to_device=False)

    def _transfer_slot_states(self, host_indices, device_indices, *, to_device):
        """Copy the registered side-state rows for these slots, one leg or the
        other. Blocking copies: the rows are a few hundred KB per checkpoint and
        correctness of the ordering against the completion event matters more
        than the microseconds."""
        if not self.slot_state_device_tensors:
            return
        for state, host_buf in zip(
            self.slot_state_device_tensors, self.slot_state_buffers
        ):
            dev_idx = device_indices.reshape(-1).to(
                device=state.device, dtype=torch.long
            )
            host_idx = host_indices.reshape(-1).to(
                device=host_buf.device, dtype=torch.long
            )
            if to_device:
                values = host_buf.index_select(0, host_idx)
                state.index_copy_(0, dev_idx, values.to(state.device))
            else:
                values = state.index_select(0, dev_idx)
                host_buf.index_copy_(0, host_idx, values.to(host_buf.device))

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        data_page = torch.cat(
            [
                self._flatten_tensor_bytes(tensor)
                for tensor in self._iter_page_tensors(index)
            ]
        )
        return data_page.flatten() if flat else data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            self.page_size * self.size_per_token,
            dtype=torch.uint8,
            device=self.device,
            pin_memory=self.pin_memory,
        )

    def set_from_flat_data_page(
        self,
        index: int,
        data_page: torch.Tensor,
    ) -> None:
        flat_bytes = data_page.contiguous().view(torch.uint8).reshape(-1)
        expected = self.page_size * self.size_per_token
        if self.slot_state_device_tensors and flat_bytes.numel() != expected:
            # A page stored by a build without the side state is shorter; say so
            # instead of failing inside a reshape halfway through the restore.
            raise ValueError(
                f"Mamba state page has {flat_bytes.numel()} bytes, expected "
                f"{expected}: the page predates registered slot side states."
            )
        start = 0
        for tensor in self._iter_page_tensors(index):
            num_bytes = tensor.numel() * tensor.element_size()
            tensor_bytes = flat_bytes[start : start + num_bytes]
            start += num_bytes
            if tensor_bytes.storage_offset() % tensor.element_size():
                # With side state the page holds components of different element
                # sizes, so a later component can begin at a byte offset its own
                # dtype cannot be viewed at. A contiguous copy re-bases it at 0.
                tensor_bytes = tensor_bytes.clone()
            restored = tensor_bytes.view(dtype=tensor.dtype).reshape(tensor.shape)
            tensor.copy_(restored)

    def get_page_buffer_meta(self, indices):
        """Meta data for zero-copy storage I/O.

        Only page-first layouts are supported for mamba storage zero-copy because
        each page slot in temporal/conv buffers is directly addressable.
        """
        if self.slot_state_device_tensors:
            raise NotImplementedError(
                "Mamba storage zero-copy does not carry registered slot side "
                "states; use a whole-page storage backend."
            )
        assert len(indices) % self.page_size == 0
        if self.layout not in ["page_first", "page_first_direct"]:
            raise ValueError(
                f"Mamba storage zero-copy requires page_first layout, got {self.layout}"
            )
        indices = indices.tolist()
        ptr_list = []
        element_size_list = []

        # Compute base pointers once; each page pointer is offset from these bases.
        temporal_base_ptr = self.temporal_buffer.data_ptr()
        conv_base_ptrs = [buf.data_ptr() for buf in self.conv_buffer]
        # Component sizes are constant across pages, so precompute once as well.
        temporal_element_size = (
            self.page_size
            * self.num_mamba_layers
            * self.temporal_dtype.itemsize
            * self.temporal_state_elem_size
        )
        conv_element_sizes = [
            (
                self.page_size
                * self.num_mamba_layers
                * self.conv_dtype.itemsize
                * self.conv_state_elem_sizes[i]
            )
            for i in range(len(self.conv_state_shapes))
        ]

        for i in range(0, len(indices), self.page_size):
            # Emit component pointers in stable order: temporal first (dropped
            # for conv-only models with no ssm state), then conv_0..conv_n.
            # _get_hybrid_page_component_keys drops the temporal key under the
            # same condition, keeping keys and buffers aligned.
            if self.temporal_state_elem_size > 0:
                temporal_ptr = (
                    temporal_base_ptr
                    + indices[i]
                    * self.num_mamba_layers
                    * self.temporal_state_elem_size
                    * self.temporal_dtype.itemsize
                )
                ptr_list.append(temporal_ptr)
                element_size_list.append(temporal_element_size)
            for j in range(len(self.conv_buffer)):
                conv_ptr = (
                    conv_base_ptrs[j]
                    + indices[i]
                    * self.num_mamba_layers
                    * self.conv_state_elem_sizes[j]
                    * self.conv_dtype.itemsize
                )
                ptr_list.append(conv_ptr)
                element_size_list.append(conv_element_sizes[j])
        return ptr_list, element_size_list

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        if self.slot_state_device_tensors:
            # Side-state rows are a second, differently-strided buffer: a page is
            # no longer one contiguous slice, so no zero-copy claim is made.
            return False
        if self.layout not in ["page_first", "page_first_direct"]:
            return False
        temporal_stride = (
            self.num_mamba_layers
            * self.temporal_state_elem_size
            * self.temporal_dtype.itemsize
        )
        if self.temporal_buffer.data_ptr() % page_size_bytes != 0:
            return False
        if temporal_stride % page_size_bytes != 0:
            return False
        for buf, elem_size in zip(self.conv_buffer, self.conv_state_elem_sizes):
            conv_stride = self.num_mamba_layers * elem_size * self.conv_dtype.itemsize
            if buf.data_ptr() % page_size_bytes != 0:
                return False
            if conv_stride % page_size_bytes != 0:
                return False
        return True
