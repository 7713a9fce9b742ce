"""`explain`: what sglang resolves for one checkpoint on one GPU, upstream beside the fork.

For an SM120 user deciding whether the fork fixes their model before installing it:
the gate harness observes one scenario built from their checkpoint directory
(config.json is enough) on the pristine tree and on the fork's tree, and prints
the decisions side by side. A difference names the patches whose rows in
expectations.toml change that field; a fork choice that names code the review
policy lists as having no SM12x kernels (patches/gates.toml [wrongly_included])
is flagged.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sm120fork.gates import load_policy

from . import kernels, runner, spec, table, trees

# What a user asks about, in this order; every other observed field stays in the JSON.
SHOWN = (
    "error",
    "quantization",
    "moe_runner_backend",
    "modelopt_quant.nvfp4_moe_runner_backend",
    "moe_a2a_backend",
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "kv_cache_dtype",
    "dsa_prefill_backend",
    "dsa_decode_backend",
    "fp8_gemm_runner_backend",
    "fp4_gemm_runner_backend",
    "fp4_utils.fp4_gemm_runner_backend",
    "flashinfer_allreduce_fusion_backend",
    "communicator.apply_flashinfer_allreduce_fusion",
)
PROBES = ("allreduce_fusion", "fp8_gemm", "fp4_gemm", "nvfp4_moe")
# trtllm_mha on SM12x is FlashInfer FMHAv2 prefill / XQA decode (the policy's own
# note on the "trtllm" token), so that value is not flagged.
NOT_FLAGGED = frozenset({"trtllm_mha"})
SM12X = ("sm120", "sm121")


class ExplainError(ValueError):
    """Bad input: the message is the one line the user sees."""


@dataclass(frozen=True)
class Line:
    field: str
    upstream: str
    fork: str
    patches: tuple[str, ...]  # the patches whose rows change this field
    warning: str | None  # the fork's value names code without SM12x kernels
    upstream_warning: str | None  # the same for upstream's value


def scenario_args(extra: Sequence[str]) -> dict[str, Any]:
    """`--tp-size 8 --quantization modelopt_fp4 --flag` as ServerArgs keyword arguments."""
    args: dict[str, Any] = {}
    items = list(extra)
    while items:
        item = items.pop(0)
        if not item.startswith("--"):
            raise ExplainError(f"sglang argument {item!r} is not of the form --name [value]")
        name, _, value = item[2:].partition("=")
        key = {"tp": "tp_size"}.get(name, name).replace("-", "_")
        if not value:
            value = items.pop(0) if items and not items[0].startswith("--") else "true"
        args[key] = _typed(value)
    return args


def _typed(value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return int(value)
    except ValueError:
        return value


def checkpoint(model_path: Path) -> Path:
    if not (model_path / "config.json").is_file():
        raise ExplainError(
            f"{model_path} has no config.json; pass the checkpoint directory "
            "(config.json is enough, no weights needed)"
        )
    return model_path.resolve()


def patches_by_field() -> dict[str, tuple[str, ...]]:
    found: dict[str, set[str]] = {}
    for row in table.load_table([a.name for a in spec.load_archs()]).rows:
        if row.patch:
            found.setdefault(row.field, set()).add(row.patch)
    return {name: tuple(sorted(patches)) for name, patches in found.items()}


def no_kernel_tokens(policy: Path = spec.REPO_ROOT / "patches" / "gates.toml") -> tuple[str, ...]:
    """The tokens patches/gates.toml says name code without SM12x kernels."""
    return tuple(load_policy(policy).tokens)


def _warning(arch: str, value: str, tokens: Sequence[str]) -> str | None:
    if arch not in SM12X or value in NOT_FLAGGED:
        return None
    hits = [t for t in tokens if t in value.lower()]
    return f"no SM12x kernels ({', '.join(hits)})" if hits else None


def compare(
    upstream: Mapping[str, Any],
    fork: Mapping[str, Any],
    arch: str,
    patches: Mapping[str, tuple[str, ...]],
    tokens: Sequence[str],
) -> list[Line]:
    lines = []
    for name in SHOWN:
        if name not in upstream and name not in fork:
            continue
        old = table.render(table.observed_cell(upstream, name)).strip('"')
        new = table.render(table.observed_cell(fork, name)).strip('"')
        if "<missing>" in (old, new) and old == new:
            continue
        changed = patches.get(name, ()) if old != new else ()
        warnings = _warning(arch, new, tokens), _warning(arch, old, tokens)
        lines.append(Line(name, old, new, changed, *warnings))
    return lines


def markdown(model: Path, arch: str, fork: str, lines: Sequence[Line]) -> str:
    out = [
        f"## {model.name} on {arch}",
        "",
        f"upstream: pristine vendor/sglang; fork: {fork}",
        "",
        "| field | upstream | fork | why |",
        "|---|---|---|---|",
    ]
    for line in lines:
        why = (
            ", ".join(line.patches)
            if line.patches
            else ("changed" if line.upstream != line.fork else "")
        )
        if line.warning:
            why = f"{why}; WARNING {line.warning}" if why else f"WARNING {line.warning}"
        upstream = line.upstream
        if line.upstream_warning:
            upstream = f"{upstream} (WARNING {line.upstream_warning})"
        out.append(f"| {line.field} | {upstream} | {line.fork} | {why} |")
    return "\n".join(out) + "\n"


def explain(
    model_path: Path,
    arch_names: Sequence[str],
    fork_tree: str,
    extra: Sequence[str],
    json_out: Path | None = None,
) -> str:
    model = checkpoint(model_path)
    known = {a.name: a for a in spec.load_archs()}
    unknown = [a for a in arch_names if a not in known]
    if unknown:
        raise ExplainError(f"unknown architecture {unknown[0]!r}; one of {', '.join(known)}")
    args = scenario_args(extra)
    scenario = spec.Scenario(name="explain", model=str(model), args=args, probes=PROBES)
    # The same checkpoint with b12x forced: does the fork let b12x serve it?
    forced = spec.Scenario(
        name="explain_b12x",
        model=str(model),
        args={**args, **kernels.FORCED_MOE},
        probes=("nvfp4_moe",),
    )
    with tempfile.TemporaryDirectory(prefix="sm120-explain-") as tmp:
        scratch = Path(tmp)
        fork = (
            trees.build_patched_tree(scratch / "patched")
            if fork_tree == trees.PATCHED
            else trees.Tree("fork", Path(fork_tree).resolve(), trees.PATCHED)
        )
        runs = runner.run_matrices(
            {"upstream": trees.pristine_tree().path, "fork": fork.path},
            [known[a] for a in arch_names],
            [scenario, forced],
            scratch=scratch,
        )
    patches, tokens = patches_by_field(), no_kernel_tokens()
    report: dict[str, list[dict[str, Any]]] = {}
    kernel_report: dict[str, list[dict[str, Any]]] = {}
    text = []
    for arch in arch_names:
        upstream = runs["upstream"].observations[arch]["explain"]
        forked = runs["fork"].observations[arch]["explain"]
        lines = compare(upstream, forked, arch, patches, tokens)
        report[arch] = [asdict(line) for line in lines]
        fork_kernels = kernels.kernel_lines(
            arch, forked, runs["fork"].observations[arch]["explain_b12x"]
        )
        kernel_report[arch] = [asdict(line) for line in fork_kernels]
        text.append(markdown(model, arch, fork_tree, lines) + kernels.markdown(fork_kernels))
    if json_out is not None:
        payload = {"model": str(model), "archs": report, "kernels": kernel_report}
        json_out.write_text(json.dumps(payload, indent=1))
    return "\n".join(text)
