"""The fork's b12x glue against FlashInfer's own torch reference, on a CPU.

sm120-b12x-moe-runner.patch loads ModelOpt NVFP4 experts straight into the layout of
FlashInfer's b12x fused MoE and calls ``B12xMoEWrapper.run`` / ``b12x_fused_moe``;
sm120-b12x-fp4-gemm.patch calls ``mm_fp4(backend="b12x")``. No SM12x GPU runs here, so
the glue is proven as follows (tests/gates/b12x_glue.py runs the patched tree's own
loader, ``load_up_proj_weight_first`` and ``process_b12x_nvfp4_layer``):

* random experts are quantized the ModelOpt way (FP4 values, E4M3 block scales of 16,
  fp32 ``weight_scale_2``; gate and up with different scales; the FC1 input scale
  calibrated as amax / (6 * 448)) by FlashInfer's reference quantizer, and a plain
  torch MoE on their dequantized weights is the expectation;
* the layer's operands (``b12x_layer_weights``) go into FlashInfer's
  ``_b12x_fused_moe_reference`` (trace/templates/moe.py; it computes
  ``silu(rows[I:]) * rows[:I]`` and quantizes the FC2 input per block with
  ``fc2_input_scale``), and for relu2, whose rows the reference does not split, into the
  same torch MoE through FlashInfer's dequantizer;
* the FC1 input quantization, which the reference leaves out, is modelled as the kernel
  does it (cute_dsl/fp4_common.py ``quantize_block_fp4``: block scale
  ``amax / (6 * input_global_scale)``; ``launch_sm120_moe`` folds
  ``w1_alpha * input_global_scale``);
* the MMA-layout scales are read back with the inverse FlashInfer's
  ``_cute_dsl_fused_moe_reference`` uses (``permute(5, 2, 1, 0, 4, 3)``), and the
  swizzle is compared byte for byte with sglang's ``swizzle_blockscale``;
* the calls into ``b12x_fused_moe``, ``B12xMoEWrapper`` and ``mm_fp4`` are bound to
  FlashInfer's real signatures (names read from the patched sources, not restated).

A wrong gate/up order, scale layout, alpha or FC2 input scale moves the output by
O(1); the correct glue matches within bf16 rounding. Mutations run against this module
(`--gate-tree mutant=DIR`), each failing the tests named:
2026-12-03: [gate, up] left unswapped: SwiGLU relative error 0.49-1.01 (limit 0.02); the
128x4 swizzle's permute(0, 1, 4, 3, 2, 5) as (0, 1, 4, 2, 3, 5): SwiGLU 0.57-0.89, relu2
0.73-0.81 (limit 1e-5); fc2_input_scale set to the calibrated input scale: untied
SwiGLU 0.60.
2026-12-07 (issue 37: the 9 tests of that day passed both of the first two):
input_global_scale inverted (1 / input_scale in process_b12x_nvfp4_layer):
test_fc1_input_scale_follows_the_kernels_convention 0.99 (limit 0.02); b12x dropped from
load_up_proj_weight_first (the loader leaves [gate, up], as the old glue did without its
w13_weight write-back): test_swiglu_layer_matches_flashinfer_reference 0.49-1.01 (limit
0.02) on all four shapes, the FC1 input test 0.60, the untied test 0.36 (limit 0.12).
Runs in the gate environment (`nox -s gate_tests`).
"""

from __future__ import annotations

import ast
import inspect
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from sm120fork.harness import trees

torch = pytest.importorskip("torch")
flashinfer = pytest.importorskip("flashinfer")
from flashinfer.trace.templates.moe import (  # type: ignore[import-not-found]  # noqa: E402
    _b12x_fused_moe_reference,
    _dequantize_fp4_tensor,
)
from flashinfer.trace.templates.quantize import (  # type: ignore[import-not-found]  # noqa: E402
    _fp4_quantize_reference,
)

from . import b12x_glue  # noqa: E402

Tensor = Any  # Tensor: the tool's type check runs without torch
RUNNER = "sglang/srt/layers/moe/moe_runner/flashinfer_b12x.py"
FP4_UTILS = "sglang/srt/layers/quantization/fp4_utils.py"
QUANT_UTILS = "sglang/srt/layers/quantization/utils.py"
MODELOPT = "sglang/srt/layers/quantization/modelopt_quant.py"


@pytest.fixture(scope="module")
def patched(gate_trees: dict[str, trees.Tree], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A patched tree's python directory (the one the matrix uses, else a fresh one)."""
    for tree in gate_trees.values():
        if tree.mode == trees.PATCHED:
            return tree.path
    return trees.build_patched_tree(tmp_path_factory.mktemp("b12x-patched")).path


@pytest.fixture(scope="module")
def glue(patched: Path) -> b12x_glue.Glue:
    return b12x_glue.Glue(patched)


def _routing(
    tokens: int, experts: int, top_k: int, hidden: int, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
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


def _fc1_input(x: Tensor, gs: Tensor) -> Tensor:
    """The kernel's FC1 input quantization with input_global_scale ``gs`` (fp4_common
    quantize_block_fp4: block scale amax / (6 * gs), values x / (scale * gs)),
    dequantized: the reference quantizer takes the reciprocal (a multiplier)."""
    packed, scales = _fp4_quantize_reference(x.float(), global_scale=(1.0 / gs).reshape(1))
    return (_dequantize_fp4_tensor(packed, scales, is_ue8m0_scales=False) * gs).to(x.dtype)


def _reference(
    view: dict[str, Any],
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    experts: int,
    top_k: int,
    fc1_quant: bool = False,
) -> Tensor:
    rows, hidden = view["w1_weight"].shape[1], view["w1_weight"].shape[2] * 2
    inter = view["w2_weight"].shape[2] * 2
    if fc1_quant:
        x = _fc1_input(x, view["input_global_scale"].float())
    return _b12x_fused_moe_reference(
        x,
        view["w1_weight"],
        _mma_to_logical(view["w1_weight_sf"], rows, hidden),
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


def _rel_err(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


# (experts, hidden, checkpoint intermediate, top_k, tp_size, tp_rank): per-rank sizes
# 64, 192 (padded to 256 at load), 128 and 96 (TP shards of 256 and 192).
SWIGLU_SHAPES = [
    (4, 128, 64, 2, 1, 0),
    (3, 96, 192, 2, 1, 0),
    (8, 256, 256, 4, 2, 1),
    (2, 128, 192, 2, 2, 0),
]


@pytest.mark.parametrize(("experts", "hidden", "inter", "top_k", "tp", "rank"), SWIGLU_SHAPES)
def test_swiglu_layer_matches_flashinfer_reference(
    glue: b12x_glue.Glue, experts: int, hidden: int, inter: int, top_k: int, tp: int, rank: int
) -> None:
    """Loaded by sglang's loader in the order load_up_proj_weight_first asks, processed,
    read as views: FlashInfer's reference agrees with the dequantized MoE."""
    ckpt = b12x_glue.checkpoint(experts, hidden, inter, gated=True, seed=experts * hidden + inter)
    layer = glue.new_layer(experts, hidden, inter // tp, gated=True)
    glue.load(layer, ckpt, gated=True, tp_size=tp, tp_rank=rank)
    view = glue.process(layer, gated=True)
    x, ids, weights = _routing(5, experts, top_k, hidden, seed=inter)
    got = _reference(view, x, ids, weights, experts, top_k)
    local = b12x_glue.shard(ckpt, tp, rank, gated=True)
    want = _torch_moe(x, ids, weights, local["deq13"], local["w2_deq"], "silu")
    assert _rel_err(got, want) < 2e-2  # bf16 output rounding; a layout slip is O(1)
    assert float(view["fc2_input_scale"]) == 1.0  # vLLM PR 40082: never the calibrated value
    assert view["w1_weight"].data_ptr() == layer.w13_weight.data_ptr()  # held once


def test_fc1_input_scale_follows_the_kernels_convention(glue: b12x_glue.Glue) -> None:
    """input_global_scale as the kernel reads it (its FC1 input quantization and the
    folded alpha, modelled from fp4_common.quantize_block_fp4) against the input
    quantized as ModelOpt calibrated it (global scale 1 / input_scale, input_scale =
    amax / (6 * 448)) through the dequantized MoE. The inverse convention's block
    scales underflow E4M3 and the output collapses."""
    experts, hidden, inter, top_k = 4, 128, 64, 2
    ckpt = b12x_glue.checkpoint(experts, hidden, inter, gated=True, seed=7)
    layer = glue.new_layer(experts, hidden, inter, gated=True)
    glue.load(layer, ckpt, gated=True)
    view = glue.process(layer, gated=True)
    x, ids, weights = _routing(6, experts, top_k, hidden, seed=9)
    got = _reference(view, x, ids, weights, experts, top_k, fc1_quant=True)
    input_scale = ckpt["input_scale"].max()
    packed, scales = _fp4_quantize_reference(x.float(), global_scale=(1 / input_scale).reshape(1))
    calibrated = (_dequantize_fp4_tensor(packed, scales, False) * input_scale).to(x.dtype)
    want = _torch_moe(calibrated, ids, weights, ckpt["deq13"], ckpt["w2_deq"], "silu")
    assert _rel_err(got, want) < 2e-2


def test_untied_gate_up_scales_share_one_alpha(glue: b12x_glue.Glue) -> None:
    """Gate and up with different weight_scale_2: b12x takes one alpha per expert, so
    the smaller half's block scales absorb the ratio. Their E4M3 rounding (up to 1/16
    per block) costs ~8% here; ignoring or inverting the ratio costs 40% and more."""
    experts, hidden, inter, top_k = 4, 128, 64, 2
    ckpt = b12x_glue.checkpoint(experts, hidden, inter, gated=True, seed=11, tied=False)
    assert not torch.allclose(ckpt["gate_s2"], ckpt["up_s2"])
    layer = glue.new_layer(experts, hidden, inter, gated=True)
    glue.load(layer, ckpt, gated=True)
    view = glue.process(layer, gated=True)
    assert torch.equal(view["w1_alpha"], torch.maximum(ckpt["gate_s2"], ckpt["up_s2"]))
    x, ids, weights = _routing(5, experts, top_k, hidden, seed=5)
    got = _reference(view, x, ids, weights, experts, top_k)
    want = _torch_moe(x, ids, weights, ckpt["deq13"], ckpt["w2_deq"], "silu")
    assert _rel_err(got, want) < 0.12


@pytest.mark.parametrize(("experts", "hidden", "inter"), [(4, 128, 96), (2, 64, 256)])
def test_relu2_layer_matches_dequantized_moe(
    glue: b12x_glue.Glue, experts: int, hidden: int, inter: int
) -> None:
    ckpt = b12x_glue.checkpoint(experts, hidden, inter, gated=False, seed=hidden + inter)
    layer = glue.new_layer(experts, hidden, inter, gated=False)
    glue.load(layer, ckpt, gated=False)
    view = glue.process(layer, gated=False)
    rows, inter_pad = view["w1_weight"].shape[1], view["w2_weight"].shape[2] * 2
    x, ids, weights = _routing(4, experts, 2, hidden, seed=inter)
    w13 = _dequantize_fp4_tensor(
        view["w1_weight"], _mma_to_logical(view["w1_weight_sf"], rows, hidden), False
    ) * view["w1_alpha"].view(-1, 1, 1)
    w2 = _dequantize_fp4_tensor(
        view["w2_weight"], _mma_to_logical(view["w2_weight_sf"], hidden, inter_pad), False
    ) * view["w2_alpha"].view(-1, 1, 1)
    got = _torch_moe(x, ids, weights, w13, w2, "relu2")
    want = _torch_moe(x, ids, weights, ckpt["deq13"], ckpt["w2_deq"], "relu2")
    assert _rel_err(got, want) < 1e-5


def test_swizzle_is_sglangs_and_the_mma_operand_a_view(patched: Path, glue: b12x_glue.Glue) -> None:
    """The scales b12x reads are sglang's swizzle_blockscale bytes (so the
    *_blockscale_swizzled placeholder holds them) and the 6-D operand is a view."""
    tree = ast.parse((patched / QUANT_UTILS).read_text())
    fn = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "swizzle_blockscale"
    )
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), QUANT_UTILS, "exec"), namespace)
    scale = torch.rand(3, 256, 24).mul(400).to(torch.float8_e4m3fn)
    ours = glue.prep.swizzle_blockscale_128x4(scale)
    assert torch.equal(
        ours.view(torch.uint8), namespace["swizzle_blockscale"](scale).view(torch.uint8)
    )
    mma = glue.prep.mma_view(ours, 256, 24 * 16)
    assert mma.untyped_storage().data_ptr() == ours.untyped_storage().data_ptr()
    assert torch.equal(
        _mma_to_logical(mma, 256, 24 * 16).view(torch.uint8), scale.view(torch.uint8)
    )


def test_view_has_flashinfers_keys(glue: b12x_glue.Glue) -> None:
    """The same weight view flashinfer.fused_moe.prepare_b12x_nvfp4_weights documents."""
    import flashinfer.fused_moe.prepare as fi_prepare  # type: ignore[import-not-found]

    doc = inspect.getsource(fi_prepare.prepare_b12x_nvfp4_weights)
    layer = glue.new_layer(2, 64, 64, gated=True)
    glue.load(layer, b12x_glue.checkpoint(2, 64, 64, gated=True, seed=3), gated=True)
    view = glue.process(layer, gated=True)
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
