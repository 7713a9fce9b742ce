"""Parent side of the forward dry run (test_moe_forward.py): which cells share a run,
their requests, the child that runs them, the memory table. Standard library only."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from sm120fork.harness import moe_sweep, runner, spec
from sm120fork.harness.zygotes import child_environ

from . import forward_cells

CHILD = Path(__file__).with_name("forward_child.py")
# What decides the forward besides the format and the layer keywords.
ARG_FIELDS = (
    "quantization",
    "dtype",
    "moe_runner_backend",
    "moe_a2a_backend",
    "modelopt_quant.nvfp4_moe_runner_backend",
)
Forward = dict[str, dict[str, dict[str, dict[str, Any]]]]  # tree -> arch -> cell -> result


def key(cell: forward_cells.ForwardCell, obs: dict[str, Any]) -> str:
    fields = {f: obs.get(f) for f in ARG_FIELDS}
    fields |= {k: v for k, v in obs.items() if k.startswith("env.")}
    fixed = cell.cell.family.architecture in moe_sweep.FIXED_EXPERTS
    arch = cell.cell.family.architecture if fixed else None
    return json.dumps([cell.cell.fmt, fields, cell.profile.kwargs(), arch], sort_keys=True)


def group(cell: forward_cells.ForwardCell, key: str, where: Path) -> dict[str, Any]:
    folder = where / re.sub(r"[^A-Za-z0-9_.+-]", "_", cell.name)
    folder.mkdir(parents=True, exist_ok=True)
    config = moe_sweep._config(cell.cell.family, cell.cell.fmt)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return {
        "key": key,
        "model_path": str(folder.resolve()),
        "args": {"moe_runner_backend": cell.cell.forced} if cell.cell.forced else {},
        "profile": cell.profile.kwargs(),
        "sizes": list(cell.sizes),
        "experts": forward_cells.EXPERTS,
        "hidden": forward_cells.HIDDEN,
        "tokens": forward_cells.TOKENS,
    }


def run_child(
    tree: Path, arch: spec.Arch, groups: list[dict[str, Any]], pool: runner.ZygotePool, at: Path
) -> dict[str, Any]:
    at.mkdir(parents=True, exist_ok=True)
    request, result, log = at / "request.json", at / "result.json", at / "child.log"
    request.write_text(
        json.dumps({"arch": arch.child_request(), "sglang_path": str(tree), "groups": groups})
    )
    env = child_environ(arch, pool.stubs, at, pool.hf_home)
    with log.open("w") as out:
        code = subprocess.run(
            [pool.python, "-W", "ignore", str(CHILD), str(request), str(result)],
            env=env, cwd=spec.REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=900,
        ).returncode  # fmt: skip
    if code != 0 or not result.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise runner.HarnessError(f"forward child {arch.name} on {tree} exited {code}:\n{tail}")
    groups_out: dict[str, Any] = json.loads(result.read_text())["groups"]
    return groups_out


def memory_table(forward: Forward) -> list[str]:
    """runner, format, I -> (held after loading, first forward) per checkpoint byte."""
    rows = set()
    for label, per_arch in forward.items():
        for arch, per in per_arch.items():
            for result in per.values():
                for size, r in result.get("sizes", {}).items():
                    if "held_bytes" in r:
                        first = r.get("first_forward_bytes")
                        first_x = "-" if first is None else f"{first / r['checkpoint_bytes']:.2f}x"
                        rows.add(
                            f"{label} {arch} {r['runner']:<18} {r['method']:<34} I={size:<4} "
                            f"held {r['held_bytes'] / r['checkpoint_bytes']:.2f}x first {first_x}"
                        )
    return sorted(rows)
