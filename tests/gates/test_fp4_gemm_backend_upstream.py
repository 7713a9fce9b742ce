"""Upstream main's FP4 GEMM ``auto`` table for SM120, against the patched tree (issue 37).

Provenance: sgl-project/sglang, test/registered/unit/layers/quantization/
test_fp4_gemm_backend_sm120.py, read at commit 62050d068dce16a5506da7db453e8ecb82524fc2
(six tests; a later version, 0a002d5c870fb3ed24f031fd84995e701f203b2f, adds an
``is_flashinfer_b12x`` predicate test and three flashinfer_autotune cases). Its cases and
its way of faking the device are restated here, not copied: ``initialize_fp4_gemm_config``
runs with ``get_exec`` giving the requested backend, ``get_platform`` replaced by an
object with ``is_sm100`` only, and ``is_cuda`` / ``get_device_capability`` patched on
fp4_utils, all on a CPU. The expectations are upstream's: auto -> flashinfer_b12x on
(12, 0) and (12, 1), flashinfer_cutedsl on SM100, marlin on (9, 0), an explicit
flashinfer_cutlass kept on SM120, and FLASHINFER_B12X named "b12x" for FlashInfer.

sm120-b12x-fp4-gemm.patch once read ``get_platform().is_sm120``: upstream's fake has no
such attribute, so three cases failed with AttributeError. Resolving from the
capability as upstream does passes all six, and a rebase onto a release with upstream's
change finds the patch's rows passing on the pristine release. The cases run in a child
interpreter of the gate environment with the patched tree first on sys.path (sglang is
never imported into the test process). Runs in the gate environment (`nox -s gate_tests`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from sm120fork.harness import trees

# (requested, capability, is_sm100) -> upstream's expected Fp4GemmRunnerBackend name
CASES = {
    "sm120_auto_selects_b12x": (("auto", (12, 0), False), "FLASHINFER_B12X"),
    "sm121_auto_selects_b12x": (("auto", (12, 1), False), "FLASHINFER_B12X"),
    "sm100_auto_keeps_cutedsl": (("auto", (10, 0), True), "FLASHINFER_CUTEDSL"),
    "sm90_auto_keeps_marlin": (("auto", (9, 0), False), "MARLIN"),
    "explicit_choice_wins_on_sm120": (("flashinfer_cutlass", (12, 0), False), "FLASHINFER_CUTLASS"),
}

CHILD = textwrap.dedent(
    """
    import json, sys
    from types import SimpleNamespace
    from unittest import mock
    import sglang.srt.layers.quantization.fp4_utils as fp4

    def resolve(requested, capability, is_sm100):
        exec_ns = SimpleNamespace(kernel=SimpleNamespace(fp4_gemm_runner_backend=requested))
        fp4.FP4_GEMM_RUNNER_BACKEND = None
        try:
            with mock.patch.object(fp4, "get_exec", return_value=exec_ns), \\
                    mock.patch.object(fp4, "get_platform",
                                      return_value=SimpleNamespace(is_sm100=is_sm100)), \\
                    mock.patch.object(fp4, "is_cuda", return_value=True), \\
                    mock.patch.object(fp4, "get_device_capability", return_value=capability):
                fp4.initialize_fp4_gemm_config()
                return fp4.get_fp4_gemm_runner_backend().name
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            fp4.FP4_GEMM_RUNNER_BACKEND = None

    cases = json.loads(sys.argv[1])
    out = {name: resolve(req, tuple(cap), sm100) for name, (req, cap, sm100) in cases.items()}
    b12x = getattr(fp4.Fp4GemmRunnerBackend, "FLASHINFER_B12X", None)
    out["b12x_maps_to_flashinfer_api_name"] = b12x and b12x.get_flashinfer_backend()
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def resolved(gate_trees: dict[str, trees.Tree], tmp_path_factory: pytest.TempPathFactory):
    tree = next((t for t in gate_trees.values() if t.mode == trees.PATCHED), None)
    if tree is None:
        tree = trees.build_patched_tree(tmp_path_factory.mktemp("fp4-patched"))
    cases = {name: args for name, (args, _) in CASES.items()}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tree.path)},
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("case", sorted(CASES))
def test_upstream_fp4_gemm_auto(resolved: dict, case: str) -> None:
    assert resolved[case] == CASES[case][1]


def test_upstream_b12x_maps_to_flashinfer_api_name(resolved: dict) -> None:
    assert resolved["b12x_maps_to_flashinfer_api_name"] == "b12x"
