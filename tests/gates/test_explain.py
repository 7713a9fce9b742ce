"""`explain` for one checkpoint: upstream beside the fork, and its bad input.

The GLM-4.x NVFP4 checkpoint as NVIDIA ships it, on a faked SM120: upstream leaves
the MoE runner at auto and loads trtllm-gen FP4 MoE (flagged: no SM12x kernels);
the fork declares modelopt_fp4 and picks FlashInfer's b12x fused MoE, naming the
patches, and its kernel lines say which MoE and FP4 GEMM kernels run and that no faster
one is known; on SM121 (b12x opt-in) they name the flag that selects b12x.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sm120fork.harness import explain

ROOT = Path(__file__).resolve().parents[2]
GLM4 = ROOT / "gatetable" / "models" / "glm4_moe_nvfp4"


def _explain(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "sm120fork.harness", "explain", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts")}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)


def test_a_directory_without_config_json_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = _explain("--model-path", str(tmp_path))
    assert done.returncode == 2
    assert done.stdout == ""
    assert (
        done.stderr == f"explain: {tmp_path} has no config.json; pass the checkpoint "
        "directory (config.json is enough, no weights needed)\n"
    )


def test_sglang_arguments_become_server_args_keywords() -> None:
    assert explain.scenario_args(["--tp", "8", "--quantization=modelopt_fp4", "--x-y"]) == {
        "tp_size": 8,
        "quantization": "modelopt_fp4",
        "x_y": True,
    }


def test_glm4_nvfp4_on_sm120_upstream_beside_the_fork(tmp_path: Path) -> None:
    out = tmp_path / "explain.json"
    done = _explain(
        "--model-path",
        str(GLM4),
        "--arch",
        "sm120",
        "--arch",
        "sm121",
        "--json",
        str(out),
        "--",
        "--tp",
        "2",  # per-rank intermediate 768: b12x's default (TP8's 192 pads to 256: cutlass)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "## glm4_moe_nvfp4 on sm120" in done.stdout
    report = json.loads(out.read_text())
    lines = {line["field"]: line for line in report["archs"]["sm120"]}
    runner = lines["moe_runner_backend"]
    assert (runner["upstream"], runner["fork"]) == ("auto", "flashinfer_b12x")
    assert "sm120-nvfp4-moe-checkpoint.patch" in runner["patches"]
    assert "sm120-b12x-moe-runner.patch" in runner["patches"]
    loaded = lines["modelopt_quant.nvfp4_moe_runner_backend"]
    assert (loaded["upstream"], loaded["fork"]) == ("flashinfer_trtllm", "flashinfer_b12x")
    assert loaded["upstream_warning"] == "no SM12x kernels (trtllm)"
    assert loaded["warning"] is None
    assert "| moe_runner_backend | auto | flashinfer_b12x | " in done.stdout
    kernels = {k["kind"]: k for k in report["kernels"]["sm120"]}
    assert (kernels["MoE"]["value"], kernels["MoE"]["faster"]) == ("flashinfer_b12x", None)
    assert (kernels["FP4 GEMM"]["value"], kernels["FP4 GEMM"]["faster"]) == (
        "flashinfer_b12x",
        None,
    )
    gb10 = {k["kind"]: k for k in report["kernels"]["sm121"]}
    assert gb10["MoE"]["value"] == "flashinfer_cutlass"
    assert gb10["MoE"]["flag"] == "--moe-runner-backend flashinfer_b12x"
    assert gb10["FP4 GEMM"]["flag"] == "--fp4-gemm-backend flashinfer_cutlass"
    assert "| MoE | flashinfer_cutlass: FlashInfer CUTLASS (SM120 build) |" in done.stdout
