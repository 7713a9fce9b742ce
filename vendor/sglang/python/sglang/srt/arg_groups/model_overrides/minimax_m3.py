"""Config-time override declarations for minimax_m3."""

import logging
from typing import Any

from sglang.srt.arg_groups.model_override_base import (
    _register_for,
    is_attention_backend_not_set,
    resolving_view,
)
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_platform
from sglang.srt.utils.common import get_quantization_config

logger = logging.getLogger(__name__)


def _resolve_quant_method(hf_config: Any) -> str | None:
    quant_method = get_quantization_config(hf_config)
    if quant_method != "mxfp8":
        return quant_method
    quant_config = hf_config.quantization_config
    # Declared mxfp8 is only the projection format;
    # the NVFP4 packed experts are named in the MoE fields, which plain MXFP8 lacks.
    if (
        str(quant_config.get("moe_quant_algo", "")).upper() != "NVFP4"
        or quant_config.get("moe_quant_format") != "nvfp4-pack-quantized"
    ):
        return quant_method
    logger.info(
        "Checkpoint declares mxfp8 with NVFP4 packed experts; "
        "serving as minimax_m3_nvfp4."
    )
    return "minimax_m3_nvfp4"


@_register_for(
    "MiniMaxM3SparseForCausalLM",
    "MiniMaxM3SparseForConditionalGeneration",
)
def _minimax_m3_overrides(server_args: Any, hf_config: Any) -> dict:

    cfg = resolving_view(server_args)
    overrides: dict[str, Any] = {}

    quant_method = _resolve_quant_method(hf_config)
    quant_resolved = cfg.quantization
    if (
        quant_resolved is None
        and not server_args._quantization_explicitly_unset
        and quant_method is not None
    ):
        overrides["quantization"] = quant_method
        quant_resolved = quant_method

    if quant_resolved == "minimax_m3_nvfp4":
        if cfg.speculative_algorithm not in (None, "DSPARK", "DFLASH"):
            raise ValueError("M3.1 NVFP4 only supports DSPARK or DFLASH speculation")
        if cfg.speculative_algorithm in ("DSPARK", "DFLASH"):
            algorithm = cfg.speculative_algorithm
            # Only the vision-language wrapper exposes the draft's hidden-state capture.
            if hf_config.architectures[0] != "MiniMaxM3SparseForConditionalGeneration":
                raise ValueError(
                    f"M3.1 NVFP4 {algorithm} requires MiniMaxM3SparseForConditionalGeneration, "
                    f"got {hf_config.architectures[0]}"
                )
            if not get_platform().is_blackwell:
                raise ValueError(f"M3.1 NVFP4 {algorithm} requires Blackwell")
            if envs.SGLANG_RAGGED_VERIFY_MODE.get() != "static":
                raise ValueError(
                    f"M3.1 NVFP4 {algorithm} requires SGLANG_RAGGED_VERIFY_MODE=static"
                )
            if cfg.pp_size != 1:
                raise ValueError(f"M3.1 NVFP4 {algorithm} requires PP=1")
            if algorithm == "DFLASH" and cfg.disaggregation_mode != "null":
                raise ValueError(
                    "M3.1 NVFP4 DFLASH currently requires colocated serving"
                )
            if cfg.speculative_draft_kv_cache_dtype in (None, "auto"):
                overrides["speculative_draft_kv_cache_dtype"] = "bf16"
            # DFLASH resolves its backend against the draft's attention layout.
            if (
                algorithm == "DSPARK"
                and cfg.speculative_draft_attention_backend is None
            ):
                overrides["speculative_draft_attention_backend"] = "trtllm_mha"
            # Draft tokens come from a cross-rank candidate gather and the greedy
            # accept from gathered target logits, so the ranks agree without
            # rank 0's broadcasts; keep only the RNG-dependent sites.
            if algorithm == "DSPARK" and not envs.SGLANG_SPEC_TP_SYNC.is_set():
                envs.SGLANG_SPEC_TP_SYNC.set("rng")
        if cfg.page_size not in (None, 128):
            raise ValueError("M3.1 NVFP4 requires --page-size 128")
        if not get_platform().is_blackwell:
            # MegaMoE and the packed NVFP4 KV cache are SM100-only; neither is
            # selected here, and the KV dtype stays at the model dtype.
            overrides.update(page_size=128)
            if cfg.moe_runner_backend == "auto":
                overrides["moe_runner_backend"] = "marlin"
            if is_attention_backend_not_set(cfg):
                overrides["attention_backend"] = "fa3"
            return overrides
        if cfg.moe_runner_backend == "flashinfer_trtllm_routed":
            if cfg.moe_a2a_backend not in ("none", "megamoe"):
                raise ValueError(
                    "M3.1 NVFP4 flashinfer_trtllm_routed requires "
                    "--moe-a2a-backend none or megamoe"
                )
        else:
            if cfg.moe_a2a_backend not in ("none", "megamoe"):
                raise ValueError("M3.1 NVFP4 requires --moe-a2a-backend megamoe")
            overrides.update(moe_a2a_backend="megamoe")
            if cfg.moe_runner_backend == "auto":
                overrides["moe_runner_backend"] = "deep_gemm"
        overrides.update(page_size=128)
        if cfg.kv_cache_dtype == "auto":
            overrides["kv_cache_dtype"] = "fp8_e4m3"
        elif cfg.kv_cache_dtype != "fp8_e4m3":
            raise ValueError("M3.1 NVFP4 requires --kv-cache-dtype fp8_e4m3")
        if is_attention_backend_not_set(cfg):
            overrides["attention_backend"] = "trtllm_mha"
        return overrides

    if get_platform().is_hip:
        if is_attention_backend_not_set(cfg):
            overrides["attention_backend"] = "triton"
        if cfg.moe_runner_backend == "auto" and quant_resolved == "mxfp8":
            overrides["moe_runner_backend"] = "triton"
        if not envs.USE_ROCM_AITER_ROPE_BACKEND.is_set():
            envs.USE_ROCM_AITER_ROPE_BACKEND.set("0")
        aiter_fusion_resolved = cfg.enable_aiter_allreduce_fusion
        if cfg.ep_size > 1 and cfg.moe_a2a_backend == "none" and aiter_fusion_resolved:
            logger.warning(
                "Disable --enable-aiter-allreduce-fusion for MiniMax-M3 "
                "standard EP on ROCm because the deferred fused all-reduce "
                "corrupts sparse MoE partial outputs."
            )
            overrides["enable_aiter_allreduce_fusion"] = False
            aiter_fusion_resolved = False
        # By default MiniMax-M3 on ROCm keeps NCCL all-reduce (custom AR off)
        # whenever aiter all-reduce fusion is not used. Opting in via
        # SGLANG_M3_ALLOW_CUSTOM_AR keeps custom all-reduce enabled so the
        # quick-reduce path (ROCM_QUICK_REDUCE_QUANTIZATION=INT4/INT6/INT8) can
        # accelerate the large prefill all-reduce.
        if not aiter_fusion_resolved and not envs.SGLANG_M3_ALLOW_CUSTOM_AR.get():
            overrides["disable_custom_all_reduce"] = True
    elif get_platform().is_sm100:
        if is_attention_backend_not_set(cfg):
            if (
                cfg.kv_cache_dtype == "fp8_e4m3"
                and not envs.SGLANG_DISABLE_M3_FP8_ATTN_GEMM.get()
            ):
                # fp8 attention GEMMs activate whenever possible
                # (m3_fp8_attn_gemm_enabled); only trtllm_mha serves the dense
                # fp8-q path, so prefer it over fa4 for fp8 KV. The
                # SGLANG_DISABLE_M3_FP8_ATTN_GEMM kill switch keeps the fa4
                # default (pre-fp8 behavior).
                overrides["attention_backend"] = "trtllm_mha"
            else:
                overrides["attention_backend"] = "fa4"
        backend_resolved = overrides.get("attention_backend", cfg.attention_backend)
        page_resolved = cfg.page_size
        # fa4 (fmha_sm100) and trtllm_mha both allow the page_size == 128
        # sparse block MSA needs (trtllm_mha via trtllm-gen's dynamic
        # tokens-per-page kernels).
        if page_resolved is None and backend_resolved in ("fa4", "trtllm_mha"):
            overrides["page_size"] = 128
            page_resolved = 128
        if cfg.moe_runner_backend == "auto" and quant_resolved == "mxfp8":
            overrides["moe_runner_backend"] = "deep_gemm"
        elif cfg.moe_runner_backend == "auto" and quant_resolved == "modelopt_mixed":
            overrides["moe_runner_backend"] = "flashinfer_trtllm_routed"
        logger.info(
            "MiniMax-M3 on SM100: attention_backend="
            f"{overrides.get('attention_backend', cfg.attention_backend)}, page_size={page_resolved}, "
            f"moe_runner_backend={overrides.get('moe_runner_backend', cfg.moe_runner_backend)}."
        )
    elif get_platform().is_sm90:
        if is_attention_backend_not_set(cfg):
            overrides["attention_backend"] = "fa3"
        page_resolved = cfg.page_size
        if (
            page_resolved is None
            and overrides.get("attention_backend", cfg.attention_backend) == "fa3"
        ):
            overrides["page_size"] = 128
            page_resolved = 128
        logger.info(
            "MiniMax-M3 on Hopper: attention_backend="
            f"{overrides.get('attention_backend', cfg.attention_backend)}, page_size={page_resolved} "
            "(MSA is SM100-only; sparse attention runs on the Triton path)."
        )

    # fp8 attention GEMMs have no opt-in flag: m3_fp8_attn_gemm_enabled
    # (server_args.py) derives the mode from kv_cache_dtype (fp8_e4m3) +
    # attention_backend (trtllm_mha) + SM100 at runtime. Surface the
    # resolution here: warn on fp8_e5m2 (fmha_sm100's variant lookup would
    # silently dispatch the e4m3 kernel, so e5m2 stays on the widening Triton
    # path), log when the fp8 GEMM mode is active, and log when the
    # SGLANG_DISABLE_M3_FP8_ATTN_GEMM kill switch suppresses it.
    if cfg.kv_cache_dtype == "fp8_e5m2":
        logger.warning(
            "MiniMax-M3 with kv_cache_dtype fp8_e5m2: fp8 attention GEMMs stay "
            "DISABLED (fmha_sm100's variant lookup would silently dispatch the "
            "e4m3 kernel for e5m2); sparse attention runs on the widening "
            "Triton path. Use --kv-cache-dtype fp8_e4m3 for fp8 attention GEMMs."
        )
    elif (
        cfg.kv_cache_dtype == "fp8_e4m3"
        and overrides.get("attention_backend", cfg.attention_backend) == "trtllm_mha"
        and get_platform().is_sm100
    ):
        if envs.SGLANG_DISABLE_M3_FP8_ATTN_GEMM.get():
            logger.info(
                "MiniMax-M3 fp8 attention GEMMs DISABLED by "
                "SGLANG_DISABLE_M3_FP8_ATTN_GEMM: bf16 indexer + widening "
                "Triton sparse path, bf16 q; dense layers keep trtllm_mha's "
                "fp8 KV cache."
            )
        else:
            logger.info(
                "MiniMax-M3 fp8 attention GEMMs active (kv_cache_dtype fp8_e4m3 + "
                "trtllm_mha on SM100): fp8 main/index KV, fp8-cast q, fp8 "
                "sparse/MSA kernels. Set SGLANG_DISABLE_M3_FP8_ATTN_GEMM=1 to "
                "force the pre-fp8 numerics."
            )

    moe_runner_resolved = overrides.get("moe_runner_backend", cfg.moe_runner_backend)
    if quant_resolved is None and moe_runner_resolved in ("auto", "deep_gemm"):
        if moe_runner_resolved == "deep_gemm":
            logger.warning(
                "MiniMax-M3: the deep_gemm MoE runner produces corrupted output "
                "on bf16 full weights; overriding --moe-runner-backend to 'triton'."
            )
        overrides["moe_runner_backend"] = "triton"

    return overrides
