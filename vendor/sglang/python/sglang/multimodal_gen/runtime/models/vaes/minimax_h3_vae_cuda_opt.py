# SPDX-License-Identifier: Apache-2.0
"""CUDA fast path for the MiniMax-H3 video VAE decoder (ViT3DDecoder).

Installed once at VAE load and dispatched on one decode-scoped
:class:`VaeFastPathGate`: ``quality="lossless"`` and ``"high"`` take the fast
path (rounding-level differences), ``"exact"`` runs the original module path
bit-for-bit. Two things read the gate:

* every decoder attention block fuses its per-head QK RMSNorm + NeoX RoPE
  into one in-place launch and runs its attention on cuDNN SDPA;
* the tiled decode runs several equal-shaped tiles and temporal windows per
  decoder forward, with the caps the VAE config carries (klvae.py).

The bit-exact output kernels (temporal blend write, output denormalization)
are not gated here: they mount at every quality level behind their own
first-sight verification. Install is all-or-nothing per layer and fail-closed.
"""

from types import MethodType

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sglang.kernels.ops.diffusion import (
    can_use_fused_inplace_qknorm_rope,
    fused_inplace_qknorm_rope,
)
from sglang.multimodal_gen import envs
from sglang.multimodal_gen.runtime.models.vaes.fast_path_gate import (
    VaeFastPathGate,
    register_vae_fast_path_gate,
)
from sglang.multimodal_gen.runtime.models.vaes.minimax_h3_video_vae.attention import (
    Attention,
    _apply_qk_norm,
    _sdpa_attention,
)
from sglang.multimodal_gen.runtime.models.vaes.minimax_h3_video_vae.vae_vit import (
    ViT3DDecoder,
)
from sglang.multimodal_gen.runtime.models.vaes.minimax_h3_video_vae.vit_utils import (
    apply_rotary_pos_emb_qk,
    native_rope_cache,
)
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

logger = init_logger(__name__)


def _fused_qknorm_rope(self, query, key, rotary_pos_emb) -> bool:
    native = native_rope_cache(query, key, rotary_pos_emb)
    if native is None:
        return False
    cache, positions = native
    if not can_use_fused_inplace_qknorm_rope(
        head_dim=self.dim_head,
        rope_dim=cache.shape[1],
        is_neox=True,
        dtype=query.dtype,
        cache_dtype=cache.dtype,
        round_norm_before_rope=True,
    ):
        return False
    weight = self._sgl_unit_weight
    if weight is None or weight.dtype != query.dtype or weight.device != query.device:
        weight = torch.ones(self.dim_head, dtype=query.dtype, device=query.device)
        self._sgl_unit_weight = weight
    # Batched decoder tiles flatten into rows; a view, so the update is in place.
    fused_inplace_qknorm_rope(
        query.flatten(0, 1),
        key.flatten(0, 1),
        weight,
        weight,
        cache,
        positions,
        is_neox=True,
        eps=self.norm_q.eps,
        head_dim=self.dim_head,
        rope_dim=cache.shape[1],
        round_norm_before_rope=True,
    )
    return True


def _cudnn_attention(self, query, key, value):
    if not self._sgl_cudnn_failed:
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(
                    query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
                ).transpose(1, 2)
        except RuntimeError as e:
            logger.warning(
                "MiniMax-H3 VAE: cuDNN SDPA failed (%s); using the layer's "
                "attention backend.",
                e,
            )
            self._sgl_cudnn_failed = True
    return self.attn(query, key, value)


def _attn_fast_forward(self, hidden_states, rotary_pos_emb=None):
    if (
        not self._sgl_gate.enabled
        or rotary_pos_emb is None
        or torch.is_grad_enabled()
        or torch.compiler.is_compiling()
    ):
        return type(self).forward(self, hidden_states, rotary_pos_emb)

    batch_size, seq_len, _ = hidden_states.shape
    qkv = self.to_qkv(hidden_states)
    qkv = qkv.view(batch_size, seq_len, -1, 3 * self.dim_head)
    query, key, value = torch.chunk(qkv, 3, dim=-1)

    if not _fused_qknorm_rope(self, query, key, rotary_pos_emb):
        query = _apply_qk_norm(self.norm_q, query)
        key = _apply_qk_norm(self.norm_k, key)
        query, key = apply_rotary_pos_emb_qk(query, key, rotary_pos_emb)

    if self.attn is not None and query.dtype in (torch.float16, torch.bfloat16):
        hidden_states = _cudnn_attention(self, query, key, value)
    else:
        hidden_states = _sdpa_attention(query, key, value)

    hidden_states = hidden_states.reshape(batch_size, seq_len, -1)
    return self.to_out(hidden_states)


def _plain_rms_norm(module) -> bool:
    return isinstance(module, nn.RMSNorm) and module.weight is None


def _attn_fast_compatible(attn: nn.Module) -> bool:
    return (
        type(attn) is Attention
        and _plain_rms_norm(attn.norm_q)
        and _plain_rms_norm(attn.norm_k)
        and attn.norm_q.eps == attn.norm_k.eps
    )


def _install_fast_attention(
    attn_modules: list[nn.Module], gate: VaeFastPathGate
) -> None:
    for attn in attn_modules:
        attn._sgl_gate = gate
        attn._sgl_unit_weight = None
        attn._sgl_cudnn_failed = False
        attn.forward = MethodType(_attn_fast_forward, attn)


def _fast_attention_modules(decoder: nn.Module) -> list[nn.Module]:
    """The decoder attention blocks to rebind; empty when any block is
    non-standard or the fp32 QK norm is disabled, since a partial install would
    change numerics between blocks."""
    if type(decoder) is not ViT3DDecoder:
        return []
    if not envs.MINIMAX_H3_VAE_DECODER_VIT_FP32_NORM:
        logger.info(
            "MiniMax-H3 VAE: fp32 QK norm disabled; skipping attention fast path."
        )
        return []
    attn_modules = [block.attn for block in decoder.transformer_blocks]
    eligible = [attn for attn in attn_modules if _attn_fast_compatible(attn)]
    if len(eligible) != len(attn_modules):
        logger.warning(
            "MiniMax-H3 VAE: %d/%d decoder attention blocks non-standard; "
            "skipping attention fast path.",
            len(attn_modules) - len(eligible),
            len(attn_modules),
        )
        return []
    return eligible


def maybe_optimize_minimax_h3_vae(vae: nn.Module) -> nn.Module:
    """Install the quality-gated CUDA MiniMax-H3 VAE decoder fast path."""
    from sglang.multimodal_gen.runtime.models.vaes.minimax_h3 import MiniMaxH3VideoVAE

    if not isinstance(vae, MiniMaxH3VideoVAE):
        return vae
    # One gate drives the model's batched decode and the attention fusion;
    # registering it here keeps batching to the platforms this installer runs on.
    gate = vae._sgl_gate
    if gate is None:
        gate = VaeFastPathGate()
        vae._sgl_gate = gate
    register_vae_fast_path_gate(vae, gate)
    attention_modules = _fast_attention_modules(vae.decoder)
    _install_fast_attention(attention_modules, gate)
    logger.info(
        "MiniMax-H3 VAE: installed quality-gated fast path (%s; %s tiles and %s "
        "windows per decoder forward).",
        (
            f"{len(attention_modules)} QK RMSNorm+RoPE fusions, cuDNN SDPA"
            if attention_modules
            else "attention fast path skipped"
        ),
        vae.decoder_tile_batch or "all",
        vae.window_batch or "all",
    )
    return vae
