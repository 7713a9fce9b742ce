"""Checkpoint-shaped random experts through the layer's weight loader, and the bytes the
layer holds afterwards (child side of the forward dry run; torch).

Every parameter that carries a ``weight_loader`` (what sglang's model loaders call) is
fed once per expert and shard (``w1`` gate, ``w3`` up, ``w2`` down) with a tensor of
the checkpoint's per-expert shape and dtype; their bytes are the checkpoint's expert
bytes. Held bytes count each storage once (views share it): the layer's parameters,
buffers and tensor attributes (dicts and lists of them included). The first forward
is measured from every tensor made while it ran (a dispatch mode sees every op), less FlashInfer's documented workspaces
(``B12xMoEWrapper`` buffers, ``moe_dispatch._WORKSPACE_CACHE``) and the call's inputs
and output: what stays is memory allocated after the KV pool was sized.
"""

from __future__ import annotations

import gc
import importlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass
class Checkpoint:
    nbytes: int = 0
    tensors: dict[tuple[int, str, str], torch.Tensor] = field(default_factory=dict)


def _random(dtype: torch.dtype, shape: list[int], suffix: str, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8 and "scale" in suffix:  # E8M0 (MXFP4) scales: 2^-2 .. 2^1
        return torch.randint(125, 129, shape, generator=gen, dtype=torch.uint8)
    if dtype in (torch.uint8, torch.int8, torch.int32):
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)
    if dtype == torch.float8_e4m3fn and "scale" in suffix:
        return (torch.rand(shape, generator=gen) + 0.5).to(dtype)
    if dtype == torch.float32 and "input_scale" in suffix:
        return torch.rand(shape, generator=gen) * 0.1 + 0.3
    if dtype == torch.float32 and "scale" in suffix:
        return torch.rand(shape, generator=gen) * 1e-3 + 1e-3
    return (torch.randn(shape, generator=gen) * 0.05).to(dtype)


def _shard_shape(layer: Any, param: Any, shard: str, shards: int, inter: int) -> list[int]:
    """The checkpoint's per-expert tensor: [out, in] rows of its shard, or a scalar.

    A method may pad the per-rank intermediate size when it creates the parameters
    (b12x pads to its kernels' tile): the checkpoint still holds `inter` rows (w1/w3)
    or `inter` columns, packed as the parameter packs them (w2), and the loader pads.
    """
    rest = list(param.shape[1:])
    if not rest or (shard != "w2" and rest == [shards] and shards == 2):
        return []  # one scale per expert (and shard)
    if len(rest) == 1:
        return [rest[0] // shards] if shard != "w2" else rest
    transposed = layer.use_triton_kernels  # stored [in, out]; the loader transposes
    dim = (0 if shard != "w2" else 1) ^ int(transposed)
    if shard != "w2":
        rest[dim] //= shards
    padded = getattr(layer, "intermediate_size_per_partition", inter)
    if not transposed and padded > inter:
        if shard != "w2" and rest[0] == padded:
            rest[0] = inter
        elif shard == "w2" and padded % rest[1] == 0:
            rest[1] = inter // (padded // rest[1])  # FP4 packs 2, block scales 16
    return rest[::-1] if transposed else rest


def load_random(layer: Any, seed: int, inter: int) -> Checkpoint:
    gen = torch.Generator().manual_seed(seed)
    checkpoint = Checkpoint()
    gated = layer.moe_runner_config.is_gated
    for name, param in list(layer.named_parameters()):
        loader = getattr(param, "weight_loader", None)
        if loader is None or not name.startswith(("w13_", "w2_")) or param.numel() == 0:
            continue
        prefix, suffix = name.split("_", 1)
        if suffix.endswith("bias"):  # biases: the models' fused loaders copy them whole
            tensor = _random(param.dtype, list(param.shape), suffix, gen)
            checkpoint.nbytes += tensor.numel() * tensor.element_size()
            param.data.copy_(tensor)
            continue
        shards = ["w1", "w3"] if prefix == "w13" and gated else ["w1"] if prefix == "w13" else ["w2"]
        experts = param.shape[0]
        for expert in range(experts):
            for shard in shards:
                shape = _shard_shape(layer, param, shard, len(shards), inter)
                tensor = _random(param.dtype, shape, suffix, gen)
                if shard == "w3" and not shape:  # gate and up share per-tensor scales
                    tensor = checkpoint.tensors[(expert, "w1", suffix)]
                checkpoint.nbytes += tensor.numel() * tensor.element_size()
                checkpoint.tensors[(expert, shard, suffix)] = tensor
                weight_name = f"model.layers.0.mlp.experts.{expert}.{PROJ[shard]}.{suffix}"
                try:
                    loader(param, tensor.clone(), weight_name, shard, expert)
                except Exception as exc:
                    note = f"{name} {list(param.shape)} <- {shard} {shape}"
                    raise type(exc)(f"{exc} (loading {note})") from exc
    return checkpoint


def _storages(value: Any, out: dict[int, int], depth: int = 0) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel():
            storage = value.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            _storages(item, out, depth + 1)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            _storages(item, out, depth + 1)


def held(layer: Any) -> dict[int, int]:
    found: dict[int, int] = {}
    for tensor in [*layer.parameters(), *layer.buffers()]:
        _storages(tensor, found)
    for owner in (layer, layer.quant_method):
        for name, value in vars(owner).items():
            if not name.startswith("_b12x_wrapper"):
                _storages(value, found)
    return found


def held_bytes(layer: Any) -> int:
    return sum(held(layer).values())


class Allocations(TorchDispatchMode):
    """Every tensor an op returns while active (weakly): what the first forward made."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.made.append(weakref.ref(tensor))
        return out

    def alive(self) -> dict[int, int]:
        found: dict[int, int] = {}
        for ref in self.made:
            tensor = ref()
            if tensor is not None:
                _storages(tensor, found)
        return found


def _workspaces() -> dict[int, int]:
    found: dict[int, int] = {}
    try:
        dispatch = importlib.import_module(
            "flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_dispatch"
        )
        wrapper_type = importlib.import_module("flashinfer").B12xMoEWrapper
    except Exception:  # noqa: BLE001 - no b12x in this flashinfer: no workspace
        return found
    owners: list[Any] = list(dispatch._WORKSPACE_CACHE.values())
    for obj in gc.get_objects():
        if isinstance(obj, wrapper_type):
            owners += [obj._static_workspace, obj._dynamic_workspace, obj._moe_output]
    for owner in owners:
        _storages(owner, found)
        if owner is not None and hasattr(owner, "__dict__"):
            _storages(vars(owner), found)
    return found


def first_forward(
    before: dict[int, int], made: Allocations, inputs: Any, output: Any
) -> tuple[int, int]:
    """(bytes the first forward left allocated beyond the workspaces, workspace bytes)."""
    gc.collect(1)  # young cycles the forward left; a full collection costs a second
    after = made.alive()
    mine: dict[int, int] = {}
    _storages([*inputs[:1], *inputs[1][:3], output], mine)
    workspaces = _workspaces()
    new = {ptr: size for ptr, size in after.items() if ptr not in before and ptr not in mine}
    extra = {ptr: size for ptr, size in new.items() if ptr not in workspaces}
    return sum(extra.values()), sum(new.values()) - sum(extra.values())


def _dequant(ckpt: Checkpoint, expert: int, shard: str) -> torch.Tensor:
    moe = importlib.import_module("flashinfer.trace.templates.moe")
    packed = ckpt.tensors[(expert, shard, "weight")]
    scales = ckpt.tensors[(expert, shard, "weight_scale")]
    scale_2 = ckpt.tensors[(expert, shard, "weight_scale_2")]
    return moe._dequantize_fp4_tensor(packed, scales, is_ue8m0_scales=False) * scale_2


def compare(ckpt: Checkpoint, inputs: Any, output: torch.Tensor, profile: dict[str, Any]) -> float:
    """Relative error of the layer's output against a plain MoE over the dequantized
    ModelOpt NVFP4 checkpoint (FC2 input quantized per block, as the kernel does)."""
    quantize = importlib.import_module("flashinfer.trace.templates.quantize")
    moe = importlib.import_module("flashinfer.trace.templates.moe")
    x, topk = inputs
    a = x.float()
    want = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for k in range(topk.topk_ids.shape[1]):
            e = int(topk.topk_ids[t, k])
            if profile["is_gated"]:
                act = torch.nn.functional.silu(_dequant(ckpt, e, "w1") @ a[t])
                act = act * (_dequant(ckpt, e, "w3") @ a[t])
            else:
                act = torch.relu(_dequant(ckpt, e, "w1") @ a[t]) ** 2
            packed, scales = quantize._fp4_quantize_reference(act[None], global_scale=torch.ones(1))
            act = moe._dequantize_fp4_tensor(packed, scales, is_ue8m0_scales=False)[0]
            want[t] += float(topk.topk_weights[t, k]) * (_dequant(ckpt, e, "w2") @ act)
    return float((output.float() - want).norm() / want.norm())
