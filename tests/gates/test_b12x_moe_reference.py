"""The fork's b12x glue against FlashInfer's own torch reference, on a CPU.

sm120-b12x-moe-runner.patch turns ModelOpt NVFP4 expert tensors into the weight view
of FlashInfer's b12x fused MoE (layers/moe/b12x_weights.py) and calls
``B12xMoEWrapper.run`` / ``b12x_fused_moe``; sm120-b12x-fp4-gemm.patch calls
``mm_fp4(backend="b12x")``. No SM12x GPU runs here, so the glue is proven as follows:

* random experts are quantized the ModelOpt way (FP4 values, E4M3 block scales of 16,
  fp32 ``weight_scale_2``; gate and up with different scales) by FlashInfer's reference
  quantizer, and a plain torch MoE on their dequantized weights is the expectation;
* the patched tree's weight preparation is fed into FlashInfer's
  ``_b12x_fused_moe_reference`` (trace/templates/moe.py; it computes
  ``silu(rows[I:]) * rows[:I]`` and quantizes the FC2 input per block with
  ``fc2_input_scale``), and for relu2, whose rows the reference does not split, into the
  same torch MoE through FlashInfer's dequantizer;
* the MMA-layout scales are read back with the inverse FlashInfer's
  ``_cute_dsl_fused_moe_reference`` uses (``permute(5, 2, 1, 0, 4, 3)``);
* the calls into ``b12x_fused_moe``, ``B12xMoEWrapper`` and ``mm_fp4`` are bound to
  FlashInfer's real signatures (names read from the patched sources, not restated).

A wrong gate/up order, scale layout, alpha or FC2 input scale moves the output by
O(1); the correct glue matches within bf16 rounding. Mutations of b12x_weights.py
run against this module (2026-12-03, `--gate-tree mutant=DIR`): [gate, up] left
unswapped: SwiGLU relative error 0.49-1.01 (limit 0.02); the 128x4 swizzle's
permute(0, 1, 4, 3, 2, 5) as (0, 1, 4, 2, 3, 5): SwiGLU 0.57-0.89, relu2 0.73-0.81
(limit 1e-5); fc2_input_scale set to the calibrated input scale: untied SwiGLU 0.60.
Runs in the gate environment (`nox -s gate_tests`).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import typing
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sm120fork.harness import trees

torch = pytest.importorskip("torch")
flashinfer = pytest.importorskip("flashinfer")
Tensor = Any  # Tensor: the tool's type check runs without torch
from flashinfer.trace.templates.moe import (  # type: ignore[import-not-found]  # noqa: E402
    _b12x_fused_moe_reference,
    _dequantize_fp4_tensor,
)
from flashinfer.trace.templates.quantize import (  # type: ignore[import-not-found]  # noqa: E402
    _fp4_quantize_reference,
)

WEIGHTS = "sglang/srt/layers/moe/b12x_weights.py"
RUNNER = "sglang/srt/layers/moe/moe_runner/flashinfer_b12x.py"
FP4_UTILS = "sglang/srt/layers/quantization/fp4_utils.py"
MODELOPT = "sglang/srt/layers/quantization/modelopt_quant.py"
FP4_MAX, E4M3_MAX = 6.0, 448.0


@pytest.fixture(scope="module")
def patched(gate_trees: dict[str, trees.Tree], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A patched tree's python directory (the one the matrix uses, else a fresh one)."""
    for tree in gate_trees.values():
        if tree.mode == trees.PATCHED:
            return tree.path
    return trees.build_patched_tree(tmp_path_factory.mktemp("b12x-patched")).path


@pytest.fixture(scope="module")
def prep(patched: Path) -> ModuleType:
    """layers/moe/b12x_weights.py of the patched tree (torch only: loadable on a CPU)."""
    spec = importlib.util.spec_from_file_location("b12x_weights_under_test", patched / WEIGHTS)
    assert spec is not None and spec.loader is not None, patched / WEIGHTS
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _quantize(w: Tensor, amax: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """ModelOpt NVFP4 of one [rows, K] weight: (FP4 uint8, E4M3 scales, weight_scale_2)."""
    scale_2 = (w.abs().max() if amax is None else amax).float() / (FP4_MAX * E4M3_MAX)
    packed, scales = _fp4_quantize_reference(w, global_scale=(1.0 / scale_2).reshape(1))
    return packed, scales, scale_2


def _dequant(packed: Tensor, scales: Tensor, scale_2: Tensor) -> Tensor:
    return _dequantize_fp4_tensor(packed, scales, is_ue8m0_scales=False) * scale_2


def _checkpoint(
    experts: int, hidden: int, inter: int, gated: bool, seed: int, tied: bool = True
) -> dict[str, Tensor]:
    """Random experts as a ModelOpt checkpoint loads into sglang ([gate, up] rows).

    ``tied``: gate and up share one weight_scale_2 (one amax over both, as exported
    fused layers have); untied halves get their own, and their magnitudes differ."""
    gen = torch.Generator().manual_seed(seed)
    layer: dict[str, list[Tensor]] = {
        k: [] for k in ("w13", "s13", "s13_2", "w2", "s2", "s2_2", "deq13", "deq2")
    }
    for e in range(experts):
        halves = [
            torch.randn(inter, hidden, generator=gen) * (0.02 * (h + 1) + 0.01 * e)
            for h in range(2 if gated else 1)
        ]
        amax = torch.stack([h.abs().max() for h in halves]).max() if tied else None
        quantized = [_quantize(h, amax) for h in halves]
        layer["w13"].append(torch.cat([q[0] for q in quantized]))
        layer["s13"].append(torch.cat([q[1] for q in quantized]))
        layer["s13_2"].append(torch.stack([q[2] for q in quantized]))
        layer["deq13"].append(torch.cat([_dequant(*q) for q in quantized]))
        w2 = torch.randn(hidden, inter, generator=gen) * 0.03
        packed, scales, scale_2 = _quantize(w2)
        layer["w2"].append(packed)
        layer["s2"].append(scales)
        layer["s2_2"].append(scale_2)
        layer["deq2"].append(_dequant(packed, scales, scale_2))
    out = {k: torch.stack(v) for k, v in layer.items()}
    out["input_scale"] = torch.tensor([0.37, 0.41])  # per-expert-pair calibration, any value
    return out


def _routing(
    tokens: int, experts: int, top_k: int, hidden: int, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(tokens, hidden, generator=gen)).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return x, ids.to(torch.int32), weights.float()


def _fc2_input(act: Tensor) -> Tensor:
    """The kernel's per-block FP4 quantization of the FC2 input, global scale 1."""
    packed, scales = _fp4_quantize_reference(act, global_scale=torch.ones(1))
    return _dequantize_fp4_tensor(packed, scales, is_ue8m0_scales=False)


def _torch_moe(
    x: Tensor, ids: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, activation: str
) -> Tensor:
    """Plain MoE on dequantized [gate, up] (or relu2) weights."""
    out = torch.zeros(x.shape[0], w2.shape[1])
    a = x.float()
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e] @ a[t]
            if activation == "silu":
                gate, up = h.chunk(2)
                act = torch.nn.functional.silu(gate) * up
            else:
                act = torch.relu(h) ** 2
            out[t] += weights[t, k] * (w2[e] @ _fc2_input(act[None])[0])
    return out


def _mma_to_logical(sf: Tensor, rows: int, cols: int) -> Tensor:
    """6-D MMA scales -> [E, rows, cols/16] E4M3 (FlashInfer's own inverse)."""
    groups = sf.shape[5]
    logical = sf.permute(5, 2, 1, 0, 4, 3).contiguous().reshape(groups, -1, sf.shape[4] * 4)
    return logical[:, :rows, : cols // 16].view(torch.float8_e4m3fn)


def _prepare(prep: ModuleType, ckpt: dict[str, Tensor], gated: bool) -> dict[str, Any]:
    view: dict[str, Any] = prep.prepare_b12x_nvfp4_moe_weights(
        ckpt["w13"],
        ckpt["s13"],
        ckpt["s13_2"].squeeze(-1) if not gated else ckpt["s13_2"],
        ckpt["input_scale"],
        ckpt["w2"],
        ckpt["s2"],
        ckpt["s2_2"],
        is_gated=gated,
        device=torch.device("cpu"),
    )
    return view


def _rel_err(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


SWIGLU_SHAPES = [(4, 128, 64, 2), (3, 96, 192, 2), (8, 256, 128, 4)]


@pytest.mark.parametrize(("experts", "hidden", "inter", "top_k"), SWIGLU_SHAPES)
def test_swiglu_prep_matches_flashinfer_reference(
    prep: ModuleType, experts: int, hidden: int, inter: int, top_k: int
) -> None:
    ckpt = _checkpoint(experts, hidden, inter, gated=True, seed=experts * hidden + inter)
    x, ids, weights = _routing(5, experts, top_k, hidden, seed=inter)
    view = _prepare(prep, ckpt, gated=True)
    got = _b12x_fused_moe_reference(
        x,
        view["w1_weight"],
        _mma_to_logical(view["w1_weight_sf"], 2 * inter, hidden),
        view["w2_weight"],
        _mma_to_logical(view["w2_weight_sf"], hidden, inter),
        ids,
        weights,
        experts,
        top_k,
        w1_alpha=view["w1_alpha"],
        w2_alpha=view["w2_alpha"],
        fc2_input_scale=view["fc2_input_scale"],
    )
    want = _torch_moe(x, ids, weights, ckpt["deq13"], ckpt["deq2"], "silu")
    assert _rel_err(got, want) < 2e-2  # bf16 output rounding; a layout slip is O(1)
    assert float(view["fc2_input_scale"]) == 1.0  # vLLM PR 40082: never the calibrated value
    assert torch.equal(view["input_global_scale"], ckpt["input_scale"].max().reshape(1))


def test_untied_gate_up_scales_share_one_alpha(prep: ModuleType) -> None:
    """Gate and up with different weight_scale_2: b12x takes one alpha per expert, so
    the smaller half's block scales absorb the ratio. Their E4M3 rounding (up to 1/16
    per block) costs ~8% here; ignoring or inverting the ratio costs 40% and more."""
    experts, hidden, inter, top_k = 4, 128, 64, 2
    ckpt = _checkpoint(experts, hidden, inter, gated=True, seed=11, tied=False)
    assert not torch.allclose(ckpt["s13_2"][:, 0], ckpt["s13_2"][:, 1])
    x, ids, weights = _routing(5, experts, top_k, hidden, seed=5)
    view = _prepare(prep, ckpt, gated=True)
    assert torch.equal(view["w1_alpha"], ckpt["s13_2"].max(dim=1).values)
    got = _b12x_fused_moe_reference(
        x,
        view["w1_weight"],
        _mma_to_logical(view["w1_weight_sf"], 2 * inter, hidden),
        view["w2_weight"],
        _mma_to_logical(view["w2_weight_sf"], hidden, inter),
        ids,
        weights,
        experts,
        top_k,
        w1_alpha=view["w1_alpha"],
        w2_alpha=view["w2_alpha"],
        fc2_input_scale=view["fc2_input_scale"],
    )
    want = _torch_moe(x, ids, weights, ckpt["deq13"], ckpt["deq2"], "silu")
    assert _rel_err(got, want) < 0.12


@pytest.mark.parametrize(("experts", "hidden", "inter"), [(4, 128, 96), (2, 64, 256)])
def test_relu2_prep_matches_dequantized_moe(
    prep: ModuleType, experts: int, hidden: int, inter: int
) -> None:
    ckpt = _checkpoint(experts, hidden, inter, gated=False, seed=hidden + inter)
    x, ids, weights = _routing(4, experts, 2, hidden, seed=inter)
    view = _prepare(prep, ckpt, gated=False)
    w13 = _dequantize_fp4_tensor(
        view["w1_weight"], _mma_to_logical(view["w1_weight_sf"], inter, hidden), False
    ) * view["w1_alpha"].view(-1, 1, 1)
    w2 = _dequantize_fp4_tensor(
        view["w2_weight"], _mma_to_logical(view["w2_weight_sf"], hidden, inter), False
    ) * view["w2_alpha"].view(-1, 1, 1)
    got = _torch_moe(x, ids, weights, w13, w2, "relu2")
    want = _torch_moe(x, ids, weights, ckpt["deq13"], ckpt["deq2"], "relu2")
    assert _rel_err(got, want) < 1e-5


def test_view_has_flashinfers_keys(prep: ModuleType) -> None:
    """The same weight view flashinfer.fused_moe.prepare_b12x_nvfp4_weights documents."""
    import flashinfer.fused_moe.prepare as fi_prepare  # type: ignore[import-not-found]

    doc = inspect.getsource(fi_prepare.prepare_b12x_nvfp4_weights)
    ckpt = _checkpoint(2, 64, 64, gated=True, seed=3)
    view = _prepare(prep, ckpt, gated=True)
    for key in set(view) - {"input_global_scale"}:
        assert f'"{key}"' in doc, key
    assert view["w1_weight_sf"].dtype == torch.uint8  # as fp4_quantize's scales


def _module_ast(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _literal(tree: ast.Module, name: str) -> Any:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found")


def _call_keywords(tree: ast.AST, func: str) -> list[list[str]]:
    """Keyword names of every call to `func` (a name or an attribute)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            target = (
                node.func.attr
                if isinstance(node.func, ast.Attribute)
                else getattr(node.func, "id", None)
            )
            if target == func:
                found.append([k.arg for k in node.keywords if k.arg])
    return found


def test_runner_calls_bind_to_flashinfer_signatures(patched: Path) -> None:
    tree = _module_ast(patched / RUNNER)
    weight_keys = _literal(tree, "RUN_WEIGHT_KEYS")
    routed = {"x": 0, "token_selected_experts": 0, "token_final_scales": 0}
    run = dict.fromkeys(weight_keys, 0) | routed
    inspect.signature(flashinfer.B12xMoEWrapper.run).bind(None, **run)
    for keywords in _call_keywords(tree, "b12x_fused_moe"):
        inspect.signature(flashinfer.b12x_fused_moe).bind(**run, **dict.fromkeys(keywords, 0))
    wrappers = _call_keywords(tree, "B12xMoEWrapper")
    assert wrappers, "no B12xMoEWrapper(...) call found"
    shape_keys = (
        "num_experts",
        "top_k",
        "hidden_size",
        "intermediate_size",
        "activation",
        "device",
    )
    for keywords in wrappers:
        shared = ("shared_static_workspace", "shared_dynamic_workspace", "shared_output")
        kwargs = dict.fromkeys([*shape_keys, *keywords, *shared], 0)
        inspect.signature(flashinfer.B12xMoEWrapper.__init__).bind(None, **kwargs)


def test_fp4_gemm_backend_binds_to_mm_fp4(patched: Path) -> None:
    """flashinfer_b12x maps to mm_fp4's "b12x", called as ModelOpt's fp4_gemm calls it."""
    tree = _module_ast(patched / FP4_UTILS)
    enum_def = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Fp4GemmRunnerBackend"
    )
    namespace: dict[str, Any] = {"Enum": Enum}
    exec(compile(ast.Module(body=[enum_def], type_ignores=[]), FP4_UTILS, "exec"), namespace)
    backend = namespace["Fp4GemmRunnerBackend"]("flashinfer_b12x").get_flashinfer_backend()
    signature = inspect.signature(flashinfer.mm_fp4)
    assert backend in typing.get_args(signature.parameters["backend"].annotation)
    calls = [
        n
        for n in ast.walk(_module_ast(patched / MODELOPT))
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "flashinfer_fp4_gemm"
    ]
    assert calls, "ModelOpt no longer calls mm_fp4 as flashinfer_fp4_gemm"
    for call in calls:
        signature.bind(*range(len(call.args)), **{str(k.arg): backend for k in call.keywords})
