"""How a gate venv is installed with uv (sm120fork/rebase/uvinstall.py, gateenv.install) and
what a release whose pins cannot be installed gives the rebase (decisionenv): the
uv command line is read, not run, except through a fake uv that fails."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import pytest
from sm120fork import gateenv
from sm120fork.rebase import decisionenv, uvinstall


@pytest.fixture
def pip_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A machine whose only pip configuration is a site pip.conf under tmp_path."""
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "xdg"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home-config"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("PIP_CONFIG_FILE", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(uvinstall, "_SYSTEM_CONFIG", tmp_path / "etc-pip.conf")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch<=2.14.1\n")
    (tmp_path / "xdg" / "pip").mkdir(parents=True)
    (tmp_path / "xdg" / "pip" / "pip.conf").write_text(f"[global]\nconstraint = {constraints}\n")
    return constraints


def test_pips_constraint_file_is_passed_to_uv(pip_config: Path, tmp_path: Path) -> None:
    assert uvinstall.pip_constraints() == [pip_config]
    _, install = uvinstall.commands(
        tmp_path / "venv", tmp_path / "uv", ["torch==2.14.1"], (None, ()), tmp_path
    )
    assert install[install.index("--constraint") + 1] == str(pip_config)
    assert install[install.index("--link-mode") + 1] == "hardlink"
    assert install[install.index("--cache-dir") + 1] == str(tmp_path / "uv")
    assert "--exclude-newer" not in install and "--overrides" not in install


def test_pip_constraint_variable_wins(
    pip_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "other.txt"
    other.write_text("torch<2\n")
    monkeypatch.setenv("PIP_CONSTRAINT", str(other))
    assert uvinstall.pip_constraints() == [other]


def test_the_release_resolves_as_of_its_time_and_the_tool_as_of_now(
    pip_config: Path, tmp_path: Path
) -> None:
    released = datetime.datetime(2026, 10, 30, 1, 4, 36, tzinfo=datetime.UTC)
    assert uvinstall.as_of(released) == "2026-10-31T01:04:36Z"
    requirements = ["torch==2.14.1", "cuda_tile == 1.6.0rc5", "unidiff>=1.0"]
    as_of = ("2026-10-31T01:04:36Z", ["unidiff>=1.0"])
    _, install = uvinstall.commands(tmp_path / "v", tmp_path / "uv", requirements, as_of, tmp_path)
    assert install[install.index("--exclude-newer") + 1] == "2026-10-31T01:04:36Z"
    exempt = [install[i + 1] for i, a in enumerate(install) if a == "--exclude-newer-package"]
    assert exempt[0] == "cuda-tile=2026-09-11T00:00:00Z"
    assert exempt[1].startswith("unidiff=") and len(exempt) == 2
    assert (tmp_path / "overrides.txt").read_text() == "cuda-tile==1.6.0\n"
    assert (tmp_path / "requirements.txt").read_text().splitlines() == requirements


def test_an_override_applies_to_its_exact_pin_only() -> None:
    [override] = uvinstall.overrides_for(["cuda-tile==1.6.0rc5", "torch==2.14.1"])
    assert "cuda-tile==1.6.0rc5 overridden to cuda-tile==1.6.0" in override.said()
    assert uvinstall.overrides_for(["cuda-tile==1.7.0"]) == []
    assert uvinstall.overrides_for(["cuda-tile>=1.6.0rc5"]) == []


@pytest.fixture
def failing_uv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fork whose env root is under tmp_path, and a uv that makes a venv and then
    cannot resolve the pins."""
    uv = tmp_path / "uv"
    uv.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = venv ]; then for last; do :; done; mkdir -p "$last/bin"; '
        'touch "$last/bin/python"; exit 0; fi\n'
        "echo 'error: No solution found when resolving dependencies' >&2; exit 1\n"
    )
    uv.chmod(uv.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(uvinstall, "uv_binary", lambda: str(uv))
    monkeypatch.setenv("SM120_ENV_ROOT", str(tmp_path / "envs"))
    monkeypatch.setenv("SM120_GATE_ENV", str(tmp_path / "envs" / "own"))
    for name in (decisionenv.INSTALL_VARIABLE, decisionenv.OVERRIDE_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    fork = tmp_path / "fork"
    (fork / "vendor").mkdir(parents=True)
    (fork / "vendor" / "sglang.lock").write_text('version = "0.5.23"\n')
    (fork / "pyproject.toml").write_text('[project]\nname = "t"\ndependencies = ["uv"]\n')
    return fork


def test_pins_that_cannot_be_installed_are_a_stop_with_the_reason(
    failing_uv: Path, tmp_path: Path
) -> None:
    release = tmp_path / "upstream" / "0.5.20"
    release.mkdir(parents=True)
    (release / decisionenv.PINS_FILE).write_text("cuda-tile==1.6.0rc5\ntorch==2.13.0\n")
    (release / decisionenv.RELEASED_FILE).write_text("2026-09-18T09:30:00+00:00\n")
    with pytest.raises(decisionenv.NoDecisionEnv) as raised:
        decisionenv.find(failing_uv, "0.5.20", release, lambda _: None)
    said = raised.value.message
    assert "its pins could not be installed into" in said
    assert "No solution found when resolving dependencies" in said
    venv = tmp_path / "envs" / "gate-env-0.5.20"
    assert not (venv / "sm120-gate-pins.txt").exists()  # never taken for a ready venv
    log = venv.with_name(venv.name + "-install.log").read_text()
    assert "--exclude-newer 2026-09-19T09:30:00Z" in log
    assert "--overrides" in log and "pytest=" in log  # the tool's own: as of now
    assert gateenv.locate(failing_uv).requirements == ("sglang==0.5.23", "pytest>=8")  # no uv
