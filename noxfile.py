"""Thin nox sessions over the `sm120fork` tool (scripts/sm120fork).

The logic lives in the package; sessions only install and forward arguments.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["check", "tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

PYTHON = "3.11"
TOOL = ["python", "-m", "sm120fork"]
TEST_DEPS = ["pytest>=8", "hypothesis>=6"]
LINT_DEPS = ["ruff", "mypy", "pytest>=8", "hypothesis>=6", "nox"]


def _install_tool(session: nox.Session) -> None:
    session.install("-e", ".")


@nox.session(python=PYTHON)
def check(session: nox.Session) -> None:
    """Series <-> files consistent, headers valid, exact apply, normal form."""
    _install_tool(session)
    session.run(*TOOL, "check", *session.posargs)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite: the tool's tests, then the architecture-gate tests."""
    _install_tool(session)
    session.install(*TEST_DEPS)
    session.run("pytest", "-q", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff and mypy over the tool, the tests and this file."""
    _install_tool(session)
    session.install(*LINT_DEPS)
    session.run("ruff", "check", "scripts", "tests", "noxfile.py", "benchmarks")
    session.run("ruff", "format", "--check", "scripts", "tests", "noxfile.py", "benchmarks")
    session.run("mypy")
