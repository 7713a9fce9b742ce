"""`sm120fork wheel` with the doctor in the series: the known-bad table and the
command (the launcher as a wheel script, no console script) go into the wheel,
RECORD stays right, and pip installs both."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
from forkrepo import make_patch
from sm120fork.cli import main
from sm120fork.errors import FatalError
from sm120fork.wheel import doctor
from wheelrepo import FORK, PACKAGE_TEXT, make_venv, make_wheel_repo, pip_into, verify_record

DIST_INFO = f"sglang-{FORK}.dist-info"
SCRIPT_MEMBER = f"sglang-{FORK}.data/scripts/{doctor.SCRIPT_NAME}"
CLI = "python/sglang/sm120_doctor/cli.py"
LAUNCHER = "python/sglang/sm120_doctor/launcher.py"
LAUNCHER_TEXT = (
    "#!python\nimport sys\nfrom sglang.sm120_doctor.cli import main\n\nsys.exit(main())\n"
)
DOCTOR_FILES = {
    "python/sglang/sm120_doctor/__init__.py": '"""The doctor."""\n',
    CLI: "from pathlib import Path\n\ndef main():\n"
    "    print(Path(__file__).with_name('known_bad.toml').read_text())\n    return 3\n",
    LAUNCHER: LAUNCHER_TEXT,
}
DOCTOR = make_patch("Add the doctor", PACKAGE_TEXT, DOCTOR_FILES)
TABLE = b'[[bad]]\nid = "x"\nlevel = "note"\nsummary = "s"\n'


def build(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["-C", str(root), "wheel"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def doctor_repo(tmp_path: Path, table: bytes | None = TABLE, patch: str = DOCTOR) -> Path:
    root = make_wheel_repo(tmp_path / "repo", {"0001-doctor.patch": patch})
    if table is not None:
        (root / "patches" / "known-bad.toml").write_bytes(table)
    return root


def test_ships_the_table_and_the_launcher_as_a_wheel_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = build(doctor_repo(tmp_path), capsys)
    assert code == 0, err
    wheel = Path(out.splitlines()[-1])
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(doctor.KNOWN_BAD_MEMBER) == TABLE
        assert archive.read(SCRIPT_MEMBER) == LAUNCHER_TEXT.encode()
        assert archive.getinfo(SCRIPT_MEMBER).external_attr >> 16 & 0o111  # executable
        names = archive.namelist()
        record = archive.read(f"{DIST_INFO}/RECORD").decode()
    assert f"{DIST_INFO}/entry_points.txt" not in names  # no console script beside it
    assert sum(name.endswith("/" + doctor.SCRIPT_NAME) for name in names) == 1
    assert [r for r in record.splitlines() if r.startswith(SCRIPT_MEMBER + ",sha256=")]
    assert verify_record(wheel) == []
    python = make_venv(tmp_path / "venv")
    pip_into(python, "install", "--no-deps", "--no-compile", "--quiet", str(wheel))
    command = python.parent / doctor.SCRIPT_NAME
    assert command.read_text().splitlines()[0].startswith("#!" + str(python.parent))
    run = subprocess.run([str(command)], capture_output=True, text=True, cwd=tmp_path)
    assert (run.returncode, run.stdout) == (3, TABLE.decode() + "\n")


def test_refuses_the_doctor_without_its_launcher(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {k: v for k, v in DOCTOR_FILES.items() if k != LAUNCHER}
    root = doctor_repo(tmp_path, patch=make_patch("Add the doctor", PACKAGE_TEXT, files))
    code, _, err = build(root, capsys)
    assert code != 0 and "not sglang/sm120_doctor/launcher.py" in err
    assert not (root / "dist").exists()


def test_without_the_doctor_the_wheel_gains_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = make_wheel_repo(tmp_path / "repo", {})
    (root / "patches" / "known-bad.toml").write_bytes(TABLE)
    code, out, err = build(root, capsys)
    assert code == 0, err
    with zipfile.ZipFile(Path(out.splitlines()[-1])) as archive:
        names = archive.namelist()
    assert doctor.KNOWN_BAD_MEMBER not in names
    assert f"{DIST_INFO}/entry_points.txt" not in names


def test_refuses_the_doctor_without_its_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = doctor_repo(tmp_path, table=None)
    code, _, err = build(root, capsys)
    assert code != 0 and "known-bad.toml is missing" in err
    assert not (root / "dist").exists()


def test_the_launcher_must_start_with_the_line_pip_rewrites() -> None:
    members = {doctor.LAUNCHER: b"#!/usr/bin/python3\nimport sys\n"}
    with pytest.raises(FatalError, match="must begin with the line #!python"):
        doctor.script_member(members, "sglang-1.data")
    members = {doctor.LAUNCHER: b"#!python\nimport sys\n"}
    assert doctor.script_member(members, "sglang-1.data") == (
        "sglang-1.data/scripts/sglang-sm120-doctor",
        b"#!python\nimport sys\n",
    )


def test_refuses_an_upstream_console_script_of_the_same_name() -> None:
    upstream = b"[console_scripts]\nsglang = sglang.cli.main:main\n\n[other]\nx = y:z\n"
    doctor.refuse_console_script(upstream, "w")  # other scripts: kept as they are
    doctor.refuse_console_script(b"[gui_scripts]\nsglang-sm120-doctor = a:b\n", "w")
    with pytest.raises(FatalError, match="already names sglang-sm120-doctor"):
        doctor.refuse_console_script(
            upstream + b"[console_scripts]\nsglang-sm120-doctor=a:b\n", "w"
        )
