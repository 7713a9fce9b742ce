"""Add LoRA before activation and expose pair-major inputs for down-A.

pair_to_row addresses either base row layout; invalid pair outputs are zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.lora.moe.activation import ActivationFn
from sglang.kernels.ops.lora.moe.fp8_quant import quantize_fp8_groups


@triton.jit
def apply_activation(x, ACTIVATION_TYPE: tl.constexpr):
    if ACTIVATION_TYPE == "silu":
        return x * tl.sigmoid(x)
    elif ACTIVATION_TYPE == "relu2":
        value = tl.maximum(x, 0.0)
        return value * value
    else:
        raise ValueError(f"unsupported activation {ACTIVATION_TYPE}")


@triton.jit
def _act_delta_kernel(
    gateup_ptr,  # [rows, slices * inter] bf16, flat base rows
    delta_ptr,  # [num_tokens, top_k, slices * inter] [gate | up]
    act_out_ptr,  # [rows, inter] bf16, flat base rows
    act_lora_in_ptr,  # [num_tokens, top_k, inter] bf16
    act_q_ptr,  # [rows, inter] fp8e4m3 (QUANT_GROUP > 0 only)
    act_s_ptr,  # [rows, inter // QUANT_GROUP] fp32 row-major
    pair_to_row_ptr,  # [num_tokens * top_k] int32
    topk_ids_ptr,  # [num_tokens, top_k] (local ids; < 0 = invalid)
    num_local_experts,
    inter,
    HAS_DELTA: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    ACTIVATION_TYPE: tl.constexpr,
    GATE_FIRST: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    QUANT_GROUP: tl.constexpr,  # 0 disables the additional FP8 output.
    WHOLE_ROW: tl.constexpr,  # Match upstream's whole-row rounding.
    BLOCK_SIZE: tl.constexpr,
):
    pair_idx_int32 = tl.program_id(0)
    pair_idx = pair_idx_int32.to(tl.int64)

    expert_id = tl.load(topk_ids_ptr + pair_idx)
    valid = (expert_id >= 0) & (expert_id < num_local_experts)
    dst_row = tl.load(pair_to_row_ptr + pair_idx, mask=valid, other=0).to(tl.int64)

    total_inter = NUM_SLICES * inter
    gateup_row = gateup_ptr + dst_row * total_inter
    delta_row = delta_ptr + pair_idx * total_inter
    act_out_row = act_out_ptr + dst_row * inter
    lora_in_row = act_lora_in_ptr + pair_idx * inter

    vec = tl.arange(0, BLOCK_SIZE)
    for start in tl.range(0, inter, BLOCK_SIZE):
        offs = start + vec
        mask = offs < inter

        if NUM_SLICES == 1:
            gate_offs = offs
            up_offs = offs
        elif INTERLEAVED:
            gate_offs = 2 * offs
            up_offs = 2 * offs + 1
        else:
            gate_offs = offs
            up_offs = inter + offs
        if not GATE_FIRST:
            gate_offs, up_offs = up_offs, gate_offs

        g = tl.load(gateup_row + gate_offs, mask=mask & valid, other=0.0).to(tl.float32)
        if HAS_DELTA:
            # The delta is always contiguous [gate | up].
            dg = tl.load(delta_row + offs, mask=mask & valid, other=0.0).to(tl.float32)
            g += dg
        act = apply_activation(g, ACTIVATION_TYPE)
        if NUM_SLICES == 2:
            u = tl.load(gateup_row + up_offs, mask=mask & valid, other=0.0).to(
                tl.float32
            )
            if HAS_DELTA:
                du = tl.load(
                    delta_row + inter + offs,
                    mask=mask & valid,
                    other=0.0,
                ).to(tl.float32)
                u += du
            act = act * u
        act_bf16 = act.to(act_out_ptr.dtype.element_ty)

        tl.store(act_out_row + offs, act_bf16, mask=mask & valid)
        lora_in = tl.where(valid, act, 0.0)
        tl.store(
            lora_in_row + offs, lora_in.to(act_lora_in_ptr.dtype.element_ty), mask=mask
        )
        if QUANT_GROUP > 0:
            # Quantize the BF16-rounded value, matching the unfused path.
            # Admission ensures each quantization group is fully valid or masked.
            QG: tl.constexpr = QUANT_GROUP if QUANT_GROUP > 0 else BLOCK_SIZE
            grouped = tl.reshape(
                tl.where(mask & valid, act_bf16.to(tl.float32), 0.0),
                (BLOCK_SIZE // QG, QG),
            )
            q, scale = quantize_fp8_groups(grouped, WHOLE_ROW)
            tl.store(
                act_q_ptr + dst_row * inter + offs,
                tl.reshape(q, (BLOCK_SIZE,)).to(act_q_ptr.dtype.element_ty),
                mask=mask & valid,
            )
            gvec = tl.arange(0, BLOCK_SIZE // QG)
            goffs = start // QG + gvec
            n_groups = inter // QG
            tl.store(
                act_s_ptr + dst_row * n_groups + goffs,
                scale,
                mask=(goffs < n_groups) & valid,
            )


def act_delta(
    gateup_rows: torch.Tensor,
    gate_up_delta: torch.Tensor | None,  # [num_tokens, top_k, slices * inter]
    act_out_rows: torch.Tensor,
    activation_lora_input: torch.Tensor,  # [num_tokens, top_k, inter] bf16
    pair_to_row: torch.Tensor,  # [num_tokens * top_k] int32
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    *,
    num_local_experts: int,
    gate_first: bool = True,
    interleaved: bool = False,
    activation: str = "silu",
    act_quant: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> None:
    """Add pair-major LoRA deltas and activate either provider row layout."""
    ActivationFn.parse(activation)
    num_pairs = topk_ids.numel()
    if num_pairs == 0:
        return
    gateup_rows = gateup_rows.view(-1, gateup_rows.shape[-1])
    act_out_rows = act_out_rows.view(-1, act_out_rows.shape[-1])
    inter = act_out_rows.shape[-1]
    num_slices = gateup_rows.shape[-1] // inter
    if act_quant is not None:
        act_q, act_s, group = act_quant
        assert inter % group == 0 and 512 % group == 0
    else:
        act_q, act_s, group = act_out_rows, act_out_rows, 0
    _act_delta_kernel[(num_pairs,)](
        gateup_rows,
        gate_up_delta if gate_up_delta is not None else gateup_rows,
        act_out_rows,
        activation_lora_input,
        act_q,
        act_s,
        pair_to_row,
        topk_ids,
        num_local_experts,
        inter,
        HAS_DELTA=gate_up_delta is not None,
        NUM_SLICES=num_slices,
        ACTIVATION_TYPE=activation,
        GATE_FIRST=gate_first,
        INTERLEAVED=interleaved,
        QUANT_GROUP=group,
        WHOLE_ROW=inter == group,
        BLOCK_SIZE=512,
    )
