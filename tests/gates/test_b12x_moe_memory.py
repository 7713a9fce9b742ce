"""Memory and reload of the fork's b12x MoE layer, on a CPU (issue 37, items 2 and 3).

One layer's experts go through the patched tree's loader and
``process_b12x_nvfp4_layer`` (tests/gates/b12x_glue.py), then through FlashInfer's
real ``B12xMoEWrapper.run`` and ``launch_sm120_moe`` with only the two kernel launches
(``launch_sm120_static_moe`` / ``launch_sm120_dynamic_moe``) replaced by recorders, once
as a decode batch (static backend) and once as a prefill batch (dynamic backend).

* memory: the bytes the layer, the wrapper and FlashInfer's module caches
  (``_PADDED_WEIGHT_CACHE``, ``_WEIGHT_CACHE``) hold afterwards, over the checkpoint's
  expert bytes for that rank, equal ``b12x_memory_ratio`` (what the argument-time
  default reads) and nothing is padded or copied on the first forward: at per-rank
  sizes 128, 192, 384, 1856 the ratio is the padding to 256 the static kernel needs
  (2.0, 1.33, 1.33, 1.10), at 256, 512, 2048 it is 1.00;
* reload: processing twice changes no tensor; new weights written through the loader
  into the same parameters (update_weights_from_disk) give exactly the tensors a fresh
  load of them gives, with every parameter's storage kept (captured CUDA graphs);
  the state dict copied into a layer processed on empty weights (sharded_state and
  remote loaders) gives the same operands.

Mutations of b12x_weights.py run against this module (2026-12-07, `--gate-tree
mutant=DIR`): every run deriving from scratch (no per-expert checksums, as the CUTLASS
path does) fails test_processing_twice_changes_nothing and
test_reload_of_one_expert_leaves_the_others; never deriving again (a version counter,
which the loader's ``param.data`` writes do not move) fails
test_reload_gives_the_new_weights_in_the_same_storage and the one-expert reload. Of
arg_groups/b12x_moe.py: the CUDA comparison dropped from b12x_misfit, or the version read
from torch.version.cuda instead of FlashInfer's nvcc: test_cuda_below_13_... fails (13 != 12).
refresh_b12x_fold a no-op: test_reload_refreshes_flashinfers_folded_alpha fails (the
wrapper keeps the old w1_alpha * input_global_scale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sm120fork.harness import trees

torch = pytest.importorskip("torch")
flashinfer = pytest.importorskip("flashinfer")

from . import b12x_glue  # noqa: E402

EXPERTS, HIDDEN, TOP_K = 2, 256, 2


@pytest.fixture(scope="module")
def glue(
    gate_trees: dict[str, trees.Tree], tmp_path_factory: pytest.TempPathFactory
) -> b12x_glue.Glue:
    for tree in gate_trees.values():
        if tree.mode == trees.PATCHED:
            return b12x_glue.Glue(tree.path)
    path: Path = trees.build_patched_tree(tmp_path_factory.mktemp("b12x-patched")).path
    return b12x_glue.Glue(path)


@pytest.fixture
def dispatch(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[tuple[str, int]]]:
    """moe_dispatch with its two kernel launches recording (backend, n) instead."""
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import (  # type: ignore[import-not-found]
        moe_dispatch as md,
    )

    launched: list[tuple[str, int]] = []
    for backend in ("static", "dynamic"):

        def record(backend: str = backend, **kw: Any) -> Any:
            launched.append((backend, kw["n"]))
            return kw["scatter_output"]

        monkeypatch.setattr(md, f"launch_sm120_{backend}_moe", record)
    md._PADDED_WEIGHT_CACHE.clear()
    return md, launched


def _loaded(
    glue: b12x_glue.Glue, inter: int, seed: int, gated: bool = True
) -> tuple[Any, dict[str, Any]]:
    ckpt = b12x_glue.checkpoint(EXPERTS, HIDDEN, inter, gated=gated, seed=seed)
    layer = glue.new_layer(EXPERTS, HIDDEN, inter, gated=gated)
    glue.load(layer, ckpt, gated=gated)
    return layer, glue.process(layer, gated=gated)


def _run(wrapper: Any, view: dict[str, Any], tokens: int) -> None:
    x = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
    ids = torch.randint(0, EXPERTS, (tokens, TOP_K), dtype=torch.int32)
    wrapper.run(
        x=x, token_selected_experts=ids, token_final_scales=torch.ones(tokens, TOP_K), **view
    )


PER_RANK = [64, 128, 192, 256, 384, 512, 1856, 2048]


@pytest.mark.parametrize("inter", PER_RANK)
def test_first_forward_copies_nothing_and_memory_is_predicted(
    glue: b12x_glue.Glue, dispatch: tuple[Any, list[tuple[str, int]]], inter: int
) -> None:
    md, launched = dispatch
    cached = set(md._WEIGHT_CACHE)  # other tests' layers may still be alive
    layer, view = _loaded(glue, inter, seed=inter)
    padded = glue.prep.b12x_padded_intermediate(inter)
    wrapper = flashinfer.B12xMoEWrapper(
        num_experts=EXPERTS,
        top_k=TOP_K,
        hidden_size=HIDDEN,
        intermediate_size=padded,
        use_cuda_graph=False,
        device="cpu",
        quant_mode="nvfp4",
    )
    _run(wrapper, view, tokens=3)  # decode: static backend (pads n to 256 if it must)
    _run(wrapper, view, tokens=600)  # prefill: dynamic backend
    assert launched == [("static", padded), ("dynamic", padded)]
    assert not md._PADDED_WEIGHT_CACHE and wrapper._padded_weights is None
    ours = {k: v for k, v in md._WEIGHT_CACHE.items() if k not in cached}
    held = b12x_glue.held_bytes(layer, wrapper, ours, md._PADDED_WEIGHT_CACHE)
    scalars = b12x_glue.held_bytes(
        layer.w13_weight_scale_2,
        layer.w2_weight_scale_2,
        layer.w13_input_scale,
        layer.w2_input_scale,
        layer.b12x_w1_alpha,
        layer.b12x_input_global_scale,
        layer.b12x_fc2_input_scale,
        wrapper._folded_w1_alpha,
        layer._b12x_fingerprints,
    )
    ratio = (held - scalars) / b12x_glue.checkpoint_expert_bytes(EXPERTS, HIDDEN, inter, True)
    print(f"b12x per-rank intermediate {inter}: expert memory {ratio:.3f}x the checkpoint's")
    assert ratio == pytest.approx(glue.prep.b12x_memory_ratio(HIDDEN, inter, True), rel=1e-9)
    if inter % 256 == 0:
        assert ratio <= glue.prep.B12X_MEMORY_LIMIT


def test_processing_twice_changes_nothing(glue: b12x_glue.Glue) -> None:
    layer, view = _loaded(glue, 192, seed=1)
    before = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    again = glue.process(layer, gated=True)
    for name, tensor in layer.state_dict().items():
        assert torch.equal(tensor.view(torch.uint8), before[name].view(torch.uint8)), name
    for key, value in view.items():
        assert again[key].data_ptr() == value.data_ptr(), key


def _param_bytes(layer: Any) -> dict[str, Any]:
    return {k: v.detach().view(torch.uint8).clone() for k, v in layer.state_dict().items()}


def test_reload_gives_the_new_weights_in_the_same_storage(glue: b12x_glue.Glue) -> None:
    """update_weights_from_disk: the loader writes new weights into the processed layer,
    then process_weights_after_loading runs again."""
    inter, gated = 192, True
    layer, _ = _loaded(glue, inter, seed=1)
    pointers = {k: v.data_ptr() for k, v in layer.state_dict().items()}
    new = b12x_glue.checkpoint(EXPERTS, HIDDEN, inter, gated=gated, seed=2, tied=False)
    glue.load(layer, new, gated=gated)
    glue.process(layer, gated=gated)
    fresh = glue.new_layer(EXPERTS, HIDDEN, inter, gated=gated)
    glue.load(fresh, new, gated=gated)
    glue.process(fresh, gated=gated)
    want = _param_bytes(fresh)
    for name, got in _param_bytes(layer).items():
        assert torch.equal(got, want[name]), name
    assert {k: v.data_ptr() for k, v in layer.state_dict().items()} == pointers
    assert getattr(layer, "_derived_weight_cache_error", None) is None


def test_state_dict_into_a_processed_empty_layer(glue: b12x_glue.Glue) -> None:
    """sharded_state / remote loaders: process_weights_after_loading on empty weights,
    then the saved (processed) state copied in by name."""
    layer, view = _loaded(glue, 384, seed=4)
    target = glue.new_layer(EXPERTS, HIDDEN, 384, gated=True)
    glue.process(target, gated=True)
    params = dict(target.named_parameters(remove_duplicate=False))
    for name, tensor in layer.state_dict().items():
        params[name].data.copy_(tensor)
    got = glue.prep.b12x_layer_weights(target)
    for key, value in view.items():
        assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key


def test_workspace_bytes_of_a_large_model() -> None:
    """The CUDA-graph workspaces one shape's wrappers share (B12xMoEWrapper
    ._allocate_buffers), on the meta device: Qwen3.5-397B-A17B NVFP4 at TP4 (512
    experts, top 10, hidden 4096, 256 per rank) for 8192 and 16384 tokens. The runner
    builds them when the weights are processed, before the KV pool is sized."""
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import (
        moe_dispatch as md,
    )

    sizes = []
    for tokens in (8192, 16384):
        wrapper = flashinfer.B12xMoEWrapper(
            num_experts=512,
            top_k=10,
            hidden_size=4096,
            intermediate_size=256,
            use_cuda_graph=True,
            max_num_tokens=tokens,
            device="meta",
            quant_mode="nvfp4",
        )
        held: dict[int, int] = {}
        for ws in (wrapper._static_workspace, wrapper._dynamic_workspace, wrapper._moe_output):
            tensors = (
                [ws]
                if isinstance(ws, torch.Tensor)
                else [getattr(ws, f) for f in getattr(ws, "__dataclass_fields__", {})]
            )
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    held[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        sizes.append(sum(held.values()) / 2**30)
        assert md.select_sm120_moe_backend(num_tokens=tokens, num_topk=10) == "dynamic"
    print(
        f"b12x workspaces, Qwen3.5-397B TP4: {sizes[0]:.2f} GiB (8192), {sizes[1]:.2f} GiB (16384)"
    )
    assert 1.0 < sizes[0] < sizes[1] < 2.5


def test_reload_of_one_expert_leaves_the_others(glue: b12x_glue.Glue) -> None:
    """An update that writes one expert's tensors re-derives that expert only."""
    inter = 256
    old = b12x_glue.checkpoint(EXPERTS, HIDDEN, inter, gated=True, seed=5)
    new = b12x_glue.checkpoint(EXPERTS, HIDDEN, inter, gated=True, seed=6, tied=False)
    mixed = {k: torch.cat([old[k][:1], new[k][1:]]) for k in old}
    layer = glue.new_layer(EXPERTS, HIDDEN, inter, gated=True)
    glue.load(layer, old, gated=True)
    glue.process(layer, gated=True)
    glue.load(layer, {k: v[1:] for k, v in new.items()}, gated=True, first_expert=1)
    glue.process(layer, gated=True)
    fresh = glue.new_layer(EXPERTS, HIDDEN, inter, gated=True)
    glue.load(fresh, mixed, gated=True)
    glue.process(fresh, gated=True)
    want = _param_bytes(fresh)
    for name, got in _param_bytes(layer).items():
        assert torch.equal(got, want[name]), name


def test_cuda_below_13_is_refused_as_flashinfer_reads_it(
    glue: b12x_glue.Glue, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The argument-time CUDA check (arg_groups/b12x_moe.py) reads the version as
    FlashInfer does (nvcc under CUDA_HOME before torch.version.cuda) and refuses below
    what B12xMoEWrapper.__init__ requires. No table row can set CUDA_HOME (the harness
    children run without CUDA_* variables), so it is checked here."""
    import ast
    import inspect

    from flashinfer.jit import cpp_ext  # type: ignore[import-not-found]

    path = glue.patched / "sglang/srt/arg_groups/b12x_moe.py"
    tree = ast.parse(path.read_text())
    fn = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "flashinfer_cuda_major"
    )
    namespace: dict[str, Any] = {"Optional": Any}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    caches = (cpp_ext.get_cuda_path, cpp_ext.get_cuda_version)  # both functools.cache
    for cached in caches:
        cached.cache_clear()
    try:
        assert namespace["flashinfer_cuda_major"]() == 12
    finally:
        for cached in caches:
            cached.cache_clear()
    minimum = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == "B12X_MIN_CUDA" for t in n.targets)
    )
    assert f"get_cuda_version().major < {minimum}" in inspect.getsource(
        flashinfer.B12xMoEWrapper.__init__
    )
    misfit = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "b12x_misfit"
    )
    compared = [ast.unparse(n) for n in ast.walk(misfit) if isinstance(n, ast.Compare)]
    assert "cuda < B12X_MIN_CUDA" in compared, compared


def test_reload_refreshes_flashinfers_folded_alpha(
    glue: b12x_glue.Glue, dispatch: tuple[Any, list[tuple[str, int]]]
) -> None:
    """B12xMoEWrapper.run caches w1_alpha * input_global_scale keyed by pointers and
    version counters, which the loader's writes through param.data leave alone: after a
    reload the glue recomputes it in its own storage (what captured graphs read)."""
    import ast

    layer, view = _loaded(glue, 256, seed=8)
    wrapper = flashinfer.B12xMoEWrapper(
        num_experts=EXPERTS,
        top_k=TOP_K,
        hidden_size=HIDDEN,
        intermediate_size=256,
        use_cuda_graph=False,
        device="cpu",
        quant_mode="nvfp4",
    )
    _run(wrapper, view, tokens=2)
    folded = wrapper._folded_w1_alpha
    new = b12x_glue.checkpoint(EXPERTS, HIDDEN, 256, gated=True, seed=9, tied=False, input_amax=9.0)
    glue.load(layer, new, gated=True)
    view = glue.process(layer, gated=True)
    glue.prep.refresh_b12x_fold(wrapper, view)
    _run(wrapper, view, tokens=2)
    want = torch.maximum(new["gate_s2"], new["up_s2"]) * new["input_scale"].max()
    assert wrapper._folded_w1_alpha is folded
    assert torch.allclose(folded, want, rtol=1e-6)
    tree = ast.parse((glue.patched / b12x_glue.MODELOPT).read_text())
    prepare = next(
        f
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef) and f.name == "_prepare_b12x_weights"
    )
    calls = [ast.unparse(c.func) for c in ast.walk(prepare) if isinstance(c, ast.Call)]
    assert "refresh_b12x_fold" in calls, calls
