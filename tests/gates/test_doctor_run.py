"""The doctor as a user runs it: the fork wheel installed into a fresh venv, the
command run outside the checkout, on this CPU-only machine, on a faked SM120 host
and on a faked H200 (the harness's NVML stand-in).

The fork wheel is built by `sm120fork wheel`'s own transform (fork_wheel) from the
upstream wheel as this gate environment installed it (its RECORD lists and hashes
every file, so the transform checks each one as it would the downloaded wheel);
the fresh venv gets the wheel's files, and torch and the other dependencies
through a .pth to the gate environment, placed after the venv's own packages.
A second venv sees the gate environment without numpy, so that `import sglang`
fails there as it did on a lent H200 with torch only: the command must still run.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import pytest
from sm120fork.harness.spec import REPO_ROOT
from sm120fork.patches.stack import load_stack
from sm120fork.paths import RepoPaths
from sm120fork.upstream import lock as lockfile
from sm120fork.wheel.metadata import AppliedPatch, ForkInfo
from sm120fork.wheel.transform import fork_wheel
from sm120fork.wheel.zipfiles import date_time_of

from . import doctorpkg

UPSTREAM = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
VERSION = "0.5.23+sm120.doctortest"
_LEFT_OUT = ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")


def installed_upstream_wheel(out: Path) -> Path:
    """The gate environment's sglang as a wheel: its RECORD's files (no .pyc, no
    installer files, no scripts pip generated), stored uncompressed for speed."""
    site = Path(sysconfig.get_paths()["purelib"])
    dist_info = next(site.glob("sglang-*.dist-info"))
    rows = list(csv.reader(io.StringIO((dist_info / "RECORD").read_text())))
    kept = [
        row
        for row in rows
        if not row[0].startswith("../")
        and not row[0].endswith(".pyc")
        and not (row[0].startswith(dist_info.name + "/") and row[0].split("/")[-1] in _LEFT_OUT)
    ]
    wheel = out / UPSTREAM
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for name, *_ in kept:
            archive.write(site / name, name)
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows(
            [*kept, [f"{dist_info.name}/RECORD", "", ""]]
        )
        archive.writestr(f"{dist_info.name}/RECORD", record.getvalue())
    return wheel


@pytest.fixture(scope="module")
def fork(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scratch = tmp_path_factory.mktemp("doctor-wheel")
    paths = RepoPaths(REPO_ROOT)
    lock = lockfile.read(paths.lock_file)
    assert lock is not None
    patches = load_stack(paths).patches
    info = ForkInfo(
        VERSION, lock.version, UPSTREAM, "0" * 64, tuple(AppliedPatch.create(p) for p in patches)
    )
    upstream = installed_upstream_wheel(scratch)
    fork = scratch / f"sglang-{VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
    with open(fork, "wb") as out:
        fork_wheel(
            upstream.read_bytes(),
            UPSTREAM,
            out,
            vendor=paths.upstream_tree,
            patches=patches,
            info=info,
            date_time=date_time_of(1_764_547_200),
            known_bad=(paths.patches_dir / "known-bad.toml").read_bytes(),
        )
    upstream.unlink()
    return fork


def install(fork: Path, root: Path, dependencies: Path) -> Path:
    """A fresh venv at `root` with the fork wheel, and `dependencies` through a .pth."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "-q",
            str(fork),
        ],
        check=True,
    )
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # torch, rich and sglang's other dependencies, after the venv's own packages
    Path(own, "zz-gate-env.pth").write_text(f"{dependencies}\n")
    return root


@pytest.fixture(scope="module")
def venv(fork: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("doctor-run") / "venv"
    return install(fork, root, Path(sysconfig.get_paths()["purelib"]))


@pytest.fixture(scope="module")
def venv_without_numpy(fork: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gate environment's packages but numpy, which sglang/__init__.py needs."""
    scratch = tmp_path_factory.mktemp("doctor-run-no-numpy")
    site = Path(sysconfig.get_paths()["purelib"])
    (scratch / "deps").mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith("numpy"):
            (scratch / "deps" / entry.name).symlink_to(entry)
    return install(fork, scratch / "venv", scratch / "deps")


def doctor(venv: Path, cwd: Path, *args: str, **environ: str) -> tuple[int, dict[str, Any]]:
    """The installed command; with args starting "-m", the venv's python runs them."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SM120_GATE_", "PYTHON", "LD_LIBRARY_PATH", "NCCL_"))
    }
    env.update(environ)
    done = subprocess.run(
        [str(venv / "bin" / "python"), *args[:2], "--json", *args[2:]]
        if args[:1] == ("-m",)
        else [str(venv / "bin" / "sglang-sm120-doctor"), "--json", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.stdout.startswith("{"), done.stderr
    return done.returncode, json.loads(done.stdout)


def summaries(report: dict[str, Any], check: str) -> list[tuple[str, str]]:
    return [(f["level"], f["summary"]) for f in report["findings"] if f["check"] == check]


def test_the_installed_command_tells_this_cpu_machine_the_truth(venv: Path, tmp_path: Path) -> None:
    code, report = doctor(venv, tmp_path)
    assert report["facts"]["versions"]["sglang"] == VERSION  # the wheel's, not the checkout's
    assert report["facts"]["packages"]["sglang"].startswith(str(venv))
    assert not summaries(report, "sglang")  # it imports here: nothing to report
    python_m = doctor(venv, tmp_path, "-m", "sglang.sm120_doctor")  # the same doctor
    assert python_m[0] == code and python_m[1]["findings"] == report["findings"]
    # Asked in a fresh interpreter: this process may hold the harness's stand-in
    # NVML, loaded by an earlier test under the same soname.
    probe = "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode:
        assert code == 2 and report["verdict"] == "will fail"
        [(level, summary)] = summaries(report, "gpus")
        assert level == "fail" and summary.startswith(
            "no NVIDIA GPU: cannot load libnvidia-ml.so.1"
        )
    else:  # a machine with a driver: the doctor lists what NVML lists
        assert report["facts"]["gpus"]


def test_serve_arguments_go_to_the_installed_sglang(venv: Path, tmp_path: Path) -> None:
    """Without a GPU, the installed sglang itself refuses the serve arguments."""
    model = REPO_ROOT / "gatetable" / "models" / "llama_dense"
    code, report = doctor(venv, tmp_path, "--", "--model-path", str(model), "--tp", "2")
    [(level, summary)] = summaries(report, "decisions")
    assert (code, level) == (2, "fail") and summary.startswith("sglang refuses: No accelerator")
    assert report["facts"]["tp"] == 2


def test_on_a_faked_sm120_host(venv: Path, tmp_path: Path) -> None:
    nvml = doctorpkg.stand_in_nvml(tmp_path)
    env = {
        "LD_LIBRARY_PATH": str(nvml),
        **doctorpkg.faked_gpus(2, "12.0", "NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887),
    }
    code, report = doctor(venv, tmp_path, **env)
    assert [g["major"] * 10 + g["minor"] for g in report["facts"]["gpus"]] == [120, 120]
    kernels = summaries(report, "kernels")
    assert {level for level, _ in kernels} == {"ok"}, kernels
    assert any(s.startswith("torch lib/libtorch_cuda.so: has sm_120 code") for _, s in kernels)
    assert (
        "ok",
        "all-reduce for --tp 2: pcie-ipc (PCIe only, P2P between every pair of 2: "
        "FlashInfer PCIe-IPC)",
    ) in summaries(report, "topology")
    assert code == 0 and report["verdict"] == "ready", report["findings"]
    # --p2p copies for real: this machine has no driver, so NVML's P2P is not borne out
    code, report = doctor(venv, tmp_path, "--p2p", "--p2p-timeout", "120", **env)
    [(level, summary)] = summaries(report, "p2p")
    assert (code, level) == (2, "fail") and summary.startswith(
        "GPU 0 <-> GPU 1: peer copy error: RuntimeError"
    )
    # an old driver for this torch's CUDA 13.0
    code, report = doctor(venv, tmp_path, **{**env, "SM120_GATE_NVML_CUDA": "12080"})
    assert code == 2 and summaries(report, "driver")[0][0] == "fail"


def test_on_a_faked_h200_it_is_upstream_behaviour(venv: Path, tmp_path: Path) -> None:
    env = {
        "LD_LIBRARY_PATH": str(doctorpkg.stand_in_nvml(tmp_path)),
        **doctorpkg.faked_gpus(1, "9.0", "NVIDIA H200", 143771, cuda="12080"),
    }
    code, report = doctor(venv, tmp_path, **env)
    assert ("note", "not SM12x: sm_90 (NVIDIA H200); upstream behaviour") in summaries(
        report, "gpus"
    )
    assert code == 0 and report["verdict"] == "ready"


def test_where_sglang_does_not_import_the_command_still_runs(
    venv_without_numpy: Path, tmp_path: Path
) -> None:
    """The launcher registers sglang without its __init__.py and reports the import
    error: a failure even on a GPU outside SM12x, since such an sglang cannot serve."""
    env = {
        "LD_LIBRARY_PATH": str(doctorpkg.stand_in_nvml(tmp_path)),
        **doctorpkg.faked_gpus(1, "9.0", "NVIDIA H200", 143771, cuda="12080"),
    }
    model = REPO_ROOT / "gatetable" / "models" / "llama_dense"
    code, report = doctor(venv_without_numpy, tmp_path, "--", "--model-path", str(model), **env)
    [(level, summary)] = summaries(report, "sglang")
    assert (level, summary) == (
        "fail",
        "sglang does not import: ModuleNotFoundError: No module named 'numpy'",
    )
    assert code == 2 and report["verdict"] == "will fail"
    assert [(g["name"], g["major"], g["minor"]) for g in report["facts"]["gpus"]] == [
        ("NVIDIA H200", 9, 0)
    ]
    assert ("note", "not SM12x: sm_90 (NVIDIA H200); upstream behaviour") in summaries(
        report, "gpus"
    )
    assert report["facts"]["versions"]["sglang"] == VERSION
    [(_, decided)] = summaries(report, "decisions")
    assert (
        decided == "cannot decide the serve arguments: sglang does not import (ModuleNotFoundError)"
    )
    fix = next(f["fix"] for f in report["findings"] if f["check"] == "sglang")
    assert str(venv_without_numpy) in fix
