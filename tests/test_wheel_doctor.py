"""`sm120fork wheel` with the doctor in the series: the known-bad table and the
console script go into the wheel, RECORD stays right, and pip installs both."""

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
CLI = "python/sglang/sm120_doctor/cli.py"
DOCTOR = make_patch(
    "Add the doctor",
    PACKAGE_TEXT,
    {
        "python/sglang/sm120_doctor/__init__.py": '"""The doctor."""\n',
        CLI: "from pathlib import Path\n\ndef main():\n"
        "    print(Path(__file__).with_name('known_bad.toml').read_text())\n    return 3\n",
    },
)
TABLE = b'[[bad]]\nid = "x"\nlevel = "note"\nsummary = "s"\n'


def build(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["-C", str(root), "wheel"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def doctor_repo(tmp_path: Path, table: bytes | None = TABLE) -> Path:
    root = make_wheel_repo(tmp_path / "repo", {"0001-doctor.patch": DOCTOR})
    if table is not None:
        (root / "patches" / "known-bad.toml").write_bytes(table)
    return root


def test_ships_the_table_and_the_console_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = build(doctor_repo(tmp_path), capsys)
    assert code == 0, err
    wheel = Path(out.splitlines()[-1])
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(doctor.KNOWN_BAD_MEMBER) == TABLE
        points = archive.read(f"{DIST_INFO}/entry_points.txt").decode()
    assert points == f"[console_scripts]\n{doctor.SCRIPT}\n"
    assert verify_record(wheel) == []
    python = make_venv(tmp_path / "venv")
    pip_into(python, "install", "--no-deps", "--no-compile", "--quiet", str(wheel))
    run = subprocess.run(
        [str(python.parent / doctor.SCRIPT_NAME)], capture_output=True, text=True, cwd=tmp_path
    )
    assert (run.returncode, run.stdout) == (3, TABLE.decode() + "\n")


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


def test_adds_the_script_to_upstreams_console_scripts() -> None:
    upstream = b"[console_scripts]\nsglang = sglang.cli.main:main\n\n[other]\nx = y:z\n"
    assert doctor.entry_points(upstream, "w").decode() == (
        f"[console_scripts]\n{doctor.SCRIPT}\nsglang = sglang.cli.main:main\n\n[other]\nx = y:z\n"
    )
    assert doctor.entry_points(b"[gui_scripts]\na = b:c\n", "w").decode() == (
        f"[gui_scripts]\na = b:c\n\n[console_scripts]\n{doctor.SCRIPT}\n"
    )
    with pytest.raises(FatalError, match="already names"):
        doctor.entry_points(doctor.entry_points(None, "w"), "w")
