"""Thin nox sessions over the `sm120fork` tool (scripts/sm120fork).

The logic lives in the package; sessions only install and forward arguments.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

# Where the gate environment lives (standard library only; its install runs in a session).
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from sm120fork import gateenv

nox.options.sessions = ["check", "tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

PYTHON = "3.11"
TOOL = ["python", "-m", "sm120fork"]
TEST_DEPS = ["pytest>=8", "hypothesis>=6", "pyyaml>=6"]  # yaml: the workflow test
FAST_MARKS = ["-m", "not slow and not network"]  # the fast tier's tool tests
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
    """The whole test suite: the tool's tests, and beside them the architecture-gate tests.

    `-- --fast`: the fast tier: the tool's tests but those marked slow or network,
    and of the gate tests the table's matrix on the pristine and patched trees (every
    row's bite: each row naming a patch fails on pristine, every row passes patched).
    The tool's tests run in the background (their output is shown when they end)
    while the gate tests run: either alone leaves one of the two cores mostly idle
    (pytest is one process; the gate matrix waits on its children).
    """
    args = list(session.posargs)
    fast = "--fast" in args
    if fast:
        args.remove("--fast")
    _install_tool(session)
    session.install(*TEST_DEPS)
    scratch = Path(tempfile.mkdtemp(prefix="sm120fork-tests-"))
    quick = _start_quick_tests(session, scratch, [*(FAST_MARKS if fast else []), *args])
    try:
        # The gate table on three trees in one matrix: pristine, patched, and the fork's
        # wheel as a user installs it (one pool of children keeps both cores busy).
        trees = ["pristine", "patched"]
        if not fast:
            trees.append(f"installed-wheel={_installed_fork_wheel(session)}")
        tree_args = [arg for tree in trees for arg in ("--gate-tree", tree)]
        target = GATE_MATRIX if fast else GATE_TESTS
        _run_gate_tests(session, [*tree_args, f"--basetemp={scratch / 'gates'}"], target)
    finally:
        quick_failed = _finish_quick_tests(session, *quick)
        shutil.rmtree(scratch, ignore_errors=True)
    if quick_failed:
        session.error("the tool's tests failed (their output is above)")


def _start_quick_tests(
    session: nox.Session, scratch: Path, args: list[str]
) -> tuple[subprocess.Popen[bytes], Path]:
    log = scratch / "quick.log"
    bin_dir = str(session.bin)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    argv = [f"{bin_dir}/pytest", "-q", f"--ignore={GATE_TESTS}", f"--basetemp={scratch / 'quick'}"]
    argv.append("--durations=10")  # where the suite's time goes, at its end
    session.log(f"{' '.join([*argv[1:], *args])} (in the background, output at its end)")
    with log.open("wb") as out:
        process = subprocess.Popen([*argv, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    return process, log


def _finish_quick_tests(session: nox.Session, process: subprocess.Popen[bytes], log: Path) -> bool:
    """Wait for the tool's tests and show their output; True when they failed."""
    code = process.wait()
    session.log(f"the tool's tests (pytest -q --ignore={GATE_TESTS}) exited {code}:")
    print(log.read_text(errors="replace"), end="", flush=True)
    return code != 0


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


@nox.session(python=PYTHON)
def review(session: nox.Session) -> None:
    """What a change to patches/ does (`-- BASE [HEAD]`): build/review/review.{md,json}."""
    _install_tool(session)
    session.run(*TOOL, "review", *session.posargs)


# --- architecture-gate tests (tests/gates) -----------------------------------------
# They run in their own environment: upstream sglang's wheel with its pinned
# dependencies (torch+CUDA, sgl-kernel, flashinfer, ... ~11 GB), because sglang
# imports its CUDA extensions once torch.cuda is faked as available. The venv lives
# outside the checkout (~/.cache/sglang-sm120/gate-env-<version>), so fresh clones
# reuse it; `sm120fork.gateenv` installs it with uv, a line per phase, uv's output in a log.
# The tested sglang tree shadows the installed one through sys.path (gatetable/README.md).

GATE_TESTS = "tests/gates"
GATE_MATRIX = f"{GATE_TESTS}/test_gate_matrix.py"


def _gate_env(session: nox.Session) -> Path:
    """The gate venv's python, installed or updated first (needs the tool installed)."""
    session.run("python", "-m", "sm120fork.gateenv")
    return gateenv.locate(Path.cwd()).python


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


def _run_gate_tests(session: nox.Session, args: list[str], target: str | None = GATE_TESTS) -> None:
    python = _gate_env(session)
    pytest = [
        str(python),
        "-m",
        "pytest",
        *([target] if target else []),
        f"--confcutdir={GATE_TESTS}",
    ]
    session.run(*pytest, "-p", "no:cacheprovider", "-q", *args, external=True)


@nox.session(python=PYTHON)
def gate_tests(session: nox.Session) -> None:
    """Architecture-gate tests, pristine and patched (`-- tests/gates/test_X.py --gate-tree DIR`).

    The arguments go to pytest; a test file among them runs instead of all of tests/gates."""
    _install_tool(session)
    named = any(arg.split("::")[0].startswith(GATE_TESTS) for arg in session.posargs)
    _run_gate_tests(session, session.posargs, None if named else GATE_TESTS)


@nox.session(python=PYTHON)
def explain(session: nox.Session) -> None:
    """What sglang resolves for one checkpoint on one GPU, upstream beside the fork.

    `-- --model-path DIR [--arch sm120] [--tree patched|wheel|DIR] [-- sglang args]`
    """
    _install_tool(session)
    args = list(session.posargs)
    if "--tree" in args and args[args.index("--tree") + 1 : args.index("--tree") + 2] == ["wheel"]:
        args[args.index("--tree") + 1] = str(_installed_fork_wheel(session))
    python = _gate_env(session)
    harness = [str(python), "-m", "sm120fork.harness", "explain", *args]
    session.run(*harness, external=True, env={"PYTHONPATH": "scripts"})


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """How apply, check and the rebase grow against the standard tools (`-- --with-tests`)."""
    _install_tool(session)
    session.run("python", "benchmarks/bench.py", *session.posargs)
