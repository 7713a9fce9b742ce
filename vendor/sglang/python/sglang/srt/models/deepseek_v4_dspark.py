from __future__ import annotations

import copy
import logging
from contextlib import nullcontext
from typing import Iterable, List, Optional, Tuple

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from sglang.kernels.ops.attention.dsv4 import fused_q_norm_rope, fused_rope_inplace
from sglang.kernels.ops.speculative.dspark.dspark_draft_model import CommitKvProj
from sglang.srt.configs.deepseek_v4 import DeepSeekV4Config
from sglang.srt.configs.draft_parallel import DraftParallelSpec, DraftTPExecution
from sglang.srt.distributed.device_communicators.vocab_gather import make_vocab_gather
from sglang.srt.environ import envs
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.layers.attention.dsv4.unified_kv_gate import (
    is_unified_kv_triton,
)
from sglang.srt.layers.dp_attention import is_dp_attention_enabled
from sglang.srt.layers.layer_boundary import layer_stack
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.moe.utils import get_num_fused_shared_experts
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_token_to_kv_pool
from sglang.srt.model_executor.runner import get_is_capture_mode
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models import deepseek_v4_boundary as hc_boundary
from sglang.srt.models import deepseek_v4_mhc as mhc
from sglang.srt.models.dbrx import ReplicatedLinear
from sglang.srt.models.deepseek_v4 import (
    DEEPSEEK_V4_STACKED_PARAMS_MAPPING,
    DeepseekV4CudaDecoderLayer,
    DeepseekV4ForCausalLM,
    DeepseekV4PlatformDecoderLayer,
    MqaAttentionBase,
    _apply_wo_a_bf16_matmul,
    _dequant_fp8_wo_a_streaming,
    _is_cuda,
    hc_head_torch,
    make_hc_head_params,
)
from sglang.srt.models.deepseek_v4_platform_stage import NonCudaDSparkMixin
from sglang.srt.models.dspark import (
    BaseDSparkMarkovHead,
    DSparkConfidenceHead,
    VocabShard,
    gather_and_crop_vocab,
    project_through_lm_head,
)
from sglang.srt.runtime_context import (
    get_parallel,
    get_platform,
)
from sglang.srt.speculative.dspark_components.dspark_config import (
    get_dspark_sample_from_anchor,
    parse_dspark_draft_config,
)
from sglang.srt.speculative.ragged_verify import (
    RaggedVerifyMode,
    read_ragged_verify_mode,
)
from sglang.srt.utils import add_prefix, is_npu

logger = logging.getLogger(__name__)

_PAD_NUM_HEADS = 64

_is_npu = is_npu()


def apply_rotary_emb(
    x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    y = x
    x = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    if inverse:
        freqs_cis = freqs_cis.conj()
    if x.ndim == 3:
        freqs_cis = freqs_cis.view(x.size(0), 1, x.size(-1))
    else:
        freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
    x = torch.view_as_real(x * freqs_cis).flatten(-2)
    y.copy_(x)
    return y


class DSparkAttention(MqaAttentionBase):
    def __init__(
        self,
        config: DeepSeekV4Config,
        layer_id: int,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
        alt_streams: Optional[List[torch.cuda.Stream]] = None,
    ) -> None:
        super().__init__(
            config,
            layer_id,
            quant_config,
            prefix,
            compress_ratio=0,
            fuse_wqa_wkv=False,
            wo_a_fp8=False,
            wo_a_keeps_quant_config=False,
            wo_b_reduce_results=True,
            rope_original_seq_len=0,
        )
        assert self.compress_ratio == 0, (
            "DSpark draft attention requires compress_ratio == 0."
        )
        self.window_size = int(
            getattr(config, "sliding_window", None) or config.window_size
        )

        self.attn = RadixAttention(
            self.n_local_heads,
            self.head_dim,
            self.softmax_scale,
            num_kv_heads=1,
            layer_id=layer_id,
            quant_config=quant_config,
            prefix=add_prefix("attn", prefix),
        )

        self._use_fast_kernel = envs.SGLANG_DSPARK_FAST_KERNEL.get()
        self.alt_streams = alt_streams
        self._multi_stream_bs_limit = 128 if get_platform().is_blackwell else 64
        if _is_npu:
            self.register_buffer(
                "_q_post_norm_weight",
                torch.ones(self.head_dim),
                persistent=False,
            )

    def kv_proj_only(self, x: torch.Tensor) -> torch.Tensor:
        kv, _ = self.wkv(x)
        return kv

    def _store_block_kv(
        self,
        *,
        kv: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        attn_backend,
        pool: DeepSeekV4TokenToKVPool,
    ) -> None:
        if is_unified_kv_triton():
            # unified_kv: SWA K lives in the shared bf16 ring (swa_kv_pool is
            # None). Use the unified ring write target -- get_unified_swa_loc
            # recomputes it from live positions for multi-step draft decode.
            pool.set_unified_key_buffer_radix_fused_norm_rope(
                layer_id=self.layer_id,
                swa_loc=attn_backend.get_unified_swa_loc(forward_batch),
                kv=kv,
                kv_weight=self.kv_norm.weight.data,
                eps=self.eps,
                freqs_cis=self.freqs_cis,
                positions=positions,
            )
            return
        pool.set_swa_key_buffer_radix_fused_norm_rope(
            layer_id=self.layer_id,
            swa_loc=attn_backend.get_swa_out_cache_loc(forward_batch),
            kv=kv,
            kv_weight=self.kv_norm.weight.data,
            eps=self.eps,
            freqs_cis=self.freqs_cis,
            positions=positions,
        )

    def _compute_q(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        q_out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        q, _ = self.wq_a(x)
        q = self.q_norm(q)
        q, _ = self.wq_b(q)
        q = q.view(-1, self.n_local_heads, self.head_dim)
        if not self.q_head_norm:
            if q_out is not None and q_out.dtype == torch.float8_e4m3fn:
                fused_q_norm_rope(q, q_out, None, self.freqs_cis, positions)
                return q_out
            if self._use_fast_kernel and not _is_npu:
                fused_rope_inplace(
                    q[..., -self.rope_head_dim :],
                    None,
                    self.freqs_cis,
                    positions=positions,
                )
            else:
                apply_rotary_emb(
                    q[..., -self.rope_head_dim :], self.freqs_cis[positions]
                )
            if q_out is None:
                return q
            q_out.copy_(q)
            return q_out
        if self._use_fast_kernel:
            if q_out is None:
                q_out = torch.empty_like(q)
            fused_q_norm_rope(q, q_out, self.eps, self.freqs_cis, positions)
            return q_out
        else:
            if _is_npu:
                import torch_npu

                from sglang.srt.hardware_backend.npu.dsv4.dsv4_rope import (
                    Dsv4NpuRoPE,
                )

                q = torch_npu.npu_rms_norm(q, self._q_post_norm_weight, self.eps)[0]
                cos4, sin4 = Dsv4NpuRoPE.for_freqs(self.freqs_cis).get_cos_sin(
                    positions,
                    q.dtype,
                    view_4d=True,
                    inverse=False,
                    allow_build=True,
                    cache_dtype=torch.float32,
                )
                Dsv4NpuRoPE.apply_rotary_mul_inplace(
                    q,
                    None,
                    cos4,
                    sin4,
                    qk_nope_dim=q.shape[-1] - self.rope_head_dim,
                )
            else:
                q = q * torch.rsqrt(
                    q.float().square().mean(-1, keepdim=True) + self.eps
                ).to(q.dtype)
                apply_rotary_emb(
                    q[..., -self.rope_head_dim :], self.freqs_cis[positions]
                )
            if q_out is not None:
                q_out.copy_(q)
                return q_out
            return q

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        *,
        defer_all_reduce: bool = False,
    ) -> torch.Tensor:
        # Idle ranks have no draft KV rows or attention metadata, but still
        # participate in the shared MoE forward later in the draft stage.
        if forward_batch.forward_mode.is_idle():
            return torch.zeros_like(hidden_states)

        from sglang.srt.model_executor.forward_context import get_attn_backend

        pool = _resolve_dspark_pool()
        attn_backend = get_attn_backend()
        rd = self.rope_head_dim

        enable_multi_stream = (
            self.alt_streams is not None
            and get_is_capture_mode()
            and hidden_states.shape[0] <= self._multi_stream_bs_limit
        )

        q_padded: Optional[torch.Tensor] = None
        q_out: Optional[torch.Tensor] = None
        if (
            pool.uniform_fp8
            and not self.q_head_norm
            and self.n_local_heads in (8, 16, 32, 64, 128)
        ):
            q_out = torch.empty(
                (hidden_states.shape[0], self.n_local_heads, self.head_dim),
                dtype=torch.float8_e4m3fn,
                device=hidden_states.device,
            )
        elif self.n_local_heads < _PAD_NUM_HEADS:
            q_padded = hidden_states.new_empty(
                hidden_states.shape[0], _PAD_NUM_HEADS, self.head_dim
            )
            q_out = q_padded[:, : self.n_local_heads, :]

        if enable_multi_stream:
            current_stream = torch.cuda.current_stream()
            stream_kv = self.alt_streams[0]
            stream_kv.wait_stream(current_stream)
            with torch.cuda.stream(stream_kv):
                kv = self.kv_proj_only(hidden_states)
                self._store_block_kv(
                    kv=kv,
                    positions=positions,
                    forward_batch=forward_batch,
                    attn_backend=attn_backend,
                    pool=pool,
                )
            q = self._compute_q(hidden_states, positions, q_out=q_out)
            current_stream.wait_stream(stream_kv)
        else:
            kv = self.kv_proj_only(hidden_states)
            self._store_block_kv(
                kv=kv,
                positions=positions,
                forward_batch=forward_batch,
                attn_backend=attn_backend,
                pool=pool,
            )
            q = self._compute_q(hidden_states, positions, q_out=q_out)

        if q_padded is not None:
            q = q_padded
        attn_sink = self._local_attn_sink()

        o = attn_backend.forward(
            q=q,
            k=kv,
            v=kv,
            layer=self.attn,
            forward_batch=forward_batch,
            compress_ratio=0,
            attn_sink=attn_sink,
            save_kv_cache=False,
        )

        if o.shape[1] != self.n_local_heads:
            o = o[:, : self.n_local_heads, :]

        if self._use_fast_kernel:
            fused_rope_inplace(
                o[..., -rd:], None, self.freqs_cis, positions=positions, inverse=True
            )
        elif _is_npu:
            from sglang.srt.hardware_backend.npu.dsv4.dsv4_rope import Dsv4NpuRoPE

            cos4, sin4 = Dsv4NpuRoPE.for_freqs(self.freqs_cis).get_cos_sin(
                positions,
                o.dtype,
                view_4d=True,
                inverse=True,
                allow_build=True,
                cache_dtype=torch.float32,
            )
            Dsv4NpuRoPE.apply_rotary_mul_inplace(
                o,
                None,
                cos4,
                sin4,
                qk_nope_dim=o.shape[-1] - rd,
            )
        else:
            apply_rotary_emb(o[..., -rd:], self.freqs_cis[positions], inverse=True)

        o = o.view(
            o.shape[0],
            self.n_local_groups,
            o.shape[1] * o.shape[2] // self.n_local_groups,
        )
        wo_a = self.wo_a.weight.view(self.n_local_groups, self.o_lora_rank, -1)
        if self._use_fast_kernel:
            o = _apply_wo_a_bf16_matmul(
                o,
                wo_a,
                is_decode=forward_batch.forward_mode.is_decode(),
                is_target_verify=forward_batch.forward_mode.is_target_verify(),
                fast_path=self.is_dsv41,
            )
        else:
            o = torch.einsum("bgd,grd->bgr", o.float(), wo_a.float()).to(q.dtype)
        value = o.reshape(o.shape[0], o.shape[1] * o.shape[2])
        out, _ = self.wo_b(value, skip_all_reduce=defer_all_reduce)
        return (
            mhc.AttnOutput(out)
            if _is_cuda and defer_all_reduce and self.attn_tp_size > 1
            else out
        )

    @staticmethod
    def accepts_mxfp8_swizzled_input():
        return False


def _resolve_dspark_pool() -> DeepSeekV4TokenToKVPool:
    pool = get_token_to_kv_pool()
    assert isinstance(pool, DeepSeekV4TokenToKVPool), (
        "DSpark draft attention requires a DeepSeekV4TokenToKVPool, "
        f"got {type(pool).__name__}."
    )
    return pool


class MarkovW2ShardGeometry(msgspec.Struct, frozen=True):
    tp_size: int
    org_vocab_start: int
    org_vocab_end: int
    num_embeddings_per_partition: int
    num_embeddings_padded: int


class DSparkV4MarkovHead(BaseDSparkMarkovHead):
    def __init__(
        self, *, vocab_size: int, markov_rank: int, is_dsv41: bool = False
    ) -> None:
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.markov_rank = int(markov_rank)
        self._is_dsv41 = bool(is_dsv41)
        if self.markov_rank <= 0:
            raise ValueError(
                f"DSparkV4MarkovHead requires markov_rank > 0, got {self.markov_rank}."
            )
        self.markov_w1 = VocabParallelEmbedding(
            self.vocab_size, self.markov_rank, enable_tp=False
        )
        self._opt_markov_w2_bf16 = envs.SGLANG_DSPARK_OPT_MARKOV_W2_BF16.get()
        self._opt_markov_w2_tp_shard = envs.SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD.get()
        markov_w2_dtype = torch.bfloat16 if self._opt_markov_w2_bf16 else torch.float32
        self.markov_w2 = nn.Linear(
            self.markov_rank, self.vocab_size, bias=False, dtype=markov_w2_dtype
        )
        self._tp_shard: Optional[MarkovW2ShardGeometry] = None
        self._shard_group = None

    def configure_tp_shard(self, *, lm_head: nn.Module) -> None:
        if not self._opt_markov_w2_tp_shard:
            return
        if int(lm_head.org_vocab_size) != self.vocab_size:
            raise ValueError(
                "DSpark markov_w2 TP-shard requires lm_head.org_vocab_size == "
                f"markov vocab_size, got {int(lm_head.org_vocab_size)} vs "
                f"{self.vocab_size}."
            )
        tp_size = int(lm_head.tp_size)
        per_partition = int(lm_head.num_embeddings_per_partition)
        num_padded = int(lm_head.num_embeddings_padded)
        if per_partition * tp_size != num_padded:
            raise ValueError(
                "DSpark markov_w2 TP-shard could not align to the lm_head partition: "
                f"num_embeddings_per_partition({per_partition}) * tp_size({tp_size}) != "
                f"num_embeddings_padded({num_padded})."
            )
        # Follow lm_head's group choice; attn_tp_group degenerates to size 1
        # under prefill CP while lm_head still shards over the full TP group.
        parallel = get_parallel()
        shard_group = (
            parallel.attn_tp_group
            if getattr(lm_head, "use_attn_tp_group", False)
            else parallel.tp_group
        )
        shard_group_size = shard_group.world_size
        if shard_group_size != tp_size:
            raise ValueError(
                "DSpark markov_w2 TP-shard needs the per-step all-gather group to "
                f"equal the lm_head shard group, got shard_group_size="
                f"{shard_group_size} vs lm_head tp_size={tp_size}. "
                "Disable SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD."
            )
        self._shard_group = shard_group
        self._tp_shard = MarkovW2ShardGeometry(
            tp_size=tp_size,
            org_vocab_start=int(lm_head.shard_indices.org_vocab_start_index),
            org_vocab_end=int(lm_head.shard_indices.org_vocab_end_index),
            num_embeddings_per_partition=per_partition,
            num_embeddings_padded=num_padded,
        )
        # A rank holding the whole unpadded vocab has nothing to gather, so the
        # draft step adds the bias, keeps the logits and selects in one pass.
        if per_partition == self.vocab_size:
            return
        vocab_gather = make_vocab_gather(
            shard_group,
            local_width=per_partition,
            prefer_nvlink=self._is_dsv41
            and envs.SGLANG_DSPARK_NVLINK_VOCAB_GATHER.get(),
        )
        if shard_group.rank == 0:
            cls_name = type(vocab_gather).__name__
            logger.info("DSpark markov_w2 vocab gather: %s", cls_name)
        self.vocab_shard = VocabShard(
            start=self._tp_shard.org_vocab_start, gather=vocab_gather
        )

    def get_prev_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids.long())

    def project_bias(
        self, latent_states: torch.Tensor, *, weight: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        weight = self.markov_w2.weight if weight is None else weight
        if self._opt_markov_w2_bf16:
            return F.linear(latent_states.to(weight.dtype), weight).float()
        return F.linear(latent_states.float(), weight)

    def step_bias(
        self,
        prev_tokens: torch.Tensor,
        *,
        hidden_states: Optional[torch.Tensor],
        state: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        del hidden_states
        latent = self.get_prev_embeddings(prev_tokens)
        shard = self._tp_shard
        if shard is None:
            return self.project_bias(latent), state
        weight_local = self.markov_w2.weight[
            shard.org_vocab_start : shard.org_vocab_end
        ]
        if self._opt_markov_w2_bf16:
            # Keep the bias in BF16; the step add upcasts it to FP32.
            return F.linear(latent.to(weight_local.dtype), weight_local), state
        return F.linear(latent.float(), weight_local), state

    def step_logits_dtype(self, base_dtype: torch.dtype) -> torch.dtype:
        # The bias is FP32 or upcast into an FP32 add, sharded or not.
        del base_dtype
        return torch.float32

    def forward(self, token_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        embed = self.get_prev_embeddings(token_ids)
        logits = self.project_bias(embed)
        return logits, embed


def build_dspark_v4_confidence_head(
    *, config: DeepSeekV4Config, markov_rank: int
) -> Optional[DSparkConfidenceHead]:
    if read_ragged_verify_mode() is RaggedVerifyMode.STATIC:
        return None
    if not hasattr(config, "enable_confidence_head"):
        logger.warning(
            "DSpark draft config has no enable_confidence_head field; treating the "
            "confidence head as enabled."
        )
    with_markov_cfg = getattr(config, "confidence_head_with_markov", None)
    with_markov = (
        (markov_rank > 0) if with_markov_cfg is None else bool(with_markov_cfg)
    )
    if with_markov and markov_rank <= 0:
        raise ValueError(
            "DSpark V4 confidence_head_with_markov requires markov_rank > 0, "
            f"got markov_rank={markov_rank}."
        )
    return DSparkConfidenceHead(
        hidden_size=int(config.hidden_size),
        markov_rank=int(markov_rank),
        with_markov=with_markov,
        bias=False,
    )


def _dspark_stage_config(config: DeepSeekV4Config) -> DeepSeekV4Config:
    n_routed = int(getattr(config, "dspark_n_routed_experts", 0) or 0)
    n_active = int(getattr(config, "dspark_num_experts_per_tok", 0) or 0)
    has_vision = int(getattr(config, "vision_n_layers", 0) or 0) > 0
    if not (n_routed or n_active or has_vision):
        return config
    stage_config = copy.copy(config)
    if n_routed:
        stage_config.n_routed_experts = n_routed
    if n_active:
        stage_config.num_experts_per_tok = n_active
    if has_vision:
        stage_config.vision_n_layers = 0
    return stage_config


class DSparkV4StageMixin:
    def __init__(
        self,
        config: DeepSeekV4Config,
        layer_id: int,
        stage_id: int,
        num_stages: int,
        num_target_layers: int,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
        alt_streams: Optional[List[torch.cuda.Stream]] = None,
        hc_stats_stream: Optional[torch.cuda.Stream] = None,
        moe_routed_quant_stream: Optional[torch.cuda.Stream] = None,
    ) -> None:
        super().__init__(
            config=_dspark_stage_config(config),
            layer_id=layer_id,
            quant_config=quant_config,
            prefix=prefix,
            is_nextn=True,
            boundary_pre_from_prev=config.hc_pre_from_prev_sublayer,
            boundary_mhc_fusions=False,
            alt_streams=alt_streams,
            hc_stats_stream=hc_stats_stream,
            moe_routed_quant_stream=moe_routed_quant_stream,
        )
        self.stage_id = stage_id
        self.dim = config.hidden_size

        if stage_id == 0:
            if num_target_layers <= 0:
                raise ValueError(
                    "DSpark needs target layers for the target-hidden projection."
                )
            self.main_proj = ReplicatedLinear(
                config.hidden_size * num_target_layers,
                config.hidden_size,
                bias=False,
                quant_config=quant_config,
                prefix=add_prefix("main_proj", prefix),
            )
            self.main_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

        if stage_id == num_stages - 1:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            if self.hc_pre_from_prev_sublayer:
                # V4.1 collapses the head with the last FFN's pre-mix; the
                # checkpoint carries no hc_head_* tensors for the stages.
                self.hc_head_fn = self.hc_head_base = self.hc_head_scale = None
            else:
                (
                    self.hc_head_fn,
                    self.hc_head_base,
                    self.hc_head_scale,
                ) = make_hc_head_params(config.hc_mult, config.hidden_size)

    def _build_self_attn(
        self,
        *,
        config: DeepSeekV4Config,
        layer_id: int,
        quant_config: Optional[QuantizationConfig],
        prefix: str,
        alt_streams: Optional[List[torch.cuda.Stream]],
        compress_ratio_override: Optional[int],
    ) -> nn.Module:
        del compress_ratio_override
        return DSparkAttention(
            config=config,
            layer_id=layer_id,
            quant_config=quant_config,
            prefix=prefix,
            alt_streams=alt_streams,
        )


class DSparkV4CudaStage(DSparkV4StageMixin, DeepseekV4CudaDecoderLayer):
    def _run_boundary_attention(
        self, hidden_states, positions, forward_batch, quantized
    ):
        return self.self_attn(
            positions, hidden_states, forward_batch, defer_all_reduce=True
        )

    def forward(self, positions, hidden_states, forward_batch):
        return super().forward(
            positions,
            hidden_states,
            None,
            forward_batch,
            None,
            allow_cross_layer_fusion=False,
        )


class DSparkV4PlatformStage(
    NonCudaDSparkMixin, DSparkV4StageMixin, DeepseekV4PlatformDecoderLayer
):
    """Non-CUDA draft with platform mHC operations."""


DSparkV4Stage = DSparkV4CudaStage if _is_cuda else DSparkV4PlatformStage


class DeepseekV4ForCausalLMDSpark(nn.Module):
    draft_parallel_spec = DraftParallelSpec(tp_execution=DraftTPExecution.TARGET_LAYOUT)

    # ModelSlim NPU checkpoints carry QuaRot-aligned, MTP-local
    # embedding/head weights. The native CUDA path keeps the original DSpark
    # behavior and shares the target model's vocabulary modules.
    uses_own_vocab_modules = _is_npu
    precompile_kernels_after_loading = (
        DeepseekV4ForCausalLM.precompile_kernels_after_loading
    )

    @classmethod
    def shared_experts_fusion_disable_reason(
        cls,
        hf_config,
        quant_config,
    ):
        if _is_npu:
            return (
                "NPU DSpark ModelSlim weight loading does not support mapping "
                "shared experts into fused expert slots."
            )

        return DeepseekV4ForCausalLM.shared_experts_fusion_disable_reason(
            hf_config, quant_config
        )

    @classmethod
    def num_fusable_shared_experts(cls, hf_config) -> int:
        return DeepseekV4ForCausalLM.num_fusable_shared_experts(hf_config)

    def __init__(
        self,
        config: DeepSeekV4Config,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.num_fused_shared_experts = get_num_fused_shared_experts()

        dspark_config = parse_dspark_draft_config(draft_hf_config=config)
        if not dspark_config.require_markov():
            raise ValueError(
                "DSpark V4 draft requires markov_rank > 0, "
                f"got markov_rank={dspark_config.markov_rank}."
            )
        self.gamma = int(
            dspark_config.resolve_gamma(default=int(config.num_hidden_layers))
        )
        self.sample_from_anchor = get_dspark_sample_from_anchor(config)
        self.block_size = self.gamma
        if dspark_config.target_layer_ids is not None:
            self.num_stages = len(dspark_config.target_layer_ids)
        else:
            self.num_stages = int(getattr(config, "num_nextn_predict_layers", 1) or 1)

        target_num_layers = (
            int(dspark_config.num_target_layers)
            if dspark_config.num_target_layers is not None
            else int(getattr(config, "num_hidden_layers", 1))
        )
        if dspark_config.target_layer_ids is not None:
            self.num_target_features = len(dspark_config.target_layer_ids)
        else:
            self.num_target_features = target_num_layers

        self.start_layer = 0
        self.end_layer = self.num_stages
        use_multi_stream = (
            envs.SGLANG_OPT_USE_MULTI_STREAM_OVERLAP.get()
            and envs.SGLANG_DSPARK_ENABLE_MULTI_STREAM.get()
            and torch.cuda.is_available()
        )
        self.alt_streams: Optional[List[torch.cuda.Stream]] = (
            [torch.cuda.Stream()] if use_multi_stream else None
        )
        self.moe_routed_quant_stream = (
            torch.cuda.Stream()
            if use_multi_stream
            and torch.version.cuda is not None
            and getattr(config, "hc_pre_from_prev_sublayer", False)
            else None
        )
        self.hc_stats_stream = (
            torch.cuda.Stream()
            if use_multi_stream
            and torch.version.cuda is not None
            and get_platform().is_blackwell
            and getattr(config, "hc_pre_from_prev_sublayer", False)
            else None
        )
        with (
            layer_stack(final_read=hc_boundary.FinalRead())
            if _is_cuda
            else nullcontext()
        ):
            self.stages = nn.ModuleList(
                [
                    DSparkV4Stage(
                        config=config,
                        layer_id=stage_id,
                        stage_id=stage_id,
                        num_stages=self.num_stages,
                        num_target_layers=self.num_target_features,
                        quant_config=quant_config,
                        prefix=add_prefix(f"stages.{stage_id}", prefix),
                        alt_streams=self.alt_streams,
                        hc_stats_stream=self.hc_stats_stream,
                        moe_routed_quant_stream=self.moe_routed_quant_stream,
                    )
                    for stage_id in range(self.num_stages)
                ]
            )
        self.markov_head = DSparkV4MarkovHead(
            vocab_size=int(config.vocab_size),
            markov_rank=int(dspark_config.markov_rank),
            is_dsv41=getattr(config, "model_type", None) == "deepseek_v41",
        )
        self.confidence_head = build_dspark_v4_confidence_head(
            config=config, markov_rank=int(dspark_config.markov_rank)
        )
        self.hc_mult = int(config.hc_mult)
        self.norm_eps = float(config.rms_norm_eps)
        self.hc_eps = float(config.hc_eps)
        self.hc_pre_from_prev_sublayer = bool(
            getattr(config, "hc_pre_from_prev_sublayer", False)
        )

        if self.uses_own_vocab_modules:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                prefix=add_prefix("embed_tokens", prefix),
                enable_tp=not is_dp_attention_enabled(),
            )
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                prefix=add_prefix("lm_head", prefix),
                use_attn_tp_group=get_parallel().enable_dp_lm_head,
            )
        else:
            self.embed_tokens: Optional[nn.Module] = None
            self.lm_head: Optional[nn.Module] = None
        self._use_fp32_lm_head = envs.SGLANG_DSPARK_FP32_LM_HEAD.get()
        self._opt_markov_w2_tp_shard = envs.SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD.get()
        if self.lm_head is not None:
            self.markov_head.configure_tp_shard(lm_head=self.lm_head)

    @property
    def enable_confidence_head(self) -> bool:
        return self.confidence_head is not None

    def attach_shared_modules(
        self, *, embed_tokens: nn.Module, lm_head: nn.Module
    ) -> None:
        if not self.uses_own_vocab_modules:
            self.embed_tokens = embed_tokens
            self.lm_head = lm_head
        self.markov_head.configure_tp_shard(lm_head=self.lm_head)

    def project_target_hidden(self, main_hidden: torch.Tensor) -> torch.Tensor:
        stage0 = self.stages[0]
        projected, _ = stage0.main_proj(main_hidden)
        return stage0.main_norm(projected)

    def write_target_hidden_kv(
        self,
        *,
        main_hidden: torch.Tensor,
        swa_loc: torch.Tensor,
        positions: torch.Tensor,
        pool: DeepSeekV4TokenToKVPool,
    ) -> None:
        kvs = self.project_commit_kv(main_hidden=main_hidden, pool=pool)
        self.store_commit_kv(kvs=kvs, swa_loc=swa_loc, positions=positions, pool=pool)

    def project_commit_kv(
        self, *, main_hidden: torch.Tensor, pool: DeepSeekV4TokenToKVPool
    ) -> List[torch.Tensor]:
        """The context rows' per-stage KV, before norm / rope / store; reads no KV
        location, so it can run before the accept decides what is committed."""
        main_x = self.project_target_hidden(main_hidden)
        return CommitKvProj.execute(
            main_x=main_x,
            wkv_linears=[stage.self_attn.wkv for stage in self.stages],
            # The FlashMLA writer reads an explicit KV row stride, so views are fine.
            allow_strided_output=(
                get_platform().is_blackwell
                and not is_unified_kv_triton()
                and not pool.uniform_fp8
            ),
        )

    def store_commit_kv(
        self,
        *,
        kvs: List[torch.Tensor],
        swa_loc: torch.Tensor,
        positions: torch.Tensor,
        pool: DeepSeekV4TokenToKVPool,
    ) -> None:
        swa_loc = swa_loc.to(torch.int32)
        # Under unified_kv the swa_kv_pool is None; the caller passes a unified
        # ring loc (state_slot * ring + pos % ring, -1 for uncommitted) so the
        # store just needs to target the bf16 ring instead of the fp8 flashmla
        # buffer. Same swa_loc/positions contract either way.
        store_kv = (
            pool.set_unified_key_buffer_radix_fused_norm_rope
            if is_unified_kv_triton()
            else pool.set_swa_key_buffer_radix_fused_norm_rope
        )
        for stage, kv in zip(self.stages, kvs):
            attn = stage.self_attn
            store_kv(
                layer_id=attn.layer_id,
                swa_loc=swa_loc,
                kv=kv,
                kv_weight=attn.kv_norm.weight.data,
                eps=attn.eps,
                freqs_cis=attn.freqs_cis,
                positions=positions,
            )

    def forward_embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise ValueError(
                "DeepseekV4ForCausalLMDSpark requires the target embed_tokens "
                "(call attach_shared_modules first)."
            )
        x = self.embed_tokens(input_ids)
        x = x.unsqueeze(1).repeat(1, self.hc_mult, 1)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
        get_embedding: bool = False,
        pp_proxy_tensors=None,
    ) -> LogitsProcessorOutput:
        if not _is_cuda:
            return self._forward_impl(input_ids, positions, forward_batch, input_embeds)
        from sglang.srt.layers.moe.mega_gate import mega_gate_forward_scope

        try:
            with mega_gate_forward_scope(forward_batch):
                return self._forward_impl(
                    input_ids, positions, forward_batch, input_embeds
                )
        finally:
            residual_batch.clear(forward_batch)

    def _forward_impl(self, input_ids, positions, forward_batch, input_embeds):
        if input_embeds is None:
            input_embeds = self.forward_embed(input_ids)
        x = input_embeds
        pre = None
        if _is_cuda:
            residual_batch.start(forward_batch)
        # Draft stages do not have recorder layer indices.
        with get_global_expert_distribution_recorder().disable_this_region():
            for stage in self.stages:
                if _is_cuda:
                    x = stage(positions, x, forward_batch)
                else:
                    x, pre = stage(positions, x, forward_batch, pre)
        if _is_cuda:
            x = residual_batch.read_output(
                x, forward_batch, hc_boundary.FinalRead(), None
            )
            if self.hc_pre_from_prev_sublayer:
                pre, x = x.pre, x.residual
        if self.hc_pre_from_prev_sublayer:
            from sglang.kernels.ops.layernorm.mhc import mhc_combine

            # The kernel widens each element to fp32 as it loads it.
            x = mhc_combine(x.flatten(1), pre, self.hc_mult, x.dtype)
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=x)

    def collapse_hc_head(self, x: torch.Tensor) -> torch.Tensor:
        if self.hc_pre_from_prev_sublayer:
            assert x.dim() == 2, "V4.1 draft hidden states leave forward() collapsed"
            return x
        last = self.stages[-1]
        return hc_head_torch(
            x,
            last.hc_head_fn,
            last.hc_head_scale,
            last.hc_head_base,
            norm_eps=self.norm_eps,
            hc_eps=self.hc_eps,
        )

    def compute_base_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_post_hc = self.collapse_hc_head(x)
        return self._logits_from_x_post_hc(x_post_hc), x_post_hc

    def _logits_from_x_post_hc(self, x_post_hc: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise ValueError(
                "DeepseekV4ForCausalLMDSpark requires the target lm_head "
                "(call attach_shared_modules first)."
            )
        last = self.stages[-1]
        x = last.norm(x_post_hc)
        weight = self.lm_head.weight
        if self._use_fp32_lm_head and weight.is_floating_point():
            local_logits = F.linear(x.float(), weight.float())
        else:
            local_logits = project_through_lm_head(x, self.lm_head)
        if self._opt_markov_w2_tp_shard:
            return local_logits
        return gather_and_crop_vocab(local_logits, self.lm_head)

    def compute_confidence(
        self,
        *,
        anchor_tokens: torch.Tensor,
        draft_tokens: torch.Tensor,
        confidence_features: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.confidence_head.predict(
            confidence_features,
            anchor_tokens=anchor_tokens,
            draft_tokens=draft_tokens,
            markov_head=self.markov_head,
        )

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        params_dict = dict(self.named_parameters())
        loaded_params = set()

        weights = _dequant_fp8_wo_a_streaming(weights)
        n_routed_experts = _dspark_stage_config(self.config).n_routed_experts

        stacked_params_mapping = DEEPSEEK_V4_STACKED_PARAMS_MAPPING
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

        expert_params_mapping = FusedMoE.make_expert_params_mapping(
            ckpt_gate_proj_name="gate_proj",
            ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="up_proj",
            num_experts=(n_routed_experts + self.num_fused_shared_experts),
        )

        for name, loaded_weight in weights:
            mapped = (
                self._remap_dspark_weight_name_npu(name)
                if _is_npu
                else self._remap_dspark_weight_name(name)
            )
            if mapped is None:
                continue
            if self.num_fused_shared_experts > 0 and ".mlp.shared_experts." in mapped:
                mapped = mapped.replace(
                    ".mlp.shared_experts.",
                    f".mlp.experts.{n_routed_experts}.",
                )
            for param_name, weight_name, shard_id in stacked_params_mapping:
                if weight_name not in mapped:
                    continue
                candidate = mapped.replace(weight_name, param_name)
                if candidate not in params_dict:
                    continue
                param = params_dict[candidate]
                weight_loader = param.weight_loader
                weight_loader(param, loaded_weight, shard_id)
                loaded_params.add(candidate)
                break
            else:
                for (
                    param_name,
                    weight_name,
                    expert_id,
                    shard_id,
                ) in expert_params_mapping:
                    if weight_name not in mapped:
                        continue
                    candidate = mapped.replace(weight_name, param_name)
                    if candidate not in params_dict:
                        continue
                    param = params_dict[candidate]
                    weight_loader = param.weight_loader
                    weight_loader(
                        param,
                        loaded_weight,
                        candidate,
                        shard_id=shard_id,
                        expert_id=expert_id,
                    )
                    loaded_params.add(candidate)
                    break
                else:
                    if mapped not in params_dict:
                        logger.warning(
                            "DSpark V4 draft: unexpected weight %r -> %r", name, mapped
                        )
                        continue
                    param = params_dict[mapped]
                    weight_loader = getattr(
                        param, "weight_loader", default_weight_loader
                    )
                    weight_loader(param, loaded_weight)
                    loaded_params.add(mapped)

        self._assert_confidence_head_loaded(
            params_dict=params_dict, loaded_params=loaded_params
        )
        self.post_load_weights()

    def post_load_weights(self, is_nextn=False, weight_names=None):
        for stage in self.stages:
            stage.refresh_mhc_norm_weight_cache()

    def _assert_confidence_head_loaded(
        self, *, params_dict: dict, loaded_params: set
    ) -> None:
        if self.confidence_head is None:
            return
        confidence_param_names = {
            name for name in params_dict if name.startswith("confidence_head.")
        }
        missing = confidence_param_names - loaded_params
        if missing:
            raise ValueError(
                f"DSpark V4 confidence head is enabled but the checkpoint is missing "
                f"{sorted(missing)}. Provide a checkpoint with trained confidence weights, "
                f"or disable the confidence head (enable_confidence_head=False)."
            )

    def _remap_dspark_weight_name(self, name: str) -> Optional[str]:
        if name.startswith(("embed.", "embed_tokens.", "head.", "lm_head.")):
            return None
        if "rotary_emb.inv_freq" in name:
            return None

        if not name.startswith("mtp."):
            return None
        parts = name.split(".", 2)
        if len(parts) < 3:
            return None
        stage_id, rest = parts[1], parts[2]

        if rest.startswith("markov_head."):
            rest = rest.replace("markov_head.embed.", "markov_head.markov_w1.", 1)
            rest = rest.replace("markov_head.head.", "markov_head.markov_w2.", 1)
            return f"markov_head.{rest[len('markov_head.') :]}"

        if rest.startswith("confidence_head."):
            if self.confidence_head is None:
                return None
            return f"confidence_head.{rest[len('confidence_head.') :]}"

        mapped_rest = rest
        mapped_rest = mapped_rest.replace("attn.", "self_attn.", 1)
        mapped_rest = mapped_rest.replace("ffn.", "mlp.", 1)
        mapped_rest = mapped_rest.replace("attn_norm.", "input_layernorm.", 1)
        mapped_rest = mapped_rest.replace("ffn_norm.", "post_attention_layernorm.", 1)
        mapped_rest = mapped_rest.replace(".w1.", ".gate_proj.")
        mapped_rest = mapped_rest.replace(".w2.", ".down_proj.")
        mapped_rest = mapped_rest.replace(".w3.", ".up_proj.")
        mapped_rest = mapped_rest.replace(".gate.tid2eid", ".topk.tid2eid")
        if mapped_rest.endswith(".gate.bias_vl"):
            return None
        mapped_rest = mapped_rest.replace(".gate.bias", ".gate.e_score_correction_bias")
        mapped_rest = mapped_rest.replace(".scale", ".weight_scale_inv")
        return f"stages.{stage_id}.{mapped_rest}"

    def _remap_dspark_weight_name_npu(self, name: str) -> Optional[str]:
        if name.startswith(("embed.", "embed_tokens.", "head.", "lm_head.")):
            return None
        if "rotary_emb.inv_freq" in name:
            return None

        if not name.startswith("mtp."):
            return None
        parts = name.split(".", 2)
        if len(parts) < 3:
            return None
        stage_id, rest = parts[1], parts[2]
        if not stage_id.isdigit():
            return None
        stage_idx = int(stage_id)
        if rest in ("embed.weight", "embed_tokens.weight"):
            return (
                "embed_tokens.weight"
                if self.uses_own_vocab_modules and stage_idx == 0
                else None
            )
        if rest in ("head.weight", "lm_head.weight"):
            return (
                "lm_head.weight"
                if self.uses_own_vocab_modules and stage_idx == self.num_stages - 1
                else None
            )
        if rest.startswith(("embed.", "embed_tokens.", "head.", "lm_head.")):
            return None

        if rest.startswith("markov_head."):
            return f"markov_head.{rest[len('markov_head.') :]}"

        if rest.startswith("confidence_head."):
            if self.confidence_head is None:
                return None
            return f"confidence_head.{rest[len('confidence_head.') :]}"

        mapped_rest = rest
        if mapped_rest.startswith("attn."):
            mapped_rest = "self_attn." + mapped_rest.removeprefix("attn.")
        elif mapped_rest.startswith("ffn."):
            mapped_rest = "mlp." + mapped_rest.removeprefix("ffn.")
        elif mapped_rest.startswith("attn_norm."):
            mapped_rest = "input_layernorm." + mapped_rest.removeprefix("attn_norm.")
        elif mapped_rest.startswith("ffn_norm."):
            mapped_rest = "post_attention_layernorm." + mapped_rest.removeprefix(
                "ffn_norm."
            )
        mapped_rest = mapped_rest.replace(".w1.", ".gate_proj.")
        mapped_rest = mapped_rest.replace(".w2.", ".down_proj.")
        mapped_rest = mapped_rest.replace(".w3.", ".up_proj.")
        mapped_rest = mapped_rest.replace(".gate.tid2eid", ".topk.tid2eid")
        mapped_rest = mapped_rest.replace(".gate.bias", ".gate.e_score_correction_bias")
        if mapped_rest.endswith(".scale"):
            mapped_rest = mapped_rest.removesuffix(".scale") + ".weight_scale_inv"
        return f"stages.{stage_id}.{mapped_rest}"


EntryClass = [DeepseekV4ForCausalLMDSpark]
