"""A rebase across a synthetic reformat and a synthetic move of the patched Glm4Moe gate
ends `resolved` (the patch's intent re-applied with libcst), and the gate table's
Glm4Moe rows hold on the result, judged by the real sglang on faked sm100 and sm120.

Upstream here is a local git remote made from vendor/sglang: v0.5.9 as vendored,
v0.5.10 with the gate reformatted, v0.5.11 with the whole override moved into a
module of its own behind a registration decorator (as upstream did by 0.5.19).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .gate_harness import runner, spec, table

ROOT = Path(__file__).resolve().parents[2]
SA = "python/sglang/srt/server_args.py"
MOVED_TO = "python/sglang/srt/model_overrides_glm4.py"
PATCH = "sm120-glm4-moe-runner.patch"
GATE = "            if is_sm100_supported():\n                quantization_config = getattr("
REFORMATTED = (
    "            if (\n                is_sm100_supported()\n            ):\n"
    "                quantization_config = getattr("
)
HEADER = '        elif model_arch in ["Glm4MoeForCausalLM"]:\n'
MODULE = '''\
"""Config-time overrides for Glm4MoeForCausalLM (moved out of server_args.py)."""

import logging

from sglang.srt.utils.common import check_pkg_version_at_least, is_sm100_supported

logger = logging.getLogger(__name__)


def _register_for(model_arch):
    return lambda function: function


@_register_for("Glm4MoeForCausalLM")
def glm4_moe_overrides(self, hf_config):
'''
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "Upstream",
    "GIT_AUTHOR_EMAIL": "upstream@example.com",
    "GIT_COMMITTER_NAME": "Upstream",
    "GIT_COMMITTER_EMAIL": "upstream@example.com",
    "GIT_AUTHOR_DATE": "2026-01-02T03:04:05+00:00",
    "GIT_COMMITTER_DATE": "2026-01-02T03:04:05+00:00",
}


def _run(cwd: Path, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **GIT_ENV, "HOME": str(home), "PYTHONPATH": str(ROOT / "scripts")}
    env["SM120FORK_DATE"] = "2026-12-01"
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, check=False)


def _moved(server_args: str) -> tuple[str, str]:
    """server_args.py without the Glm4Moe block, and the module that now holds it."""
    start = server_args.index(HEADER) + len(HEADER)
    end = server_args.index("\n        elif model_arch in [", start)
    block = server_args[start:end]
    body = "".join(line[4:] if line.strip() else line for line in block.splitlines(True))
    call = (
        "            from sglang.srt.model_overrides_glm4 import glm4_moe_overrides\n\n"
        "            glm4_moe_overrides(self, hf_config)\n"
    )
    return server_args[:start] + call + server_args[end:], MODULE + body + "\n"


@pytest.fixture(scope="module")
def landed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    tmp = tmp_path_factory.mktemp("intent-rebase")
    home = tmp / "home"
    home.mkdir()
    upstream = tmp / "upstream"
    shutil.copytree(ROOT / "vendor" / "sglang", upstream)

    def git(cwd: Path, *args: str) -> None:
        result = _run(cwd, "git", *args, home=home)
        assert result.returncode == 0, result.stderr

    git(upstream, "init", "-q", ".")
    for tag in ("v0.5.9", "v0.5.10", "v0.5.11"):
        sa = upstream / SA
        if tag == "v0.5.10":
            sa.write_text(sa.read_text().replace(GATE, REFORMATTED, 1))
        if tag == "v0.5.11":
            remaining, module = _moved(sa.read_text())
            sa.write_text(remaining)
            (upstream / MOVED_TO).write_text(module)
        git(upstream, "add", "-A", ".")
        git(upstream, "commit", "-q", "-m", f"release {tag}")
        git(upstream, "tag", tag)

    fork = tmp / "fork"
    fork.mkdir()
    for name in ("vendor", "patches", "CHANGELOG.md"):
        source = ROOT / name
        copy = shutil.copytree if source.is_dir() else shutil.copy
        copy(source, fork / name)
    (fork / ".gitignore").write_text("/build/\n")
    git(fork, "init", "-q", ".")
    git(fork, "add", "-A", ".")
    git(fork, "commit", "-q", "-m", "the fork at 0.5.9")
    python = [sys.executable, "-m", "sm120fork", "-C", str(fork)]
    rebase = _run(
        fork, *python, "rebase", "v0.5.11", "--step", "--upstream-git", upstream.as_uri(), home=home
    )
    assert rebase.returncode == 0, rebase.stderr
    applied = _run(fork, *python, "apply", "--out", str(tmp / "applied"), home=home)
    assert applied.returncode == 0, applied.stderr
    report = json.loads((fork / "build/rebase/report.json").read_text())
    return tmp / "applied" / "python", report


def test_the_moved_and_reformatted_gate_is_resolved_by_intent(
    landed: tuple[Path, dict[str, object]],
) -> None:
    _, report = landed
    patches = {p["name"]: p for p in report["patches"]}  # type: ignore[attr-defined]
    assert patches[PATCH]["status"] == "resolved", patches[PATCH]
    assert MOVED_TO in patches[PATCH]["detail"]
    assert [s["status"] for s in patches[PATCH]["steps"]] == ["resolved", "resolved"]


def test_gate_rows_hold_on_the_resolved_tree(
    landed: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    tree, _ = landed
    archs = [a for a in spec.load_archs() if a.name in ("sm100", "sm120")]
    scenarios = [s for s in spec.load_scenarios().values() if s.name.startswith("glm4_moe")]
    matrix = runner.run_matrices({"resolved": tree}, archs, scenarios, scratch=tmp_path)
    observations = matrix["resolved"].observations
    rows = [
        r for r in table.load_table([a.name for a in spec.load_archs()]).rows if r.patch == PATCH
    ]
    assert rows, f"no expectation rows name {PATCH}"
    wrong = [
        f"{row.label} {cell.arch}: expected {cell.expected!r}, observed {cell.observed!r}"
        for row in rows
        for cell in table.check_row(row, observations)
        if cell.arch in ("sm100", "sm120") and not cell.ok
    ]
    assert not wrong, "\n".join(wrong)
