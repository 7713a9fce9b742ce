from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import msgspec

from sglang.srt.configs.model_config import ModelConfig, is_deepseek_v4
from sglang.srt.runtime_context import get_exec, get_spec

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

logger = logging.getLogger(__name__)

_MUSE_LAYER_OUTPUT_DRAFT_ARCHITECTURES = frozenset(
    {"DFlash2DraftModel", "MuseGlimmerAssistantModel"}
)


def _map_muse_target_layer_ids(*, target_hf_config, draft_hf_config, layer_ids):
    architectures = getattr(draft_hf_config, "architectures", None) or []
    uses_layer_outputs = getattr(
        target_hf_config, "model_type", None
    ) == "muse_glimmer" and bool(
        _MUSE_LAYER_OUTPUT_DRAFT_ARCHITECTURES.intersection(architectures)
    )
    return [i + 1 for i in layer_ids] if uses_layer_outputs else layer_ids


class SpecAuxHiddenStateConfig(msgspec.Struct, kw_only=True):
    eagle_use_aux_hidden_state: bool = False
    eagle_draft_num_layers: Optional[int] = None
    # Draft layers whose KV cache uses the target SWA pool capacity.
    eagle_draft_swa_num_layers: Optional[int] = None
    eagle_aux_hidden_state_layer_ids: Any = None
    dflash_use_aux_hidden_state: bool = False
    dflash_draft_num_layers: Optional[int] = None
    dflash_target_layer_ids: Any = None
    # DeepSeek-V4 DSpark draft stages (DeepseekV4ForCausalLMDSpark.num_stages); a
    # bundled head inherits the target's num_hidden_layers, so that overcounts.
    dspark_num_stages: Optional[int] = None
    # The draft checkpoint read in draft mode, and its KV layer count, for
    # every drafting algorithm: the fused-draft placement's input. A private
    # EAGLE draft pool is sized by `eagle_draft_num_layers` instead.
    draft_model_config: Optional[ModelConfig] = None
    draft_kv_num_layers: Optional[int] = None
    # Route the DFLASH-family capture to the model's DSPARK hook when it has one.
    is_dspark: bool = False


def resolve_spec_aux_hidden_state_config(
    *,
    server_args: ServerArgs,
    model_config: ModelConfig,
    spec_algorithm: SpeculativeAlgorithm,
    is_draft_worker: bool,
) -> SpecAuxHiddenStateConfig:
    config = SpecAuxHiddenStateConfig(is_dspark=spec_algorithm.is_dspark())
    _resolve_capture_only_aux_hidden_state(
        config=config,
        model_config=model_config,
        spec_algorithm=spec_algorithm,
        is_draft_worker=is_draft_worker,
    )
    _resolve_eagle_aux_hidden_state(
        config=config,
        server_args=server_args,
        model_config=model_config,
        spec_algorithm=spec_algorithm,
        is_draft_worker=is_draft_worker,
    )
    _resolve_dflash_aux_hidden_state(
        config=config,
        server_args=server_args,
        model_config=model_config,
        spec_algorithm=spec_algorithm,
        is_draft_worker=is_draft_worker,
    )
    return config


def _resolve_capture_only_aux_hidden_state(
    *,
    config: SpecAuxHiddenStateConfig,
    model_config: ModelConfig,
    spec_algorithm: SpeculativeAlgorithm,
    is_draft_worker: bool,
) -> None:
    """--enable-return-aux-hidden-states: aux capture on a target without a draft.

    No draft layer counts are set, so the KV pool reserves nothing for a draft.
    """
    features = get_exec().features
    method = features.aux_hidden_state_capture
    if method is None or is_draft_worker or not spec_algorithm.is_none():
        return
    layer_ids = features.return_aux_hidden_state_layer_ids
    if layer_ids is not None:
        _check_capture_layer_ids_in_range(layer_ids, model_config)
    if method == "eagle3":
        config.eagle_use_aux_hidden_state = True
        config.eagle_aux_hidden_state_layer_ids = (
            list(layer_ids) if layer_ids is not None else None
        )
    else:
        config.dflash_use_aux_hidden_state = True
        config.dflash_target_layer_ids = list(layer_ids)
        config.is_dspark = method == "dspark"


def _check_capture_layer_ids_in_range(layer_ids, model_config: ModelConfig) -> None:
    num_layers = getattr(model_config.hf_text_config, "num_hidden_layers", None)
    if num_layers is None:
        raise ValueError(
            "--return-aux-hidden-state-layer-ids requires target num_hidden_layers "
            "in config."
        )
    # Loop models: target layer ids span num_hidden_layers * num_loops.
    num_layers = int(num_layers) * int(
        getattr(model_config.hf_text_config, "num_loops", 1)
    )
    out_of_range = [layer_id for layer_id in layer_ids if layer_id >= num_layers]
    if out_of_range:
        raise ValueError(
            f"--return-aux-hidden-state-layer-ids {out_of_range} out of range for a "
            f"target with {num_layers} layers."
        )


def _resolve_eagle_aux_hidden_state(
    *,
    config: SpecAuxHiddenStateConfig,
    server_args: ServerArgs,
    model_config: ModelConfig,
    spec_algorithm: SpeculativeAlgorithm,
    is_draft_worker: bool,
) -> None:
    if not (
        (spec_algorithm.is_eagle() or spec_algorithm.is_standalone())
        and not is_draft_worker
    ):
        return

    draft_path = get_spec().speculative_draft_model_path
    # The draft read in draft mode. A path-less NEXTN/MTP head is the TARGET
    # checkpoint rewritten to its MTP form, which is where its
    # `num_nextn_predict_layers` gets filled in.
    draft_mode_config = ModelConfig.from_server_args(
        server_args,
        model_path=draft_path,
        model_revision=get_spec().speculative_draft_model_revision,
        is_draft_model=True,
    )
    if draft_mode_config.num_nextn_predict_layers is not None:
        config.draft_kv_num_layers = int(draft_mode_config.num_nextn_predict_layers)
    elif draft_path:
        config.draft_kv_num_layers = int(
            max(
                draft_mode_config.num_hidden_layers,
                draft_mode_config.num_attention_layers,
            )
        )
    if config.draft_kv_num_layers is not None:
        config.draft_model_config = draft_mode_config

    # A private draft pool is sized off the TARGET config when path-less, so
    # a path-less MTP deployment's token budget does not depend on the
    # draft-mode rewrite.
    draft_model_config = draft_mode_config if draft_path else model_config
    num_nextn_predict_layers = draft_model_config.num_nextn_predict_layers
    if num_nextn_predict_layers is not None:
        config.eagle_draft_num_layers = int(num_nextn_predict_layers)
    elif draft_path:
        config.eagle_draft_num_layers = config.draft_kv_num_layers
    else:
        return

    if draft_model_config.is_hybrid_swa and not draft_model_config.is_deepseek_v4_arch:
        config.eagle_draft_swa_num_layers = len(
            draft_model_config.swa_attention_layer_ids
        )

    if spec_algorithm.is_eagle3():
        config.eagle_use_aux_hidden_state = True
        try:
            eagle_config = getattr(draft_model_config.hf_config, "eagle_config", None)
            config.eagle_use_aux_hidden_state = eagle_config.get(
                "use_aux_hidden_state", True
            )
            config.eagle_aux_hidden_state_layer_ids = eagle_config[
                "eagle_aux_hidden_state_layer_ids"
            ]
        except Exception:
            config.eagle_aux_hidden_state_layer_ids = None


def _resolve_dflash_aux_hidden_state(
    *,
    config: SpecAuxHiddenStateConfig,
    server_args: ServerArgs,
    model_config: ModelConfig,
    spec_algorithm: SpeculativeAlgorithm,
    is_draft_worker: bool,
) -> None:
    if spec_algorithm.is_dflash_family() and not is_draft_worker:
        from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

        # Select target layers to capture for building draft context features.
        draft_model_config = ModelConfig.from_server_args(
            server_args,
            model_path=(get_spec().speculative_draft_model_path),
            model_revision=get_spec().speculative_draft_model_revision,
            is_draft_model=True,
        )
        dflash_draft_config = parse_dflash_draft_config(
            draft_hf_config=draft_model_config.hf_config
        )
        draft_num_layers = dflash_draft_config.require_num_layers()
        trained_target_layers = dflash_draft_config.num_target_layers

        target_num_layers = getattr(
            model_config.hf_text_config, "num_hidden_layers", None
        )
        if target_num_layers is None:
            raise ValueError(
                "Block-draft-with-target-kv spec requires target num_hidden_layers "
                f"in config. Got target={target_num_layers}."
            )
        target_num_layers = int(target_num_layers)
        # Loop models: target layer ids span num_hidden_layers * num_loops.
        num_loops = getattr(model_config.hf_text_config, "num_loops", 1)
        target_num_layers = target_num_layers * int(num_loops)

        if (
            trained_target_layers is not None
            and trained_target_layers != target_num_layers
        ):
            logger.warning(
                "Draft config num_target_layers=%s differs from runtime target num_hidden_layers=%s; "
                "selecting capture layers based on the runtime target model.",
                trained_target_layers,
                target_num_layers,
            )

        target_layer_ids = dflash_draft_config.resolve_target_layer_ids(
            target_num_layers=int(target_num_layers),
            draft_num_layers=int(draft_num_layers),
        )

        # These Muse drafts use HF layer-output ids, while the Muse target captures
        # before each layer. Legacy Muse drafts already store layer-input ids.
        target_layer_ids = _map_muse_target_layer_ids(
            target_hf_config=model_config.hf_config,
            draft_hf_config=draft_model_config.hf_config,
            layer_ids=target_layer_ids,
        )

        if spec_algorithm.is_dspark():
            from sglang.srt.speculative.dspark_components.dspark_config import (
                parse_dspark_draft_config,
            )

            dspark_draft_config = parse_dspark_draft_config(
                draft_hf_config=draft_model_config.hf_config
            )
            if not dspark_draft_config.require_markov():
                raise ValueError(
                    "DSPARK requires markov_rank > 0 in the draft config, "
                    f"got markov_rank={dspark_draft_config.markov_rank}."
                )
            if dspark_draft_config.target_layer_ids is not None:
                target_layer_ids = list(dspark_draft_config.target_layer_ids)
                # Dense DSpark drafts build num_hidden_layers stages instead.
                if is_deepseek_v4(draft_model_config.hf_config):
                    config.dspark_num_stages = len(target_layer_ids)

        config.dflash_use_aux_hidden_state = True
        config.dflash_draft_num_layers = int(draft_num_layers)
        config.draft_model_config = draft_model_config
        config.draft_kv_num_layers = int(draft_num_layers)
        config.dflash_target_layer_ids = target_layer_ids
