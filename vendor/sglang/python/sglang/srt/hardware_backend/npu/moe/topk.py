from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.eplb.expert_location_dispatch import topk_ids_logical_to_physical
from sglang.srt.layers.moe.topk import (
    StandardTopKOutput,
    _zero_topk_weights_padded_region,
    capture_routed_experts_if_allowed,
    select_experts,
)

if TYPE_CHECKING:
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo
    from sglang.srt.layers.moe.topk import TopKConfig, TopKOutput


def fused_topk_npu(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    topk_config: "TopKConfig",
    num_token_non_padded: Optional[torch.Tensor] = None,
    expert_location_dispatch_info: Optional["ExpertLocationDispatchInfo"] = None,
    layer_id: Optional[int] = None,
) -> "TopKOutput":
    use_grouped_topk = topk_config.use_grouped_topk
    renormalize = topk_config.renormalize
    correction_bias = topk_config.correction_bias

    # sqrtsoftplus (DSV4 noaux_tc): top-k over (scores + bias); weights from
    # un-biased scores. The custom op fuses softplus/sqrt/topk/gather/norm/cast.
    if topk_config.scoring_func == "sqrtsoftplus":
        routed_scaling_factor = (
            topk_config.routed_scaling_factor
            if topk_config.apply_routed_scaling_factor_on_output
            else 1.0
        )
        topk_weights, topk_ids, _ = torch.ops.custom.npu_moe_gating_top_k(
            x=router_logits.to(torch.float32),
            k=topk_config.top_k,
            bias=(
                correction_bias.to(torch.float32)
                if correction_bias is not None
                else None
            ),
            input_ids=None,
            tid2eid=None,
            routed_scaling_factor=float(routed_scaling_factor),
            norm_type=2,
        )
        topk_weights = topk_weights.to(torch.float32)

    # Fast path: simple top-k without grouped routing and bias
    elif not use_grouped_topk and correction_bias is None:
        topk_weights, topk_ids, _ = torch.ops.npu.npu_moe_gating_top_k_softmax(
            router_logits,
            k=topk_config.top_k,
        )

        if renormalize:
            from sgl_kernel_npu.norm.l1_norm import l1_norm

            topk_weights = l1_norm(
                topk_weights
                if topk_config.num_shared_topk_slots == 0
                else topk_weights[:, :-1]
            )
        topk_weights = topk_weights.to(torch.float32)

    # Support grouped top-k or correction bias or sigmoid or routed_scaling_factor
    elif (
        correction_bias is not None
        or topk_config.scoring_func == "sigmoid"
        or num_token_non_padded is not None
    ):
        topk_weights, topk_ids, _ = torch.ops.npu.npu_moe_gating_top_k(
            router_logits.to(torch.float32),
            k=topk_config.top_k,
            bias=(
                correction_bias.to(torch.float32)
                if correction_bias is not None
                else None
            ),
            # num_expert_group and topk_group in some topk_config without group is None, (not supported by this ops)
            k_group=topk_config.topk_group if use_grouped_topk else 1,
            group_count=topk_config.num_expert_group if use_grouped_topk else 1,
            group_select_mode=(1 if use_grouped_topk else 0),
            renorm=renormalize,
            # 1 for sigmoid, 0 for softmax
            norm_type=(0 if topk_config.scoring_func == "softmax" else 1),
            routed_scaling_factor=(
                topk_config.routed_scaling_factor
                if topk_config.apply_routed_scaling_factor_on_output
                else 1
            ),
            eps=float(1e-20),
        )
        topk_weights = topk_weights.to(torch.float32)

    # torch native is not yet supported num_token_non_padded
    # Fallback to torch native implementation
    else:
        topk_config.torch_native = True
        return select_experts(
            hidden_states=hidden_states,
            layer_id=layer_id,
            router_logits=router_logits,
            topk_config=topk_config,
            num_token_non_padded=num_token_non_padded,
            expert_location_dispatch_info=expert_location_dispatch_info,
        )

    return _finalize_topk_npu(
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        router_logits=router_logits,
        topk_config=topk_config,
        num_token_non_padded=num_token_non_padded,
        expert_location_dispatch_info=expert_location_dispatch_info,
        layer_id=layer_id,
    )


def _finalize_topk_npu(
    *,
    topk_ids,
    topk_weights,
    router_logits,
    topk_config,
    num_token_non_padded,
    expert_location_dispatch_info,
    layer_id,
):
    num_shared = topk_config.num_shared_topk_slots
    routed_ids = topk_ids[:, :-num_shared] if num_shared else topk_ids
    capture_routed_experts_if_allowed(topk_config, layer_id, routed_ids)
    routed_ids = topk_ids_logical_to_physical(routed_ids, expert_location_dispatch_info)
    topk_ids = (
        torch.cat([routed_ids, topk_ids[:, -num_shared:]], dim=-1)
        if num_shared
        else routed_ids
    )
    # NPU dispatch retains valid IDs; duplicating a padded row's routes onto
    # expert zero can exceed per-expert capacity in fused dispatch backends.
    _zero_topk_weights_padded_region(topk_weights, num_token_non_padded)
    recorder_ids = routed_ids
    if num_token_non_padded is not None:
        rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)
        recorder_ids = routed_ids.masked_fill(
            (rows >= num_token_non_padded)[:, None], -1
        )
    get_global_expert_distribution_recorder().on_select_experts(topk_ids=recorder_ids)
    return StandardTopKOutput(topk_weights, topk_ids, router_logits)
