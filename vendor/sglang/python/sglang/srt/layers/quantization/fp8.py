# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted from https://github.com/vllm-project/vllm/blob/v0.6.4.post1/vllm/model_executor/layers/quantization/fp8.py

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from torch.nn import Module
from torch.nn.parameter import Parameter

from sglang.kernels.ops.quantization.fp8_kernel import (
    fp8_dtype,
    is_fp8_fnuz,
    per_token_group_quant_fp8,
    scaled_fp8_quant,
)
from sglang.srt.distributed.device_communicators.pynccl_allocator import (
    use_symmetric_memory,
)
from sglang.srt.environ import envs
from sglang.srt.hardware_backend.npu.utils import is_npu_arch35
from sglang.srt.layers.amx_utils import (
    CPUQuantMethod,
    _amx_process_weight_after_loading,
)
from sglang.srt.layers.dp_attention import is_allocation_symmetric
from sglang.srt.layers.moe import MoeRunner, MoeRunnerBackend, MoeRunnerConfig
from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoeQuantInfo
from sglang.srt.layers.moe.moe_runner.flashinfer_trtllm import (
    FlashInferTrtllmFp8MoeQuantInfo,
)
from sglang.srt.layers.moe.moe_runner.triton import TritonMoeQuantInfo
from sglang.srt.layers.moe.utils import (
    RoutingMethodType,
    get_moe_a2a_backend,
    get_moe_padding_size,
    get_moe_runner_backend,
    get_moe_weight_sizes,
)
from sglang.srt.layers.parameter import (
    BlockQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)
from sglang.srt.layers.quantization.base_config import (
    FusedMoEMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
)
from sglang.srt.layers.quantization.fp8_utils import (
    _deepgemm_block_fp8_supported,
    _use_aiter_bpreshuffle_gfx95,
    apply_fp8_linear,
    block_fp8_scale_to_e8m0_128,
    block_fp8_scale_to_mxfp8_e8m0,
    can_auto_enable_marlin_fp8,
    can_serve_block_fp8_as_mxfp8,
    cutlass_fp8_supported,
    deepgemm_w8a8_block_fp8_linear_with_fallback,
    deepgemm_w8a8_mxfp8_linear_with_fallback,
    dense_mxscale_wanted,
    dispatch_block_fp8_mxfp8_linear,
    dispatch_w8a8_block_fp8_linear,
    dispatch_w8a8_mxfp8_linear,
    input_to_float8,
    mxfp8_group_quantize,
    normalize_e4m3fn_to_e4m3fnuz,
    pack_mxfp8_weight_scale_for_deepgemm,
    prepare_xpu_block_scale_for_scaled_mm,
    requant_block_scale_ue8m0_for_deepgemm,
    resolve_block_fp8_mxfp8_backend,
    resolve_mxfp8_dense_gemm_backend,
    unshuffle_aiter_fp8_weight,
    use_aiter_bpreshuffle_gemm,
)
from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod
from sglang.srt.layers.quantization.marlin_utils_fp8 import prepare_fp8_layer_for_marlin
from sglang.srt.layers.quantization.mxfp8_input import Mxfp8SwizzledInput
from sglang.srt.layers.quantization.unquant import (
    UnquantizedFusedMoEMethod,
    UnquantizedLinearMethod,
)
from sglang.srt.layers.quantization.utils import (
    all_close_1d,
    convert_to_channelwise,
    is_layer_skipped,
    per_tensor_dequantize,
    requantize_with_max_scale,
)
from sglang.srt.layers.utils import copy_or_rebind_param
from sglang.srt.runtime_context import (
    get_parallel,
    get_platform,
)
from sglang.srt.utils import (
    cpu_has_amx_support,
    get_bool_env_var,
    get_device_capability,
    is_cpu,
    is_cuda,
    is_flashinfer_available,
    is_gfx95_supported,
    is_gfx1250_supported,
    is_hip,
    is_musa,
    is_npu,
    is_xpu,
    log_info_on_rank0,
    mxfp8_block_convert_required,
    print_warning_once,
    set_weight_attrs,
    use_intel_amx_backend,
)

if TYPE_CHECKING:
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.moe.moe_runner.aiter import AiterMoeQuantInfo
    from sglang.srt.layers.moe.token_dispatcher import CombineInput, DispatchOutput
    from sglang.srt.layers.quantization.w4afp8 import W4AFp8Config
    from sglang.srt.models.utils import WeightsMapper

_is_hip = is_hip()
_is_cuda = is_cuda()
_is_musa = is_musa()
_is_npu = is_npu()
_is_cpu_amx_available = cpu_has_amx_support()
_is_cpu = is_cpu()
_is_xpu = is_xpu()
_is_fp8_fnuz = is_fp8_fnuz()
_is_gfx95_supported = is_gfx95_supported()

if _is_hip:
    from sglang.srt.layers.quantization import fp8_hip
# gfx942 (MI300) has no MX matmul HW; MXFP8 checkpoints are converted to
# block-fp8 [128,128] at load and run through the native block-fp8 kernels.
# SGLANG_FORCE_MXFP8_BLOCK_CONVERT=1 opts into that same block-fp8 path on
# gfx950 (MI35x): it routes the fp8 GEMMs / fused MoE through the mature aiter
# block-scale kernels instead of the native MX dot_scaled path (measured +20%
# throughput at equal accuracy on MiniMax-M3, GSM8K 0.9719 vs 0.9689).
_mxfp8_to_block_fp8_required = mxfp8_block_convert_required() or get_bool_env_var(
    "SGLANG_FORCE_MXFP8_BLOCK_CONVERT"
)
_use_hip_int4 = get_bool_env_var("SGLANG_INT4_WEIGHT") and _is_hip
_use_aiter = envs.SGLANG_USE_AITER.get() and _is_hip
_is_shuffle_moe_mxfp4 = is_gfx95_supported()
_is_gfx1250_supported = is_gfx1250_supported()
# gfx1250 grouped MoE runs the a8w4 (fp8 activation) FlyDSL kernel when
# AITER_FORCE_A8W4 is set; that kernel consumes (16,16)-preshuffled weights.
_use_aiter_a8w4 = get_bool_env_var("AITER_FORCE_A8W4", "false")


def _require_fp4_dtype():
    fp4_dtype = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4_dtype is None:
        raise RuntimeError(
            "DeepSeek-V4 FP4 experts require torch.float4_e2m1fn_x2 support."
        )
    return fp4_dtype


def unshuffle_fp8_weight(weight: torch.Tensor) -> torch.Tensor:
    """Restore the logical layout of a backend-shuffled FP8 weight."""
    if not _use_aiter:
        raise RuntimeError("FP8 weight unshuffle requires AITER")
    return unshuffle_aiter_fp8_weight(weight)


if _use_aiter or _use_hip_int4:
    from aiter.ops.shuffle import (
        moe_shuffle_scale,
        moe_shuffle_weight,
        shuffle_scale,
        shuffle_weight,
    )

if _use_aiter:
    from sglang.srt.layers.quantization.fp8_utils import (
        aiter_w8a8_block_fp8_linear,
        use_aiter_triton_gemm_w8a8_tuned_gfx950,
    )


ACTIVATION_SCHEMES = ["static", "dynamic"]

logger = logging.getLogger(__name__)
_DENSE_MXSCALE_LOGGED: set = set()

DSV4_DEQUANT_FP4_TABLE = torch.tensor(
    [
        0.0,
        0.5,
        1.0,
        1.5,
        2.0,
        3.0,
        4.0,
        6.0,
        -0.0,
        -0.5,
        -1.0,
        -1.5,
        -2.0,
        -3.0,
        -4.0,
        -6.0,
    ],
    dtype=torch.float32,
)


def cast_e2m1fn_to_e4m3fn(
    x: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Casts a tensor from e2m1fn to e4m3fn losslessly.
    """
    assert x.dtype == torch.int8
    assert x.ndim == 2
    out_dim, in_dim = x.size()
    in_dim *= 2
    fp8_block_size = 128
    fp4_block_size = 32
    assert in_dim % fp8_block_size == 0 and out_dim % fp8_block_size == 0
    assert scale.size(0) == out_dim and scale.size(1) == in_dim // fp4_block_size

    x = x.view(torch.uint8)
    low = x & 0x0F
    high = (x >> 4) & 0x0F
    table = DSV4_DEQUANT_FP4_TABLE.to(x.device)
    x = torch.stack([table[low.long()], table[high.long()]], dim=-1).flatten(2)

    # max_fp4 (6.0) * MAX_OFFSET must fit in e4m3fn (max 448)
    # 6.0 * 2^6 = 384 < 448; 6.0 * 2^7 = 768 > 448; so MAX_OFFSET_BITS = 6
    MAX_OFFSET_BITS = 6

    bOut = out_dim // fp8_block_size
    bIn = in_dim // fp8_block_size
    # bOut, bIn, 128, 128
    x = x.view(bOut, fp8_block_size, bIn, fp8_block_size).transpose(1, 2)
    # bOut, bIn, 128*4
    scale = scale.float().view(bOut, fp8_block_size, bIn, -1).transpose(1, 2).flatten(2)
    ## bOut, bIn, 1
    scale_max_offset_bits = scale.amax(dim=-1, keepdim=True) / (2**MAX_OFFSET_BITS)
    # bOut, bIn, 128*4
    offset = scale / scale_max_offset_bits
    # bOut, bIn, 128, 128
    offset = offset.unflatten(-1, (fp8_block_size, -1)).repeat_interleave(
        fp4_block_size, dim=-1
    )
    x = (x * offset).transpose(1, 2).reshape(out_dim, in_dim)
    return x.to(torch.float8_e4m3fn), scale_max_offset_bits.squeeze(-1).to(
        torch.float8_e8m0fnu
    )


class Fp8Config(QuantizationConfig):
    """Config class for FP8."""

    def __init__(
        self,
        is_checkpoint_fp8_serialized: bool = False,
        activation_scheme: str = "dynamic",
        ignored_layers: Optional[List[str]] = None,
        weight_block_size: List[int] = None,
        packed_modules_mapping: Optional[Dict[str, List[str]]] = None,
        use_mxfp8: bool = False,
        is_fp4_experts: bool = False,
        kv_cache_quant_algo: Optional[str] = None,
        scale_fmt: Optional[str] = None,
    ) -> None:
        super().__init__()
        # DSV4 mxfp4-packed (True) vs converted FP8 (False); injected by
        # model_loader from ModelConfig. Default False off the DSV4 path.
        self.is_fp4_experts = is_fp4_experts
        self.dequant_fp4_to_fp8 = False
        self.is_dsv4_fp4_experts = False
        self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized
        if is_checkpoint_fp8_serialized:
            log_info_on_rank0(logger, "Detected fp8 checkpoint.")
        if activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"Unsupported activation scheme {activation_scheme}")
        self.activation_scheme = activation_scheme
        self.ignored_layers = ignored_layers or []
        if ignored_layers_str := envs.SGLANG_FP8_IGNORED_LAYERS.get():
            self.ignored_layers.extend(
                [
                    layer.strip()
                    for layer in ignored_layers_str.split(",")
                    if layer.strip()
                ]
            )
        self.packed_modules_mapping = packed_modules_mapping or {}
        self.use_mxfp8 = use_mxfp8
        self.kv_cache_quant_algo = kv_cache_quant_algo
        # "ue8m0" checkpoints quantize activations with power-of-two scales.
        self.scale_fmt = scale_fmt
        if weight_block_size is not None:
            if not is_checkpoint_fp8_serialized:
                raise ValueError(
                    "The block-wise quantization only supports fp8-serialized checkpoint for now."
                )
            if len(weight_block_size) != 2:
                raise ValueError(
                    f"The quantization block size of weight must have 2 dimensions, but got {len(weight_block_size)} dimensions."
                )
            if activation_scheme != "dynamic":
                raise ValueError(
                    f"The block-wise quantization only supports dynamic activation scheme for now, but got {activation_scheme} activation scheme."
                )
        if self.use_mxfp8:
            if weight_block_size is None:
                weight_block_size = [1, 32]
            elif weight_block_size != [1, 32]:
                raise ValueError("MXFP8 requires weight_block_size=[1, 32].")
        self.weight_block_size = weight_block_size

    def get_name(self) -> str:
        return "mxfp8" if self.use_mxfp8 else "fp8"

    @classmethod
    def get_supported_act_dtypes(cls) -> List[torch.dtype]:
        return [torch.bfloat16, torch.half]

    def get_min_capability(self) -> int:
        if is_npu():
            return 0  # NPU bypasses CUDA capability checks
        if _is_musa:
            return 31
        if self.use_mxfp8 and _is_hip and _is_gfx95_supported:
            return 95
        if self.use_mxfp8 and _mxfp8_to_block_fp8_required:
            return 94

        return 100 if self.use_mxfp8 else 80

    @classmethod
    def get_config_filenames(cls) -> List[str]:
        return []

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> Fp8Config:
        quant_method = cls.get_from_keys(config, ["quant_method"])
        use_mxfp8 = "mxfp8" in quant_method
        is_checkpoint_fp8_serialized = ("fp8" in quant_method) or use_mxfp8
        activation_scheme = cls.get_from_keys(config, ["activation_scheme"])
        packed_modules_mapping = (
            cls.get_from_keys_or(config, ["packed_modules_mapping"], {}) or {}
        )
        ignored_layers = cls.get_from_keys_or(
            config, ["ignored_layers", "modules_to_not_convert"], None
        )
        if ignored_layers:
            # Keep both "model." and non-"model." variants for robust prefix matching.
            normalized = []
            for layer in ignored_layers:
                base = layer.removeprefix("model.")
                normalized.append(base)
                normalized.append(f"model.{base}")
            ignored_layers = normalized
        weight_block_size = cls.get_from_keys_or(config, ["weight_block_size"], None)
        kv_cache_quant_algo = cls.get_from_keys_or(
            config, ["kv_cache_quant_algo"], None
        )
        scale_fmt = cls.get_from_keys_or(config, ["scale_fmt"], None)
        if use_mxfp8:
            # MXFP8 (OCP) spec fixes block size to [1, 32]; ckpt field is metadata only.
            if weight_block_size is not None and weight_block_size != [1, 32]:
                logger.warning(
                    "MXFP8 overriding weight_block_size=%s from config.json -> [1, 32].",
                    weight_block_size,
                )
            weight_block_size = [1, 32]
        return cls(
            is_checkpoint_fp8_serialized=is_checkpoint_fp8_serialized,
            activation_scheme=activation_scheme,
            ignored_layers=ignored_layers,
            weight_block_size=weight_block_size,
            packed_modules_mapping=packed_modules_mapping,
            use_mxfp8=use_mxfp8,
            kv_cache_quant_algo=kv_cache_quant_algo,
            scale_fmt=scale_fmt,
        )

    def get_quant_method(
        self, layer: torch.nn.Module, prefix: str
    ) -> Optional[QuantizeMethodBase]:
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
        from sglang.srt.layers.radix_attention import RadixAttention

        if isinstance(layer, LinearBase):
            if is_layer_skipped(
                prefix, self.ignored_layers, fused_mapping=self.packed_modules_mapping
            ):
                return UnquantizedLinearMethod()
            if is_npu() and self.use_mxfp8:
                from sglang.srt.hardware_backend.npu.quantization.linear_method_npu import (
                    NPUMXFP8LinearMethod,
                )

                return NPUMXFP8LinearMethod(self)
            return Fp8LinearMethod(self)
        elif isinstance(layer, FusedMoE):
            if is_layer_skipped(
                prefix, self.ignored_layers, fused_mapping=self.packed_modules_mapping
            ):
                return UnquantizedFusedMoEMethod(
                    layer.use_triton_kernels, layer.use_flashinfer_trtllm_moe
                )

            if is_npu() and self.use_mxfp8:
                from sglang.srt.hardware_backend.npu.quantization.online_moe_methods import (
                    NPUMXFP8OnlineMoEMethod,
                )

                return NPUMXFP8OnlineMoEMethod(self)

            fp8_method = Fp8MoEMethod(self)

            if self.is_fp4_experts and self.dequant_fp4_to_fp8:
                assert get_moe_runner_backend().is_auto(), (
                    f"{get_moe_runner_backend()} is not compatible with SGLANG_DSV4_FP4_DEQUANT=1"
                )
                return fp8_method

            if (
                self.is_fp4_experts
                and is_npu_arch35()
                # NPUW4A4Fp4MoEMethod is DSV4-specific (deepep dispatch,
                # swiglu_limit); other FP4-expert checkpoints fall through
                # to Fp8MoEMethod.
                and self.is_dsv4_fp4_experts
            ):
                from sglang.srt.hardware_backend.npu.quantization.fp4_moe_methods import (
                    NPUW4A8MXFP4FusedMoEMethod,
                )

                return NPUW4A8MXFP4FusedMoEMethod(prefix=prefix)

            if self.is_fp4_experts and get_moe_runner_backend().is_marlin():
                from sglang.srt.layers.quantization.mxfp4_marlin_moe import (
                    Mxfp4MarlinMoEMethod,
                )

                return Mxfp4MarlinMoEMethod(fp8_method, prefix=prefix)

            if self.is_fp4_experts and get_moe_runner_backend().is_humming():
                from sglang.srt.layers.quantization.mxfp4_humming_moe import (
                    Mxfp4HummingMoEMethod,
                )

                return Mxfp4HummingMoEMethod(fp8_method, prefix=prefix)

            if self.is_fp4_experts and get_moe_runner_backend().is_flashinfer_mxfp4():
                # SM100 uses TRT-LLM; SM90 uses W4A16 and SM120 uses MXFP8xMXFP4.
                if get_platform().is_sm90 or get_platform().is_sm120:
                    from sglang.srt.layers.quantization.mxfp4_flashinfer_cutlass_moe import (
                        Mxfp4FlashinferCutlassMoEMethod,
                    )

                    return Mxfp4FlashinferCutlassMoEMethod(fp8_method, prefix=prefix)

                from sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe import (
                    Mxfp4FlashinferTrtllmMoEMethod,
                )

                return Mxfp4FlashinferTrtllmMoEMethod(fp8_method, prefix=prefix)
            return fp8_method
        elif isinstance(layer, RadixAttention):
            return Fp8KVCacheMethod(self)
        return None

    def get_scaled_act_names(self) -> List[str]:
        return []

    def apply_weight_name_mapper(self, hf_to_sglang_mapper: WeightsMapper):
        if self.ignored_layers:
            self.ignored_layers = list(
                dict.fromkeys(hf_to_sglang_mapper.apply_list(self.ignored_layers))
            )


class Fp8LinearMethod(LinearMethodBase):
    """Linear method for FP8.

    It supports the following quantization schemes:
    - Per-channel weight quantization + per-token activation quantization
    - Per-tensor weight quantization + per-tensor activation quantization
    - Blockwise weight quantization + blockwise activation quantization

    It supports the following checkpoint formats:
    - FP8 checkpoint
    - FP16/BF16 checkpoint. In this case, the weights will be quantized to FP8 during the weight loading.

    Notes:
    - The activation quantization scheme can be static or dynamic. The dynamic activation quantization is more commonly used.
    - On NV platforms, the per-channel weight quantization is used by default, if block quantization is not enabled.

    Args:
        quant_config: The quantization config.
    """

    def __init__(self, quant_config: Union[Fp8Config, W4AFp8Config]):
        self.quant_config = quant_config
        self.cutlass_fp8_supported = cutlass_fp8_supported()

        # For GPUs that lack FP8 hardware support, we can leverage the Marlin
        # kernel for fast weight-only FP8 quantization
        self.use_marlin = False
        if _is_cuda:
            force_marlin = get_bool_env_var("SGLANG_FORCE_FP8_MARLIN")
            auto_enable = can_auto_enable_marlin_fp8()
            self.use_marlin = force_marlin or auto_enable

        self.use_mxfp8 = getattr(self.quant_config, "use_mxfp8", False)
        self.block_quant = (
            self.use_mxfp8 or self.quant_config.weight_block_size is not None
        )
        per_config = self.quant_config.convert_mxfp8_to_block_fp8
        self.convert_mxfp8_to_block = self.use_mxfp8 and (
            (
                _mxfp8_to_block_fp8_required
                or (_is_hip and envs.SGLANG_FORCE_MXFP8_BLOCK_CONVERT_DENSE.get())
            )
            if per_config is None
            else per_config
        )
        self.weight_block_size = self.quant_config.weight_block_size
        self.w8a8_block_fp8_linear = None
        self.w8a8_mxfp8_linear = None
        self.mxfp8_dense_backend = None
        # Set by a model-owned startup hook after opting into prefill tuning.
        self.mxfp8_prefill_autotune_min_tokens = None
        if self.use_mxfp8 and not self.convert_mxfp8_to_block:
            self.mxfp8_dense_backend = resolve_mxfp8_dense_gemm_backend()
            self.w8a8_mxfp8_linear = dispatch_w8a8_mxfp8_linear()
        else:
            # Dispatch on the block size the weight will have after loading: an
            # MXFP8 checkpoint converted to block-fp8 ends up as [128, 128].
            effective_block_size = (
                [128, 128] if self.convert_mxfp8_to_block else self.weight_block_size
            )
            self.w8a8_block_fp8_linear = dispatch_w8a8_block_fp8_linear(
                weight_block_size=effective_block_size,
                act_scale_ue8m0=isinstance(self.quant_config, Fp8Config)
                and self.quant_config.scale_fmt == "ue8m0",
            )
        # Method-wide gate; a layer that cannot take the MXFP8 view stays on the
        # block kernel (see _prepare_block_fp8_as_mxfp8).
        self.block_fp8_as_mxfp8 = not self.use_mxfp8 and can_serve_block_fp8_as_mxfp8(
            self.weight_block_size, getattr(self.quant_config, "scale_fmt", None)
        )
        if self.block_fp8_as_mxfp8:
            self.mxfp8_dense_backend = resolve_block_fp8_mxfp8_backend()
            self.w8a8_mxfp8_linear = dispatch_block_fp8_mxfp8_linear(
                self.mxfp8_dense_backend
            )
        self.is_checkpoint_fp8_serialized = (
            self.quant_config.is_checkpoint_fp8_serialized
        )
        self.use_aiter_fp8_per_token = envs.SGLANG_USE_AITER_FP8_PER_TOKEN.get()
        self.use_per_token_if_dynamic = False

    @staticmethod
    def validate_block_quant_shapes(
        layer: LinearBase,
        quant_config,
        input_size: int,
        input_size_per_partition: int,
        output_size: int,
        output_size_per_partition: int,
        output_partition_sizes: List[int],
        skip_block_quant_check: bool = False,
    ):
        block_n, block_k = (
            quant_config.weight_block_size[0],
            quant_config.weight_block_size[1],
        )

        if skip_block_quant_check:
            print_warning_once(
                "Skipping block quantization checks for weight partition."
            )
        else:
            tp_group = layer.tp_group
            tp_size = tp_group.world_size if tp_group is not None else 1
            # Required by row parallel
            if tp_size > 1 and input_size // input_size_per_partition == tp_size:
                if input_size_per_partition % block_k != 0:
                    raise ValueError(
                        f"Weight input_size_per_partition = "
                        f"{input_size_per_partition} is not divisible by "
                        f"weight quantization block_k = {block_k}."
                    )
            # Required by column parallel or enabling merged weights
            if (
                tp_size > 1 and output_size // output_size_per_partition == tp_size
            ) or len(output_partition_sizes) > 1:
                for output_partition_size in output_partition_sizes:
                    if output_partition_size % block_n != 0:
                        raise ValueError(
                            f"Weight output_partition_size = "
                            f"{output_partition_size} is not divisible by "
                            f"weight quantization block_n = {block_n}."
                        )

    @staticmethod
    def create_fp8_weight_(
        layer: torch.nn.Module,
        block_quant: bool,
        quant_config,
        use_mxfp8: bool,
        output_size_per_partition: int,
        input_size_per_partition: int,
        output_partition_sizes: List[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        weight_loader,
        is_checkpoint_fp8_serialized: bool,
        skip_block_quant_check: bool = False,
        **extra_weight_attrs,
    ):
        """
        Registers weights into `layer`. This static method can be reused by other quantization methods that require loading FP8 checkpoints first (e.g. requantization to other formats as MXFP4).
        """
        # Copy the layer attributes
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = output_size_per_partition
        layer.orig_dtype = params_dtype

        if block_quant:
            block_n, block_k = quant_config.weight_block_size
            Fp8LinearMethod.validate_block_quant_shapes(
                layer,
                quant_config,
                input_size,
                input_size_per_partition,
                output_size,
                output_size_per_partition,
                output_partition_sizes,
                skip_block_quant_check,
            )
        else:
            block_n, block_k = None, None

        # Create the weight
        weight_dtype = (
            torch.float8_e4m3fn if is_checkpoint_fp8_serialized else params_dtype
        )
        weight = ModelWeightParameter(
            data=torch.empty(
                output_size_per_partition, input_size_per_partition, dtype=weight_dtype
            ),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        layer.register_parameter("weight", weight)

        if is_checkpoint_fp8_serialized:
            if block_quant:
                if hasattr(quant_config, "activation_scheme"):
                    assert quant_config.activation_scheme == "dynamic"
                elif hasattr(quant_config, "linear_activation_scheme"):
                    assert quant_config.linear_activation_scheme == "dynamic"

                scale_dtype = torch.uint8 if use_mxfp8 else torch.float32
                scale_init = torch.zeros if scale_dtype == torch.uint8 else torch.empty
                scale = BlockQuantScaleParameter(
                    data=scale_init(
                        (output_size_per_partition + block_n - 1) // block_n,
                        (input_size_per_partition + block_k - 1) // block_k,
                        dtype=scale_dtype,
                    ),
                    input_dim=1,
                    output_dim=0,
                    weight_loader=weight_loader,
                )
                scale.format_ue8m0 = use_mxfp8
                if scale_dtype != torch.uint8:
                    scale[:] = torch.finfo(torch.float32).min
                layer.register_parameter("weight_scale_inv", scale)
            else:
                scale = PerTensorScaleParameter(
                    data=torch.empty(len(output_partition_sizes), dtype=torch.float32),
                    weight_loader=weight_loader,
                )
                scale[:] = torch.finfo(torch.float32).min
                layer.register_parameter("weight_scale", scale)

            # INPUT ACTIVATION SCALE
            if (
                hasattr(quant_config, "activation_scheme")
                and quant_config.activation_scheme == "static"
            ) or (
                hasattr(quant_config, "linear_activation_scheme")
                and quant_config.linear_activation_scheme == "static"
            ):
                scale = PerTensorScaleParameter(
                    data=torch.empty(len(output_partition_sizes), dtype=torch.float32),
                    weight_loader=weight_loader,
                )

                scale[:] = torch.finfo(torch.float32).min
                layer.register_parameter("input_scale", scale)
            else:
                layer.register_parameter("input_scale", None)

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: List[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        skip_block_quant_check: bool = False,
        **extra_weight_attrs,
    ):
        Fp8LinearMethod.create_fp8_weight_(
            layer,
            block_quant=self.block_quant,
            quant_config=self.quant_config,
            use_mxfp8=self.use_mxfp8,
            output_size_per_partition=sum(output_partition_sizes),
            input_size_per_partition=input_size_per_partition,
            output_partition_sizes=output_partition_sizes,
            weight_loader=extra_weight_attrs.get("weight_loader"),
            skip_block_quant_check=skip_block_quant_check,
            input_size=input_size,
            output_size=output_size,
            is_checkpoint_fp8_serialized=self.is_checkpoint_fp8_serialized,
            params_dtype=params_dtype,
        )

    def process_weights_after_loading_block_quant(self, layer: Module) -> None:
        use_deepgemm_runner = (
            getattr(self.w8a8_block_fp8_linear, "func", self.w8a8_block_fp8_linear)
            is deepgemm_w8a8_block_fp8_linear_with_fallback
        )
        if self.convert_mxfp8_to_block:
            from sglang.srt.layers.quantization.mxfp8_block_convert import (
                convert_mxfp8_weight_to_block_fp8,
                dequant_mxfp8_2d_to_bf16,
            )

            mx_weight, mx_scale = layer.weight.data, layer.weight_scale_inv.data
            qweight, scale = convert_mxfp8_weight_to_block_fp8(
                mx_weight, mx_scale, block=128
            )
            layer.weight = Parameter(qweight, requires_grad=False)
            if (
                _use_aiter
                and _is_gfx95_supported
                and self.w8a8_block_fp8_linear is aiter_w8a8_block_fp8_linear
            ):
                # rowwise-fp8 copy for the small-M path of aiter_w8a8_block_fp8_linear;
                # the later bpreshuffle is an in-place copy_, so these attrs survive
                weight_fp32 = dequant_mxfp8_2d_to_bf16(mx_weight, mx_scale).float()
                fp8_max = torch.finfo(torch.float8_e4m3fn).max
                row_scale = (
                    weight_fp32.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
                    / fp8_max
                )
                layer.weight._ptpc_weight = shuffle_weight(
                    (weight_fp32 / row_scale)
                    .clamp(-fp8_max, fp8_max)
                    .to(torch.float8_e4m3fn),
                    (16, 16),
                )
                layer.weight._ptpc_scale = row_scale
            layer.weight_scale_inv = Parameter(scale, requires_grad=False)
            self.use_mxfp8 = False
            self.convert_mxfp8_to_block = False
            self.weight_block_size = [128, 128]
        elif self.use_mxfp8:
            # MXFP8 (e4m3fn + UE8M0) must NOT be fnuz-normalized; check before
            # the fnuz branch since is_fp8_fnuz() is also True on gfx942.
            if not self.is_checkpoint_fp8_serialized:
                self._quantize_mxfp8_weights(layer)
                return
            # MXFP8 scales are stored as UE8M0 uint8; no requantization here.
            # Keep parameter object to preserve weight_loader attrs for hot reload.
            layer.weight_scale_inv.requires_grad_(False)
            layer.weight_scale_inv.format_ue8m0 = True
            self._process_mxfp8_linear_weight_scale(layer)
            return
        elif (
            _is_npu
            and is_npu_arch35()
            and (
                # UE8M0 checkpoints: lossless MXFP8 re-layout. Plain block-FP8
                # (fp32 scales): lossy requant, opt-in via
                # SGLANG_NPU_ARCH35_REQUANT_BLOCK_FP8=1. Otherwise the generic
                # path below keeps the checkpoint layout and numerics.
                self.quant_config.scale_fmt == "ue8m0"
                or envs.SGLANG_NPU_ARCH35_REQUANT_BLOCK_FP8.get()
            )
        ):
            from sglang.srt.hardware_backend.npu.quantization.w8a8_mxfp8 import (
                process_npu_arch35_mxfp8_linear_weights,
            )

            process_npu_arch35_mxfp8_linear_weights(
                layer,
                self.weight_block_size,
                scale_fmt=self.quant_config.scale_fmt,
            )
            return
        # If ROCm, normalize the weights and scales to e4m3fnuz
        if _is_fp8_fnuz:
            # activation_scheme: dynamic
            weight, weight_scale, _ = normalize_e4m3fn_to_e4m3fnuz(
                weight=layer.weight,
                weight_scale=layer.weight_scale_inv,
                input_scale=None,
            )
            layer.input_scale = None
        elif _is_cpu:
            assert _is_cpu_amx_available, (
                "Fp8LinearMethod on CPU requires that CPU has AMX support"
            )
            _amx_process_weight_after_loading(layer, ["weight"])
            layer.weight_scale_inv = torch.nn.Parameter(
                layer.weight_scale_inv.data, requires_grad=False
            )
            return
        else:
            # Requantize block scales to UE8M0 when DeepGEMM is the active runner.
            requant_block_scale_ue8m0_for_deepgemm(
                layer.weight,
                layer.weight_scale_inv,
                getattr(self.quant_config, "weight_block_size", None),
                use_deepgemm_runner=use_deepgemm_runner,
                output_dtype=getattr(layer, "orig_dtype", None),
                weight_shape=layer.weight.shape,
            )
            weight, weight_scale = layer.weight.data, layer.weight_scale_inv.data

        layer.weight.data = weight.data
        layer.weight_scale_inv.data = weight_scale.data
        if use_deepgemm_runner and self.weight_block_size == [32, 32]:
            from sglang.srt.layers import deep_gemm_wrapper

            if deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0:
                # UE8M0 DeepGEMM casts these fp32 scales in the kernel, which
                # holds only for powers of two; the linear keeps others on Triton.
                layer.weight_scale_inv.power_of_two = bool(
                    (torch.frexp(weight_scale)[0] == 0.5).all().item()
                )
        if hasattr(layer, "_block_fp8_bf16_weight"):
            layer._block_fp8_bf16_weight = None
            layer._derived_weight_cache_error = None
        if (
            _is_cuda
            and get_platform().is_sm90
            and envs.SGLANG_OPT_HOPPER_BLOCK_FP8_BF16.get()
            and not (
                use_deepgemm_runner
                and _deepgemm_block_fp8_supported(
                    weight.shape,
                    self.weight_block_size,
                    getattr(layer, "orig_dtype", None),
                )
            )
            and weight.is_cuda
            and weight.dtype == torch.float8_e4m3fn
            and self.weight_block_size == [32, 32]
            and getattr(self.quant_config, "scale_fmt", None) == "ue8m0"
            and getattr(layer, "orig_dtype", None) == torch.bfloat16
            and not self.use_marlin
            and not getattr(layer, "keep_plain_weight_layout", False)
        ):
            from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled
            from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

            # Keep even the smallest/largest finite E4M3 value representable
            # as normal BF16, and reject mislabeled non-power-of-two scales.
            exact_bf16_scales = (
                (weight_scale >= 2.0**-117)
                & (weight_scale <= 2.0**119)
                & (torch.frexp(weight_scale)[0] == 0.5)
            ).all()
            if not is_batch_invariant_mode_enabled() and exact_bf16_scales.item():
                # Hopper group32 FP8 accumulates each 32-wide block separately.
                # Reuse a BF16 weight expansion for larger GEMMs, keeping the
                # original FP8 weights for decode and weight reloads.
                layer.register_buffer(
                    "_block_fp8_bf16_weight",
                    block_quant_dequant(weight, weight_scale, [32, 32], torch.bfloat16),
                    persistent=False,
                )
                layer._derived_weight_cache_error = (
                    "Online weight updates are not supported while Hopper FP8 "
                    "BF16 weight caches are active: captured CUDA graphs retain "
                    "these derived weights. Restart with "
                    "SGLANG_OPT_HOPPER_BLOCK_FP8_BF16=0 to allow online updates."
                )
        if self.block_fp8_as_mxfp8:
            self._prepare_block_fp8_as_mxfp8(layer)

        # The preshuffle rewrites the weight into a layout only
        # aiter_w8a8_block_fp8_linear can read, so it is correct exactly when
        # this quant method is what consumes the weight. A layer whose weight is
        # read directly by the model (DeepSeek-V4 wo_a, whose absorb GEMM takes
        # .weight/.weight_scale_inv and runs its own batched kernel) sets
        # keep_plain_weight_layout and keeps the plain row-major layout.
        if (
            _use_aiter_bpreshuffle_gfx95
            and self.w8a8_block_fp8_linear is aiter_w8a8_block_fp8_linear
            and not getattr(layer, "keep_plain_weight_layout", False)
        ):
            n, k = layer.weight.shape
            if not use_aiter_triton_gemm_w8a8_tuned_gfx950(n, k):
                # TODO(1am9trash), to deal with case that this branch chance
                # drops as use_aiter_triton_gemm_w8a8_tuned_gfx950() expands
                t = shuffle_weight(layer.weight, (16, 16))
                layer.weight.copy_(t)
                del t
                # The shuffle is in place and preserves shape, dtype and
                # strides, so nothing downstream can tell it happened. Record
                # it so a consumer that needs the row-major layout can assert
                # instead of silently reading a permuted weight.
                layer.aiter_bpreshuffled = True
                layer.weight.is_shuffled = True
                self._maybe_prepare_dense_mxscale(layer)

        if _is_xpu:
            scale_reordered = prepare_xpu_block_scale_for_scaled_mm(
                layer.weight_scale_inv.data,
                self.weight_block_size,
                self.w8a8_block_fp8_linear,
            )
            if scale_reordered is not layer.weight_scale_inv.data:
                with torch.no_grad():
                    layer.weight_scale_inv.set_(scale_reordered)

    def _maybe_prepare_dense_mxscale(self, layer: Module) -> None:
        """SGLANG_DSV4_DENSE_MXSCALE: give a (16, 16)-preshuffled 128x128 block-fp8
        weight an e8m0 copy of its scale, which routes aiter_w8a8_block_fp8_linear
        onto aiter's mxscale bpreshuffle GEMM. Lossless only for power-of-two
        scales (ue8m0 checkpoints); any other layer stays on the fp32 GEMM. The
        weight bytes are shared, the copy costs N*K/16384 bytes."""
        if self.weight_block_size != [128, 128] or self.convert_mxfp8_to_block:
            return
        if layer.weight.dtype != torch.float8_e4m3fn:
            return
        n, k = layer.weight.shape
        if not dense_mxscale_wanted(n, k):
            return
        scale = layer.weight_scale_inv.data
        if tuple(scale.shape) != (n // 128, k // 128) or n % 128 or k % 128:
            return
        e8m0 = block_fp8_scale_to_e8m0_128(scale)
        if e8m0 is None:
            logger.warning(
                "Dense mxscale: %s keeps the fp32 GEMM (scales are not powers of two)",
                getattr(layer, "prefix", tuple(layer.weight.shape)),
            )
            return
        layer.weight._mxscale_w_scale = e8m0
        if (n, k) not in _DENSE_MXSCALE_LOGGED:
            _DENSE_MXSCALE_LOGGED.add((n, k))
            logger.info(
                "Dense mxscale (e8m0 bpreshuffle GEMM) enabled for N=%d K=%d", n, k
            )

    def _prepare_block_fp8_as_mxfp8(self, layer: Module) -> None:
        layer.block_fp8_mxfp8_ready = False
        if getattr(layer, "keep_plain_weight_layout", False):
            # The model reads .weight / .weight_scale_inv directly.
            return
        n, k = layer.weight.shape
        if k % 32 != 0:
            return
        try:
            scale_u8 = block_fp8_scale_to_mxfp8_e8m0(
                layer.weight_scale_inv.data, (n, k), self.weight_block_size
            )
        except ValueError as e:
            logger.warning("Block-fp8 layer stays on the Triton kernel: %s", e)
            return
        # weight_scale_inv stays in place for the Triton fallback and raw readers;
        # the swizzled copy is stored separately.
        self._process_mxfp8_linear_weight_scale(layer, scale_u8=scale_u8)
        layer.block_fp8_mxfp8_ready = True

    def prepare_deepgemm_mxfp8_input(self, layer: Module) -> bool:
        """Pack the weight scale a FlashInfer layer needs for a DeepGEMM-packed input pair."""
        from sglang.srt.layers import deep_gemm_wrapper

        backend = self.mxfp8_dense_backend
        if not (
            _is_cuda
            and get_platform().is_blackwell
            and backend is not None
            and (backend.is_flashinfer_cutedsl() or backend.is_flashinfer_cutlass())
            and deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM
            and deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0
        ):
            return False
        n, k = layer.weight.shape
        if n % 64 != 0 or k % 128 != 0:
            return False
        if self.use_mxfp8:
            scale_u8 = layer.weight_scale_inv.data.view(torch.uint8).reshape(n, k // 32)
        elif self.block_fp8_as_mxfp8 and layer.block_fp8_mxfp8_ready:
            scale_u8 = block_fp8_scale_to_mxfp8_e8m0(
                layer.weight_scale_inv.data, (n, k), self.weight_block_size
            )
        else:
            return False
        copy_or_rebind_param(
            layer,
            "weight_scale_inv_deepgemm",
            pack_mxfp8_weight_scale_for_deepgemm(scale_u8, n, k),
        )
        return True

    def _process_mxfp8_linear_weight_scale(
        self, layer: Module, scale_u8: Optional[torch.Tensor] = None
    ) -> None:
        if not (self.use_mxfp8 or scale_u8 is not None):
            return

        backend = self.mxfp8_dense_backend
        if backend.is_flashinfer_trtllm():
            from flashinfer import shuffle_matrix_a, shuffle_matrix_sf_a

            weight = layer.weight.data
            if scale_u8 is None:
                scale_u8 = layer.weight_scale_inv.data
            n, k = weight.shape
            epilogue_tile_m = 128
            sf_cols = k // 32

            scale_u8 = scale_u8.contiguous().view(torch.uint8).reshape(n, sf_cols)
            padded_n = ((n + epilogue_tile_m - 1) // epilogue_tile_m) * (
                epilogue_tile_m
            )
            pad_rows = padded_n - n

            if pad_rows:
                scale_u8 = F.pad(
                    scale_u8,
                    (0, 0, 0, pad_rows),
                    mode="constant",
                    value=0,
                )

            copy_or_rebind_param(
                layer,
                "weight",
                shuffle_matrix_a(
                    weight.contiguous().view(torch.uint8), epilogue_tile_m
                ).view(torch.float8_e4m3fn),
            )
            copy_or_rebind_param(
                layer,
                "weight_scale_inv_shuffled",
                shuffle_matrix_sf_a(
                    scale_u8,
                    epilogue_tile_m,
                    num_elts_per_sf=32,
                )
                .reshape_as(scale_u8)
                .contiguous(),
            )
        elif backend.is_flashinfer_cutlass() or backend.is_flashinfer_cutedsl():
            from flashinfer import block_scale_interleave

            if scale_u8 is None:
                scale_u8 = layer.weight_scale_inv.data
            # block_scale_interleave may pad and/or reshape scales,
            # so store swizzled scales separately to keep weight update working
            copy_or_rebind_param(
                layer,
                "weight_scale_inv_swizzled",
                block_scale_interleave(scale_u8.contiguous()).contiguous(),
            )
        elif backend.is_gfx95():
            fp8_hip.process_dense_weights(self, layer, scale_u8)
        elif backend.is_deep_gemm():
            from sglang.srt.layers.deep_gemm_wrapper.configurer import (
                DEEPGEMM_SCALE_UE8M0,
            )

            n, k = layer.weight.shape
            if scale_u8 is None:
                scale_u8 = layer.weight_scale_inv.data
            layer.weight_scale_inv_swizzled = None
            if n % 64 != 0 or k % 128 != 0:
                if not (get_platform().is_blackwell and is_flashinfer_available()):
                    raise RuntimeError(
                        f"--fp8-gemm-backend=deep_gemm cannot serve MXFP8 weight shape "
                        f"({n}, {k}) (needs N % 64 == 0 and K % 128 == 0), and this "
                        "device has no FlashInfer MXFP8 fallback kernel."
                    )
                from flashinfer import block_scale_interleave

                copy_or_rebind_param(
                    layer,
                    "weight_scale_inv_swizzled",
                    block_scale_interleave(scale_u8.contiguous()).contiguous(),
                )
            if DEEPGEMM_SCALE_UE8M0:
                # Pre-packed; GEMM must be called with disable_ue8m0_cast=True.
                scale_packed = pack_mxfp8_weight_scale_for_deepgemm(scale_u8, n, k)
            else:
                scale_packed = (
                    (scale_u8.contiguous().view(-1).to(torch.int32) << 23)
                    .view(torch.float32)
                    .view(n, k // 32)
                )
            copy_or_rebind_param(layer, "weight_scale_inv_deepgemm", scale_packed)

    def _quantize_mxfp8_weights(self, layer: Module) -> None:
        weight = layer.weight.data
        qweight, weight_scale = mxfp8_group_quantize(weight)
        # Keep parameter objects to preserve weight_loader attrs for hot reload.
        layer.weight.data = qweight
        layer.weight.requires_grad_(False)
        if hasattr(layer, "weight_scale_inv") and layer.weight_scale_inv is not None:
            layer.weight_scale_inv.data = weight_scale
            layer.weight_scale_inv.requires_grad_(False)
        else:
            # First-time online MXFP8 quantization (no serialized scales).
            layer.register_parameter(
                "weight_scale_inv", Parameter(weight_scale, requires_grad=False)
            )
        layer.weight_scale_inv.format_ue8m0 = True
        self._process_mxfp8_linear_weight_scale(layer)
        layer.input_scale = None

    def process_weights_after_loading(self, layer: Module) -> None:
        if self.block_quant:
            self.process_weights_after_loading_block_quant(layer)
            if layer.deepgemm_mxfp8_input:
                layer.deepgemm_mxfp8_input = self.prepare_deepgemm_mxfp8_input(layer)
        else:
            layer.weight = Parameter(layer.weight.data, requires_grad=False)

            # If checkpoint not serialized fp8, quantize the weights.
            if not self.is_checkpoint_fp8_serialized:
                if (
                    self.cutlass_fp8_supported
                    or _is_xpu
                    or self.use_marlin
                    or (_use_aiter and self.use_aiter_fp8_per_token)
                ):
                    # apply per-channel quantization default as
                    # cutlass sgl-kernel and marlin only support per-channel scale
                    qweight, weight_scale = per_token_group_quant_fp8(
                        layer.weight, layer.weight.shape[-1]
                    )
                    weight_scale = weight_scale.t().contiguous()
                    if _use_aiter and self.use_aiter_fp8_per_token:
                        self.use_per_token_if_dynamic = True
                        if use_aiter_bpreshuffle_gemm(qweight.shape[0]):
                            qweight = shuffle_weight(qweight.contiguous(), (16, 16))
                else:
                    # per-tensor quantization
                    qweight, weight_scale = input_to_float8(layer.weight)

                # Update the layer with the new values.
                layer.weight = Parameter(qweight.t(), requires_grad=False)
                layer.weight_scale = Parameter(weight_scale, requires_grad=False)
                layer.input_scale = None

            # If checkpoint is fp8, handle that there are N scales for N
            # shards in a fused module
            else:
                layer.weight_scale = Parameter(
                    layer.weight_scale.data, requires_grad=False
                )
                if (
                    hasattr(self.quant_config, "activation_scheme")
                    and self.quant_config.activation_scheme == "static"
                ) or (
                    hasattr(self.quant_config, "linear_activation_scheme")
                    and self.quant_config.linear_activation_scheme == "static"
                ):
                    layer.input_scale = Parameter(
                        layer.input_scale.data, requires_grad=False
                    )

                # On SM120 (Blackwell RTX 50) the per-tensor FP8 path dispatches
                # to the fast cudnn/nvjet SM120 kernel, which beats the
                # channelwise cutlass GemmUniversal by ~1.2-2.7x across the
                # decode/prefill M range (matches vLLM's per-tensor SM120
                # choice). Requantize per-channel -> per-tensor (max scale)
                # there instead.
                use_sm120_fp8_pertensor = (
                    self.cutlass_fp8_supported
                    and not self.use_marlin
                    and get_device_capability()[0] == 12
                )
                # cutlass sgl-kernel and marlin only support per-channel scale; aiter supports per-channel scale
                if (
                    (self.cutlass_fp8_supported and not use_sm120_fp8_pertensor)
                    or _is_xpu
                    or self.use_marlin
                    or (_use_aiter and self.use_aiter_fp8_per_token)
                ):
                    weight = layer.weight
                    weight_scale = convert_to_channelwise(
                        layer.weight_scale, layer.logical_widths
                    )
                    if _use_aiter and self.use_aiter_fp8_per_token:
                        # Otherwise, by default, aiter only uses per-tensor quantization
                        self.use_per_token_if_dynamic = True
                        # This path quantizes activations dynamically per token, which
                        # is incompatible with a static per-tensor input_scale. Drop it
                        # so apply_fp8_linear (and the fused RMSNorm+quant path) compute
                        # the activation scale per token instead of reusing a stale one.
                        layer.input_scale = None
                        if _is_fp8_fnuz:
                            weight, weight_scale, _ = normalize_e4m3fn_to_e4m3fnuz(
                                weight=weight,
                                weight_scale=weight_scale,
                            )
                        if use_aiter_bpreshuffle_gemm(weight.shape[0]):
                            weight = shuffle_weight(weight.contiguous(), (16, 16))
                else:
                    # Dequant -> Quant with max scale so we can run per tensor.
                    weight = layer.weight
                    weight_scale = layer.weight_scale
                    # If ROCm, normalize the weights and scales to e4m3fnuz
                    if _is_fp8_fnuz:
                        weight, weight_scale, input_scale = (
                            normalize_e4m3fn_to_e4m3fnuz(
                                weight=weight,
                                weight_scale=weight_scale,
                                input_scale=layer.input_scale,
                            )
                        )
                        if input_scale is not None:
                            layer.input_scale = Parameter(
                                input_scale, requires_grad=False
                            )

                    weight_scale, weight = requantize_with_max_scale(
                        weight=weight,
                        weight_scale=weight_scale,
                        logical_widths=layer.logical_widths,
                    )

                # Update layer with new values.
                layer.weight = Parameter(weight.t(), requires_grad=False)
                layer.weight_scale = Parameter(weight_scale, requires_grad=False)
                # input_scale is None when the per-token path above dropped it.
                if (
                    (
                        hasattr(self.quant_config, "activation_scheme")
                        and self.quant_config.activation_scheme == "static"
                    )
                    or (
                        hasattr(self.quant_config, "linear_activation_scheme")
                        and self.quant_config.linear_activation_scheme == "static"
                    )
                ) and layer.input_scale is not None:
                    layer.input_scale = Parameter(
                        layer.input_scale.max(), requires_grad=False
                    )

            if _is_xpu:
                # A scale is row-wise iff it carries exactly one value per
                # output channel, regardless of shape ([N], [1, N], [N, 1], ...).
                num_channels = sum(layer.logical_widths)
                is_rowwise = layer.weight_scale.numel() == num_channels
                if is_rowwise and (
                    layer.weight_scale.shape != (num_channels, 1)
                    or not layer.weight_scale.t().is_contiguous()
                ):
                    with torch.no_grad():
                        layer.weight_scale.set_(
                            layer.weight_scale.data.reshape(
                                num_channels, 1
                            ).contiguous()
                        )
                self.use_per_token_if_dynamic = is_rowwise

            if _is_cpu:
                assert _is_cpu_amx_available, (
                    "Fp8LinearMethod on CPU requires that CPU has AMX support"
                )
                layer.weight = Parameter(
                    layer.weight.data.t().contiguous(), requires_grad=False
                )
                _amx_process_weight_after_loading(layer, ["weight"])
                return

        if self.use_marlin:
            if self.block_quant:
                layer.weight_block_size = self.quant_config.weight_block_size
            prepare_fp8_layer_for_marlin(layer, not self.block_quant)
            # Activations not quantized for marlin.
            del layer.input_scale

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if self.use_marlin:
            return torch.ops.sglang.apply_fp8_marlin_linear(
                input=x,
                weight=layer.weight,
                weight_scale=layer.weight_scale,
                workspace=layer.workspace,
                size_n=layer.output_size_per_partition,
                size_k=layer.input_size_per_partition,
                bias=bias,
            )

        if _is_hip and self.block_fp8_as_mxfp8 and self.mxfp8_dense_backend.is_gfx95():
            return fp8_hip.apply_dense(self, layer, x, bias)

        mxfp8_view = self.use_mxfp8 or (
            self.block_fp8_as_mxfp8 and layer.block_fp8_mxfp8_ready
        )
        if isinstance(x, Mxfp8SwizzledInput):
            if not mxfp8_view or not (
                self.mxfp8_dense_backend.is_flashinfer_cutlass()
                or self.mxfp8_dense_backend.is_flashinfer_cutedsl()
            ):
                raise ValueError(
                    "Mxfp8SwizzledInput needs a layer with an MXFP8 view on a "
                    "FlashInfer CUTLASS / CuTe-DSL backend"
                )
        elif (
            mxfp8_view
            and isinstance(x, tuple)
            and x[1].dtype == torch.int32
            and not self.mxfp8_dense_backend.is_deep_gemm()
        ):
            # DeepGEMM-packed activation scales; see LinearBase.deepgemm_mxfp8_input.
            return deepgemm_w8a8_mxfp8_linear_with_fallback(
                x[0],
                layer.weight,
                layer.weight_scale_inv_deepgemm,
                input_scale=x[1],
                bias=bias,
            )
        elif self.block_fp8_as_mxfp8 and isinstance(x, tuple):
            # A legacy (q, scale) block-fp8 pair keeps the block kernel.
            mxfp8_view = False
        if mxfp8_view:
            backend = self.mxfp8_dense_backend
            extra_kwargs = {}
            if self.mxfp8_prefill_autotune_min_tokens is not None:
                input_tensor = x[0] if isinstance(x, tuple) else x
                num_tokens = input_tensor.numel() // input_tensor.shape[-1]
                if num_tokens >= self.mxfp8_prefill_autotune_min_tokens:
                    from sglang.srt.batch_invariant_ops import (
                        is_batch_invariant_mode_enabled,
                    )
                    from sglang.srt.runtime_context import get_exec

                    extra_kwargs["pin_tactic"] = (
                        is_batch_invariant_mode_enabled()
                        or get_exec().deterministic.enable_deterministic_inference
                    )
            if backend.is_flashinfer_cutlass() or backend.is_flashinfer_cutedsl():
                weight_scale = layer.weight_scale_inv_swizzled
            elif backend.is_flashinfer_trtllm():
                weight_scale = layer.weight_scale_inv_shuffled
            elif backend.is_deep_gemm():
                weight_scale = layer.weight_scale_inv_deepgemm
                extra_kwargs["weight_scale_swizzled"] = layer.weight_scale_inv_swizzled
            else:
                weight_scale = layer.weight_scale_inv
            if isinstance(x, tuple):
                return self.w8a8_mxfp8_linear(
                    input=x[0],
                    weight=layer.weight,
                    weight_scale=weight_scale,
                    input_scale=x[1],
                    bias=bias,
                    **extra_kwargs,
                )
            out = self.w8a8_mxfp8_linear(
                input=x,
                weight=layer.weight,
                weight_scale=weight_scale,
                input_scale=None,
                bias=bias,
                **extra_kwargs,
            )
            return out

        if self.block_quant:
            if use_intel_amx_backend(layer):
                return torch.ops.sgl_kernel.fp8_scaled_mm_cpu(
                    x,
                    layer.weight,
                    layer.weight_scale_inv,
                    self.weight_block_size,
                    bias,
                    x.dtype,
                    True,  # is_vnni
                )

            cached_weight = getattr(layer, "_block_fp8_bf16_weight", None)
            extra_kwargs = (
                {"weight_bf16": cached_weight} if cached_weight is not None else {}
            )
            if isinstance(x, tuple):
                return self.w8a8_block_fp8_linear(
                    input=x[0],
                    weight=layer.weight,
                    block_size=self.weight_block_size,
                    weight_scale=layer.weight_scale_inv,
                    input_scale=x[1],
                    bias=bias,
                    **extra_kwargs,
                )

            return self.w8a8_block_fp8_linear(
                input=x,
                weight=layer.weight,
                block_size=self.weight_block_size,
                weight_scale=layer.weight_scale_inv,
                input_scale=None,
                bias=bias,
                **extra_kwargs,
            )

        if use_intel_amx_backend(layer):
            output = torch.ops.sgl_kernel.fp8_per_tensor_scaled_mm_cpu(
                x,
                layer.weight,
                layer.weight_scale,
                bias,
                x.dtype,
                True,  # is_vnni
            )
            return output.view(*x.shape[:-1], layer.weight.shape[0])

        if isinstance(x, tuple):
            # Pre-quantized activation from a fused RMSNorm+FP8 quant kernel:
            # x = (fp8_input, per_tensor_input_scale[, orig_dtype]).
            # apply_fp8_linear detects the fp8 dtype and skips re-quantizing;
            # orig_dtype (when present) sets the GEMM output dtype.
            qx, x_scale = x[0], x[1]
            out_dtype = x[2] if len(x) > 2 else None
            return apply_fp8_linear(
                input=qx,
                weight=layer.weight,
                weight_scale=layer.weight_scale,
                input_scale=x_scale,
                bias=bias,
                cutlass_fp8_supported=self.cutlass_fp8_supported,
                use_per_token_if_dynamic=self.use_per_token_if_dynamic,
                pre_quant_output_dtype=out_dtype,
            )

        return apply_fp8_linear(
            input=x,
            weight=layer.weight,
            weight_scale=layer.weight_scale,
            input_scale=layer.input_scale,
            bias=bias,
            cutlass_fp8_supported=self.cutlass_fp8_supported,
            use_per_token_if_dynamic=self.use_per_token_if_dynamic,
        )


class Fp8MoEMethod(FusedMoEMethodBase):
    """MoE method for FP8.
    Supports loading FP8 checkpoints with static weight scale and
    dynamic/static activation scale.

    Also supports loading quantized FP16/BF16 model checkpoints with dynamic
    activation scaling. The weight scaling factor will be initialized after
    the model weights are loaded.

    Args:
        quant_config: The quantization config.
    """

    def __init__(self, quant_config: Fp8Config):
        self.quant_config = quant_config
        self.use_mxfp8 = getattr(self.quant_config, "use_mxfp8", False)
        self.block_quant = (
            self.use_mxfp8 or self.quant_config.weight_block_size is not None
        )
        per_config = self.quant_config.convert_mxfp8_to_block_fp8
        self.convert_mxfp8_to_block = self.use_mxfp8 and (
            _mxfp8_to_block_fp8_required if per_config is None else per_config
        )
        self.weight_block_size = self.quant_config.weight_block_size
        self.is_fp4_expert = self.quant_config.is_fp4_experts
        self.dequant_fp4_to_fp8 = self.quant_config.dequant_fp4_to_fp8
        self.with_bias = False
        # The MxFP4 wrapper methods borrow this instance for weight loading;
        # they never call create_moe_runner, so moe_runner_config is unset.
        self._owns_moe_runner = False
        self._moe_runner_backend = None
        if get_moe_runner_backend().is_cutlass():
            assert cutlass_fp8_supported(), (
                "cutlass_fp8 MoE requires CUDA 12.0+ with SM90 or CUDA 12.4+ with SM89"
            )
            assert self.block_quant, "cutlass_fp8 MoE requires block quantization"
            assert (
                get_platform().is_sm100
                or get_platform().is_sm90
                or get_platform().is_sm120
            ), "cutlass_fp8 MoE requires SM90, SM100, or SM120 GPUs"

    @staticmethod
    def is_deepgemm_moe_runner_backend_enabled(
        moe_runner_backend=None, moe_a2a_backend=None
    ) -> bool:
        """Check if MoE will actually use DeepGEMM runner for FP8."""
        from sglang.srt.layers.moe.utils import get_moe_a2a_backend

        if moe_runner_backend is None:
            moe_runner_backend = get_moe_runner_backend()
        if moe_runner_backend.is_deep_gemm():
            return True
        if moe_runner_backend.is_auto():
            if moe_a2a_backend is None:
                moe_a2a_backend = get_moe_a2a_backend()
            if not (
                moe_a2a_backend.is_deepep()
                or moe_a2a_backend.is_mooncake()
                or moe_a2a_backend.is_nixl()
            ):
                return False
            from sglang.srt.layers import deep_gemm_wrapper

            return deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM
        return False

    @staticmethod
    def create_fp8_moe_weight_(
        layer: Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        block_quant: bool,
        quant_config,
        use_mxfp8: bool,
        is_checkpoint_fp8_serialized: bool,
        is_fp4_expert: bool,
        params_dtype: torch.dtype,
        with_bias: bool = False,
        fp4_scale_dtype: Optional[torch.dtype] = None,
        **extra_weight_attrs,
    ):
        """
        Registers weights into `layer`. This static method can be reused by other quantization methods that require loading FP8 checkpoints first (e.g. requantization to other formats as MXFP4).
        """
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoeWeightScaleSupported

        if is_checkpoint_fp8_serialized:
            params_dtype = torch.uint32 if _use_hip_int4 else torch.float8_e4m3fn

        tp_size = layer.moe_tp_size
        w13_num_shards = 2 if layer.moe_runner_config.is_gated else 1

        w13_up_dim, w2_up_dim, weight_padded = get_moe_weight_sizes(
            intermediate_size_per_partition,
            is_aiter_moe=_use_aiter,
            is_concat=layer.moe_runner_config.is_gated,
            is_packed=False,
        )

        if block_quant:
            block_n, block_k = (
                quant_config.weight_block_size[0],
                quant_config.weight_block_size[1],
            )

            padding_size = get_moe_padding_size(_use_aiter)
            if not (_use_aiter and padding_size == block_n == block_k):
                # NOTE(HandH1998): To ensure proper alignment of the block-wise quantization scales, the output_size of the weights for both the gate and up layers must be divisible by block_n.
                # Required by column parallel or enabling merged weights
                if intermediate_size_per_partition % block_n != 0:
                    raise ValueError(
                        f"The output_size of gate's and up's weight = "
                        f"{intermediate_size_per_partition} is not divisible by "
                        f"weight quantization block_n = {block_n}."
                    )
                if tp_size > 1:
                    # Required by row parallel
                    if intermediate_size_per_partition % block_k != 0:
                        raise ValueError(
                            f"The input_size of down's weight = "
                            f"{intermediate_size_per_partition} is not divisible by "
                            f"weight quantization block_k = {block_k}."
                        )

        # WEIGHTS
        if is_fp4_expert:
            w13_weight = torch.nn.Parameter(
                torch.empty(
                    num_experts,
                    w13_num_shards * intermediate_size_per_partition,
                    hidden_size // 2,
                    dtype=torch.int8,
                ),
                requires_grad=False,
            )
            w2_weight = torch.nn.Parameter(
                torch.empty(
                    num_experts,
                    hidden_size,
                    intermediate_size_per_partition // 2,
                    dtype=torch.int8,
                ),
                requires_grad=False,
            )
        elif _is_hip and _use_hip_int4:
            # INT4 MoE weight - INT32 packed
            w13_weight = torch.nn.Parameter(
                torch.empty(
                    num_experts,
                    w13_num_shards * intermediate_size_per_partition,
                    hidden_size // 8,
                    dtype=params_dtype,
                ),
                requires_grad=False,
            )
            w2_weight = torch.nn.Parameter(
                torch.empty(
                    num_experts,
                    hidden_size,
                    intermediate_size_per_partition // 8,
                    dtype=params_dtype,
                ),
                requires_grad=False,
            )
        else:
            w13_weight = torch.nn.Parameter(
                torch.empty(
                    num_experts,
                    w13_up_dim,
                    hidden_size,
                    dtype=params_dtype,
                ),
                requires_grad=False,
            )
            w2_weight = torch.nn.Parameter(
                torch.empty(
                    num_experts,
                    hidden_size,
                    w2_up_dim,
                    dtype=params_dtype,
                ),
                requires_grad=False,
            )

        extra_weight_attrs.update(
            {"weight_padded": weight_padded},
        )

        layer.register_parameter("w13_weight", w13_weight)
        set_weight_attrs(w13_weight, extra_weight_attrs)

        layer.register_parameter("w2_weight", w2_weight)
        set_weight_attrs(w2_weight, extra_weight_attrs)

        # BIAS (optional, e.g. GPT-OSS)
        if with_bias:
            w13_weight_bias = torch.nn.Parameter(
                torch.empty(
                    num_experts,
                    w13_num_shards * intermediate_size_per_partition,
                    dtype=torch.float32,
                ),
                requires_grad=False,
            )
            layer.register_parameter("w13_weight_bias", w13_weight_bias)
            set_weight_attrs(w13_weight_bias, extra_weight_attrs)

            w2_weight_bias = torch.nn.Parameter(
                torch.empty(num_experts, hidden_size, dtype=torch.float32),
                requires_grad=False,
            )
            layer.register_parameter("w2_weight_bias", w2_weight_bias)
            set_weight_attrs(w2_weight_bias, extra_weight_attrs)

        # WEIGHT_SCALES
        if is_fp4_expert:
            fp4_block_k = 32
            if fp4_scale_dtype is None:
                fp4_scale_dtype = (
                    torch.float8_e8m0fnu if _use_aiter or is_xpu() else torch.float32
                )
            w13_weight_scale = torch.nn.Parameter(
                torch.ones(
                    num_experts,
                    w13_num_shards * intermediate_size_per_partition,
                    hidden_size // fp4_block_k,
                    dtype=fp4_scale_dtype,
                ),
                requires_grad=False,
            )
            w2_weight_scale = torch.nn.Parameter(
                torch.ones(
                    num_experts,
                    hidden_size,
                    intermediate_size_per_partition // fp4_block_k,
                    dtype=fp4_scale_dtype,
                ),
                requires_grad=False,
            )
            layer.register_parameter("w13_weight_scale_inv", w13_weight_scale)
            layer.register_parameter("w2_weight_scale_inv", w2_weight_scale)
        elif block_quant:
            scale_dtype = torch.uint8 if use_mxfp8 else torch.float32
            scale_init = torch.zeros if scale_dtype == torch.uint8 else torch.ones
            w13_weight_scale = torch.nn.Parameter(
                scale_init(
                    num_experts,
                    w13_num_shards
                    * ((intermediate_size_per_partition + block_n - 1) // block_n),
                    (hidden_size + block_k - 1) // block_k,
                    dtype=scale_dtype,
                ),
                requires_grad=False,
            )
            w2_weight_scale = torch.nn.Parameter(
                scale_init(
                    num_experts,
                    (hidden_size + block_n - 1) // block_n,
                    (intermediate_size_per_partition + block_k - 1) // block_k,
                    dtype=scale_dtype,
                ),
                requires_grad=False,
            )
            # w13_weight and w2_weight are always requanted together
            w13_weight_scale.format_ue8m0 = use_mxfp8
            w2_weight_scale.format_ue8m0 = use_mxfp8
            layer.register_parameter("w13_weight_scale_inv", w13_weight_scale)
            layer.register_parameter("w2_weight_scale_inv", w2_weight_scale)

            assert quant_config.activation_scheme == "dynamic"

        else:
            # One scale per w13 shard; a gated layer combines its two into a
            # single scale after weight loading.
            w13_weight_scale = torch.nn.Parameter(
                torch.ones(num_experts, w13_num_shards, dtype=torch.float32),
                requires_grad=False,
            )
            w2_weight_scale = torch.nn.Parameter(
                torch.ones(num_experts, dtype=torch.float32), requires_grad=False
            )
            layer.register_parameter("w13_weight_scale", w13_weight_scale)
            layer.register_parameter("w2_weight_scale", w2_weight_scale)

            if _is_hip:  # _use_aiter: TODO: add check back after triton kernel
                # ROCm - using column scaling, duplicate scaling numbers in case per tensor scaling
                w13_weight_scale1 = torch.nn.Parameter(
                    torch.ones(
                        num_experts,
                        w13_num_shards * intermediate_size_per_partition,
                        dtype=torch.float32,
                    ),
                    requires_grad=False,
                )
                w2_weight_scale1 = torch.nn.Parameter(
                    torch.ones(num_experts, hidden_size, dtype=torch.float32),
                    requires_grad=False,
                )
                layer.register_parameter("w13_weight_scale1", w13_weight_scale1)
                layer.register_parameter("w2_weight_scale1", w2_weight_scale1)

        # Add the quantization method used (per tensor/grouped/channel)
        # to ensure the weight scales are loaded in properly
        extra_weight_attrs.update(
            {"quant_method": FusedMoeWeightScaleSupported.BLOCK.value}
            if block_quant
            else {"quant_method": FusedMoeWeightScaleSupported.TENSOR.value}
        )

        # If loading fp8 checkpoint, pass the weight loaders.
        # If loading an fp16 checkpoint, do not (we will quantize in
        #   process_weights_after_loading()
        if quant_config.is_checkpoint_fp8_serialized:
            set_weight_attrs(w13_weight_scale, extra_weight_attrs)
            set_weight_attrs(w2_weight_scale, extra_weight_attrs)

            if _is_hip and _use_hip_int4:
                extra_weight_attrs.update(
                    {"quant_method": FusedMoeWeightScaleSupported.CHANNEL.value}
                )
                set_weight_attrs(w13_weight_scale1, extra_weight_attrs)
                set_weight_attrs(w2_weight_scale1, extra_weight_attrs)

        # INPUT_SCALES
        if quant_config.activation_scheme == "static":
            if not quant_config.is_checkpoint_fp8_serialized:
                raise ValueError(
                    "Found static activation scheme for checkpoint that "
                    "was not serialized fp8."
                )

            w13_input_scale = torch.nn.Parameter(
                torch.ones(num_experts, dtype=torch.float32), requires_grad=False
            )
            layer.register_parameter("w13_input_scale", w13_input_scale)
            set_weight_attrs(w13_input_scale, extra_weight_attrs)

            w2_input_scale = torch.nn.Parameter(
                torch.ones(num_experts, dtype=torch.float32), requires_grad=False
            )
            layer.register_parameter("w2_input_scale", w2_input_scale)
            set_weight_attrs(w2_input_scale, extra_weight_attrs)

        else:
            layer.w13_input_scale = None
            layer.w2_input_scale = None

    def create_weights(
        self,
        layer: Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        with_bias: bool = False,
        **extra_weight_attrs,
    ):
        Fp8MoEMethod.create_fp8_moe_weight_(
            layer=layer,
            num_experts=num_experts,
            hidden_size=hidden_size,
            intermediate_size_per_partition=intermediate_size_per_partition,
            block_quant=self.block_quant,
            quant_config=self.quant_config,
            use_mxfp8=self.use_mxfp8,
            is_checkpoint_fp8_serialized=self.quant_config.is_checkpoint_fp8_serialized,
            is_fp4_expert=self.is_fp4_expert,
            params_dtype=params_dtype,
            with_bias=with_bias,
            **extra_weight_attrs,
        )

        if (
            not self.is_fp4_expert
            and self.block_quant
            and get_moe_runner_backend().is_cutlass()
        ):
            self._ensure_cutlass_buffers_initialized(layer)

    def _dequantize_aiter_fp4_experts(self, layer: Module) -> None:
        """Convert packed FP4 expert weights to block-FP8 in place."""
        for weight_param, scale_param in [
            (layer.w13_weight, layer.w13_weight_scale_inv),
            (layer.w2_weight, layer.w2_weight_scale_inv),
        ]:
            num_experts = weight_param.shape[0]
            new_weights = []
            new_scales = []
            for e in range(num_experts):
                w, s = cast_e2m1fn_to_e4m3fn(weight_param.data[e], scale_param.data[e])
                new_weights.append(w)
                new_scales.append(s)
            weight_param.data = torch.stack(new_weights)
            scale_param.data = torch.stack(new_scales).float()
            scale_param.format_ue8m0 = False
        self.is_fp4_expert = False
        logger.warning_once("Dequantized FP4 MoE expert weights to FP8.")

    def process_weights_after_loading_block_quant(self, layer: Module) -> None:
        if _use_aiter and self.is_fp4_expert:
            # aiter MegaMoEv2 builds from the packed FP4 layout, so it has to
            # claim the experts before the native-MXFP4 and dequant arms.
            if (
                get_moe_a2a_backend().is_megamoe()
                and envs.SGLANG_AMD_USE_FLYDSL_MEGA_MOE.get()
            ):
                if self.dequant_fp4_to_fp8:
                    raise ValueError(
                        "SGLANG_DSV4_FP4_DEQUANT strips the packed FP4 layout that "
                        "aiter MegaMoEv2 builds from; unset it, or pick another "
                        "--moe-a2a-backend."
                    )
                from sglang.srt.layers.moe.mega_moe import (
                    build_mega_moe_experts_weights,
                )

                fp4_weight_dtype = _require_fp4_dtype()
                layer.w13_weight.data = layer.w13_weight.data.view(fp4_weight_dtype)
                layer.w2_weight.data = layer.w2_weight.data.view(fp4_weight_dtype)
                build_mega_moe_experts_weights(layer)
                return

            # AMD FP4 experts: use aiter's native MXFP4 MoE path.
            elif not self.dequant_fp4_to_fp8:
                gu_intv = envs.SGLANG_USE_AITER_MOE_GU_ITLV.get()
                fp4_weight_dtype = _require_fp4_dtype()

                # DeepSeek V4 MoE is implemented by the FlyDSL kernel, which supports
                # tile_k=128, so we only need to pad dim to 128. This lets DeepSeek-V4-Pro
                # at TP8 skip padding 384 -> 512, reducing routed-expert memory by ~25%.
                # shuffle_scale also supports non-256 shapes since aiter PR#4130.
                fp4_k_align = 128
                E, w13_N, w13_K_packed = layer.w13_weight.shape
                _, w2_N, w2_K_packed = layer.w2_weight.shape
                inter_per_part = w13_N // 2
                padded_inter = (
                    (inter_per_part + fp4_k_align - 1) // fp4_k_align * fp4_k_align
                )
                # Record the padding so fused_moe is told the real intermediate size
                # (aiter fused_moe needs intermediate_pad = padded - real; ATOM passes
                # 128, SGLang previously defaulted to 0 -> computed the padded region).
                layer.intermediate_pad = padded_inter - inter_per_part
                layer.hidden_pad = 0
                if padded_inter != inter_per_part:
                    pad_amount = padded_inter - inter_per_part
                    fp4_block_k = 32

                    # Pad w13_weight: (E, 2*inter, K_packed) → (E, 2*padded, K_packed)
                    old_w13 = layer.w13_weight.data
                    new_w13 = torch.zeros(
                        E,
                        2 * padded_inter,
                        w13_K_packed,
                        dtype=old_w13.dtype,
                        device=old_w13.device,
                    )
                    new_w13[:, :inter_per_part, :] = old_w13[:, :inter_per_part, :]
                    new_w13[:, padded_inter : padded_inter + inter_per_part, :] = (
                        old_w13[:, inter_per_part:, :]
                    )
                    layer.w13_weight = torch.nn.Parameter(new_w13, requires_grad=False)

                    # Pad w2_weight: (E, N, inter_packed) → (E, N, padded_packed)
                    old_w2 = layer.w2_weight.data
                    new_w2 = torch.zeros(
                        E,
                        w2_N,
                        padded_inter // 2,
                        dtype=old_w2.dtype,
                        device=old_w2.device,
                    )
                    new_w2[:, :, :w2_K_packed] = old_w2
                    layer.w2_weight = torch.nn.Parameter(new_w2, requires_grad=False)

                    # Pad w13 scale: (E, 2*inter, K/block_k) → (E, 2*padded, K/block_k)
                    old_s13 = layer.w13_weight_scale_inv.data
                    _, _, s13_K = old_s13.shape
                    new_s13 = torch.zeros(
                        E,
                        2 * padded_inter,
                        s13_K,
                        dtype=old_s13.dtype,
                        device=old_s13.device,
                    )
                    new_s13[:, :inter_per_part, :] = old_s13[:, :inter_per_part, :]
                    new_s13[:, padded_inter : padded_inter + inter_per_part, :] = (
                        old_s13[:, inter_per_part:, :]
                    )
                    layer.w13_weight_scale_inv = torch.nn.Parameter(
                        new_s13, requires_grad=False
                    )

                    # Pad w2 scale: (E, N, inter/block_k) → (E, N, padded/block_k)
                    old_s2 = layer.w2_weight_scale_inv.data
                    new_s2 = torch.zeros(
                        E,
                        w2_N,
                        padded_inter // fp4_block_k,
                        dtype=old_s2.dtype,
                        device=old_s2.device,
                    )
                    new_s2[:, :, : old_s2.shape[2]] = old_s2
                    layer.w2_weight_scale_inv = torch.nn.Parameter(
                        new_s2, requires_grad=False
                    )

                for scale_name in ("w13_weight_scale_inv", "w2_weight_scale_inv"):
                    scale = getattr(layer, scale_name)
                    num_experts, num_rows, _ = scale.shape
                    is_w13_scale = scale_name == "w13_weight_scale_inv"
                    if _is_gfx1250_supported:
                        scale.data = moe_shuffle_scale(
                            scale.contiguous(),
                            experts_cnt=num_experts,
                            is_guinterleave=gu_intv,
                            gate_up=is_w13_scale,
                        )
                    else:
                        scale_2d = scale.reshape(-1, scale.shape[-1])
                        scale.data = shuffle_scale(
                            scale_2d, num_experts, gu_intv, is_w13_scale
                        )

                layer.w13_weight.data = layer.w13_weight.data.view(fp4_weight_dtype)
                layer.w2_weight.data = layer.w2_weight.data.view(fp4_weight_dtype)

                if _is_gfx1250_supported:
                    is_shuffled = True
                    layer.w13_weight.data = moe_shuffle_weight(
                        layer.w13_weight,
                        is_guinterleave=gu_intv,
                        gate_up=True,
                    )
                    layer.w2_weight.data = moe_shuffle_weight(
                        layer.w2_weight,
                        is_guinterleave=gu_intv,
                        gate_up=False,
                    )
                else:
                    is_shuffled = _is_shuffle_moe_mxfp4 or _use_aiter_a8w4
                    if is_shuffled:
                        shuffle_gu_intv = gu_intv and not _use_aiter_a8w4
                        layer.w13_weight.data = shuffle_weight(
                            layer.w13_weight,
                            is_guinterleave=shuffle_gu_intv,
                            gate_up=True,
                        )
                        layer.w2_weight.data = shuffle_weight(
                            layer.w2_weight,
                            is_guinterleave=shuffle_gu_intv,
                            gate_up=False,
                        )
                layer.w13_weight.is_shuffled = is_shuffled
                layer.w2_weight.is_shuffled = is_shuffled
                return

            # DSV4 dequant requested: convert to block-FP8 and use the standard
            # block-FP8 MoE path.
            else:
                self._dequantize_aiter_fp4_experts(layer)
                self.weight_block_size = [128, 128]

                # gfx942/gfx950 native FP8 is e4m3fnuz, not e4m3fn.
                if _is_fp8_fnuz:
                    w13_weight, w13_weight_scale, _ = normalize_e4m3fn_to_e4m3fnuz(
                        weight=layer.w13_weight,
                        weight_scale=layer.w13_weight_scale_inv,
                        input_scale=None,
                    )
                    w2_weight, w2_weight_scale, _ = normalize_e4m3fn_to_e4m3fnuz(
                        weight=layer.w2_weight,
                        weight_scale=layer.w2_weight_scale_inv,
                        input_scale=None,
                    )
                    layer.w13_weight = Parameter(w13_weight, requires_grad=False)
                    layer.w13_weight_scale_inv = Parameter(
                        w13_weight_scale, requires_grad=False
                    )
                    layer.w2_weight = Parameter(w2_weight, requires_grad=False)
                    layer.w2_weight_scale_inv = Parameter(
                        w2_weight_scale, requires_grad=False
                    )
                    layer.w13_input_scale = None
                    layer.w2_input_scale = None

                # Only aiter-shuffle when the MoE runner is aiter; the triton runner
                # consumes un-shuffled weights (shuffling the wrong runner corrupts output).
                runner_is_aiter = (
                    getattr(self, "runner", None) is not None
                    and self.runner.runner_backend.is_aiter()
                )
                if _use_aiter and runner_is_aiter:
                    layer.w13_weight.data = shuffle_weight(
                        layer.w13_weight.contiguous(), (16, 16)
                    )
                    layer.w2_weight.data = shuffle_weight(
                        layer.w2_weight.contiguous(), (16, 16)
                    )
                return

        if self.convert_mxfp8_to_block:
            # Only aiter-shuffle when the MoE runner is aiter; the triton runner
            # consumes un-shuffled weights (shuffling the wrong runner corrupts output).
            self._convert_mxfp8_moe_to_block_fp8(layer)
            self.use_mxfp8 = False
            self.convert_mxfp8_to_block = False
            self.weight_block_size = [128, 128]
            if _is_fp8_fnuz:
                w13_weight, w13_weight_scale, _ = normalize_e4m3fn_to_e4m3fnuz(
                    weight=layer.w13_weight,
                    weight_scale=layer.w13_weight_scale_inv,
                    input_scale=None,
                )
                w2_weight, w2_weight_scale, _ = normalize_e4m3fn_to_e4m3fnuz(
                    weight=layer.w2_weight,
                    weight_scale=layer.w2_weight_scale_inv,
                    input_scale=None,
                )
                layer.w13_weight = Parameter(w13_weight, requires_grad=False)
                layer.w13_weight_scale_inv = Parameter(
                    w13_weight_scale, requires_grad=False
                )
                layer.w2_weight = Parameter(w2_weight, requires_grad=False)
                layer.w2_weight_scale_inv = Parameter(
                    w2_weight_scale, requires_grad=False
                )
                layer.w13_input_scale = None
                layer.w2_input_scale = None
            runner_is_aiter = (
                getattr(self, "runner", None) is not None
                and self.runner.runner_backend.is_aiter()
            )
            if _use_aiter and runner_is_aiter:
                layer.w13_weight.data = shuffle_weight(
                    layer.w13_weight.contiguous(), (16, 16)
                )
                layer.w2_weight.data = shuffle_weight(
                    layer.w2_weight.contiguous(), (16, 16)
                )
                layer.w13_weight.is_shuffled = True
                layer.w2_weight.is_shuffled = True
                layer._aiter_gate_up_interleaved = False
            return
        elif self.use_mxfp8 and get_moe_a2a_backend().is_flashinfer_megamoe():
            from sglang.srt.layers.moe.flashinfer_megamoe import (
                prepare_mxfp8_moe_weights_for_flashinfer_megamoe,
            )

            prepare_mxfp8_moe_weights_for_flashinfer_megamoe(layer)
            return
        elif self.use_mxfp8:
            self._process_mxfp8_moe_weights(
                layer, quantize=not self.quant_config.is_checkpoint_fp8_serialized
            )
            return

        runner_backend = self.get_moe_runner_backend(layer)
        runner_is_aiter = runner_backend is not None and runner_backend.is_aiter()

        # If ROCm, normalize the weights and scales to e4m3fnuz
        if _is_fp8_fnuz:
            # activation_scheme: dynamic
            w13_weight, w13_weight_scale, _ = normalize_e4m3fn_to_e4m3fnuz(
                weight=layer.w13_weight,
                weight_scale=layer.w13_weight_scale_inv,
                input_scale=None,
            )
            w2_weight, w2_weight_scale, _ = normalize_e4m3fn_to_e4m3fnuz(
                weight=layer.w2_weight,
                weight_scale=layer.w2_weight_scale_inv,
                input_scale=None,
            )
            # Reset the parameter
            layer.w13_weight = torch.nn.Parameter(w13_weight, requires_grad=False)
            layer.w13_weight_scale_inv = torch.nn.Parameter(
                w13_weight_scale, requires_grad=False
            )
            layer.w13_input_scale = None
            layer.w2_weight = torch.nn.Parameter(w2_weight, requires_grad=False)
            layer.w2_weight_scale_inv = torch.nn.Parameter(
                w2_weight_scale, requires_grad=False
            )
            layer.w2_input_scale = None
            if _use_aiter and runner_is_aiter:
                layer.w13_weight.data = shuffle_weight(
                    layer.w13_weight.contiguous(), (16, 16)
                )
                layer.w2_weight.data = shuffle_weight(
                    layer.w2_weight.contiguous(), (16, 16)
                )
                layer.w13_weight.is_shuffled = True
                layer.w2_weight.is_shuffled = True
                layer._aiter_gate_up_interleaved = False
        elif _use_aiter:
            if runner_is_aiter:
                # Pre-shuffle weights
                t = shuffle_weight(layer.w13_weight, (16, 16))
                layer.w13_weight.copy_(t)
                del t
                t = shuffle_weight(layer.w2_weight, (16, 16))
                layer.w2_weight.copy_(t)
                del t
                layer.w13_weight.is_shuffled = True
                layer.w2_weight.is_shuffled = True
                layer._aiter_gate_up_interleaved = False
        elif _is_cpu:
            assert _is_cpu_amx_available, (
                "Fp8MoEMethod on CPU requires that CPU has AMX support"
            )
            _amx_process_weight_after_loading(layer, ["w13_weight", "w2_weight"])
        else:
            # For fp8 moe run with deepgemm, the expert weights and scales need be requantized to ue8m0
            from sglang.srt.layers import deep_gemm_wrapper

            # Check if MoE will actually use DeepGEMM runner
            will_use_deepgemm = self.is_deepgemm_moe_runner_backend_enabled()

            if self.is_fp4_expert and self.dequant_fp4_to_fp8:
                for weight_param, scale_param in [
                    (layer.w13_weight, layer.w13_weight_scale_inv),
                    (layer.w2_weight, layer.w2_weight_scale_inv),
                ]:
                    num_experts = weight_param.shape[0]
                    new_weights = []
                    new_scales = []
                    for e in range(num_experts):
                        w, s = cast_e2m1fn_to_e4m3fn(
                            weight_param.data[e], scale_param.data[e]
                        )
                        new_weights.append(w)
                        new_scales.append(s)
                    weight_param.data = torch.stack(new_weights)
                    scale_param.data = torch.stack(new_scales).float()
                    scale_param.format_ue8m0 = False
                self.is_fp4_expert = False
                logger.warning_once("Dequantized FP4 expert weights to FP8.")

            if self.is_fp4_expert:
                if _is_npu:
                    self._process_npu_fp4_expert_weights(layer)
                    return

                if get_moe_runner_backend().is_marlin():
                    layer.w13_weight.data = layer.w13_weight.data.view(torch.int8)
                    layer.w2_weight.data = layer.w2_weight.data.view(torch.int8)
                    return

                fp4_weight_dtype = _require_fp4_dtype() if _use_aiter else torch.int8
                layer.w13_weight.data = layer.w13_weight.data.view(fp4_weight_dtype)
                layer.w2_weight.data = layer.w2_weight.data.view(fp4_weight_dtype)

                if get_moe_a2a_backend().is_megamoe():
                    from sglang.srt.layers.moe.mega_moe import (
                        build_mega_moe_experts_weights,
                    )

                    build_mega_moe_experts_weights(layer)
                    return

                if get_moe_a2a_backend().is_flashinfer_megamoe():
                    from sglang.srt.layers.moe.flashinfer_megamoe import (
                        prepare_fp4_moe_weights_for_flashinfer_megamoe,
                    )

                    prepare_fp4_moe_weights_for_flashinfer_megamoe(layer)
                    return

                if deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0 and will_use_deepgemm:
                    from deep_gemm import transform_sf_into_required_layout

                    for scale_param, weight_param in [
                        (layer.w13_weight_scale_inv, layer.w13_weight),
                        (layer.w2_weight_scale_inv, layer.w2_weight),
                    ]:
                        num_experts, n, _ = scale_param.data.shape
                        k = weight_param.shape[2] * 2
                        scale_param.data = transform_sf_into_required_layout(
                            scale_param.data,
                            mn=n,
                            k=k,
                            recipe=(1, 32),
                            num_groups=num_experts,
                            disable_ue8m0_cast=False,
                        )
                    layer.w13_weight_scale_inv.format_ue8m0 = True
                    layer.w2_weight_scale_inv.format_ue8m0 = True

            if get_moe_a2a_backend().is_megamoe() and get_platform().is_sm90:
                from sglang.srt.layers.moe.mega_moe_sm90 import (
                    build_sm90_mega_moe_experts_weights,
                )

                assert not self.is_fp4_expert
                build_sm90_mega_moe_experts_weights(layer)
                return

            if not self.is_fp4_expert:
                weight_block_size = self.quant_config.weight_block_size
                for weight, weight_scale in (
                    (layer.w13_weight, layer.w13_weight_scale_inv),
                    (layer.w2_weight, layer.w2_weight_scale_inv),
                ):
                    requant_block_scale_ue8m0_for_deepgemm(
                        weight,
                        weight_scale,
                        weight_block_size,
                        use_deepgemm_runner=will_use_deepgemm,
                        output_dtype=torch.bfloat16,
                        weight_shape=weight.shape[-2:],
                        grouped_moe=True,
                    )

    def _convert_mxfp8_moe_to_block_fp8(self, layer: Module) -> None:
        from sglang.srt.layers.quantization.mxfp8_block_convert import (
            convert_mxfp8_weight_to_block_fp8,
        )

        def convert(w, s):
            E, N, K = w.shape
            qw = torch.empty_like(w)
            sn = (N + 127) // 128
            sk = (K + 127) // 128
            scale = torch.empty((E, sn, sk), dtype=torch.float32, device=w.device)
            for e in range(E):
                qe, se = convert_mxfp8_weight_to_block_fp8(w[e], s[e], block=128)
                qw[e] = qe
                scale[e] = se
            return qw, scale

        w13_q, w13_s = convert(layer.w13_weight.data, layer.w13_weight_scale_inv.data)
        w2_q, w2_s = convert(layer.w2_weight.data, layer.w2_weight_scale_inv.data)
        layer.w13_weight = Parameter(w13_q, requires_grad=False)
        layer.w2_weight = Parameter(w2_q, requires_grad=False)
        layer.w13_weight_scale_inv = Parameter(w13_s, requires_grad=False)
        layer.w2_weight_scale_inv = Parameter(w2_s, requires_grad=False)
        layer.w13_input_scale = None
        layer.w2_input_scale = None

    def _process_mxfp8_moe_weights(self, layer: Module, quantize: bool = True) -> None:

        if not (
            (_is_cuda and get_platform().is_sm100) or (_is_hip and _is_gfx95_supported)
        ):
            raise RuntimeError(
                "MXFP8 MoE quantization requires SM100 or ROCm gfx95 "
                "(gfx942 converts MXFP8 to block-fp8 at load instead)."
            )

        def _quantize_and_swizzle_with_cutlass_es_kernel(weight: torch.Tensor):
            from sgl_kernel import es_sm100_mxfp8_blockscaled_grouped_quant

            weight = weight.contiguous()
            num_experts, m, k = weight.shape
            assert k % 32 == 0, f"{k=} must be divisible by 32 for MXFP8"

            weight_flat = weight.view(-1, k).contiguous()
            problem_sizes = torch.empty(
                (num_experts, 3), dtype=torch.int32, device=weight.device
            )
            problem_sizes[:, 0] = m
            problem_sizes[:, 1] = 0
            problem_sizes[:, 2] = k
            expert_offsets = torch.arange(
                0, num_experts * m, m, dtype=torch.int32, device=weight.device
            )
            aligned_m = ((m + 127) // 128) * 128
            blockscale_offsets = torch.arange(
                0,
                num_experts * aligned_m,
                aligned_m,
                dtype=torch.int32,
                device=weight.device,
            )
            qweight = torch.empty_like(weight_flat, dtype=torch.float8_e4m3fn)
            scale = torch.empty(
                (num_experts * aligned_m, k // 32),
                dtype=torch.uint8,
                device=weight.device,
            )
            es_sm100_mxfp8_blockscaled_grouped_quant(
                weight_flat,
                problem_sizes,
                expert_offsets,
                blockscale_offsets,
                qweight,
                scale,
            )
            qweight = qweight.view_as(weight)
            scale = scale.view(num_experts, aligned_m, k // 32)
            if aligned_m != m:
                scale = scale[:, :m, :]
            return qweight, scale

        def _swizzle_mxfp8_sf(scale, num_warps):
            from triton_kernels.tensor import convert_layout, wrap_torch_tensor
            from triton_kernels.tensor_details import layout

            scale_layout = layout.make_default_matmul_mxfp4_w_scale_layout(
                mx_axis=-2, num_warps=num_warps
            )
            scale_layout_opts = {}
            scale = scale.transpose(-2, -1)
            scale = convert_layout(
                wrap_torch_tensor(scale), scale_layout, **scale_layout_opts
            )
            return scale

        def _swizzle_with_triton_kernel(
            weight_shape: tuple[int, int, int], scale: torch.Tensor
        ):
            num_experts, m, k = weight_shape
            aligned_m = ((m + 127) // 128) * 128
            scale = scale.view(num_experts, aligned_m, k // 32)
            num_warps = 8
            scale = _swizzle_mxfp8_sf(scale, num_warps)
            # convert_layout may pad for alignment; we can't view back to the
            # unpadded shape, so return the (possibly padded) swizzled tensor.
            return scale.data

        def _quantize_and_swizzle_with_triton_kernel(weight: torch.Tensor):

            weight = weight.contiguous()
            _, _, k = weight.shape
            assert k % 32 == 0, f"{k=} must be divisible by 32 for MXFP8"

            weight_flat = weight.view(-1, k).contiguous()
            qweight, scale = mxfp8_group_quantize(weight_flat)
            qweight = qweight.view_as(weight)
            scale = _swizzle_with_triton_kernel(weight.shape, scale)
            return qweight, scale

        def _quantize_with_flashinfer_trtllm(weight: torch.Tensor):
            weight = weight.contiguous()
            num_experts, m, k = weight.shape
            assert k % 32 == 0, f"{k=} must be divisible by 32 for MXFP8"
            from sglang.srt.layers.quantization.fp8_utils import (
                flashinfer_mxfp8_quantize,
            )

            weight_flat = weight.view(-1, k).contiguous()
            qweight, scale = flashinfer_mxfp8_quantize(weight_flat, False)
            scale_u8 = (
                scale.view(torch.uint8).contiguous().view(num_experts, m, k // 32)
            )
            return qweight.view_as(weight), scale_u8

        from sglang.srt.layers.quantization.mxfp8_block_convert import _ue8m0_to_fp32

        def _quantize_for_deepgemm(weight: torch.Tensor):
            weight = weight.contiguous()
            num_experts, m, k = weight.shape
            assert k % 32 == 0, f"{k=} must be divisible by 32 for MXFP8"

            weight_flat = weight.view(-1, k).contiguous()
            qweight, scale_u8 = mxfp8_group_quantize(weight_flat)
            qweight = qweight.view_as(weight)
            scale_fp32 = _ue8m0_to_fp32(scale_u8).view(num_experts, m, k // 32)
            scale_packed = _pack_moe_scale_for_deepgemm(scale_fp32)
            return qweight, scale_packed

        def _pack_moe_scale_for_deepgemm(scale_fp32: torch.Tensor) -> torch.Tensor:
            """Blackwell: int32 MN-major TMA-packed. Hopper returns fp32 (FP4 API converts)."""
            from sglang.srt.layers.deep_gemm_wrapper.configurer import (
                DEEPGEMM_SCALE_UE8M0,
            )

            if DEEPGEMM_SCALE_UE8M0:
                import deep_gemm.utils.layout

                return (
                    deep_gemm.utils.layout.get_mn_major_tma_aligned_packed_ue8m0_tensor(
                        scale_fp32
                    )
                )
            return scale_fp32

        def _convert_ue8m0_scales_for_deepgemm(
            scale_u8: torch.Tensor, shape: tuple
        ) -> torch.Tensor:
            num_experts, m, k_groups = shape[0], shape[1], scale_u8.shape[-1]
            scale_fp32 = _ue8m0_to_fp32(scale_u8.contiguous().view(-1)).view(
                num_experts, m, k_groups
            )
            return _pack_moe_scale_for_deepgemm(scale_fp32)

        if quantize:
            if _is_hip:
                w13_q, w13_s_u8 = mxfp8_group_quantize(
                    layer.w13_weight.data.contiguous().view(
                        -1, layer.w13_weight.data.shape[-1]
                    )
                )
                w2_q, w2_s_u8 = mxfp8_group_quantize(
                    layer.w2_weight.data.contiguous().view(
                        -1, layer.w2_weight.data.shape[-1]
                    )
                )
                w13_q = w13_q.view_as(layer.w13_weight.data)
                w2_q = w2_q.view_as(layer.w2_weight.data)
                w13_s = w13_s_u8.view(
                    layer.w13_weight.data.shape[0],
                    layer.w13_weight.data.shape[1],
                    layer.w13_weight.data.shape[2] // 32,
                )
                w2_s = w2_s_u8.view(
                    layer.w2_weight.data.shape[0],
                    layer.w2_weight.data.shape[1],
                    layer.w2_weight.data.shape[2] // 32,
                )
            elif get_moe_runner_backend().is_cutlass():
                w13_q, w13_s = _quantize_and_swizzle_with_cutlass_es_kernel(
                    layer.w13_weight.data
                )
                w2_q, w2_s = _quantize_and_swizzle_with_cutlass_es_kernel(
                    layer.w2_weight.data
                )
            elif get_moe_runner_backend().is_deep_gemm():
                w13_q, w13_s = _quantize_for_deepgemm(layer.w13_weight.data)
                w2_q, w2_s = _quantize_for_deepgemm(layer.w2_weight.data)
            elif (
                get_moe_runner_backend().is_flashinfer_trtllm()
                or get_moe_runner_backend().is_flashinfer_trtllm_routed()
            ):
                # Match FlashInfer TRT-LLM MoE test contracts:
                # 1) quantize in canonical (non-swizzled) scale layout, and
                # 2) do row/layout shuffling in align_mxfp8_moe_weights_for_flashinfer_trtllm.
                w13_q, w13_s = _quantize_with_flashinfer_trtllm(layer.w13_weight.data)
                w2_q, w2_s = _quantize_with_flashinfer_trtllm(layer.w2_weight.data)
            else:
                w13_q, w13_s = _quantize_and_swizzle_with_triton_kernel(
                    layer.w13_weight.data
                )
                w2_q, w2_s = _quantize_and_swizzle_with_triton_kernel(
                    layer.w2_weight.data
                )
        else:
            if _is_hip:
                w13_q = layer.w13_weight.data
                w2_q = layer.w2_weight.data
                w13_s = layer.w13_weight_scale_inv.data
                w2_s = layer.w2_weight_scale_inv.data
            elif get_moe_runner_backend().is_cutlass():
                w13_q = layer.w13_weight.data
                w2_q = layer.w2_weight.data
                w13_s = layer.w13_weight_scale_inv.data
                w2_s = layer.w2_weight_scale_inv.data
            elif (
                get_moe_runner_backend().is_flashinfer_trtllm()
                or get_moe_runner_backend().is_flashinfer_trtllm_routed()
            ):
                w13_q = layer.w13_weight.data
                w2_q = layer.w2_weight.data
                w13_s = layer.w13_weight_scale_inv.data
                w2_s = layer.w2_weight_scale_inv.data
            elif get_moe_runner_backend().is_deep_gemm():
                w13_q = layer.w13_weight.data
                w2_q = layer.w2_weight.data
                w13_s = _convert_ue8m0_scales_for_deepgemm(
                    layer.w13_weight_scale_inv.data, layer.w13_weight.data.shape
                )
                w2_s = _convert_ue8m0_scales_for_deepgemm(
                    layer.w2_weight_scale_inv.data, layer.w2_weight.data.shape
                )
            else:
                w13_q = layer.w13_weight.data
                w2_q = layer.w2_weight.data
                w13_s = _swizzle_with_triton_kernel(
                    layer.w13_weight.data.shape, layer.w13_weight_scale_inv.data
                )
                w2_s = _swizzle_with_triton_kernel(
                    layer.w2_weight.data.shape, layer.w2_weight_scale_inv.data
                )

        # Keep parameter objects to preserve weight_loader attrs for hot reload.
        # Prefer in-place copy; rebind only when shape/dtype changes (online quantize).
        def _copy_or_rebind(param: Parameter, new_value: torch.Tensor) -> None:
            if (
                param.data.shape == new_value.shape
                and param.data.dtype == new_value.dtype
            ):
                param.data.copy_(new_value)
            else:
                param.data = new_value

        _copy_or_rebind(layer.w13_weight, w13_q)
        _copy_or_rebind(layer.w2_weight, w2_q)
        _copy_or_rebind(layer.w13_weight_scale_inv, w13_s)
        _copy_or_rebind(layer.w2_weight_scale_inv, w2_s)
        layer.w13_weight.requires_grad_(False)
        layer.w2_weight.requires_grad_(False)
        layer.w13_weight_scale_inv.requires_grad_(False)
        layer.w2_weight_scale_inv.requires_grad_(False)
        layer.w13_weight_scale_inv.format_ue8m0 = True
        layer.w2_weight_scale_inv.format_ue8m0 = True
        layer.w13_input_scale = None
        layer.w2_input_scale = None

        if (
            get_moe_runner_backend().is_flashinfer_trtllm()
            or get_moe_runner_backend().is_flashinfer_trtllm_routed()
        ):
            from sglang.srt.layers.moe.moe_runner.flashinfer_trtllm import (
                align_mxfp8_moe_weights_for_flashinfer_trtllm,
            )

            align_mxfp8_moe_weights_for_flashinfer_trtllm(layer)

        if _is_hip and _is_gfx95_supported and get_moe_runner_backend().is_aiter():
            from aiter.ops.shuffle import shuffle_scale_a16w4, shuffle_weight_a16w4
            from aiter.utility import fp4_utils

            num_experts = layer.w13_weight.shape[0]
            layer.w13_weight.data = shuffle_weight_a16w4(
                layer.w13_weight.data.contiguous(), 16, True
            )
            w13_s3d = layer.w13_weight_scale_inv.data
            layer.w13_weight_scale_inv.data = shuffle_scale_a16w4(
                w13_s3d.reshape(-1, w13_s3d.shape[-1]).contiguous(),
                num_experts,
                True,
            )
            layer.w2_weight.data = shuffle_weight_a16w4(
                layer.w2_weight.data.contiguous(), 16, False
            )
            w2_s3d = layer.w2_weight_scale_inv.data
            layer.w2_weight_scale_inv.data = fp4_utils.e8m0_shuffle(
                w2_s3d.reshape(-1, w2_s3d.shape[-1]).contiguous()
            )
            layer.w13_weight.is_shuffled = True
            layer.w2_weight.is_shuffled = True

    def process_weights_after_loading(self, layer: Module) -> None:
        if _is_hip and _use_hip_int4:
            self.process_weights_hip_int4(layer)

        elif self.block_quant:
            # Block quant doesn't need to process weights after loading
            self.process_weights_after_loading_block_quant(layer)

        # If checkpoint is fp16 or bfloat16, quantize in place.
        elif not self.quant_config.is_checkpoint_fp8_serialized:
            # If ROCm, fp8_dtype will be float8_e4m3fnuz (MI300x HW)
            w13_weight = torch.empty_like(layer.w13_weight.data, dtype=fp8_dtype)
            w2_weight = torch.empty_like(layer.w2_weight.data, dtype=fp8_dtype)

            # Re-initialize w13_scale because we directly quantize
            # merged w13 weights and generate a single scaling factor.
            layer.w13_weight_scale = torch.nn.Parameter(
                torch.ones(
                    layer.num_local_experts,
                    dtype=torch.float32,
                    device=w13_weight.device,
                ),
                requires_grad=False,
            )
            for expert in range(layer.num_local_experts):
                w13_weight[expert, :, :], layer.w13_weight_scale[expert] = (
                    scaled_fp8_quant(layer.w13_weight.data[expert, :, :])
                )
                w2_weight[expert, :, :], layer.w2_weight_scale[expert] = (
                    scaled_fp8_quant(layer.w2_weight.data[expert, :, :])
                )
            layer.w13_weight = torch.nn.Parameter(w13_weight, requires_grad=False)
            layer.w2_weight = torch.nn.Parameter(w2_weight, requires_grad=False)

            if _is_hip:
                self.process_weights_hip_scale_padding(layer)

        # If checkpoint is fp8, we need to handle that the
        # MoE kernels require single activation scale and single weight
        # scale for w13 per expert.
        else:
            # Fp8 moe kernels require a single activation scale.
            # We take the max of all the scales in case they differ.
            if self.quant_config.activation_scheme == "static":
                if layer.w13_input_scale is None or layer.w2_input_scale is None:
                    raise ValueError(
                        "QuantConfig has static quantization, but found "
                        "activation scales are None."
                    )
                if not all_close_1d(layer.w13_input_scale) or not all_close_1d(
                    layer.w2_input_scale
                ):
                    print_warning_once(
                        "Found input_scales that are not equal for "
                        "fp8 MoE layer. Using the maximum across experts "
                        "for each layer. "
                    )
                layer.w13_input_scale = torch.nn.Parameter(
                    layer.w13_input_scale.max(), requires_grad=False
                )
                layer.w2_input_scale = torch.nn.Parameter(
                    layer.w2_input_scale.max(), requires_grad=False
                )

            # If ROCm, normalize the weights and scales to e4m3fnuz
            if _is_fp8_fnuz:
                # Normalize the weights and scales
                w13_weight, w13_weight_scale, w13_input_scale = (
                    normalize_e4m3fn_to_e4m3fnuz(
                        layer.w13_weight, layer.w13_weight_scale, layer.w13_input_scale
                    )
                )
                w2_weight, w2_weight_scale, w2_input_scale = (
                    normalize_e4m3fn_to_e4m3fnuz(
                        layer.w2_weight, layer.w2_weight_scale, layer.w2_input_scale
                    )
                )
                # Reset the parameter
                layer.w13_weight = torch.nn.Parameter(w13_weight, requires_grad=False)
                layer.w13_weight_scale = torch.nn.Parameter(
                    w13_weight_scale, requires_grad=False
                )
                if w13_input_scale is not None:
                    layer.w13_input_scale = torch.nn.Parameter(
                        w13_input_scale, requires_grad=False
                    )
                layer.w2_weight = torch.nn.Parameter(w2_weight, requires_grad=False)
                layer.w2_weight_scale = torch.nn.Parameter(
                    w2_weight_scale, requires_grad=False
                )
                if w2_input_scale is not None:
                    layer.w2_input_scale = torch.nn.Parameter(
                        w2_input_scale, requires_grad=False
                    )
            # Fp8 moe kernel needs single weight scale for w13 per expert.
            # We take the max then dequant and requant each expert.
            assert layer.w13_weight_scale is not None
            w13_num_shards = 2 if layer.moe_runner_config.is_gated else 1
            shard_size = layer.intermediate_size_per_partition
            max_w13_scales = layer.w13_weight_scale.max(dim=1).values
            # A single shard already carries one scale per expert; nothing to fuse.
            if w13_num_shards > 1:
                for expert_id in range(layer.num_local_experts):
                    start = 0
                    for shard_id in range(w13_num_shards):
                        dq_weight = per_tensor_dequantize(
                            layer.w13_weight[expert_id][start : start + shard_size, :],
                            layer.w13_weight_scale[expert_id][shard_id],
                        )
                        (
                            layer.w13_weight[expert_id][start : start + shard_size, :],
                            _,
                        ) = scaled_fp8_quant(dq_weight, max_w13_scales[expert_id])
                        start += shard_size

            layer.w13_weight_scale = torch.nn.Parameter(
                max_w13_scales, requires_grad=False
            )

            if _is_hip:
                self.process_weights_hip_scale_padding(layer)

            # Align FP8 weights to FlashInfer per-tensor kernel layout if enabled
            if (
                get_moe_runner_backend().is_flashinfer_trtllm()
                or get_moe_runner_backend().is_flashinfer_trtllm_routed()
            ):
                from sglang.srt.layers.moe.moe_runner.flashinfer_trtllm import (
                    align_fp8_moe_weights_for_flashinfer_trtllm,
                )

                align_fp8_moe_weights_for_flashinfer_trtllm(layer)

        # The runner backend is global, so it is also true for a borrowed delegate,
        # which has no moe_runner_config and whose kernel ignores these params.
        if (
            get_moe_runner_backend().is_flashinfer_trtllm()
            or get_moe_runner_backend().is_flashinfer_trtllm_routed()
        ) and self._owns_moe_runner:
            self._prepare_flashinfer_trtllm_activation_params(layer)

        if get_moe_runner_backend().is_hpc_ops():
            self._prepare_hpc_ops_weights(layer)

        if hasattr(layer, "dispatcher"):
            # Execution kernels may declare the dispatch wire format they
            # need (DISPATCHER_QUANT_CONFIG, e.g. the NPU W4A8 MXFP GMMs
            # consume MXFP8 activations); otherwise report the checkpoint
            # dtype and let the dispatcher pick.
            kernel_quant_config = getattr(
                getattr(layer, "w13_kernel", None), "DISPATCHER_QUANT_CONFIG", None
            )
            layer.dispatcher.set_quant_config(
                kernel_quant_config
                if kernel_quant_config is not None
                else {
                    "weight_dtype": layer.w13_weight.dtype,
                    "use_mxfp8": self.use_mxfp8,
                }
            )

    def _prepare_flashinfer_trtllm_activation_params(self, layer: Module) -> None:
        """Materialize optional TRT-LLM SwiGLU parameters once per expert."""
        num_experts = int(layer.num_local_experts)
        device = layer.w13_weight.device
        clamp_limit = (
            self.moe_runner_config.gemm1_clamp_limit
            if self.moe_runner_config.gemm1_clamp_limit is not None
            else self.moe_runner_config.swiglu_limit
        )
        for name, value in (
            ("gemm1_alpha", self.moe_runner_config.gemm1_alpha),
            ("gemm1_beta", self.moe_runner_config.gemm1_beta),
            ("gemm1_clamp_limit", clamp_limit),
        ):
            tensor = (
                None
                if value is None
                else torch.full(
                    (num_experts,),
                    float(value),
                    dtype=torch.float32,
                    device=device,
                )
            )
            setattr(layer, f"_flashinfer_trtllm_{name}", tensor)

    def _prepare_hpc_ops_weights(self, layer: Module) -> None:
        """Precompute the scale layouts consumed by the HPC-Ops fused MoE kernels.

        - Blockwise FP8: the kernel wants [E, N/128, K/128] float32 dequant
          scales with the K dim padded to a multiple of 4.
        - Per-tensor FP8: the kernel wants per-expert dequant alphas
          (weight_scale * input_scale) and a static w2 input scale; this
          requires the static activation scheme.
        """
        from sglang.srt.layers.moe.moe_runner.hpc_ops import pad_hpc_ops_block_scale

        if self.block_quant:
            layer.hpc_ops_w13_weight_scale = pad_hpc_ops_block_scale(
                layer.w13_weight_scale_inv.data.float()
            )
            layer.hpc_ops_w2_weight_scale = pad_hpc_ops_block_scale(
                layer.w2_weight_scale_inv.data.float()
            )
        else:
            if layer.w13_input_scale is None or layer.w2_input_scale is None:
                raise ValueError(
                    "The hpc_ops MoE runner backend requires static activation "
                    "scales for per-tensor FP8 models (activation_scheme="
                    "'static' in the checkpoint quantization config)."
                )
            layer.hpc_ops_gate_up_alphas = (
                layer.w13_weight_scale.data.float() * layer.w13_input_scale.data.float()
            )
            layer.hpc_ops_down_alphas = (
                layer.w2_weight_scale.data.float() * layer.w2_input_scale.data.float()
            )

    def _get_hpc_ops_quant_info(self, layer: torch.nn.Module):
        from sglang.srt.layers.moe.moe_runner.hpc_ops import HpcOpsMoeQuantInfo

        # The HPC-Ops fused kernels take no per-expert GEMM bias; refuse
        # instead of silently dropping it.
        if (
            getattr(layer, "w13_weight_bias", None) is not None
            or getattr(layer, "w2_weight_bias", None) is not None
        ):
            raise ValueError(
                "The hpc_ops MoE runner backend does not support MoE GEMM "
                "biases (w13_weight_bias / w2_weight_bias); use another "
                "--moe-runner-backend for this model."
            )

        if self.block_quant:
            return HpcOpsMoeQuantInfo(
                w13_weight=layer.w13_weight,
                w2_weight=layer.w2_weight,
                block_quant=True,
                global_num_experts=int(layer.num_experts),
                w13_weight_scale_inv=layer.hpc_ops_w13_weight_scale,
                w2_weight_scale_inv=layer.hpc_ops_w2_weight_scale,
                block_shape=self.quant_config.weight_block_size,
            )
        else:
            return HpcOpsMoeQuantInfo(
                w13_weight=layer.w13_weight,
                w2_weight=layer.w2_weight,
                block_quant=False,
                global_num_experts=int(layer.num_experts),
                gate_up_alphas=layer.hpc_ops_gate_up_alphas,
                down_alphas=layer.hpc_ops_down_alphas,
                w13_input_scale=layer.w13_input_scale,
                w2_input_scale=layer.w2_input_scale,
            )

    def process_weights_hip_int4(self, layer: Module):
        # TODO: _use_aiter: add after triton kernel added
        # INT4-FP8 (INT4 MoE Weight, FP8 Compute)
        # Weight Permutation
        layer.w13_weight = torch.nn.Parameter(
            shuffle_weight(layer.w13_weight.data, (16, 16)),
            requires_grad=False,
        )
        torch.cuda.empty_cache()
        layer.w2_weight = torch.nn.Parameter(
            shuffle_weight(layer.w2_weight.data, (16, 16)),
            requires_grad=False,
        )
        torch.cuda.empty_cache()

        # INT4-FP8 : offset INT4 w13_weight_scale1 to single w13_weight_scale
        # Fp8 moe kernel needs single fp8 w13_weight_scale for w13 per expert.
        # We won't do requant each expert's fp8 weight (not direct available),
        # instead we adjust half of INT4 w13_weight_scale1 numbers
        assert layer.w13_weight_scale is not None
        w13_num_shards = 2 if layer.moe_runner_config.is_gated else 1
        shard_size = layer.intermediate_size_per_partition
        max_w13_scales = layer.w13_weight_scale.max(dim=1).values
        for expert_id in range(layer.num_local_experts):
            start = 0
            max_w13_scale_fp8 = max_w13_scales[expert_id]
            for shard_id in range(w13_num_shards):
                if layer.w13_weight_scale[expert_id][shard_id] != max_w13_scale_fp8:
                    int4_rescale = (
                        layer.w13_weight_scale[expert_id][shard_id] / max_w13_scale_fp8
                    )
                    layer.w13_weight_scale1[expert_id][start : start + shard_size] *= (
                        int4_rescale
                    )
                start += shard_size

        layer.w13_weight_scale = torch.nn.Parameter(max_w13_scales, requires_grad=False)

        # special hack to asm_moe, which takes (weight_scale1 * weight_scale) as post GEMM scaling
        # optimal design - shall apply per-column weight_scale1 before GEMM, and weight_scale post
        for expert_id in range(layer.num_local_experts):
            layer.w13_weight_scale1[expert_id] *= max_w13_scales[expert_id]
            layer.w2_weight_scale1[expert_id] *= layer.w2_weight_scale[expert_id]

    def process_weights_hip_scale_padding(self, layer: Module):
        padding_size = get_moe_padding_size(_use_aiter)
        if _use_aiter:
            layer.w13_weight = torch.nn.Parameter(
                shuffle_weight(layer.w13_weight.data, (16, 16)),
                requires_grad=False,
            )
            torch.cuda.empty_cache()
            layer.w2_weight = torch.nn.Parameter(
                shuffle_weight(layer.w2_weight.data, (16, 16)),
                requires_grad=False,
            )
            torch.cuda.empty_cache()
            layer._aiter_gate_up_interleaved = False

            # ROCm (_use_aiter): using column-wise scaling
            layer.w13_weight_scale1 *= layer.w13_weight_scale.unsqueeze(-1)
            layer.w2_weight_scale1 *= layer.w2_weight_scale.unsqueeze(-1)
        elif get_bool_env_var("SGLANG_MOE_PADDING"):
            # If ROCm, apply weight padding (min. Mem channel contention) only if set
            layer.w13_weight = torch.nn.Parameter(
                F.pad(layer.w13_weight.data, (0, padding_size), "constant", 0),
                requires_grad=False,
            )
            torch.cuda.empty_cache()
            layer.w2_weight = torch.nn.Parameter(
                F.pad(layer.w2_weight.data, (0, padding_size), "constant", 0),
                requires_grad=False,
            )
            torch.cuda.empty_cache()

    def create_moe_runner(
        self, layer: torch.nn.Module, moe_runner_config: MoeRunnerConfig
    ):
        self._owns_moe_runner = False
        self.moe_runner_config = moe_runner_config

        # MXFP4 experts on NPU run through the ASCEND runner, which
        # quantizes activations internally.
        if _is_npu and self.is_fp4_expert:
            from sglang.srt.hardware_backend.npu.quantization.moe_methods import (
                NPUW4A8MXFP4MoEMethod,
            )

            layer.w13_kernel = NPUW4A8MXFP4MoEMethod()
            layer.w2_kernel = NPUW4A8MXFP4MoEMethod()
            moe_runner_config.layer = layer
            self.runner = MoeRunner(MoeRunnerBackend.ASCEND, moe_runner_config)
            return

        moe_runner_backend = get_moe_runner_backend()

        if moe_runner_backend.is_auto():
            if self.is_deepgemm_moe_runner_backend_enabled():
                moe_runner_backend = MoeRunnerBackend.DEEP_GEMM
            elif (
                _is_hip
                and (_use_aiter or _use_hip_int4)
                and get_moe_a2a_backend().supports_aiter()
            ):
                moe_runner_backend = MoeRunnerBackend.AITER
            else:
                moe_runner_backend = MoeRunnerBackend.TRITON

        if (
            moe_runner_backend.is_flashinfer_cutlass()
            or moe_runner_backend.is_flashinfer_cutedsl()
        ):
            # Neither runner has an fp8 MoE path; they get pinned globally for
            # NVFP4 experts on sm120, so run this layer's fp8 experts on triton.
            logger.info(
                "Fp8MoEMethod has no %s path; using triton for its fp8 experts.",
                moe_runner_backend.name,
            )
            moe_runner_backend = MoeRunnerBackend.TRITON

        if (
            moe_runner_backend.is_deep_gemm()
            or moe_runner_backend.is_triton()
            or moe_runner_backend.is_aiter()
            or moe_runner_backend.is_flashinfer_trtllm()
            or moe_runner_backend.is_flashinfer_trtllm_routed()
            or moe_runner_backend.is_hpc_ops()
            or moe_runner_backend.is_flashinfer_megamoe()
        ):
            self.runner = MoeRunner(moe_runner_backend, moe_runner_config)
            self._owns_moe_runner = True
        else:
            # Direct kernels declare the layout they consume.
            self._moe_runner_backend = moe_runner_backend

    def get_moe_runner_backend(self, layer):
        if self.runner is not None:
            return self.runner.runner_backend
        return self._moe_runner_backend

    def get_moe_routing_method_type(self, layer, requested_method):
        backend = self.get_moe_runner_backend(layer)
        if (
            requested_method is None
            and backend is not None
            and (
                backend.is_flashinfer_trtllm() or backend.is_flashinfer_trtllm_routed()
            )
        ):
            return RoutingMethodType.DeepSeekV3
        return requested_method

    def get_triton_quant_info(self, layer: torch.nn.Module) -> TritonMoeQuantInfo:
        use_rocm_mxfp8 = self.use_mxfp8 and _is_hip and _is_gfx95_supported
        return TritonMoeQuantInfo(
            w13_weight=layer.w13_weight,
            w2_weight=layer.w2_weight,
            b13=getattr(layer, "w13_weight_bias", None),
            b2=getattr(layer, "w2_weight_bias", None),
            use_mxfp8=use_rocm_mxfp8,
            use_fp8_w8a8=not use_rocm_mxfp8,
            w13_scale=(
                layer.w13_weight_scale_inv
                if self.block_quant
                else layer.w13_weight_scale
            ),
            w2_scale=(
                layer.w2_weight_scale_inv if self.block_quant else layer.w2_weight_scale
            ),
            a13_scale=layer.w13_input_scale,
            a2_scale=layer.w2_input_scale,
            block_shape=self.weight_block_size,
        )

    def _process_npu_fp4_expert_weights(self, layer: torch.nn.Module) -> None:
        """Convert HF MXFP4 experts to the NPU W4A8 kernel layout.

        HF stores packed FP4 weights as int8 and block scales as float32; the
        NPU kernel expects the weight in FRACTAL_NZ (transposed) and the scale
        as e8m0 (uint8) reshaped to [E, K//64, N, 2].
        """
        from sglang.srt.hardware_backend.npu.quantization.linear_method_npu import (
            _get_float4_e2m1fn_x2_dtype,
        )
        from sglang.srt.hardware_backend.npu.utils import npu_format_cast

        fp4_dtype = _get_float4_e2m1fn_x2_dtype()
        if fp4_dtype is None:
            raise RuntimeError("NPU W4A8 MXFP MoE requires float4 support.")

        for prefix in ("w13", "w2"):
            weight = getattr(layer, f"{prefix}_weight")
            weight.data = npu_format_cast(
                weight.data.view(torch.uint8),
                customize_dtype=torch.float8_e4m3fn,
                input_dtype=fp4_dtype,
            ).transpose(-1, -2)

            # Two e8m0 storage conventions in the fp32 scales: (a) the value
            # IS the e8m0 byte (int in 0..255, MiMo-V2.5-Pro); (b) the value
            # is 2^(e-127) -> recover e from the exponent field. Never
            # re-encode with round(log2)+127: it re-biases the exponent.
            scale_inv = getattr(layer, f"{prefix}_weight_scale_inv")
            scale = scale_inv.data.to(torch.float32)
            s_flat = scale.detach().float().flatten()
            is_int_like = bool(
                torch.all(s_flat >= 0)
                and torch.all(s_flat <= 255)
                and torch.allclose(s_flat, s_flat.round())
            )
            if is_int_like:
                e8m0 = scale.to(torch.uint8)
            else:
                e8m0 = (scale.view(torch.int32) >> 23 & 0xFF).to(torch.uint8)
            scale_inv.data = e8m0.reshape(
                scale.shape[0],
                scale.shape[1],
                scale.shape[2] // 2,
                2,
            ).transpose(1, 2)

    def apply(
        self,
        layer: torch.nn.Module,
        dispatch_output: DispatchOutput,
    ) -> CombineInput:

        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x = dispatch_output.hidden_states
        moe_runner_config = self.moe_runner_config

        if _is_npu and self.is_fp4_expert:
            from sglang.srt.layers.moe.moe_runner.ascend import AscendQuantInfo

            quant_info = AscendQuantInfo(
                w13_weight=layer.w13_weight,
                w2_weight=layer.w2_weight,
                w13_weight_scale=layer.w13_weight_scale_inv,
                w2_weight_scale=layer.w2_weight_scale_inv,
            )
            return self.runner.run(dispatch_output, quant_info)

        if use_intel_amx_backend(layer):
            from sglang.srt.layers.moe.topk import apply_topk_weights_cpu

            topk_weights, topk_ids, _ = dispatch_output.topk_output
            x, topk_weights = apply_topk_weights_cpu(
                moe_runner_config.apply_router_weight_on_input, topk_weights, x
            )

            output = torch.ops.sgl_kernel.fused_experts_cpu(
                x,
                layer.w13_weight,
                layer.w2_weight,
                topk_weights,
                topk_ids,
                False,  # inplace See [Note] inplace should be False in fused_experts.
                CPUQuantMethod.FP8_W8A16,
                layer.w13_weight_scale_inv,  # w1_scale
                layer.w2_weight_scale_inv,  # w2_scale
                None,  # w1_zp
                None,  # w2_zp
                self.quant_config.weight_block_size,  # block_size
                None,  # w1 bias
                None,  # w3 bias
                None,  # alpha
                None,  # limit
                True,  # is_vnni
                moe_runner_config.activation,  # activation
            )
            return StandardCombineInput(hidden_states=output)

        if (
            _is_hip
            and getattr(self, "runner", None) is not None
            and self.runner.runner_backend.is_aiter()
        ):
            quant_info = self.maybe_get_hip_aiter_quant_info(
                layer,
                moe_runner_config.no_combine,
            )
            if quant_info is not None:
                return self.runner.run(dispatch_output, quant_info)

        if _is_xpu and not get_moe_runner_backend().is_triton():
            # sgl-kernel-xpu path
            from sgl_kernel import fused_experts

            topk_weights, topk_ids, _ = dispatch_output.topk_output
            assert layer.w13_weight.dtype == layer.w2_weight.dtype
            use_fp8_w8a8 = layer.w13_weight.dtype == torch.float8_e4m3fn
            use_mxfp4_w4a16 = layer.w13_weight.dtype == torch.int8
            assert self.is_fp4_expert == use_mxfp4_w4a16
            output = fused_experts(
                x,
                layer.w13_weight,
                layer.w2_weight,
                topk_weights,
                topk_ids,
                b1=getattr(layer, "w13_weight_bias", None),
                b2=getattr(layer, "w2_weight_bias", None),
                use_mxfp4_w4a16=use_mxfp4_w4a16,
                use_fp8_w8a8=use_fp8_w8a8,
                w1_scale=(
                    layer.w13_weight_scale_inv
                    if self.block_quant
                    else layer.w13_weight_scale
                ),
                w2_scale=(
                    layer.w2_weight_scale_inv
                    if self.block_quant
                    else layer.w2_weight_scale
                ),
                activation=moe_runner_config.activation,
                routed_scaling_factor=moe_runner_config.routed_scaling_factor,
                gemm1_alpha=moe_runner_config.gemm1_alpha,
                gemm1_limit=moe_runner_config.gemm1_clamp_limit,
                swiglu_limit=moe_runner_config.swiglu_limit,
            )
            return StandardCombineInput(hidden_states=output)

        if get_moe_runner_backend().is_cutlass():
            from sglang.srt.layers.moe.cutlass_moe import cutlass_fused_experts_fp8

            with use_symmetric_memory(
                get_parallel().tp_group, disabled=not is_allocation_symmetric()
            ):
                symm_output = torch.empty_like(x)

            topk_weights, topk_ids, _ = dispatch_output.topk_output
            use_mxfp8 = getattr(self.quant_config, "use_mxfp8", False)
            output = cutlass_fused_experts_fp8(
                x,
                layer.w13_weight.transpose(1, 2),
                layer.w2_weight.transpose(1, 2),
                layer.w13_weight_scale_inv.transpose(1, 2),
                layer.w2_weight_scale_inv.transpose(1, 2),
                topk_weights,
                topk_ids,
                self.ab_strides1,
                self.c_strides1,
                self.ab_strides2,
                self.c_strides2,
                self.workspace,
                self.a_ptr,
                self.b_ptr,
                self.out_ptr,
                self.a_scales_ptr,
                self.b_scales_ptr,
                self.expert_offsets,
                self.problem_sizes1,
                self.problem_sizes2,
                use_fp8_blockscale=True,
                use_mxfp8=use_mxfp8,
                output=symm_output,
                enable_es=(use_mxfp8, use_mxfp8),
                swiglu_limit=self.moe_runner_config.swiglu_limit,
            )
            return StandardCombineInput(hidden_states=output)

        if self.runner.runner_backend.is_flashinfer_megamoe():
            from sglang.srt.layers.moe.flashinfer_megamoe import (
                FlashInferMegaMoeQuantInfo,
                ensure_fp4_moe_layer_for_flashinfer_megamoe,
                ensure_mxfp8_moe_layer_for_flashinfer_megamoe,
            )

            if self.use_mxfp8:
                ensure_megamoe_layer = ensure_mxfp8_moe_layer_for_flashinfer_megamoe
            elif self.is_fp4_expert:
                ensure_megamoe_layer = ensure_fp4_moe_layer_for_flashinfer_megamoe
            else:
                raise ValueError(
                    "FlashInfer MegaMOE does not support standard FP8 MoE "
                    "weights; use MXFP8, NVFP4, or an FP4-expert checkpoint."
                )
            mega = ensure_megamoe_layer(layer)
            quant_info = FlashInferMegaMoeQuantInfo(
                mega=mega,
                mega_forward=layer._flashinfer_megamoe_forward,
                apply_routed_scaling_factor=(
                    not layer.should_fuse_routed_scaling_factor_in_topk
                ),
            )
        elif self.runner.runner_backend.is_deep_gemm():
            w13_weight = layer.w13_weight
            w2_weight = layer.w2_weight

            if self.block_quant:
                block_shape = self.quant_config.weight_block_size
                w13_scale = layer.w13_weight_scale_inv
                w2_scale = layer.w2_weight_scale_inv
            else:
                # Convert per-tensor quant to per-block quant by repeating scales for forward_deepgemm
                scale_block_size = 128
                block_shape = [scale_block_size, scale_block_size]
                w13_scale_n = (w13_weight.shape[1] - 1) // scale_block_size + 1
                w13_scale_k = (w13_weight.shape[2] - 1) // scale_block_size + 1
                w13_scale = (
                    layer.w13_weight_scale.unsqueeze(1)
                    .repeat_interleave(w13_scale_n, dim=1)
                    .unsqueeze(2)
                    .repeat_interleave(w13_scale_k, dim=2)
                )
                w2_scale_n = (w2_weight.shape[1] - 1) // scale_block_size + 1
                w2_scale_k = (w2_weight.shape[2] - 1) // scale_block_size + 1
                w2_scale = (
                    layer.w2_weight_scale.unsqueeze(1)
                    .repeat_interleave(w2_scale_n, dim=1)
                    .unsqueeze(2)
                    .repeat_interleave(w2_scale_k, dim=2)
                )
            quant_info = DeepGemmMoeQuantInfo(
                w13_weight=w13_weight,
                w2_weight=w2_weight,
                use_fp8=True,
                w13_scale=w13_scale,
                w2_scale=w2_scale,
                block_shape=block_shape,
                is_fp4_experts=self.is_fp4_expert,
                use_mxfp8=self.use_mxfp8,
            )
        elif (
            self.runner.runner_backend.is_flashinfer_trtllm()
            or self.runner.runner_backend.is_flashinfer_trtllm_routed()
        ):
            # FlashInfer TRT-LLM backend only supports fused execution and consumes
            # router logits directly (no separate apply_with_router_logits needed).
            # FlashInfer TRT-LLM routed backend consumes SGLang-computed
            # top-k ids/weights (packed into int32) instead of router logits.
            global_num_experts = int(getattr(layer, "num_experts"))
            num_local_experts = int(getattr(layer, "num_local_experts"))
            moe_ep_rank = int(getattr(layer, "moe_ep_rank"))

            from sglang.srt.layers.moe.moe_runner.flashinfer_trtllm import (
                get_activation_type,
            )

            activation_type = get_activation_type(
                self.moe_runner_config.activation,
                is_gated=self.moe_runner_config.is_gated,
            )

            quant_info = FlashInferTrtllmFp8MoeQuantInfo(
                w13_weight=layer.w13_weight,
                w2_weight=layer.w2_weight,
                global_num_experts=global_num_experts,
                local_expert_offset=moe_ep_rank * num_local_experts,
                local_num_experts=num_local_experts,
                intermediate_size=layer.w2_weight.shape[2],
                routing_method_type=int(layer.routing_method_type),
                block_quant=self.block_quant,
                use_mxfp8=getattr(self.quant_config, "use_mxfp8", False),
                weight_block_k=(
                    None
                    if self.quant_config.weight_block_size is None
                    else self.quant_config.weight_block_size[1]
                ),
                w13_weight_scale_inv=(
                    layer.w13_weight_scale_inv if self.block_quant else None
                ),
                w2_weight_scale_inv=(
                    layer.w2_weight_scale_inv if self.block_quant else None
                ),
                gemm1_alpha=layer._flashinfer_trtllm_gemm1_alpha,
                gemm1_beta=layer._flashinfer_trtllm_gemm1_beta,
                gemm1_clamp_limit=layer._flashinfer_trtllm_gemm1_clamp_limit,
                w13_input_scale=layer.w13_input_scale if not self.block_quant else None,
                output1_scales_scalar=(
                    getattr(layer, "output1_scales_scalar", None)
                    if not self.block_quant
                    else None
                ),
                output1_scales_gate_scalar=(
                    getattr(layer, "output1_scales_gate_scalar", None)
                    if not self.block_quant
                    else None
                ),
                output2_scales_scalar=(
                    getattr(layer, "output2_scales_scalar", None)
                    if not self.block_quant
                    else None
                ),
                activation_type=activation_type,
            )
        elif self.runner.runner_backend.is_hpc_ops():
            quant_info = self._get_hpc_ops_quant_info(layer)
        elif self.runner.runner_backend.is_triton():
            quant_info = self.get_triton_quant_info(layer)
        else:
            raise NotImplementedError(
                "Unsupported runner backend: %s" % self.runner.runner_backend
            )

        return self.runner.run(dispatch_output, quant_info)

    def _ensure_cutlass_buffers_initialized(self, layer: Module) -> None:
        if getattr(self, "_cutlass_buffers_ready", False):
            return

        device = layer.w13_weight.device
        num_experts = layer.w13_weight.shape[0]
        hidden_size = layer.w2_weight.shape[1]
        intermediate_size_per_partition = layer.intermediate_size_per_partition
        w13_num_shards = 2 if layer.moe_runner_config.is_gated else 1

        self.ab_strides1 = torch.full(
            (num_experts,), hidden_size, device=device, dtype=torch.int64
        )
        self.c_strides1 = torch.full(
            (num_experts,),
            w13_num_shards * intermediate_size_per_partition,
            device=device,
            dtype=torch.int64,
        )
        self.ab_strides2 = torch.full(
            (num_experts,),
            intermediate_size_per_partition,
            device=device,
            dtype=torch.int64,
        )
        self.c_strides2 = torch.full(
            (num_experts,), hidden_size, device=device, dtype=torch.int64
        )
        self.workspace = torch.empty(90000, device=device, dtype=torch.uint8)
        self.a_ptr = torch.empty(num_experts, device=device, dtype=torch.int64)
        self.b_ptr = torch.empty(num_experts, device=device, dtype=torch.int64)
        self.out_ptr = torch.empty(num_experts, device=device, dtype=torch.int64)
        self.a_scales_ptr = torch.empty(num_experts, device=device, dtype=torch.int64)
        self.b_scales_ptr = torch.empty(num_experts, device=device, dtype=torch.int64)
        self.expert_offsets = torch.empty(
            num_experts + 1, device=device, dtype=torch.int32
        )
        self.problem_sizes1 = torch.empty(
            num_experts, 3, device=device, dtype=torch.int32
        )
        self.problem_sizes2 = torch.empty(
            num_experts, 3, device=device, dtype=torch.int32
        )

        self._cutlass_buffers_ready = True

    def maybe_get_hip_aiter_quant_info(
        self,
        layer: torch.nn.Module,
        no_combine: bool = False,
    ) -> Optional[AiterMoeQuantInfo]:
        if not (_use_aiter or _use_hip_int4):
            return None
        assert not no_combine, f"{no_combine=} is not supported."

        from sglang.srt.layers.moe.moe_runner.aiter import (
            AiterMoeQuantInfo,
            AiterQuantType,
        )

        w13_weight = layer.w13_weight
        w2_weight = layer.w2_weight

        if self.use_mxfp8:
            gemm1_alpha = self.moe_runner_config.gemm1_alpha
            if gemm1_alpha != 1.702:
                raise NotImplementedError(
                    f"AITER MXFP8 MoE only supports swiglu-oai "
                    f"alpha=1.702, got {gemm1_alpha=}."
                )
            from aiter import ActivationType
            from aiter.ops.flydsl.moe_common import GateMode

            return AiterMoeQuantInfo(
                w13_weight=w13_weight,
                w2_weight=w2_weight,
                quant_type=AiterQuantType.PER_1X32,
                w13_scale=layer.w13_weight_scale_inv,
                w2_scale=layer.w2_weight_scale_inv,
                expert_mask=layer.dispatcher.expert_mask_gpu if _use_aiter else None,
                swiglu_limit=self.moe_runner_config.swiglu_limit
                or self.moe_runner_config.gemm1_clamp_limit
                or 0.0,
                hidden_pad=getattr(layer, "hidden_pad", 0),
                intermediate_pad=getattr(layer, "intermediate_pad", 0),
                fused_moe_kwargs={
                    "activation": ActivationType.Swiglu,
                    "gate_mode": GateMode.INTERLEAVE.value,
                },
            )

        if self.block_quant:
            quant_type = (
                AiterQuantType.PER_1X32
                if self.is_fp4_expert
                else AiterQuantType.PER_128X128
            )

            if self.is_fp4_expert:
                fp4_weight_dtype = _require_fp4_dtype()
                w13_weight = w13_weight.view(fp4_weight_dtype)
                w2_weight = w2_weight.view(fp4_weight_dtype)
                if getattr(layer.w13_weight, "is_shuffled", False):
                    w13_weight.is_shuffled = True
                    w2_weight.is_shuffled = True
            w13_scale = layer.w13_weight_scale_inv
            w2_scale = layer.w2_weight_scale_inv
        else:
            quant_type = AiterQuantType.PER_TOKEN
            w13_scale = layer.w13_weight_scale1
            w2_scale = layer.w2_weight_scale1

        fused_moe_kwargs = None
        gate_up_interleaved = getattr(layer, "_aiter_gate_up_interleaved", None)
        if (
            gate_up_interleaved is not None
            and (self.moe_runner_config.swiglu_limit or 0.0) > 0
        ):
            from aiter.ops.flydsl.moe_common import GateMode

            fused_moe_kwargs = {
                "gate_mode": (
                    GateMode.INTERLEAVE.value
                    if gate_up_interleaved
                    else GateMode.SEPARATED.value
                )
            }

        return AiterMoeQuantInfo(
            w13_weight=w13_weight,
            w2_weight=w2_weight,
            quant_type=quant_type,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            expert_mask=layer.dispatcher.expert_mask_gpu if _use_aiter else None,
            swiglu_limit=self.moe_runner_config.swiglu_limit or 0.0,
            hidden_pad=getattr(layer, "hidden_pad", 0),
            intermediate_pad=getattr(layer, "intermediate_pad", 0),
            fp8_activations=(
                self.is_fp4_expert and getattr(layer, "fp8_activations", False)
            ),
            fused_moe_kwargs=fused_moe_kwargs,
        )


class Fp8KVCacheMethod(BaseKVCacheMethod):
    """
    Supports loading kv-cache scaling factors from FP8 checkpoints.
    """

    def __init__(self, quant_config: Fp8Config):
        super().__init__(quant_config)
