# Copied and adapted from: https://github.com/huggingface/diffusers
# main/src/diffusers/models/transformers/transformer_longcat_image.py
"""LongCat-Image Transformer2D model for SGLang.

Implements the LongCatImageTransformer2DModel architecture from diffusers
adapted for SGLang's inference pipeline.

Key adaptation: the transformer accepts raw scheduler timesteps (in [0, 1000])
and feeds them directly to the timestep embedder. The diffusers pipeline passes
``timestep / 1000`` to its transformer (which then multiplies by 1000 internally);
SGLang's DenoisingStage passes the raw timestep instead, so the value reaching
the embedder is identical and no division is needed here.

Attention alignment: uses USPAttention (FA3/FA4 on Hopper/Blackwell) and the
SGLang fused QKNorm+RoPE kernel. LongCat's full-width, interleaved RoPE cache is
handled directly instead of materializing the Diffusers rotate-pair chain.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from diffusers.models.embeddings import (
    TimestepEmbedding,
    Timesteps,
    apply_rotary_emb,
    get_1d_rotary_pos_embed,
)
from diffusers.models.normalization import (
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
)

from sglang.kernels.ops import diffusion as diffusion_ops
from sglang.kernels.ops.diffusion import (
    FUSED_LINEAR_GELU,
    BitExactFusionGate,
    can_use_fused_inplace_qknorm_rope,
    can_use_linear_gelu,
    fused_linear_gelu_tanh,
    residual_gate_add,
    tensors_equal,
)
from sglang.multimodal_gen.runtime.distributed import get_tp_world_size
from sglang.multimodal_gen.runtime.layers.attention import USPAttention
from sglang.multimodal_gen.runtime.layers.layernorm import (
    RMSNorm,
    apply_qk_norm,
    apply_qk_norm_rope,
)
from sglang.multimodal_gen.runtime.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.runtime.managers.memory_managers.layerwise_offload import (
    LayerwiseOffloadableModuleMixin,
)
from sglang.multimodal_gen.runtime.models.dits.base import BaseDiT
from sglang.multimodal_gen.runtime.models.dits.common import (
    layernorm_modulate_bitexact,
)
from sglang.multimodal_gen.runtime.platforms import current_platform
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

_is_cuda = current_platform.is_cuda()

logger = init_logger(__name__)

_LONGCAT_QKNORM_ROPE = BitExactFusionGate("LongCat fused QKNorm+RoPE")
_LONGCAT_LN_MOD = BitExactFusionGate("LongCat fused LN+modulate", per_signature=True)
_LONGCAT_GELU_CAT = BitExactFusionGate("LongCat fused GELU+cat")


def _longcat_gelu_cat(
    attn: torch.Tensor, mlp: torch.Tensor, activation: nn.Module
) -> torch.Tensor:
    if (
        type(activation) is nn.GELU
        and activation.approximate == "tanh"
        and _is_cuda
        and attn.is_cuda
        and attn.dtype is torch.bfloat16
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    ):
        return _LONGCAT_GELU_CAT.run(
            lambda: diffusion_ops.fused_gelu_tanh_cat(attn, mlp),
            lambda: torch.cat((attn, activation(mlp)), dim=-1),
            logger=logger,
        )
    return torch.cat((attn, activation(mlp)), dim=-1)


def _longcat_norm_modulate(
    norm: nn.Module,
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
) -> torch.Tensor:

    def reference():
        return norm(x) * (1 + scale[:, None]) + shift[:, None]

    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return reference()
    # LayerNorm's reduction depends on the live aten dispatch, so each
    # shape/stride is verified separately.
    return layernorm_modulate_bitexact(
        _LONGCAT_LN_MOD,
        norm,
        x,
        scale,
        shift,
        reference,
        sig=(
            x.shape,
            x.stride(),
            scale.shape,
            scale.stride(),
            shift.shape,
            shift.stride(),
            norm.eps,
            x.dtype,
            x.device,
        ),
    )


class _LongCatAdaLayerNormZero(AdaLayerNormZero):
    def forward(
        self,
        x: torch.Tensor,
        timestep: Optional[torch.Tensor] = None,
        class_labels: Optional[torch.LongTensor] = None,
        hidden_dtype: Optional[torch.dtype] = None,
        emb: Optional[torch.Tensor] = None,
    ):
        if self.emb is not None:
            emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(
            6, dim=1
        )
        x = _longcat_norm_modulate(self.norm, x, scale_msa, shift_msa)
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class _LongCatAdaLayerNormZeroSingle(AdaLayerNormZeroSingle):
    def forward(self, x: torch.Tensor, emb: Optional[torch.Tensor] = None):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
        return _longcat_norm_modulate(self.norm, x, scale_msa, shift_msa), gate_msa


def _longcat_qknorm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: RMSNorm,
    k_norm: RMSNorm,
    head_dim: int,
    image_rotary_emb: Tuple[torch.Tensor, torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    q, k = apply_qk_norm(q, k, q_norm, k_norm, head_dim)
    q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
    k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
    return q, k


def _apply_longcat_qknorm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: RMSNorm,
    k_norm: RMSNorm,
    head_dim: int,
    image_rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]],
    cos_sin_cache: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    if image_rotary_emb is None:
        return apply_qk_norm(q, k, q_norm, k_norm, head_dim)

    q_eps = q_norm.variance_epsilon
    k_eps = k_norm.variance_epsilon
    can_fuse = (
        cos_sin_cache is not None
        and positions is not None
        and q.is_cuda
        and not torch.compiler.is_compiling()
        and q_eps == k_eps
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.dtype == q.dtype
        and q_norm.weight.dtype == q.dtype
        and k_norm.weight.dtype == k.dtype
        and q.is_contiguous()
        and k.is_contiguous()
        and can_use_fused_inplace_qknorm_rope(
            head_dim=head_dim,
            rope_dim=head_dim,
            is_neox=False,
            dtype=q.dtype,
            cache_dtype=cos_sin_cache.dtype,
            round_norm_before_rope=True,
            cache_has_full_width=True,
        )
    )
    verified = _LONGCAT_QKNORM_ROPE.verified
    if (
        can_fuse
        and not _LONGCAT_QKNORM_ROPE.disabled
        and (verified or _LONGCAT_QKNORM_ROPE.can_attempt_once())
    ):
        if q.shape[0] > 1:
            positions = positions.repeat(q.shape[0])
        q_input = q.clone() if not verified else q
        k_input = k.clone() if not verified else k
        try:
            out = apply_qk_norm_rope(
                q=q,
                k=k,
                q_norm=q_norm,
                k_norm=k_norm,
                head_dim=head_dim,
                cos_sin_cache=cos_sin_cache,
                is_neox=False,
                positions=positions,
                round_norm_before_rope=True,
                cache_has_full_width=True,
            )
        except Exception as exc:
            _LONGCAT_QKNORM_ROPE.on_exception(exc, logger=logger)
            return _longcat_qknorm_rope_reference(
                q_input,
                k_input,
                q_norm,
                k_norm,
                head_dim,
                image_rotary_emb,
            )
        else:
            if verified:
                return out
            ref = _longcat_qknorm_rope_reference(
                q_input,
                k_input,
                q_norm,
                k_norm,
                head_dim,
                image_rotary_emb,
            )
            return _LONGCAT_QKNORM_ROPE.accept_or_fallback(
                out,
                ref,
                equal=tensors_equal,
                logger=logger,
            )

    return _longcat_qknorm_rope_reference(
        q,
        k,
        q_norm,
        k_norm,
        head_dim,
        image_rotary_emb,
    )


# ---------------------------------------------------------------------------
# FFN
# ---------------------------------------------------------------------------


class _LongCatFFN(nn.Module):
    """TP-parallel FFN matching diffusers FeedForward(activation_fn="gelu-approximate").

    Weight names mirror the diffusers checkpoint layout so loading works without remapping:
      net.0.proj  ->  ColumnParallelLinear  (project in, dim -> inner_dim)
      net.2       ->  RowParallelLinear     (project out, inner_dim -> dim)
    """

    def __init__(self, dim: int, inner_dim: int, bias: bool = True, prefix: str = ""):
        super().__init__()
        self.net = nn.ModuleList(
            [
                # net.0: GELU activation wrapper — only the inner proj is a parameter
                nn.ModuleDict(
                    {
                        "proj": ColumnParallelLinear(
                            dim,
                            inner_dim,
                            bias=bias,
                            gather_output=False,
                            prefix=f"{prefix}.net.0.proj",
                        )
                    }
                ),
                nn.Dropout(
                    0.0
                ),  # net.1: dummy dropout, matches diffusers checkpoint layout
                RowParallelLinear(
                    inner_dim,
                    dim,
                    bias=bias,
                    input_is_parallel=True,
                    prefix=f"{prefix}.net.2",
                ),
            ]
        )
        self.act = nn.GELU(approximate="tanh")
        # lossless/high site: up-proj GEMM + tanh-GELU epilogue. Off by
        # default; the denoising stage mounts it per batch. The ModuleDict holds
        # `proj` in _modules, so getattr resolves it for the fusion helper.
        FUSED_LINEAR_GELU.mark(self.net[0], "proj")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        proj = self.net[0]["proj"]
        if FUSED_LINEAR_GELU.is_enabled(self.net[0]) and can_use_linear_gelu(
            proj, hidden_states
        ):
            hidden_states = fused_linear_gelu_tanh(
                hidden_states, proj.weight, proj.bias
            )
        else:
            hidden_states, _ = proj(hidden_states)
            hidden_states = self.act(hidden_states)
        hidden_states, _ = self.net[2](hidden_states)
        return hidden_states


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------


class _LongCatJointAttention(nn.Module):
    """Double-stream (joint) attention for _TransformerBlock.

    img and txt tokens are projected separately, passed through fused QKNorm
    and full-width interleaved RoPE, then concatenated (txt first) before
    USPAttention.

    TP: Q/K/V and add_q/k/v use ColumnParallelLinear (heads sharded across TP ranks).
    Output projections use RowParallelLinear (all-reduce after matmul).
    """

    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        bias: bool = True,
        eps: float = 1e-6,
        prefix: str = "",
    ):
        super().__init__()
        tp_size = get_tp_world_size()
        self.num_local_heads = num_attention_heads // tp_size
        assert num_attention_heads % tp_size == 0, (
            f"num_attention_heads ({num_attention_heads}) must be divisible by tp_size ({tp_size})"
        )
        self.head_dim = attention_head_dim
        inner_dim = num_attention_heads * attention_head_dim

        self.norm_q = RMSNorm(attention_head_dim, eps=eps)
        self.norm_k = RMSNorm(attention_head_dim, eps=eps)
        self.norm_added_q = RMSNorm(attention_head_dim, eps=eps)
        self.norm_added_k = RMSNorm(attention_head_dim, eps=eps)

        self.to_q = ColumnParallelLinear(
            dim, inner_dim, bias=bias, gather_output=False, prefix=f"{prefix}.to_q"
        )
        self.to_k = ColumnParallelLinear(
            dim, inner_dim, bias=bias, gather_output=False, prefix=f"{prefix}.to_k"
        )
        self.to_v = ColumnParallelLinear(
            dim, inner_dim, bias=bias, gather_output=False, prefix=f"{prefix}.to_v"
        )
        self.add_q_proj = ColumnParallelLinear(
            dim,
            inner_dim,
            bias=bias,
            gather_output=False,
            prefix=f"{prefix}.add_q_proj",
        )
        self.add_k_proj = ColumnParallelLinear(
            dim,
            inner_dim,
            bias=bias,
            gather_output=False,
            prefix=f"{prefix}.add_k_proj",
        )
        self.add_v_proj = ColumnParallelLinear(
            dim,
            inner_dim,
            bias=bias,
            gather_output=False,
            prefix=f"{prefix}.add_v_proj",
        )

        self.to_out = nn.ModuleList(
            [
                RowParallelLinear(
                    inner_dim,
                    dim,
                    bias=bias,
                    input_is_parallel=True,
                    prefix=f"{prefix}.to_out.0",
                )
            ]
        )
        self.to_add_out = RowParallelLinear(
            inner_dim,
            dim,
            bias=bias,
            input_is_parallel=True,
            prefix=f"{prefix}.to_add_out",
        )

        self.attn = USPAttention(
            num_heads=self.num_local_heads,
            head_size=attention_head_dim,
            causal=False,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        image_rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        cos_sin_cache: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        txt_seq_len = encoder_hidden_states.shape[1]

        q, _ = self.to_q(hidden_states)
        k, _ = self.to_k(hidden_states)
        v, _ = self.to_v(hidden_states)
        q = q.unflatten(-1, (self.num_local_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_local_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_local_heads, self.head_dim))

        eq, _ = self.add_q_proj(encoder_hidden_states)
        ek, _ = self.add_k_proj(encoder_hidden_states)
        ev, _ = self.add_v_proj(encoder_hidden_states)
        eq = eq.unflatten(-1, (self.num_local_heads, self.head_dim))
        ek = ek.unflatten(-1, (self.num_local_heads, self.head_dim))
        ev = ev.unflatten(-1, (self.num_local_heads, self.head_dim))

        if image_rotary_emb is None:
            image_rotary_emb_txt = image_rotary_emb_img = None
        else:
            cos, sin = image_rotary_emb
            image_rotary_emb_txt = (cos[:txt_seq_len], sin[:txt_seq_len])
            image_rotary_emb_img = (cos[txt_seq_len:], sin[txt_seq_len:])
        positions_txt = positions[:txt_seq_len] if positions is not None else None
        positions_img = positions[txt_seq_len:] if positions is not None else None

        q, k = _apply_longcat_qknorm_rope(
            q,
            k,
            self.norm_q,
            self.norm_k,
            self.head_dim,
            image_rotary_emb_img,
            cos_sin_cache,
            positions_img,
        )
        eq, ek = _apply_longcat_qknorm_rope(
            eq,
            ek,
            self.norm_added_q,
            self.norm_added_k,
            self.head_dim,
            image_rotary_emb_txt,
            cos_sin_cache,
            positions_txt,
        )

        # Concatenate: txt first, then img (matches diffusers convention)
        q = torch.cat([eq, q], dim=1)
        k = torch.cat([ek, k], dim=1)
        v = torch.cat([ev, v], dim=1)

        x = self.attn(q, k, v, num_replicated_prefix=txt_seq_len)
        x = x.flatten(2, 3).to(q.dtype)

        encoder_out, hidden_out = x.split_with_sizes(
            [txt_seq_len, x.shape[1] - txt_seq_len], dim=1
        )
        hidden_out, _ = self.to_out[0](hidden_out)
        encoder_out, _ = self.to_add_out(encoder_out)
        return hidden_out, encoder_out


class _LongCatSingleAttention(nn.Module):
    """Single-stream attention for _SingleTransformerBlock.

    txt and img are already concatenated by the block before calling here.
    No output projection — the block handles proj_out itself.

    TP: Q/K/V use ColumnParallelLinear with gather_output=False (head-sharded).
    USPAttention receives [B, S, H_local, D] directly; no all-gather needed here.
    proj_mlp/proj_out in _SingleTransformerBlock must also use gather_output=False
    so the concat [attn_output, mlp_hidden_states] is uniformly sharded.
    """

    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        bias: bool = True,
        eps: float = 1e-6,
        prefix: str = "",
    ):
        super().__init__()
        tp_size = get_tp_world_size()
        self.num_local_heads = num_attention_heads // tp_size
        assert num_attention_heads % tp_size == 0, (
            f"num_attention_heads ({num_attention_heads}) must be divisible by tp_size ({tp_size})"
        )
        self.head_dim = attention_head_dim
        inner_dim = num_attention_heads * attention_head_dim

        self.norm_q = RMSNorm(attention_head_dim, eps=eps)
        self.norm_k = RMSNorm(attention_head_dim, eps=eps)

        self.to_q = ColumnParallelLinear(
            dim, inner_dim, bias=bias, gather_output=False, prefix=f"{prefix}.to_q"
        )
        self.to_k = ColumnParallelLinear(
            dim, inner_dim, bias=bias, gather_output=False, prefix=f"{prefix}.to_k"
        )
        self.to_v = ColumnParallelLinear(
            dim, inner_dim, bias=bias, gather_output=False, prefix=f"{prefix}.to_v"
        )

        self.attn = USPAttention(
            num_heads=self.num_local_heads,
            head_size=attention_head_dim,
            causal=False,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        image_rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        num_replicated_prefix: int = 0,
        cos_sin_cache: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        q, _ = self.to_q(hidden_states)
        k, _ = self.to_k(hidden_states)
        v, _ = self.to_v(hidden_states)
        q = q.unflatten(-1, (self.num_local_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_local_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_local_heads, self.head_dim))

        q, k = _apply_longcat_qknorm_rope(
            q,
            k,
            self.norm_q,
            self.norm_k,
            self.head_dim,
            image_rotary_emb,
            cos_sin_cache,
            positions,
        )

        x = self.attn(q, k, v, num_replicated_prefix=num_replicated_prefix)
        return x.flatten(2, 3).to(q.dtype)


# ---------------------------------------------------------------------------
# Transformer blocks
# ---------------------------------------------------------------------------


class _SingleTransformerBlock(nn.Module):
    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        mlp_ratio: float = 4.0,
        prefix: str = "",
    ):
        super().__init__()
        self.mlp_hidden_dim = int(dim * mlp_ratio)
        self.norm = _LongCatAdaLayerNormZeroSingle(dim)
        # proj_mlp: ColumnParallelLinear with gather_output=False keeps output
        # head-sharded, consistent with attn_output from _LongCatSingleAttention.
        self.proj_mlp = ColumnParallelLinear(
            dim,
            self.mlp_hidden_dim,
            bias=True,
            gather_output=False,
            prefix=f"{prefix}.proj_mlp",
        )
        self.act_mlp = nn.GELU(approximate="tanh")
        # lossless/high site: proj_mlp GEMM + tanh-GELU epilogue,
        # mounted per batch by the denoising stage; off (bit-exact) by default.
        FUSED_LINEAR_GELU.mark(self, "proj_mlp")
        # each rank consumes independently sharded attention and MLP inputs
        self.proj_out = RowParallelLinear(
            dim + self.mlp_hidden_dim,
            dim,
            input_sizes=[num_attention_heads * attention_head_dim, self.mlp_hidden_dim],
            bias=True,
            input_is_parallel=True,
            prefix=f"{prefix}.proj_out",
        )
        self.attn = _LongCatSingleAttention(
            dim=dim,
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            bias=True,
            eps=1e-6,
            prefix=f"{prefix}.attn",
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb=None,
        cos_sin_cache=None,
        positions=None,
        **kwargs,
    ):
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

        residual = hidden_states
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        gelu_in_projection = FUSED_LINEAR_GELU.is_enabled(self) and can_use_linear_gelu(
            self.proj_mlp, norm_hidden_states
        )
        if gelu_in_projection:
            mlp_hidden_states = fused_linear_gelu_tanh(
                norm_hidden_states, self.proj_mlp.weight, self.proj_mlp.bias
            )
        else:
            mlp_hidden_states, _ = self.proj_mlp(norm_hidden_states)
        attn_output = self.attn(
            hidden_states=norm_hidden_states,
            image_rotary_emb=image_rotary_emb,
            # Text is replicated per SP rank; keep it out of the all-to-all.
            num_replicated_prefix=text_seq_len,
            cos_sin_cache=cos_sin_cache,
            positions=positions,
        )
        if gelu_in_projection:
            hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
        else:
            hidden_states = _longcat_gelu_cat(
                attn_output, mlp_hidden_states, self.act_mlp
            )
        gate = gate.unsqueeze(1)
        hidden_states, _ = self.proj_out(hidden_states)
        hidden_states = residual_gate_add(residual, hidden_states, gate)
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)

        encoder_hidden_states, hidden_states = (
            hidden_states[:, :text_seq_len],
            hidden_states[:, text_seq_len:],
        )
        return encoder_hidden_states, hidden_states


class _TransformerBlock(nn.Module):
    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        qk_norm_eps: float = 1e-6,
        prefix: str = "",
    ):
        super().__init__()
        self.norm1 = _LongCatAdaLayerNormZero(dim)
        self.norm1_context = _LongCatAdaLayerNormZero(dim)
        self.attn = _LongCatJointAttention(
            dim=dim,
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            bias=True,
            eps=qk_norm_eps,
            prefix=f"{prefix}.attn",
        )
        # norm2/norm2_context use eps=1e-6 matching diffusers (not configurable)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = _LongCatFFN(dim=dim, inner_dim=dim * 4, prefix=f"{prefix}.ff")
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff_context = _LongCatFFN(
            dim=dim, inner_dim=dim * 4, prefix=f"{prefix}.ff_context"
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb=None,
        cos_sin_cache=None,
        positions=None,
        **kwargs,
    ):
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(
            hidden_states, emb=temb
        )
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
            self.norm1_context(encoder_hidden_states, emb=temb)
        )

        attn_output, context_attn_output = self.attn(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=norm_encoder_hidden_states,
            image_rotary_emb=image_rotary_emb,
            cos_sin_cache=cos_sin_cache,
            positions=positions,
        )

        hidden_states = residual_gate_add(
            hidden_states, attn_output, gate_msa.unsqueeze(1)
        )

        norm_hidden_states = _longcat_norm_modulate(
            self.norm2, hidden_states, scale_mlp, shift_mlp
        )
        ff_output = self.ff(norm_hidden_states)
        hidden_states = residual_gate_add(
            hidden_states, ff_output, gate_mlp.unsqueeze(1)
        )

        encoder_hidden_states = residual_gate_add(
            encoder_hidden_states, context_attn_output, c_gate_msa.unsqueeze(1)
        )

        norm_encoder_hidden_states = _longcat_norm_modulate(
            self.norm2_context, encoder_hidden_states, c_scale_mlp, c_shift_mlp
        )
        context_ff_output = self.ff_context(norm_encoder_hidden_states)
        encoder_hidden_states = residual_gate_add(
            encoder_hidden_states,
            context_ff_output,
            c_gate_mlp.unsqueeze(1),
        )
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)

        return encoder_hidden_states, hidden_states


# ---------------------------------------------------------------------------
# Position embedding
# ---------------------------------------------------------------------------


class _LongCatPosEmbed(nn.Module):
    def __init__(self, theta: int, axes_dim: List[int]):
        super().__init__()
        self.theta = theta
        self.axes_dim = axes_dim

    def forward(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return (freqs_cos, freqs_sin) each of shape [S, head_dim]."""
        cos_out, sin_out = [], []
        pos = ids.float()
        freqs_dtype = (
            torch.float32 if ids.device.type in ("mps", "npu") else torch.float64
        )
        for i, dim in enumerate(self.axes_dim):
            cos, sin = get_1d_rotary_pos_embed(
                dim,
                pos[:, i],
                theta=self.theta,
                repeat_interleave_real=True,
                use_real=True,
                freqs_dtype=freqs_dtype,
            )
            cos_out.append(cos)
            sin_out.append(sin)
        freqs_cos = torch.cat(cos_out, dim=-1).to(ids.device)
        freqs_sin = torch.cat(sin_out, dim=-1).to(ids.device)
        return freqs_cos, freqs_sin


# ---------------------------------------------------------------------------
# Timestep embedding
# ---------------------------------------------------------------------------


class _TimestepEmbeddings(nn.Module):
    def __init__(self, embedding_dim: int):
        super().__init__()
        self.time_proj = Timesteps(
            num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0
        )
        self.timestep_embedder = TimestepEmbedding(
            in_channels=256, time_embed_dim=embedding_dim
        )

    def forward(self, timestep: torch.Tensor, hidden_dtype) -> torch.Tensor:
        timesteps_proj = self.time_proj(timestep)
        return self.timestep_embedder(timesteps_proj.to(dtype=hidden_dtype))


# ---------------------------------------------------------------------------
# Main model
# ---------------------------------------------------------------------------


class LongCatImageTransformer2DModel(BaseDiT, LayerwiseOffloadableModuleMixin):
    """SGLang implementation of the LongCat-Image transformer.

    Accepts raw scheduler timesteps (in [0, 1000]) and feeds them directly to
    the timestep embedder (no /1000). The diffusers pipeline divides timesteps
    by 1000 before calling its transformer, which multiplies them back by 1000
    internally — so the embedder receives the same value either way.
    """

    _aliases = ["LongCatImageTransformer2DModel"]

    param_names_mapping = {}
    _fsdp_shard_conditions = []
    _compile_conditions = []

    def __init__(self, config, hf_config: dict = None, quant_config=None):
        super().__init__(config=config, hf_config=hf_config or {})
        arch = config.arch_config

        patch_size = getattr(arch, "patch_size", 1)
        in_channels = getattr(arch, "in_channels", 64)
        num_layers = getattr(arch, "num_layers", 19)
        num_single_layers = getattr(arch, "num_single_layers", 38)
        attention_head_dim = getattr(arch, "attention_head_dim", 128)
        num_attention_heads = getattr(arch, "num_attention_heads", 24)
        joint_attention_dim = getattr(arch, "joint_attention_dim", 3584)
        axes_dims_rope = getattr(arch, "axes_dims_rope", [16, 56, 56])

        self.config = config
        self.out_channels = in_channels
        self.inner_dim = num_attention_heads * attention_head_dim

        # Required by BaseDiT.__post_init__
        self.hidden_size = self.inner_dim
        self.num_attention_heads = num_attention_heads
        self.num_channels_latents = 16  # unpacked latent channels

        self.pos_embed = _LongCatPosEmbed(theta=10000, axes_dim=axes_dims_rope)
        self.time_embed = _TimestepEmbeddings(embedding_dim=self.inner_dim)
        self.context_embedder = ColumnParallelLinear(
            joint_attention_dim,
            self.inner_dim,
            bias=True,
            gather_output=True,
            prefix="context_embedder",
        )
        self.x_embedder = ColumnParallelLinear(
            in_channels,
            self.inner_dim,
            bias=True,
            gather_output=True,
            prefix="x_embedder",
        )

        self.transformer_blocks = nn.ModuleList(
            [
                _TransformerBlock(
                    dim=self.inner_dim,
                    num_attention_heads=num_attention_heads,
                    attention_head_dim=attention_head_dim,
                    prefix=f"transformer_blocks.{i}",
                )
                for i in range(num_layers)
            ]
        )

        self.single_transformer_blocks = nn.ModuleList(
            [
                _SingleTransformerBlock(
                    dim=self.inner_dim,
                    num_attention_heads=num_attention_heads,
                    attention_head_dim=attention_head_dim,
                    prefix=f"single_transformer_blocks.{i}",
                )
                for i in range(num_single_layers)
            ]
        )

        self.norm_out = AdaLayerNormContinuous(
            self.inner_dim, self.inner_dim, elementwise_affine=False, eps=1e-6
        )
        self.proj_out = ColumnParallelLinear(
            self.inner_dim,
            patch_size * patch_size * self.out_channels,
            bias=True,
            gather_output=True,
            prefix="proj_out",
        )

        self.layer_names = ["transformer_blocks", "single_transformer_blocks"]

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        timestep: torch.Tensor = None,
        img_ids: torch.Tensor = None,
        txt_ids: torch.Tensor = None,
        guidance: torch.Tensor = None,
        return_dict: bool = False,
        **kwargs,
    ):
        hidden_states, _ = self.x_embedder(hidden_states)

        # Raw scheduler timestep in [0, 1000] — fed directly (see module docstring).
        temb = self.time_embed(timestep.to(hidden_states.dtype), hidden_states.dtype)

        encoder_hidden_states, _ = self.context_embedder(encoder_hidden_states)

        # RoPE is computed on the fly from txt_ids + img_ids, matching diffusers'
        # transformer (which calls self.pos_embed internally). image_rotary_emb is
        # only passed in for standalone model testing.
        image_rotary_emb = kwargs.get("image_rotary_emb") or self.pos_embed(
            torch.cat((txt_ids, img_ids), dim=0)
        )
        cos, sin = image_rotary_emb
        cos_sin_cache = torch.cat((cos, sin), dim=-1).contiguous()
        positions = torch.arange(cos.shape[0], device=cos.device, dtype=torch.int64)

        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                temb=temb,
                image_rotary_emb=image_rotary_emb,
                cos_sin_cache=cos_sin_cache,
                positions=positions,
            )

        for block in self.single_transformer_blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                temb=temb,
                image_rotary_emb=image_rotary_emb,
                cos_sin_cache=cos_sin_cache,
                positions=positions,
            )

        hidden_states = self.norm_out(hidden_states, temb)
        output, _ = self.proj_out(hidden_states)

        if return_dict:
            from diffusers.models.modeling_outputs import Transformer2DModelOutput

            return Transformer2DModelOutput(sample=output)
        return output


EntryClass = LongCatImageTransformer2DModel
