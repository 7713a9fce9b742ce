"""The MoE sweep (issue 28): every MoE architecture of the tree (and every overridden
one) x expert format x forced SM100-only runner, decided on faked SM12x, each cell a
test id `<arch>-sweep:<Architecture>:<format>[+<forced runner>]`.

On sm120/sm121 every cell of a patched tree must end in a runner with SM12x kernels
for its format or a one-line ValueError naming the flag (moe_sweep.verdict); the
pristine tree must fail some (the series fixes them). On sm80..sm103 pristine and
patched decide alike: each cell is run on one of them (cells rotate over the five,
to keep `nox -s tests` short). See gatetable/README.md, "MoE sweep".
"""

from __future__ import annotations

from typing import Any

import pytest
from sm120fork.harness import moe_sweep, spec, trees

from .conftest import SWEEP_UNEXPECTED_SMI

ARCHS = spec.load_archs()
SM12X = [a for a in ARCHS if a.capability[0] == 12]
UPSTREAM = [a for a in ARCHS if a.capability[0] != 12]
CELLS = moe_sweep.cells()
Observed = dict[str, dict[str, dict[str, Any]]]  # tree label -> arch -> scenario -> obs
# The `sweep` fixture (conftest.py) is shared with test_moe_forward.py.


def _patched(gate_trees: dict[str, trees.Tree]) -> list[str]:
    labels = [label for label, tree in gate_trees.items() if tree.mode != trees.PRISTINE]
    if not labels:
        pytest.skip("no patched tree under test (--gate-tree pristine only)")
    return labels


@pytest.mark.parametrize("arch", [a.name for a in SM12X])
@pytest.mark.parametrize("cell", CELLS, ids=[c.name for c in CELLS])
def test_sm12x_cell(
    arch: str,
    cell: moe_sweep.Cell,
    sweep: Observed,
    gate_trees: dict[str, trees.Tree],
    gate_archs: tuple[spec.Arch, ...],
) -> None:
    if arch not in {a.name for a in gate_archs}:
        pytest.skip(f"--gate-arch leaves out {arch}")
    for label in _patched(gate_trees):
        problem = moe_sweep.verdict(cell, sweep[label][arch].get(cell.name))
        known = moe_sweep.KNOWN_WRONG.get(cell.name)
        if known is not None:
            assert problem is not None, f"{label} {arch} {cell.name}: fixed, drop KNOWN_WRONG"
            pytest.xfail(f"known: {known}")
        assert problem is None, f"{label} {arch} {cell.name}: {problem}"


def test_pristine_fails_cells_the_series_fixes(
    sweep: Observed, gate_trees: dict[str, trees.Tree]
) -> None:
    """The sweep bites: the pristine tree decides some SM12x cell wrongly."""
    pristine = [label for label, tree in gate_trees.items() if tree.mode == trees.PRISTINE]
    for label in pristine:
        failed = [
            f"{arch}:{cell.name}"
            for arch in sweep[label]
            if arch in {a.name for a in SM12X}
            for cell in CELLS
            if moe_sweep.verdict(cell, sweep[label][arch].get(cell.name)) is not None
        ]
        if sweep[label].keys() & {a.name for a in SM12X}:
            assert failed, f"{label}: no SM12x cell fails on the pristine tree"


def test_upstream_archs_unchanged(sweep: Observed, gate_trees: dict[str, trees.Tree]) -> None:
    """sm80..sm103: every cell decides on the patched tree exactly as on pristine."""
    pristine = [label for label, tree in gate_trees.items() if tree.mode == trees.PRISTINE]
    patched = [label for label, tree in gate_trees.items() if tree.mode != trees.PRISTINE]
    upstream = {a.name for a in UPSTREAM}
    differ = [
        f"{label} {arch} {name}: {obs!r} != pristine {sweep[base][arch].get(name)!r}"
        for base in pristine[:1]
        for label in patched
        for arch in sweep[label].keys() & upstream
        for name, obs in sweep[label][arch].items()
        if obs != sweep[base][arch].get(name)
    ]
    assert not differ, "\n".join(differ[:20])


def test_fake_nvidia_smi_answered_every_cell(sweep: Observed) -> None:
    """A query the fake cannot answer means a cell decided on a broken fake."""
    assert sweep and not SWEEP_UNEXPECTED_SMI, "\n".join(SWEEP_UNEXPECTED_SMI)


def test_every_cell_observed(sweep: Observed) -> None:
    """A cell no child reported would pass nothing: each is observed where it ran."""
    missing = [
        f"{label} {arch} {cell.name}"
        for label, per_arch in sweep.items()
        for arch in per_arch.keys() & {a.name for a in SM12X}
        for cell in CELLS
        if cell.name not in per_arch[arch]
    ]
    assert not missing, "\n".join(missing[:20])
