# SPDX-License-Identifier: Apache-2.0
"""MiniMax H3 packed-token DiT.

Native SGLang implementation of the MiniMax H3 audio-video DiT. The forward
contract accepts packed inference keyword arguments and returns packed logits.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sglang.kernels.ops.activation.activation import (
    silu_and_mul_with_activation_rounding,
    silu_and_mul_with_activation_rounding_,
)
from sglang.kernels.ops.diffusion import (
    MINIMAX_H3_NORM_MODULATE,
    can_use_fused_inplace_qknorm_rope,
    can_use_mxfp8_swizzled,
    can_use_rmsnorm_indexed_scale_shift,
    can_use_silu_mul_mxfp8,
    fused_inplace_qknorm_rope,
    fused_qknorm_rope_out_of_place,
    indexed_gate_bf16,
    indexed_gate_bf16_,
    indexed_gate_fp32,
    indexed_gate_fp32_,
    indexed_scale_shift_bf16_,
    indexed_scale_shift_fp32_,
    indexed_scale_shift_mxfp8_,
    rmsnorm_indexed_scale_shift,
    silu_mul_mxfp8,
)
from sglang.kernels.ops.layernorm.norm import fused_inplace_qknorm
from sglang.multimodal_gen import envs
from sglang.multimodal_gen.configs.models.dits.minimax_h3 import (
    MINIMAX_H3_ADALN_MODALITY_NUM,
    MINIMAX_H3_PACKED_SEQUENCE_ALIGNMENT,
    MiniMaxH3DiTArchConfig,
    MiniMaxH3DiTConfig,
)
from sglang.multimodal_gen.configs.models.fsdp import is_block
from sglang.multimodal_gen.runtime.cache.spectrum import (
    SpectrumMixin,
    blend_h3_spectrum_prediction,
    local_target_hidden,
    target_audio_video_span,
)
from sglang.multimodal_gen.runtime.distributed import (
    get_tp_world_size,
    tensor_model_parallel_all_gather,
)
from sglang.multimodal_gen.runtime.distributed.parallel_state import (
    get_ring_ctx,
    get_ulysses_ctx,
)
from sglang.multimodal_gen.runtime.layers.attention.backends.attention_backend import (
    AttentionRequirements,
)
from sglang.multimodal_gen.runtime.layers.attention.backends.video_sparse_attn_h3 import (
    vsa_h3_fold_gate,
)
from sglang.multimodal_gen.runtime.layers.attention.selector import (
    claim_deferred_component_attn_backend,
    get_attn_backend,
    get_component_forced_attn_backend,
    get_global_forced_attn_backend,
)
from sglang.multimodal_gen.runtime.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.runtime.layers.quantization.configs.base_config import (
    QuantizationConfig,
)
from sglang.multimodal_gen.runtime.layers.usp import _ring_attention_varlen
from sglang.multimodal_gen.runtime.loader.utils import get_param_names_mapping
from sglang.multimodal_gen.runtime.managers.forward_context import (
    get_forward_context,
)
from sglang.multimodal_gen.runtime.managers.memory_managers.layerwise_offload import (
    LayerwiseOffloadableModuleMixin,
    is_layerwise_offloaded_module,
)
from sglang.multimodal_gen.runtime.models.dits.base import BaseDiT
from sglang.multimodal_gen.runtime.models.dits.minimax_h3_adaln_cache import (
    MINIMAX_H3_ADALN_MAX_PLAN_WIDTH,
    MiniMaxH3AdalnCache,
)
from sglang.multimodal_gen.runtime.models.dits.minimax_h3_adaln_cache import (
    _plan_key as _adaln_plan_key,
)
from sglang.multimodal_gen.runtime.models.dits.minimax_h3_adaln_cache import (
    native_adaln_weight_files,
)
from sglang.multimodal_gen.runtime.models.dits.minimax_h3_vdn_attention import (
    MiniMaxH3VDNHybridAttention,
)
from sglang.multimodal_gen.runtime.models.parameter import BlockQuantScaleParameter
from sglang.multimodal_gen.runtime.platforms import (
    AttentionBackendEnum,
    current_platform,
)
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
    eager_on_graph,
    is_in_breakable_cuda_graph,
)

logger = init_logger(__name__)

_ARCH_DEFAULTS = MiniMaxH3DiTArchConfig()

_NON_LORA_DELTA_SUFFIXES = (".diff", ".diff_b", ".set_weight")


def _reject_non_lora_delta_tensors(adapter: dict[str, torch.Tensor]) -> None:
    offending = sorted(key for key in adapter if key.endswith(_NON_LORA_DELTA_SUFFIXES))
    if offending:
        raise ValueError(
            f"LoRA adapter carries {len(offending)} non-LoRA tensors "
            f"(.diff/.diff_b/.set_weight, e.g. {offending[0]}) that no MiniMax-H3 "
            "LoRA mapping rule applies; serve a checkpoint with them merged instead."
        )


# DO NOT CHANGE, MILES-D IS USING: miles_diffusion keeps a clone in
# miles/backends/fsdp_utils/models/diffusers/h3/weight_bridge.py; change both together.
# TODO(rockdu): load weights and update weights in one format so the clone can go.
def _diffusers_h3_checkpoint(
    iterator: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Map Diffusers H3 names/layout to the fused native checkpoint layout."""
    mapping = get_param_names_mapping(_ARCH_DEFAULTS.param_names_mapping)
    pending: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)

    for source_name, tensor in iterator:
        target_name, merge_index, merge_count = mapping(source_name)

        # Diffusers SwiGLU stores [value, gate]; the native fused MLP consumes
        # [gate, value]. Packed GPTQ tensors carry output channels on dim 1.
        if ".ff.net.0.proj." in source_name:
            output_dim = (
                1 if source_name.endswith((".qweight", ".qzeros", ".scales")) else 0
            )
            value, gate = tensor.chunk(2, dim=output_dim)
            tensor = torch.cat((gate, value), dim=output_dim)

        if merge_index is None:
            yield target_name, tensor
            continue

        assert merge_count is not None
        pending[target_name][merge_index] = tensor
        if len(pending[target_name]) != merge_count:
            continue

        merge_dim = 1 if target_name.endswith((".qweight", ".qzeros", ".scales")) else 0
        yield (
            target_name,
            torch.cat(
                [pending[target_name][index] for index in range(merge_count)],
                dim=merge_dim,
            ),
        )
        del pending[target_name]

    if pending:
        incomplete = ", ".join(sorted(pending))
        raise ValueError(f"Incomplete Diffusers H3 fused parameters: {incomplete}")


_BF16_DTYPE = torch.bfloat16
_FP32_DTYPE = torch.float32
_MPS_MLP_TOKEN_CHUNK_SIZE = 128
# keep MPS activation chunks below the allocator high-watermark; CUDA keeps
# its fused full-sequence projection
_MPS_QKV_PROJECTION_TOKEN_CHUNK_SIZE = 128
_MPS_ATTENTION_QUERY_TOKEN_CHUNK_SIZE = 128

_MPS_EMBED_WEIGHT_PREFIXES = (
    "condition_proj",
    "video_patch_proj",
    "audio_patch_proj",
    "time_embedder",
    "token_refiner.final_norm",
)

_MINIMAX_H3_FP32_PARAM_NAMES_IN_MODEL_ORDER = (
    "video_patch_proj.weight",
    "video_patch_proj.bias",
    "audio_patch_proj.weight",
    "audio_patch_proj.bias",
    "time_embedder.proj_in.weight",
    "time_embedder.proj_in.bias",
    "time_embedder.proj_out.weight",
    "time_embedder.proj_out.bias",
    "final_layer.video_out.weight",
    "final_layer.video_out.bias",
    "final_layer.audio_out.weight",
    "final_layer.audio_out.bias",
)
MINIMAX_H3_FP32_PARAM_NAMES = frozenset(_MINIMAX_H3_FP32_PARAM_NAMES_IN_MODEL_ORDER)
MINIMAX_H3_FP32_BUFFER_NAMES = frozenset({"rope.inv_freq"})


def _required_kwarg(kwargs: dict[str, Any], key: str) -> Any:
    if key not in kwargs or kwargs[key] is None:
        raise ValueError(f"MiniMaxH3DiTModel.forward requires kwarg {key!r}")
    return kwargs[key]


# The exhaustive keyword contract of MiniMaxH3DiTModel.forward. Anything not
# listed here is rejected with a TypeError before any tensor work starts.
_FORWARD_SUPPORTED_KWARGS = frozenset(
    {
        "x",
        "audio_x",
        "img_position_ids",
        "rope_cache",
        "unique_timesteps",
        "adaln_cache_slot",
        "inverse_indices",
        "update_mask",
        "update_audio_mask",
        "token_tags",
        "block_token_tags",
        "block_combined_indices",
        "subblock_sparse_query_block_mask",
        "skip_mask_out_condition",
        "prompt_embeds",
        "refined_prompt_embeds_length",
        "img_pos_info",
        "audio_pos_info",
        "text_pos_info",
        "img_pos_for_infer_output_info",
        "local_embedding_layout",
        "packed_seq_params",
        "refiner_packed_seq_params",
    }
)


def _reorder_grouped_qkv_to_qkv(
    weight: torch.Tensor,
    *,
    num_query_groups: int,
    heads_per_group: int,
    head_dim: int,
) -> torch.Tensor:
    per_group = (heads_per_group + 2) * head_dim
    expected_out = num_query_groups * per_group
    if weight.shape[0] != expected_out:
        raise ValueError(
            "qkv weight has incompatible output dim for grouped checkpoint layout: "
            f"got {tuple(weight.shape)}, expected first dim {expected_out}."
        )

    rest_shape = weight.shape[1:]
    grouped = weight.reshape(num_query_groups, per_group, *rest_shape)
    q, k, v = torch.split(
        grouped,
        [heads_per_group * head_dim, head_dim, head_dim],
        dim=1,
    )
    return torch.cat(
        [
            q.reshape(num_query_groups * heads_per_group * head_dim, *rest_shape),
            k.reshape(num_query_groups * head_dim, *rest_shape),
            v.reshape(num_query_groups * head_dim, *rest_shape),
        ],
        dim=0,
    )


def _install_qkv_row_reorder(
    param: torch.Tensor,
    reorder: Callable[[torch.Tensor], torch.Tensor],
    qkv_rows: int,
) -> None:
    """Reorder a per-output-row qkv parameter the same way its rows are reordered.

    Applied to quantization metadata rather than the weight itself. Anything whose
    leading dim is not the checkpoint's qkv row count is passed through: per-tensor
    scales are scalars, and a swizzled block-scale layout is not row-indexed.
    """

    def _maybe_reorder(loaded_weight: torch.Tensor) -> torch.Tensor:
        if loaded_weight.dim() >= 2 and loaded_weight.shape[0] == qkv_rows:
            return reorder(loaded_weight)
        return loaded_weight

    base_loader = (
        param._weight_loader
        if hasattr(param, "_weight_loader")
        else param.weight_loader
    )

    def _weight_loader(p: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        base_loader(p, _maybe_reorder(loaded_weight))

    if hasattr(param, "_weight_loader"):
        param._weight_loader = _weight_loader
    else:
        param.weight_loader = _weight_loader
    param.rank_local_weight_transform = _maybe_reorder


def _qkv_scale_block_rows(qkv_proj: nn.Module, head_dim: int) -> int:
    """Weight rows covered by one row of the qkv projection's scale.

    Per-channel and NVFP4 scales hold one row per weight row and report 1. A
    block-FP8 scale holds one row per weight_block_size[0] weight rows, so the
    qkv row permutation has to count its rows in blocks instead. Only whole
    scale rows can move, so a block spanning two heads' q/k/v rows cannot be
    repaired by a permutation and is rejected rather than silently mis-scaled.
    """
    quant_config = getattr(
        getattr(qkv_proj, "quant_method", None), "quant_config", None
    )
    block_size = getattr(quant_config, "weight_block_size", None)
    if not block_size:
        return 1
    block_rows = block_size[0]
    if head_dim % block_rows:
        raise ValueError(
            "block-quantized qkv needs a block size that divides the head dim: "
            f"head_dim={head_dim}, weight_block_size={block_size}."
        )
    return block_rows


def _copy_grouped_qkv_tp_shard(
    param: torch.Tensor,
    loaded_weight: torch.Tensor,
    *,
    num_query_groups: int,
    head_dim: int,
    tp_rank: int,
    tp_size: int,
) -> bool:
    """Copy a dense MHA checkpoint directly into its TP-local Q/K/V rows."""
    if (
        tp_size <= 0
        or not 0 <= tp_rank < tp_size
        or num_query_groups % tp_size
        or getattr(param, "output_dim", None) != 0
        or getattr(param, "is_sharded_weight", False)
        or getattr(param, "packed_dim", None) is not None
        or param.dtype != loaded_weight.dtype
        or param.dtype not in (_BF16_DTYPE, torch.float8_e4m3fn)
        or not param.is_contiguous()
        or not loaded_weight.is_contiguous()
    ):
        return False

    expected_rows = num_query_groups * 3 * head_dim
    local_groups = num_query_groups // tp_size
    rest_shape = loaded_weight.shape[1:]
    if loaded_weight.shape[0] != expected_rows or tuple(param.shape) != (
        3 * local_groups * head_dim,
        *rest_shape,
    ):
        return False

    grouped = loaded_weight.view(num_query_groups, 3, head_dim, *rest_shape)
    grouped = grouped.narrow(0, tp_rank * local_groups, local_groups)
    target = param.data.view(3, local_groups, head_dim, *rest_shape)
    for index in range(3):
        target[index].copy_(grouped[:, index])
    return True


def _norm(size: int, *, eps: float, dtype: torch.dtype = _BF16_DTYPE) -> nn.RMSNorm:
    # RMSNorm uses fp32 accumulation with bf16 inputs and outputs.
    # torch.nn.RMSNorm upcasts reduced-precision inputs for the variance
    # reduction, matching that accumulation semantic.
    return nn.RMSNorm(size, eps=eps, dtype=dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _modulate_rmsnorm_scale_shift(
    x: torch.Tensor,
    norm: nn.RMSNorm,
    shift: torch.Tensor,
    scale: torch.Tensor,
    indices: torch.Tensor,
    *,
    dtype: torch.dtype,
    fused: bool = False,
) -> torch.Tensor:
    """RMSNorm + indexed AdaLN.

    The reference chain rounds after the norm and after every modulation op.
    ``fused`` (quality lossless / high) runs one fp32 pass with one rounding,
    which moves the denoising trajectory at rounding level.
    """
    if (
        fused
        and x.dtype == dtype == _BF16_DTYPE
        and norm.weight is not None
        and can_use_rmsnorm_indexed_scale_shift(x, norm.weight, shift, scale, indices)
    ):
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        return rmsnorm_indexed_scale_shift(x, norm.weight, shift, scale, indices, eps)
    return _modulate_scale_shift(norm(x), shift, scale, indices, dtype=dtype)


def _accepts_mxfp8_input(linear: nn.Module) -> bool:
    return (
        isinstance(linear, LinearBase)
        and linear.quant_method is not None
        and linear.quant_method.accepts_mxfp8_input(linear)
    )


def _modulate_scale_shift(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    indices: torch.Tensor,
    *,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Apply indexed affine modulation, reusing disposable CUDA BF16 input."""
    # Apply per-index affine modulation: x * (1 + scale[idx]) + shift[idx].
    if (
        x.is_cuda
        and x.dtype == _BF16_DTYPE
        and dtype == _BF16_DTYPE
        and shift.dtype == scale.dtype
        and x.is_contiguous()
        and shift.stride(-1) == scale.stride(-1) == 1
    ):
        # Serialized INT8 checkpoints keep the AdaLN tables in FP32.
        if shift.dtype == _BF16_DTYPE:
            return indexed_scale_shift_bf16_(x, shift, scale, indices)
        if shift.dtype == _FP32_DTYPE:
            return indexed_scale_shift_fp32_(x, shift, scale, indices)
    return (
        x * (1.0 + scale.index_select(0, indices)) + shift.index_select(0, indices)
    ).to(dtype)


def _modulate_gate(
    x: torch.Tensor,
    gate: torch.Tensor,
    other: torch.Tensor,
    indices: torch.Tensor,
    *,
    dtype: torch.dtype,
    allow_inplace: bool = True,
) -> torch.Tensor:
    """Apply an indexed gated residual, optionally reusing the input buffer."""
    # Apply the per-index gated residual: x + gate[idx] * other.
    if (
        x.is_cuda
        and x.dtype == _BF16_DTYPE
        and dtype == _BF16_DTYPE
        and other.dtype == _BF16_DTYPE
        and x.is_contiguous()
        and other.is_contiguous()
        and gate.stride(-1) == 1
    ):
        if gate.dtype == _BF16_DTYPE:
            if allow_inplace:
                return indexed_gate_bf16_(x, gate, other, indices)
            return indexed_gate_bf16(x, gate, other, indices)
        if gate.dtype == _FP32_DTYPE:
            if allow_inplace:
                return indexed_gate_fp32_(x, gate, other, indices)
            return indexed_gate_fp32(x, gate, other, indices)
    return (x + gate.index_select(0, indices) * other).to(dtype)


def _silu_mul(hidden: torch.Tensor, *, reuse_input: bool) -> torch.Tensor:
    if (
        hidden.is_cuda
        and hidden.dtype == _BF16_DTYPE
        and hidden.is_contiguous()
        and hidden.shape[-1] % 16 == 0
    ):
        if reuse_input:
            return silu_and_mul_with_activation_rounding_(hidden)
        # Quantized fc2 needs contiguous rows, so keep the fused result out of
        # the packed fc1 buffer while preserving the eager BF16 SiLU rounding.
        return silu_and_mul_with_activation_rounding(hidden)
    gate, up = hidden.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def _apply_qk_norm(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: nn.RMSNorm,
    k_norm: nn.RMSNorm,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        q.is_cuda
        and q.dtype == _BF16_DTYPE
        and q.dtype == k.dtype == q_norm.weight.dtype == k_norm.weight.dtype
        and q.stride(-1) == k.stride(-1) == 1
        and q.stride(-2) == k.stride(-2) == head_dim
        and q_norm.eps == k_norm.eps
        and not torch.compiler.is_compiling()
        and current_platform.is_cuda()
    ):
        fused_inplace_qknorm(
            q,
            k,
            q_norm.weight,
            k_norm.weight,
            eps=q_norm.eps,
            head_dim=head_dim,
        )
        return q, k
    return q_norm(q), k_norm(k)


class MiniMaxH3Rope(nn.Module):
    """3D rope over (t, h, w); rotates 96 of 128 head dims (rotary_percent 0.75).

    Frequency layout concatenates temporal, height, and width embeddings twice,
    with 16 frequencies per axis (inv_freq = base^-(arange(0,32,2)/32)).
    """

    def __init__(self, inv_freq_len: int) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq",
            torch.empty(inv_freq_len, dtype=_FP32_DTYPE),
            persistent=True,
        )

    def forward(self, img_position_ids: torch.Tensor) -> torch.Tensor:
        """img_position_ids: [1, S, 3] (t, h, w) -> freqs [S, rot_dim=96]."""
        if img_position_ids.dim() != 3 or img_position_ids.shape[0] != 1:
            raise ValueError(
                "img_position_ids must be [1, S, 3], got "
                f"{list(img_position_ids.shape)}"
            )
        pos = img_position_ids[0].to(_FP32_DTYPE)  # [S, 3]
        per_axis = pos.unsqueeze(-1) * self.inv_freq.view(1, 1, -1)  # [S, 3, 16]
        t_f, h_f, w_f = per_axis.unbind(dim=1)  # each [S, 16]
        half = torch.cat((t_f, h_f, w_f), dim=-1)  # [S, 48]
        return torch.cat((half, half), dim=-1)  # [S, 96]


def _rope_cos_sin_cache(freqs: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """Build the activation-dtype cos|sin cache for fused Q/K RoPE."""
    half = freqs.shape[-1] // 2
    return (
        torch.cat(
            (torch.cos(freqs[:, :half]), torch.sin(freqs[:, :half])),
            dim=-1,
        )
        .to(dtype=dtype, copy=False)
        .contiguous()
    )


def _apply_rope_cos_sin(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Rotate the first cached RoPE dims; pass the remaining head dims through."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x_rot = (x_rot * cos) + (_rotate_half(x_rot) * sin)
    return torch.cat((x_rot, x_pass), dim=-1)


def _apply_rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        half = cos_sin_cache.shape[-1] // 2
        cos_half, sin_half = cos_sin_cache.split(half, dim=-1)
        cos = torch.cat((cos_half, cos_half), dim=-1).unsqueeze(1)
        sin = torch.cat((sin_half, sin_half), dim=-1).unsqueeze(1)
        return (
            _apply_rope_cos_sin(q, cos, sin),
            _apply_rope_cos_sin(k, cos, sin),
        )

    from sgl_kernel import rotary_embedding as apply_sgl_kernel_rotary_embedding

    apply_sgl_kernel_rotary_embedding(
        positions,
        q.view(q.shape[0], -1),
        k.view(k.shape[0], -1),
        q.shape[-1],
        cos_sin_cache,
        True,
    )
    return q, k


def _apply_rope(
    x: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> torch.Tensor:
    """Apply the eager (non-CUDA) H3 RoPE path to one Q or K tensor."""
    half = cos_sin_cache.shape[-1] // 2
    cos_half, sin_half = cos_sin_cache.split(half, dim=-1)
    cos = torch.cat((cos_half, cos_half), dim=-1).unsqueeze(1)
    sin = torch.cat((sin_half, sin_half), dim=-1).unsqueeze(1)
    return _apply_rope_cos_sin(x, cos, sin)


class MiniMaxH3TimeEmbedder(nn.Module):
    def __init__(
        self,
        arch: MiniMaxH3DiTArchConfig,
        *,
        prefix: str,
    ) -> None:
        super().__init__()
        self.frequency_embedding_size = arch.timestep_input_dim
        self.proj_in = ColumnParallelLinear(
            arch.timestep_input_dim,
            arch.time_embed_hidden_size,
            bias=True,
            gather_output=False,
            params_dtype=_FP32_DTYPE,
            quant_config=None,
            prefix=f"{prefix}.proj_in",
        )
        self.proj_out = RowParallelLinear(
            arch.time_embed_hidden_size,
            arch.time_embed_dim,
            bias=True,
            input_is_parallel=True,
            params_dtype=_FP32_DTYPE,
            quant_config=None,
            prefix=f"{prefix}.proj_out",
        )
        self.register_buffer("_frequency_cache", None, persistent=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t: [M] -> [M, time_embed_dim] fp32.

        The sinusoidal embedding stays fp32 throughout and concatenates cosine
        values before sine values.
        """
        half = self.frequency_embedding_size // 2
        freqs = self._frequency_cache
        if freqs is None or freqs.device != t.device:
            # Construct this on the execution device once so the values keep
            # the established CUDA numerics without repeating arange/exp on
            # every denoise step.
            freqs = torch.exp(
                -math.log(10000.0)
                * torch.arange(half, dtype=_FP32_DTYPE, device=t.device)
                / half
            )
            self._frequency_cache = freqs
        args = t.to(_FP32_DTYPE)[:, None] * freqs[None]
        t_freq = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        hidden, _ = self.proj_in(t_freq)
        hidden = nn.functional.silu(hidden)
        out, _ = self.proj_out(hidden)
        return out


def _minimax_h3_bind_attention_backend(
    attention: MiniMaxH3Attention, dtype: torch.dtype
) -> None:
    if attention._attention_impl is None:
        attention._set_attention_backend(
            get_attn_backend(
                attention.head_dim,
                dtype,
                selected_attention_backend=attention._selected_attention_backend,
                attention_requirements=AttentionRequirements(packed_varlen=True),
            )
        )


# FlashAttention on Hopper and cuDNN SDPA on Blackwell give a head group the
# same bytes as those heads inside the full call (checked at H3's shapes)
_PIPELINED_ATTENTION_BACKENDS = (
    AttentionBackendEnum.FA,
    AttentionBackendEnum.DYNAMIC_CUDNN_SDPA,
)


def _minimax_h3_pipelined_dense_attention(
    attention: MiniMaxH3Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: tuple[int, ...] | None,
    max_seqlen: int,
    fill=None,
) -> torch.Tensor | None:
    """Dense attention with the Ulysses exchange pipelined over head groups.

    Returns None (caller keeps the sequential exchange) unless head-group
    pipelining is enabled and a dense backend that runs a head group exactly
    as it runs those heads in the full call would serve it.
    """
    groups = envs.SGLANG_DIFFUSION_ULYSSES_PIPELINE_GROUPS
    if groups in (0, 1) or torch.compiler.is_compiling():
        return None
    if attention._attention_backend_enum not in _PIPELINED_ATTENTION_BACKENDS:
        return None
    impl = attention._attention_impl
    skip_softmax = getattr(impl, "_request_skip_softmax_threshold", None)
    if skip_softmax is not None and skip_softmax()[0]:
        return None
    from sglang.multimodal_gen.runtime.distributed.device_communicators.ipc_a2a_multi import (
        ulysses_pipelined_attention,
    )

    def attend(q_group, k_group, v_group):
        return impl.forward_varlen(
            q_group,
            k_group,
            v_group,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            cu_seqlens_host=cu_seqlens_host,
        )

    return ulysses_pipelined_attention(q, k, v, attend, groups, fill=fill)


def _minimax_h3_qknorm_rope_pipelined_attention(
    attention: MiniMaxH3Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope_cache: tuple[torch.Tensor, torch.Tensor],
    *,
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: tuple[int, ...] | None,
    max_seqlen: int,
) -> torch.Tensor | None:
    """The pipelined attention with QK-norm + RoPE writing into the exchange.

    q/k are the raw projections. Each destination block gets its heads'
    normalized q and k written in place, so the in-place norm and the pack
    become one pass, and v moves on the copy engine. Same kernel arithmetic,
    so the result is bit-identical. Returns None, having written nothing,
    when the call cannot pipeline.
    """
    # under graph capture the forward keeps the in-place norm, and the pipeline
    # runs from the attention core's eager break point instead
    if (
        envs.SGLANG_DIFFUSION_ULYSSES_PIPELINE_GROUPS in (0, 1)
        or torch.cuda.is_current_stream_capturing()
    ):
        return None
    _minimax_h3_bind_attention_backend(attention, q.dtype)
    cos_sin_cache, positions = rope_cache
    head_dim = attention.head_dim
    q_weight, k_weight = attention.q_norm.weight, attention.k_norm.weight

    def fill(
        head_start: int, head_count: int, q_dst: torch.Tensor, k_dst: torch.Tensor
    ) -> None:
        heads = slice(head_start, head_start + head_count)
        fused_qknorm_rope_out_of_place(
            q[:, heads],
            k[:, heads],
            q_dst,
            k_dst,
            q_weight,
            k_weight,
            cos_sin_cache,
            positions,
            is_neox=True,
            eps=attention.q_norm.eps,
            head_dim=head_dim,
            rope_dim=cos_sin_cache.shape[-1],
            round_norm_before_rope=True,
        )

    return _minimax_h3_pipelined_dense_attention(
        attention,
        q,
        k,
        v,
        cu_seqlens=cu_seqlens,
        cu_seqlens_host=cu_seqlens_host,
        max_seqlen=max_seqlen,
        fill=fill,
    )


def _minimax_h3_attention_core_impl(
    attention: MiniMaxH3Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: tuple[int, ...] | None,
    max_seqlen: int,
    ulysses_active: bool,
    subblock_sparse_query_block_mask: torch.Tensor | None = None,
    ring_active: bool = False,
    gate_compress: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dynamic varlen attention and Ulysses/Ring collectives.

    This is the narrow BCG break point: projections, normalization, RoPE,
    residuals, and MLPs remain captured while the dynamic packed attention
    kernel and sequence-parallel collectives execute eagerly.
    """

    _minimax_h3_bind_attention_backend(attention, q.dtype)

    if ulysses_active and not ring_active and gate_compress is None:
        out = _minimax_h3_pipelined_dense_attention(
            attention,
            q,
            k,
            v,
            cu_seqlens=cu_seqlens,
            cu_seqlens_host=cu_seqlens_host,
            max_seqlen=max_seqlen,
        )
        if out is not None:
            return out

    if ulysses_active:
        from sglang.multimodal_gen.runtime.layers.usp import (
            _usp_all_gather,
            _usp_input_all_to_all_packed_qkv,
            _usp_output_all_to_all,
        )

        q, k, v = _usp_input_all_to_all_packed_qkv(q, k, v)

    if attention._attention_backend_enum is AttentionBackendEnum.VIDEO_SPARSE_ATTN_H3:
        attn_metadata = (
            get_forward_context().attn_metadata
            if attention.prefix.startswith("blocks.")
            else None
        )
        # the gate stays on this rank's row shard; fold it after the output all-to-all
        fold_after_exchange = ulysses_active and gate_compress is not None
        attn_result = attention._attention_impl.forward_varlen(
            q,
            k,
            v,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            cu_seqlens_host=cu_seqlens_host,
            attn_metadata=attn_metadata,
            gate_compress=None if fold_after_exchange else gate_compress,
            return_compress=fold_after_exchange,
        )
        if fold_after_exchange:
            out, out_compress = attn_result
        else:
            out = attn_result
        if ulysses_active:
            out = _usp_output_all_to_all(out[None], head_dim=2)[0]
        if fold_after_exchange:
            _, ulysses_rank = get_ulysses_ctx()
            vsa_h3_fold_gate(
                out,
                gate_compress,
                _usp_all_gather(out_compress),
                attn_metadata,
                row_start=ulysses_rank * out.shape[0],
            )
        return out

    if ring_active:
        ring_ws, _ = get_ring_ctx()
        if attention._attention_backend_enum is not AttentionBackendEnum.FA:
            raise NotImplementedError(
                "MiniMax H3 ring parallelism requires the FlashAttention "
                "backend (matches --ring-degree's general restriction)."
            )
        # max_seqlen is cu_seqlens[1] (`used`) by construction -- the real,
        # non-padding row count ring needs, already a host int here.
        out = _ring_attention_varlen(
            q,
            k,
            v,
            attn_impl=attention._attention_impl,
            real_seq_len=max_seqlen,
            ring_ws=ring_ws,
        )
    else:
        if (
            attention._attention_backend_enum
            is AttentionBackendEnum.SUBBLOCK_SPARSE_ATTN
        ):
            impl = attention._attention_impl
            sparse_will_run = (
                cu_seqlens_host is not None
                and impl._sparse_ready(q, k)
                and any(
                    stop - start >= impl.schedule.min_seq_len
                    for start, stop in itertools.pairwise(cu_seqlens_host)
                )
            )
            if sparse_will_run and subblock_sparse_query_block_mask is None:
                raise ValueError(
                    "MiniMax H3 requires subblock_sparse_query_block_mask "
                    "when SubBlock sparse attention is active"
                )
            out = attention._attention_impl.forward_varlen(
                q,
                k,
                v,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                cu_seqlens_host=cu_seqlens_host,
                first_segment_sparse_query_block_mask=(
                    subblock_sparse_query_block_mask
                ),
            )
        else:
            out = attention._attention_impl.forward_varlen(
                q,
                k,
                v,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                cu_seqlens_host=cu_seqlens_host,
            )
    if ulysses_active:
        out = _usp_output_all_to_all(out[None], head_dim=2)[0]
    return out


@eager_on_graph
def _minimax_h3_attention_core_bcg(*args, out: torch.Tensor, **kwargs) -> None:
    result = _minimax_h3_attention_core_impl(*args, **kwargs)
    # copy_ would broadcast a mispredicted shape or cast a dtype silently.
    assert out.shape == result.shape and out.dtype == result.dtype, (
        "MiniMax-H3 attention output mispredicted"
    )
    out.copy_(result)


class MiniMaxH3Attention(nn.Module):
    def __init__(
        self,
        arch: MiniMaxH3DiTArchConfig,
        quant_config: QuantizationConfig | None,
        *,
        prefix: str,
        bcg_breakpoint: bool = True,
        cube_sparse_capable: bool = True,
    ) -> None:
        super().__init__()
        self.bcg_breakpoint = bcg_breakpoint
        self.tp_size = get_tp_world_size()
        if arch.num_attention_heads % self.tp_size:
            raise ValueError(
                "MiniMax H3 attention heads must be divisible by TP size: "
                f"{arch.num_attention_heads} % {self.tp_size} != 0"
            )
        self.total_num_heads = arch.num_attention_heads
        self.num_heads = self.total_num_heads // self.tp_size
        self.head_dim = arch.attention_head_dim
        self.inner_dim = self.total_num_heads * self.head_dim
        self.local_inner_dim = self.num_heads * self.head_dim
        self.softmax_scale = self.head_dim**-0.5
        self.prefix = prefix
        self._attention_impl = None
        self._attention_backend_enum: AttentionBackendEnum | None = None
        # attention initializes on the first real QKV tensors, after the
        # component-loading context has ended; retain the transformer-scoped
        # selection so a component override is not silently lost at runtime
        self._selected_attention_backend = get_component_forced_attn_backend()
        # Cube metadata describes only the packed multimodal sequence. The
        # text-only token refiner must preserve the exact dense FA baseline.
        self._cube_sparse_capable = cube_sparse_capable
        # The checkpoint stores one fused qkv tensor. Each logical Q/K/V
        # matrix must be sharded independently; a plain ColumnParallelLinear
        # would instead slice across the concatenated tensor and is incorrect
        # for TP > 1.
        self.qkv_proj = MergedColumnParallelLinear(
            arch.hidden_size,
            [self.inner_dim] * 3,
            bias=False,
            gather_output=False,
            params_dtype=_BF16_DTYPE,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        # explicit layout overrides checkpoint metadata and quantization inference
        if arch.checkpoint_qkv_layout is not None:
            checkpoint_qkv_is_native = arch.checkpoint_qkv_layout == "native"
        else:
            checkpoint_qkv_is_native = quant_config is not None and (
                quant_config.get_name() == "gguf"
                or quant_config.checkpoint_uses_native_qkv_layout
            )
            checkpoint_qkv_is_native = (
                checkpoint_qkv_is_native
                or arch.checkpoint_uses_diffusers_layout
                or not arch.qkv_checkpoint_grouped
            )
        if not checkpoint_qkv_is_native:
            self._install_qkv_weight_loader(arch)
        self.q_norm = _norm(arch.attention_head_dim, eps=arch.qk_norm_eps)
        self.k_norm = _norm(arch.attention_head_dim, eps=arch.qk_norm_eps)
        # cache width covers cos/sin for temporal, height, and width frequencies
        rope_dim = 6 * arch.rope_inv_freq_len
        # Not apply_qk_norm_rope: Q/K are [tokens, heads, head_dim] and the norms
        # are torch nn.RMSNorm, so the fused kernel is called directly.
        self._use_fused_qknorm_rope = (
            current_platform.is_cuda()
            and can_use_fused_inplace_qknorm_rope(
                arch.attention_head_dim,
                rope_dim,
                True,
                _BF16_DTYPE,
                cache_dtype=_BF16_DTYPE,
                round_norm_before_rope=True,
            )
        )
        self.out_proj = RowParallelLinear(
            self.inner_dim,
            arch.hidden_size,
            bias=False,
            input_is_parallel=True,
            params_dtype=_BF16_DTYPE,
            quant_config=quant_config,
            prefix=f"{prefix}.out_proj",
        )
        # VSA compression gate; stays bf16 and unquantized (zero gate == pure sparse).
        self.to_gate_compress: ColumnParallelLinear | None = None
        if arch.has_gate_compress and prefix.startswith("blocks."):
            self.to_gate_compress = ColumnParallelLinear(
                arch.hidden_size,
                self.inner_dim,
                bias=False,
                gather_output=False,
                params_dtype=_BF16_DTYPE,
                quant_config=None,
                prefix=f"{prefix}.to_gate_compress",
            )
        # VDN-H3: None for the dense model and for the token refiner
        self.hybrid = MiniMaxH3VDNHybridAttention.build(
            arch, quant_config, prefix=prefix, local_heads=self.num_heads
        )

    def _set_attention_backend(self, backend) -> None:
        if (
            backend.get_enum() is AttentionBackendEnum.CUBE_SPARSE_ATTN
            and not self._cube_sparse_capable
        ):
            backend = get_attn_backend(
                self.head_dim,
                _BF16_DTYPE,
                selected_attention_backend=AttentionBackendEnum.FA,
            )
        impl_cls = backend.get_impl_cls()
        self._attention_impl = impl_cls(
            num_heads=self.num_heads,
            head_size=self.head_dim,
            causal=False,
            softmax_scale=self.softmax_scale,
            num_kv_heads=self.num_heads,
            prefix=self.prefix,
            packed_trailing_padding=True,
        )
        # Ring only supports FA (see _minimax_h3_attention_core_impl); keep
        # the resolved enum alongside the impl instance instead of a second
        # get_attn_backend() call at the ring gate.
        self._attention_backend_enum = backend.get_enum()

    def _install_qkv_weight_loader(self, arch: MiniMaxH3DiTArchConfig) -> None:
        weight = self.qkv_proj.weight
        # h3 checkpoints interleave each attention head's Q, K, and V rows
        # this parameter needs reordering before the native QKV projection
        weight.checkpoint_mapping_unsafe = True
        base_loader = weight.weight_loader

        def _make_row_reorder(
            head_dim: int,
        ) -> Callable[[torch.Tensor], torch.Tensor]:
            def _reorder(loaded_weight: torch.Tensor) -> torch.Tensor:
                return _reorder_grouped_qkv_to_qkv(
                    loaded_weight,
                    num_query_groups=arch.num_attention_heads,
                    heads_per_group=1,
                    head_dim=head_dim,
                )

            return _reorder

        _reorder_checkpoint_weight = _make_row_reorder(arch.attention_head_dim)

        def _weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
            # The grouped checkpoint layout is
            # [num_query_groups, q_per_group + k + v] before splitting.
            # MiniMax H3 uses MHA, so checkpoint rows are per-head [q, k, v],
            # while SGLang stores [q_all, k_all, v_all].
            if _copy_grouped_qkv_tp_shard(
                param,
                loaded_weight,
                num_query_groups=arch.num_attention_heads,
                head_dim=arch.attention_head_dim,
                tp_rank=self.qkv_proj.tp_rank,
                tp_size=self.tp_size,
            ):
                return
            base_loader(param, _reorder_checkpoint_weight(loaded_weight))

        if hasattr(weight, "_weight_loader"):
            weight._weight_loader = _weight_loader
        else:
            weight.weight_loader = _weight_loader
        # rank-local FSDP must reorder grouped QKV before selecting each shard
        weight.rank_local_weight_transform = _reorder_checkpoint_weight

        # A quantized checkpoint stores metadata indexed by output row next to the
        # rows themselves (NVFP4 block scales, fp8 per-channel scales). Those rows
        # are permuted above, so the per-row metadata has to be permuted the same
        # way. Row count is the gate: a swizzled scale layout is not row-indexed,
        # and per-tensor scales are scalars, so both are passed through untouched.
        # A block-FP8 scale is row-indexed too, but in blocks rather than rows:
        # it carries one row per block of weight rows, so both its permutation
        # and the row count gating it are scaled down by the block height.
        qkv_rows = 3 * arch.num_attention_heads * arch.attention_head_dim
        block_rows = _qkv_scale_block_rows(self.qkv_proj, arch.attention_head_dim)
        for name, param in self.qkv_proj.named_parameters(recurse=False):
            if name == "weight":
                continue
            rows_per_scale_row = (
                block_rows if isinstance(param, BlockQuantScaleParameter) else 1
            )
            _install_qkv_row_reorder(
                param,
                _make_row_reorder(arch.attention_head_dim // rows_per_scale_row),
                qkv_rows // rows_per_scale_row,
            )

    def _forward_mps_streamed_attention(
        self,
        x: torch.Tensor,
        *,
        rope_cache: tuple[torch.Tensor, torch.Tensor] | None,
        cu_seqlens: torch.Tensor,
        cu_seqlens_host: tuple[int, ...] | None,
        max_seqlen: int,
    ) -> torch.Tensor:
        """Run MPS attention without materializing the full QKV activation.

        H3's fused QKV output alone is roughly 1.45 GiB at 768px.  MPS shares
        unified memory with the host, so retaining it alongside the packed
        residual and SDPA workspace can evict the OS.  Build normalized K/V
        once, then project Q a small chunk at a time and immediately consume it
        through attention and the output projection.  The formula, weights,
        and complete K/V context are unchanged; this is intentionally limited
        to single-device MPS where Ulysses collectives are not active.
        """
        total = x.shape[0]
        key = torch.empty(
            (total, self.num_heads, self.head_dim), dtype=x.dtype, device=x.device
        )
        value = torch.empty_like(key)
        cos_sin_cache = None if rope_cache is None else rope_cache[0]

        # Do not retain Q while producing the K/V cache.  Dropping the chunk
        # before the next transfer keeps only two full-width attention tensors.
        for start in range(0, total, _MPS_QKV_PROJECTION_TOKEN_CHUNK_SIZE):
            stop = min(start + _MPS_QKV_PROJECTION_TOKEN_CHUNK_SIZE, total)
            qkv, _ = self.qkv_proj(x[start:stop])
            q_chunk, k_chunk, v_chunk = qkv.split(self.local_inner_dim, dim=-1)
            del q_chunk
            k_chunk = self.k_norm(k_chunk.view(-1, self.num_heads, self.head_dim))
            if cos_sin_cache is not None:
                k_chunk = _apply_rope(k_chunk, cos_sin_cache[start:stop])
            key[start:stop].copy_(k_chunk)
            value[start:stop].copy_(v_chunk.view(-1, self.num_heads, self.head_dim))
            del qkv, k_chunk, v_chunk
            torch.mps.synchronize()
            torch.mps.empty_cache()

        if self._attention_impl is None:
            self._set_attention_backend(
                get_attn_backend(
                    self.head_dim,
                    x.dtype,
                    attention_requirements=AttentionRequirements(packed_varlen=True),
                )
            )
        bounds = (
            cu_seqlens_host
            if cu_seqlens_host is not None
            else tuple(int(item) for item in cu_seqlens.tolist())
        )
        out = torch.empty_like(x)
        for sequence_start, sequence_stop in itertools.pairwise(bounds):
            if sequence_start == sequence_stop:
                continue
            keys = key[sequence_start:sequence_stop].unsqueeze(0)
            values = value[sequence_start:sequence_stop].unsqueeze(0)
            for start in range(
                sequence_start,
                sequence_stop,
                _MPS_QKV_PROJECTION_TOKEN_CHUNK_SIZE,
            ):
                stop = min(start + _MPS_QKV_PROJECTION_TOKEN_CHUNK_SIZE, sequence_stop)
                qkv, _ = self.qkv_proj(x[start:stop])
                q_chunk, k_chunk, v_chunk = qkv.split(self.local_inner_dim, dim=-1)
                del k_chunk, v_chunk
                for query_start in range(
                    start, stop, _MPS_ATTENTION_QUERY_TOKEN_CHUNK_SIZE
                ):
                    query_stop = min(
                        query_start + _MPS_ATTENTION_QUERY_TOKEN_CHUNK_SIZE, stop
                    )
                    q = self.q_norm(
                        q_chunk[query_start - start : query_stop - start].view(
                            -1, self.num_heads, self.head_dim
                        )
                    )
                    if cos_sin_cache is not None:
                        q = _apply_rope(q, cos_sin_cache[query_start:query_stop])
                    attention_out = self._attention_impl.forward(
                        q.unsqueeze(0), keys, values, None
                    )[0]
                    projected, _ = self.out_proj(
                        attention_out.reshape(
                            query_stop - query_start, self.local_inner_dim
                        )
                    )
                    out[query_start:query_stop].copy_(projected)
                    del q, attention_out, projected
                del qkv, q_chunk
                torch.mps.synchronize()
                torch.mps.empty_cache()

        del key, value
        torch.mps.empty_cache()
        return out

    def forward(
        self,
        x: torch.Tensor,
        *,
        rope_cache: tuple[torch.Tensor, torch.Tensor] | None,
        cu_seqlens: torch.Tensor,
        cu_seqlens_host: tuple[int, ...] | None = None,
        max_seqlen: int,
        subblock_sparse_query_block_mask: torch.Tensor | None = None,
        ulysses_active: bool = False,
        ring_active: bool = False,
        x_prequant: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x: [T, hidden] packed thd rows -> [T, hidden].

        ``x_prequant``: ``x`` already quantized for ``qkv_proj`` as ``(fp8, scales)``.

        Operation order: fused qkv projection -> per-head q/k RMSNorm -> RoPE
        on q/k -> variable-length non-causal flash attention -> output projection.

        With Ulysses sequence parallelism, x holds this rank's row shard;
        qkv/norm/RoPE run locally, an all-to-all trades sequence for heads.
        Each rank attends the full sequence with heads/world_size local heads,
        so cu_seqlens retains global packed-document semantics. The inverse
        all-to-all restores the row shard before the output projection.
        """
        if x.device.type == "mps" and not ulysses_active:
            return self._forward_mps_streamed_attention(
                x,
                rope_cache=rope_cache,
                cu_seqlens=cu_seqlens,
                cu_seqlens_host=cu_seqlens_host,
                max_seqlen=max_seqlen,
            )

        total = x.shape[0]
        qkv, _ = self.qkv_proj(x if x_prequant is None else x_prequant)
        q, k, v = qkv.split(self.local_inner_dim, dim=-1)
        q = q.view(total, self.num_heads, self.head_dim)
        k = k.view(total, self.num_heads, self.head_dim)
        v = v.view(total, self.num_heads, self.head_dim)
        if (
            self.hybrid is not None
            and self._attention_backend_enum
            is AttentionBackendEnum.HYBRID_WINDOW_ATTN_H3
        ):
            return self.hybrid(
                self,
                x,
                q,
                k,
                v,
                rope_cache=rope_cache,
                cu_seqlens=cu_seqlens,
                cu_seqlens_host=cu_seqlens_host,
                max_seqlen=max_seqlen,
                ulysses_active=ulysses_active,
                ring_active=ring_active,
            )
        # The fused qk-norm/RoPE, pipelined Ulysses exchange and attention kernels
        # are untraceable, and the traceable fallback is slower than eager, so a
        # compiled DiT runs this section eager and compiles around it.
        attend = self._attend_eager if torch.compiler.is_compiling() else self._attend
        out = attend(
            x,
            q,
            k,
            v,
            rope_cache=rope_cache,
            cu_seqlens=cu_seqlens,
            cu_seqlens_host=cu_seqlens_host,
            max_seqlen=max_seqlen,
            subblock_sparse_query_block_mask=subblock_sparse_query_block_mask,
            ulysses_active=ulysses_active,
            ring_active=ring_active,
        )
        out, _ = self.out_proj(out)
        return out

    def _attend(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        rope_cache: tuple[torch.Tensor, torch.Tensor] | None,
        cu_seqlens: torch.Tensor,
        cu_seqlens_host: tuple[int, ...] | None,
        max_seqlen: int,
        subblock_sparse_query_block_mask: torch.Tensor | None,
        ulysses_active: bool,
        ring_active: bool,
    ) -> torch.Tensor:
        """q/k/v [T, heads, head_dim] -> attention output [T, heads * head_dim]."""
        total = x.shape[0]
        if rope_cache is None:
            q, k = _apply_qk_norm(
                q,
                k,
                self.q_norm,
                self.k_norm,
                self.head_dim,
            )
        else:
            cos_sin_cache, positions = rope_cache
            if self._use_fused_qknorm_rope:
                if ulysses_active and not ring_active:
                    out = _minimax_h3_qknorm_rope_pipelined_attention(
                        self,
                        q,
                        k,
                        v,
                        rope_cache,
                        cu_seqlens=cu_seqlens,
                        cu_seqlens_host=cu_seqlens_host,
                        max_seqlen=max_seqlen,
                    )
                    if out is not None:
                        return out.reshape(total, self.num_heads * self.head_dim)
                fused_inplace_qknorm_rope(
                    q,
                    k,
                    self.q_norm.weight,
                    self.k_norm.weight,
                    cos_sin_cache,
                    positions,
                    is_neox=True,
                    eps=self.q_norm.eps,
                    head_dim=self.head_dim,
                    rope_dim=cos_sin_cache.shape[-1],
                    round_norm_before_rope=True,
                )
            else:
                q, k = _apply_qk_norm(
                    q,
                    k,
                    self.q_norm,
                    self.k_norm,
                    self.head_dim,
                )
                q, k = _apply_rope_qk(q, k, cos_sin_cache, positions)

        gate_compress = None
        if (
            self._attention_backend_enum is AttentionBackendEnum.VIDEO_SPARSE_ATTN_H3
            and self.to_gate_compress is not None
        ):
            gate_flat, _ = self.to_gate_compress(x)
            gate_compress = gate_flat.view(total, self.num_heads, self.head_dim)

        core_kwargs = dict(
            cu_seqlens=cu_seqlens,
            cu_seqlens_host=cu_seqlens_host,
            max_seqlen=max_seqlen,
            subblock_sparse_query_block_mask=subblock_sparse_query_block_mask,
            ulysses_active=ulysses_active,
            ring_active=ring_active,
            gate_compress=gate_compress,
        )
        if self.bcg_breakpoint and is_in_breakable_cuda_graph():
            out = q.new_empty(q.shape)
            _minimax_h3_attention_core_bcg(self, q, k, v, out=out, **core_kwargs)
        else:
            out = _minimax_h3_attention_core_impl(self, q, k, v, **core_kwargs)
        return out.reshape(total, self.num_heads * self.head_dim)

    _attend_eager = torch.compiler.disable(_attend)


class MiniMaxH3MLP(nn.Module):
    def __init__(
        self,
        arch: MiniMaxH3DiTArchConfig,
        quant_config: QuantizationConfig | None,
        *,
        prefix: str,
    ) -> None:
        super().__init__()
        # As with qkv, gate and up are two independently sharded logical
        # matrices even though the checkpoint stores them fused.
        self.fc1 = MergedColumnParallelLinear(
            arch.hidden_size,
            [arch.ffn_hidden_size] * 2,
            bias=False,
            gather_output=False,
            params_dtype=_BF16_DTYPE,
            quant_config=quant_config,
            prefix=f"{prefix}.fc1",
        )
        # Chunk the fused fc1 output as [gate, up], then compute
        # silu(gate) * up.
        self.fc2 = RowParallelLinear(
            arch.ffn_hidden_size,
            arch.hidden_size,
            bias=False,
            input_is_parallel=True,
            params_dtype=_BF16_DTYPE,
            quant_config=quant_config,
            prefix=f"{prefix}.fc2",
        )
        self.reuse_fc1_activation = quant_config is None or (
            quant_config.get_name() == "gguf"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, tuple) and x.device.type == "mps":
            out = torch.empty_like(x)
            for start in range(0, x.shape[0], _MPS_MLP_TOKEN_CHUNK_SIZE):
                stop = min(start + _MPS_MLP_TOKEN_CHUNK_SIZE, x.shape[0])
                hidden, _ = self.fc1(x[start:stop])
                hidden = _silu_mul(hidden, reuse_input=self.reuse_fc1_activation)
                chunk, _ = self.fc2(hidden)
                out[start:stop].copy_(chunk)
                del hidden, chunk
                torch.mps.synchronize()
                torch.mps.empty_cache()
            return out
        hidden, _ = self.fc1(x)
        if _accepts_mxfp8_input(self.fc2) and can_use_silu_mul_mxfp8(hidden):
            out, _ = self.fc2(silu_mul_mxfp8(hidden))
            return out
        hidden = _silu_mul(hidden, reuse_input=self.reuse_fc1_activation)
        out, _ = self.fc2(hidden)
        return out


class MiniMaxH3AdalnProj(nn.Module):
    """SiLU + zero-init linear over unique condition embeddings.

    Per block, three modalities each produce six H-wide vectors:
    [M, t_dim] -> [M, 3*6H] -> view(M*3, 6H) -> chunk(6).
    The final layer uses one modality and produces two H-wide vectors:
    [M, t_dim] -> [M, 2H] -> chunk(2).
    """

    def __init__(
        self,
        arch: MiniMaxH3DiTArchConfig,
        out_features: int,
        quant_config: QuantizationConfig | None,
        *,
        prefix: str,
        expand_ratio: int,
        modality_num: int,
    ) -> None:
        super().__init__()
        if out_features != expand_ratio * arch.hidden_size * modality_num:
            raise ValueError(
                "adaln out_features mismatch: "
                f"{out_features} != {expand_ratio}*{arch.hidden_size}*{modality_num}"
            )
        self.expand_ratio = expand_ratio
        self.modality_num = modality_num
        self.hidden_size = arch.hidden_size
        # Curve checkpoints store both the sampled curve and their reduced
        # AdaLN projections in FP32. Preserve that precision island to match
        # the published pruned implementation; these outputs intentionally do
        # not enter the BF16-only fused modulation kernels.
        params_dtype = _FP32_DTYPE if arch.adaln_curve_grid is not None else _BF16_DTYPE
        self.linear = ColumnParallelLinear(
            arch.time_embed_dim,
            out_features,
            bias=True,
            gather_output=False,
            params_dtype=params_dtype,
            quant_config=quant_config,
            prefix=f"{prefix}.linear",
        )

    def project_local(self, adaln_input: torch.Tensor) -> torch.Tensor:
        x, _ = self.linear(adaln_input)
        return x

    def split_output(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = x.shape[0]
        x = x.view(m * self.modality_num, self.expand_ratio * self.hidden_size)
        return tuple(x.chunk(self.expand_ratio, dim=-1))

    def forward(self, adaln_input: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Project the post-SiLU embedding in its checkpoint-defined dtype."""
        x = self.project_local(adaln_input)
        if get_tp_world_size() > 1:
            x = tensor_model_parallel_all_gather(x)
        return self.split_output(x)


class MiniMaxH3TokenRefinerBlock(nn.Module):
    """Standard pre-norm transformer block without AdaLN or RoPE."""

    def __init__(
        self,
        arch: MiniMaxH3DiTArchConfig,
        quant_config: QuantizationConfig | None,
        *,
        prefix: str,
    ) -> None:
        super().__init__()
        self.norm1 = _norm(arch.hidden_size, eps=arch.norm_eps)
        self.norm2 = _norm(arch.hidden_size, eps=arch.norm_eps)
        # The whole dynamic text-refiner/scatter phase is one BCG break point;
        # do not nest per-attention graph breaks inside it.
        self.attn = MiniMaxH3Attention(
            arch,
            quant_config,
            prefix=f"{prefix}.attn",
            bcg_breakpoint=False,
            cube_sparse_capable=False,
        )
        self.mlp = MiniMaxH3MLP(arch, quant_config, prefix=f"{prefix}.mlp")

    def forward(
        self,
        x: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor,
        cu_seqlens_host: tuple[int, ...] | None = None,
        max_seqlen: int,
    ) -> torch.Tensor:
        x = x + self.attn(
            self.norm1(x),
            rope_cache=None,
            cu_seqlens=cu_seqlens,
            cu_seqlens_host=cu_seqlens_host,
            max_seqlen=max_seqlen,
        )
        x = x + self.mlp(self.norm2(x))
        return x


class MiniMaxH3TokenRefiner(nn.Module):
    def __init__(
        self,
        arch: MiniMaxH3DiTArchConfig,
        quant_config: QuantizationConfig | None,
        *,
        prefix: str,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                MiniMaxH3TokenRefinerBlock(
                    arch,
                    quant_config,
                    prefix=f"{prefix}.blocks.{index}",
                )
                for index in range(arch.token_refiner_num_layers)
            ]
        )
        self.final_norm = _norm(arch.hidden_size, eps=arch.final_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor,
        cu_seqlens_host: tuple[int, ...] | None = None,
        max_seqlen: int,
    ) -> torch.Tensor:
        for block in self.blocks:
            x = block(
                x,
                cu_seqlens=cu_seqlens,
                cu_seqlens_host=cu_seqlens_host,
                max_seqlen=max_seqlen,
            )
        return self.final_norm(x)


class MiniMaxH3DiTBlock(nn.Module):
    def __init__(
        self,
        arch: MiniMaxH3DiTArchConfig,
        quant_config: QuantizationConfig | None,
        *,
        prefix: str,
        use_adaln_cache: bool = False,
    ) -> None:
        super().__init__()
        self.norm1 = _norm(arch.hidden_size, eps=arch.norm_eps)
        self.norm2 = _norm(arch.hidden_size, eps=arch.norm_eps)
        MINIMAX_H3_NORM_MODULATE.mark(self)
        self.attn = MiniMaxH3Attention(
            arch,
            quant_config,
            prefix=f"{prefix}.attn",
        )
        self.mlp = MiniMaxH3MLP(arch, quant_config, prefix=f"{prefix}.mlp")
        self.adaln_proj = (
            None
            if use_adaln_cache
            else MiniMaxH3AdalnProj(
                arch,
                arch.adaln_out_features,
                quant_config,
                prefix=f"{prefix}.adaln_proj",
                expand_ratio=6,
                modality_num=MINIMAX_H3_ADALN_MODALITY_NUM,
            )
        )
        self.preserve_input_for_cache_dit = False

    def forward(
        self,
        x: torch.Tensor,
        *,
        adaln_input: torch.Tensor,
        combined_indices: torch.Tensor,
        rope_cache: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: torch.Tensor,
        cu_seqlens_host: tuple[int, ...] | None = None,
        max_seqlen: int,
        subblock_sparse_query_block_mask: torch.Tensor | None = None,
        ulysses_active: bool = False,
        ring_active: bool = False,
        adaln_params: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """x: [T, H]; adaln_input: [M, t_dim]; combined_indices: [T]
        (= inverse_indices * modality_num + token_tags.clamp(min=0)).

        Each block computes AdaLN parameters once, then applies
        norm1 -> scale/shift -> attention -> gated residual, followed by
        norm2 -> scale/shift -> MLP -> gated residual.
        """
        if adaln_params is None:
            if self.adaln_proj is None:
                raise ValueError("MiniMax H3 AdaLN cache parameters are required")
            adaln_params = self.adaln_proj(adaln_input)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = adaln_params
        # Cache-DiT retains the inputs to its Fn and Mn block ranges. Only the
        # first gated residual writes to that tensor; the second one operates on
        # a block-local buffer.
        residual = x
        h_prequant = None
        if _accepts_mxfp8_input(self.attn.qkv_proj):
            h = self.norm1(x)
            if can_use_mxfp8_swizzled(h):
                # the bf16 modulated rows stay in h for the VDN branch projections
                h, h_fp8, h_scales = indexed_scale_shift_mxfp8_(
                    h, shift_msa, scale_msa, combined_indices, keep_bf16=True
                )
                h_prequant = (h_fp8, h_scales)
            else:
                h = _modulate_scale_shift(
                    h, shift_msa, scale_msa, combined_indices, dtype=_BF16_DTYPE
                )
        else:
            h = _modulate_rmsnorm_scale_shift(
                x,
                self.norm1,
                shift_msa,
                scale_msa,
                combined_indices,
                dtype=_BF16_DTYPE,
                fused=MINIMAX_H3_NORM_MODULATE.is_enabled(self),
            )
        h = self.attn(
            h,
            x_prequant=h_prequant,
            rope_cache=rope_cache,
            cu_seqlens=cu_seqlens,
            cu_seqlens_host=cu_seqlens_host,
            max_seqlen=max_seqlen,
            subblock_sparse_query_block_mask=subblock_sparse_query_block_mask,
            ulysses_active=ulysses_active,
            ring_active=ring_active,
        )
        x = _modulate_gate(
            residual,
            gate_msa,
            h,
            combined_indices,
            dtype=_BF16_DTYPE,
            allow_inplace=not self.preserve_input_for_cache_dit,
        )

        residual = x
        if _accepts_mxfp8_input(self.mlp.fc1):
            h = self.norm2(x)
            if can_use_mxfp8_swizzled(h):
                _, h_fp8, h_scales = indexed_scale_shift_mxfp8_(
                    h, shift_mlp, scale_mlp, combined_indices, keep_bf16=False
                )
                h = self.mlp((h_fp8, h_scales))
            else:
                h = _modulate_scale_shift(
                    h, shift_mlp, scale_mlp, combined_indices, dtype=_BF16_DTYPE
                )
                h = self.mlp(h)
        else:
            h = _modulate_rmsnorm_scale_shift(
                x,
                self.norm2,
                shift_mlp,
                scale_mlp,
                combined_indices,
                dtype=_BF16_DTYPE,
                fused=MINIMAX_H3_NORM_MODULATE.is_enabled(self),
            )
            h = self.mlp(h)
        # `residual` is block-local here (see above), so this stays in-place
        # even while Cache-DiT is attached.
        return _modulate_gate(
            residual,
            gate_mlp,
            h,
            combined_indices,
            dtype=_BF16_DTYPE,
        )


class MiniMaxH3FinalLayer(nn.Module):
    def __init__(
        self,
        arch: MiniMaxH3DiTArchConfig,
        quant_config: QuantizationConfig | None,
        *,
        prefix: str,
        use_adaln_cache: bool = False,
    ) -> None:
        super().__init__()
        video_patch_dim = (
            arch.latents_dim
            * arch.patch_size[0]
            * arch.patch_size[1]
            * arch.patch_size[2]
        )
        self.norm = _norm(arch.hidden_size, eps=arch.final_norm_eps)
        self.adaln_proj = (
            None
            if use_adaln_cache
            else MiniMaxH3AdalnProj(
                arch,
                arch.final_adaln_out_features,
                quant_config,
                prefix=f"{prefix}.adaln_proj",
                expand_ratio=2,
                modality_num=1,
            )
        )
        self.video_out = ColumnParallelLinear(
            arch.hidden_size,
            video_patch_dim,
            bias=True,
            gather_output=False,
            params_dtype=_FP32_DTYPE,
            quant_config=None,
            prefix=f"{prefix}.video_out",
        )
        self.audio_out = ColumnParallelLinear(
            arch.hidden_size,
            arch.audio_latents_dim,
            bias=True,
            gather_output=False,
            params_dtype=_FP32_DTYPE,
            quant_config=None,
            prefix=f"{prefix}.audio_out",
        )
        # Parallel Decoding Distillation heads, one per denoise step, loaded by
        # `load_pdd_fused_heads`. None on every ordinary run.
        self._pdd_heads: dict[str, torch.Tensor] | None = None
        # (name, device, dtype) -> that head's stacked (weight, bias), uploaded once
        self._pdd_device_heads: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def load_pdd_fused_heads(self, path: str) -> None:
        """Swap the two output heads for a per-step stack (PDD).

        PDD replicates the final linear layer once per time interval and lets one
        backbone evaluation advance a whole block of them; the per-block heads
        fuse into one because H3's euler-eta0 step is linear in the predicted
        velocity. `tools/fuse_minimax_h3_pdd_heads.py` does that fusion offline,
        leaving one head per denoise step.
        """
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            heads = {k: f.get_tensor(k) for k in f.keys()}
        steps = heads["video_out.weight"].shape[0]
        for name in ("video_out", "audio_out"):
            projection = getattr(self, name)
            for suffix, shape in (
                ("weight", (steps, projection.output_size, projection.input_size)),
                ("bias", (steps, projection.output_size)),
            ):
                key = f"{name}.{suffix}"
                if steps == 0 or heads[key].shape != shape:
                    raise ValueError(f"MiniMax-H3 PDD {key} must have shape {shape}")
                width = projection.output_size_per_partition
                heads[key] = heads[key].narrow(1, projection.tp_rank * width, width)
        self._pdd_heads = heads
        self._pdd_device_heads = {}
        logger.info("MiniMax-H3 PDD: %d fused output heads loaded from %s", steps, path)

    def _pdd_project(self, h: torch.Tensor, name: str) -> torch.Tensor:
        heads = self._pdd_heads
        step = int(get_forward_context().current_timestep)
        stack = heads[f"{name}.weight"]
        if not 0 <= step < stack.shape[0]:
            raise ValueError(
                f"MiniMax-H3 PDD has {stack.shape[0]} fused heads but the loop is at "
                f"step {step}; run with --num-inference-steps {stack.shape[0]} "
                "(num_inference_steps counts denoise transitions)."
            )
        key = (name, h.device, h.dtype)
        if key not in self._pdd_device_heads:
            self._pdd_device_heads[key] = (
                stack.to(device=h.device, dtype=h.dtype),
                heads[f"{name}.bias"].to(device=h.device, dtype=h.dtype),
            )
        weight, bias = self._pdd_device_heads[key]
        return torch.nn.functional.linear(h, weight[step], bias[step])

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pdd_heads is not None:
            return self._pdd_project(h, "video_out"), self._pdd_project(h, "audio_out")
        video, _ = self.video_out(h)
        audio, _ = self.audio_out(h)
        return video, audio

    def forward(
        self,
        x: torch.Tensor,
        *,
        adaln_input: torch.Tensor,
        inverse_indices: torch.Tensor,
        adaln_params: tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Project all rows into TP-local video/audio output shards.

        Apply single-modality shift/scale AdaLN to the final normalized
        activations, cast to fp32, then apply both output heads to all rows.
        The model gathers output columns only after selecting live media rows,
        preserving the GEMM shape while reducing collective payload.
        """
        if adaln_params is None:
            if self.adaln_proj is None:
                raise ValueError("MiniMax H3 AdaLN cache parameters are required")
            adaln_params = self.adaln_proj(adaln_input)
        shift, scale = adaln_params
        if x.device.type == "mps":
            video = audio = None
            for start in range(0, x.shape[0], _MPS_MLP_TOKEN_CHUNK_SIZE):
                stop = min(start + _MPS_MLP_TOKEN_CHUNK_SIZE, x.shape[0])
                h = _modulate_rmsnorm_scale_shift(
                    x[start:stop],
                    self.norm,
                    shift,
                    scale,
                    inverse_indices[start:stop],
                    dtype=_BF16_DTYPE,
                ).to(_FP32_DTYPE)
                video_chunk, audio_chunk = self._project(h)
                if video is None:
                    video = torch.empty(
                        (x.shape[0], video_chunk.shape[-1]),
                        dtype=video_chunk.dtype,
                        device=x.device,
                    )
                    audio = torch.empty(
                        (x.shape[0], audio_chunk.shape[-1]),
                        dtype=audio_chunk.dtype,
                        device=x.device,
                    )
                video[start:stop].copy_(video_chunk)
                audio[start:stop].copy_(audio_chunk)
                del h, video_chunk, audio_chunk
                torch.mps.synchronize()
                torch.mps.empty_cache()
            assert video is not None and audio is not None
            return video, audio
        h = _modulate_rmsnorm_scale_shift(
            x, self.norm, shift, scale, inverse_indices, dtype=_BF16_DTYPE
        )
        # Preserve full precision through both final output projections.
        h = h.to(_FP32_DTYPE)
        return self._project(h)


def _reject_adaln_lora(names: list[str]) -> None:
    """Reject LoRA names touching adaln_proj; callers gate on cache mode.

    Cache modes prune the adaln_proj modules, so these deltas have nothing to
    attach to: they would be dropped without a trace while the rebuild keeps
    reading base weights from the checkpoint.
    """
    adaln_names = sorted(name for name in names if "adaln_proj" in name)
    if not adaln_names:
        return
    raise ValueError(
        "MiniMax H3 AdaLN cache modes (--minimax-h3-adaln-online / "
        "--minimax-h3-adaln-cache-path) cannot apply LoRA deltas on "
        f"adaln_proj ({len(adaln_names)} name(s), e.g. {adaln_names[0]!r}); "
        "serve this adapter with resident AdaLN weights"
    )


class MiniMaxH3DiTModel(SpectrumMixin, BaseDiT, LayerwiseOffloadableModuleMixin):
    _aliases = (
        "MiniMaxH3Transformer3DModel",
        "MiniMaxH3PrunedTransformer3DModel",
    )
    _fsdp_shard_conditions = (is_block,)
    # refine_prompt_embeds drives a forward pass outside __call__.
    _fsdp_forward_methods = ("refine_prompt_embeds",)
    # parameters mix fp32 (patch projections, timestep embedder, and output
    # heads) with bf16 blocks; FSDP must gather in each parameter's own dtype
    _fsdp_mixed_dtype_params = True
    mps_stream_non_layer_weights = True
    _compile_conditions = (is_block,)
    param_names_mapping = _ARCH_DEFAULTS.param_names_mapping
    reverse_param_names_mapping = _ARCH_DEFAULTS.reverse_param_names_mapping
    lora_param_names_mapping = _ARCH_DEFAULTS.lora_param_names_mapping

    def prepare_lora_adapter(
        self, adapter: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Project released-checkpoint AdaLN LoRAs onto pruned coordinates."""
        _reject_non_lora_delta_tensors(adapter)
        if self._adaln_precomputed:
            _reject_adaln_lora(list(adapter))
        full_width = self.arch.adaln_affine_input_dim
        if full_width is None:
            return adapter

        suffix = ".adaln_proj.linear.lora_A"
        a_keys = sorted(key for key in adapter if key.endswith(suffix))
        if not a_keys:
            return adapter
        widths = {int(adapter[key].shape[-1]) for key in a_keys}
        if widths == {self.arch.time_embed_dim}:
            return adapter
        if widths != {full_width}:
            raise ValueError(
                "MiniMax H3 pruned AdaLN LoRA inputs must be uniformly "
                f"{self.arch.time_embed_dim} or {full_width} wide, got "
                f"{sorted(widths)}."
            )

        basis = self.adaln_basis
        mean = self.adaln_mean
        assert basis is not None and mean is not None
        if isinstance(basis, DTensor):
            basis = basis.full_tensor()
            mean = mean.full_tensor()
        if torch.count_nonzero(basis).item() == 0:
            raise ValueError(
                "MiniMax H3 pruned LoRA projection requires adaln_basis and "
                "adaln_mean from the component checkpoint."
            )

        projected = dict(adapter)
        work_device = adapter[a_keys[0]].device
        work_basis = basis.to(device=work_device, dtype=torch.float64)
        work_mean = mean.to(device=work_device, dtype=torch.float64)
        for a_key in a_keys:
            b_key = a_key[: -len("lora_A")] + "lora_B"
            if b_key not in adapter:
                raise ValueError(f"MiniMax H3 AdaLN LoRA is missing {b_key!r}.")
            a = adapter[a_key]
            b = adapter[b_key]
            a64 = a.to(torch.float64)
            b64 = b.to(device=work_device, dtype=torch.float64)
            projected[a_key] = (a64 @ work_basis.T).to(torch.float32)
            projected[a_key[: -len("lora_A")] + "lora_output_offset"] = (
                b64 @ (a64 @ work_mean)
            ).to(torch.float32)

        logger.info(
            "Projected %d MiniMax H3 AdaLN LoRA modules from width %d to %d",
            len(a_keys),
            full_width,
            self.arch.time_embed_dim,
        )
        return projected

    def prepare_adaln_plans(
        self, step_timesteps: list[torch.Tensor]
    ) -> torch.Tensor | None:
        """Fill the AdaLN cache for this request before denoising starts.

        Returns the per-step slab slots as a device tensor (None without a
        cache); forward consumes one scalar view per step so it never has to
        match timesteps on device. A prebuilt sidecar only resolves slots; the
        rebuild path needs the model's own timestep embedding so a filled plan
        is bit-identical to what resident adaln_proj weights would have
        produced.
        """
        cache = self.adaln_cache
        if cache is None:
            return None
        # Keying costs one D2H sync per plan; compute the keys once and share
        # them between build and resolve.
        keys = [_adaln_plan_key(timesteps) for timesteps in step_timesteps]
        if cache.weight_files is not None:

            def embed(timesteps: torch.Tensor) -> torch.Tensor:
                out = nn.functional.silu(self.time_embedder(timesteps))
                # 'match' replicates forward's bf16 cast bit-exactly; 'fp32'
                # keeps the embedding in fp32 for the one-time projection.
                if cache.precision == "match":
                    out = out.to(_BF16_DTYPE)
                return out

            cache.build(step_timesteps, embed=embed, keys=keys)
        return cache.resolve_slots(step_timesteps, keys=keys)

    def validate_lora_layers(self, layer_names: list[str]) -> None:
        if self._adaln_precomputed:
            _reject_adaln_lora(layer_names)

    def validate_weight_update_source(self, *, weights_path: str | None) -> None:
        """Reject a weight update the AdaLN cache cannot follow.

        Runs before any weight is written: cached AdaLN outputs are derived
        from adaln_proj, so an update this cache cannot follow would pair new
        transformer weights with the previous checkpoint's conditioning.
        """
        cache = self.adaln_cache
        if cache is None:
            return
        if cache.weight_files is None:
            raise ValueError(
                "MiniMax H3 was started with a prebuilt AdaLN sidecar "
                "(--minimax-h3-adaln-cache-path), which is built offline from "
                "the startup checkpoint and cannot be regenerated online; "
                "rebuild the sidecar against the new weights and restart, or "
                "serve with --minimax-h3-adaln-online"
            )
        if weights_path is None:
            raise ValueError(
                "MiniMax H3 --minimax-h3-adaln-online rebuilds AdaLN outputs "
                "by streaming adaln_proj from a checkpoint directory, and a "
                "tensor weight update carries no such directory (its "
                "adaln_proj tensors have no resident modules to land in); "
                "use update_weights_from_disk instead"
            )
        if not (
            os.path.isdir(weights_path) and native_adaln_weight_files(weights_path)
        ):
            # The rebuild streams native tensor names; a Diffusers-layout or
            # quantized export would defer a KeyError to the next request.
            raise ValueError(
                "MiniMax H3 --minimax-h3-adaln-online cannot retarget its "
                f"AdaLN rebuild at {weights_path!r} (no native adaln_proj "
                "safetensors there), and rebuilding from the original "
                "checkpoint would serve stale conditioning"
            )

    def refresh_weight_derived_caches(self, *, weights_path: str | None) -> None:
        """Drop cached AdaLN plans after a weight swap; retarget the rebuild.

        Cached plans are weight-derived values; keeping them after an update
        silently serves the previous checkpoint's conditioning.
        """
        cache = self.adaln_cache
        if cache is None:
            return
        # validate_weight_update_source ran before the weights were written and
        # rejected every source this cannot follow; anything else is a broken
        # call order rather than a deployment the cache can degrade through.
        self.validate_weight_update_source(weights_path=weights_path)
        cache.weight_files = native_adaln_weight_files(weights_path)
        cache.invalidate()

    def _can_batch_block_adaln(self) -> bool:
        return (
            self.adaln_cache is None
            and get_tp_world_size() > 1
            and not torch.compiler.is_compiling()
            and not envs.SGLANG_CACHE_DIT_ENABLED
            and not hasattr(self, "_sglang_cache_dit_adapter")
            and not is_layerwise_offloaded_module(self)
            and all(type(block) is MiniMaxH3DiTBlock for block in self.blocks)
        )

    def _validate_tp_config(
        self, *, arch: MiniMaxH3DiTArchConfig, tp_size: int
    ) -> None:
        if tp_size <= 0:
            raise ValueError("TP size must be positive.")
        if arch.num_attention_heads <= 0:
            raise ValueError("num_attention_heads must be positive.")
        if arch.hidden_size <= 0:
            raise ValueError("hidden_size must be positive.")
        if arch.attention_head_dim <= 0:
            raise ValueError("attention_head_dim must be positive.")
        if arch.ffn_hidden_size <= 0:
            raise ValueError("ffn_hidden_size must be positive.")
        for name, value in (
            ("num_attention_heads", arch.num_attention_heads),
            ("hidden_size", arch.hidden_size),
            ("ffn_hidden_size", arch.ffn_hidden_size),
            ("time_embed_hidden_size", arch.time_embed_hidden_size),
            ("adaln_out_features", arch.adaln_out_features),
            ("final_adaln_out_features", arch.final_adaln_out_features),
            ("video_patch_output_dim", arch.latents_dim * math.prod(arch.patch_size)),
            ("audio_patch_output_dim", arch.audio_latents_dim),
        ):
            if value % tp_size:
                raise ValueError(
                    f"MiniMax H3 {name}={value} must be divisible by TP size {tp_size}."
                )

    @staticmethod
    def _validate_sequence_parallel_config(
        *,
        arch: MiniMaxH3DiTArchConfig,
        tp_size: int,
        ulysses_size: int,
        ring_size: int,
    ) -> None:
        if ulysses_size <= 0:
            raise ValueError("MiniMax H3 Ulysses size must be positive.")
        if ring_size <= 0:
            raise ValueError("MiniMax H3 ring size must be positive.")
        local_heads = arch.num_attention_heads // tp_size
        if local_heads % ulysses_size:
            raise ValueError(
                f"MiniMax H3 TP-local heads {local_heads} must be divisible by "
                f"Ulysses size {ulysses_size} (total heads="
                f"{arch.num_attention_heads}, TP={tp_size})."
            )
        # ring never shards heads (only rows), so it has no head-divisibility
        # constraint; the packed sequence alignment constant must still
        # divide the *combined* sequence-parallel size, since ring adds an
        # outer row split on top of Ulysses's inner one (see forward()).
        sp_size = ulysses_size * ring_size
        if MINIMAX_H3_PACKED_SEQUENCE_ALIGNMENT % sp_size:
            raise ValueError(
                "MiniMax H3 packed sequence alignment "
                f"{MINIMAX_H3_PACKED_SEQUENCE_ALIGNMENT} must be divisible by "
                f"the combined sequence-parallel size {sp_size} "
                f"(ulysses={ulysses_size} x ring={ring_size}). Choose degrees "
                "whose product divides both the TP-local attention heads and "
                "the packed sequence alignment."
            )

    def __init__(
        self,
        config: MiniMaxH3DiTConfig,
        hf_config: dict[str, Any],
        quant_config: QuantizationConfig | None = None,
        adaln_cache_path: str | None = None,
        adaln_cache_model_variant: str | None = None,
        adaln_weight_files: list[str] | None = None,
        adaln_plan_width: int = MINIMAX_H3_ADALN_MAX_PLAN_WIDTH,
        adaln_max_plans: int = 64,
        adaln_host_cache_bytes: int = 0,
        adaln_precision: str = "match",
    ) -> None:
        super().__init__(config=config, hf_config=hf_config)
        arch = self.config
        if (
            adaln_cache_path is not None or adaln_weight_files is not None
        ) and quant_config is not None:
            raise ValueError(
                "MiniMax H3 AdaLN cache is only compatible with unquantized weights"
            )
        if arch.adaln_curve_grid is not None and (
            adaln_cache_path is not None or adaln_weight_files is not None
        ):
            raise ValueError(
                "MiniMax H3 pruned curve checkpoints cannot use a separate AdaLN cache"
            )
        self._adaln_precomputed = (
            adaln_cache_path is not None or adaln_weight_files is not None
        )
        self.arch = arch
        if arch.checkpoint_uses_diffusers_layout:
            self.preprocess_loaded_state_dict = _diffusers_h3_checkpoint
        self.hidden_size = arch.hidden_size
        self.num_attention_heads = arch.num_attention_heads
        self.num_channels_latents = arch.latents_dim
        tp_size = get_tp_world_size()
        ulysses_size, _ = get_ulysses_ctx()
        self._validate_tp_config(arch=arch, tp_size=tp_size)
        self._validate_sequence_parallel_config(
            arch=arch,
            tp_size=tp_size,
            ulysses_size=ulysses_size,
            ring_size=get_ring_ctx()[0],
        )

        self.video_patch_proj = ColumnParallelLinear(
            arch.latents_dim
            * arch.patch_size[0]
            * arch.patch_size[1]
            * arch.patch_size[2],
            arch.hidden_size,
            bias=True,
            gather_output=True,
            params_dtype=_FP32_DTYPE,
            quant_config=None,
            prefix="video_patch_proj",
        )
        self.audio_patch_proj = ColumnParallelLinear(
            arch.audio_latents_dim,
            arch.hidden_size,
            bias=True,
            gather_output=True,
            params_dtype=_FP32_DTYPE,
            quant_config=None,
            prefix="audio_patch_proj",
        )
        self.condition_proj = ColumnParallelLinear(
            arch.text_dim,
            arch.hidden_size,
            bias=True,
            gather_output=True,
            params_dtype=_BF16_DTYPE,
            quant_config=quant_config,
            prefix="condition_proj",
        )
        if arch.adaln_curve_grid is None:
            self.time_embedder = MiniMaxH3TimeEmbedder(
                arch,
                prefix="time_embedder",
            )
            self.register_parameter("adaln_t_table", None)
        else:
            self.time_embedder = None
            self.adaln_t_table = nn.Parameter(
                torch.empty(
                    arch.adaln_curve_grid,
                    arch.time_embed_dim,
                    dtype=_FP32_DTYPE,
                ),
                requires_grad=False,
            )
        if arch.adaln_affine_input_dim is None:
            self.register_parameter("adaln_basis", None)
            self.register_parameter("adaln_mean", None)
        else:
            self.register_parameter(
                "adaln_basis",
                nn.Parameter(
                    torch.empty(
                        arch.time_embed_dim,
                        arch.adaln_affine_input_dim,
                        dtype=_FP32_DTYPE,
                    ),
                    requires_grad=False,
                ),
            )
            self.register_parameter(
                "adaln_mean",
                nn.Parameter(
                    torch.empty(arch.adaln_affine_input_dim, dtype=_FP32_DTYPE),
                    requires_grad=False,
                ),
            )
        self.rope = MiniMaxH3Rope(arch.rope_inv_freq_len)
        self.token_refiner = MiniMaxH3TokenRefiner(
            arch,
            quant_config,
            prefix="token_refiner",
        )
        self.blocks = nn.ModuleList(
            [
                MiniMaxH3DiTBlock(
                    arch,
                    quant_config,
                    prefix=f"blocks.{index}",
                    use_adaln_cache=self._adaln_precomputed,
                )
                for index in range(arch.num_layers)
            ]
        )
        # Offload the 50-layer DiT stack before token_refiner. Each
        # LayerwiseOffloadManager ends with model.to(device) for leftovers;
        # putting the 2-layer refiner first would copy the full INT8 DiT onto
        # a 24GB card and OOM.
        self.layer_names = ["blocks", "token_refiner.blocks"]
        self.final_layer = MiniMaxH3FinalLayer(
            arch,
            quant_config,
            prefix="final_layer",
            use_adaln_cache=self._adaln_precomputed,
        )
        pdd_heads = envs.SGLANG_DIFFUSION_MINIMAX_H3_PDD_HEADS
        if pdd_heads:
            self.final_layer.load_pdd_fused_heads(pdd_heads)
        self.adaln_cache = (
            MiniMaxH3AdalnCache(
                arch,
                path=adaln_cache_path,
                model_variant=adaln_cache_model_variant,
                weight_files=adaln_weight_files,
                max_plans=adaln_max_plans,
                max_plan_width=adaln_plan_width,
                host_cache_bytes=adaln_host_cache_bytes,
                precision=adaln_precision,
            )
            if self._adaln_precomputed
            else None
        )
        # Component overrides disappear when the loader context exits. Preserve
        # only that selection; process-wide overrides are resolved at first use.
        self._component_attention_backend_override = (
            claim_deferred_component_attn_backend()
        )
        self._resolved_attention_backend: AttentionBackendEnum | None = None
        self._mark_missing_params_required()
        self._init_spectrum_state()
        self._h3_spectrum_last_audio: torch.Tensor | None = None
        self._h3_spectrum_last_video: torch.Tensor | None = None

    def set_cache_dit_input_preservation(self, enabled: bool) -> None:
        """Stop the blocks from overwriting the input Cache-DiT holds by reference.

        Cache-DiT snapshots the block-stack input to measure its residuals, so a
        block that rewrites its own input in place makes that residual read as
        zero. Only the first gated residual of a block writes the block input;
        the second one operates on a buffer this block just allocated, so it is
        left on the in-place fused path either way.

        The caller owns the lifecycle. It has to be on before Cache-DiT mounts,
        because mounting replaces `blocks` with a wrapper and the real blocks
        stop being reachable by iterating it.
        """
        for block in self.blocks:
            block.preserve_input_for_cache_dit = enabled

    def _h3_spectrum_requested(self, *, sp_ws: int) -> bool:
        """True when this forward should use Spectrum. Off path stays bit-exact."""
        try:
            forward_batch = get_forward_context().forward_batch
        except AssertionError:
            return False
        if forward_batch is None or not forward_batch.enable_spectrum:
            return False
        if sp_ws > 1:
            raise ValueError(
                "MiniMax-H3 Spectrum requires sequence-parallel size 1 so "
                "target audio/video rows stay on one rank. Disable "
                "--enable-spectrum or run without SP / Ulysses / ring."
            )
        return True

    def _h3_spectrum_record_targets(
        self,
        hidden: torch.Tensor,
        audio_pos: torch.Tensor,
        infer_out_pos: torch.Tensor,
        row_start: int,
        row_stop: int,
    ) -> None:
        audio_start, audio_stop, video_stop = target_audio_video_span(
            audio_pos, infer_out_pos
        )
        sliced = local_target_hidden(
            hidden, audio_start, video_stop, row_start, row_stop
        )
        if sliced is None:
            return
        local, _, _ = sliced
        n_audio = audio_stop - audio_start
        cpu_local = local.detach().to(device="cpu", dtype=local.dtype)
        self._h3_spectrum_last_audio = cpu_local[:n_audio].contiguous()
        self._h3_spectrum_last_video = cpu_local[n_audio:].contiguous()
        self.spectrum_record_features(cpu_local)

    def _h3_spectrum_predict_targets(
        self,
        hidden: torch.Tensor,
        audio_pos: torch.Tensor,
        infer_out_pos: torch.Tensor,
        row_start: int,
        row_stop: int,
    ) -> torch.Tensor:
        audio_start, audio_stop, video_stop = target_audio_video_span(
            audio_pos, infer_out_pos
        )
        sliced = local_target_hidden(
            hidden, audio_start, video_stop, row_start, row_stop
        )
        if sliced is None:
            return hidden
        local, local_start, local_stop = sliced
        predicted = self.spectrum_predict_features(
            local.detach().to(device="cpu", dtype=local.dtype)
        )
        predicted = blend_h3_spectrum_prediction(
            predicted,
            n_audio=audio_stop - audio_start,
            last_audio=self._h3_spectrum_last_audio,
            last_video=self._h3_spectrum_last_video,
        )
        hidden[local_start:local_stop].copy_(
            predicted.to(device=hidden.device, dtype=hidden.dtype)
        )
        return hidden

    def _resolve_attention_backend_once(self) -> None:
        if self._resolved_attention_backend is not None:
            return
        selected_backend = (
            get_global_forced_attn_backend()
            or self._component_attention_backend_override
        )
        if selected_backend is None:
            selected_backend = next(
                (
                    module._selected_attention_backend
                    for module in self.modules()
                    if isinstance(module, MiniMaxH3Attention)
                    and module._selected_attention_backend is not None
                ),
                None,
            )
        backend = get_attn_backend(
            self.arch.attention_head_dim,
            _BF16_DTYPE,
            selected_attention_backend=selected_backend,
            attention_requirements=AttentionRequirements(packed_varlen=True),
        )
        for module in self.modules():
            if isinstance(module, MiniMaxH3Attention):
                module._set_attention_backend(backend)
        self._resolved_attention_backend = backend.get_enum()

    def _mark_missing_params_required(self) -> None:
        for _, param in self.named_parameters():
            # A quant method's create_weights() declares its own policy for scales
            # it can synthesize (weight-only NVFP4 has no input_scale and marks it
            # "ones"); claiming only undeclared params keeps that intact.
            if getattr(param, "missing_param_init", None) is None:
                param.missing_param_init = "error"

    def post_load_weights(self) -> None:
        fp32_param_names = list(_MINIMAX_H3_FP32_PARAM_NAMES_IN_MODEL_ORDER)
        if self.adaln_t_table is not None:
            fp32_param_names = [
                name
                for name in fp32_param_names
                if not name.startswith("time_embedder.")
            ]
            fp32_param_names.append("adaln_t_table")
            if self.adaln_basis is not None:
                fp32_param_names.extend(("adaln_basis", "adaln_mean"))
        for name in fp32_param_names:
            param = self.get_parameter(name)
            if param.dtype != _FP32_DTYPE:
                raise ValueError(
                    f"{name} must stay fp32 after load, got {param.dtype}."
                )
        if self.adaln_t_table is not None:
            for name, param in self.named_parameters():
                if ".adaln_proj.linear." in name and param.dtype != _FP32_DTYPE:
                    raise ValueError(
                        f"{name} must stay fp32 with curve AdaLN, got {param.dtype}."
                    )
        # assign=True loading may re-register this persistent buffer as a parameter
        rope_inv_freq = self.rope.inv_freq
        if rope_inv_freq.dtype != _FP32_DTYPE:
            raise ValueError(
                f"rope.inv_freq must stay fp32 after load, got {rope_inv_freq.dtype}."
            )
        if self.adaln_cache is not None:
            self.adaln_cache.load(self.video_patch_proj.weight.device)

    def _time_embedding(self, timesteps: torch.Tensor) -> torch.Tensor:
        if self.adaln_t_table is None:
            assert self.time_embedder is not None
            return self.time_embedder(timesteps)

        grid = self.adaln_t_table.shape[0]
        position = timesteps.to(_FP32_DTYPE).clamp(0, 1) * (grid - 1)
        lower = position.floor().clamp(max=grid - 2).to(torch.long)
        fraction = (position - lower).unsqueeze(-1)
        lower_value = self.adaln_t_table.index_select(0, lower)
        upper_value = self.adaln_t_table.index_select(0, lower + 1)
        return torch.lerp(lower_value, upper_value, fraction)

    @staticmethod
    def _pos_ids(pos_info: Any, key: str) -> torch.Tensor:
        if isinstance(pos_info, dict):
            ids = pos_info.get("position_ids")
        else:
            ids = getattr(pos_info, "position_ids", None)
        if ids is None:
            raise ValueError(f"{key}.position_ids is required")
        return ids.view(-1).to(torch.long)

    @staticmethod
    def _psp_field(psp: Any, key: str, field: str) -> Any:
        if isinstance(psp, dict):
            value = psp.get(field)
        else:
            value = getattr(psp, field, None)
        if value is None:
            raise ValueError(f"{key}.{field} is required")
        return value

    @staticmethod
    def _psp_optional_field(psp: Any, field: str) -> Any:
        if isinstance(psp, dict):
            return psp.get(field)
        return getattr(psp, field, None)

    def refine_prompt_embeds(
        self,
        prompt_embeds: torch.Tensor,
        refiner_cu_seqlens: torch.Tensor,
        *,
        device: torch.device,
    ) -> torch.Tensor:
        """Project and refine request-static text conditioning once."""
        self.materialize_mps_non_layer_weights(
            "condition_proj", "token_refiner.final_norm"
        )
        text_len = int(refiner_cu_seqlens[1].item())
        if text_len <= 0 or text_len > int(prompt_embeds.shape[0]):
            raise ValueError(
                "refiner cu_seqlens live text length must be in "
                f"[1, {int(prompt_embeds.shape[0])}], got {text_len}"
            )
        text_rows = prompt_embeds[:text_len].to(device=device, dtype=_BF16_DTYPE)
        true_refiner_cu = torch.stack(
            (
                refiner_cu_seqlens[0],
                refiner_cu_seqlens[1],
                refiner_cu_seqlens[1],
            )
        )
        text_embed, _ = self.condition_proj(text_rows)
        refined = self.token_refiner(
            text_embed,
            cu_seqlens=true_refiner_cu,
            cu_seqlens_host=(0, text_len, text_len),
            max_seqlen=text_len,
        )
        self.release_mps_non_layer_weights("condition_proj", "token_refiner.final_norm")
        return refined

    def build_rope_cache(
        self,
        img_position_ids: torch.Tensor,
        *,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Build request-static RoPE inputs for this rank's row shard.

        Same 2D row split as forward(): ring first (outer, contiguous
        ring_chunk_len slice), Ulysses second (inner slice within that
        chunk) -- see forward()'s row_start derivation for the identity
        this must stay in sync with.
        """
        self.materialize_mps_non_layer_weights("rope")
        if img_position_ids.dim() != 3 or img_position_ids.shape[0] != 1:
            raise ValueError(
                "img_position_ids must be [1, S, 3], got "
                f"{list(img_position_ids.shape)}"
            )
        seq_len = int(img_position_ids.shape[1])
        ulysses_ws, ulysses_rank = get_ulysses_ctx()
        ring_ws, ring_rank = get_ring_ctx()
        sp_ws = ulysses_ws * ring_ws
        if seq_len % sp_ws:
            raise ValueError(
                f"packed seq_len {seq_len} not divisible by the combined "
                f"sequence-parallel world size {sp_ws} "
                f"(ulysses={ulysses_ws} x ring={ring_ws})"
            )
        local_seq_len = seq_len // sp_ws
        ring_chunk_len = local_seq_len * ulysses_ws
        row_start = ring_rank * ring_chunk_len + ulysses_rank * local_seq_len
        rope_freqs = self.rope(
            img_position_ids[:, row_start : row_start + local_seq_len]
        ).to(device)
        result = (
            _rope_cos_sin_cache(rope_freqs, dtype=_BF16_DTYPE),
            torch.arange(
                local_seq_len,
                device=device,
                dtype=torch.long,
            ),
        )
        self.release_mps_non_layer_weights("rope")
        return result

    @eager_on_graph(True)
    def _embed(
        self,
        *,
        x: torch.Tensor,
        audio_x: torch.Tensor,
        text_embeddings_selected: torch.Tensor,
        unique_timesteps: torch.Tensor,
        img_pos: torch.Tensor,
        audio_pos: torch.Tensor,
        text_pos: torch.Tensor,
        refiner_cu_seqlens: torch.Tensor,
        refiner_max_seqlen: int,
        row_start: int,
        row_stop: int,
        device: torch.device,
        refined_prompt_embeds_length: int | torch.Tensor | None = None,
        local_embedding_layout: dict[str, torch.Tensor | int] | None = None,
        embeddings: torch.Tensor,
        t_emb: torch.Tensor,
    ) -> None:
        """Build embeddings for one contiguous block-stack row shard.

        Writes embeddings [S_local, H] bf16 and t_emb [M, t_dim] fp32.
        """
        # BCG pads the prompt tensor only to stabilize its input signature.
        # Raw-input callers recover the live length from refiner metadata;
        # request-static refined inputs carry it as a host integer and avoid a
        # per-step device scalar read. Running the refiner at the bucketed M
        # dimension changes GEMM selection and is not bitwise equivalent.
        if refined_prompt_embeds_length is None:
            text_len = int(refiner_cu_seqlens[1].item())
        elif torch.is_tensor(refined_prompt_embeds_length):
            # BCG turns this request-varying host constant into a scalar input
            # so different live lengths can replay one padded-text signature.
            # _embed is an eager graph break, so this value is read outside
            # captured CUDA graphs.
            text_len = int(refined_prompt_embeds_length.item())
        else:
            text_len = int(refined_prompt_embeds_length)
        if text_len <= 0 or text_len > int(text_embeddings_selected.shape[0]):
            raise ValueError(
                "refiner cu_seqlens live text length must be in "
                f"[1, {int(text_embeddings_selected.shape[0])}], got {text_len}"
            )
        text_pos = text_pos[:text_len]
        if refined_prompt_embeds_length is not None:
            text_embed = text_embeddings_selected[:text_len].to(
                device=device, dtype=_BF16_DTYPE
            )
            if int(text_embed.shape[-1]) != self.hidden_size:
                raise ValueError(
                    "refined prompt embeddings must have hidden width "
                    f"{self.hidden_size}, got {int(text_embed.shape[-1])}"
                )
        else:
            text_embed = self.refine_prompt_embeds(
                text_embeddings_selected,
                refiner_cu_seqlens,
                device=device,
            )

        local_seq_len = row_stop - row_start
        trusted_layout = local_embedding_layout is not None
        if trusted_layout:
            used_len = text_len + int(img_pos.numel()) + int(audio_pos.numel())
            local_live_rows = min(max(used_len - row_start, 0), local_seq_len)
            if local_live_rows < local_seq_len:
                embeddings[local_live_rows:].zero_()
        else:
            # Direct model callers do not provide the serving-time partition
            # contract. Preserve their historical zero-fill/add semantics for
            # sparse or overlapping row maps.
            embeddings.zero_()

        if local_embedding_layout is None:
            text_source_ids = torch.nonzero(
                (text_pos >= row_start) & (text_pos < row_stop),
                as_tuple=False,
            ).view(-1)
            text_row_ids = text_pos.index_select(0, text_source_ids) - row_start
            img_global_ids = img_pos.index_select(
                0,
                torch.nonzero(
                    (img_pos >= row_start) & (img_pos < row_stop),
                    as_tuple=False,
                ).view(-1),
            )
            img_row_ids = img_global_ids - row_start
            audio_global_ids = audio_pos.index_select(
                0,
                torch.nonzero(
                    (audio_pos >= row_start) & (audio_pos < row_stop),
                    as_tuple=False,
                ).view(-1),
            )
            audio_row_ids = audio_global_ids - row_start
        else:
            text_source_start = int(local_embedding_layout["text_source_start"])
            text_source_stop = int(local_embedding_layout["text_source_stop"])
            img_global_ids = local_embedding_layout["img_global_ids"]
            img_row_ids = local_embedding_layout["img_row_ids"]
            audio_global_ids = local_embedding_layout["audio_global_ids"]
            audio_row_ids = local_embedding_layout["audio_row_ids"]

        write_rows = embeddings.index_copy_ if trusted_layout else embeddings.index_add_
        if trusted_layout:
            text_rows = text_source_stop - text_source_start
            if text_rows:
                embeddings[:text_rows].copy_(
                    text_embed[text_source_start:text_source_stop]
                )
        elif text_row_ids.numel():
            write_rows(
                0,
                text_row_ids,
                text_embed.index_select(0, text_source_ids).to(_BF16_DTYPE),
            )

        # latent embedders stay fp32; only rows owned by this SP rank are
        # projected, then cast during scattering into the bf16 sequence
        if img_row_ids.numel():
            x_rows = (
                x.view(-1, x.shape[-1]).index_select(0, img_global_ids).to(_FP32_DTYPE)
            )
            video_embed, _ = self.video_patch_proj(x_rows)
            write_rows(
                0,
                img_row_ids,
                video_embed.to(_BF16_DTYPE),
            )

        if audio_row_ids.numel():
            audio_rows = (
                audio_x.view(-1, audio_x.shape[-1])
                .index_select(0, audio_global_ids)
                .to(_FP32_DTYPE)
            )
            audio_embed, _ = self.audio_patch_proj(audio_rows)
            write_rows(
                0,
                audio_row_ids,
                audio_embed.to(_BF16_DTYPE),
            )

        time_embedding = self._time_embedding(unique_timesteps)
        # copy_ would broadcast a mispredicted shape or cast a dtype silently.
        assert (
            t_emb.shape == time_embedding.shape and t_emb.dtype == time_embedding.dtype
        ), "MiniMax-H3 t_emb mispredicted"
        t_emb.copy_(time_embedding)

    def forward(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed inference forward.

        Keyword names follow the checkpoint's serving contract.
        Returns `(video_logits, audio_logits)` from rows selected by
        `img_pos_for_infer_output_info` and `audio_pos_info`, with condition
        rows zeroed by update masks.
        """
        # Strict keyword contract: refuse any kwarg forward does not consume.
        unexpected = sorted(set(kwargs) - _FORWARD_SUPPORTED_KWARGS)
        if unexpected:
            raise TypeError(
                "MiniMaxH3DiTModel.forward received unexpected kwargs: "
                f"{unexpected}; supported kwargs: "
                f"{sorted(_FORWARD_SUPPORTED_KWARGS)}"
            )

        x = _required_kwarg(kwargs, "x")
        audio_x = _required_kwarg(kwargs, "audio_x")
        img_position_ids = _required_kwarg(kwargs, "img_position_ids")
        unique_timesteps = _required_kwarg(kwargs, "unique_timesteps")
        inverse_indices = (
            _required_kwarg(kwargs, "inverse_indices").view(-1).to(torch.long)
        )
        update_mask = _required_kwarg(kwargs, "update_mask")
        subblock_sparse_query_block_mask = kwargs.get(
            "subblock_sparse_query_block_mask"
        )
        block_token_tags = kwargs.get("block_token_tags")
        token_tags = kwargs.get("token_tags")
        if block_token_tags is None:
            token_tags = _required_kwarg(kwargs, "token_tags").view(-1).to(torch.long)
        else:
            block_token_tags = block_token_tags.view(-1).to(torch.long)
            token_tags = None
        skip_mask_out_condition = bool(kwargs.get("skip_mask_out_condition", False))

        text_selected = _required_kwarg(kwargs, "prompt_embeds")

        img_pos = self._pos_ids(_required_kwarg(kwargs, "img_pos_info"), "img_pos_info")
        audio_pos = self._pos_ids(
            _required_kwarg(kwargs, "audio_pos_info"), "audio_pos_info"
        )
        text_pos = self._pos_ids(
            _required_kwarg(kwargs, "text_pos_info"),
            "text_pos_info",
        )
        infer_out_pos = self._pos_ids(
            _required_kwarg(kwargs, "img_pos_for_infer_output_info"),
            "img_pos_for_infer_output_info",
        )

        psp = _required_kwarg(kwargs, "packed_seq_params")
        cu_seqlens = self._psp_field(psp, "packed_seq_params", "cu_seqlens_q").to(
            torch.int32
        )
        raw_cu_seqlens_host = self._psp_optional_field(psp, "cu_seqlens_q_host")
        cu_seqlens_host = tuple(
            int(value)
            for value in (
                cu_seqlens.tolist()
                if raw_cu_seqlens_host is None
                else raw_cu_seqlens_host
            )
        )
        # max_seqlen_q is set to cu_seqlens[1] (`used`, the real/non-padding
        # row count) by construction -- already a plain host int here, so
        # ring can reuse it as real_seq_len below with no new device sync.
        max_seqlen = int(self._psp_field(psp, "packed_seq_params", "max_seqlen_q"))
        refiner_psp = _required_kwarg(kwargs, "refiner_packed_seq_params")
        refiner_cu = self._psp_field(
            refiner_psp, "refiner_packed_seq_params", "cu_seqlens_q"
        ).to(torch.int32)
        refiner_max = int(
            self._psp_field(refiner_psp, "refiner_packed_seq_params", "max_seqlen_q")
        )

        if x.dim() != 3 or x.shape[0] != 1:
            raise ValueError(f"x must be [1, S, C], got {list(x.shape)}")
        seq_len = int(x.shape[1])
        if token_tags is not None and token_tags.shape[0] != seq_len:
            raise ValueError(
                "token_tags must cover the full packed sequence "
                f"({seq_len}), got {token_tags.shape[0]}."
            )
        if inverse_indices.shape[0] != seq_len:
            raise ValueError(
                f"inverse_indices must be [{seq_len}], got {list(inverse_indices.shape)}"
            )
        device = x.device
        if subblock_sparse_query_block_mask is not None and not isinstance(
            subblock_sparse_query_block_mask, torch.Tensor
        ):
            raise ValueError("subblock_sparse_query_block_mask must be a tensor")
        self._resolve_attention_backend_once()

        # Row split is 2D: ring first (an outer, contiguous ring_chunk_len
        # slice of the packed sequence), Ulysses second (an inner slice
        # within this rank's ring chunk). Only Ulysses shards heads inside
        # attention -- ring instead ring-rotates each rank's local KV chunk
        # and online-softmax merges partial outputs (see
        # _minimax_h3_attention_core_impl), so it has no head constraint.
        ulysses_ws, ulysses_rank = get_ulysses_ctx()
        ring_ws, ring_rank = get_ring_ctx()
        sp_ws = ulysses_ws * ring_ws
        local_seq_len = seq_len
        if sp_ws > 1:
            if seq_len % sp_ws:
                raise ValueError(
                    f"packed seq_len {seq_len} not divisible by the combined "
                    f"sequence-parallel world size {sp_ws} "
                    f"(ulysses={ulysses_ws} x ring={ring_ws})"
                )
            local_heads = self.num_attention_heads // get_tp_world_size()
            if local_heads % ulysses_ws:
                raise ValueError(
                    f"TP-local heads {local_heads} not divisible by Ulysses "
                    f"world size {ulysses_ws} (total heads="
                    f"{self.num_attention_heads}, TP={get_tp_world_size()})"
                )
            local_seq_len = seq_len // sp_ws
        ring_chunk_len = local_seq_len * ulysses_ws
        row_start = ring_rank * ring_chunk_len + ulysses_rank * local_seq_len
        row_stop = row_start + local_seq_len

        # RoPE and latent projections are row-local before Ulysses exchanges
        # sequence for heads inside attention. Serving normally prepares the
        # request-static cache once; direct model callers use this fallback.
        rope_cache = kwargs.get("rope_cache")
        if rope_cache is None:
            self.materialize_mps_non_layer_weights("rope")
            rope_freqs = self.rope(img_position_ids[:, row_start:row_stop]).to(device)
            rope_cache = (
                _rope_cos_sin_cache(rope_freqs, dtype=_BF16_DTYPE),
                torch.arange(
                    local_seq_len,
                    device=device,
                    dtype=torch.long,
                ),
            )
            self.release_mps_non_layer_weights("rope")
        self.materialize_mps_non_layer_weights(*_MPS_EMBED_WEIGHT_PREFIXES)
        img_pos = img_pos.to(device)
        audio_pos = audio_pos.to(device)
        text_pos = text_pos.to(device)

        decoder_input = torch.empty(
            (local_seq_len, self.hidden_size), device=device, dtype=_BF16_DTYPE
        )
        t_emb = torch.empty(
            (unique_timesteps.numel(), self.arch.time_embed_dim),
            device=device,
            dtype=_FP32_DTYPE,
        )
        self._embed(
            x=x,
            audio_x=audio_x,
            text_embeddings_selected=text_selected,
            unique_timesteps=unique_timesteps.view(-1).to(device),
            img_pos=img_pos,
            audio_pos=audio_pos,
            text_pos=text_pos,
            refiner_cu_seqlens=refiner_cu.to(device),
            refiner_max_seqlen=refiner_max,
            row_start=row_start,
            row_stop=row_stop,
            device=device,
            refined_prompt_embeds_length=kwargs.get("refined_prompt_embeds_length"),
            local_embedding_layout=kwargs.get("local_embedding_layout"),
            embeddings=decoder_input,
            t_emb=t_emb,
        )
        self.release_mps_non_layer_weights(*_MPS_EMBED_WEIGHT_PREFIXES)
        # request-step AdaLN input shared by all blocks
        adaln_input = (
            t_emb
            if self.adaln_t_table is not None
            else nn.functional.silu(t_emb).to(_BF16_DTYPE)
        )
        inverse_indices = inverse_indices.to(device)
        block_inverse = inverse_indices[row_start:row_stop]
        if block_token_tags is None:
            assert token_tags is not None
            token_tags = token_tags.to(device)
            block_token_tags = token_tags[row_start:row_stop].clamp(min=0)
        else:
            block_token_tags = block_token_tags.to(device)
            if block_token_tags.shape[0] != local_seq_len:
                raise ValueError(
                    "block_token_tags must cover the rank-local packed sequence "
                    f"({local_seq_len}), got {block_token_tags.shape[0]}."
                )
        block_combined = kwargs.get("block_combined_indices")
        if block_combined is None:
            block_combined = torch.add(
                block_token_tags,
                block_inverse,
                alpha=MINIMAX_H3_ADALN_MODALITY_NUM,
            )

        hidden = decoder_input
        cu_seqlens = cu_seqlens.to(device)
        spectrum_on = self._h3_spectrum_requested(sp_ws=sp_ws)
        run_transformer_blocks = self.begin_spectrum_step() if spectrum_on else True
        if spectrum_on:
            try:
                timestep = get_forward_context().current_timestep
            except AssertionError:
                timestep = None
            if timestep == 0:
                self._h3_spectrum_last_audio = None
                self._h3_spectrum_last_video = None
        block_adaln_params = None
        adaln_cache_plan_index = None
        # Skip-step forecasts still run embed + final_layer. Do not touch
        # per-block AdaLN or the 50-layer stack — that is what lets Spectrum
        # coexist with DiT layerwise offload.
        if run_transformer_blocks:
            if self.adaln_cache is not None:
                # prepare_adaln_plans resolved the slot on the host; the device
                # lookup remains for callers that drive forward() directly.
                adaln_cache_plan_index = kwargs.get("adaln_cache_slot")
                if adaln_cache_plan_index is None:
                    adaln_cache_plan_index = self.adaln_cache.lookup(
                        unique_timesteps.view(-1).to(device)
                    )
                block_adaln_params = self.adaln_cache.block_all(
                    cache_plan_index=adaln_cache_plan_index,
                    num_timesteps=adaln_input.shape[0],
                )
            elif self._can_batch_block_adaln():
                local_adaln = torch.stack(
                    [
                        block.adaln_proj.project_local(adaln_input)
                        for block in self.blocks
                    ]
                )
                gathered_adaln = tensor_model_parallel_all_gather(local_adaln)
                block_adaln_params = tuple(
                    block.adaln_proj.split_output(output)
                    for block, output in zip(self.blocks, gathered_adaln)
                )
            # With sequence parallelism, shard rows across the group for the
            # block stack. Attention trades sequence for heads internally
            # (Ulysses) and/or ring-rotates KV across ring ranks; everything
            # else, including the final layer, is row-local. Only the narrow
            # video/audio logits are gathered after the final layer.
            for index, block in enumerate(self.blocks):
                hidden = block(
                    hidden,
                    adaln_input=adaln_input,
                    combined_indices=block_combined,
                    rope_cache=rope_cache,
                    cu_seqlens=cu_seqlens,
                    cu_seqlens_host=cu_seqlens_host,
                    max_seqlen=max_seqlen,
                    subblock_sparse_query_block_mask=subblock_sparse_query_block_mask,
                    ulysses_active=ulysses_ws > 1,
                    ring_active=ring_ws > 1,
                    adaln_params=(
                        None
                        if block_adaln_params is None
                        else block_adaln_params[index]
                    ),
                )
            if spectrum_on:
                self._h3_spectrum_record_targets(
                    hidden, audio_pos, infer_out_pos, row_start, row_stop
                )
        elif spectrum_on:
            hidden = self._h3_spectrum_predict_targets(
                hidden, audio_pos, infer_out_pos, row_start, row_stop
            )
        if self.adaln_cache is not None and adaln_cache_plan_index is None:
            adaln_cache_plan_index = kwargs.get("adaln_cache_slot")
            if adaln_cache_plan_index is None:
                adaln_cache_plan_index = self.adaln_cache.lookup(
                    unique_timesteps.view(-1).to(device)
                )
        self.materialize_mps_non_layer_weights("final_layer")
        video_logits, audio_logits = self.final_layer(
            hidden,
            adaln_input=adaln_input,
            inverse_indices=block_inverse,
            adaln_params=(
                None
                if adaln_cache_plan_index is None
                else self.adaln_cache.final(
                    adaln_cache_plan_index,
                    adaln_input.shape[0],
                )
            ),
        )
        self.release_mps_non_layer_weights("final_layer")
        if sp_ws > 1:
            from sglang.multimodal_gen.runtime.distributed.parallel_state import (
                get_sp_group,
            )

            video_width = video_logits.shape[-1]
            logits = get_sp_group().all_gather(
                torch.cat((video_logits, audio_logits), dim=-1), dim=0
            )
            video_logits, audio_logits = logits.split(
                (video_width, logits.shape[-1] - video_width), dim=-1
            )

        # Preserve the full-row output GEMM (and therefore its numerical
        # contract), but defer TP column gathers until after dead text/padding
        # rows have been removed. For hybrid TP+Ulysses, the preceding SP row
        # gather also carries only the TP-local output width.
        video_logits = video_logits.index_select(0, infer_out_pos.to(device))
        audio_logits = audio_logits.index_select(0, audio_pos.to(device))
        if get_tp_world_size() > 1:
            video_logits = tensor_model_parallel_all_gather(video_logits)
            audio_logits = tensor_model_parallel_all_gather(audio_logits)
        if not skip_mask_out_condition:
            update_mask = update_mask.view(-1).to(device)
            if update_mask.shape[0] != video_logits.shape[0]:
                raise ValueError(
                    "update_mask length mismatch: "
                    f"{update_mask.shape[0]} != {video_logits.shape[0]}"
                )
            video_logits = video_logits * update_mask.unsqueeze(-1)
            # Audio has no condition rows in the supported tasks, so its
            # derived update mask is all ones. Honor an explicit mask when
            # provided.
            update_audio_mask = kwargs.get("update_audio_mask")
            if update_audio_mask is not None:
                audio_logits = audio_logits * update_audio_mask.view(-1).unsqueeze(-1)
        return video_logits, audio_logits


EntryClass = MiniMaxH3DiTModel

__all__ = [
    "MINIMAX_H3_FP32_BUFFER_NAMES",
    "MINIMAX_H3_FP32_PARAM_NAMES",
    "MiniMaxH3DiTModel",
    "_qkv_scale_block_rows",
    "_reorder_grouped_qkv_to_qkv",
]
