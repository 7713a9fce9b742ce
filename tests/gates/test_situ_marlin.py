"""Marlin's SiTU against sglang's own SiTU, on a CPU (issue 37, item 1).

On SM12x an NVFP4 MoE layer whose experts use SiTU (Kimi-K3 class) runs on marlin
(sm120-moe-runner-fit.patch, sm120-nvfp4-moe-auto-fit.patch), which
sm120-nvfp4-moe-situ-marlin.patch lets past ModelOptNvFp4FusedMoEMethod.apply's
assertion. That is right only if marlin computes SiTU as sglang defines it
(``SituAndMul.forward_native``, layers/activation.py: beta*tanh(gate/beta)*sigmoid(gate)
* linear_beta*tanh(up/linear_beta), [gate, up] halves) with the layer's parameters
(models/kimi_k3.py: ``gemm1_alpha=activation_situ_beta``,
``gemm1_clamp_limit=activation_situ_linear_beta``). Two checks, in a child interpreter
of the gate environment on the patched tree (no GPU, no faked one):

* fused_marlin_moe.situ_and_mul, the Triton kernel itself, run by the Triton
  interpreter (``TRITON_INTERPRET=1``), against ``SituAndMul.forward_native``;
* the marlin runner (``fused_experts_none_to_marlin``) and fused_marlin_moe's own
  Python body with a SiTU ``MoeRunnerConfig``: the Marlin GEMMs are replaced by
  stand-ins bound to their real signatures, the first writes known [gate, up] rows and
  the second records the activation it is given, which must be SiTU of those rows with
  the config's beta and linear_beta.

Both agree within one bf16 rounding of the reference. A check that cannot fail is
worth nothing, so each case also proves that swapping beta and linear_beta, or the
gate and up halves, moves the result by far more than the tolerance. Mutations of the
patched tree (2026-12-07): the marlin runner passing ``swiglu_limit`` as clamp_limit (so
linear_beta is lost): runner 112 and 1879 roundings off (limit 1); the kernel's
``sigmoid(gate)`` as ``sigmoid(gate / situ_beta)``: kernel and runner 3e4 to 1e8 off.
Unmutated: 1 rounding at most in every case. The layer-level
path (create_weights, load, process_weights_after_loading, apply) is the gate row of
scenario kimi_k3_situ_nvfp4_forward. Runs in the gate environment (`nox -s gate_tests`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sm120fork.harness import trees

CASES = [(4.0, 25.0), (4.0, None), (1.5, 3.0)]  # Kimi-K3's (4.0, 25.0) first

CHILD = textwrap.dedent(
    """
    import inspect, json, sys
    import torch
    import sglang.srt.layers.moe.fused_moe_triton as triton_moe
    import sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe as fmm
    import sglang.srt.layers.quantization.marlin_utils as marlin_utils
    from sglang.srt.layers.activation import SituAndMul
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.marlin import (
        MarlinMoeQuantInfo, fused_experts_none_to_marlin)
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    E, K, N, M, TOP_K = 4, 64, 96, 3, 2
    torch.manual_seed(0)
    rows = (torch.randn(M * TOP_K, 2 * N) * 12).to(torch.bfloat16)
    rows[0, :4] = torch.tensor([60.0, -60.0, 1e-3, -1e-3])  # saturated and tiny gates
    seen = {}

    def gemm(a, c_or_none, b_q_weight, *args, size_n, size_k, **kw):
        if size_n == 2 * N:
            return c_or_none.copy_(rows)
        seen["act"] = a.clone()
        return c_or_none.zero_()

    def bound(real, impl):
        sig = inspect.signature(real)
        return lambda *a, **k: (sig.bind(*a, **k), impl(*a, **k))[1]

    def signature_only(module, name):
        # the real def without its body: importing it loads sgl_kernel (CUDA only)
        import ast, importlib.util
        tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
        node = next(n for n in tree.body if getattr(n, "name", None) == name)
        node.body, node.decorator_list, node.returns = [ast.Pass()], [], None
        for arg in node.args.args + node.args.kwonlyargs:
            arg.annotation = None
        scope = {}
        exec(compile(ast.fix_missing_locations(ast.Module([node], [])), module, "exec"), scope)
        return scope[name]

    fmm.moe_wna16_marlin_gemm = bound(
        signature_only("sglang.kernels.ops.moe.moe_wna16_marlin", "moe_wna16_marlin_gemm"), gemm)
    fmm.moe_sum_reduce = lambda i, o, s=0: o.zero_()
    fmm.get_scalar_type = bound(fmm.get_scalar_type, lambda *a, **k: "float4_e2m1f")
    triton_moe.moe_align_block_size = lambda ids, *a, **k: (
        torch.arange(ids.numel(), dtype=torch.int32), torch.zeros(ids.numel(), dtype=torch.int32),
        torch.tensor([ids.numel()]))
    marlin_utils.marlin_make_workspace = lambda device, max_blocks_per_sm=1: torch.zeros(
        4, dtype=torch.int)
    torch.cuda.get_device_capability = lambda device=None: (12, 0)
    op = fmm.fused_marlin_moe
    fmm.fused_marlin_moe = getattr(op, "op_func", None) or getattr(op, "__wrapped__", op)

    def ulps(got, ref):
        # distance in bf16 roundings of the reference (one rounding: <= 1)
        step = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp(min=2.0**-20))) - 7)
        return float(((got.float() - ref.float()).abs() / step).max())

    out = []
    for beta, linear in json.loads(sys.argv[1]):
        ref = SituAndMul(beta, linear).forward_native(rows)
        kernel = torch.empty(M * TOP_K, N, dtype=torch.bfloat16)
        fmm.situ_and_mul(kernel, rows, situ_beta=beta, linear_beta=linear)
        config = MoeRunnerConfig(
            num_experts=E, num_local_experts=E, hidden_size=K,
            intermediate_size_per_partition=N, top_k=TOP_K, params_dtype=torch.bfloat16,
            activation="situ", is_gated=True, gemm1_alpha=beta, gemm1_clamp_limit=linear)
        w = lambda *shape: torch.zeros(*shape, dtype=torch.int32)
        info = MarlinMoeQuantInfo(
            w13_qweight=w(E, K // 16, 2 * N * 2), w2_qweight=w(E, N // 16, K * 2),
            w13_scales=torch.ones(E, K // 16, 2 * N, dtype=torch.float8_e4m3fn),
            w2_scales=torch.ones(E, N // 16, K, dtype=torch.float8_e4m3fn),
            w13_g_idx_sort_indices=None, w2_g_idx_sort_indices=None, weight_bits=4,
            w13_global_scale=torch.ones(E, dtype=torch.bfloat16),
            w2_global_scale=torch.ones(E, dtype=torch.bfloat16))
        topk = StandardTopKOutput(torch.rand(M, TOP_K),
            torch.randint(0, E, (M, TOP_K), dtype=torch.int32), torch.zeros(M, E))
        hidden = torch.randn(M, K, dtype=torch.bfloat16)
        with torch.no_grad():
            fused_experts_none_to_marlin(
                StandardDispatchOutput(hidden, None, topk), info, config)
        swapped = SituAndMul(linear or beta, beta if linear else None).forward_native(rows)
        halves = SituAndMul(beta, linear).forward_native(rows.roll(N, dims=1))
        out.append({
            "case": [beta, linear],
            "kernel_ulps": ulps(kernel, ref),
            "runner_ulps": ulps(seen["act"], ref),
            "swapped_params_ulps": ulps(swapped, ref) if linear else None,
            "swapped_halves_ulps": ulps(halves, ref),
        })
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def measured(gate_trees: dict[str, trees.Tree], tmp_path_factory: pytest.TempPathFactory):
    """The child's measurements on the patched tree (the matrix's, else a fresh one)."""
    tree = next((t for t in gate_trees.values() if t.mode == trees.PATCHED), None)
    if tree is None:
        tree = trees.build_patched_tree(tmp_path_factory.mktemp("situ-patched"))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(tree.path)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(CASES)],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(tree.path),
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return {tuple(r["case"]): r for r in json.loads(lines[-1][len("RESULT ") :])}


@pytest.mark.parametrize("case", CASES, ids=[f"beta{b}-linear{lb}" for b, lb in CASES])
def test_marlin_situ_matches_sglang_situ(measured: dict, case: tuple) -> None:
    result = measured[case]
    assert result["kernel_ulps"] <= 1.0, result  # the Triton kernel, interpreted
    assert result["runner_ulps"] <= 1.0, result  # runner -> fused_marlin_moe -> kernel
    # The comparison discriminates: the wrong parameters or halves are far off.
    assert result["swapped_halves_ulps"] > 100, result
    if result["swapped_params_ulps"] is not None:
        assert result["swapped_params_ulps"] > 100, result
