"""The patched tree's b12x glue, run on a CPU without importing sglang.

tests/gates/test_b12x_moe_reference.py and test_b12x_moe_memory.py build one FusedMoE
layer's expert parameters as ModelOpt's ``create_weights`` makes them for
``flashinfer_b12x`` (intermediate size padded by the patched ``b12x_padded_intermediate``),
write a checkpoint into them through the patched tree's own loader functions
(``FusedMoE._load_w13`` / ``_load_w2`` / ``_load_per_tensor_weight_scale``, read from
layers/moe/fused_moe_triton/layer.py) with the row order the patched
``ModelOptNvFp4FusedMoEMethod.load_up_proj_weight_first`` asks for, then run the
patched ``process_b12x_nvfp4_layer`` with sglang's own ``copy_or_rebind_param`` /
``alias_or_bind_derived_param`` (layers/utils/common.py). Functions are taken from the
sources by name (``ast``), so a change to any of them is what the tests run.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch  # type: ignore[import-not-found]
from flashinfer.trace.templates.moe import _dequantize_fp4_tensor  # type: ignore[import-not-found]
from flashinfer.trace.templates.quantize import (  # type: ignore[import-not-found]
    _fp4_quantize_reference,
)

WEIGHTS = "sglang/srt/layers/moe/b12x_weights.py"
LAYER = "sglang/srt/layers/moe/fused_moe_triton/layer.py"
COMMON = "sglang/srt/layers/utils/common.py"
MODELOPT = "sglang/srt/layers/quantization/modelopt_quant.py"
FP4_MAX, E4M3_MAX = 6.0, 448.0
Tensor = Any


def load_weights_module(patched: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("b12x_weights_under_test", patched / WEIGHTS)
    assert spec is not None and spec.loader is not None, patched / WEIGHTS
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _defs(path: Path, names: set[str], cls: str | None = None) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    body = tree.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = {n.name: n for n in body if isinstance(n, ast.FunctionDef) and n.name in names}
    assert set(found) == names, f"{path}: missing {names - set(found)}"
    return found


def _compile(defs: dict[str, ast.FunctionDef], namespace: dict[str, Any], path: Path) -> None:
    for node in defs.values():
        node.decorator_list = []
    module = ast.Module(body=list(defs.values()), type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)


class Glue:
    """sglang's functions the b12x layer goes through, from the patched tree."""

    def __init__(self, patched: Path) -> None:
        self.patched = patched
        self.prep = load_weights_module(patched)
        common: dict[str, Any] = {"torch": torch, "Parameter": torch.nn.Parameter}
        names = {"copy_or_rebind_param", "alias_or_bind_derived_param"}
        _compile(_defs(patched / COMMON, names), common, patched / COMMON)
        self.bind, self.alias = (
            common["copy_or_rebind_param"],
            common["alias_or_bind_derived_param"],
        )
        loader: dict[str, Any] = {"torch": torch, "_is_cpu": False}
        _compile(_defs(patched / LAYER, {"_weight_layout_method"}), loader, patched / LAYER)
        loader["_maybe_copy_weight_view_before_h2d"] = lambda t: t
        names = {
            "_load_w13",
            "_load_w2",
            "_load_per_tensor_weight_scale",
            "_load_model_weight_or_group_weight_scale",
        }
        _compile(_defs(patched / LAYER, names, "FusedMoE"), loader, patched / LAYER)
        self.loader = loader
        method: dict[str, Any] = {"get_moe_runner_backend": _b12x_backend}
        names = {"load_up_proj_weight_first", "_uses_b12x"}
        _compile(
            _defs(patched / MODELOPT, names, "ModelOptNvFp4FusedMoEMethod"),
            method,
            patched / MODELOPT,
        )
        self.method = method

    def up_first(self, gated: bool) -> bool:
        """ModelOptNvFp4FusedMoEMethod.load_up_proj_weight_first with runner b12x."""
        this = SimpleNamespace(
            moe_runner_config=SimpleNamespace(is_gated=gated),
            use_flashinfer_trtllm_weight_layout=False,
            enable_flashinfer_cutlass_moe=False,
            _is_cutedsl_v2_standard=False,
        )
        this._uses_b12x = self.method["_uses_b12x"](this)
        return bool(self.method["load_up_proj_weight_first"](this))

    def new_layer(self, experts: int, hidden: int, inter: int, gated: bool) -> torch.nn.Module:
        """The parameters create_weights registers for b12x (one TP rank's shard)."""
        padded = self.prep.b12x_padded_intermediate(inter)
        rows = (2 if gated else 1) * padded
        layer = torch.nn.Module()

        def param(name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0) -> None:
            t = torch.full(shape, fill, dtype=torch.float32).to(dtype)
            layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))

        param("w13_weight", (experts, rows, hidden // 2), torch.uint8)
        param("w2_weight", (experts, hidden, padded // 2), torch.uint8)
        param("w13_weight_scale", (experts, rows, hidden // 16), torch.float8_e4m3fn)
        param("w2_weight_scale", (experts, hidden, padded // 16), torch.float8_e4m3fn)
        for name in ("w13", "w2"):  # create_weights: Parameter(swizzle_blockscale(...))
            raw = getattr(layer, f"{name}_weight_scale")
            swizzled = self.prep.swizzle_blockscale_128x4(raw.data)
            layer.register_parameter(
                f"{name}_blockscale_swizzled", torch.nn.Parameter(swizzled, requires_grad=False)
            )
        param("w13_weight_scale_2", (experts, 2) if gated else (experts,), torch.float32)
        param("w2_weight_scale_2", (experts,), torch.float32)
        param("w13_input_scale", (experts, 2 if gated else 1), torch.float32, 1.0)
        param("w2_input_scale", (experts,), torch.float32, 1.0)
        return layer

    def load(
        self,
        layer: torch.nn.Module,
        ckpt: dict[str, Tensor],
        gated: bool,
        tp_size: int = 1,
        tp_rank: int = 0,
        first_expert: int = 0,
    ) -> None:
        """FusedMoE.weight_loader's ModelOpt NVFP4 path for every expert tensor."""
        g = self.loader
        this = SimpleNamespace(
            moe_runner_config=SimpleNamespace(is_gated=gated),
            quant_method=SimpleNamespace(load_up_proj_weight_first=self.up_first(gated)),
            use_padded_loading=False,
            use_presharded_weights=False,
            use_triton_kernels=False,
            moe_tp_size=tp_size,
            moe_tp_rank=tp_rank,
            quant_config=SimpleNamespace(get_name=lambda: "modelopt_fp4"),
        )
        for name in (
            "_load_w13",
            "_load_w2",
            "_load_model_weight_or_group_weight_scale",
            "_load_per_tensor_weight_scale",
        ):
            setattr(this, name, g[name].__get__(this))
        shards = [("w1", "gate"), ("w3", "up")] if gated else [("w1", "gate")]
        for i in range(ckpt["w2"].shape[0]):
            e = first_expert + i
            for shard, half in shards:
                for suffix, param in (("", "w13_weight"), ("_s", "w13_weight_scale")):
                    this._load_model_weight_or_group_weight_scale(
                        shard_dim=0,
                        expert_data=getattr(layer, param).data[e],
                        shard_id=shard,
                        loaded_weight=ckpt[half + suffix][i],
                    )
                this._load_per_tensor_weight_scale(
                    shard_id=shard,
                    param=layer.w13_weight_scale_2,
                    loaded_weight=ckpt[half + "_s2"][i],
                    expert_id=e,
                )
            for suffix, param in (("", "w2_weight"), ("_s", "w2_weight_scale")):
                this._load_model_weight_or_group_weight_scale(
                    shard_dim=1,
                    expert_data=getattr(layer, param).data[e],
                    shard_id="w2",
                    loaded_weight=ckpt["w2" + suffix][i],
                )
            this._load_per_tensor_weight_scale(
                shard_id="w2",
                param=layer.w2_weight_scale_2,
                loaded_weight=ckpt["w2_s2"][i],
                expert_id=e,
            )
            layer.w13_input_scale.data[e] = ckpt["input_scale"][i]

    def process(self, layer: torch.nn.Module, gated: bool) -> dict[str, Any]:
        self.prep.process_b12x_nvfp4_layer(layer, is_gated=gated, bind=self.bind, alias=self.alias)
        weights: dict[str, Any] = self.prep.b12x_layer_weights(layer)
        return weights


def _b12x_backend() -> Any:
    return SimpleNamespace(is_flashinfer_b12x=lambda: True)


def quantize(w: Tensor, amax: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """ModelOpt NVFP4 of one [rows, K] weight: (FP4 uint8, E4M3 scales, weight_scale_2)."""
    scale_2 = (w.abs().max() if amax is None else amax).float() / (FP4_MAX * E4M3_MAX)
    packed, scales = _fp4_quantize_reference(w, global_scale=(1.0 / scale_2).reshape(1))
    return packed, scales, scale_2


def dequant(packed: Tensor, scales: Tensor, scale_2: Tensor) -> Tensor:
    return _dequantize_fp4_tensor(packed, scales, is_ue8m0_scales=False) * scale_2


def checkpoint(
    experts: int,
    hidden: int,
    inter: int,
    gated: bool,
    seed: int,
    tied: bool = True,
    input_amax: float = 4.0,
) -> dict[str, Tensor]:
    """Random experts as a ModelOpt checkpoint stores them (unsharded, per expert).

    ``tied``: gate and up share one weight_scale_2 (one amax over both); untied halves
    get their own. ``input_scale`` is calibrated as ModelOpt does: amax / (6 * 448)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[Tensor]] = {}
    halves = ("gate", "up") if gated else ("gate",)
    for e in range(experts):
        raw = [
            torch.randn(inter, hidden, generator=gen) * (0.02 * (h + 1) + 0.01 * e)
            for h in range(len(halves))
        ]
        amax = torch.stack([r.abs().max() for r in raw]).max() if tied else None
        for half, r in zip(halves, raw, strict=True):
            packed, scales, scale_2 = quantize(r, amax)
            for key, value in (
                ("", packed),
                ("_s", scales),
                ("_s2", scale_2),
                ("_deq", dequant(packed, scales, scale_2)),
            ):
                out.setdefault(half + key, []).append(value)
        w2 = torch.randn(hidden, inter, generator=gen) * 0.03
        packed, scales, scale_2 = quantize(w2)
        for key, value in (
            ("", packed),
            ("_s", scales),
            ("_s2", scale_2),
            ("_deq", dequant(packed, scales, scale_2)),
        ):
            out.setdefault("w2" + key, []).append(value)
        cal = input_amax * (1 + 0.1 * e) / (FP4_MAX * E4M3_MAX)
        out.setdefault("input_scale", []).append(torch.full((len(halves),), cal))
    ckpt = {k: torch.stack(v) for k, v in out.items()}
    ckpt["deq13"] = torch.cat([ckpt[h + "_deq"] for h in halves], dim=1)  # [gate, up]
    return ckpt


def shard(ckpt: dict[str, Tensor], tp_size: int, tp_rank: int, gated: bool) -> dict[str, Tensor]:
    """What one TP rank computes with (the dequantized rows/columns it holds)."""
    inter = ckpt["w2_deq"].shape[2] // tp_size
    rows = slice(tp_rank * inter, (tp_rank + 1) * inter)
    halves = ("gate", "up") if gated else ("gate",)
    out = dict(ckpt)
    out["deq13"] = torch.cat([ckpt[h + "_deq"][:, rows] for h in halves], dim=1)
    out["w2_deq"] = ckpt["w2_deq"][:, :, rows]
    return out


def held_bytes(*owners: Any) -> int:
    """Bytes of the distinct storages the owners' tensors (parameters, attributes,
    dict/tuple values, one level deep) keep alive."""
    storages: dict[int, int] = {}

    def visit(value: Any, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            s = value.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        elif isinstance(value, dict) and depth < 3:
            for v in value.values():
                visit(v, depth + 1)
        elif isinstance(value, (list, tuple)) and depth < 3:
            for v in value:
                visit(v, depth + 1)
        elif hasattr(value, "__dataclass_fields__") and depth < 3:
            for name in value.__dataclass_fields__:
                visit(getattr(value, name), depth + 1)

    for owner in owners:
        if isinstance(owner, torch.nn.Module):
            for t in list(owner.parameters()) + list(owner.buffers()):
                visit(t)
            for v in vars(owner).values():
                if not isinstance(v, dict) or v is not owner._parameters:
                    visit(v)
        else:
            visit(owner)
    return sum(storages.values())


def checkpoint_expert_bytes(experts: int, hidden: int, inter: int, gated: bool) -> int:
    """FP4 weights + E4M3 block scales of one rank's experts, as stored."""
    rows = (2 if gated else 1) * inter
    return experts * (
        rows * hidden // 2 + rows * hidden // 16 + hidden * inter // 2 + hidden * inter // 16
    )
