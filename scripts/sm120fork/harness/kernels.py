"""`explain`'s kernel lines: the MoE and FP4 GEMM kernel a checkpoint gets on SM12x,
whether a faster one exists for it, and the flag that selects it.

"Faster" rests on cited figures, never on a measurement here (no SM12x hardware):
docs/sm120-gates.md, "FlashInfer b12x". A faster MoE runner is offered only where the
fork itself accepts it for this checkpoint: explain runs the checkpoint a second time
with that runner forced (scenario ``explain_b12x``), and an argument-time refusal there
means b12x cannot serve the model (EP, its activation, its quantization).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MOE_FIELD = "modelopt_quant.nvfp4_moe_runner_backend"
FP4_FIELD = "fp4_utils.fp4_gemm_runner_backend"
B12X = "flashinfer_b12x"
FORCED_MOE = {"moe_runner_backend": B12X}  # the second scenario's extra arguments
NVFP4 = ("modelopt_fp4", "modelopt_mixed")  # checkpoints whose kernels the probes observe

KERNELS = {
    "flashinfer_b12x": "FlashInfer b12x (CuTe DSL, written for SM120/SM121)",
    "flashinfer_cutlass": "FlashInfer CUTLASS (SM120 build)",
    "flashinfer_cudnn": "FlashInfer cuDNN",
    "flashinfer_cutedsl": "FlashInfer CuTe DSL (SM100 tcgen05)",
    "flashinfer_trtllm": "TensorRT-LLM-gen (SM100 only)",
    "marlin": "Marlin W4A16 (weight-only)",
}
# (kind, arch) -> (the faster choice, its flag, the evidence it rests on)
FASTER = {
    ("MoE", "sm120"): (
        B12X,
        "--moe-runner-backend flashinfer_b12x",
        "vllm-project/vllm#40082, #47577 (cited)",
    ),
    ("MoE", "sm121"): (
        B12X,
        "--moe-runner-backend flashinfer_b12x",
        "opt-in on GB10: SM120 figures only, flashinfer#3359 (cited)",
    ),
    ("FP4 GEMM", "sm120"): (
        B12X,
        "--fp4-gemm-backend flashinfer_b12x",
        "sgl-project/sglang#38170 (cited)",
    ),
    ("FP4 GEMM", "sm121"): (
        "flashinfer_cutlass",
        "--fp4-gemm-backend flashinfer_cutlass",
        "FlashInfer's own mm_fp4 auto prefers cutlass/cudnn on SM121",
    ),
}


@dataclass(frozen=True)
class KernelLine:
    kind: str  # "MoE" or "FP4 GEMM"
    value: str  # the fork's runner
    kernel: str
    faster: str | None  # the faster runner, None when the fork already picks it
    flag: str | None
    evidence: str | None


def _value(obs: Mapping[str, Any], field: str) -> str | None:
    value = obs.get(field)
    return value if isinstance(value, str) and not value.startswith("<") else None


def kernel_lines(
    arch: str, fork: Mapping[str, Any], forced_b12x: Mapping[str, Any]
) -> list[KernelLine]:
    """The fork's MoE / FP4 GEMM kernels on an SM12x arch ([] elsewhere)."""
    if arch not in ("sm120", "sm121") or fork.get("quantization") not in NVFP4:
        return []
    lines = []
    b12x_serves = forced_b12x.get("error") is None and _value(forced_b12x, MOE_FIELD) == B12X
    for kind, field in (("MoE", MOE_FIELD), ("FP4 GEMM", FP4_FIELD)):
        value = _value(fork, field)
        if value is None:
            continue
        faster: str | None
        flag: str | None
        evidence: str | None
        faster, flag, evidence = FASTER[(kind, arch)]
        if faster == value or (kind == "MoE" and not b12x_serves):
            faster = flag = evidence = None
        lines.append(KernelLine(kind, value, KERNELS.get(value, value), faster, flag, evidence))
    return lines


def markdown(lines: list[KernelLine]) -> str:
    if not lines:
        return ""
    out = ["", "| kernel | fork's choice | faster option |", "|---|---|---|"]
    for line in lines:
        faster = f"{line.faster}: `{line.flag}` ({line.evidence})" if line.faster else "none known"
        out.append(f"| {line.kind} | {line.value}: {line.kernel} | {faster} |")
    return "\n".join(out) + "\n"
