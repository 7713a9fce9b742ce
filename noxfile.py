"""Thin nox sessions over the `sm120fork` tool (scripts/sm120fork).

The logic lives in the package; sessions only install and forward arguments.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

nox.options.sessions = ["check", "tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

PYTHON = "3.11"
TOOL = ["python", "-m", "sm120fork"]
TEST_DEPS = ["pytest>=8", "hypothesis>=6", "pyyaml>=6"]  # yaml: the workflow test
LINT_DEPS = ["ruff", "mypy", *TEST_DEPS, "nox", "check-jsonschema"]


def _install_tool(session: nox.Session) -> None:
    session.install("-e", ".")


@nox.session(python=PYTHON)
def check(session: nox.Session) -> None:
    """Series <-> files consistent, headers valid, exact apply, normal form."""
    _install_tool(session)
    session.run(*TOOL, "check", *session.posargs)


@nox.session(python=PYTHON)
def gates(session: nox.Session) -> None:
    """Inventory every architecture gate of vendor/sglang with its reviewed decision."""
    _install_tool(session)
    session.run(*TOOL, "gates", *session.posargs)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite: the tool's tests, then the architecture-gate tests."""
    _install_tool(session)
    session.install(*TEST_DEPS)
    session.run("pytest", "-q", f"--ignore={GATE_TESTS}", *session.posargs)
    _run_gate_tests(session, [])
    # The expectation table again, against the fork's wheel as a user installs it (the
    # harness's own tests and the intent rebase do not depend on the tree: not repeated).
    wheel_site = str(_installed_fork_wheel(session))
    _run_gate_tests(session, ["--gate-tree", wheel_site], target=GATE_MATRIX)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff and mypy over the tool, the tests and this file."""
    _install_tool(session)
    session.install(*LINT_DEPS)
    session.run("ruff", "check", "scripts", "tests", "noxfile.py", "benchmarks")
    session.run("ruff", "format", "--check", "scripts", "tests", "noxfile.py", "benchmarks")
    session.run("mypy")
    workflows = sorted(str(p) for p in Path(".github/workflows").glob("*.yml"))
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)


@nox.session(python=PYTHON)
def wheel(session: nox.Session) -> None:
    """dist/sglang-<upstream>+sm120.<n>-<tags>.whl (`-- --all`: one per upstream wheel)."""
    _install_tool(session)
    session.run(*TOOL, "wheel", *session.posargs)


@nox.session(python=PYTHON)
def rebase(session: nox.Session) -> None:
    """Rebase the series onto an upstream release (`-- v0.5.10`, `-- --continue`, `-- --abort`)."""
    _install_tool(session)
    session.run(*TOOL, "rebase", *session.posargs)


# --- architecture-gate tests (tests/gates) -----------------------------------------
# They run in their own environment: upstream sglang's wheel with its pinned
# dependencies (torch+CUDA, sgl-kernel, flashinfer, ... ~11 GB), because sglang
# imports its CUDA extensions once torch.cuda is faked as available. The venv lives
# outside the checkout, keyed by the vendored version, so fresh clones reuse it; pip
# reinstalls only when the requirements below change. The tested sglang tree shadows
# the installed one through sys.path (see tests/gates/README.md).

GATE_TESTS = "tests/gates"
GATE_MATRIX = f"{GATE_TESTS}/test_gate_matrix.py"


def _vendored_version() -> str:
    lock = Path("vendor/sglang.lock")
    if lock.is_file():
        return str(tomllib.loads(lock.read_text())["version"])
    text = Path("vendor/sglang/python/sglang/_version.py").read_text()
    match = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text)
    if not match:
        raise RuntimeError("cannot tell the vendored sglang version: no vendor/sglang.lock")
    return match.group(1)


def _gate_requirements(version: str) -> list[str]:
    """Upstream's wheel (it brings its own pins), pytest, and the tool's own deps
    (`sm120fork apply` builds the patched tree inside the gate run)."""
    tool_deps = tomllib.loads(Path("pyproject.toml").read_text())["project"]["dependencies"]
    return [f"sglang=={version}", "pytest>=8", *tool_deps]


def _gate_env(session: nox.Session) -> Path:
    """The gate venv's python, created or updated as needed."""
    version = _vendored_version()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = Path(os.environ.get("SM120_GATE_ENV") or cache / "sglang-sm120" / f"gate-env-{version}")
    python = venv / "bin" / "python"
    stamp = venv / "sm120-gate-requirements.txt"
    requirements = _gate_requirements(version)
    wanted = "\n".join(requirements) + "\n"
    if not python.exists():
        session.run("python", "-m", "venv", str(venv))
    if not stamp.is_file() or stamp.read_text() != wanted:
        session.log(f"installing the gate environment into {venv} (several GB, first time)")
        session.run(str(python), "-m", "pip", "install", *requirements, external=True)
        stamp.write_text(wanted)
    return python


def _installed_fork_wheel(session: nox.Session) -> Path:
    """Build the fork's wheel and `pip install --target` it; the directory holding sglang/."""
    work = Path("build") / "gate-wheel"
    session.run("rm", "-rf", str(work), external=True)
    session.run(*TOOL, "wheel", "--dist", str(work / "dist"))
    (built,) = sorted((work / "dist").glob("sglang-*+sm120.*.whl"))
    python = _gate_env(session)
    site = work / "site"
    session.run(
        str(python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(built),
        external=True,
    )  # fmt: skip
    return site


def _run_gate_tests(session: nox.Session, args: list[str], target: str = GATE_TESTS) -> None:
    python = _gate_env(session)
    pytest = [str(python), "-m", "pytest", target, f"--confcutdir={GATE_TESTS}"]
    session.run(*pytest, "-p", "no:cacheprovider", "-q", *args, external=True)


@nox.session(python=PYTHON)
def gate_tests(session: nox.Session) -> None:
    """Architecture-gate tests, pristine and patched (`-- --gate-tree DIR` etc.: pytest args)."""
    _run_gate_tests(session, session.posargs)


@nox.session(python=PYTHON)
def gate_bench(session: nox.Session) -> None:
    """Time the full gate matrix (benchmarks/gate_matrix.py; `-- --jobs 1 2 3`)."""
    python = _gate_env(session)
    session.run(str(python), "benchmarks/gate_matrix.py", *session.posargs, external=True)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The tools against the standard tools on real upstream data (`-- --with-tests`)."""
    _install_tool(session)
    session.install("wheel")
    session.run("python", "benchmarks/bench.py", *session.posargs)
