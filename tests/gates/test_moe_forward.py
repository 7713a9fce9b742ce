"""The forward dry run of the MoE sweep (issue 37): every SM12x sweep cell that passes
argument time is built, loaded and run once, on a CPU, as sglang would on the GPU.

For each cell the sweep resolved (`sweep` fixture, conftest.py) forward_child.py builds
the real ``FusedMoE`` with the checkpoint's quantization and the family's layer
keywords (forward_cells.py), at per-rank intermediate sizes that real TP shards have
(forward_cells.SIZES: 192 and 320 are no multiples of 128 or 256); loads random
checkpoint-shaped experts through its weight loader; runs
``process_weights_after_loading`` and one forward with the kernel entry points
replaced by recorders bound to the real signatures (forward_recorders.py; the b12x
launch answers with FlashInfer's torch reference, compared with a dequantized MoE).
Cells whose resolution matters alike (format, resolved runner, layer keywords) share
one run; each cell is its own test id `forward-<arch>-<cell>`.

A cell passes, or was refused at argument time. Failing at build, load, processing or
the forward fails it, and so does memory: the layer may hold at most ``MAX_RATIO`` of
the checkpoint's expert bytes after loading, and the first forward may leave nothing
allocated beyond FlashInfer's documented workspaces but per-expert scalars.
``KNOWN_FAILING`` names the defects not yet fixed; each is checked strictly (a cell
it covers that passes fails, so that it is dropped once fixed).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from sm120fork.harness import runner, spec, trees

from . import forward_cells, forward_run

ARCHS = spec.load_archs()
SM12X = [a for a in ARCHS if a.capability[0] == 12]
CELLS = forward_cells.forward_cells()
MAX_RATIO = 1.10
PER_EXPERT_SCALARS = 64  # bytes a first forward may add per expert (a folded alpha)
MAX_REL_ERR = 0.02  # bf16 output rounding; a layout or scale slip is O(1)
Result = dict[str, Any]
Forward = forward_run.Forward


@dataclass(frozen=True)
class Known:
    """A failure explained: `pattern` (a regex) matches the problem lines it covers."""

    item: str  # issue 37's item, or why the dry run cannot model it
    pattern: str


# Defects of the patched tree not yet fixed. Each must still match some SM12x cell's
# problem (test_known_failing_still_fails): the coordinator drops an entry once fixed.
KNOWN_FAILING: dict[str, Known] = {
    "b12x-refused-at-load": Known(
        "issue 37 item 5: auto resolves to flashinfer_b12x for a layer that "
        "check_b12x_runner_config refuses when the model is built",
        r"build: ValueError: --moe-runner-backend flashinfer_b12x",
    ),
    "cutlass-relu2-holds-more": Known(
        "found here (SM121, Nemotron-H NVFP4 on flashinfer_cutlass): a non-gated layer at "
        "I=192 holds 1.39x its expert bytes after loading (same class as item 2)",
        r"flashinfer_cutlass: holds 1\.\d+x the checkpoint's expert bytes after loading",
    ),
    "fp8-triton-kernel-no-runner": Known(
        "found here, not SM12x-specific: Fp8MoEMethod builds no runner for triton_kernel "
        "(GPT-OSS's override) and apply() dereferences it",
        r"triton_kernel: apply: AttributeError: 'NoneType' object has no attribute "
        r"'runner_backend'",
    ),
}
# What the dry run cannot run on a CPU; strict like KNOWN_FAILING.
NOT_MODELLED: dict[str, Known] = {
    "triton-launch-at-load": Known(
        "process_weights_after_loading launches a Triton kernel (MXFP4 swizzle): Triton "
        "has no CPU driver here",
        r"process: ImportError: .*cuda_utils.*undefined symbol",
    ),
    "triton-kernels-topk": Known(
        "the triton_kernel runner reads TopK's own output type, which the dry run "
        "does not build",
        r"Triton-kernel runner expects TritonKernelTopKOutput",
    ),
    "flashinfer-jit-at-forward": Known(
        "the forward JIT-builds a FlashInfer module ahead of the recorded entry point "
        "(MXFP4 CUTLASS path): no CUDA toolchain here",
        r"apply: RuntimeError: Ninja build failed",
    ),
    "dsv4-expert-method": Known(
        "DeepSeek V4 builds its experts with its own method (FP4 experts whatever the "
        "checkpoint declares); the dry run builds the checkpoint's",
        r"Unsupported moe_runner_backend for NVFP4 MoE: MoeRunnerBackend.FLASHINFER_MXFP4"
        r"|flashinfer_mxfp4: process: RuntimeError: MXFP8 MoE quantization requires SM100"
        r"|build: ValueError: Mxfp4FlashinferCutlassMoEMethod requires hidden_size",
    ),
}


def _forward_trees(gate_trees: dict[str, trees.Tree]) -> dict[str, trees.Tree]:
    """The first pristine and the first patched tree: a further patched tree (the
    installed wheel) holds the same sources, compared byte for byte elsewhere, and
    each tree's dry run costs minutes a child."""
    chosen: dict[str, trees.Tree] = {}
    for label, tree in gate_trees.items():
        pristine = tree.mode == trees.PRISTINE
        if not any((t.mode == trees.PRISTINE) == pristine for t in chosen.values()):
            chosen[label] = tree
    return chosen


@pytest.fixture(scope="session")
def forward(
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
    gate_trees: dict[str, trees.Tree],
    gate_archs: tuple[spec.Arch, ...],
    zygote_pool: runner.ZygotePool,
    sweep: dict[str, dict[str, dict[str, Any]]],
) -> Forward:
    """Each tree's SM12x cells: refused at argument time, or their group's forward."""
    where = tmp_path_factory.mktemp("moe-forward")
    wanted = {a.name for a in gate_archs}
    jobs: list[tuple[str, spec.Arch, list[dict[str, Any]]]] = []
    run_on = _forward_trees(gate_trees)
    out: Forward = {label: {} for label in run_on}
    keys: dict[tuple[str, str], dict[str, str]] = {}
    for label in run_on:
        for arch in [a for a in SM12X if a.name in wanted]:
            cells, groups = out[label].setdefault(arch.name, {}), {}
            keys[(label, arch.name)] = {}
            for cell in CELLS:
                variant = "@" in cell.name
                obs = {} if variant else sweep[label][arch.name].get(cell.name)
                if obs is None:
                    cells[cell.name] = {"missing": "the sweep did not observe it"}
                elif obs.get("error"):
                    cells[cell.name] = {"argument_time": obs["error"]}
                else:
                    key = f"variant:{cell.name}" if variant else forward_run.key(cell, obs)
                    keys[(label, arch.name)][cell.name] = key
                    if key not in groups:
                        groups[key] = forward_run.group(cell, key, where / "configs" / label / arch.name)
            jobs.append((label, arch, list(groups.values())))
    workers = pytestconfig.getoption("--gate-jobs") or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {
            (label, arch.name): pool.submit(
                forward_run.run_child, gate_trees[label].path.resolve(), arch, groups, zygote_pool,
                where / "runs" / label / arch.name,
            )  # fmt: skip
            for label, arch, groups in jobs
        }
        for (label, arch_name), future in futures.items():
            results = future.result()
            for name, key in keys[(label, arch_name)].items():
                out[label][arch_name][name] = results[key]
    return out


def _kernel_padding(r: Result, size: int) -> float:
    """The memory factor b12x's own tile needs: FlashInfer 0.7.2's SM12x MoE pads the
    per-rank intermediate size to a multiple of 256 for its static decode kernels
    (blackwell_sm12x/moe_dispatch.py `_pad_intermediate_to_tile`), so the patch pads
    once at load, before the KV pool is sized, and makes b12x the default only where
    this factor is <= 1.10 (arg_groups/b12x_moe.py `b12x_memory_misfit`). Any other
    extra copy is still judged against MAX_RATIO. Other runners pad nothing here."""
    if r.get("runner") != "flashinfer_b12x":
        return 1.0
    return max(1.0, r.get("padded_intermediate", size) / size)


def problems(result: Result) -> list[str]:
    """What is wrong with one cell's forward; none: it passed or was refused in time."""
    if "missing" in result:
        return [result["missing"]]
    if "argument_time" in result:
        return []
    if "refused" in result:  # a variant cell, resolved by the child itself
        text = result["refused"]
        clear = text.startswith("ValueError: ") and re.search(r"--[a-z][a-z-]+|SGLANG_[A-Z_]+", text)
        return [] if clear else [f"not a clear refusal at argument time: {text}"]
    found = []
    for size, r in result["sizes"].items():
        at = f"I={size} {r.get('runner')}"
        if "error" in r:
            found.append(f"{at}: {r['stage']}: {r['error']}")
            continue
        found += [f"{at}: {p}" for p in r["problems"]]
        if not r["calls"]:
            found.append(f"{at}: the forward reached no recorded kernel entry point")
        held = r["held_bytes"] / r["checkpoint_bytes"]
        if held > MAX_RATIO * _kernel_padding(r, int(size)):
            found.append(f"{at}: holds {held:.2f}x the checkpoint's expert bytes after loading")
        if r["first_forward_bytes"] > PER_EXPERT_SCALARS * forward_cells.EXPERTS:
            ratio = r["first_forward_bytes"] / r["checkpoint_bytes"]
            found.append(f"{at}: the first forward allocates {ratio:.2f}x the expert bytes")
        if r.get("rel_err") is not None and r["rel_err"] > MAX_REL_ERR:
            found.append(f"{at}: output off the dequantized MoE by {r['rel_err']:.3f}")
    return found


def _explained(found: list[str]) -> tuple[list[str], list[str]]:
    """(names of the entries explaining `found`, the problems none explains)."""
    entries = {**KNOWN_FAILING, **NOT_MODELLED}
    names = [n for n, k in entries.items() if any(re.search(k.pattern, p) for p in found)]
    rest = [p for p in found if not any(re.search(entries[n].pattern, p) for n in names)]
    return names, rest


def _patched(gate_trees: dict[str, trees.Tree]) -> list[str]:
    chosen = _forward_trees(gate_trees)
    labels = [label for label, tree in chosen.items() if tree.mode != trees.PRISTINE]
    if not labels:
        pytest.skip("no patched tree under test (--gate-tree pristine only)")
    return labels


PARAMS = [(a.name, c) for a in SM12X for c in CELLS]


@pytest.mark.parametrize(
    ("arch", "cell"), PARAMS, ids=[f"forward-{arch}-{cell.name}" for arch, cell in PARAMS]
)
def test_forward(
    arch: str,
    cell: forward_cells.ForwardCell,
    forward: Forward,
    gate_trees: dict[str, trees.Tree],
) -> None:
    """The cell passes its forward, was refused at argument time, or fails only as
    KNOWN_FAILING / NOT_MODELLED say (expected failures, named)."""
    if arch not in next(iter(forward.values()), {}):
        pytest.skip(f"--gate-arch leaves out {arch}")
    for label in _patched(gate_trees):
        found = problems(forward[label][arch][cell.name])
        names, rest = _explained(found)
        assert not rest, f"{label} {arch} {cell.name}:\n" + "\n".join(rest)
        if names:
            pytest.xfail("; ".join(f"{n}: {KNOWN_FAILING.get(n, NOT_MODELLED.get(n))}" for n in names))


def test_known_failing_still_fails(forward: Forward, gate_trees: dict[str, trees.Tree]) -> None:
    """Each KNOWN_FAILING / NOT_MODELLED entry still explains some SM12x cell of a
    patched tree: one that matches nothing was fixed, and must be dropped."""
    found = [
        p
        for label in _patched(gate_trees)
        for per in forward[label].values()
        for result in per.values()
        for p in problems(result)
    ]
    if any(set(forward[label]) != {a.name for a in SM12X} for label in _patched(gate_trees)):
        pytest.skip("entries are judged with every SM12x architecture under test")
    stale = [
        name
        for name, k in {**KNOWN_FAILING, **NOT_MODELLED}.items()
        if not any(re.search(k.pattern, p) for p in found)
    ]
    assert not stale, f"fixed: drop {stale} from KNOWN_FAILING / NOT_MODELLED"


def test_pristine_fails_forward_cells(forward: Forward, gate_trees: dict[str, trees.Tree]) -> None:
    """The dry run bites: on the pristine tree some SM12x cell fails its forward."""
    for label, tree in _forward_trees(gate_trees).items():
        if tree.mode == trees.PRISTINE and forward[label]:
            failed = [n for per in forward[label].values() for n, r in per.items() if problems(r)]
            assert failed, f"{label}: every SM12x cell passes its forward on the pristine tree"


def test_forward_reached_every_runner(forward: Forward) -> None:
    """Every runner a patched cell resolves reached a recorder at every size: a forward
    that never reaches a kernel would pass anything."""
    silent = sorted(
        f"{label} {arch} {name} I={size} {r.get('runner')}"
        for label, per_arch in forward.items()
        for arch, per in per_arch.items()
        for name, result in per.items()
        for size, r in result.get("sizes", {}).items()
        if "error" not in r and not r["calls"]
    )
    assert not silent, "\n".join(silent[:20])


def test_forward_memory_measured(forward: Forward) -> None:
    """Every forward that loaded measured its bytes (the table goes to stdout)."""
    table = forward_run.memory_table(forward)
    print("\n".join(table))
    ran = any(r.get("sizes") for per in forward.values() for p in per.values() for r in p.values())
    assert table or not ran, "no memory measured although forwards ran"
