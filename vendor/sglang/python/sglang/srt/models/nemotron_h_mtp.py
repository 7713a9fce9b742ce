# Copyright 2023-2025 SGLang Team
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
# ==============================================================================

from collections.abc import Iterable

import torch
from torch import nn

from sglang.srt.configs import NemotronHConfig
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.layers.dp_attention import is_dp_attention_enabled
from sglang.srt.layers.layer_boundary import layer_stack
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ColumnParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.quantization import QuantizationConfig
from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4A16LinearMethod
from sglang.srt.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.nemotron_h import (
    NemotronHAttentionDecoderLayer,
    NemotronHForCausalLM,
    NemotronHMoEDecoderLayer,
)
from sglang.srt.models.utils import WeightsMapper
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import add_prefix


class NemotronHMTPAttentionDecoderLayer(NemotronHAttentionDecoderLayer):
    def __init__(
        self,
        config: NemotronHConfig,
        layer_idx: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        has_start_projections: bool = False,
        has_end_norm: bool = False,
    ) -> None:
        super().__init__(
            config=config,
            layer_idx=layer_idx,
            quant_config=quant_config,
            prefix=prefix,
        )
        self.has_start_projections = has_start_projections
        self.has_end_norm = has_end_norm

        if has_start_projections:
            self.enorm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
            self.hnorm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

            _dp_attn = is_dp_attention_enabled()
            self.eh_proj = ColumnParallelLinear(
                input_size=config.hidden_size * 2,
                output_size=config.hidden_size,
                bias=False,
                gather_output=not _dp_attn,
                parallel_group="attn_tp" if _dp_attn else "tp",
                params_dtype=(
                    config.dtype if hasattr(config, "dtype") else torch.bfloat16
                ),
                quant_config=quant_config,
                prefix=f"{prefix}.eh_proj",
            )

        if has_end_norm:
            self.final_layernorm = RMSNorm(
                config.hidden_size,
                eps=getattr(config, "layer_norm_epsilon", 1e-5),
            )

    def forward(
        self,
        *,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if self.has_start_projections:
            inputs_embeds_normed = self.enorm(inputs_embeds)
            previous_hidden_states_normed = self.hnorm(hidden_states)

            fused = torch.cat(
                [inputs_embeds_normed, previous_hidden_states_normed], dim=-1
            )
            hidden_states, _ = self.eh_proj(fused)
            if is_dp_attention_enabled():
                hidden_states = get_parallel().attn_tp_group.all_gather(
                    hidden_states, dim=-1
                )

        if self.has_start_projections:
            hidden_states = residual_batch.set_written(hidden_states, forward_batch)

        hidden_states = super().forward(
            hidden_states=hidden_states,
            forward_batch=forward_batch,
        )

        if self.has_end_norm:
            hidden_states = residual_batch.fold(hidden_states, forward_batch)

            hidden_states = residual_batch.set_written(
                self.final_layernorm(hidden_states), forward_batch
            )

        return hidden_states


class NemotronHMTPMoEDecoderLayer(NemotronHMoEDecoderLayer):
    def __init__(
        self,
        config: NemotronHConfig,
        layer_idx: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        has_start_projections: bool = False,
        has_end_norm: bool = False,
    ) -> None:
        super().__init__(
            config=config,
            layer_idx=layer_idx,
            quant_config=quant_config,
            prefix=prefix,
            is_nextn=True,
        )
        self.has_start_projections = has_start_projections
        self.has_end_norm = has_end_norm

        if has_start_projections:
            self.enorm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
            self.hnorm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

            _dp_attn = is_dp_attention_enabled()
            self.eh_proj = ColumnParallelLinear(
                input_size=config.hidden_size * 2,
                output_size=config.hidden_size,
                bias=False,
                gather_output=not _dp_attn,
                parallel_group="attn_tp" if _dp_attn else "tp",
                params_dtype=(
                    config.dtype if hasattr(config, "dtype") else torch.bfloat16
                ),
                quant_config=quant_config,
                prefix=f"{prefix}.eh_proj",
            )

        if has_end_norm:
            self.final_layernorm = RMSNorm(
                config.hidden_size,
                eps=getattr(config, "layer_norm_epsilon", 1e-5),
            )

    def forward(
        self,
        *,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if self.has_start_projections:
            inputs_embeds_normed = self.enorm(inputs_embeds)
            previous_hidden_states_normed = self.hnorm(hidden_states)

            fused = torch.cat(
                [inputs_embeds_normed, previous_hidden_states_normed], dim=-1
            )
            hidden_states, _ = self.eh_proj(fused)
            if is_dp_attention_enabled():
                hidden_states = get_parallel().attn_tp_group.all_gather(
                    hidden_states, dim=-1
                )

        if self.has_start_projections:
            hidden_states = residual_batch.set_written(hidden_states, forward_batch)

        hidden_states = super().forward(
            hidden_states=hidden_states,
            forward_batch=forward_batch,
        )

        if self.has_end_norm:
            hidden_states = residual_batch.fold(hidden_states, forward_batch)

            hidden_states = residual_batch.set_written(
                self.final_layernorm(hidden_states), forward_batch
            )

        return hidden_states


class NemotronHMultiTokenPredictor(nn.Module):
    def __init__(
        self,
        config: NemotronHConfig,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()

        self.config = config
        self.vocab_size = config.vocab_size
        self.org_vocab_size = config.vocab_size

        self.mtp_start_layer_idx = config.num_hidden_layers
        self.num_mtp_layers = getattr(config, "num_nextn_predict_layers", 1)
        assert self.num_mtp_layers == 1, (
            "Only one MTP layer is supported for NemotronH-MTP"
        )

        self.pattern_str = config.mtp_hybrid_override_pattern
        self.pattern_len = len(self.pattern_str)
        assert self.pattern_len > 0

        self.embed_tokens = VocabParallelEmbedding(
            self.vocab_size,
            config.hidden_size,
            org_num_embeddings=config.vocab_size,
            use_attn_tp_group=is_dp_attention_enabled(),
        )

        # Build flat list of layers
        self.layers = nn.ModuleDict()

        # Total number of physical layers = num_steps * pattern_len
        total_layers = self.num_mtp_layers * self.pattern_len
        with layer_stack():
            for i in range(total_layers):
                step_rel_idx = i % self.pattern_len

                char = self.pattern_str[step_rel_idx]

                is_start_of_step = step_rel_idx == 0
                is_end_of_step = step_rel_idx == self.pattern_len - 1

                layer_prefix = f"{prefix}.layers.{i}"

                common_kwargs = dict(
                    config=config,
                    layer_idx=i,
                    quant_config=quant_config,
                    prefix=layer_prefix,
                    has_start_projections=is_start_of_step,
                    has_end_norm=is_end_of_step,
                )

                if char == "*":
                    self.layers[str(i)] = NemotronHMTPAttentionDecoderLayer(
                        **common_kwargs
                    )
                elif char == "E":
                    self.layers[str(i)] = NemotronHMTPMoEDecoderLayer(**common_kwargs)
                else:
                    raise NotImplementedError(
                        f"Pattern char '{char}' in {self.pattern_str} not implemented"
                    )

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, (
            "embed_tokens not initialized - must be shared from target model"
        )
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = forward_batch.mm_input_embeds
            if (
                forward_batch.forward_mode.is_extend()
                and forward_batch.contains_mm_inputs()
                and not forward_batch.forward_mode.is_draft_extend_v2()
            ):
                assert inputs_embeds is not None
                last_indices = (
                    forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
                ).long()
                inputs_embeds[last_indices] = self.get_input_embeddings(
                    input_ids[last_indices]
                )
            if inputs_embeds is None:
                inputs_embeds = self.get_input_embeddings(input_ids)

        hidden_states = forward_batch.spec_info.hidden_states
        residual_batch.start(forward_batch)

        with get_global_expert_distribution_recorder().disable_this_region():
            for i in range(self.pattern_len):
                hidden_states = self.layers[str(i)](
                    inputs_embeds=inputs_embeds,
                    hidden_states=hidden_states,
                    forward_batch=forward_batch,
                )
        return residual_batch.take_output(hidden_states, forward_batch)


class NemotronHForCausalLMMTP(NemotronHForCausalLM):
    hf_to_sglang_mapper = NemotronHForCausalLM.hf_to_sglang_mapper | WeightsMapper(
        orig_to_new_prefix={"language_model.mtp.": "mtp."}
    )

    def __init__(
        self,
        config: NemotronHConfig,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        nn.Module.__init__(self)
        config = config.get_mtp_config()
        self.config = config
        self.quant_config = quant_config
        self._owns_lm_head = False
        # Required for parent's load_weights
        self.pp_group = get_parallel().pp_group

        # Override config for MTP pattern (which has no Mamba layers)
        config.num_hidden_layers = len(config.mtp_hybrid_override_pattern)
        # Set hybrid_override_pattern to MTP pattern so attention backend
        # doesn't use Mamba2AttnBackend (MTP has no Mamba layers)
        config.hybrid_override_pattern = config.mtp_hybrid_override_pattern

        self.model = NemotronHMultiTokenPredictor(
            config=config,
            quant_config=quant_config,
            prefix=add_prefix("mtp", prefix),
        )

        self.lm_head = ParallelLMHead(
            self.config.vocab_size,
            self.config.hidden_size,
            quant_config=quant_config,
            prefix=add_prefix("lm_head", prefix),
            use_attn_tp_group=get_parallel().enable_dp_lm_head,
        )

        self.logits_processor = LogitsProcessor(config)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        hidden_states = self.model(
            input_ids,
            positions,
            forward_batch,
            input_embeds,
        )
        return self.logits_processor(
            input_ids, hidden_states, self.lm_head, forward_batch
        )

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], is_mtp: bool = False
    ):
        has_mtp_layers = False
        has_target_layers = False
        head_weights = set()

        def normalized_weights():
            nonlocal has_mtp_layers, has_target_layers
            for name, weight in weights:
                name = name.removeprefix("language_model.")
                has_mtp_layers |= name.startswith("mtp.layers.")
                has_target_layers |= name.startswith(
                    ("backbone.layers.", "model.layers.")
                )
                if name.startswith("lm_head."):
                    head_weights.add(name)
                yield name, weight

        # Inspect names while streaming: buffering a full target checkpoint here
        # would double its host-memory footprint during embedded MTP loading.
        super().load_weights(normalized_weights(), is_mtp=True)
        self._owns_lm_head = bool(
            has_mtp_layers and not has_target_layers and head_weights
        )
        if self._owns_lm_head:
            expected = {
                name
                for name, _ in self.named_parameters()
                if name.startswith("lm_head.")
            }
            if "lm_head.input_scale" in expected and isinstance(
                self.lm_head.quant_method, ModelOptNvFp4A16LinearMethod
            ):
                # NVFP4A16 accepts this loader placeholder but never uses it.
                expected.remove("lm_head.input_scale")
            missing = (expected | {"lm_head.weight"}) - head_weights
            if missing:
                raise ValueError(
                    f"Incomplete standalone MTP lm_head: missing {sorted(missing)}"
                )

    def set_embed_and_head(self, embed, head):
        if not self._owns_lm_head:
            return super().set_embed_and_head(embed, head)
        # Standalone MTP checkpoints can supply a differently quantized head.
        # Share only the input embeddings; retain the entire loaded head module.
        self.model.embed_tokens.weight = embed
        torch.cuda.empty_cache()
        torch.cuda.synchronize()

    def set_lm_head_from_target(self, target_lm_head: nn.Module) -> None:
        if self.config.tie_word_embeddings or self._owns_lm_head:
            return
        self.lm_head = target_lm_head


EntryClass = [NemotronHForCausalLMMTP]
