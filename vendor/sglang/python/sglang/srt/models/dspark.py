from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Tuple

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from sglang.kernels.ops.memory.ptr_table import make_ptr_table
from sglang.srt.distributed.communication_op import tensor_model_parallel_all_gather
from sglang.srt.distributed.device_communicators.triton_symm_mem_ag import (
    MultimemAllGatherer,
    recommended_max_tokens,
)
from sglang.srt.distributed.device_communicators.vocab_gather import make_vocab_gather
from sglang.srt.environ import envs
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.dflash import DFlashDraftModel
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative.dflash_utils import can_dflash_slice_qkv_weight
from sglang.srt.speculative.dspark_components.dspark_config import (
    get_dspark_sample_from_anchor,
    parse_dspark_draft_config,
)
from sglang.srt.speculative.ragged_verify import (
    RaggedVerifyMode,
    read_ragged_verify_mode,
)
from sglang.srt.utils import is_gfx95_supported
from sglang.srt.utils.invariants import Bucket, InClosedRange, Invariant, expect

if TYPE_CHECKING:
    from sglang.srt.distributed.device_communicators.vocab_gather import VocabGather

logger = logging.getLogger(__name__)

# fp8 target lm_head GEMM for the DSPARK verify logits, opt-in via
# SGLANG_ROCM_OPT_DSPARK_FP8_LM_HEAD. The bf16 head matmul
# [num_verify_tokens, hidden] x [hidden, vocab_slice] is a per-decode-step cost
# that grows with the verify batch; running it in fp8 (per-token activation
# scale + per-output-channel weight scale) roughly halves that GEMM. The weight
# is fp8-quantized once and cached on the module. Evaluated once at import to
# keep the per-token decode path free of env lookups.
#
# Platform guard: the fp8 _scaled_mm path is validated on gfx95x (MI355X). On
# gfx942 (MI300X) it produces an accuracy regression, so gate the flag on the
# arch -- a user who sets the env on gfx942 keeps the safe bf16 head matmul
# (the flag stays inert) rather than silently hitting the accuracy issue.
_DSPARK_FP8_LM_HEAD = (
    envs.SGLANG_ROCM_OPT_DSPARK_FP8_LM_HEAD.get() and is_gfx95_supported()
)
if envs.SGLANG_ROCM_OPT_DSPARK_FP8_LM_HEAD.get() and not _DSPARK_FP8_LM_HEAD:
    logger.warning(
        "SGLANG_ROCM_OPT_DSPARK_FP8_LM_HEAD is set but the fp8 lm_head path is only "
        "supported on gfx95x; keeping the bf16 head matmul on this device."
    )
_FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0


def _fp8_quant_per_row(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row (dim=-1) symmetric fp8 quant. Returns (fp8 tensor, float32 scale [rows,1])."""
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32).clamp_(min=1e-6)
    scale = amax / _FP8_MAX
    x_fp8 = (x.to(torch.float32) / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(_FP8_DTYPE)
    return x_fp8, scale


def _fp8_lm_head_matmul(hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    """logits = hidden @ weight.T computed in fp8 via torch._scaled_mm."""
    weight = lm_head.weight  # [N(vocab_slice), K(hidden)]
    w_fp8 = getattr(lm_head, "_fp8_weight_cache", None)
    w_scale = getattr(lm_head, "_fp8_wscale_cache", None)
    if w_fp8 is None or w_fp8.shape != weight.shape:
        w_fp8, w_scale = _fp8_quant_per_row(weight)  # [N,K], [N,1]
        lm_head._fp8_weight_cache = w_fp8
        lm_head._fp8_wscale_cache = w_scale
    h_fp8, h_scale = _fp8_quant_per_row(hidden)  # [M,K], [M,1]
    # a=[M,K] fp8, b=[K,N] fp8 (col-major via .t()); scale_a per-row [M,1],
    # scale_b per-col [1,N]. Output cast back to hidden dtype.
    return torch._scaled_mm(
        h_fp8,
        w_fp8.t(),
        scale_a=h_scale,
        scale_b=w_scale.t(),
        out_dtype=hidden.dtype,
    )


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class FusedKvWriteBundle(msgspec.Struct, frozen=True):
    """Per-pool state of the fused draft K norm + RoPE + KV write."""

    project: Callable[[torch.Tensor], torch.Tensor]
    meta: torch.Tensor
    k_norm_weights: torch.Tensor
    cos_sin: torch.Tensor
    eps: float
    num_layers: int
    kv_size: int
    head_dim: int
    rotary_dim: int
    is_neox_style: bool


# DSpark confidence is a per-token score that must stay in [0, 1].
_CONFIDENCE = Invariant(
    "dspark.model.confidence", Bucket.GUARD, InClosedRange(0.0, 1.0)
)


def gather_and_crop_vocab(
    local_logits: torch.Tensor, lm_head: nn.Module
) -> torch.Tensor:
    full_logits = tensor_model_parallel_all_gather(local_logits, dim=-1)
    return full_logits[..., : int(lm_head.org_vocab_size)]


def project_through_lm_head(hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    """Project draft hidden states through the target head; a quantized head
    stores `weight` packed, so it needs its own kernel instead of a matmul."""
    quant_method = lm_head.quant_method
    if should_apply_lm_head_quant_method(lm_head, quant_method):
        return quant_method.apply(lm_head, hidden, None)
    weight = lm_head.weight
    if (
        _DSPARK_FP8_LM_HEAD
        and weight.is_floating_point()
        and hidden.shape[0] > 0
        and weight.shape[-1] % 16 == 0
    ):
        return _fp8_lm_head_matmul(hidden, lm_head)
    return torch.matmul(hidden.to(weight.dtype), weight.T)


class VocabShard(msgspec.Struct, frozen=True):
    """Where a rank's vocab slice starts, and the gather over its group."""

    start: int
    gather: VocabGather


class BaseDSparkMarkovHead(nn.Module, ABC):
    """Corrects a draft block step by step: each step's base logits get a bias
    computed from the token drafted at the step before."""

    vocab_size: int
    # The rank's slice of a TP-sharded vocab; None when the vocab is whole.
    vocab_shard: Optional[VocabShard] = None

    def init_state(
        self, hidden_states: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        del hidden_states
        return None

    @abstractmethod
    def step_bias(
        self,
        prev_tokens: torch.Tensor,
        *,
        hidden_states: Optional[torch.Tensor],
        state: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Return this step's bias and the state the next step reads."""

    @abstractmethod
    def step_logits_dtype(self, base_dtype: torch.dtype) -> torch.dtype:
        """The dtype of ``base_logits + bias``."""

    def greedy_w2_weight(self) -> Optional[torch.Tensor]:
        """The w2 weight when the bias is exactly the GEMV of the previous
        token's embedding, for the fused greedy kernel; otherwise None."""
        return None


class VanillaMarkov(BaseDSparkMarkovHead):
    # This rank's lm_head vocab rows of markov_w2; None biases the whole vocab.
    _w2_rows: Optional[slice] = None

    def __init__(self, *, vocab_size: int, markov_rank: int) -> None:
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.markov_rank = int(markov_rank)
        if self.markov_rank <= 0:
            raise ValueError(
                f"VanillaMarkov requires markov_rank > 0, got {self.markov_rank}."
            )
        self.markov_w1 = nn.Embedding(self.vocab_size, self.markov_rank)
        self.markov_w2 = nn.Linear(self.markov_rank, self.vocab_size, bias=False)

    def configure_tp_shard(self, *, lm_head: nn.Module, prefer_nvlink: bool) -> None:
        """Bias only this rank's lm_head vocab slice; each step then exchanges
        per-block candidates instead of the base logits being gathered whole."""
        if int(lm_head.org_vocab_size) != self.vocab_size:
            raise ValueError(
                "DSpark markov_w2 TP-shard requires lm_head.org_vocab_size == "
                f"markov vocab_size, got {int(lm_head.org_vocab_size)} vs "
                f"{self.vocab_size}."
            )
        tp_size = int(lm_head.tp_size)
        per_partition = int(lm_head.num_embeddings_per_partition)
        # Follow lm_head's group: attn_tp_group under a DP lm_head.
        parallel = get_parallel()
        group = (
            parallel.attn_tp_group
            if getattr(lm_head, "use_attn_tp_group", False)
            else parallel.tp_group
        )
        if group.world_size != tp_size:
            raise ValueError(
                "DSpark markov_w2 TP-shard needs the step gather group to equal "
                f"the lm_head shard group, got {group.world_size} vs {tp_size}. "
                "Disable SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD."
            )
        start = int(lm_head.shard_indices.org_vocab_start_index)
        end = int(lm_head.shard_indices.org_vocab_end_index)
        self._w2_rows = slice(start, end)
        gather = make_vocab_gather(
            group,
            local_width=per_partition,
            dtype=self.step_logits_dtype(lm_head.weight.dtype),
            prefer_nvlink=prefer_nvlink,
        )
        if group.rank_in_group == 0:
            logger.info(f"DSpark markov_w2 vocab gather: {type(gather).__name__}")
        self.vocab_shard = VocabShard(start=start, gather=gather)

    def get_prev_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids.long())

    def project_bias(self, latent_states: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(latent_states)

    def step_logits_dtype(self, base_dtype: torch.dtype) -> torch.dtype:
        # The bias comes out in the embedding's dtype.
        return torch.promote_types(base_dtype, self.markov_w1.weight.dtype)

    def step_bias(
        self,
        prev_tokens: torch.Tensor,
        *,
        hidden_states: Optional[torch.Tensor],
        state: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        del hidden_states
        latent = self.get_prev_embeddings(prev_tokens)
        if self._w2_rows is None:
            return self.project_bias(latent), state
        return F.linear(latent, self.markov_w2.weight[self._w2_rows]), state

    def greedy_w2_weight(self) -> Optional[torch.Tensor]:
        # The fused kernel picks a token from its own columns, no cross-rank exchange.
        if self._w2_rows is not None or not self._bias_is_w2_gemv():
            return None
        return self.markov_w2.weight

    def _bias_is_w2_gemv(self) -> bool:
        # The fused kernel recomputes this class's bias; a subclass that changes
        # it keeps the shared op.
        cls = type(self)
        return (
            cls.step_bias is VanillaMarkov.step_bias
            and cls.project_bias is VanillaMarkov.project_bias
        )


class Nemotron35VanillaMarkov(VanillaMarkov):
    """Checkpoint-quantized Markov head used only by Nemotron 3.5 DSpark."""

    def __init__(
        self,
        *,
        vocab_size: int,
        markov_rank: int,
        quant_config,
        prefix: str,
    ) -> None:
        nn.Module.__init__(self)
        self.vocab_size = int(vocab_size)
        self.markov_rank = int(markov_rank)
        if self.markov_rank <= 0:
            raise ValueError(
                "Nemotron35VanillaMarkov requires markov_rank > 0, "
                f"got {self.markov_rank}."
            )
        self.markov_w1 = nn.Embedding(self.vocab_size, self.markov_rank)
        self.markov_w2 = ReplicatedLinear(
            self.markov_rank,
            self.vocab_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.markov_w2" if prefix else "markov_w2",
        )

    def project_bias(self, latent_states: torch.Tensor) -> torch.Tensor:
        bias, _ = self.markov_w2(latent_states)
        return bias


class GatedMarkovHead(VanillaMarkov):
    def __init__(self, *, vocab_size: int, markov_rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size=vocab_size, markov_rank=markov_rank)
        self.gate_proj = nn.Linear(int(hidden_size) + markov_rank, markov_rank)

    def compute_gate(
        self,
        token_ids: torch.Tensor,
        hidden_states: Optional[torch.Tensor],
    ) -> torch.Tensor:
        if hidden_states is None:
            raise ValueError("GatedMarkovHead requires hidden_states.")
        prev_embeddings = self.get_prev_embeddings(token_ids)
        gate_inputs = torch.cat([hidden_states, prev_embeddings], dim=-1)
        return torch.sigmoid(self.gate_proj(gate_inputs))

    def step_bias(
        self,
        prev_tokens: torch.Tensor,
        *,
        hidden_states: Optional[torch.Tensor],
        state: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        prev_embeddings = self.get_prev_embeddings(prev_tokens)
        gate = self.compute_gate(prev_tokens, hidden_states).to(
            dtype=prev_embeddings.dtype
        )
        return self.project_bias(gate * prev_embeddings), state


class RNNHead(VanillaMarkov):
    def __init__(self, *, vocab_size: int, markov_rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size=vocab_size, markov_rank=markov_rank)
        self.hidden_size = int(hidden_size)
        self.state_size = markov_rank
        self.joint_proj = nn.Linear(2 * markov_rank + self.hidden_size, 3 * markov_rank)

    def _rnn_step(
        self,
        state: torch.Tensor,
        prev_embeddings: torch.Tensor,
        hidden_states: torch.Tensor,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        z = torch.cat([state, prev_embeddings, hidden_states], dim=-1)
        gate_raw, candidate_raw, output_raw = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        candidate = torch.tanh(candidate_raw)
        new_state = gate * state + (1.0 - gate) * candidate
        bias = self.project_bias(torch.tanh(output_raw))
        return new_state, bias

    def init_state(
        self, hidden_states: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        if hidden_states is None:
            raise ValueError("RNNHead requires hidden_states.")
        return torch.zeros(
            hidden_states.shape[0],
            self.markov_rank,
            device=hidden_states.device,
            dtype=hidden_states.dtype,
        )

    def step_bias(
        self,
        prev_tokens: torch.Tensor,
        *,
        hidden_states: Optional[torch.Tensor],
        state: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        prev_emb = self.get_prev_embeddings(prev_tokens)
        state, bias = self._rnn_step(state, prev_emb, hidden_states)
        return bias, state


def build_markov_head(config) -> Optional[nn.Module]:
    markov_rank = int(getattr(config, "markov_rank", 0))
    if markov_rank <= 0:
        raise ValueError(
            "DSpark requires markov_rank > 0 (the Markov head is the core of the "
            f"semi-AR draft); got markov_rank={markov_rank}."
        )
    markov_head_type = str(getattr(config, "markov_head_type", "vanilla")).lower()
    vocab_size = int(config.vocab_size)
    hidden_size = int(config.hidden_size)
    if markov_head_type == "vanilla":
        return VanillaMarkov(vocab_size=vocab_size, markov_rank=markov_rank)
    if markov_head_type == "gated":
        return GatedMarkovHead(
            vocab_size=vocab_size, markov_rank=markov_rank, hidden_size=hidden_size
        )
    if markov_head_type == "rnn":
        return RNNHead(
            vocab_size=vocab_size, markov_rank=markov_rank, hidden_size=hidden_size
        )
    raise ValueError(f"Unsupported DSpark markov_head_type={markov_head_type!r}.")


def build_nemotron_35_markov_head(config, quant_config, prefix: str) -> nn.Module:
    markov_head_type = str(getattr(config, "markov_head_type", "vanilla")).lower()
    if markov_head_type != "vanilla":
        raise ValueError(
            "Nemotron 3.5 DSpark requires markov_head_type='vanilla', "
            f"got {markov_head_type!r}."
        )
    markov_prefix = f"{prefix}.markov_head" if prefix else "markov_head"
    return Nemotron35VanillaMarkov(
        vocab_size=int(config.vocab_size),
        markov_rank=int(config.markov_rank),
        quant_config=quant_config,
        prefix=markov_prefix,
    )


class DSparkConfidenceHead(nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        markov_rank: int,
        with_markov: bool = True,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.with_markov = bool(with_markov)
        input_dim = int(hidden_size) + (int(markov_rank) if self.with_markov else 0)
        self.proj = nn.Linear(input_dim, 1, bias=bias, dtype=dtype)
        self.register_buffer(
            "sts_temperatures", torch.ones((), dtype=torch.float32), persistent=False
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        markov_embed_stack: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if self.with_markov:
            if markov_embed_stack is None:
                raise ValueError(
                    "DSparkConfidenceHead(with_markov=True) requires markov_embed_stack."
                )
            features = torch.cat(
                [hidden_states, markov_embed_stack.to(dtype=hidden_states.dtype)],
                dim=-1,
            )
        else:
            features = hidden_states
        features = features.to(dtype=self.proj.weight.dtype)
        return self.proj(features).squeeze(-1)

    def apply_sts(self, confidence_raw: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(confidence_raw.float() / self.sts_temperatures)

    def predict(
        self,
        features: torch.Tensor,
        *,
        anchor_tokens: torch.Tensor,
        draft_tokens: torch.Tensor,
        markov_head: BaseDSparkMarkovHead,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The [bs, gamma] confidence of a drafted block and its raw logit."""
        bs, gamma = draft_tokens.shape
        if self.with_markov:
            prev_tokens = torch.cat(
                [anchor_tokens.view(-1, 1), draft_tokens[:, : gamma - 1]], dim=1
            )
            markov_embed_stack = markov_head.get_prev_embeddings(prev_tokens)
        else:
            markov_embed_stack = None
        confidence_raw = self(features.view(bs, gamma, -1), markov_embed_stack)
        confidence = self.apply_sts(confidence_raw)
        expect(_CONFIDENCE, confidence)
        return confidence, confidence_raw


def build_confidence_head(config) -> Optional[nn.Module]:
    if read_ragged_verify_mode() is RaggedVerifyMode.STATIC:
        return None
    if not hasattr(config, "enable_confidence_head"):
        logger.warning(
            "DSpark draft config has no enable_confidence_head field; treating the "
            "confidence head as enabled."
        )
    hidden_size = int(config.hidden_size)
    markov_rank = int(getattr(config, "markov_rank", 0))
    with_markov = bool(getattr(config, "confidence_head_with_markov", markov_rank > 0))
    if with_markov and markov_rank <= 0:
        raise ValueError(
            "DSpark confidence_head_with_markov requires markov_rank > 0, "
            f"got markov_rank={markov_rank}."
        )
    return DSparkConfidenceHead(
        hidden_size=hidden_size,
        markov_rank=markov_rank,
        with_markov=with_markov,
    )


_DSPARK_SKIPPED_WEIGHT_PREFIXES = ("lm_head.", "rotary_emb.")


class DSparkDraftMixin:
    supports_pre_gather_target_hidden_projection = True
    # Drafts whose base logits leave the vocab-parallel lm_head via a TP-sharded
    # VanillaMarkov step (per-shard candidates) or the multimem all-gather.
    supports_vocab_parallel_draft_logits = False

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config=config, quant_config=quant_config, prefix=prefix)
        self._fused_kv_write_cache = None
        self._base_logits_gatherer: Optional[MultimemAllGatherer] = None
        self.logits_mup_width_multiplier = None
        dspark_config = parse_dspark_draft_config(draft_hf_config=config)
        if not dspark_config.require_markov():
            raise ValueError(
                "DSpark draft requires markov_rank > 0, "
                f"got markov_rank={dspark_config.markov_rank}."
            )
        self.gamma = int(dspark_config.resolve_gamma(default=self.block_size))
        self.sample_from_anchor = get_dspark_sample_from_anchor(config)
        if self.is_nemotron_35_draft:
            self.markov_head = build_nemotron_35_markov_head(
                config, quant_config, prefix
            )
        else:
            self.markov_head = build_markov_head(config)
        self.confidence_head = build_confidence_head(config)
        self.lm_head: Optional[nn.Module] = None
        # Expose the draft's own layer count so the draft ModelRunner sizes the
        # draft KV pool correctly. Some DSpark draft checkpoints inherit the
        # target's ``num_nextn_predict_layers`` (>0) on the config; without this
        # attribute the runner's MTP heuristic (model_runner.py) would size the
        # pool to ``num_nextn_predict_layers`` instead of the real draft depth and
        # the per-layer ``set_kv_buffer`` in ``write_target_hidden_kv`` would go
        # out of range. DSv4 (MoE) drafts expose this via ``num_stages``; mirror
        # that convention for dense DSpark drafts.
        self.num_stages = int(config.num_hidden_layers)

    def attach_shared_modules(
        self, *, embed_tokens: nn.Module, lm_head: nn.Module
    ) -> None:
        if not self.is_nemotron_35_draft:
            self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        if (
            not self.supports_vocab_parallel_draft_logits
            or int(getattr(lm_head, "tp_size", 1)) <= 1
        ):
            return
        if (
            type(self.markov_head) is VanillaMarkov
            and envs.SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD.get()
        ):
            self.markov_head.configure_tp_shard(
                lm_head=lm_head,
                prefer_nvlink=envs.SGLANG_DSPARK_NVLINK_VOCAB_GATHER.get(),
            )
        elif not getattr(lm_head, "use_attn_tp_group", False):
            # Base logits rows are bs * gamma, within the spec-decode batch.
            self._base_logits_gatherer = MultimemAllGatherer(
                max_tokens=recommended_max_tokens(include_prefill=False)
            )

    def forward_embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Embeds with the shared target embedding INSIDE the draft graph
        # (the runner skips the eager input_embeds staging when the draft
        # model exposes forward_embed).
        return self.embed_tokens(input_ids)

    def compute_base_logits(
        self, hidden: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Project the draft's raw final hidden through the target lm_head;
        also returns the features the confidence head reads.

        muP targets (Inkling) train the draft against a FOLDED head (weights
        pre-divided by logits_mup_width_multiplier) while serving attaches the
        target's unfolded head, so the division happens here — exactly once,
        keeping base logits in the scale the markov bias and confidence head
        were trained against. DSparkWorkerV2 wires the multiplier from the
        target config; it stays None for non-muP targets.
        """
        if self.lm_head is None:
            raise ValueError(
                "DSpark dense draft requires the target lm_head "
                "(call attach_shared_modules first)."
            )
        confidence_features = hidden
        if self.logits_mup_width_multiplier:
            hidden = hidden / self.logits_mup_width_multiplier
        local_logits = project_through_lm_head(hidden, self.lm_head)
        if self.markov_head.vocab_shard is not None:
            return local_logits, confidence_features
        if self._base_logits_gatherer is not None:
            full_logits = self._base_logits_gatherer(local_logits)
            return full_logits[..., : int(self.lm_head.org_vocab_size)], (
                confidence_features
            )
        base_logits = gather_and_crop_vocab(local_logits, self.lm_head)
        return base_logits, confidence_features

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

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        markov_weights = []
        confidence_weights = []
        backbone_weights = []
        params_dict = dict(self.named_parameters())
        for name, loaded_weight in weights:
            normalized_name = name.removeprefix("model.")
            if any(
                normalized_name.startswith(p) for p in _DSPARK_SKIPPED_WEIGHT_PREFIXES
            ):
                continue
            if normalized_name.startswith("embed_tokens.") and not (
                self.is_nemotron_35_draft
            ):
                continue
            if name.startswith("confidence_head."):
                if self.confidence_head is None:
                    continue
                confidence_weights.append((name, loaded_weight))
            elif name.startswith("markov_head."):
                markov_weights.append((name, loaded_weight))
            else:
                backbone_weights.append((name, loaded_weight))

        super().load_weights(backbone_weights)

        for name, loaded_weight in markov_weights:
            if name not in params_dict:
                raise ValueError(
                    f"DSpark unexpected markov weight {name!r} not found in model "
                    f"parameters (known markov params require a {type(self.markov_head).__name__} head)."
                )
            param = params_dict[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, loaded_weight)

        self._load_confidence_weights(
            confidence_weights=confidence_weights, params_dict=params_dict
        )

    def _load_confidence_weights(
        self,
        *,
        confidence_weights: list,
        params_dict: dict,
    ) -> None:
        if self.confidence_head is None:
            return
        loaded_names = set()
        for name, loaded_weight in confidence_weights:
            if name not in params_dict:
                raise ValueError(
                    f"DSpark unexpected confidence weight {name!r} not found in "
                    "model parameters."
                )
            param = params_dict[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, loaded_weight)
            loaded_names.add(name)

        confidence_param_names = {
            name for name in params_dict if name.startswith("confidence_head.")
        }
        missing = confidence_param_names - loaded_names
        if missing:
            raise ValueError(
                f"DSpark confidence head is enabled but the checkpoint is missing "
                f"{sorted(missing)}. Provide a checkpoint with trained confidence weights, "
                f"or disable the confidence head (enable_confidence_head=False)."
            )

    def _fused_kv_write_bundle(self, pool):
        cached = self._fused_kv_write_cache
        if cached is not None and cached[0] == id(pool):
            return cached[1]
        bundle = self._build_fused_kv_write_bundle(pool)
        self._fused_kv_write_cache = (id(pool), bundle)
        return bundle

    def _build_fused_kv_write_bundle(self, pool) -> Optional[FusedKvWriteBundle]:
        layers = list(self.layers)
        if not layers:
            return None
        weights = []
        for layer in layers:
            attn = layer.self_attn
            ok, _ = can_dflash_slice_qkv_weight(attn.qkv_proj)
            if not ok or attn.qkv_proj.bias is not None:
                return None
            w = attn.qkv_proj.weight[attn.q_size : attn.q_size + 2 * attn.kv_size]
            if w.dtype != torch.bfloat16:
                return None
            weights.append(w)
        w_all = torch.cat(weights, dim=0).contiguous()
        return self._fused_kv_write_layout(pool, project=lambda x: F.linear(x, w_all))

    def _fused_k_norm_weights(self) -> list[torch.Tensor]:
        """Per-layer multipliers the K norm applies to the normalized row."""
        return [layer.self_attn.k_norm.weight.data for layer in self.layers]

    def _fused_kv_write_layout(self, pool, *, project) -> Optional[FusedKvWriteBundle]:
        """Validate the bf16 pool layout and plain RoPE the fused kernel needs.

        ``project`` maps the context hidden to every layer's [K | V] columns,
        layer-major.
        """
        layers = list(self.layers)
        if not layers or not (
            hasattr(pool, "get_key_buffer") and hasattr(pool, "get_value_buffer")
        ):
            return None
        k_norm_weights = self._fused_k_norm_weights()
        attn0 = layers[0].self_attn
        head_dim = attn0.head_dim
        kv_size = attn0.kv_size
        rotary = attn0.rotary_emb
        if type(rotary).__name__ != "RotaryEmbedding" or rotary.position_start != 0:
            return None
        rotary_dim = getattr(rotary, "rotary_dim", None)
        pass_dim = head_dim - (rotary_dim if isinstance(rotary_dim, int) else 0)
        if not (
            isinstance(rotary_dim, int)
            and 2 <= rotary_dim <= head_dim
            and _is_pow2(head_dim)
            and _is_pow2(rotary_dim)
            and (pass_dim == 0 or _is_pow2(pass_dim))
        ):
            return None
        eps = attn0.k_norm.variance_epsilon
        meta_rows = []
        for layer in layers:
            attn = layer.self_attn
            if attn.head_dim != head_dim or attn.kv_size != kv_size:
                return None
            if attn.rotary_emb is not rotary and not torch.equal(
                attn.rotary_emb.cos_sin_cache, rotary.cos_sin_cache
            ):
                return None
            if attn.rotary_emb.is_neox_style != rotary.is_neox_style:
                return None
            if attn.k_norm.variance_epsilon != eps:
                return None
            k_buf = pool.get_key_buffer(attn.attn.layer_id)
            v_buf = pool.get_value_buffer(attn.attn.layer_id)
            nh = kv_size // head_dim
            # A bf16 pool stores K/V unscaled (set_kv_buffer applies k/v scales
            # only when quantizing), so layer scales do not gate the fused write.
            for buf in (k_buf, v_buf):
                if buf.dtype != torch.bfloat16:
                    return None
                if buf.shape[1:] != (nh, head_dim):
                    return None
                if buf.stride(1) != head_dim or buf.stride(2) != 1:
                    return None
            meta_rows.append(
                [k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(0), v_buf.stride(0)]
            )
        device = k_norm_weights[0].device
        # k_buf/v_buf data_ptr() can set the top bit on XPU (USM addresses),
        # which dtype=torch.int64 rejects while unpacking; pack unsigned and view.
        return FusedKvWriteBundle(
            project=project,
            meta=make_ptr_table(meta_rows, device=device),
            k_norm_weights=torch.stack(k_norm_weights).to(device),
            cos_sin=rotary.cos_sin_cache.to(device),
            eps=eps,
            num_layers=len(layers),
            kv_size=kv_size,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            is_neox_style=rotary.is_neox_style,
        )

    def _stacked_ctx_kv_params(self) -> Optional[dict]:
        """Stack every layer's KV projection into one weight (exact: the input
        hidden is shared, so concatenating output columns is equivalent).
        Cached; None (per-layer fallback) when a QKV weight cannot be sliced
        (quantized) or layers disagree on norm epsilon / bias presence.
        """
        if not envs.SGLANG_DSPARK_STACKED_CTX_KV.get():
            return None
        cached = getattr(self, "_stacked_ctx_kv_cache", False)
        if cached is not False:
            return cached
        weights, biases, k_norm_weights = [], [], []
        eps = None
        for layer in self.layers:
            attn = layer.self_attn
            can_slice, _ = can_dflash_slice_qkv_weight(attn.qkv_proj)
            if not can_slice or eps not in (None, attn.k_norm.variance_epsilon):
                self._stacked_ctx_kv_cache = None
                return None
            eps = attn.k_norm.variance_epsilon
            kv_slice = slice(attn.q_size, attn.q_size + 2 * attn.kv_size)
            weights.append(attn.qkv_proj.weight[kv_slice])
            biases.append(
                attn.qkv_proj.bias[kv_slice] if attn.qkv_proj.bias is not None else None
            )
            k_norm_weights.append(attn.k_norm.weight)
        has_bias = [b is not None for b in biases]
        if any(has_bias) and not all(has_bias):
            self._stacked_ctx_kv_cache = None
            return None
        self._stacked_ctx_kv_cache = {
            "weight": torch.cat(weights, dim=0),
            "bias": torch.cat(biases, dim=0) if all(has_bias) else None,
            "k_norm_weight": torch.stack(k_norm_weights, dim=0).float(),
            "eps": eps,
        }
        return self._stacked_ctx_kv_cache

    def write_target_hidden_kv(
        self,
        *,
        target_hidden: torch.Tensor,
        pool,
        positions: torch.Tensor,
        cache_loc: torch.Tensor,
        cache_loc_2d: Optional[torch.Tensor] = None,
        commit_lens: Optional[torch.Tensor] = None,
        target_hidden_is_projected: bool = False,
    ) -> None:
        ctx_hidden = (
            target_hidden
            if target_hidden_is_projected
            else self.project_target_hidden(target_hidden)
        )

        bundle = self._fused_kv_write_bundle(pool)
        if bundle is not None:
            from sglang.kernels.ops.speculative.dspark.fused_kv_write import (
                fused_kv_norm_rope_write,
            )

            if cache_loc_2d is not None and commit_lens is not None:
                locs = cache_loc_2d.reshape(-1)
                write_commit_lens = commit_lens
                locs_row_width = cache_loc_2d.shape[1]
            else:
                locs = cache_loc
                write_commit_lens = None
                locs_row_width = None
            fused_kv_norm_rope_write(
                bundle.project(ctx_hidden),
                bundle.meta,
                bundle.k_norm_weights,
                bundle.cos_sin,
                positions,
                locs,
                bundle.num_layers,
                bundle.kv_size,
                bundle.head_dim,
                bundle.eps,
                commit_lens=write_commit_lens,
                locs_row_width=locs_row_width,
                is_neox_style=bundle.is_neox_style,
                rotary_dim=bundle.rotary_dim,
            )
            return

        stacked = self._stacked_ctx_kv_params()
        if stacked is not None:
            k_all, v_all = self._project_ctx_kv_stacked(
                ctx_hidden=ctx_hidden, positions=positions, stacked=stacked
            )
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if stacked is not None:
                k = k_all[i]
                v = v_all[i]
            else:
                k, v = attn.kv_proj_only(ctx_hidden)
                k = attn.apply_k_norm(k)
                k = attn.apply_k_rope(positions, k)
                k = k.view(-1, attn.num_kv_heads, attn.head_dim)
                v = v.view(-1, attn.num_kv_heads, attn.head_dim)
            if cache_loc_2d is not None and commit_lens is not None:
                pool.set_kv_buffer_prefix_valid(
                    attn.attn,
                    cache_loc_2d,
                    commit_lens,
                    k,
                    v,
                    attn.attn.k_scale,
                    attn.attn.v_scale,
                )
            else:
                # `cache_loc` comes from `TargetHiddenKvInjector.ids_for`,
                # already in the ids the draft pool indexes.
                pool.set_kv_buffer(
                    attn.attn,
                    KVWriteLoc(cache_loc, physical=True),
                    k,
                    v,
                    attn.attn.k_scale,
                    attn.attn.v_scale,
                )

    def _project_ctx_kv_stacked(
        self,
        *,
        ctx_hidden: torch.Tensor,
        positions: torch.Tensor,
        stacked: dict,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        attn0 = self.layers[0].self_attn
        num_layers = len(self.layers)
        kv_size = attn0.kv_size
        head_dim = attn0.head_dim
        num_kv_heads = attn0.num_kv_heads
        tokens = ctx_hidden.shape[0]

        kv_all = F.linear(ctx_hidden, stacked["weight"], stacked["bias"])
        kv_all = kv_all.view(tokens, num_layers, 2, kv_size)
        k32 = (
            kv_all[:, :, 0, :]
            .reshape(tokens, num_layers, num_kv_heads, head_dim)
            .to(torch.float32)
        )
        variance = k32.pow(2).mean(dim=-1, keepdim=True)
        k32 = k32 * torch.rsqrt(variance + stacked["eps"])
        k32 = k32 * stacked["k_norm_weight"].view(1, num_layers, 1, head_dim)
        k_all = k32.to(ctx_hidden.dtype)
        k_flat = k_all.reshape(tokens, num_layers * kv_size)
        dummy_q = k_flat.new_empty(k_flat.shape)
        _, k_flat = attn0.rotary_emb(positions, dummy_q, k_flat)
        k_all = (
            k_flat.view(tokens, num_layers, num_kv_heads, head_dim)
            .permute(1, 0, 2, 3)
            .contiguous()
        )
        v_all = (
            kv_all[:, :, 1, :]
            .view(tokens, num_layers, num_kv_heads, head_dim)
            .permute(1, 0, 2, 3)
            .contiguous()
        )
        return k_all, v_all


class DSparkDraftModel(DSparkDraftMixin, DFlashDraftModel):
    def prune_to_ctx_kv_injection(self) -> None:
        self.markov_head = None
        self.confidence_head = None
        for layer in self.layers:
            layer.mlp = None
            layer.self_attn.o_proj = None
        torch.cuda.empty_cache()


class Qwen3DSparkModel(DSparkDraftModel):
    pass


class LingDSparkModel(DSparkDraftModel):
    """Qwen3-shaped DSpark draft for Ling / Bailing-MoE target families.

    The DeepSpec Ling draft (``deepspec.modeling.dspark.ling``) is byte-for-byte a
    Qwen3DSparkModel — a short stack of Qwen3 draft layers sharing the target
    embedding / lm_head. The architecture tag ``LingDSparkModel`` on the draft
    checkpoint only distinguishes the target family for resume / error messages
    (see ``deepspec/modeling/dspark/ling/modeling.py``); the checkpoint weights
    line up exactly with ``Qwen3DSparkModel``, so we reuse the same backbone.
    """

    pass


EntryClass = [Qwen3DSparkModel, LingDSparkModel, DSparkDraftModel]
