# SPDX-License-Identifier: Apache-2.0

import logging
from array import array
from typing import Iterable, List, Optional, Tuple

import torch
import torch.nn as nn

from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.moe.utils import (
    get_moe_a2a_backend,
    get_num_fused_shared_experts,
)
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.utils import PPMissingLayer
from sglang.srt.layers.utils.common import get_layer_id
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglang.srt.managers.mm_utils import (
    general_mm_embed_routine,
    pad_mm_tokens,
)
from sglang.srt.managers.schedule_batch import (
    MultimodalDataItem,
    MultimodalInputs,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors
from sglang.srt.model_loader.weight_utils import (
    default_weight_loader,
    maybe_remap_kv_scale_name,
)
from sglang.srt.models.minimax_m3 import (
    MiniMaxM3Model,
    MiniMaxM3SparseForCausalLM,
    build_minimax_fused_qkv_index,
    get_spec_layer_idx_from_weight_name,
)
from sglang.srt.models.minimax_vl_common import (
    CLIPVisionConfig,
    MiniMaxVLVisionModel,
    get_image_feature,
    get_video_feature,
    load_vision_weight,
    merge_vit_qkv_weights,
)
from sglang.srt.models.utils import WeightsMapper
from sglang.srt.multimodal.encoder_preprocessing import EncoderMediaProcessorConfig
from sglang.srt.runtime_context import get_mm, get_parallel
from sglang.srt.utils import (
    add_prefix,
    get_device_sm,
    is_cuda,
    is_gfx95_supported,
    is_hip,
    log_info_on_rank0,
)
from sglang.srt.utils.hf_transformers_utils import get_rope_config

logger = logging.getLogger(__name__)


_is_cuda = is_cuda()
_is_hip = is_hip()
_is_gfx95_supported = is_gfx95_supported()
_device_sm = get_device_sm()


class MiniMaxM3SparseForConditionalGeneration(nn.Module):
    hf_to_sglang_mapper = WeightsMapper(
        orig_to_new_substr={".block_sparse_moe.": ".mlp."}
    )
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        # no index_v_proj in the M3 checkpoint
        "index_qkv_proj": ["index_q_proj", "index_k_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    encoder_media_processor_config = EncoderMediaProcessorConfig(
        preserve_media_metadata=True, preprocess_off_event_loop=True
    )

    def __init__(
        self,
        config,
        quant_config: Optional[QuantizationConfig] = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.pp_group = get_parallel().pp_group

        self.use_data_parallel = get_mm().mm_enable_dp_encoder

        # The weight loader reads this after the build.
        self.num_fused_shared_experts = get_num_fused_shared_experts()
        if self.num_fused_shared_experts:
            log_info_on_rank0(logger, "Shared experts fusion optimization enabled.")

        vision_config_raw = config.vision_config
        assert vision_config_raw is not None, "vision_config is required"
        if hasattr(vision_config_raw, "to_dict"):
            vision_config_dict = vision_config_raw.to_dict()
        else:
            vision_config_dict = vision_config_raw
        vision_config = CLIPVisionConfig.from_dict(vision_config_dict)
        self.vision_config = vision_config

        text_hidden_size = getattr(config.text_config, "hidden_size", None)
        assert text_hidden_size is not None, "text_hidden_size is required"
        projector_hidden_size = getattr(config, "projector_hidden_size", None)

        # Vision model skips quantization: CLIP dimensions (head_dim=80) are not
        # compatible with MXFP8 kernel alignment requirements (128).
        self.vision_tower = MiniMaxVLVisionModel(
            config=vision_config,
            text_hidden_size=text_hidden_size,
            projector_hidden_size=projector_hidden_size,
            quant_config=None,
            prefix=add_prefix("vision_tower", prefix),
            multimodal_projector_bias=getattr(
                config, "multimodal_projector_bias", True
            ),
            patch_merge_bias=getattr(config, "patch_merge_bias", True),
        )

        self.encoder_processor = None
        if config.encoder_only:
            from sglang.srt.managers.tokenizer_manager import get_processor_wrapper

            self.encoder_processor = get_processor_wrapper()
            self.model = None
            self.lm_head = None
            self.logits_processor = None
            return

        text_config = config.text_config
        self.model = MiniMaxM3Model(
            config=text_config,
            quant_config=quant_config,
            prefix=add_prefix("language_model.model", prefix),
        )

        if self.pp_group.is_last_rank:
            self.lm_head = ParallelLMHead(
                text_config.vocab_size,
                text_config.hidden_size,
                quant_config=quant_config,
                prefix=add_prefix("language_model.lm_head", prefix),
                use_attn_tp_group=get_parallel().enable_dp_lm_head,
            )
        else:
            self.lm_head = PPMissingLayer()

        _, text_rope_scaling = get_rope_config(text_config)
        self.is_mrope_enabled = (
            text_rope_scaling is not None and "mrope_section" in text_rope_scaling
        )

        self.logits_processor = LogitsProcessor(text_config)

        # For EAGLE3 support
        self.capture_aux_hidden_states = False

    @classmethod
    def shared_experts_fusion_disable_reason(cls, hf_config, quant_config):
        """Why this checkpoint cannot fuse its shared expert, or None. Asked by
        the loader before any layer is built; the experts live on the text
        config."""
        text_config = getattr(hf_config, "text_config", hf_config)
        if not getattr(text_config, "n_shared_experts", None):
            return "No shared experts are defined in the config."
        if quant_config is not None and quant_config.get_name() in (
            "modelopt_mixed",
            "minimax_m3_nvfp4",
        ):
            return (
                "Shared and routed experts may use different quantization formats "
                "in mixed-precision checkpoints."
            )
        if not (_is_cuda or _is_hip):
            return "Shared experts fusion currently requires CUDA or ROCm devices."
        if _is_cuda and (_device_sm is not None) and (_device_sm < 80):
            return "Shared experts fusion requires SM80 or newer GPUs."
        if _is_hip and not _is_gfx95_supported:
            return "Shared experts fusion on ROCm is validated on gfx950 only."
        if get_parallel().moe_ep_size > 1:
            return (
                "Shared experts fusion is not supported together with expert "
                "parallelism yet."
            )
        if get_moe_a2a_backend().is_deepep():
            return (
                "Shared experts fusion is not supported when Deepep MoE backend "
                "is enabled."
            )
        return None

    @classmethod
    def num_fusable_shared_experts(cls, hf_config) -> int:
        """Return the model's fusable shared-expert count."""
        num_shared_experts = hf_config.text_config.n_shared_experts
        assert num_shared_experts == 1, "Only 1 fused shared expert is supported"
        return num_shared_experts

    @classmethod
    def get_model_config_for_expert_location(cls, config):
        # EP asserts if this hook is absent on the top-level arch; VL nests the
        # LM config under text_config, so delegate there (fall back to config).
        text_config = getattr(config, "text_config", None) or config
        return MiniMaxM3SparseForCausalLM.get_model_config_for_expert_location(
            text_config
        )

    def precompile_kernels_after_loading(self) -> None:
        MiniMaxM3SparseForCausalLM.precompile_kernels_after_loading(self)

    def pad_input_ids(self, input_ids: array, mm_inputs: MultimodalInputs) -> array:
        return pad_mm_tokens(input_ids, mm_inputs)

    def preprocess_mm_for_encoder(self, mm_data, modality, config):
        from sglang.srt.multimodal.processors.minimax_m3_vl import (
            preprocess_for_encoder,
        )

        return preprocess_for_encoder(
            mm_data,
            modality,
            processor=self.encoder_processor,
            mm_process_config=get_mm().mm_process_config,
        )

    def get_image_feature(self, items: List[MultimodalDataItem]) -> torch.Tensor:
        return get_image_feature(self.vision_tower, items, self.use_data_parallel)

    def get_video_feature(self, items: List[MultimodalDataItem]) -> torch.Tensor:
        return get_video_feature(self.vision_tower, items, self.use_data_parallel)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_embed_and_head(self):
        # EAGLE3 target interface: share the text embed + lm_head with the draft.
        return self.model.embed_tokens.weight, self.lm_head.weight

    def set_eagle3_layers_to_capture(self, layer_ids: Optional[list[int]] = None):
        # EAGLE3 target interface: select which decoder layers' hidden states the
        # draft consumes. Mirrors MiniMaxM3SparseForCausalLM; operates on the inner
        # MiniMaxM3Model (self.model), whose forward returns (hidden, aux) once set.
        if not self.pp_group.is_last_rank:
            return

        self.capture_aux_hidden_states = True
        # MiniMaxM3Model.forward captures at layer ENTRY (= previous layer's
        # output), so to capture layer L's output we must mark layer L+1. Apply
        # +1 on both paths so EAGLE3 works out-of-the-box even when the draft
        # config omits ``eagle_aux_hidden_state_layer_ids`` (the upstream
        # Inferact/MiniMax-M3-EAGLE3 checkpoint does not ship it); otherwise the
        # default-path layers are off by one and draft accept collapses.
        if layer_ids is None:
            num_layers = self.config.text_config.num_hidden_layers
            layer_ids = [2, num_layers // 2, num_layers - 3]
        self.model.layers_to_capture = [val + 1 for val in layer_ids]

        # MiniMaxM3Model.forward checks each layer's ``_is_layer_to_capture``
        # attribute (not ``i in layers_to_capture``); set it explicitly so the
        # (hidden, aux) tuple is actually returned during capture-enabled forwards.
        for layer_id in self.model.layers_to_capture:
            if 0 <= layer_id < len(self.model.layers):
                setattr(self.model.layers[layer_id], "_is_layer_to_capture", True)

    def set_dspark_layers_to_capture(self, layer_ids: list[int]):
        if not self.pp_group.is_last_rank:
            return
        depth = len(self.model.layers)
        if not layer_ids or any(i < 0 or i >= depth for i in layer_ids):
            raise ValueError("DSpark capture IDs must select existing target layers")
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [i + 1 for i in layer_ids]
        for i, layer in enumerate(self.model.layers):
            layer._is_layer_to_capture = i in self.model.layers_to_capture

    def set_dflash_layers_to_capture(self, layer_ids: list[int]):
        if list(layer_ids) != sorted(set(layer_ids)):
            raise ValueError("MiniMax DFlash capture taps must be unique and sorted")
        self.set_dspark_layers_to_capture(layer_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        get_embedding: bool = False,
        pp_proxy_tensors: Optional[PPProxyTensors] = None,
    ):
        if self.is_mrope_enabled:
            positions = forward_batch.mrope_positions

        hidden_states = general_mm_embed_routine(
            input_ids=input_ids,
            forward_batch=forward_batch,
            language_model=self.model,
            multimodal_model=self,
            positions=positions,
            pp_proxy_tensors=pp_proxy_tensors,
        )

        # EAGLE3: when layers_to_capture is set, MiniMaxM3Model.forward returns
        # (hidden_states, aux_hidden_states) once aux is non-empty; on idle/warmup
        # forwards with no captured tokens it returns a bare hidden tensor.
        aux_hidden_states = None
        if self.capture_aux_hidden_states and isinstance(hidden_states, tuple):
            hidden_states, aux_hidden_states = hidden_states

        if self.pp_group.is_last_rank and not get_embedding:
            return self.logits_processor(
                input_ids,
                hidden_states,
                self.lm_head,
                forward_batch,
                aux_hidden_states,
            )
        return hidden_states

    @property
    def start_layer(self):
        return self.model.start_layer

    @property
    def end_layer(self):
        return self.model.end_layer

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

        # ``.qkv_proj`` (with the leading dot) prevents matching e.g.
        # ``index_q_proj`` in the sparse-attention branch.
        llm_stacked_params_mapping = [
            (".qkv_proj", ".q_proj", "q"),
            (".qkv_proj", ".k_proj", "k"),
            (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0),
            (".gate_up_proj", ".up_proj", 1),
        ]

        if (
            getattr(self.config.text_config, "sparse_attention_config", None)
            is not None
        ):
            llm_stacked_params_mapping += [
                (".index_qkv_proj", ".index_q_proj", "q"),
                (".index_qkv_proj", ".index_k_proj", "k"),
                (".index_qkv_proj", ".index_v_proj", "v"),
            ]

        num_experts = getattr(self.config.text_config, "num_local_experts", 0)
        expert_params_mapping = (
            FusedMoE.make_expert_params_mapping(
                ckpt_gate_proj_name="w1",
                ckpt_down_proj_name="w2",
                ckpt_up_proj_name="w3",
                num_experts=num_experts + self.num_fused_shared_experts,
            )
            if num_experts > 0
            else []
        )

        params_dict = dict(self.named_parameters())
        vit_qkv_weights: dict = {}
        vit_qkv_biases: dict = {}

        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name:
                continue

            if name.startswith("language_model."):
                if self.config.encoder_only:
                    continue
                self._load_llm_weight(
                    name[len("language_model.") :],
                    loaded_weight,
                    params_dict,
                    llm_stacked_params_mapping,
                    expert_params_mapping,
                )
                continue

            load_vision_weight(
                name, loaded_weight, params_dict, vit_qkv_weights, vit_qkv_biases
            )

        merge_vit_qkv_weights(vit_qkv_weights, vit_qkv_biases, params_dict)

        build_minimax_fused_qkv_index(self)

    def _load_llm_weight(
        self,
        name: str,
        loaded_weight: torch.Tensor,
        params_dict: dict,
        llm_stacked_params_mapping: list,
        expert_params_mapping: list,
    ) -> None:
        if "block_sparse_moe" in name:
            name = name.replace("block_sparse_moe", "mlp")

        layer_id = get_layer_id(name)
        if layer_id is not None and (
            layer_id < self.model.start_layer or layer_id >= self.model.end_layer
        ):
            return

        if self.num_fused_shared_experts > 0 and "mlp.shared_experts" in name:
            name = name.replace(
                "mlp.shared_experts",
                f"mlp.experts.{self.config.text_config.num_local_experts}",
            )
            name = name.replace("gate_proj", "w1")
            name = name.replace("down_proj", "w2")
            name = name.replace("up_proj", "w3")

        if (
            get_spec_layer_idx_from_weight_name(self.config.text_config, name)
            is not None
        ):
            return

        for param_name, weight_name, shard_id in llm_stacked_params_mapping:
            if weight_name not in name:
                continue
            if "mlp.experts." in name:
                continue
            new_name = name.replace(weight_name, param_name)
            if new_name.endswith(".bias") and new_name not in params_dict:
                continue
            if new_name not in params_dict:
                continue
            param = params_dict[new_name]
            param.weight_loader(param, loaded_weight, shard_id)
            return

        is_expert_weight = False
        for mapping in expert_params_mapping:
            param_name, weight_name, expert_id, shard_id = mapping
            if weight_name not in name:
                continue
            is_expert_weight = True
            new_name = name.replace(weight_name, param_name)
            if new_name not in params_dict:
                continue
            param = params_dict[new_name]
            param.weight_loader(
                param,
                loaded_weight,
                new_name,
                shard_id=shard_id,
                expert_id=expert_id,
            )
            return
        if is_expert_weight:
            return

        if name.endswith(".bias") and name not in params_dict:
            return
        remapped = maybe_remap_kv_scale_name(name, params_dict)
        if remapped is None:
            return
        if remapped not in params_dict:
            logger.warning(f"Parameter {remapped} not found in params_dict")
            return
        param = params_dict[remapped]
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, loaded_weight)
        except Exception as e:
            logger.warning(f"Error loading weight {remapped}: {e}")


EntryClass = [MiniMaxM3SparseForConditionalGeneration]
