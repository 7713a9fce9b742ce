from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional, Union

import torch
from torch.nn import Module
from torch.nn.parameter import Parameter

from sglang.kernels.ops.gemm.fp8_gfx1250 import (
    gfx1250_fp8_scaled_mm,
    gfx1250_fp8_scaled_mm_supported,
    per_token_quant_fp8_gfx1250,
)
from sglang.kernels.ops.quantization.fp8_kernel import (
    is_fp8_fnuz,
    per_token_group_quant_fp8,
)
from sglang.multimodal_gen.runtime.distributed.parallel_state import (
    get_tensor_model_parallel_world_size,
)
from sglang.multimodal_gen.runtime.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
)
from sglang.multimodal_gen.runtime.layers.quantization.configs.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from sglang.multimodal_gen.runtime.models.parameter import (
    BasevLLMParameter,
    BlockQuantScaleParameter,
    ChannelQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)
from sglang.multimodal_gen.runtime.platforms import current_platform
from sglang.multimodal_gen.runtime.platforms.aiter import USE_AITER
from sglang.multimodal_gen.runtime.utils.common import (
    cpu_has_amx_support,
    get_bool_env_var,
    use_intel_amx_backend,
)
from sglang.multimodal_gen.runtime.utils.weight_attrs import set_weight_attrs
from sglang.srt.environ import envs
from sglang.srt.layers.amx_utils import _amx_process_weight_after_loading
from sglang.srt.layers.quantization.fp8 import Fp8Config as SRTFp8Config
from sglang.srt.layers.quantization.fp8_utils import (
    apply_fp8_linear,
    can_auto_enable_marlin_fp8,
    cutlass_fp8_supported,
    dispatch_w8a8_block_fp8_linear,
    input_to_float8,
    normalize_e4m3fn_to_e4m3fnuz,
    requant_weight_ue8m0_inplace,
)
from sglang.srt.layers.quantization.marlin_utils_fp8 import (
    apply_fp8_marlin_linear,
    prepare_fp8_layer_for_marlin,
)
from sglang.srt.layers.quantization.utils import (
    convert_to_channelwise,
    is_layer_skipped,
    requantize_with_max_scale,
)
from sglang.srt.utils.common import is_gfx1250_supported

if TYPE_CHECKING:
    from sglang.multimodal_gen.runtime.layers.quantization.rowwise_fp8 import (
        RowwiseFp8Config,
    )
    from sglang.srt.layers.quantization.w4afp8 import W4AFp8Config

_is_hip = current_platform.is_hip()
_is_cuda = current_platform.is_cuda()
_is_npu = current_platform.is_npu()
_is_cpu_amx_available = cpu_has_amx_support()
_is_cpu = current_platform.is_cpu()
_is_fp8_fnuz = is_fp8_fnuz()
_use_hip_int4 = get_bool_env_var("SGLANG_INT4_WEIGHT") and _is_hip

if USE_AITER or _use_hip_int4:
    pass


logger = logging.getLogger(__name__)


def _apply_gfx1250_triton_fp8(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:
    """Per-token FP8 linear through the gfx1250 Triton tile.

    ``weight`` is ``[K, N]`` float8_e4m3fn and ``weight_scale`` holds one scale
    per output channel. Returns ``None`` when the tile does not cover the shape,
    leaving the caller on its existing path.
    """
    x_2d = x.view(-1, x.shape[-1])
    K, N = weight.shape
    if not gfx1250_fp8_scaled_mm_supported(M=x_2d.shape[0], N=N, K=K):
        return None
    qx, x_scale = per_token_quant_fp8_gfx1250(x_2d)
    output = gfx1250_fp8_scaled_mm(
        qx, weight, x_scale, weight_scale, out_dtype=x.dtype, bias=bias
    )
    return output.view(*x.shape[:-1], weight.shape[1])


class Fp8Config(SRTFp8Config, QuantizationConfig):
    """Config class for FP8.

    No-arg ``Fp8Config()`` selects online (post-load) weight quantization:
    ``is_checkpoint_fp8_serialized=False`` with ``activation_scheme="dynamic"``.
    """

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    def get_quant_method(
        self, layer: torch.nn.Module, prefix: str
    ) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, LinearBase):
            if is_layer_skipped(
                prefix,
                self.ignored_layers,
                fused_mapping=self.packed_modules_mapping,
            ):
                return UnquantizedLinearMethod()
            return Fp8LinearMethod(self)
        return None


class Fp8LinearMethod(LinearMethodBase):
    """Linear method for FP8.
    Supports loading FP8 checkpoints with per-tensor, per-output-channel, or
    block-wise weight scales and dynamic/static activation scales.

    Also supports loading quantized FP16/BF16 model checkpoints with dynamic
    activation scaling. The weight scaling factor will be initialized after
    the model weights are loaded.

    Limitation:
    Only supports the float8_e4m3fn data type due to the limitation of
       torch._scaled_mm (https://github.com/pytorch/pytorch/blob/2e48b39603411a41c5025efbe52f89560b827825/aten/src/ATen/native/cuda/Blas.cpp#L854-L856)

    Args:
        quant_config: The quantization config.
    """

    def __init__(self, quant_config: Union[Fp8Config, RowwiseFp8Config, W4AFp8Config]):
        self.quant_config = quant_config
        self.cutlass_fp8_supported = cutlass_fp8_supported()
        self.per_channel_serialized = (
            getattr(quant_config, "weight_qscheme", None) == "per_channel"
            and quant_config.is_checkpoint_fp8_serialized
        )

        # For GPUs that lack FP8 hardware support, we can leverage the Marlin
        # kernel for fast weight-only FP8 quantization
        self.use_marlin = False
        if _is_cuda:
            force_marlin = get_bool_env_var("SGLANG_FORCE_FP8_MARLIN")
            auto_enable = can_auto_enable_marlin_fp8()
            self.use_marlin = force_marlin or auto_enable
        if self.per_channel_serialized:
            self.use_marlin = False

        self.block_quant = self.quant_config.weight_block_size is not None

        # gfx1250 has no tuned hipBLASLt FP8 kernel, so the library GEMM this
        # method would otherwise dispatch to is slower than the BF16 path it
        # replaces; route to the Triton tile instead.
        self.use_gfx1250_triton_fp8 = (
            not self.block_quant
            and not self.quant_config.is_checkpoint_fp8_serialized
            and is_gfx1250_supported()
            and not envs.SGLANG_DISABLE_GFX1250_FP8_GEMM.get()
        )

        self.w8a8_block_fp8_linear = dispatch_w8a8_block_fp8_linear()

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: List[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        output_size_per_partition = sum(output_partition_sizes)
        weight_loader = extra_weight_attrs.get("weight_loader")

        if self.block_quant:
            tp_size = get_tensor_model_parallel_world_size()
            block_n, block_k = (
                self.quant_config.weight_block_size[0],
                self.quant_config.weight_block_size[1],
            )
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

        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = output_size_per_partition
        layer.orig_dtype = params_dtype

        # WEIGHT
        weight_dtype = (
            torch.float8_e4m3fn
            if self.quant_config.is_checkpoint_fp8_serialized
            else params_dtype
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

        # If checkpoint is serialized fp8, load them.
        # Otherwise, wait until process_weights_after_loading.
        if self.quant_config.is_checkpoint_fp8_serialized:
            # WEIGHT SCALE
            if self.block_quant:
                if hasattr(self.quant_config, "activation_scheme"):
                    assert self.quant_config.activation_scheme == "dynamic"
                elif hasattr(self.quant_config, "linear_activation_scheme"):
                    assert self.quant_config.linear_activation_scheme == "dynamic"
                scale = BlockQuantScaleParameter(
                    data=torch.empty(
                        (output_size_per_partition + block_n - 1) // block_n,
                        (input_size_per_partition + block_k - 1) // block_k,
                        dtype=torch.float32,
                    ),
                    input_dim=1,
                    output_dim=0,
                    weight_loader=weight_loader,
                )
                scale.format_ue8m0 = False
                scale[:] = torch.finfo(torch.float32).min
                layer.register_parameter("weight_scale_inv", scale)
            elif self.per_channel_serialized:
                scale = ChannelQuantScaleParameter(
                    data=torch.empty(output_size_per_partition, dtype=torch.float32),
                    output_dim=0,
                    weight_loader=weight_loader,
                )
                set_weight_attrs(scale, {"missing_param_init": "error"})
                layer.register_parameter("weight_scale", scale)
            else:
                scale = PerTensorScaleParameter(
                    data=torch.empty(len(output_partition_sizes), dtype=torch.float32),
                    weight_loader=weight_loader,
                )
                scale[:] = torch.finfo(torch.float32).min
                layer.register_parameter("weight_scale", scale)

            # INPUT ACTIVATION SCALE
            # has_input_scale is RowwiseFp8Config-only, not on QuantizationConfig.
            has_input_scale = hasattr(
                self.quant_config, "has_input_scale"
            ) and self.quant_config.has_input_scale(layer.prefix)
            if self.per_channel_serialized and has_input_scale:
                scale = BasevLLMParameter(
                    data=torch.empty(1, dtype=torch.float32),
                    weight_loader=weight_loader,
                )
                set_weight_attrs(scale, {"missing_param_init": "error"})
                layer.register_parameter("input_scale", scale)
            elif (
                hasattr(self.quant_config, "activation_scheme")
                and self.quant_config.activation_scheme == "static"
            ) or (
                hasattr(self.quant_config, "linear_activation_scheme")
                and self.quant_config.linear_activation_scheme == "static"
            ):
                scale = PerTensorScaleParameter(
                    data=torch.empty(len(output_partition_sizes), dtype=torch.float32),
                    weight_loader=weight_loader,
                )

                scale[:] = torch.finfo(torch.float32).min
                layer.register_parameter("input_scale", scale)
            else:
                layer.register_parameter("input_scale", None)

    def process_weights_after_loading(self, layer: Module) -> None:
        if self.per_channel_serialized:
            # Rowwise FP8 checkpoints store weights in the conventional
            # (out_features, in_features) layout, while apply_fp8_linear expects
            # its column-major transposed view.
            layer.weight.data = layer.weight.data.t()
            return

        if self.block_quant:
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
                # For fp8 linear weights run with deepgemm, the weights and scales need be requantized to ue8m0
                from sglang.srt.layers.quantization.fp8_utils import (
                    deepgemm_w8a8_block_fp8_linear_with_fallback,
                )
                from sglang.srt.model_loader.utils import (
                    should_deepgemm_weight_requant_ue8m0,
                )

                if (
                    should_deepgemm_weight_requant_ue8m0(
                        weight_block_size=getattr(
                            self.quant_config, "weight_block_size", None
                        ),
                    )
                    and (
                        self.w8a8_block_fp8_linear
                        is deepgemm_w8a8_block_fp8_linear_with_fallback
                    )
                    and (not layer.weight_scale_inv.format_ue8m0)
                ):
                    requant_weight_ue8m0_inplace(
                        layer.weight,
                        layer.weight_scale_inv,
                        self.quant_config.weight_block_size,
                    )
                    layer.weight_scale_inv.format_ue8m0 = True
                weight, weight_scale = layer.weight.data, layer.weight_scale_inv.data

            layer.weight.data = weight.data
            layer.weight_scale_inv.data = weight_scale.data
        else:
            layer.weight = Parameter(layer.weight.data, requires_grad=False)

            # If checkpoint not serialized fp8, quantize the weights.
            if not self.quant_config.is_checkpoint_fp8_serialized:
                if self.use_gfx1250_triton_fp8:
                    # The gfx1250 tile dequantizes with one scale per output
                    # channel; a per-tensor scale would lose the per-channel
                    # range that keeps a BF16 checkpoint usable at FP8.
                    qweight, weight_scale = per_token_group_quant_fp8(
                        layer.weight, layer.weight.shape[-1]
                    )
                    weight_scale = weight_scale.t().contiguous()
                elif self.cutlass_fp8_supported or self.use_marlin:
                    # apply per-channel quantization default as
                    # cutlass sgl-kernel and marlin only support per-channel scale
                    qweight, weight_scale = per_token_group_quant_fp8(
                        layer.weight, layer.weight.shape[-1]
                    )
                    weight_scale = weight_scale.t().contiguous()
                else:
                    # per-tensor quantization
                    qweight, weight_scale = input_to_float8(layer.weight)

                # Update the layer with the new values. The gfx1250 tile wants
                # [K, N] contiguous along N rather than the usual transposed
                # view of a [N, K] weight; at these shapes that is worth
                # 1.05-1.33x, paid once here as a transpose at load.
                qweight_kn = qweight.t()
                if self.use_gfx1250_triton_fp8:
                    qweight_kn = qweight_kn.contiguous()
                layer.weight = Parameter(qweight_kn, requires_grad=False)
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

                # cutlass sgl-kernel and marlin only support per-channel scale
                if self.cutlass_fp8_supported or self.use_marlin:
                    weight = layer.weight
                    weight_scale = convert_to_channelwise(
                        layer.weight_scale, layer.logical_widths
                    )
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
                if (
                    hasattr(self.quant_config, "activation_scheme")
                    and self.quant_config.activation_scheme == "static"
                ) or (
                    hasattr(self.quant_config, "linear_activation_scheme")
                    and self.quant_config.linear_activation_scheme == "static"
                ):
                    layer.input_scale = Parameter(
                        layer.input_scale.max(), requires_grad=False
                    )

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
        # The activation quantization kernels assert on row-major input, and
        # diffusion backbones routinely pass a permuted view. Normalising at the
        # producer instead would also move the unquantized path's output, by
        # changing which GEMM kernel it picks. No-op when already contiguous.
        if not x.is_contiguous():
            x = x.contiguous()

        if self.use_gfx1250_triton_fp8:
            output = _apply_gfx1250_triton_fp8(
                x=x, weight=layer.weight, weight_scale=layer.weight_scale, bias=bias
            )
            if output is not None:
                return output

        if self.per_channel_serialized:
            input_scale = layer.input_scale
            if input_scale is not None:
                input_scale = input_scale.float().clamp(min=1e-8)
            return apply_fp8_linear(
                input=x,
                weight=layer.weight,
                weight_scale=layer.weight_scale,
                input_scale=input_scale,
                bias=bias,
                cutlass_fp8_supported=self.cutlass_fp8_supported,
                use_per_token_if_dynamic=True,
            )

        if self.use_marlin:
            return apply_fp8_marlin_linear(
                input=x,
                weight=layer.weight,
                weight_scale=layer.weight_scale,
                workspace=layer.workspace,
                size_n=layer.output_size_per_partition,
                size_k=layer.input_size_per_partition,
                bias=bias,
            )

        if self.block_quant:
            if use_intel_amx_backend(layer):
                return torch.ops.sgl_kernel.fp8_scaled_mm_cpu(
                    x,
                    layer.weight,
                    layer.weight_scale_inv,
                    self.quant_config.weight_block_size,
                    bias,
                    x.dtype,
                    True,  # is_vnni
                )

            if isinstance(x, tuple):
                return self.w8a8_block_fp8_linear(
                    input=x[0],
                    weight=layer.weight,
                    block_size=self.quant_config.weight_block_size,
                    weight_scale=layer.weight_scale_inv,
                    input_scale=x[1],
                    bias=bias,
                )

            return self.w8a8_block_fp8_linear(
                input=x,
                weight=layer.weight,
                block_size=self.quant_config.weight_block_size,
                weight_scale=layer.weight_scale_inv,
                input_scale=None,
                bias=bias,
            )

        return apply_fp8_linear(
            input=x,
            weight=layer.weight,
            weight_scale=layer.weight_scale,
            input_scale=layer.input_scale,
            bias=bias,
            cutlass_fp8_supported=self.cutlass_fp8_supported,
            use_per_token_if_dynamic=False,
        )
