"""Shared memory of the kernels SM12x runs, compiled for SM120, against SM12x's per-block limit.

test_selected_kernels_fit: every Triton launch the SM12x decisions select for the
families of scenarios.toml (Triton extend/decode attention incl. MLA decode, the vision
encoder's Triton prefill, the Triton fused-MoE kernel at each config sglang's lookup
returns for the family's expert shapes, the Triton block-FP8 GEMM where the dispatch
can reach it, the TileLang sparse-MLA kernels of DSA models where a DSA role resolves to
`tilelang`), enumerated and compiled by the `kernel_fit` probe
(sm120fork/harness/kernel_probes.py, dsa_launches.py) in faked sm120/sm121 children of
each tested tree.

The figures the patch headers cite (sm120-triton-attention-tiles, sm120-nsa-guard) come
from here: each kernel of vendor/sglang is compiled (Triton) or lowered (TileLang) for
target sm_120 with the gate environment's own Triton / TileLang, no GPU needed, and its
shared-memory size is read from the result. SM12x allows 99 KiB per block
(archs.toml: smem_per_block_optin_kib), SM90/SM100 227 KiB.

Runs in the gate environment (`nox -s gate_tests`). A new Triton or TileLang pin may move
the exact byte counts: re-measure, then update the patch headers with them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from sm120fork.harness import kernel_probes, runner, spec, trees

pytest.importorskip("triton")

SM120 = {a.name: a for a in spec.load_archs()}["sm120"]
SM12X = tuple(a for a in spec.load_archs() if a.capability[0] == 12)
LIMIT = int(SM120.values["smem_per_block_optin_kib"]) * 1024  # 101376
MAJOR, MINOR = SM120.capability

# Runs in a fresh interpreter with vendor/sglang first on sys.path (never the installed
# sglang), prints {case: shared-memory bytes}.
MEASURE = textwrap.dedent(
    """
    import inspect, json, sys
    sys.path.insert(0, sys.argv[1])
    cap = int(sys.argv[2])
    import sglang
    assert sglang.__file__.startswith(sys.argv[1]), sglang.__file__
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from sglang.kernels.ops.attention.prefill_attention import _fwd_kernel

    def triton_prefill(block, lk):
        # context_attention_fwd's launch: BLOCK_M = BLOCK_N = BLOCK, 8 warps for Lk > 64.
        names = list(inspect.signature(_fwd_kernel.fn).parameters)
        const = dict(kv_group_num=1, BLOCK_M=block, BLOCK_DMODEL=triton.next_power_of_2(lk),
                     BLOCK_N=block, IS_CAUSAL=True, Lk=lk)
        sig = {}
        for n in names:
            if n in const:
                sig[n] = "constexpr"
            elif n in ("Q", "K", "V", "Out"):
                sig[n] = "*bf16"
            elif n in ("B_Start_Loc", "B_Seqlen"):
                sig[n] = "*i32"
            elif n == "sm_scale":
                sig[n] = "fp32"
            else:
                sig[n] = "i32"
        src = ASTSource(fn=_fwd_kernel, signature=sig,
                        constexprs={(names.index(k),): v for k, v in const.items()})
        options = dict(num_warps=8 if lk > 64 else 4, num_stages=1)
        kernel = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options)
        return kernel.metadata.shared

    out = {
        "triton_prefill[128x128,Lk=256]": triton_prefill(128, 256),
        "triton_prefill[64x64,Lk=256]": triton_prefill(64, 256),
        "triton_prefill[128x128,Lk=128]": triton_prefill(128, 128),
    }
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def smem() -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(spec.VENDOR_PYTHON), f"{MAJOR}{MINOR}"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, int] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_triton_prefill_tiles(smem: dict[str, int]) -> None:
    """sm120-triton-attention-tiles: Hopper's 128-wide tiles overflow SM12x at head_dim 256."""
    assert smem["triton_prefill[128x128,Lk=256]"] == 163840 > LIMIT
    assert smem["triton_prefill[64x64,Lk=256]"] == 73728 <= LIMIT
    assert smem["triton_prefill[128x128,Lk=128]"] == 65536 <= LIMIT


# --------------------------------------------------------------------------- every selected launch

# Kernels the table's families must reach somewhere (else the enumeration went blind):
# (kernel function, tile constant that tells the variant apart, or "" for any).
REACHED = {
    "extend attention": ("extend_attention._fwd_kernel", ""),
    "decode attention": ("decode_attention._fwd_grouped_kernel_stage1", ""),
    "MLA decode": ("decode_attention._fwd_grouped_kernel_stage1", "BLOCK_DPE"),
    "vision prefill attention": ("prefill_attention._fwd_kernel", ""),
    "fused MoE": ("fused_moe_triton_kernels.fused_moe_kernel", ""),
    "block-FP8 GEMM": ("fp8_kernel._w8a8_block_fp8_matmul", ""),
    "DSA TileLang sparse MLA (FP8 KV)": ("tilelang_kernel.sparse_mla_fwd_decode_partial_fp8", ""),
    "DSA Triton sparse-MLA prefill": ("triton_sparse_mla_prefill._sparse_mla_prefill_kernel", ""),
    "DSA indexer FP8 quantization": ("act_quant_triton._act_quant_kernel", ""),
}


@pytest.fixture(scope="session")
def kernel_fit(
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
    gate_trees: dict[str, trees.Tree],
    zygote_pool: runner.ZygotePool,
) -> dict[str, runner.MatrixRun]:
    """Each tree's selected launches on sm120 and sm121 (the scenarios with a model)."""
    scenarios = [
        spec.Scenario(s.name, s.model, s.args, ("kernel_fit",))
        for s in spec.load_scenarios().values()
        if s.model
    ]
    return runner.run_matrices(
        {label: tree.path for label, tree in gate_trees.items()},
        SM12X,
        scenarios,
        scratch=tmp_path_factory.mktemp("kernel-fit"),
        jobs=pytestconfig.getoption("--gate-jobs") or None,
        zygotes=zygote_pool,
    )


def _launches(run: runner.MatrixRun) -> list[tuple[str, str, dict[str, Any]]]:
    """(arch, scenario, launch record) of every selected launch; a probe error fails."""
    found: list[tuple[str, str, dict[str, Any]]] = []
    broken: list[str] = []
    for arch, scenarios in run.observations.items():
        for name, obs in scenarios.items():
            if obs.get("error"):  # refused at argument time: nothing runs
                continue
            records = obs.get(kernel_probes.FIELD)
            if not isinstance(records, list):
                broken.append(f"{arch} {name}: {records}")
                continue
            found.extend((arch, name, record) for record in records)
    assert not broken, "kernel_fit probe failed:\n" + "\n".join(broken)
    return found


def _describe(arch: str, scenario: str, record: dict[str, Any]) -> str:
    return (
        f"{arch} {scenario}: {record['kernel']} {record['tiles']} warps={record['num_warps']} "
        f"stages={record['num_stages']}: {record['shared']} B ({record['cases'][0]})"
    )


def _overflows(run: runner.MatrixRun) -> dict[tuple[str, str], list[str]]:
    limits = {a.name: int(a.values["smem_per_block_optin_kib"]) * 1024 for a in SM12X}
    over: dict[tuple[str, str], list[str]] = {}
    for arch, name, record in _launches(run):
        if record["shared"] > limits[arch]:
            over.setdefault((arch, name), []).append(_describe(arch, name, record))
    return over


def test_selected_kernels_fit(
    tree_label: str, gate_trees: dict[str, trees.Tree], kernel_fit: dict[str, runner.MatrixRun]
) -> None:
    """Every selected launch fits SM12x's per-block shared memory. On a pristine tree,
    a launch that does not fit passes only where a patched tree of this session fits
    (the series fixes it); with no patched tree, it fails."""
    over = _overflows(kernel_fit[tree_label])
    if gate_trees[tree_label].mode == trees.PRISTINE:
        patched = [label for label, t in gate_trees.items() if t.mode == trees.PATCHED]
        fixed = {key for key in over if patched and all(
            key not in _overflows(kernel_fit[label]) for label in patched)}  # fmt: skip
        over = {key: lines for key, lines in over.items() if key not in fixed}
    lines = [line for found in over.values() for line in found]
    assert not lines, (
        f"{tree_label}: {len(lines)} selected Triton/TileLang launches exceed SM12x's "
        "per-block shared memory (fix the tiles with a patch, or refuse the configuration):\n"
        + "\n".join(lines)
    )


def test_selected_kernels_cover_the_table(
    tree_label: str, kernel_fit: dict[str, runner.MatrixRun]
) -> None:
    """The enumeration reaches each kernel family the SM12x decisions select."""
    launches = _launches(kernel_fit[tree_label])
    missing = [
        what
        for what, (kernel, tile) in REACHED.items()
        if not any(
            r["kernel"].endswith(kernel) and (not tile or r["tiles"].get(tile))
            for _, _, r in launches
        )
    ]
    assert not missing, f"{tree_label}: no selected launch of {', '.join(missing)}"


def test_triton_sparse_mla_prefill_steps_down_on_sm12x(
    tmp_path: Any, gate_trees: dict[str, trees.Tree], zygote_pool: runner.ZygotePool
) -> None:
    """sparse_mla_prefill retries smaller tiles on OutOfResources: GLM-5 at TP2 (32 heads
    a rank) overflows SM120 with the pinned BLOCK_N=64, so the probe must record the
    tile it steps down to (fits) and not the one it stepped down from."""
    patched = next((t for t in gate_trees.values() if t.mode == trees.PATCHED), None)
    tree = patched or trees.build_patched_tree(tmp_path / "tree")
    args = {"tp_size": 2, "dsa_prefill_backend": "triton_sparse_mla"}
    scenario = spec.Scenario("glm5_tp2_triton_sparse_mla", "glm5_fp8", args, ("kernel_fit",))
    run = runner.run_matrices(
        {"tree": tree.path}, (SM120,), [scenario], scratch=tmp_path / "run", zygotes=zygote_pool
    )["tree"]
    launches = [
        r for _, _, r in _launches(run) if r["kernel"].endswith("_sparse_mla_prefill_kernel")
    ]
    assert [(r["tiles"], r["shared"] <= LIMIT) for r in launches] == [
        ({"BLOCK_H": 32, "BLOCK_N": 32}, True)
    ], launches


def test_tilelang_dsa_figures(
    gate_trees: dict[str, trees.Tree], kernel_fit: dict[str, runner.MatrixRun]
) -> None:
    """sm120-nsa-guard's figures, from the enumeration (not a hand-picked case): TileLang's
    FP8-KV sparse MLA at a decode step (DeepSeek V3.2 at TP8: 16 heads, 512 + 64, top-k
    2048) fits SM12x; its bf16 kernel, which the pristine tree selects (bf16 KV cache
    scenarios), does not."""
    found = {label: _launches(run) for label, run in kernel_fit.items()}
    fp8 = {r["shared"] for launches in found.values() for _, _, r in launches
           if r["kernel"].endswith("sparse_mla_fwd_decode_partial_fp8")
           and r["tiles"]["args"][0] == 16 and r["tiles"].get("inner_iter") == 1}  # fmt: skip
    assert fp8 == {28288}
    for label, tree in gate_trees.items():
        if tree.mode == trees.PRISTINE:
            bf16 = {r["shared"] for _, _, r in found[label]
                    if r["kernel"].endswith("sparse_attention_fwd_kernel_v2")}  # fmt: skip
            assert bf16 == {170048} and LIMIT < 170048, (label, bf16)
