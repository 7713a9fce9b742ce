"""What the fork wheel adds for the doctor (sm120-doctor.patch): the known-bad
table beside its code, and the `sglang-sm120-doctor` command.

The command is a wheel script (`<name>-<version>.data/scripts/`), the doctor's
launcher.py copied, not a console-script entry point: pip's console script
imports sglang.sm120_doctor, which runs sglang/__init__.py and its heavy imports
first, so it dies before the doctor runs wherever a dependency is missing or
broken. The launcher runs the doctor there too and reports the import error.

Both only when the series puts the doctor into the wheel, so a series without it
(the synthetic test forks, an older fork release) builds the wheel as before.
"""

from __future__ import annotations

from collections.abc import Mapping

from sm120fork.errors import FatalError

PACKAGE = "sglang/sm120_doctor/"
KNOWN_BAD_SOURCE = "patches/known-bad.toml"
KNOWN_BAD_MEMBER = PACKAGE + "known_bad.toml"
LAUNCHER = PACKAGE + "launcher.py"
SCRIPT_NAME = "sglang-sm120-doctor"
SHEBANG = b"#!python"  # pip rewrites exactly this first line to the environment's interpreter
_SECTION = "[console_scripts]"


def ships(members: Mapping[str, bytes | None]) -> bool:
    """Whether the patched members hold the doctor's entry point."""
    return members.get(PACKAGE + "cli.py") is not None


def known_bad_member(table: bytes | None) -> dict[str, bytes]:
    if table is None:
        raise FatalError(
            f"the series adds the doctor ({PACKAGE}) but {KNOWN_BAD_SOURCE} is missing; "
            "the doctor reads it at run time: restore it"
        )
    return {KNOWN_BAD_MEMBER: table}


def script_member(members: Mapping[str, bytes | None], data_dir: str) -> tuple[str, bytes]:
    """(the command's member under `data_dir`, its bytes): the launcher as patched."""
    source = members.get(LAUNCHER)
    if source is None:
        raise FatalError(
            f"the series adds the doctor ({PACKAGE}) but not {LAUNCHER}, the source of the "
            f"{SCRIPT_NAME} command: restore it in sm120-doctor.patch"
        )
    if source.split(b"\n", 1)[0].rstrip() != SHEBANG:
        raise FatalError(
            f"{LAUNCHER} must begin with the line {SHEBANG.decode()}: pip rewrites only that "
            "line to the interpreter of the environment it installs into"
        )
    return f"{data_dir}/scripts/{SCRIPT_NAME}", source


def refuse_console_script(entry_points: bytes, where: str) -> None:
    """Upstream must not name the command already: pip would install both."""
    try:
        lines = entry_points.decode("utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise FatalError(f"{where} is not UTF-8; cannot check it for {SCRIPT_NAME}") from error
    section = None
    for line in (line.strip() for line in lines):
        if line.startswith("["):
            section = line
        elif section == _SECTION and line.split("=")[0].strip() == SCRIPT_NAME:
            raise FatalError(
                f"{where} already names {SCRIPT_NAME}; the fork ships that command as a "
                "wheel script: refusing to install two"
            )
