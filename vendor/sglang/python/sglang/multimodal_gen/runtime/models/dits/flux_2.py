# Copyright 2025 Black Forest Labs, The HuggingFace Team and The InstantX Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.normalization import AdaLayerNormContinuous

from sglang.kernels.ops.diffusion import (
    FLUX2_NVFP4_SWIGLU_QUANT,
    BitExactFusionGate,
    can_defer_flux2_gated_residual,
    can_defer_xpu_gated_residual,
    can_use_flux2_gated_resnorm,
    can_use_flux2_strided_qknorm_rope,
    can_use_fused_layernorm_modulate,
    can_use_xpu_layernorm_modulate,
    flux2_gated_resnorm_raw,
    flux2_strided_qknorm_rope,
    fused_layernorm_modulate_fp8_quant_raw,
    fused_layernorm_modulate_raw,
    fused_packed_silu_mul_bitexact,
    is_plain_layer_norm,
    residual_gate_add,
    tensors_equal,
    try_flux2_token_cat_fp8,
    try_flux2_token_cat_nvfp4,
    try_fused_flux2_qkv_epilogue,
    xpu_gated_resnorm,
    xpu_layernorm_modulate,
)
from sglang.kernels.ops.quantization.fp8_kernel import static_quant_fp8
from sglang.multimodal_gen import envs
from sglang.multimodal_gen.configs.models.dits.flux import FluxConfig
from sglang.multimodal_gen.runtime.distributed import (
    divide,
    get_tp_world_size,
)
from sglang.multimodal_gen.runtime.distributed.sp_shard_utils import (
    build_shard_plan,
    join_seqs,
    shard_like,
    shard_seq_prefix,
    should_shard_text,
    split_seqs,
    tail_attn_meta,
)
from sglang.multimodal_gen.runtime.layers.attention import USPAttention
from sglang.multimodal_gen.runtime.layers.layernorm import (
    RMSNorm,
    apply_qk_norm_with_optional_rope,
)
from sglang.multimodal_gen.runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.runtime.layers.quantization.configs.base_config import (
    QuantizationConfig,
)
from sglang.multimodal_gen.runtime.layers.quantization.modelopt_quant import (
    ModelOptFp4Config,
    ModelOptFp4LinearMethod,
    ModelOptFp8Config,
    ModelOptFp8LinearMethod,
    apply_nvfp4_gemm_prequantized,
    apply_nvfp4_gemm_swiglu_quant,
)
from sglang.multimodal_gen.runtime.layers.rotary_embedding.mrope import (
    FluxPosEmbed as Flux2PosEmbed,
)
from sglang.multimodal_gen.runtime.managers.memory_managers.layerwise_offload import (
    LayerwiseOffloadableModuleMixin,
)
from sglang.multimodal_gen.runtime.models.dits.base import CachableDiT
from sglang.multimodal_gen.runtime.models.dits.common import get_qkv_projections
from sglang.multimodal_gen.runtime.platforms import (
    AttentionBackendEnum,
    current_platform,
)
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

logger = init_logger(__name__)  # pylint: disable=invalid-name

_get_qkv_projections = get_qkv_projections

_FLUX2_LN_MOD = BitExactFusionGate("FLUX.2 fused LN+modulate", per_signature=True)
_FLUX2_LN_MOD_SIGS = _FLUX2_LN_MOD.verified_sigs
assert _FLUX2_LN_MOD_SIGS is not None
# The CUDA gated-resnorm kernel is exact by construction; the XPU one replicates
# torch-xpu's LayerNorm and is verified once per signature like LN+modulate.
_FLUX2_XPU_GATED_RESNORM = BitExactFusionGate(
    "FLUX.2 fused gated residual+LN+modulate (XPU)", per_signature=True
)
_FLUX2_SWIGLU = BitExactFusionGate("FLUX.2 fused SwiGLU", per_signature=True)
_FLUX2_SWIGLU_SIGS = _FLUX2_SWIGLU.verified_sigs
assert _FLUX2_SWIGLU_SIGS is not None
_FLUX2_LN_FP8 = BitExactFusionGate(
    "FLUX.2 fused LN+modulate+FP8 quant", per_signature=True
)
_FLUX2_LN_FP8_SIGS = _FLUX2_LN_FP8.verified_sigs
assert _FLUX2_LN_FP8_SIGS is not None
_FLUX2_STRIDED_QK_ROPE = BitExactFusionGate(
    "FLUX.2 Klein strided QK RMSNorm+RoPE", per_signature=True
)


def _flux2_single_qk_rope(q, k, q_norm, k_norm, head_dim, cache, complex_freqs):
    def reference():
        return apply_qk_norm_with_optional_rope(
            q=q,
            k=k,
            q_norm=q_norm,
            k_norm=k_norm,
            head_dim=head_dim,
            cos_sin_cache=cache,
            freqs_complex=complex_freqs,
            is_neox=False,
            allow_inplace=True,
            allow_strided_qk=current_platform.is_rocm(),
        )

    if (
        head_dim != 128
        or type(q_norm) is not RMSNorm
        or type(k_norm) is not RMSNorm
        or q_norm.variance_epsilon != k_norm.variance_epsilon
        or any(
            norm.variance_size_override is not None
            or getattr(norm._forward_method, "__func__", None)
            is not RMSNorm.forward_cuda
            for norm in (q_norm, k_norm)
        )
        or not envs.SGLANG_ENABLE_FUSED_QKNORM_ROPE
        or not can_use_flux2_strided_qknorm_rope(
            q, k, q_norm.weight, k_norm.weight, cache
        )
    ):
        return reference()
    return _FLUX2_STRIDED_QK_ROPE.run(
        lambda: flux2_strided_qknorm_rope(
            q, k, q_norm.weight, k_norm.weight, cache, q_norm.variance_epsilon
        ),
        reference,
        sig=(q.device, q.shape, q.stride(), cache.stride(), q_norm.variance_epsilon),
        equal=lambda a, b: all(
            torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b)
        ),
        logger=logger,
    )


def _valid_modelopt_fp8_linear(linear: nn.Module) -> bool:
    input_scale = getattr(linear, "input_scale", None)
    return (
        isinstance(getattr(linear, "quant_method", None), ModelOptFp8LinearMethod)
        and isinstance(input_scale, torch.Tensor)
        and input_scale.is_cuda
        and input_scale.dtype == torch.float32
        and input_scale.numel() == 1
        and input_scale.is_contiguous()
        and bool(torch.isfinite(input_scale).all().item())
        and bool((input_scale > 0).all().item())
    )


def _shared_modelopt_fp8_scale(linears: list[nn.Module]) -> bool:
    if not all(_valid_modelopt_fp8_linear(linear) for linear in linears):
        return False
    reference = linears[0].input_scale
    return all(torch.equal(reference, linear.input_scale) for linear in linears[1:])


def _try_flux2_norm_modulate_fp8(
    norm: nn.Module,
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    input_scale: Optional[torch.Tensor],
    *,
    enabled: bool,
) -> Optional[torch.Tensor]:
    """Return the exact prequantized FP8 projection input when eligible."""
    if not enabled or torch.compiler.is_compiling():
        return None

    scale_row = scale.squeeze(1) if scale.dim() == 3 and scale.shape[1] == 1 else scale
    shift_row = shift.squeeze(1) if shift.dim() == 3 and shift.shape[1] == 1 else shift
    if (
        _FLUX2_LN_FP8.disabled
        or not x.is_cuda
        or x.shape[-1] != 6144
        or not is_plain_layer_norm(norm, x.shape[-1])
        or not can_use_fused_layernorm_modulate(x.dtype, x.shape[-1])
    ):
        return None

    sig = (
        x.dtype,
        x.device,
        x.shape[0],
        x.shape[-1],
        x.stride(-1),
        scale_row.stride(0) if scale_row.shape[0] > 1 else x.shape[-1],
        shift_row.stride(0) if shift_row.shape[0] > 1 else x.shape[-1],
        norm.eps,
    )
    verified = sig in _FLUX2_LN_FP8_SIGS
    if not verified and torch.cuda.is_current_stream_capturing():
        return None
    try:
        out = fused_layernorm_modulate_fp8_quant_raw(
            x, scale_row, shift_row, input_scale, norm.eps
        )
    except Exception as exc:
        _FLUX2_LN_FP8.on_exception(exc, logger=logger)
        return None
    if verified:
        return out

    reference_bf16 = _flux2_norm_modulate(norm, x, scale, shift)
    reference, _ = static_quant_fp8(reference_bf16, input_scale)
    return _FLUX2_LN_FP8.accept_or_fallback(
        out,
        reference,
        sig=sig,
        logger=logger,
    )


PendingGatedResidual = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _materialize_gated_residual(pending: PendingGatedResidual) -> torch.Tensor:
    residual, update, gate = pending
    return residual_gate_add(residual, update, gate)


def _defer_gated_residual(
    residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor | PendingGatedResidual:
    if can_defer_flux2_gated_residual(residual, update, gate) or _can_defer_xpu(
        residual, update, gate
    ):
        return residual, update, gate
    return residual_gate_add(residual, update, gate)


def _can_defer_xpu(
    residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor
) -> bool:
    return (
        residual.is_xpu
        and not _FLUX2_XPU_GATED_RESNORM.disabled
        and can_defer_xpu_gated_residual(residual, update, gate)
    )


def _flux2_derive_rope_tensors(
    freqs_cis: Optional[Tuple[torch.Tensor, torch.Tensor]],
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(cos_sin_cache, complex_freqs) from one (cos, sin) pair.

    Called once per Flux2Transformer2DModel.forward() instead of once per
    block: freqs_cis is identical across every block in a forward pass, so
    deriving it per-attention-call recomputed the same tensors up to 56x
    per denoising step.
    """
    if freqs_cis is None:
        return None, None
    cos, sin = freqs_cis
    cos_sin_cache = torch.cat(
        [
            cos.to(dtype=torch.float32).contiguous(),
            sin.to(dtype=torch.float32).contiguous(),
        ],
        dim=-1,
    )
    # is_neox=False here, so this can hit the NPU _apply_rotary_emb_complex
    # fast path in RotaryEmbedding instead of the interleaved fallback (no
    # fused NPU kernel for it).
    complex_freqs = torch.complex(cos.to(torch.float32), sin.to(torch.float32))
    return cos_sin_cache, complex_freqs


def _flux2_gated_resnorm(
    norm: nn.Module,
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if is_plain_layer_norm(norm, residual.shape[-1]) and can_use_flux2_gated_resnorm(
        residual, update, gate, scale, shift
    ):
        return flux2_gated_resnorm_raw(residual, update, gate, scale, shift, norm.eps)
    if residual.is_xpu and is_plain_layer_norm(norm, residual.shape[-1]):
        fused = _xpu_gated_resnorm(norm, residual, update, gate, scale, shift)
        if fused is not None:
            return fused

    residual = residual_gate_add(residual, update, gate)
    return _flux2_norm_modulate(norm, residual, scale, shift), residual


def _xpu_gated_resnorm(
    norm: nn.Module,
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Bit-exact single-kernel ``r = residual + update * gate; LN(r) * (1 + scale) + shift``."""
    if (
        torch.compiler.is_compiling()
        or _FLUX2_XPU_GATED_RESNORM.disabled
        or not can_use_xpu_layernorm_modulate(residual.dtype, residual.shape[-1])
    ):
        return None
    # Exactness depends on the reduction width and row layouts, not on row count.
    sig = (residual.dtype, residual.device, residual.shape[-1], norm.eps)
    verified = _FLUX2_XPU_GATED_RESNORM.is_verified(sig)
    if not verified and torch.xpu.is_current_stream_capturing():
        return None
    try:
        out = xpu_gated_resnorm(residual, update, gate, scale, shift, norm.eps)
    except Exception as exc:
        _FLUX2_XPU_GATED_RESNORM.on_exception(exc, logger=logger)
        return None
    if verified:
        return out
    ref_residual = residual_gate_add(residual, update, gate)
    ref = (norm(ref_residual) * (1 + scale) + shift, ref_residual)
    return _FLUX2_XPU_GATED_RESNORM.accept_or_fallback(
        out,
        ref,
        sig=sig,
        equal=tensors_equal,
        logger=logger,
    )


def _can_use_nvfp4_swiglu_quant_fusion(capability: Any) -> bool:
    # The end-to-end accuracy and performance validation for this fusion was
    # done on SM103.  SM100 currently produces a deterministic but materially
    # different FLUX.2 image, so keep B200/GB200 on the existing unfused path.
    return capability is not None and (capability.major, capability.minor) == (10, 3)


def _flux2_norm_maybe_fp8(
    norm: nn.Module,
    hidden_states: torch.Tensor | PendingGatedResidual,
    scale: torch.Tensor,
    shift: torch.Tensor,
    input_scale: Optional[torch.Tensor],
    *,
    fp8_enabled: bool,
    update: Optional[torch.Tensor] = None,
    gate: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(norm_hidden_states, residual_hidden_states)``.

    Uses fused gated residual-norm when a pending residual is present or when
    ``update``/``gate`` are supplied. When the FP8 producer is enabled, the
    residual is materialized first so LN+modulate+FP8 can write the GEMM input.
    """
    if isinstance(hidden_states, tuple):
        residual, pending_update, pending_gate = hidden_states
        if fp8_enabled:
            hidden_states = residual_gate_add(residual, pending_update, pending_gate)
        else:
            return _flux2_gated_resnorm(
                norm, residual, pending_update, pending_gate, scale, shift
            )
    elif update is not None and gate is not None:
        if fp8_enabled:
            hidden_states = residual_gate_add(hidden_states, update, gate)
        else:
            return _flux2_gated_resnorm(norm, hidden_states, update, gate, scale, shift)

    norm_hidden_states = _try_flux2_norm_modulate_fp8(
        norm, hidden_states, scale, shift, input_scale, enabled=fp8_enabled
    )
    if norm_hidden_states is None:
        norm_hidden_states = _flux2_norm_modulate(norm, hidden_states, scale, shift)
    return norm_hidden_states, hidden_states


def _flux2_norm_modulate(
    norm: nn.Module,
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
) -> torch.Tensor:
    """Bit-exact single-kernel ``LN(x) * (1 + scale) + shift``."""
    # Preserve the original expression for Dynamo/Inductor.  This direct
    # Triton dispatch is intentionally an eager fast path.
    if torch.compiler.is_compiling():
        return norm(x) * (1 + scale) + shift

    scale_row = scale.squeeze(1) if scale.dim() == 3 and scale.shape[1] == 1 else scale
    shift_row = shift.squeeze(1) if shift.dim() == 3 and shift.shape[1] == 1 else shift
    use_xpu = x.is_xpu and can_use_xpu_layernorm_modulate(x.dtype, x.shape[-1])
    use_cuda = x.is_cuda and can_use_fused_layernorm_modulate(x.dtype, x.shape[-1])
    if (
        _FLUX2_LN_MOD.disabled
        or not is_plain_layer_norm(norm, x.shape[-1])
        or not (use_xpu or use_cuda)
    ):
        return norm(x) * (1 + scale) + shift

    # The bit-exact contract is set by dtype/reduction width/affine-row
    # layout, not by the number of independent rows.  Excluding sequence
    # length lets the representative warmup verify the real prompt path too.
    sig = (
        x.dtype,
        x.device,
        x.shape[0],
        x.shape[-1],
        x.stride(-1),
        scale_row.stride(0) if scale_row.shape[0] > 1 else x.shape[-1],
        shift_row.stride(0) if shift_row.shape[0] > 1 else x.shape[-1],
        norm.eps,
    )
    verified = sig in _FLUX2_LN_MOD_SIGS
    if not verified and torch.get_device_module(x.device).is_current_stream_capturing():
        return norm(x) * (1 + scale) + shift
    kernel = xpu_layernorm_modulate if use_xpu else fused_layernorm_modulate_raw
    try:
        # Direct dispatch avoids custom-op overhead on this eager-only path.
        out = kernel(x, scale_row, shift_row, norm.eps)
    except Exception as exc:
        _FLUX2_LN_MOD.on_exception(exc, logger=logger)
        return norm(x) * (1 + scale) + shift
    if verified:
        return out
    ref = norm(x) * (1 + scale) + shift
    return _FLUX2_LN_MOD.accept_or_fallback(
        out,
        ref,
        sig=sig,
        logger=logger,
    )


def _flux2_swiglu(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bit-exact fused SwiGLU for the packed FLUX.2 FFN projection.

    With ``out`` (e.g. a column slice of the next GEMM's input) the result is
    written there and ``out`` is returned.
    """
    if out is None:
        return _flux2_swiglu_impl(x, None)
    result = _flux2_swiglu_impl(x, out)
    if result.data_ptr() != out.data_ptr():
        out.copy_(result)
    return out


def _flux2_swiglu_impl(x: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    half = x.shape[-1] // 2
    # Let Inductor fuse the reference expression in torch.compile mode.
    if torch.compiler.is_compiling():
        return F.silu(x[..., :half]) * x[..., half:]

    # Sequence length only changes the launch grid; D and row stride define
    # how the two packed halves are addressed and therefore need verification.
    sig = (x.dtype, x.device, x.shape[0], x.shape[-1], x.stride(-2), x.stride(-1))
    verified = sig in _FLUX2_SWIGLU_SIGS
    can_fuse = (
        not _FLUX2_SWIGLU.disabled
        and (x.is_cuda or x.is_xpu)
        and x.dtype is torch.bfloat16
        and x.dim() == 3
        and x.stride(-1) == 1
        and x.stride(-2) >= x.shape[-1]
        and x.stride(0) == x.shape[1] * x.stride(1)
        and x.shape[-1] % 2 == 0
        and x.numel() > 0
    )
    # Per-signature verification may compare tensors and synchronize.  Never
    # verify a new layout while a CUDA graph is being captured.
    if (
        can_fuse
        and not verified
        and torch.get_device_module(x.device).is_current_stream_capturing()
    ):
        return F.silu(x[..., :half]) * x[..., half:]
    if can_fuse:
        try:
            out = fused_packed_silu_mul_bitexact(x, out)
        except Exception as exc:
            _FLUX2_SWIGLU.on_exception(exc, logger=logger)
        else:
            if verified:
                return out
            return _FLUX2_SWIGLU.accept_or_fallback(
                out,
                F.silu(x[..., :half]) * x[..., half:],
                sig=sig,
                logger=logger,
            )
    return F.silu(x[..., :half]) * x[..., half:]


class Flux2SwiGLU(nn.Module):
    """
    Flux 2 uses a SwiGLU-style activation in the transformer feedforward sub-blocks, but with the linear projection
    layer fused into the first linear layer of the FF sub-block. Thus, this module has no trainable parameters.
    """

    def forward(
        self, x: torch.Tensor, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return _flux2_swiglu(x, out)


class Flux2FeedForward(nn.Module):
    def __init__(
        self,
        dim: int,
        dim_out: Optional[int] = None,
        mult: float = 3.0,
        inner_dim: Optional[int] = None,
        bias: bool = False,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ):
        super().__init__()
        if inner_dim is None:
            inner_dim = int(dim * mult)
        dim_out = dim_out or dim

        # Flux2SwiGLU will reduce the dimension by half
        self.linear_in = MergedColumnParallelLinear(
            dim,
            [inner_dim, inner_dim],
            bias=bias,
            gather_output=False,
            quant_config=quant_config,
            prefix=f"{prefix}.linear_in" if prefix else "linear_in",
        )
        self.act_fn = Flux2SwiGLU()
        self.linear_out = RowParallelLinear(
            inner_dim,
            dim_out,
            bias=bias,
            input_is_parallel=True,
            quant_config=quant_config,
            prefix=f"{prefix}.linear_out" if prefix else "linear_out",
        )

        capability = current_platform.get_device_capability()
        if (
            _can_use_nvfp4_swiglu_quant_fusion(capability)
            and isinstance(self.linear_in.quant_method, ModelOptFp4LinearMethod)
            and isinstance(self.linear_out.quant_method, ModelOptFp4LinearMethod)
            and self.linear_in.output_size_per_partition % 128 == 0
            and self.linear_in.input_size_per_partition % 16 == 0
            and self.linear_in.bias is None
            and self.linear_out.bias is None
        ):
            # These flags are consumed after checkpoint loading.  Keep the
            # regular weight layout as well so graph/compile fallback remains
            # available.
            self.linear_in._interleave_for_swiglu_fusion = True
            self.linear_out._accepts_prequantized_fp4 = True
            FLUX2_NVFP4_SWIGLU_QUANT.mark(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            FLUX2_NVFP4_SWIGLU_QUANT.is_enabled(self)
            and getattr(self.linear_in, "_swiglu_fusion_ready", False)
            and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing()
        ):
            return apply_nvfp4_gemm_swiglu_quant(self.linear_in, self.linear_out, x)
        x, _ = self.linear_in(x)
        x = self.act_fn(x)
        x, _ = self.linear_out(x)
        return x


class Flux2Attention(torch.nn.Module, AttentionModuleMixin):
    def __init__(
        self,
        query_dim: int,
        num_heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
        bias: bool = False,
        added_kv_proj_dim: Optional[int] = None,
        added_proj_bias: Optional[bool] = True,
        out_bias: bool = True,
        eps: float = 1e-5,
        out_dim: int = None,
        elementwise_affine: bool = True,
        supported_attention_backends: set[AttentionBackendEnum] | None = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ):
        super().__init__()

        self.head_dim = dim_head
        self.inner_dim = out_dim if out_dim is not None else dim_head * num_heads
        self.query_dim = query_dim
        self.out_dim = out_dim if out_dim is not None else query_dim
        self.heads = out_dim // dim_head if out_dim is not None else num_heads
        self.tp_size = get_tp_world_size()
        self.local_heads = divide(self.heads, self.tp_size)
        self.local_inner_dim = divide(self.inner_dim, self.tp_size)

        self.use_bias = bias
        self.dropout = dropout

        self.added_kv_proj_dim = added_kv_proj_dim

        # Packed NVFP4 checkpoints already serialize QKV together. ModelOpt
        # FP8 exports separate Diffusers tensors, but the loader can merge
        # those tensors losslessly and execute one channelwise-CUTLASS GEMM.
        fp4_packed_qkv = isinstance(quant_config, ModelOptFp4Config) and getattr(
            quant_config, "checkpoint_uses_packed_qkv", False
        )
        capability = current_platform.get_device_capability()
        fp8_merged_qkv = (
            isinstance(quant_config, ModelOptFp8Config)
            and self.tp_size == 1
            and capability is not None
            and capability.major >= 10
        )
        self.use_fused_qkv = fp4_packed_qkv or fp8_merged_qkv
        self.use_fused_added_qkv = self.use_fused_qkv
        self.use_fused_qkv_epilogue = fp8_merged_qkv

        if self.use_fused_qkv:
            self.to_qkv = MergedColumnParallelLinear(
                query_dim,
                [self.inner_dim] * 3,
                bias=bias,
                gather_output=False,
                quant_config=quant_config,
                prefix=f"{prefix}.to_qkv" if prefix else "to_qkv",
            )
        else:
            self.to_q = ColumnParallelLinear(
                query_dim,
                self.inner_dim,
                bias=bias,
                gather_output=False,
                quant_config=quant_config,
                prefix=f"{prefix}.to_q" if prefix else "to_q",
            )
            self.to_k = ColumnParallelLinear(
                query_dim,
                self.inner_dim,
                bias=bias,
                gather_output=False,
                quant_config=quant_config,
                prefix=f"{prefix}.to_k" if prefix else "to_k",
            )
            self.to_v = ColumnParallelLinear(
                query_dim,
                self.inner_dim,
                bias=bias,
                gather_output=False,
                quant_config=quant_config,
                prefix=f"{prefix}.to_v" if prefix else "to_v",
            )

        # QK Norm
        self.norm_q = RMSNorm(dim_head, eps=eps)
        self.norm_k = RMSNorm(dim_head, eps=eps)

        self.to_out = torch.nn.ModuleList([])
        self.to_out.append(
            RowParallelLinear(
                self.inner_dim,
                self.out_dim,
                bias=out_bias,
                input_is_parallel=True,
                quant_config=quant_config,
                prefix=f"{prefix}.to_out.0" if prefix else "to_out.0",
            )
        )
        self.to_out.append(torch.nn.Dropout(dropout))

        if added_kv_proj_dim is not None:
            self.norm_added_q = RMSNorm(dim_head, eps=eps)
            self.norm_added_k = RMSNorm(dim_head, eps=eps)
            if self.use_fused_added_qkv:
                # txt_attn.qkv is BF16 in the packed NVFP4 checkpoint, while
                # ModelOpt FP8 keeps it quantized like the image projection.
                self.to_added_qkv = MergedColumnParallelLinear(
                    added_kv_proj_dim,
                    [self.inner_dim] * 3,
                    bias=added_proj_bias,
                    gather_output=False,
                    quant_config=None if fp4_packed_qkv else quant_config,
                    prefix=f"{prefix}.to_added_qkv" if prefix else "to_added_qkv",
                )
            else:
                self.add_q_proj = ColumnParallelLinear(
                    added_kv_proj_dim,
                    self.inner_dim,
                    bias=added_proj_bias,
                    gather_output=False,
                    quant_config=quant_config,
                    prefix=f"{prefix}.add_q_proj" if prefix else "add_q_proj",
                )
                self.add_k_proj = ColumnParallelLinear(
                    added_kv_proj_dim,
                    self.inner_dim,
                    bias=added_proj_bias,
                    gather_output=False,
                    quant_config=quant_config,
                    prefix=f"{prefix}.add_k_proj" if prefix else "add_k_proj",
                )
                self.add_v_proj = ColumnParallelLinear(
                    added_kv_proj_dim,
                    self.inner_dim,
                    bias=added_proj_bias,
                    gather_output=False,
                    quant_config=quant_config,
                    prefix=f"{prefix}.add_v_proj" if prefix else "add_v_proj",
                )
            self.to_add_out = RowParallelLinear(
                self.inner_dim,
                query_dim,
                bias=out_bias,
                input_is_parallel=True,
                quant_config=quant_config,
                prefix=f"{prefix}.to_add_out" if prefix else "to_add_out",
            )

        self.attn = USPAttention(
            num_heads=self.local_heads,
            head_size=self.head_dim,
            dropout_rate=0,
            softmax_scale=None,
            causal=False,
            supported_attention_backends=supported_attention_backends,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        cos_sin_cache: Optional[torch.Tensor] = None,
        complex_freqs: Optional[torch.Tensor] = None,
        num_replicated_prefix: int = 0,
        attn_mask: Optional[torch.Tensor] = None,
        attn_mask_meta: Optional[Dict[str, int]] = None,
    ) -> torch.Tensor:
        (
            query,
            key,
            value,
            encoder_query,
            encoder_key,
            encoder_value,
        ) = _get_qkv_projections(
            self,
            hidden_states,
            encoder_hidden_states,
            make_contiguous=not self.use_fused_qkv_epilogue,
        )

        query = query.unflatten(-1, (self.local_heads, -1))
        key = key.unflatten(-1, (self.local_heads, -1))
        value = value.unflatten(-1, (self.local_heads, -1))

        joint_qkv = None
        sp_txt_pad = 0
        if self.added_kv_proj_dim is not None:
            encoder_query = encoder_query.unflatten(-1, (self.local_heads, -1))
            encoder_key = encoder_key.unflatten(-1, (self.local_heads, -1))
            encoder_value = encoder_value.unflatten(-1, (self.local_heads, -1))

            text_seq_len = encoder_query.shape[1]
            # join_seqs relocates any SP text tail-pad behind the image (see
            # sp_shard.join_seqs for why).
            sp_txt_pad = (attn_mask_meta or {}).get("local_pad", 0)
            if (
                self.use_fused_qkv_epilogue
                and cos_sin_cache is not None
                and sp_txt_pad == 0
            ):
                joint_qkv = try_fused_flux2_qkv_epilogue(
                    query,
                    key,
                    value,
                    encoder_query,
                    encoder_key,
                    encoder_value,
                    self.norm_q.weight,
                    self.norm_k.weight,
                    self.norm_added_q.weight,
                    self.norm_added_k.weight,
                    cos_sin_cache,
                    self.norm_q.variance_epsilon,
                    self.norm_added_q.variance_epsilon,
                )

            if joint_qkv is None:
                if self.use_fused_qkv_epilogue:
                    query, key, value = [
                        tensor.contiguous() for tensor in (query, key, value)
                    ]
                    encoder_query, encoder_key, encoder_value = [
                        tensor.contiguous()
                        for tensor in (encoder_query, encoder_key, encoder_value)
                    ]
                # complex_freqs covers [text, image] positions in order (same
                # table cos_sin_cache/positions index into); slice per call the
                # same way position_offset selects rows below — the class's
                # complex_freqs path does not do positional indexing itself.
                text_freqs_complex = (
                    complex_freqs[:text_seq_len] if complex_freqs is not None else None
                )
                encoder_query, encoder_key = apply_qk_norm_with_optional_rope(
                    q=encoder_query,
                    k=encoder_key,
                    q_norm=self.norm_added_q,
                    k_norm=self.norm_added_k,
                    head_dim=self.head_dim,
                    cos_sin_cache=cos_sin_cache,
                    freqs_complex=text_freqs_complex,
                    is_neox=False,
                    allow_inplace=True,
                )
                img_seq_len = query.shape[1]
                img_freqs_complex = (
                    complex_freqs[text_seq_len : text_seq_len + img_seq_len]
                    if complex_freqs is not None
                    else None
                )
                query, key = apply_qk_norm_with_optional_rope(
                    q=query,
                    k=key,
                    q_norm=self.norm_q,
                    k_norm=self.norm_k,
                    head_dim=self.head_dim,
                    cos_sin_cache=cos_sin_cache,
                    freqs_complex=img_freqs_complex,
                    is_neox=False,
                    position_offset=text_seq_len,
                    allow_inplace=True,
                )
                query = join_seqs(encoder_query, query, sp_txt_pad)
                key = join_seqs(encoder_key, key, sp_txt_pad)
                value = join_seqs(encoder_value, value, sp_txt_pad)
            else:
                query, key, value = joint_qkv
        else:
            if self.use_fused_qkv_epilogue:
                query, key, value = [
                    tensor.contiguous() for tensor in (query, key, value)
                ]
            seq_len = query.shape[1]
            joint_freqs_complex = (
                complex_freqs[:seq_len] if complex_freqs is not None else None
            )
            query, key = apply_qk_norm_with_optional_rope(
                q=query,
                k=key,
                q_norm=self.norm_q,
                k_norm=self.norm_k,
                head_dim=self.head_dim,
                cos_sin_cache=cos_sin_cache,
                freqs_complex=joint_freqs_complex,
                is_neox=False,
                allow_inplace=True,
            )

        hidden_states = self.attn(
            query,
            key,
            value,
            attn_mask=attn_mask,
            attn_mask_meta=attn_mask_meta,
            num_replicated_prefix=num_replicated_prefix,
        )

        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = split_seqs(
                hidden_states, encoder_hidden_states.shape[1], sp_txt_pad
            )
            encoder_hidden_states, _ = self.to_add_out(encoder_hidden_states)

        hidden_states, _ = self.to_out[0](hidden_states)
        hidden_states = self.to_out[1](hidden_states)

        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        else:
            return hidden_states


class Flux2ParallelSelfAttention(torch.nn.Module, AttentionModuleMixin):
    """
    Flux 2 parallel self-attention for the Flux 2 single-stream transformer blocks.

    This implements a parallel transformer block, where the attention QKV projections are fused to the feedforward (FF)
    input projections, and the attention output projections are fused to the FF output projections. See the [ViT-22B
    paper](https://arxiv.org/abs/2302.05442) for a visual depiction of this type of transformer block.
    """

    # Does not support QKV fusion as the QKV projections are always fused
    _supports_qkv_fusion = False

    def __init__(
        self,
        query_dim: int,
        num_heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
        bias: bool = False,
        out_bias: bool = True,
        eps: float = 1e-5,
        out_dim: int = None,
        elementwise_affine: bool = True,
        mlp_ratio: float = 4.0,
        mlp_mult_factor: int = 2,
        supported_attention_backends: set[AttentionBackendEnum] | None = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ):
        super().__init__()

        self.head_dim = dim_head
        self.inner_dim = out_dim if out_dim is not None else dim_head * num_heads
        self.query_dim = query_dim
        self.out_dim = out_dim if out_dim is not None else query_dim
        self.heads = out_dim // dim_head if out_dim is not None else num_heads
        self.tp_size = get_tp_world_size()
        self.local_heads = divide(self.heads, self.tp_size)
        self.local_inner_dim = divide(self.inner_dim, self.tp_size)

        self.use_bias = bias
        self.dropout = dropout

        self.mlp_ratio = mlp_ratio
        self.mlp_hidden_dim = int(query_dim * self.mlp_ratio)
        self.local_mlp_hidden_dim = divide(self.mlp_hidden_dim, self.tp_size)
        self.mlp_mult_factor = mlp_mult_factor

        # Fused QKV projections + MLP input projection
        self.to_qkv_mlp_proj = MergedColumnParallelLinear(
            self.query_dim,
            [self.inner_dim, self.inner_dim, self.inner_dim]
            + [self.mlp_hidden_dim] * self.mlp_mult_factor,
            bias=bias,
            gather_output=False,
            quant_config=quant_config,
            prefix=f"{prefix}.to_qkv_mlp_proj" if prefix else "to_qkv_mlp_proj",
        )
        self.mlp_act_fn = Flux2SwiGLU()

        # QK Norm
        self.norm_q = RMSNorm(dim_head, eps=eps)
        self.norm_k = RMSNorm(dim_head, eps=eps)

        # each rank consumes independently sharded attention and MLP inputs
        self.to_out = RowParallelLinear(
            self.inner_dim + self.mlp_hidden_dim,
            self.out_dim,
            input_sizes=[self.inner_dim, self.mlp_hidden_dim],
            bias=out_bias,
            input_is_parallel=True,
            quant_config=quant_config,
            prefix=f"{prefix}.to_out" if prefix else "to_out",
        )
        self._enable_fp8_token_cat = self.tp_size == 1 and isinstance(
            self.to_out.quant_method, ModelOptFp8LinearMethod
        )
        self._enable_nvfp4_token_cat = False
        capability = current_platform.get_device_capability()
        if (
            self.tp_size == 1
            and capability is not None
            and (capability.major, capability.minor) == (10, 3)
            and isinstance(self.to_out.quant_method, ModelOptFp4LinearMethod)
        ):
            self._enable_nvfp4_token_cat = True

        self.attn = USPAttention(
            num_heads=self.local_heads,
            head_size=self.head_dim,
            dropout_rate=0,
            softmax_scale=None,
            causal=False,
            supported_attention_backends=supported_attention_backends,
        )

    def revalidate_fp8_fast_paths(self) -> None:
        """Recompute fused FP8/NVFP4 fast-path eligibility after submodule changes.

        LoRA wrapping replaces quantized linears with wrappers that do not
        expose ``quant_method``/``input_scale``; flags decided at ``__init__``
        against the raw modules then go stale and ``forward`` would read those
        attributes off the wrapper and crash. Read them defensively here so a
        recheck after wrapping disables the fusion instead.
        """
        self._enable_fp8_token_cat = self.tp_size == 1 and isinstance(
            getattr(self.to_out, "quant_method", None), ModelOptFp8LinearMethod
        )
        capability = current_platform.get_device_capability()
        self._enable_nvfp4_token_cat = (
            self.tp_size == 1
            and capability is not None
            and (capability.major, capability.minor) == (10, 3)
            and isinstance(
                getattr(self.to_out, "quant_method", None), ModelOptFp4LinearMethod
            )
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        cos_sin_cache: Optional[torch.Tensor] = None,
        complex_freqs: Optional[torch.Tensor] = None,
        num_replicated_prefix: int = 0,
        **kwargs,
    ) -> torch.Tensor:
        attn_mask = kwargs.get("attn_mask")
        attn_mask_meta = kwargs.get("attn_mask_meta")
        if attn_mask is None:
            attn_mask = attention_mask

        # Parallel in (QKV + MLP in) projection
        hidden_states, _ = self.to_qkv_mlp_proj(hidden_states)
        qkv, mlp_hidden_states = torch.split(
            hidden_states,
            [
                3 * self.local_inner_dim,
                self.local_mlp_hidden_dim * self.mlp_mult_factor,
            ],
            dim=-1,
        )

        # Handle the attention logic
        query, key, value = qkv.chunk(3, dim=-1)

        query = query.unflatten(-1, (self.local_heads, -1))
        key = key.unflatten(-1, (self.local_heads, -1))
        value = value.unflatten(-1, (self.local_heads, -1))

        if complex_freqs is not None:
            complex_freqs = complex_freqs[: query.shape[1]]

        # Packed QKV/MLP projection views can be normalized and rotated
        # without materializing contiguous Q/K inputs on the supported path.
        query, key = _flux2_single_qk_rope(
            query,
            key,
            self.norm_q,
            self.norm_k,
            self.head_dim,
            cos_sin_cache,
            complex_freqs,
        )
        hidden_states = self.attn(
            query,
            key,
            value,
            attn_mask=attn_mask,
            attn_mask_meta=attn_mask_meta,
            num_replicated_prefix=num_replicated_prefix,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        # BF16: build the output projection's [attn | mlp] input in place. SwiGLU
        # writes its columns directly and only the narrower attention output is
        # copied, instead of a full-width cat; the GEMM input is byte-identical.
        if not (self._enable_fp8_token_cat or self._enable_nvfp4_token_cat):
            attn_dim = hidden_states.shape[-1]
            gemm_input = hidden_states.new_empty(
                (*hidden_states.shape[:-1], attn_dim + mlp_hidden_states.shape[-1] // 2)
            )
            self.mlp_act_fn(mlp_hidden_states, out=gemm_input[..., attn_dim:])
            gemm_input[..., :attn_dim].copy_(hidden_states)
            hidden_states, _ = self.to_out(gemm_input)
            return hidden_states

        # Handle the feedforward (FF) logic
        mlp_hidden_states = self.mlp_act_fn(mlp_hidden_states)

        # Concatenate and parallel output projection. FP8 writes a packed
        # GEMM input; SM103 NVFP4 writes packed values and swizzled scales.
        # Both avoid a full-width BF16 cat materialization.
        output_shape = (*hidden_states.shape[:-1], self.out_dim)
        quantized = None
        packed = None
        if self._enable_fp8_token_cat:
            quantized = try_flux2_token_cat_fp8(
                hidden_states, mlp_hidden_states, self.to_out.input_scale
            )
        elif self._enable_nvfp4_token_cat:
            packed = try_flux2_token_cat_nvfp4(
                hidden_states, mlp_hidden_states, self.to_out.input_scale_inv
            )
        if quantized is not None:
            hidden_states = quantized
            hidden_states, _ = self.to_out(hidden_states)
        elif packed is not None:
            hidden_states = apply_nvfp4_gemm_prequantized(
                self.to_out,
                *packed,
                output_dtype=hidden_states.dtype,
                bias=self.to_out.bias,
            ).view(*output_shape)
        else:
            hidden_states = torch.cat([hidden_states, mlp_hidden_states], dim=-1)
            hidden_states, _ = self.to_out(hidden_states)

        return hidden_states


class Flux2SingleTransformerBlock(nn.Module):
    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        mlp_ratio: float = 3.0,
        eps: float = 1e-6,
        bias: bool = False,
        supported_attention_backends: set[AttentionBackendEnum] | None = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ):
        super().__init__()

        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)

        # Note that the MLP in/out linear layers are fused with the attention QKV/out projections, respectively; this
        # is often called a "parallel" transformer block. See the [ViT-22B paper](https://arxiv.org/abs/2302.05442)
        # for a visual depiction of this type of transformer block.
        self.attn = Flux2ParallelSelfAttention(
            query_dim=dim,
            dim_head=attention_head_dim,
            num_heads=num_attention_heads,
            out_dim=dim,
            bias=bias,
            out_bias=bias,
            eps=eps,
            mlp_ratio=mlp_ratio,
            mlp_mult_factor=2,
            supported_attention_backends=supported_attention_backends,
            quant_config=quant_config,
            prefix=f"{prefix}.attn" if prefix else "attn",
        )
        self._fp8_norm_quant = False

    def configure_fp8_norm_quant(self) -> None:
        self._fp8_norm_quant = _valid_modelopt_fp8_linear(self.attn.to_qkv_mlp_proj)

    def forward(
        self,
        hidden_states: torch.Tensor | PendingGatedResidual,
        encoder_hidden_states: Optional[torch.Tensor],
        temb_mod_params: Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        cos_sin_cache: Optional[torch.Tensor] = None,
        complex_freqs: Optional[torch.Tensor] = None,
        joint_attention_kwargs: Optional[Dict[str, Any]] = None,
        split_hidden_states: bool = False,
        text_seq_len: Optional[int] = None,
        num_replicated_prefix: int = 0,
    ) -> torch.Tensor | PendingGatedResidual:
        # If encoder_hidden_states is None, hidden_states is assumed to have encoder_hidden_states already
        # concatenated
        if encoder_hidden_states is not None:
            assert isinstance(hidden_states, torch.Tensor)
            text_seq_len = encoder_hidden_states.shape[1]
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

        mod_shift, mod_scale, mod_gate = temb_mod_params

        norm_hidden_states, hidden_states = _flux2_norm_maybe_fp8(
            self.norm,
            hidden_states,
            mod_scale,
            mod_shift,
            (self.attn.to_qkv_mlp_proj.input_scale if self._fp8_norm_quant else None),
            fp8_enabled=self._fp8_norm_quant,
        )

        joint_attention_kwargs = joint_attention_kwargs or {}
        attn_output = self.attn(
            hidden_states=norm_hidden_states,
            cos_sin_cache=cos_sin_cache,
            complex_freqs=complex_freqs,
            num_replicated_prefix=num_replicated_prefix,
            **joint_attention_kwargs,
        )

        hidden_states = _defer_gated_residual(hidden_states, attn_output, mod_gate)
        if (
            isinstance(hidden_states, torch.Tensor)
            and hidden_states.dtype == torch.float16
        ):
            hidden_states = hidden_states.clip(-65504, 65504)

        if split_hidden_states:
            if isinstance(hidden_states, tuple):
                hidden_states = _materialize_gated_residual(hidden_states)
            encoder_hidden_states, hidden_states = (
                hidden_states[:, :text_seq_len],
                hidden_states[:, text_seq_len:],
            )
            return encoder_hidden_states, hidden_states
        else:
            return hidden_states


class Flux2TransformerBlock(nn.Module):
    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        mlp_ratio: float = 3.0,
        eps: float = 1e-6,
        bias: bool = False,
        supported_attention_backends: set[AttentionBackendEnum] | None = None,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ):
        super().__init__()
        self.mlp_hidden_dim = int(dim * mlp_ratio)

        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.norm1_context = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)

        self.attn = Flux2Attention(
            query_dim=dim,
            added_kv_proj_dim=dim,
            dim_head=attention_head_dim,
            num_heads=num_attention_heads,
            out_dim=dim,
            bias=bias,
            added_proj_bias=bias,
            out_bias=bias,
            eps=eps,
            supported_attention_backends=supported_attention_backends,
            quant_config=quant_config,
            prefix=f"{prefix}.attn" if prefix else "attn",
        )

        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.ff = Flux2FeedForward(
            dim=dim,
            dim_out=dim,
            mult=mlp_ratio,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.ff" if prefix else "ff",
        )

        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.ff_context = Flux2FeedForward(
            dim=dim,
            dim_out=dim,
            mult=mlp_ratio,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.ff_context" if prefix else "ff_context",
        )
        self._fp8_img_attn_norm_quant = False
        self._fp8_txt_attn_norm_quant = False
        self._fp8_img_ff_norm_quant = False
        self._fp8_txt_ff_norm_quant = False

    def configure_fp8_norm_quant(self) -> None:
        if self.attn.use_fused_qkv:
            self._fp8_img_attn_norm_quant = _valid_modelopt_fp8_linear(self.attn.to_qkv)
        else:
            self._fp8_img_attn_norm_quant = _shared_modelopt_fp8_scale(
                [self.attn.to_q, self.attn.to_k, self.attn.to_v]
            )

        if self.attn.use_fused_added_qkv:
            self._fp8_txt_attn_norm_quant = _valid_modelopt_fp8_linear(
                self.attn.to_added_qkv
            )
        else:
            self._fp8_txt_attn_norm_quant = _shared_modelopt_fp8_scale(
                [
                    self.attn.add_q_proj,
                    self.attn.add_k_proj,
                    self.attn.add_v_proj,
                ]
            )

        self._fp8_img_ff_norm_quant = _valid_modelopt_fp8_linear(self.ff.linear_in)
        self._fp8_txt_ff_norm_quant = _valid_modelopt_fp8_linear(
            self.ff_context.linear_in
        )

    def forward(
        self,
        hidden_states: torch.Tensor | PendingGatedResidual,
        encoder_hidden_states: torch.Tensor | PendingGatedResidual,
        temb_mod_params_img: Tuple[
            Tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...
        ],
        temb_mod_params_txt: Tuple[
            Tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...
        ],
        cos_sin_cache: Optional[torch.Tensor] = None,
        complex_freqs: Optional[torch.Tensor] = None,
        joint_attention_kwargs: Optional[Dict[str, Any]] = None,
        num_replicated_prefix: int = 0,
    ) -> Tuple[
        torch.Tensor | PendingGatedResidual, torch.Tensor | PendingGatedResidual
    ]:
        joint_attention_kwargs = joint_attention_kwargs or {}

        # Modulation parameters shape: [1, 1, self.dim]
        (
            (shift_msa, scale_msa, gate_msa),
            (
                shift_mlp,
                scale_mlp,
                gate_mlp,
            ),
        ) = temb_mod_params_img
        (
            (c_shift_msa, c_scale_msa, c_gate_msa),
            (
                c_shift_mlp,
                c_scale_mlp,
                c_gate_mlp,
            ),
        ) = temb_mod_params_txt

        # Img stream
        norm_hidden_states, hidden_states = _flux2_norm_maybe_fp8(
            self.norm1,
            hidden_states,
            scale_msa,
            shift_msa,
            (
                (
                    self.attn.to_qkv.input_scale
                    if self.attn.use_fused_qkv
                    else self.attn.to_q.input_scale
                )
                if self._fp8_img_attn_norm_quant
                else None
            ),
            fp8_enabled=self._fp8_img_attn_norm_quant,
        )

        # Conditioning txt stream
        norm_encoder_hidden_states, encoder_hidden_states = _flux2_norm_maybe_fp8(
            self.norm1_context,
            encoder_hidden_states,
            c_scale_msa,
            c_shift_msa,
            (
                (
                    self.attn.to_added_qkv.input_scale
                    if self.attn.use_fused_added_qkv
                    else self.attn.add_q_proj.input_scale
                )
                if self._fp8_txt_attn_norm_quant
                else None
            ),
            fp8_enabled=self._fp8_txt_attn_norm_quant,
        )

        # Attention on concatenated img + txt stream
        attention_outputs = self.attn(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=norm_encoder_hidden_states,
            cos_sin_cache=cos_sin_cache,
            complex_freqs=complex_freqs,
            num_replicated_prefix=num_replicated_prefix,
            **joint_attention_kwargs,
        )

        attn_output, context_attn_output = attention_outputs

        # Process attention outputs for the image stream (`hidden_states`).
        norm_hidden_states, hidden_states = _flux2_norm_maybe_fp8(
            self.norm2,
            hidden_states,
            scale_mlp,
            shift_mlp,
            (self.ff.linear_in.input_scale if self._fp8_img_ff_norm_quant else None),
            fp8_enabled=self._fp8_img_ff_norm_quant,
            update=attn_output,
            gate=gate_msa,
        )

        ff_output = self.ff(norm_hidden_states)
        hidden_states = _defer_gated_residual(hidden_states, ff_output, gate_mlp)

        # Process attention outputs for the text stream (`encoder_hidden_states`).
        norm_encoder_hidden_states, encoder_hidden_states = _flux2_norm_maybe_fp8(
            self.norm2_context,
            encoder_hidden_states,
            c_scale_mlp,
            c_shift_mlp,
            (
                self.ff_context.linear_in.input_scale
                if self._fp8_txt_ff_norm_quant
                else None
            ),
            fp8_enabled=self._fp8_txt_ff_norm_quant,
            update=context_attn_output,
            gate=c_gate_msa,
        )

        context_ff_output = self.ff_context(norm_encoder_hidden_states)
        encoder_hidden_states = _defer_gated_residual(
            encoder_hidden_states, context_ff_output, c_gate_mlp
        )
        if (
            isinstance(encoder_hidden_states, torch.Tensor)
            and encoder_hidden_states.dtype == torch.float16
        ):
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)

        return encoder_hidden_states, hidden_states


class Flux2TimestepGuidanceEmbeddings(nn.Module):
    def __init__(
        self,
        in_channels: int = 256,
        embedding_dim: int = 6144,
        bias: bool = False,
        guidance_embeds: bool = True,
    ):
        super().__init__()

        self.time_proj = Timesteps(
            num_channels=in_channels, flip_sin_to_cos=True, downscale_freq_shift=0
        )
        self.timestep_embedder = TimestepEmbedding(
            in_channels=in_channels, time_embed_dim=embedding_dim, sample_proj_bias=bias
        )

        if guidance_embeds:
            self.guidance_embedder = TimestepEmbedding(
                in_channels=in_channels,
                time_embed_dim=embedding_dim,
                sample_proj_bias=bias,
            )
        else:
            self.guidance_embedder = None

    def forward(
        self, timestep: torch.Tensor, guidance: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        timesteps_proj = self.time_proj(timestep)
        timesteps_emb = self.timestep_embedder(
            timesteps_proj.to(timestep.dtype)
        )  # (N, D)

        if guidance is not None and self.guidance_embedder is not None:
            guidance_proj = self.time_proj(guidance)
            guidance_emb = self.guidance_embedder(
                guidance_proj.to(guidance.dtype)
            )  # (N, D)
            time_guidance_emb = timesteps_emb + guidance_emb
            return time_guidance_emb
        else:
            return timesteps_emb


class Flux2Modulation(nn.Module):
    def __init__(self, dim: int, mod_param_sets: int = 2, bias: bool = False):
        super().__init__()
        self.mod_param_sets = mod_param_sets

        self.linear = ColumnParallelLinear(
            dim, dim * 3 * self.mod_param_sets, bias=bias, gather_output=True
        )
        self.act_fn = nn.SiLU()

    def forward(
        self, temb: torch.Tensor
    ) -> Tuple[Tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]:
        mod = self.act_fn(temb)
        mod, _ = self.linear(mod)

        if mod.ndim == 2:
            mod = mod.unsqueeze(1)
        mod_params = torch.chunk(mod, 3 * self.mod_param_sets, dim=-1)
        # Return tuple of 3-tuples of modulation params shift/scale/gate
        return tuple(
            mod_params[3 * i : 3 * (i + 1)] for i in range(self.mod_param_sets)
        )


class Flux2Transformer2DModel(CachableDiT, LayerwiseOffloadableModuleMixin):
    """
    The Transformer model introduced in Flux 2.

    Reference: https://blackforestlabs.ai/announcing-black-forest-labs/

    """

    param_names_mapping = {
        # ModelOpt FP8 exports separate Diffusers projections. Merge Q/K/V and
        # their static scales into the runtime MergedColumnParallelLinear.
        r"^(transformer_blocks\.\d+\.attn)\.to_q\.(weight|bias|weight_scale|input_scale)$": (
            r"\1.to_qkv.\2",
            0,
            3,
        ),
        r"^(transformer_blocks\.\d+\.attn)\.to_k\.(weight|bias|weight_scale|input_scale)$": (
            r"\1.to_qkv.\2",
            1,
            3,
        ),
        r"^(transformer_blocks\.\d+\.attn)\.to_v\.(weight|bias|weight_scale|input_scale)$": (
            r"\1.to_qkv.\2",
            2,
            3,
        ),
        r"^(transformer_blocks\.\d+\.attn)\.add_q_proj\.(weight|bias|weight_scale|input_scale)$": (
            r"\1.to_added_qkv.\2",
            0,
            3,
        ),
        r"^(transformer_blocks\.\d+\.attn)\.add_k_proj\.(weight|bias|weight_scale|input_scale)$": (
            r"\1.to_added_qkv.\2",
            1,
            3,
        ),
        r"^(transformer_blocks\.\d+\.attn)\.add_v_proj\.(weight|bias|weight_scale|input_scale)$": (
            r"\1.to_added_qkv.\2",
            2,
            3,
        ),
        **FluxConfig().arch_config.param_names_mapping,
    }
    packed_modules_mapping = {
        "to_qkv": ["to_q", "to_k", "to_v"],
        "to_added_qkv": ["add_q_proj", "add_k_proj", "add_v_proj"],
    }
    scale_shift_swap_params = ("norm_out.linear.weight", "norm_out.linear.bias")
    # FLUX.2 stays closer to the official diffusers output with Torch SDPA.
    # The generic FA path still produces a measurable image-level drift here.
    _supported_attention_backends = {
        AttentionBackendEnum.TORCH_SDPA,
        AttentionBackendEnum.FA,
        AttentionBackendEnum.AITER,
        AttentionBackendEnum.AITER_SAGE,
    }

    def post_load_weights(self) -> None:
        super().post_load_weights()
        if isinstance(getattr(self, "quant_config", None), ModelOptFp4Config):
            # BFL/ComfyUI checkpoints store AdaLN modulation params as
            # [scale, shift], while diffusers expects [shift, scale].
            for param_name in self.scale_shift_swap_params:
                parts = param_name.split(".")
                module = self
                for part in parts[:-1]:
                    module = getattr(module, part)
                param = getattr(module, parts[-1], None)
                if param is None:
                    continue
                half = param.shape[0] // 2
                with torch.no_grad():
                    first_half = param[:half].clone()
                    param[:half] = param[half:]
                    param[half:] = first_half
                logger.info(
                    "Swapped scale/shift order for %s (BFL → diffusers)",
                    param_name,
                )

        for block in self.transformer_blocks:
            block.configure_fp8_norm_quant()
        for block in self.single_transformer_blocks:
            block.configure_fp8_norm_quant()
        enabled = sum(
            block._fp8_img_attn_norm_quant
            + block._fp8_txt_attn_norm_quant
            + block._fp8_img_ff_norm_quant
            + block._fp8_txt_ff_norm_quant
            for block in self.transformer_blocks
        ) + sum(block._fp8_norm_quant for block in self.single_transformer_blocks)
        total = 4 * len(self.transformer_blocks) + len(self.single_transformer_blocks)
        if enabled:
            logger.info(
                "Enabled FLUX.2 FP8 norm+quant fusion for %d/%d block paths",
                enabled,
                total,
            )

    def revalidate_fp8_fast_paths(self) -> None:
        """Recheck FP8 fast paths after LoRA (or other) submodule replacement.

        ``configure_fp8_norm_quant`` is getattr-safe, so a wrapper that hides
        the quant attributes simply turns each flag off.
        """
        for block in self.transformer_blocks:
            block.configure_fp8_norm_quant()
        for block in self.single_transformer_blocks:
            block.configure_fp8_norm_quant()
            block.attn.revalidate_fp8_fast_paths()

    def __init__(
        self,
        config: FluxConfig,
        hf_config: dict[str, Any],
        quant_config: Optional[QuantizationConfig] = None,
    ):
        super().__init__(config=config, hf_config=hf_config)
        patch_size: int = config.patch_size
        in_channels: int = config.in_channels
        out_channels: Optional[int] = config.out_channels
        num_layers: int = config.num_layers
        num_single_layers: int = config.num_single_layers
        attention_head_dim: int = config.attention_head_dim
        num_attention_heads: int = config.num_attention_heads
        joint_attention_dim: int = config.joint_attention_dim
        timestep_guidance_channels: int = config.timestep_guidance_channels
        mlp_ratio: float = config.mlp_ratio
        axes_dims_rope: Tuple[int, ...] = config.axes_dims_rope
        rope_theta: int = config.rope_theta
        eps: float = config.eps
        guidance_embeds: bool = getattr(config, "guidance_embeds", True)
        self.out_channels = out_channels or in_channels
        self.inner_dim = num_attention_heads * attention_head_dim
        self.guidance_embeds = guidance_embeds
        quant_config = quant_config if quant_config is not None else config.quant_config
        self.quant_config = quant_config

        # 1. Sinusoidal positional embedding for RoPE on image and text tokens
        self.rotary_emb = Flux2PosEmbed(theta=rope_theta, axes_dim=axes_dims_rope)

        # 2. Combined timestep + guidance embedding
        self.time_guidance_embed = Flux2TimestepGuidanceEmbeddings(
            in_channels=timestep_guidance_channels,
            embedding_dim=self.inner_dim,
            bias=False,
            guidance_embeds=guidance_embeds,
        )

        # 3. Modulation (double stream and single stream blocks share modulation parameters, resp.)
        # Two sets of shift/scale/gate modulation parameters for the double stream attn and FF sub-blocks
        self.double_stream_modulation_img = Flux2Modulation(
            self.inner_dim, mod_param_sets=2, bias=False
        )
        self.double_stream_modulation_txt = Flux2Modulation(
            self.inner_dim, mod_param_sets=2, bias=False
        )
        # Only one set of modulation parameters as the attn and FF sub-blocks are run in parallel for single stream
        self.single_stream_modulation = Flux2Modulation(
            self.inner_dim, mod_param_sets=1, bias=False
        )

        # 4. Input projections
        self.x_embedder = ColumnParallelLinear(
            in_channels, self.inner_dim, bias=False, gather_output=True
        )
        self.context_embedder = ColumnParallelLinear(
            joint_attention_dim, self.inner_dim, bias=False, gather_output=True
        )

        # 5. Double Stream Transformer Blocks
        self.transformer_blocks = nn.ModuleList(
            [
                Flux2TransformerBlock(
                    dim=self.inner_dim,
                    num_attention_heads=num_attention_heads,
                    attention_head_dim=attention_head_dim,
                    mlp_ratio=mlp_ratio,
                    eps=eps,
                    bias=False,
                    supported_attention_backends=self._supported_attention_backends,
                    quant_config=quant_config,
                    prefix=f"transformer_blocks.{i}",
                )
                for i in range(num_layers)
            ]
        )

        # 6. Single Stream Transformer Blocks
        self.single_transformer_blocks = nn.ModuleList(
            [
                Flux2SingleTransformerBlock(
                    dim=self.inner_dim,
                    num_attention_heads=num_attention_heads,
                    attention_head_dim=attention_head_dim,
                    mlp_ratio=mlp_ratio,
                    eps=eps,
                    bias=False,
                    supported_attention_backends=self._supported_attention_backends,
                    quant_config=quant_config,
                    prefix=f"single_transformer_blocks.{i}",
                )
                for i in range(num_single_layers)
            ]
        )

        # 7. Output layers
        self.norm_out = AdaLayerNormContinuous(
            self.inner_dim,
            self.inner_dim,
            elementwise_affine=False,
            eps=eps,
            bias=False,
        )
        self.proj_out = ColumnParallelLinear(
            self.inner_dim,
            patch_size * patch_size * self.out_channels,
            bias=False,
            gather_output=True,
            quant_config=quant_config,
            prefix="proj_out",
        )

        self.layer_names = ["transformer_blocks", "single_transformer_blocks"]

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        timestep: torch.LongTensor = None,
        guidance: torch.Tensor = None,
        freqs_cis: torch.Tensor = None,
        joint_attention_kwargs: Optional[Dict[str, Any]] = None,
    ) -> torch.Tensor:
        """
        The [`FluxTransformer2DModel`] forward method.

        Args:
            hidden_states (`torch.Tensor` of shape `(batch_size, image_sequence_length, in_channels)`):
                Input `hidden_states`.
            encoder_hidden_states (`torch.Tensor` of shape `(batch_size, text_sequence_length, joint_attention_dim)`):
                Conditional embeddings (embeddings computed from the input conditions such as prompts) to use.
            timestep ( `torch.LongTensor`):
                Used to indicate denoising step.
            joint_attention_kwargs (`dict`, *optional*):
                A kwargs dictionary that if specified is passed along to the `AttentionProcessor` as defined under
                `self.processor` in
                [diffusers.models.attention_processor](https://github.com/huggingface/diffusers/blob/main/src/diffusers/models/attention_processor.py).

        """
        # 0. Handle input arguments
        if joint_attention_kwargs is not None:
            joint_attention_kwargs = joint_attention_kwargs.copy()
            joint_attention_kwargs.pop("scale", 1.0)

        num_txt_tokens = encoder_hidden_states.shape[1]

        # 1. Calculate timestep embedding and modulation parameters
        timestep = timestep.to(hidden_states.dtype)
        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000

        temb = self.time_guidance_embed(timestep, guidance)

        double_stream_mod_img = self.double_stream_modulation_img(temb)
        double_stream_mod_txt = self.double_stream_modulation_txt(temb)
        single_stream_mod = self.single_stream_modulation(temb)[0]

        # 2. Input projection for image (hidden_states) and conditioning text (encoder_hidden_states)
        hidden_states, _ = self.x_embedder(hidden_states)
        encoder_hidden_states, _ = self.context_embedder(encoder_hidden_states)

        # Shard the replicated text stream across SP ranks (image latents are
        # already sharded); non-divisible lengths tail-pad the last rank and the
        # per-request tail meta lets attention skip the pad for free.
        num_replicated_prefix = num_txt_tokens
        sp_txt_pad = 0
        singles_freqs_cis = freqs_cis
        if should_shard_text(num_txt_tokens):
            txt_shard = build_shard_plan(num_txt_tokens)
            encoder_hidden_states = shard_like(encoder_hidden_states, txt_shard)
            if freqs_cis is not None:
                cos, sin = freqs_cis
                cos = shard_seq_prefix(cos, num_txt_tokens, txt_shard)
                sin = shard_seq_prefix(sin, num_txt_tokens, txt_shard)
                freqs_cis = (cos, sin)
                singles_freqs_cis = freqs_cis
            num_replicated_prefix = 0
            num_txt_tokens = txt_shard.local_len
            tail_meta = tail_attn_meta(
                txt_shard,
                encoder_hidden_states.shape[0],
                hidden_states.device,
                image_seq_len=hidden_states.shape[1],
            )
            if tail_meta is not None:
                joint_attention_kwargs = (
                    joint_attention_kwargs.copy() if joint_attention_kwargs else {}
                )
                joint_attention_kwargs["attn_mask_meta"] = tail_meta
                sp_txt_pad = txt_shard.local_pad
                # The single-stream trunk applies RoPE on the relocated
                # [txt_real, img, pad] layout; reorder its cache to match.
                if freqs_cis is not None:
                    t_loc = txt_shard.local_len
                    singles_freqs_cis = (
                        join_seqs(cos[:t_loc], cos[t_loc:], sp_txt_pad, dim=0),
                        join_seqs(sin[:t_loc], sin[t_loc:], sp_txt_pad, dim=0),
                    )

        # freqs_cis/singles_freqs_cis are fixed for the rest of this forward
        # pass, so derive cos_sin_cache/complex_freqs once here instead of
        # once per block (56x per full denoising step).
        cos_sin_cache, complex_freqs = _flux2_derive_rope_tensors(freqs_cis)
        singles_cos_sin_cache, singles_complex_freqs = _flux2_derive_rope_tensors(
            singles_freqs_cis
        )

        # 4. Double Stream Transformer Blocks
        for index_block, block in enumerate(self.transformer_blocks):
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                temb_mod_params_img=double_stream_mod_img,
                temb_mod_params_txt=double_stream_mod_txt,
                cos_sin_cache=cos_sin_cache,
                complex_freqs=complex_freqs,
                joint_attention_kwargs=joint_attention_kwargs,
                num_replicated_prefix=num_replicated_prefix,
            )
        if isinstance(encoder_hidden_states, tuple):
            encoder_hidden_states = _materialize_gated_residual(encoder_hidden_states)
        if isinstance(hidden_states, tuple):
            hidden_states = _materialize_gated_residual(hidden_states)
        # Concatenate text and image streams for single-block inference;
        # join_seqs relocates any SP text tail-pad behind the image once for
        # the whole trunk (see sp_shard.join_seqs for why).
        txt_real = num_txt_tokens - sp_txt_pad
        hidden_states = join_seqs(encoder_hidden_states, hidden_states, sp_txt_pad)

        # 5. Single Stream Transformer Blocks
        for index_block, block in enumerate(self.single_transformer_blocks):
            hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=None,
                temb_mod_params=single_stream_mod,
                cos_sin_cache=singles_cos_sin_cache,
                complex_freqs=singles_complex_freqs,
                joint_attention_kwargs=joint_attention_kwargs,
                text_seq_len=txt_real,
                num_replicated_prefix=num_replicated_prefix,
            )
        if isinstance(hidden_states, tuple):
            hidden_states = _materialize_gated_residual(hidden_states)
        # Remove text (and any tail pad) from the concatenated stream
        img_end = hidden_states.shape[1] - sp_txt_pad
        hidden_states = hidden_states[:, txt_real:img_end, ...]

        # 6. Output layers
        hidden_states = self.norm_out(hidden_states, temb)
        output, _ = self.proj_out(hidden_states)

        return output


EntryClass = Flux2Transformer2DModel
