import logging
from typing import Optional

import torch

from sglang.kernels.ops.attention.cutedsl_kda import (
    cutedsl_fused_sigmoid_gating_kda_update,
)
from sglang.srt.layers.attention.linear.kernels.kernel_backend import (
    LinearAttnKernelBase,
)

logger = logging.getLogger(__name__)


def _is_sm10x() -> bool:
    """True iff on SM10x, the only arch with the tcgen05/TMEM the chunk prefill uses.

    SM120 (desktop Blackwell) lacks tcgen05 despite its larger capability number.
    """
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability()
    return major == 10


class CuteDSLKDAKernel(LinearAttnKernelBase):
    """CuTe DSL kernel for KDA.

    Decode: ``cutedsl_fused_sigmoid_gating_kda_update`` (SM90+).
    Extend (prefill): SM100 chunk pipeline ``chunk_kda_cutedsl`` (SM10x only,
    ``head_k_dim`` must be 128). Elsewhere the prefill path is unsupported; callers
    query :attr:`supports_prefill` and fall back to Triton.
    """

    supports_safe_gate: bool = False

    def __init__(self):
        self.supports_prefill = _is_sm10x()
        self._extend_fn: Optional[callable] = None
        self._l2norm_fn: Optional[callable] = None

    def _ensure_extend_loaded(self, head_k_dim: int) -> None:
        if self._extend_fn is not None:
            return
        if not self.supports_prefill:
            major = (
                torch.cuda.get_device_capability()[0]
                if torch.cuda.is_available()
                else -1
            )
            raise RuntimeError(
                f"CuTe DSL KDA prefill requires SM10x (tcgen05); got SM{major}."
            )
        if head_k_dim != 128:
            raise RuntimeError(
                f"CuTe DSL KDA prefill requires head_k_dim=128, got {head_k_dim}."
            )
        from sglang.kernels.ops.attention.fla.l2norm import l2norm_fwd
        from sglang.kernels.ops.attention.linear.kda_blackwell import (
            chunk_kda_cutedsl,
        )

        self._extend_fn = chunk_kda_cutedsl
        self._l2norm_fn = l2norm_fwd
        logger.info("Using CuTe DSL KDA prefill (Blackwell)")

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        **kwargs,
    ) -> torch.Tensor:
        if kwargs.get("lower_bound") is not None:
            raise NotImplementedError(
                "KDA safe gate (lower_bound) is not implemented in the CuTe DSL "
                "decode kernel; use --linear-attn-decode-backend triton."
            )
        return cutedsl_fused_sigmoid_gating_kda_update(
            A_log=A_log,
            dt_bias=dt_bias,
            q=q,
            k=k,
            v=v,
            a=a,
            b=b,
            initial_state_source=ssm_states,
            initial_state_indices=cache_indices,
            cu_seqlens=query_start_loc,
            use_qk_l2norm_in_kernel=True,
            softplus_beta=1.0,
            softplus_threshold=20.0,
        )

    def extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        A_log: Optional[torch.Tensor] = None,
        dt_bias: Optional[torch.Tensor] = None,
        lower_bound: Optional[float] = None,
        **kwargs,
    ) -> torch.Tensor:
        if kwargs.get("return_intermediate_states"):
            # The mamba radix extra_buffer track path needs per-chunk states
            # (h), which chunk_kda_cutedsl does not expose. Refuse instead of
            # silently skipping the snapshot (that corrupts prefix-cache
            # restores). Use the Triton prefill backend with extra_buffer.
            raise NotImplementedError(
                "CuteDSLKDAKernel.extend cannot return intermediate chunk "
                "states required by mamba_radix_cache_strategy=extra_buffer; "
                "use --linear-attn-prefill-backend triton or "
                "--mamba-radix-cache-strategy no_buffer."
            )
        head_k_dim = k.shape[-1]
        self._ensure_extend_loaded(head_k_dim)

        # [1, T, HV, D] -> [T, HV, D]; L2-norm Q/K outside the kernel.
        q_n = self._l2norm_fn(q[0].contiguous()).to(torch.bfloat16)
        k_n = self._l2norm_fn(k[0].contiguous()).to(torch.bfloat16)
        v_in = v[0].contiguous().to(torch.bfloat16)
        # Trim g/beta to q's real token count: the [:real_num_tokens] slice in
        # unified_linear_attention_with_output narrows their batch dim (a no-op),
        # not tokens, so padded rows survive and break the kernel's shape check.
        num_tokens = q_n.shape[0]
        g_in = g[0][:num_tokens]  # raw forget gate; activated inside chunk_kda_cutedsl
        beta_in = beta[0][:num_tokens].to(torch.float32)
        if kwargs.get("beta_is_raw"):
            beta_in = beta_in.sigmoid()
        cu_seqlens = query_start_loc.to(torch.int32)

        # Pool state I/O is fused into the h kernel's TMA load/store: pass the
        # pool + per-seq slots and the kernel reads h0/writes ht in place at
        # those rows (no gather/scatter kernels, no [N, HV, V, K] intermediates).
        # Remap padding (-1) to the last (sentinel) slot. State is
        # [slots, HV, V, K] == cutedsl [V,K] layout, no transpose needed.
        ssm_cache_indices = torch.where(
            cache_indices >= 0, cache_indices, ssm_states.shape[0] - 1
        ).to(torch.int32)

        o, _ = self._extend_fn(
            q_n,
            k_n,
            v_in,
            g_in,
            beta_in,
            ssm_states,
            cu_seqlens,
            A_log=A_log,
            dt_bias=dt_bias,
            lower_bound=lower_bound,
            h0_indices=ssm_cache_indices,
        )

        # CuTeDSL does not emit intermediate chunk states; pairing with None
        # keeps the upstream extra-buffer radix track contract.
        return o.unsqueeze(0), None

    def target_verify(self, *args, **kwargs):
        raise NotImplementedError("CuteDSLKDAKernel does not support target_verify")
