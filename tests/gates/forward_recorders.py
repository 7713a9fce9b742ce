"""Kernel entry points of the MoE runners, replaced by recorders (child side; torch).

Each recorder binds its call to the real function's signature
(``inspect.signature(real).bind``), checks what the kernel would read (dtype, shape,
16-byte alignment of every tensor, the intermediate size its tiles need) and returns
a correctly shaped output. The b12x launch (``launch_sm120_moe``, under the real
``B12xMoEWrapper.run``, whose padding and caches therefore run as on a GPU) answers
with FlashInfer's own torch reference (``_b12x_fused_moe_reference``), so the layer's
output can be compared with a plain MoE over the checkpoint's dequantized experts.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

ALIGN = 16  # bytes: TMA and vectorized loads need 16-byte aligned operands
CALLS: list[dict[str, Any]] = []
PROBLEMS: list[str] = []


def _tensors(arguments: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, (list, tuple)):
            out.update({f"{name}[{i}]": v for i, v in enumerate(value) if torch.is_tensor(v)})
    return out


def _check_common(entry: str, arguments: dict[str, Any]) -> None:
    for name, tensor in _tensors(arguments).items():
        if tensor.numel() and tensor.data_ptr() % ALIGN:
            PROBLEMS.append(f"{entry}: {name} is not {ALIGN}-byte aligned")
        if "output" in name:  # written by the kernel, not read
            continue
        if tensor.dtype in (torch.float32, torch.bfloat16) and tensor.is_floating_point():
            if tensor.numel() and not torch.isfinite(tensor.float()).all():
                PROBLEMS.append(f"{entry}: {name} holds non-finite values")


def _expect(entry: str, ok: bool, what: str) -> None:
    if not ok:
        PROBLEMS.append(f"{entry}: {what}")


def _mma_to_logical(sf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """6-D MMA scales -> [E, rows, cols/16] E4M3 (FlashInfer's own inverse)."""
    groups = sf.shape[5]
    logical = sf.permute(5, 2, 1, 0, 4, 3).contiguous().reshape(groups, -1, sf.shape[4] * 4)
    return logical[:, :rows, : cols // 16].view(torch.float8_e4m3fn)


def _launch_sm120_moe(a: dict[str, Any]) -> torch.Tensor:
    entry = "launch_sm120_moe"
    x, w1, w2 = a["a"], a["w1_weight"], a["w2_weight"]
    gated = a["activation"] == "silu"
    n = w1.shape[1] // 2 if gated else w1.shape[1]
    _expect(entry, x.dtype == torch.bfloat16, f"a is {x.dtype}, the kernels read bf16")
    _expect(entry, w1.dtype == torch.uint8 and w2.dtype == torch.uint8, "weights not FP4 bytes")
    _expect(entry, n % 128 == 0, f"intermediate {n} is not a multiple of the 128-row tile")
    _expect(entry, w1.shape[2] * 2 == x.shape[1] and w2.shape[1] == x.shape[1], "hidden size")
    _expect(entry, a["topk_ids"].dtype == torch.int32, f"topk_ids {a['topk_ids'].dtype}")
    moe = importlib.import_module("flashinfer.trace.templates.moe")
    alpha1 = a["w1_alpha"].float()
    if a.get("_weight_views") is not None and a.get("input_global_scale") is not None:
        alpha1 = alpha1 / a["input_global_scale"].float()  # the wrapper folded it in
    if not gated:  # the reference splits SwiGLU rows; relu2 is computed here
        out = _relu2_reference(a, alpha1, moe)
        a["scatter_output"].copy_(out.to(a["scatter_output"].dtype))
        return a["scatter_output"]
    out = moe._b12x_fused_moe_reference(
        x,
        w1,
        _mma_to_logical(a["w1_weight_sf"], w1.shape[1], x.shape[1]),
        w2,
        _mma_to_logical(a["w2_weight_sf"], x.shape[1], w2.shape[2] * 2),
        a["topk_ids"],
        a["topk_weights"],
        a["num_experts"],
        a["top_k"],
        w1_alpha=alpha1,
        w2_alpha=a["w2_alpha"],
        fc2_input_scale=a.get("fc2_input_scale"),
        activation=a["activation"],
    )
    a["scatter_output"].copy_(out.to(a["scatter_output"].dtype))
    return a["scatter_output"]


def _relu2_reference(a: dict[str, Any], alpha1: torch.Tensor, moe: Any) -> torch.Tensor:
    quantize = importlib.import_module("flashinfer.trace.templates.quantize")
    x, w1, w2 = a["a"], a["w1_weight"], a["w2_weight"]
    hidden, inter = x.shape[1], w2.shape[2] * 2
    sf1 = _mma_to_logical(a["w1_weight_sf"], w1.shape[1], hidden)
    sf2 = _mma_to_logical(a["w2_weight_sf"], hidden, inter)
    big1 = moe._dequantize_fp4_tensor(w1, sf1, False) * alpha1.view(-1, 1, 1)
    big2 = moe._dequantize_fp4_tensor(w2, sf2, False) * a["w2_alpha"].float().view(-1, 1, 1)
    out = torch.zeros(x.shape[0], hidden)
    for t in range(x.shape[0]):
        for k in range(a["topk_ids"].shape[1]):
            e = int(a["topk_ids"][t, k])
            act = torch.relu(big1[e] @ x[t].float()) ** 2
            packed, scales = quantize._fp4_quantize_reference(act[None], global_scale=torch.ones(1))
            act = moe._dequantize_fp4_tensor(packed, scales, False)[0]
            out[t] += float(a["topk_weights"][t, k]) * (big2[e] @ act)
    return out


def _repack(a: dict[str, Any]) -> torch.Tensor:
    """gptq_marlin_repack's output (its own torch.empty shape): a permutation of the
    input, same bytes; the layout is the kernel's business."""
    pack_factor = 32 // a["num_bits"]
    q = a["b_q_weight"]
    _expect("gptq_marlin_repack", a["size_k"] % 16 == 0 and a["size_n"] % 64 == 0, "tile")
    return torch.zeros(a["size_k"] // 16, a["size_n"] * 16 // pack_factor, dtype=q.dtype)


def _interleave(a: dict[str, Any]) -> torch.Tensor:
    """block_scale_interleave: the scales in the 128x4 swizzle, padded (same dtype)."""
    sf = a["unswizzled_sf"]
    rows, cols = sf.shape[-2], sf.shape[-1]
    batch = sf.numel() // (rows * cols)
    padded = ((rows + 127) // 128 * 128) * ((cols + 3) // 4 * 4) * batch
    return torch.zeros(padded, dtype=sf.dtype)


def _zeros_like_input(key: str) -> Callable[[dict[str, Any]], torch.Tensor]:
    def output(a: dict[str, Any]) -> torch.Tensor:
        x = a[key]
        return torch.zeros(x.shape[0], x.shape[-1], dtype=x.dtype)

    return output


def _cutlass(a: dict[str, Any]) -> list[torch.Tensor]:
    entry = "cutlass_fused_moe"
    x = a["input"]
    _expect(entry, a["token_selected_experts"].dtype == torch.int32, "expert ids not int32")
    _expect(entry, len(a["quant_scales"] or []) in (0, 2, 4, 6), "quant_scales count")
    hidden = x.shape[1] * (2 if x.dtype == torch.uint8 else 1)
    out = a.get("output")
    if out is None:
        out = torch.zeros(x.shape[0], hidden, dtype=a["output_dtype"])
    return [out]


def _marlin(a: dict[str, Any]) -> torch.Tensor:
    entry = "fused_marlin_moe"
    x = a["hidden_states"]
    _expect(entry, x.dtype in (torch.bfloat16, torch.float16), f"hidden_states {x.dtype}")
    return torch.zeros_like(x)


def _fused_experts(a: dict[str, Any]) -> torch.Tensor:
    x = a["hidden_states"]
    w1, w2 = a["w1"], a["w2"]
    _expect("fused_experts", w1.shape[0] == w2.shape[0], "w1/w2 expert counts differ")
    return torch.zeros_like(x)


def _sequence(a: dict[str, Any]) -> torch.Tensor:
    return torch.zeros_like(a["hidden_states"])


# module, attribute, output builder
ENTRIES: tuple[tuple[str, str, Callable[[dict[str, Any]], Any]], ...] = (
    (
        "flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_dispatch",
        "launch_sm120_moe",
        _launch_sm120_moe,
    ),
    ("flashinfer.fused_moe", "cutlass_fused_moe", _cutlass),
    ("sglang.srt.layers.quantization.marlin_utils_fp4", "gptq_marlin_repack", _repack),
    ("sglang.srt.layers.quantization.marlin_utils", "gptq_marlin_repack", _repack),
    ("sglang.kernels.ops.quantization.gptq_marlin_repack", "gptq_marlin_repack", _repack),
    ("flashinfer", "block_scale_interleave", _interleave),
    ("flashinfer.fused_moe.core", "cutlass_fused_moe", _cutlass),
    ("sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe", "fused_marlin_moe", _marlin),
    ("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe", "fused_experts", _fused_experts),
    (
        "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe",
        "_fused_moe_kernel_sequence",
        _sequence,
    ),
)


def _recorder(module: str, name: str, real: Any, build: Callable[[dict[str, Any]], Any]) -> Any:
    signature = inspect.signature(real)

    def record(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            PROBLEMS.append(f"{name}: the call does not bind to {module}.{name}: {exc}")
            raise
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.update(arguments.pop("kwargs", {}) or {})
        _check_common(name, arguments)
        CALLS.append(
            {
                "entry": f"{module}.{name}",
                "tensors": {
                    k: [str(v.dtype), list(v.shape)] for k, v in _tensors(arguments).items()
                },
            }
        )
        return build(arguments)

    record.__wrapped_real__ = real  # type: ignore[attr-defined]
    return record


def install() -> list[str]:
    """Replace every entry point that exists; return those replaced."""
    done = []
    for module_name, attribute, build in ENTRIES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - a module a release lacks has no entry to record
            continue
        real = getattr(module, attribute, None)
        if real is None or hasattr(real, "__wrapped_real__"):
            continue
        setattr(module, attribute, _recorder(module_name, attribute, real, build))
        done.append(f"{module_name}.{attribute}")
    return done
