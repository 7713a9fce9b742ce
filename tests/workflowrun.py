"""Run a GitHub Actions job's shell steps here, as the runner would: in order, with
`bash -eo pipefail`, each step's `env`, `$GITHUB_OUTPUT` read back into
`steps.<id>.outputs`, and `if:` conditions (the few forms our workflows use;
any other form fails the test, so the runner never silently misreads one).
`uses:` steps are skipped: the test sets up what they would.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
_OUTPUT = re.compile(r"steps\.([\w-]+)\.outputs\.([\w-]+)")
_CONDITION = re.compile(rf"{_OUTPUT.pattern}\s*(==|!=)\s*'([^']*)'")


@dataclass(frozen=True)
class Step:
    name: str
    id: str | None
    condition: str | None
    run: str | None  # None for a `uses:` step
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRun:
    name: str
    ran: bool
    returncode: int
    output: str


def load_steps(workflow: Path, job: str) -> list[Step]:
    data: dict[str, Any] = yaml.safe_load(workflow.read_text())
    steps = []
    for raw in data["jobs"][job]["steps"]:
        name = raw.get("name") or raw.get("uses") or raw["run"]
        env = {str(k): str(v) for k, v in (raw.get("env") or {}).items()}
        steps.append(Step(name, raw.get("id"), raw.get("if"), raw.get("run"), env))
    return steps


def run_job(
    steps: list[Step], cwd: Path, env: Mapping[str, str], skip: frozenset[str]
) -> list[StepRun]:
    """Run every step not in `skip` (names) whose condition holds; stop running the
    default (success()) steps after a failure, as GitHub does."""
    outputs: dict[str, dict[str, str]] = {}
    failed = False
    runs = []
    for step in steps:
        if step.run is None or step.name in skip:
            continue
        if not _holds(step.condition, outputs, failed):
            runs.append(StepRun(step.name, False, 0, ""))
            continue
        assert "${{" not in step.run, f"{step.name}: pass expressions through env, not run"
        output_file = cwd.parent / f"github-output-{len(runs)}"
        output_file.write_text("")
        step_env = {k: _expand(v, outputs) for k, v in step.env.items()}
        result = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step.run],
            cwd=cwd,
            env={**env, **step_env, "GITHUB_OUTPUT": str(output_file)},
            capture_output=True,
            text=True,
            check=False,
        )
        if step.id is not None:
            outputs[step.id] = _read_outputs(output_file.read_text())
        failed = failed or result.returncode != 0
        runs.append(StepRun(step.name, True, result.returncode, result.stdout + result.stderr))
    return runs


def _holds(condition: str | None, outputs: Mapping[str, Mapping[str, str]], failed: bool) -> bool:
    if condition is None:
        return not failed
    text = condition.strip()
    if text == "always()":
        return True
    match = _CONDITION.fullmatch(text)
    assert match is not None, f"workflowrun cannot evaluate `if: {condition}`"
    step, key, operator, value = match.groups()
    actual = outputs.get(step, {}).get(key, "")
    return not failed and ((actual == value) == (operator == "=="))


def _expand(value: str, outputs: Mapping[str, Mapping[str, str]]) -> str:
    def one(match: re.Match[str]) -> str:
        expression = match.group(1)
        if expression == "github.token":
            return "test-token"
        found = _OUTPUT.fullmatch(expression)
        assert found is not None, f"workflowrun cannot evaluate ${{{{ {expression} }}}}"
        return outputs.get(found.group(1), {}).get(found.group(2), "")

    return _EXPRESSION.sub(one, value)


def _read_outputs(text: str) -> dict[str, str]:
    # Only the `key=value` form (no heredoc delimiters: our steps do not write them).
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
