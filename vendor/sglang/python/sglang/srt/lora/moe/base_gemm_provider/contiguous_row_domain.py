"""Routed rows packed into aligned, contiguous expert segments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec
import torch

from sglang.kernels.ops.lora.moe.activation_delta import act_delta
from sglang.kernels.ops.lora.moe.dispatch_contiguous import (
    contiguous_m_pad_ceiling,
    dispatch_fill_rows_contiguous_bf16,
    dispatch_layout_contiguous,
)
from sglang.kernels.ops.lora.moe.fused_act import fused_b_act
from sglang.srt.lora.moe.base_gemm_provider.base import (
    MoeBaseProvider,
    admit_weight_layout,
    prepare_buffer,
)
from sglang.srt.lora.moe.quant_info import StandardLayoutQuantInfo

if TYPE_CHECKING:
    from sglang.kernels.ops.lora.common.route_view import RouteView
    from sglang.srt.lora.workspace import LoraWorkspace


class ContiguousRowState(msgspec.Struct, kw_only=True):
    hidden_compact: torch.Tensor | None  # [m_pad_ceiling, hidden], the GEMM input dtype
    seg_counts: torch.Tensor  # [E_local] int32
    seg_offsets: torch.Tensor  # [E_local + 1] int32 first row of each segment
    pair_to_row: torch.Tensor  # [num_tokens * top_k] int32 compact rows
    m_pad_ceiling: int
    input_buffer_reuse: bool
    # Quantized activation and scales for the down GEMM.
    act_quant: tuple[torch.Tensor, torch.Tensor] | None = None


class ContiguousRowDomainProvider(MoeBaseProvider):
    def __init__(self, quant_info: StandardLayoutQuantInfo, *, m_alignment: int):
        self.quant_info = quant_info
        if not isinstance(m_alignment, int) or m_alignment < 1:
            raise ValueError(f"m_alignment must be a positive int, got {m_alignment!r}")
        self._m_alignment = m_alignment
        self._gate_up_slices = admit_weight_layout(quant_info)

    def prepare(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        top_k: int,
        workspace: LoraWorkspace | None = None,
        *,
        fill_rows: bool = True,
    ) -> ContiguousRowState:
        num_pairs = topk_ids.numel()
        num_experts = self.quant_info.num_local_experts
        m_pad_ceiling = contiguous_m_pad_ceiling(
            num_pairs, num_experts, self._m_alignment
        )
        device = hidden_states.device
        prefix = f"contiguous:a{self._m_alignment}"
        seg_counts = prepare_buffer(
            workspace,
            f"{prefix}:seg_counts",
            (num_experts,),
            dtype=torch.int32,
            device=device,
        )
        seg_offsets = prepare_buffer(
            workspace,
            f"{prefix}:seg_offsets",
            (num_experts + 1,),
            dtype=torch.int32,
            device=device,
        )
        pair_to_row = prepare_buffer(
            workspace,
            f"{prefix}:pair_to_row",
            (num_pairs,),
            dtype=torch.int32,
            device=device,
        )
        if workspace is not None:
            # Padding outputs are ignored, so reused padding needs no reset.
            hidden_compact = (
                None
                if not fill_rows
                else workspace.tensor(
                    f"{prefix}:hidden_compact",
                    (m_pad_ceiling, hidden_states.size(1)),
                    dtype=torch.bfloat16,
                    device=device,
                    zero_on_first_allocation=True,
                )
            )
        else:
            hidden_compact = (
                None
                if not fill_rows
                else torch.zeros(
                    (m_pad_ceiling, hidden_states.size(1)),
                    dtype=torch.bfloat16,
                    device=device,
                )
            )
        dispatch_layout_contiguous(
            hidden_states,
            topk_ids,
            num_experts,
            top_k,
            self._m_alignment,
            seg_counts_out=seg_counts,
            seg_offsets_out=seg_offsets,
            pair_to_row_out=pair_to_row,
        )
        if hidden_compact is not None:
            dispatch_fill_rows_contiguous_bf16(
                hidden_states, topk_ids, pair_to_row, hidden_compact_out=hidden_compact
            )
        return ContiguousRowState(
            hidden_compact=hidden_compact,
            seg_counts=seg_counts,
            seg_offsets=seg_offsets,
            pair_to_row=pair_to_row,
            m_pad_ceiling=m_pad_ceiling,
            input_buffer_reuse=workspace is not None,
        )

    def release_prepared_inputs(self, row_state: ContiguousRowState) -> None:
        # Workspace buffers retain their addresses for graph replay.
        if row_state.input_buffer_reuse or row_state.hidden_compact is None:
            return
        from sglang.srt.utils import dispose_tensor

        dispose_tensor(row_state.hidden_compact)

    def act_with_delta(
        self,
        row_state: ContiguousRowState,
        gateup_out: torch.Tensor,
        gate_up_delta: torch.Tensor | None,
        topk_ids: torch.Tensor,
        act_out: torch.Tensor,
        activation_lora_input: torch.Tensor,
        *,
        activation: str = "silu",
        act_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if act_quant is not None:
            row_state.act_quant = act_quant
        act_delta(
            gateup_out,
            gate_up_delta,
            act_out,
            activation_lora_input,
            row_state.pair_to_row,
            topk_ids,
            num_local_experts=self.num_local_experts,
            gate_first=self.contract.gate_first,
            interleaved=self.contract.interleaved,
            activation=activation,
            act_quant=(
                (*act_quant, self.contract.act_quant_group)
                if act_quant is not None
                else None
            ),
        )

    def fused_act(
        self,
        row_state: ContiguousRowState,
        *,
        activation: str,
        base_gateup: torch.Tensor,
        act_rows: torch.Tensor,
        act_pairs: torch.Tensor | None,
        routing: RouteView,
        config: Mapping[str, int],
        bridge_gateup: torch.Tensor | None = None,
        b_gate_up: torch.Tensor | None = None,
        bridge_top_k: int = 1,
    ) -> None:
        fused_b_act(
            activation=activation,
            base_gateup=base_gateup,
            act_rows=act_rows,
            act_pairs=act_pairs,
            pair_to_row=row_state.pair_to_row,
            routing=routing,
            num_local_experts=self.num_local_experts,
            gate_first=self.contract.gate_first,
            interleaved=self.contract.interleaved,
            config=config,
            bridge_gateup=bridge_gateup,
            b_gate_up=b_gate_up,
            bridge_top_k=bridge_top_k,
        )

    def gateup_out_shape(self, row_state: ContiguousRowState) -> tuple[int, ...]:
        return (
            row_state.m_pad_ceiling,
            self.gate_up_slices * self.quant_info.intermediate_size,
        )

    def act_out_shape(self, row_state: ContiguousRowState) -> tuple[int, ...]:
        return (row_state.m_pad_ceiling, self.quant_info.intermediate_size)

    def down_out_shape(self, row_state: ContiguousRowState) -> tuple[int, ...]:
        return (row_state.m_pad_ceiling, self.quant_info.hidden_size)
