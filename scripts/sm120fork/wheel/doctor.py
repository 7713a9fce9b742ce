"""What the fork wheel adds for the doctor (sm120-doctor.patch): the known-bad
table beside its code, and the `sglang-sm120-doctor` console script.

Both only when the series puts the doctor into the wheel, so a series without it
(the synthetic test forks, an older fork release) builds the wheel as before.
"""

from __future__ import annotations

from collections.abc import Mapping

from sm120fork.errors import FatalError

PACKAGE = "sglang/sm120_doctor/"
KNOWN_BAD_SOURCE = "patches/known-bad.toml"
KNOWN_BAD_MEMBER = PACKAGE + "known_bad.toml"
SCRIPT_NAME = "sglang-sm120-doctor"
SCRIPT = f"{SCRIPT_NAME} = sglang.sm120_doctor.cli:main"
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


def entry_points(original: bytes | None, where: str) -> bytes:
    """entry_points.txt with the doctor's console script in [console_scripts]."""
    try:
        text = (original or b"").decode("utf-8")
    except UnicodeDecodeError as error:
        raise FatalError(f"{where} is not UTF-8; refusing to rewrite it") from error
    lines = text.splitlines()
    if any(line.split("=")[0].strip() == SCRIPT_NAME for line in lines):
        raise FatalError(f"{where} already names {SCRIPT_NAME}; refusing to add it twice")
    if _SECTION in (line.strip() for line in lines):
        at = next(i for i, line in enumerate(lines) if line.strip() == _SECTION) + 1
        lines.insert(at, SCRIPT)
    else:
        lines = [*lines, *([""] if lines else []), _SECTION, SCRIPT]
    return ("\n".join(lines) + "\n").encode("utf-8")
