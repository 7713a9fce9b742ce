"""Synthetic fork repositories for the wheel build tests: an upstream wheel made
with zipfile, vendor/sglang equal to its text files, a lock, a series, a CHANGELOG.

Kept apart from conftest.py so that the wheel tests own their helpers.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from forkrepo import make_fork
from sm120fork.upstream import lock as lockfile

VERSION = "0.5.9"
FORK = "0.5.9+sm120.1"
CHANGELOG = f"# Changelog\n\n## {FORK} - 2026-11-29\n\n- first fork release\n"
SA = "python/sglang/srt/server_args.py"
UT = "python/sglang/srt/utils.py"
INIT = "python/sglang/__init__.py"
SO = "sglang/srt/_kernels.abi3.so"  # binary: not in vendor (the import skips it)
SCRIPT = f"sglang-{VERSION}.data/scripts/sglang-tool"

PACKAGE_TEXT = {
    SA: "".join(f"line {i}\n" for i in range(1, 41)),
    UT: "def is_sm120_supported():\n    return False\n",
    INIT: '__version__ = "0.5.9"\n',
}
METADATA = f"""\
Metadata-Version: 2.4
Name: sglang
Version: {VERSION}
Summary: SGLang is a fast serving framework.
License: Apache-2.0
Description-Content-Type: text/markdown
Requires-Dist: numpy

# SGLang

Upstream's long description.
"""


@dataclass(frozen=True)
class Entry:
    data: bytes
    executable: bool = False


def wheel_entries(
    tag: str = "py3-none-any", text: Mapping[str, str] = PACKAGE_TEXT
) -> dict[str, Entry]:
    """Members of a synthetic upstream wheel, in upstream's order (package, then dist-info)."""
    dist_info = f"sglang-{VERSION}.dist-info"
    entries = {path.removeprefix("python/"): Entry(t.encode()) for path, t in text.items()}
    entries[SO] = Entry(b"\x7fELF\x00\x01binary\x00" * 50, executable=True)
    entries[SCRIPT] = Entry(b"#!python\nprint('tool')\n", executable=True)
    entries[f"{dist_info}/licenses/LICENSE"] = Entry(b"Apache License\n")
    entries[f"{dist_info}/METADATA"] = Entry(METADATA.encode())
    wheel = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n\n"
    entries[f"{dist_info}/WHEEL"] = Entry(wheel.encode())
    entries[f"{dist_info}/top_level.txt"] = Entry(b"sglang\n")
    return entries


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(path: Path, entries: Mapping[str, Entry], *, record: bytes | None = None) -> Path:
    """A wheel with `entries` and a RECORD (correct unless `record` is given), last."""
    dist_info = next(n.split("/")[0] for n in entries if n.split("/")[0].endswith(".dist-info"))
    if record is None:
        rows = [f"{n},{record_hash(e.data)},{len(e.data)}\n" for n, e in entries.items()]
        record = ("".join(rows) + f"{dist_info}/RECORD,,\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, entry in [*entries.items(), (f"{dist_info}/RECORD", Entry(record))]:
            info = zipfile.ZipInfo(name, date_time=(2026, 2, 23, 8, 13, 52))
            info.create_system = 3
            info.external_attr = (0o100755 if entry.executable else 0o100644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, entry.data)
    return path


def wheel_name(tag: str = "py3-none-any") -> str:
    return f"sglang-{VERSION}-{tag}.whl"


def make_wheel_repo(
    root: Path,
    patches: Mapping[str, str] | None = None,
    *,
    tags: tuple[str, ...] = ("py3-none-any",),
    cached: bool = True,
    changelog: str = CHANGELOG,
) -> Path:
    """A fork repo whose lock pins one synthetic upstream wheel per tag (kept in
    `root/wheels`, and in the build cache when `cached`)."""
    make_fork(root, patches, base=PACKAGE_TEXT)
    (root / "CHANGELOG.md").write_text(changelog)
    artifacts = []
    for tag in tags:
        wheel = write_wheel(root / "wheels" / wheel_name(tag), wheel_entries(tag))
        data = wheel.read_bytes()
        artifacts.append(lockfile.Artifact(wheel.name, hashlib.sha256(data).hexdigest(), len(data)))
        if cached:
            (root / "build" / "wheel" / "cache").mkdir(parents=True, exist_ok=True)
            (root / "build" / "wheel" / "cache" / wheel.name).write_bytes(data)
    lock = lockfile.Lock(
        version=VERSION,
        tag=f"v{VERSION}",
        source="pypi",
        imported="2026-11-29",
        tree_from=artifacts[0].file,
        license_from=f"{artifacts[0].file}:sglang-{VERSION}.dist-info/licenses/LICENSE",
        skipped=(f"python/{SO}",),
        artifacts=(*artifacts, lockfile.Artifact(f"sglang-{VERSION}.tar.gz", "0" * 64, 10)),
    )
    (root / "vendor" / "sglang.lock").write_text(lockfile.dumps(lock))
    return root


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (relative path -> bytes): to prove it unchanged."""
    if not directory.exists():
        return {}
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def verify_record(wheel: Path) -> list[str]:
    """Problems with `wheel`'s RECORD, found independently of the tool's code."""
    problems = []
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if not n.endswith("/")]
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = {}
        for name, hash_, size in csv.reader(io.StringIO(archive.read(record_name).decode())):
            rows[name] = (hash_, size)
        for name in names:
            if name == record_name:
                if rows.get(name) != ("", ""):
                    problems.append(f"{name}: RECORD's own row is not empty")
                continue
            data = archive.read(name)
            if rows.get(name) != (record_hash(data), str(len(data))):
                problems.append(f"{name}: RECORD row {rows.get(name)} is wrong")
        problems += [f"{name}: listed but not in the wheel" for name in set(rows) - set(names)]
    return problems


def make_venv(path: Path) -> Path:
    """A fresh venv (without its own pip: this interpreter's pip installs into it)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path / "bin" / "python"


def pip_into(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), *args],
        check=True,
        capture_output=True,
        text=True,
    )


def site_packages(venv_python: Path) -> Path:
    found = subprocess.run(
        [str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(found.stdout.strip())
