"""Child of the forward dry run: ``python forward_child.py REQUEST.json RESULT.json``.

Runs in the gate environment with the harness's fakes (a faked SM12x GPU at the
torch.cuda boundary, stand-in libcuda/NVML, fake nvidia-smi); tensors live on the CPU.
For each group of sweep cells it resolves one cell's ServerArgs (child.build_server_args,
as the sweep does), publishes them, builds the real ``FusedMoE`` with the checkpoint's
quantization config and the family's layer keywords at each per-rank intermediate
size, loads random checkpoint-shaped experts through the layer's weight loader, runs
``process_weights_after_loading`` and one forward with the kernels replaced by
recorders (forward_recorders.py), and measures the bytes the layer holds.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "scripts")]

from sm120fork.harness import child  # noqa: E402
from sm120fork.harness.probe_support import publish  # noqa: E402
from sm120fork.harness.torch_fakes import fake_hardware  # noqa: E402

import forward_memory  # noqa: E402


def one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _setup(group: dict[str, Any]) -> tuple[Any, Any]:
    """Resolve and publish the cell's ServerArgs; the checkpoint's quantization config."""
    server_args, _ = child.build_server_args(group["model_path"], dict(group["args"]))
    publish(server_args)
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.model_loader.loader import _get_quantization_config

    initialize_moe_config()
    model_config = ModelConfig.from_server_args(server_args)
    return server_args, _get_quantization_config(model_config, LoadConfig())


def _build(quant_config: Any, profile: dict[str, Any], size: int, experts: int, hidden: int) -> Any:
    import torch
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    return FusedMoE(
        num_experts=experts,
        hidden_size=hidden,
        intermediate_size=size,
        layer_id=0,
        params_dtype=torch.bfloat16,
        quant_config=quant_config,
        prefix="model.layers.0.mlp.experts",
        **profile,
    )


def _forward(layer: Any, tokens: int, top_k: int, seed: int) -> tuple[Any, Any]:
    import torch
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layer.hidden_size_unpadded, generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, layer.num_experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    if top_k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    topk = StandardTopKOutput(weights.float(), ids.to(torch.int32), logits.to(torch.bfloat16))
    return (x, topk), layer.forward(x, topk)


def run_size(group: dict[str, Any], quant_config: Any, size: int) -> dict[str, Any]:
    import forward_recorders as rec
    from sglang.srt.runtime_context import get_parallel

    out: dict[str, Any] = {"stage": "build"}
    rec.CALLS.clear()
    rec.PROBLEMS.clear()
    profile = dict(group["profile"])
    top_k = profile["top_k"]
    try:
        ranks = dict(moe_tp_size=1, moe_ep_size=1, moe_tp_rank=0, moe_ep_rank=0, tp_group=None)
        with get_parallel().override(**ranks):
            stamp = time.monotonic()
            layer = _build(quant_config, profile, size, group["experts"], group["hidden"])
            out["runner"] = str(getattr(layer.runner_backend, "value", layer.runner_backend))
            out["method"] = type(layer.quant_method).__name__
            out["stage"] = "load"
            checkpoint = forward_memory.load_random(layer, seed=size, inter=size)
            out["checkpoint_bytes"] = checkpoint.nbytes
            out["padded_intermediate"] = int(getattr(layer, "intermediate_size_per_partition", size))
            out["stage"] = "process"
            layer.quant_method.process_weights_after_loading(layer)
            out["held_bytes"] = forward_memory.held_bytes(layer)
            before = forward_memory.held(layer)
            out["stage"] = "apply"
            with forward_memory.Allocations() as made:
                inputs, output = _forward(layer, group["tokens"], top_k, seed=size)
            out["stage"] = "done"
            out["seconds"] = round(time.monotonic() - stamp, 2)
            extra, workspace = forward_memory.first_forward(before, made, inputs, output)
            out["first_forward_bytes"], out["workspace_bytes"] = extra, workspace
            out["output"] = [str(output.dtype), list(output.shape)]
            if any(c["entry"].endswith("launch_sm120_moe") for c in rec.CALLS):
                out["rel_err"] = forward_memory.compare(checkpoint, inputs, output, profile)
    except Exception as exc:  # noqa: BLE001 - each failure is the cell's observation
        out["error"] = one_line(exc)
        out["where"] = traceback.format_exc().splitlines()[-16:]
    out["calls"] = [c["entry"].rsplit(".", 1)[-1] for c in rec.CALLS]
    out["problems"] = list(dict.fromkeys(rec.PROBLEMS))
    return out


def run_group(group: dict[str, Any]) -> dict[str, Any]:
    import forward_recorders as rec

    try:
        _, quant_config = _setup(group)
    except child.HarnessFailure:
        raise
    except Exception as exc:  # noqa: BLE001 - refused at argument time (or at config)
        return {"refused": one_line(exc)}
    rec.install()
    return {"sizes": {str(size): run_size(group, quant_config, size) for size in group["sizes"]}}


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[1]).read_text())
    fake_hardware(request["arch"])
    sys.path.insert(0, str(Path(request["sglang_path"]).resolve()))
    import sglang

    if not str(Path(str(sglang.__file__)).resolve()).startswith(request["sglang_path"]):
        raise SystemExit(f"sglang imported from {sglang.__file__}, not the tested tree")
    results = {}
    for group in request["groups"]:
        started = time.monotonic()
        try:
            results[group["key"]] = run_group(group)
            print(f"forward group {time.monotonic() - started:.1f} s: {group['key']}", file=sys.stderr)
        except child.HarnessFailure as exc:
            print(f"forward dry run: {exc}", file=sys.stderr)
            return 3
    Path(argv[2]).write_text(json.dumps({"groups": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
