"""`sm120fork wheel` on the real sglang 0.5.9 wheel from the package index.

The repo is a temporary one: sglang 0.5.9 imported from the index (its tree and
lock), and a one-patch series on a real file, so these tests depend neither on
the release the project vendors nor on its series. The last test builds the
project itself.
"""

from __future__ import annotations

import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from forkrepo import edit, make_patch
from sm120fork.cli import main
from sm120fork.upstream import lock as lockfile
from wheelrepo import make_venv, pip_into, site_packages, snapshot, verify_record

pytestmark = [pytest.mark.network, pytest.mark.slow]

PROJECT = Path(__file__).resolve().parents[1]
UPSTREAM = "sglang-0.5.9-py3-none-any.whl"
SHA256 = "8a936c4d25fea605f44254e533cff2144c73ceffbc1f8738aba393461bbb64d1"
FORK = "0.5.9+sm120.1"
PATCHED = "python/sglang/srt/utils/common.py"


@pytest.fixture(scope="module")
def real_repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("real")
    assert main(["-C", str(root), "import", "0.5.9"]) == 0  # tree and lock from the index
    lock = lockfile.read(root / "vendor" / "sglang.lock")
    assert lock is not None and (lock.tree_from, lock.version) == (UPSTREAM, "0.5.9")
    assert any(a.sha256 == SHA256 for a in lock.artifacts)
    (root / "CHANGELOG.md").write_text(f"# Changelog\n\n## {FORK} - 2026-11-29\n")
    base = (root / "vendor" / "sglang" / PATCHED).read_text()
    patch = make_patch(
        "Mark the fork in common.py", {PATCHED: base}, {PATCHED: edit(base, "\n", "\n# sm120\n")}
    )
    (root / "patches").mkdir()
    (root / "patches" / "sm120-mark.patch").write_text(patch)
    (root / "patches" / "series").write_text("sm120-mark.patch\n")
    assert main(["-C", str(root), "wheel"]) == 0  # downloads through pip into build/
    yield root


def fork_wheel(root: Path) -> Path:
    return root / "dist" / f"sglang-{FORK}-py3-none-any.whl"


def upstream_wheel(root: Path) -> Path:
    return root / "build" / "wheel" / "cache" / UPSTREAM


def test_real_wheel_builds_reproducibly(real_repo: Path, tmp_path: Path) -> None:
    wheel = fork_wheel(real_repo)
    assert verify_record(wheel) == []
    assert main(["-C", str(real_repo), "wheel", "--dist", str(tmp_path)]) == 0
    assert (tmp_path / wheel.name).read_bytes() == wheel.read_bytes()
    with zipfile.ZipFile(wheel) as fork, zipfile.ZipFile(upstream_wheel(real_repo)) as up:
        changed = {"sglang/srt/utils/common.py", "sglang-0.5.9.dist-info/METADATA"}
        for info in up.infolist():
            if info.filename.endswith("/RECORD") or info.filename in changed:
                continue
            name = info.filename.replace("sglang-0.5.9.dist-info", f"sglang-{FORK}.dist-info")
            assert fork.read(name) == up.read(info), name


def test_installs_as_vendor_plus_series(real_repo: Path, tmp_path: Path) -> None:
    assert main(["-C", str(real_repo), "apply", "--out", str(tmp_path / "applied")]) == 0
    python = make_venv(tmp_path / "venv")
    pip_into(python, "install", "--no-deps", "--no-compile", "-q", str(fork_wheel(real_repo)))
    installed = snapshot(site_packages(python) / "sglang")
    expected = snapshot(tmp_path / "applied" / "python" / "sglang")
    with zipfile.ZipFile(upstream_wheel(real_repo)) as up:
        binaries = {
            name: up.read(f"sglang/{name}") for name in set(installed) - set(expected)
        }  # the files the import leaves out of vendor/ because they are not text
    assert all(b"\0" in data or not is_utf8(data) for data in binaries.values())
    assert installed == {**expected, **binaries}
    assert version_in(python) == FORK


def test_replaces_upstream_in_place(real_repo: Path, tmp_path: Path) -> None:
    python = make_venv(tmp_path / "venv")
    pip_into(python, "install", "--no-deps", "--no-compile", "-q", str(upstream_wheel(real_repo)))
    assert version_in(python) == "0.5.9"
    pip_into(python, "install", "--no-deps", "--no-compile", "-q", str(fork_wheel(real_repo)))
    assert version_in(python) == FORK
    site = site_packages(python)
    assert sorted(p.name for p in site.glob("sglang-*.dist-info")) == [f"sglang-{FORK}.dist-info"]
    assert "# sm120\n" in (site / "sglang" / "srt" / "utils" / "common.py").read_text()
    shown = pip_into(python, "show", "sglang").stdout
    assert f"[sm120 fork {FORK}: 1 patch: sm120-mark]" in shown


def test_the_project_itself(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code = main(
        ["-C", str(PROJECT), "wheel", "--dist", str(tmp_path / "dist"), "--cache", str(cache)]
    )
    assert code == 0
    (wheel,) = (tmp_path / "dist").iterdir()
    assert verify_record(wheel) == []
    assert main(["-C", str(PROJECT), "apply", "--out", str(tmp_path / "applied")]) == 0
    applied = snapshot(tmp_path / "applied" / "python" / "sglang")
    with zipfile.ZipFile(wheel) as archive:
        for name, data in applied.items():
            assert archive.read(f"sglang/{name}") == data, name


def version_in(python: Path) -> str:
    found = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
        check=True,
        capture_output=True,
        text=True,
    )
    return found.stdout.strip()


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
