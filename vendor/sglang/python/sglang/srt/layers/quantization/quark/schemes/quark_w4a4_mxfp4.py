# SPDX-License-Identifier: Apache-2.0

import logging
import threading
from typing import Any, Callable, Optional

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.parameter import (
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedvLLMParameter,
    PerTensorScaleParameter,
)
from sglang.srt.layers.quantization import QuantizationConfig
from sglang.srt.layers.quantization.dequantization import (
    copy_missing_attrs,
    dequantize_fp8,
    dequantize_nvfp4,
)
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
from sglang.srt.layers.quantization.online_quantization import CopyNumelCounter
from sglang.srt.layers.quantization.quark.schemes import QuarkLinearScheme
from sglang.srt.layers.quantization.quark.utils import Nvfp4SourceConfig
from sglang.srt.utils import get_bool_env_var, is_hip
from sglang.srt.utils.common import direct_register_custom_op, is_gfx95_supported

NVFP4_BLOCK_SIZE = 16

_is_hip = is_hip()

_ASM_FP4_SCALE_ROW_MULTIPLE = 32
_ASM_FP4_SCALE_COL_MULTIPLE = 8
# Workaround: gemm_a4w4's untuned ASM heuristic returns wrong rows 1..M-1 for
# N <= 128 at 2 <= M <= 64 (measured on ROCm/aiter@e7d2453f2, MI355X).
# TODO(vorapolsiloai): link the AITER issue; drop once the heuristic is fixed.
_ASM_FP4_UNSAFE_MAX_N = 128

# Keep this path opt-in while the AITER ASM integration is validated across the
# Quark model matrix. Unlike the Triton fallback, it consumes AITER's
# a4w4_blockscale_tuned_gemm CSVs.
_use_aiter_asm_fp4_gemm = _is_hip and envs.SGLANG_ROCM_USE_AITER_FP4_ASM_GEMM.get()


def _asm_fp4_scale_swizzle_supported(weight_scale: torch.Tensor) -> bool:
    if weight_scale.ndim != 2:
        return False
    rows, cols = weight_scale.shape
    return (
        rows % _ASM_FP4_SCALE_ROW_MULTIPLE == 0
        and cols % _ASM_FP4_SCALE_COL_MULTIPLE == 0
    )


def _swizzle_asm_fp4_scale(scale: torch.Tensor) -> torch.Tensor:
    """Convert a (rows, K/32) E8M0 scale tensor to AITER ASM tile order."""
    rows, cols = scale.shape
    return (
        scale.view(rows // 32, 2, 16, cols // 8, 2, 4, 1)
        .permute(0, 3, 5, 2, 4, 1, 6)
        .contiguous()
        .view(rows, cols)
    )


# Padding of AITER's per_1x32_f4_quant(shuffle=True) activation scales.
_ASM_FP4_ACT_SCALE_ROW_MULTIPLE = 256
_E8M0_ONE = 0x7F


def _shuffle_asm_fp4_act_scale(x_scales: torch.Tensor) -> torch.Tensor:
    """Pad and swizzle row-major (M, K/32) E8M0 activation scales for gemm_a4w4."""
    rows, cols = x_scales.shape
    row_tile, col_tile = _ASM_FP4_ACT_SCALE_ROW_MULTIPLE, _ASM_FP4_SCALE_COL_MULTIPLE
    # Pad with E8M0 1.0, not garbage: the kernel reads whole tiles, and 0xFF is NaN.
    padded = torch.full(
        (
            (rows + row_tile - 1) // row_tile * row_tile,
            (cols + col_tile - 1) // col_tile * col_tile,
        ),
        _E8M0_ONE,
        dtype=torch.uint8,
        device=x_scales.device,
    )
    padded[:rows, :cols] = x_scales.view(torch.uint8)
    return _swizzle_asm_fp4_scale(padded).view(torch.float8_e8m0fnu)


def _asm_fp4_prequantized_input(
    x: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapt an already-quantized ``(x_fp4, x_scales)`` activation for gemm_a4w4."""
    # The 3- and 5-tuples request Triton-only fused epilogues (atomic pre-quant,
    # split + cat); weights are already preshuffled, so there is no fallback.
    if len(x) != 2:
        raise NotImplementedError(
            "AITER ASM FP4 GEMM only supports the (x_fp4, x_scales) tuple input; "
            f"got a {len(x)}-tuple. Disable SGLANG_ROCM_USE_AITER_FP4_ASM_GEMM "
            "for models that use this projection."
        )
    x_q, x_scales = x
    # Only B is preshuffled (bpreshuffle=True), so the packed FP4 activation is
    # consumed as-is. The scales come from the Triton fused-quant kernels in
    # row-major (M, K/32) order, which gemm_a4w4 cannot read directly.
    return x_q.view(torch.float4_e2m1fn_x2), _shuffle_asm_fp4_act_scale(x_scales)


# On GPUs that lack the fp4-activation WMMA scale instruction
# (V_WMMA_SCALE_F32_32X16X128_F4, e.g. gfx1250) the a4w4 (fp4 x fp4) linear GEMM
# cannot run. The MoE path is switched to a8w4 via AITER_FORCE_A8W4=1 (handled
# inside aiter.fused_moe); there is currently no working dense a8w4 GEMM for
# plain nn.Linear on this arch, so under the same flag the (few) MXFP4-quantized
# linear layers dequantize their FP4 weights to bf16 once at load and run a
# plain bf16 GEMM. This trades a little memory for correctness on hardware that
# cannot execute the fp4 kernel at all.
_dequant_linear_to_bf16 = _is_hip and get_bool_env_var("AITER_FORCE_A8W4", "false")

# MXFP4 (OCP MX FP4 / e2m1) decode table, indexed by the 4-bit code.
_MXFP4_VALUES = [
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
]


def _dequant_mxfp4_to_bf16(
    weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """Dequantize a packed MXFP4 weight ``(N, K//2)`` uint8 + e8m0 group scale
    ``(N, K//32)`` uint8 into a dense bf16 weight ``(N, K)``."""
    N, k_packed = weight.shape
    K = k_packed * 2
    lut = torch.tensor(_MXFP4_VALUES, device=weight.device, dtype=torch.float32)
    lo = (weight & 0xF).long()
    hi = (weight >> 4).long()
    vals = torch.empty(N, K, device=weight.device, dtype=torch.float32)
    vals[:, 0::2] = lut[lo]
    vals[:, 1::2] = lut[hi]
    # e8m0 byte b decodes to 2^(b-127); 255 is the NaN/Inf sentinel (unused by
    # real weights) -> map to 0 so it can't poison the matmul.
    scale = torch.exp2(weight_scale.to(torch.float32) - 127.0)
    scale = torch.where(weight_scale == 255, torch.zeros_like(scale), scale)
    scale = scale.view(N, K // 32, 1)
    w = (vals.view(N, K // 32, 32) * scale).view(N, K)
    return w.to(torch.bfloat16)


if _is_hip:
    from aiter import gemm_a4w4 as _gemm_a4w4_orig
    from aiter import per_1x32_f4_quant_hip as _per_1x32_f4_quant_hip_orig
    from aiter.ops.shuffle import shuffle_weight
    from aiter.ops.triton.gemm.fused.fused_gemm_afp4wfp4_split_cat import (
        fused_gemm_afp4wfp4_split_cat as _fused_gemm_afp4wfp4_split_cat_orig,
    )
    from aiter.ops.triton.gemm_afp4wfp4 import gemm_afp4wfp4 as _gemm_afp4wfp4_orig
    from aiter.ops.triton.gemm_afp4wfp4_pre_quant_atomic import (
        gemm_afp4wfp4_pre_quant as _gemm_afp4wfp4_pre_quant_orig,
    )
    from aiter.ops.triton.quant import dynamic_mxfp4_quant as _dynamic_mxfp4_quant_orig

    def _aiter_gemm_afp4wfp4(
        x: torch.Tensor,
        w: torch.Tensor,
        x_scales: torch.Tensor,
        w_scales: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        _gemm_afp4wfp4_orig(x, w, x_scales, w_scales, y.dtype, y)

    def _aiter_gemm_afp4wfp4_fake(
        x: torch.Tensor,
        w: torch.Tensor,
        x_scales: torch.Tensor,
        w_scales: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        return None

    direct_register_custom_op(
        op_name="aiter_gemm_afp4wfp4",
        op_func=_aiter_gemm_afp4wfp4,
        mutates_args=["y"],
        fake_impl=_aiter_gemm_afp4wfp4_fake,
    )

    def gemm_afp4wfp4(x, w, x_scales, w_scales, dtype, y):
        torch.ops.sglang.aiter_gemm_afp4wfp4(x, w, x_scales, w_scales, y)

    def _aiter_gemm_afp4wfp4_pre_quant(
        x: torch.Tensor,
        w: torch.Tensor,
        w_scales: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        _gemm_afp4wfp4_pre_quant_orig(x, w, w_scales, y.dtype, y)

    def _aiter_gemm_afp4wfp4_pre_quant_fake(
        x: torch.Tensor,
        w: torch.Tensor,
        w_scales: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        return None

    direct_register_custom_op(
        op_name="aiter_gemm_afp4wfp4_pre_quant",
        op_func=_aiter_gemm_afp4wfp4_pre_quant,
        mutates_args=["y"],
        fake_impl=_aiter_gemm_afp4wfp4_pre_quant_fake,
    )

    def gemm_afp4wfp4_pre_quant(x, w, w_scales, dtype, y):
        torch.ops.sglang.aiter_gemm_afp4wfp4_pre_quant(x, w, w_scales, y)

    def _aiter_dynamic_mxfp4_quant(
        x: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _dynamic_mxfp4_quant_orig(x)

    def _aiter_dynamic_mxfp4_quant_fake(
        x: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        M, N = x.shape
        x_fp4 = torch.empty((M, N // 2), dtype=torch.uint8, device=x.device)
        blockscale = torch.empty(
            (M, (N + 31) // 32), dtype=torch.uint8, device=x.device
        )
        return x_fp4, blockscale

    direct_register_custom_op(
        op_name="aiter_dynamic_mxfp4_quant",
        op_func=_aiter_dynamic_mxfp4_quant,
        mutates_args=[],
        fake_impl=_aiter_dynamic_mxfp4_quant_fake,
    )

    def dynamic_mxfp4_quant(x):
        return torch.ops.sglang.aiter_dynamic_mxfp4_quant(x)

    def _aiter_per_1x32_f4_quant(
        x: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _per_1x32_f4_quant_hip_orig(x, shuffle=True)

    def _aiter_per_1x32_f4_quant_fake(
        x: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = x.shape
        x_fp4 = torch.empty((rows, cols // 2), dtype=torch.uint8, device=x.device)
        scales = torch.empty(
            (rows, (cols + 31) // 32), dtype=torch.uint8, device=x.device
        )
        return x_fp4, scales

    direct_register_custom_op(
        op_name="aiter_per_1x32_f4_quant",
        op_func=_aiter_per_1x32_f4_quant,
        mutates_args=[],
        fake_impl=_aiter_per_1x32_f4_quant_fake,
    )

    def per_1x32_f4_quant(x):
        return torch.ops.sglang.aiter_per_1x32_f4_quant(x)

    def _aiter_gemm_a4w4(
        x: torch.Tensor,
        w: torch.Tensor,
        x_scales: torch.Tensor,
        w_scales: torch.Tensor,
        output_dtype_ref: torch.Tensor,
    ) -> torch.Tensor:
        return _gemm_a4w4_orig(
            x,
            w.view(x.dtype),
            x_scales,
            w_scales.view(x_scales.dtype),
            dtype=output_dtype_ref.dtype,
            bpreshuffle=True,
        )

    def _aiter_gemm_a4w4_fake(
        x: torch.Tensor,
        w: torch.Tensor,
        x_scales: torch.Tensor,
        w_scales: torch.Tensor,
        output_dtype_ref: torch.Tensor,
    ) -> torch.Tensor:
        del x_scales, w_scales
        return torch.empty(
            (x.shape[0], w.shape[0]),
            dtype=output_dtype_ref.dtype,
            device=x.device,
        )

    direct_register_custom_op(
        op_name="aiter_gemm_a4w4",
        op_func=_aiter_gemm_a4w4,
        mutates_args=[],
        fake_impl=_aiter_gemm_a4w4_fake,
    )

    def gemm_a4w4(x, w, x_scales, w_scales, output_dtype_ref):
        return torch.ops.sglang.aiter_gemm_a4w4(
            x, w, x_scales, w_scales, output_dtype_ref
        )

    def _aiter_fused_gemm_split_cat(
        x: torch.Tensor,
        w: torch.Tensor,
        y: torch.Tensor,
        x_scale: torch.Tensor,
        w_scale: torch.Tensor,
        S1: int,
        S2: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _fused_gemm_afp4wfp4_split_cat_orig(
            x=x,
            w=w,
            y=y,
            x_scale=x_scale,
            w_scale=w_scale,
            S1=S1,
            S2=S2,
            dtype=y.dtype,
        )

    def _aiter_fused_gemm_split_cat_fake(
        x: torch.Tensor,
        w: torch.Tensor,
        y: torch.Tensor,
        x_scale: torch.Tensor,
        w_scale: torch.Tensor,
        S1: int,
        S2: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        M = x.shape[0]
        D = y.shape[1]
        S3 = y.shape[2]
        c1 = torch.empty((M, D, S1 + S3), dtype=y.dtype, device=x.device)
        c2 = torch.empty((M, D, S2), dtype=y.dtype, device=x.device)
        return c1, c2

    direct_register_custom_op(
        op_name="aiter_fused_gemm_split_cat",
        op_func=_aiter_fused_gemm_split_cat,
        mutates_args=[],
        fake_impl=_aiter_fused_gemm_split_cat_fake,
    )

    def fused_gemm_afp4wfp4_split_cat(x, w, y, x_scale, w_scale, S1, S2, dtype):
        return torch.ops.sglang.aiter_fused_gemm_split_cat(
            x, w, y, x_scale, w_scale, S1, S2
        )


__all__ = ["QuarkW4A4MXFP4"]
logger = logging.getLogger(__name__)

OCP_MX_BLOCK_SIZE = 32


class QuarkW4A4MXFP4(QuarkLinearScheme):
    # PackedvLLMParameter / ModelWeightParameter (online and NVFP4->MXFP4
    # paths) only implement the v2 loader API.
    requires_weight_loader_v2 = True

    def __init__(
        self,
        weight_quant_spec: dict[str, Any],
        input_quant_spec: dict[str, Any],
        is_checkpoint_mxfp4_serialized: bool = True,
        dequantization_config: QuantizationConfig | None = None,
    ):
        self.out_dtype = torch.get_default_dtype()
        self.qscheme = "per_group"
        self.weight_quant_spec = weight_quant_spec
        self.input_quant_spec = input_quant_spec
        self.is_checkpoint_mxfp4_serialized = is_checkpoint_mxfp4_serialized
        self.dequantization_config = dequantization_config

        if not self.is_checkpoint_mxfp4_serialized:
            if not is_gfx95_supported():
                raise NotImplementedError(
                    "Online MXFP4 quantization requires an AMD ROCm device with "
                    "FP4 hardware support (gfx95x, e.g. MI355x)."
                )
            logger.info_once(
                "Using online MXFP4 quantization in dense linear layers from a higher precision checkpoint. Beware that this optimization may degrade prediction quality - please validate your model accuracy. More details at https://docs.sglang.io/advanced_features/quantization.html#online-quantization."
            )

    @classmethod
    def get_min_capability(cls) -> int:
        return 70

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not self.is_checkpoint_mxfp4_serialized:
            assert layer.weight.dtype == torch.uint8
            assert layer.weight_scale.dtype == torch.uint8

        if _dequant_linear_to_bf16:
            w_bf16 = _dequant_mxfp4_to_bf16(layer.weight.data, layer.weight_scale.data)
            layer.weight = torch.nn.Parameter(w_bf16, requires_grad=False)
            # FP4 block scales are folded into the bf16 weight; drop them.
            layer.weight_scale = None
            layer.dequantized_bf16 = True
            return

        layer.use_aiter_asm_fp4_gemm = False
        if not _use_aiter_asm_fp4_gemm or not is_gfx95_supported():
            return

        if not _asm_fp4_scale_swizzle_supported(layer.weight_scale.data):
            logger.warning_once(
                "AITER ASM FP4 GEMM requires weight-scale dimensions divisible "
                "by (%d, %d), but this layer has shape %s. Falling back to the "
                "AITER Triton FP4 GEMM for this layer.",
                _ASM_FP4_SCALE_ROW_MULTIPLE,
                _ASM_FP4_SCALE_COL_MULTIPLE,
                tuple(layer.weight_scale.shape),
            )
            return

        if layer.weight.shape[0] <= _ASM_FP4_UNSAFE_MAX_N:
            logger.warning_once(
                "AITER ASM FP4 GEMM is unreliable for N <= %d; keeping the AITER "
                "Triton FP4 GEMM for a layer with N=%d.",
                _ASM_FP4_UNSAFE_MAX_N,
                layer.weight.shape[0],
            )
            return

        layer.weight_scale = torch.nn.Parameter(
            _swizzle_asm_fp4_scale(layer.weight_scale.data),
            requires_grad=False,
        )
        layer.weight = torch.nn.Parameter(
            shuffle_weight(layer.weight.data, layout=(16, 16)),
            requires_grad=False,
        )
        layer.use_aiter_asm_fp4_gemm = True

    def create_weights(
        self,
        layer: torch.nn.Module,
        output_partition_sizes: list[int],
        input_size_per_partition: int,
        params_dtype: torch.dtype,
        weight_loader: Callable,
        **kwargs,
    ):
        self.input_size_per_partition = input_size_per_partition

        output_size_per_partition = sum(output_partition_sizes)
        self.output_size_per_partition = output_size_per_partition

        layer.logical_widths = output_partition_sizes

        # If dequantization_config is provided, we dequantize the source
        # checkpoint and re-quantize to MXFP4 at load time. The source may be
        # NVFP4 (ModelOpt/Quark) or FP8 (block-quantized); each has its own
        # weight-creation and loader path.
        if self.dequantization_config is not None:
            if isinstance(self.dequantization_config, Nvfp4SourceConfig):
                self._create_weights_from_nvfp4(
                    layer=layer,
                    output_size_per_partition=output_size_per_partition,
                    input_size_per_partition=input_size_per_partition,
                    output_partition_sizes=output_partition_sizes,
                    weight_loader=weight_loader,
                )
            elif isinstance(self.dequantization_config, Fp8Config):
                # Create FP8 weights for re-quantization from FP8 checkpoint.
                # Extract necessary parameters from dequantization_config.
                self.weight_block_size = self.dequantization_config.weight_block_size

                if self.dequantization_config.use_mxfp8:
                    raise NotImplementedError(
                        "use_mxfp8=True is not supported in Quark MXFP4 requantization."
                    )

                block_quant = self.weight_block_size is not None

                if not block_quant:
                    raise NotImplementedError(
                        "Only block_quant=True is supported in Quark MXFP4 requantization, got block_quant=False."
                    )

                layer._fp8_weight_loaded_numel = 0
                layer._load_device = torch.get_default_device()
                layer._fp8_weight_loading_lock = threading.Lock()
                layer._fp8_weight_materialized = False

                # Wrap the weight loader to handle FP8->MXFP4 conversion
                fp8_to_mxfp4_weight_loader = self.get_online_fp8_to_mxfp4_weight_loader(
                    layer, weight_loader
                )

                # Create FP8 weight parameters on meta device to avoid device memory overhead during weight loading, as the resulting model uses MXFP4 using less device memory.
                # The weight loader handles progressive FP8 weight materialization on device.
                with torch.device("meta"):
                    Fp8LinearMethod.create_fp8_weight_(
                        layer=layer,
                        block_quant=block_quant,
                        quant_config=self.dequantization_config,
                        use_mxfp8=False,
                        output_size_per_partition=output_size_per_partition,
                        input_size_per_partition=input_size_per_partition,
                        output_partition_sizes=output_partition_sizes,
                        weight_loader=fp8_to_mxfp4_weight_loader,
                        is_checkpoint_fp8_serialized=True,
                        params_dtype=params_dtype,
                        skip_block_quant_check=False,
                        input_size=kwargs.get("input_size", input_size_per_partition),
                        output_size=kwargs.get(
                            "output_size", output_size_per_partition
                        ),
                    )

                # NOTE: ideally, weight_loader should be refactored to be aware of `param_name`.
                layer.weight._param_name = "weight"
                layer.weight_scale_inv._param_name = "weight_scale_inv"
            else:
                raise NotImplementedError(
                    f"Requantization in QuarkW4A4MXFP4 from {self.dequantization_config.__class__.__name__} is not supported."
                )
        else:
            original_weight_loader = weight_loader
            if not self.is_checkpoint_mxfp4_serialized:
                weight_loader = self.get_online_mxfp4_weight_loader(
                    layer, weight_loader
                )

            # WEIGHT
            # Both serialized and online quantization use packed uint8 format
            weight = PackedvLLMParameter(
                data=torch.empty(
                    output_size_per_partition,
                    input_size_per_partition // 2,
                    dtype=torch.uint8,
                ),
                input_dim=1,
                output_dim=0,
                packed_dim=1,
                packed_factor=2,
                weight_loader=weight_loader,
            )
            layer.register_parameter("weight", weight)

            # WEIGHT SCALE
            weight_scale = GroupQuantScaleParameter(
                data=torch.empty(
                    output_size_per_partition,
                    input_size_per_partition // OCP_MX_BLOCK_SIZE,
                    dtype=torch.uint8,
                ),
                input_dim=1,
                output_dim=0,
                weight_loader=original_weight_loader,
            )
            layer.register_parameter("weight_scale", weight_scale)

    def _create_weights_from_nvfp4(
        self,
        layer,
        output_size_per_partition,
        input_size_per_partition,
        output_partition_sizes,
        weight_loader,
    ):
        layer._nvfp4_loaded_numel = 0
        # torch.get_default_device() may return `cuda` (no index), which breaks
        # the `current_device() == idx` assert in the loader
        layer._load_device = torch.device(f"cuda:{torch.cuda.current_device()}")
        layer._nvfp4_loading_lock = threading.Lock()

        nvfp4_loader = self.get_online_nvfp4_to_mxfp4_weight_loader(
            layer, weight_loader
        )

        layer.register_parameter(
            "weight",
            ModelWeightParameter(
                data=torch.empty(
                    output_size_per_partition,
                    input_size_per_partition // 2,
                    dtype=torch.uint8,
                    device=layer._load_device,
                ),
                input_dim=1,
                output_dim=0,
                weight_loader=nvfp4_loader,
            ),
        )
        layer.register_parameter(
            "weight_scale",
            ModelWeightParameter(
                data=torch.empty(
                    output_size_per_partition,
                    input_size_per_partition // NVFP4_BLOCK_SIZE,
                    dtype=torch.float8_e4m3fn,
                    device=layer._load_device,
                ),
                input_dim=1,
                output_dim=0,
                weight_loader=nvfp4_loader,
            ),
        )
        layer.register_parameter(
            "weight_scale_2",
            PerTensorScaleParameter(
                data=torch.empty(
                    len(output_partition_sizes),
                    dtype=torch.float32,
                    device=layer._load_device,
                ),
                weight_loader=nvfp4_loader,
            ),
        )

        # NVFP4 checkpoints carry per-tensor `input_scale` (activation scale).
        # MXFP4 uses dynamic activation quantization, so we discard it, but
        # we still register the param so upstream model loaders that rename
        # `gate_proj.input_scale` -> `gate_up_proj.input_scale` find a slot
        # to write into
        def _discard_loader(param, loaded_weight, shard_id=None):
            pass

        layer.register_parameter(
            "input_scale",
            PerTensorScaleParameter(
                data=torch.empty(
                    len(output_partition_sizes),
                    dtype=torch.float32,
                    device=layer._load_device,
                ),
                weight_loader=_discard_loader,
            ),
        )

        layer.weight._param_name = "weight"
        layer.weight_scale._param_name = "weight_scale"
        layer.weight_scale_2._param_name = "weight_scale_2"

    def get_online_nvfp4_to_mxfp4_weight_loader(
        self,
        layer,
        original_weight_loader: Callable,
    ) -> Callable:
        """NVFP4 -> MXFP4 loader: dequantize+requantize once all source bytes
        are in place."""

        def loader(param, loaded_weight, shard_id=None):
            param_name = getattr(param, "_param_name", None)
            assert torch.cuda.current_device() == layer._load_device.index

            with layer._nvfp4_loading_lock:
                param = getattr(layer, param_name)

            kwargs = {"loaded_shard_id": shard_id} if shard_id is not None else {}
            counter = CopyNumelCounter()
            with counter:
                original_weight_loader(param, loaded_weight, **kwargs)

            with layer._nvfp4_loading_lock:
                layer._nvfp4_loaded_numel += counter.copied_numel
                target = (
                    layer.weight.numel()
                    + layer.weight_scale.numel()
                    + layer.weight_scale_2.numel()
                )
                if layer._nvfp4_loaded_numel == target:
                    # weight_scale_2 is one fp32 per output partition (e.g. 2
                    # for gate_up_proj, 3 for qkv_proj). Expand to a per-row
                    # scalar matching layer.weight's output dim so it
                    # broadcasts against the per-block scale.
                    per_row_scale_2 = layer.weight_scale_2.repeat_interleave(
                        torch.tensor(
                            layer.logical_widths, device=layer.weight_scale_2.device
                        )
                    ).view(-1, 1)
                    # Dequantize to fp32: the intermediate feeds straight into the
                    # MXFP4 requant
                    dequantized_weight = dequantize_nvfp4(
                        layer.weight,
                        layer.weight_scale,
                        per_row_scale_2,
                        out_dtype=torch.float32,
                    )
                    mxfp4_weight, mxfp4_scale = dynamic_mxfp4_quant(dequantized_weight)
                    layer.weight = torch.nn.Parameter(mxfp4_weight, requires_grad=False)
                    layer.weight_scale = torch.nn.Parameter(
                        mxfp4_scale, requires_grad=False
                    )
                    del layer.weight_scale_2
                    del layer._load_device

        return loader

    def get_online_mxfp4_weight_loader(
        self,
        layer,
        original_weight_loader: Callable,
    ) -> Callable:
        """
        Wrap the original weight loader to perform online MXFP4 quantization.
        """

        def online_mxfp4_weight_loader(
            param: torch.nn.Parameter,
            loaded_weight: torch.Tensor,
            shard_id: int | str | None = None,
        ):
            # Materialize on device the loaded weight.
            loaded_weight = loaded_weight.to(param.device)

            # Quantize the loaded weight shard immediately. Since MXFP4 uses per-group quantization, there is no need to load all shards (e.g. q_proj, k_proj, v_proj) before doing online quantization.
            qweight, weight_scale = dynamic_mxfp4_quant(loaded_weight)

            # Required e.g. for q_proj, k_proj, v_proj.
            kwargs = {}
            if shard_id is not None:
                kwargs["loaded_shard_id"] = shard_id

            # Use the original weight loader to handle the loading logic
            # (e.g. qkv sharding, etc.)
            original_weight_loader(param, qweight, **kwargs)

            layer.weight_scale.weight_loader(layer.weight_scale, weight_scale, **kwargs)

        return online_mxfp4_weight_loader

    def get_online_fp8_to_mxfp4_weight_loader(
        self,
        layer,
        original_weight_loader: Callable,
    ) -> Callable:
        """
        Wrap the original weight loader to perform FP8 to MXFP4 requantization.

        This loader handles:
        1. Loading FP8 weights and weight_scale_inv parameters
        2. Waiting for all shards (e.g., q_proj, k_proj, v_proj) to be loaded
        3. Dequantizing FP8 -> BF16
        4. Requantizing BF16 -> MXFP4
        """

        def online_fp8_to_mxfp4_weight_loader(
            param: torch.nn.Parameter,
            loaded_weight: torch.Tensor,
            shard_id: int | str | None = None,
        ):
            param_name = getattr(param, "_param_name", None)

            is_weight_or_weight_scale = "weight" in param_name
            is_weight = param_name == "weight"
            is_weight_scale_inv = param_name == "weight_scale_inv"

            # Sanity multi-threaded load check.
            assert torch.cuda.current_device() == layer._load_device.index

            with layer._fp8_weight_loading_lock:
                # Materialize FP8 parameters on first load on device (there may be several shards for a single layer parameter, e.g. q_proj, k_proj, v_proj).

                if is_weight_or_weight_scale and not layer._fp8_weight_materialized:
                    # Sanity check.
                    assert layer.weight.device.type == "meta"

                    materialized_tensor = layer.weight.__class__(
                        data=torch.empty_like(
                            layer.weight.data, device=layer._load_device
                        ),
                        input_dim=1,
                        output_dim=0,
                        weight_loader=layer.weight._weight_loader,
                    )
                    copy_missing_attrs(layer.weight, materialized_tensor)
                    layer.weight = materialized_tensor

                    # Sanity check.
                    assert layer.weight_scale_inv.device.type == "meta"  # Sanity check.

                    materialized_tensor = layer.weight_scale_inv.__class__(
                        data=torch.empty_like(
                            layer.weight_scale_inv.data, device=layer._load_device
                        ),
                        input_dim=1,
                        output_dim=0,
                        weight_loader=layer.weight_scale_inv._weight_loader,
                    )
                    copy_missing_attrs(layer.weight_scale_inv, materialized_tensor)
                    layer.weight_scale_inv = materialized_tensor

                    # Mark as materialized to prevent other threads from doing it again.
                    layer._fp8_weight_materialized = True

                if is_weight:
                    param = layer.weight
                elif is_weight_scale_inv:
                    param = layer.weight_scale_inv

            kwargs = {}
            if shard_id is not None:
                kwargs["loaded_shard_id"] = shard_id

            # Track how much data we are actually loading (`narrow` used in weight loader)
            copy_numel_counter = CopyNumelCounter()
            with copy_numel_counter:
                original_weight_loader(param, loaded_weight, **kwargs)

            with layer._fp8_weight_loading_lock:
                if is_weight_or_weight_scale:
                    layer._fp8_weight_loaded_numel += copy_numel_counter.copied_numel

                target_numel = layer.weight.numel() + layer.weight_scale_inv.numel()

                # Perform requantization outside the lock (but only if we're the chosen thread)
                if layer._fp8_weight_loaded_numel == target_numel and hasattr(
                    layer, "weight_scale_inv"
                ):
                    assert layer.weight.device.type != "meta"

                    # FP8 -> BF16 dequantization.
                    weight_bf16 = dequantize_fp8(
                        layer.weight,
                        layer.weight_scale_inv,
                        block_size=self.weight_block_size,
                    )

                    # BF16 -> MXFP4 requantization.
                    weight_mxfp4, weight_mxfp4_scale = dynamic_mxfp4_quant(weight_bf16)

                    layer.weight = torch.nn.Parameter(weight_mxfp4, requires_grad=False)
                    layer.weight_scale = torch.nn.Parameter(
                        weight_mxfp4_scale, requires_grad=False
                    )

                    # Clean up FP8 parameters and tracking attributes
                    del layer.weight_scale_inv
                    del layer._load_device
                    del weight_bf16

        return online_fp8_to_mxfp4_weight_loader

    def apply_weights(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        # bf16 fallback: FP4 weights were dequantized to bf16 at load time
        # because this HW cannot run the fp4 GEMM. Run a plain bf16 linear.
        # (The fused tuple-input paths below are only used by MLA attention
        # projections, which are excluded from quantization for this checkpoint,
        # so a plain-tensor activation is what reaches here.)
        if getattr(layer, "dequantized_bf16", False):
            if isinstance(x, tuple):
                x = x[0]
            return torch.nn.functional.linear(x, layer.weight, bias)

        if getattr(layer, "use_aiter_asm_fp4_gemm", False):
            output_shape = None
            if isinstance(x, tuple):
                x_q, x_scales = _asm_fp4_prequantized_input(x)
            else:
                if x.dim() == 3:
                    output_shape = [*x.shape[:-1], layer.weight.shape[0]]
                    x = x.view(-1, x.shape[-1])
                x_q, x_scales = per_1x32_f4_quant(x)

            output_dtype_ref = torch.empty(0, dtype=self.out_dtype, device=x_q.device)
            y = gemm_a4w4(
                x_q,
                layer.weight,
                x_scales,
                layer.weight_scale,
                output_dtype_ref,
            )
            if bias is not None:
                y = y + bias
            return y.view(*output_shape) if output_shape is not None else y

        # Bias will be added after the GEMM if provided
        three_d = False
        fused_gemm_split_cat = False
        x_s = None
        y = None

        if isinstance(x, tuple):
            assert len(x) in [
                2,
                3,
                5,
            ], (
                "For tuple input, only (x, x_s), (x, x_s, y), or (x, y, S1, S2, out_dtype) formats are accepted"
            )
            if len(x) == 2:
                x, x_s = x
            elif len(x) == 3:
                x, x_s, y = x
            elif len(x) == 5:
                x, y, S1, S2, out_dtype = x
                fused_gemm_split_cat = True

        use_fused_quant_gemm = (
            not fused_gemm_split_cat
            and x_s is None
            and y is not None
            and layer.weight.shape[0] == y.shape[1]
        )

        if x.dim() == 3:
            three_d = True
            x = x.view(-1, x.shape[-1])
            output_shape = [*x.shape[:-1], layer.weight.shape[0]]

        # use_fused_quant_gemm = true, x_q is a bf16/fp16 num
        # x_s is not None = true, x_q is uint8 num
        if use_fused_quant_gemm or x_s is not None:
            x_q = x
        else:
            x_q, x_s = dynamic_mxfp4_quant(x)

        if y is None:
            y = torch.empty(
                x_q.shape[0],
                layer.weight.shape[0],
                device=x_q.device,
                dtype=self.out_dtype,
            )

        if use_fused_quant_gemm:
            gemm_afp4wfp4_pre_quant(x_q, layer.weight, layer.weight_scale, y.dtype, y)
            y = y.to(x.dtype)
        elif fused_gemm_split_cat:
            k, v = fused_gemm_afp4wfp4_split_cat(
                x=x_q,
                w=layer.weight,
                y=y,
                x_scale=x_s,
                w_scale=layer.weight_scale,
                S1=S1,
                S2=S2,
                dtype=out_dtype,
            )
        else:
            gemm_afp4wfp4(x_q, layer.weight, x_s, layer.weight_scale, self.out_dtype, y)

        if bias is not None:
            y = y + bias

        if fused_gemm_split_cat:
            return k, v
        elif three_d:
            return y.view(*output_shape)
        else:
            return y
