"""Each check of the sm120 doctor (sm120-doctor.patch), as the series builds it,
on inputs made here: fixture shared objects with and without sm_120 code (gcc and
a fat binary written byte by byte), the harness's NVML stand-in for the GPUs, and
plain values for the rest. Each test fails when its check is removed or inverted.
"""

from __future__ import annotations

import logging
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from . import doctorpkg

SM120 = ("12.0", "NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887)
PTX, CUBIN = 1, 2


@pytest.fixture(scope="module")
def doctor(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    return doctorpkg.load(doctorpkg.applied_doctor(tmp_path_factory.mktemp("doctor")))


def m(name: str) -> ModuleType:
    return doctorpkg.module(name)


def device(doctor: ModuleType, major: int = 12, minor: int = 0, name: str = SM120[1]) -> Any:
    return m("nvml").Device(0, name, major, minor, 97887, 600.0, 30.0)


# --- fat binaries -------------------------------------------------------------------


def fatbin(entries: list[tuple[int, int]]) -> bytes:
    """One fat binary container (the layout fatbin.py documents) with these entries."""
    body = b""
    for kind, sm in entries:
        payload = bytes(range(24))
        header = struct.pack("<HHIQIIHHI", kind, 0x0101, 64, len(payload), 0, 0, 0, 0, sm)
        body += header.ljust(64, b"\0") + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def shared_object(path: Path, entries: list[tuple[int, int]]) -> Path:
    """A real ELF shared object (gcc) whose .nv_fatbin section holds `entries`."""
    data = fatbin(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.with_suffix(".c")
    source.write_text(
        '__attribute__((section(".nv_fatbin"), used)) const unsigned char fatbin[] = {'
        + ",".join(str(b) for b in data)
        + "};\nint host_function(void) { return 1; }\n"
    )
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    return path


def test_fatbin_reads_the_archs_of_a_shared_object(doctor: ModuleType, tmp_path: Path) -> None:
    fb = m("fatbin")
    with_120 = shared_object(tmp_path / "a.so", [(CUBIN, 90), (CUBIN, 120), (PTX, 120)])
    without = shared_object(tmp_path / "b.so", [(CUBIN, 80), (CUBIN, 90)])
    assert fb.codes_in(with_120) == {fb.Code("sass", 90), fb.Code("sass", 120), fb.Code("ptx", 120)}
    assert fb.codes_in(without) == {fb.Code("sass", 80), fb.Code("sass", 90)}
    plain = tmp_path / "plain.so"
    (tmp_path / "plain.c").write_text("int f(void) { return 0; }\n")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(plain), str(tmp_path / "plain.c")], check=True
    )
    assert fb.codes_in(plain) == set()


def test_fatbin_reads_the_installed_torch() -> None:
    """Against nvcc's own output: this gate environment's torch is built for CUDA 13.0
    with sm_120 and sm_121 code."""
    import torch  # type: ignore[import-not-found]  # the gate environment's

    fb = m("fatbin")
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    codes = fb.codes_in(lib)
    assert {fb.Code("sass", 120), fb.Code("sass", 121), fb.Code("sass", 90)} <= codes
    assert fb.runs_on(codes, 12, 0) == "sass"


def test_which_code_runs_on_which_gpu(doctor: ModuleType) -> None:
    fb = m("fatbin")
    sass, ptx = fb.Code("sass", 120), fb.Code("ptx", 90)
    assert fb.runs_on({sass}, 12, 0) == "sass"
    assert fb.runs_on({sass}, 12, 1) == "sass"  # sm_120 code runs on a 12.1 GPU
    assert fb.runs_on({fb.Code("sass", 121)}, 12, 0) == "none"
    assert fb.runs_on({fb.Code("sass", 100)}, 12, 0) == "none"
    assert fb.runs_on({ptx}, 12, 0) == "ptx"
    assert fb.runs_on({fb.Code("ptx", 121)}, 12, 0) == "none"


def test_kernels_fail_a_package_without_sm120_code(doctor: ModuleType, tmp_path: Path) -> None:
    kernels = m("kernels")
    good, bad = tmp_path / "good", tmp_path / "bad"
    shared_object(good / "lib" / "libtorch_cuda.so", [(CUBIN, 90), (CUBIN, 120)])
    shared_object(bad / "lib" / "libtorch_cuda.so", [(CUBIN, 90), (CUBIN, 100)])
    ptx_only = tmp_path / "ptx"
    shared_object(ptx_only / "lib" / "libtorch_cuda.so", [(CUBIN, 90), (PTX, 90)])
    gpu = device(doctor)
    assert [f.level for f in kernels.check_package("torch", good, gpu)] == ["ok"]
    [failed] = kernels.check_package("torch", bad, gpu)
    assert failed.level == "fail" and "no code for sm_120" in failed.summary and failed.fix
    assert [f.level for f in kernels.check_package("torch", ptx_only, gpu)] == ["note"]
    assert [f.level for f in kernels.check_package("torch", None, gpu)] == ["fail"]


def test_kernels_judge_the_sgl_kernel_library_loaded_for_the_gpu(
    doctor: ModuleType, tmp_path: Path
) -> None:
    kernels = m("kernels")
    shared_object(tmp_path / "sm100" / "common_ops.abi3.so", [(CUBIN, 100), (CUBIN, 120)])
    shared_object(tmp_path / "sm90" / "common_ops.abi3.so", [(CUBIN, 90)])
    shared_object(tmp_path / "flash_ops.abi3.so", [(CUBIN, 90)])  # listed, not judged
    found = kernels.check_package("sgl_kernel", tmp_path, device(doctor))
    assert [(f.level, f.summary.split(":")[0]) for f in found] == [
        ("ok", "sgl_kernel sm100/common_ops.abi3.so")
    ]
    [on_h200] = kernels.check_package("sgl_kernel", tmp_path, device(doctor, 9, 0, "NVIDIA H200"))
    assert on_h200.level == "ok" and "sm90/common_ops" in on_h200.summary


@pytest.mark.parametrize(
    ("value", "level"),
    [
        (None, "ok"),
        ("12.0a", "ok"),
        ("9.0 12.0a", "ok"),
        ("9.0;10.0a", "fail"),
        ("12.1a", "fail"),
        ("9.0+PTX", "ok"),
        ("8.0,9.0a", "fail"),
    ],
)
def test_flashinfer_arch_list_must_cover_the_gpu(
    doctor: ModuleType, value: str | None, level: str
) -> None:
    environ = {} if value is None else {"FLASHINFER_CUDA_ARCH_LIST": value}
    found = m("kernels").check_arch_lists(device(doctor), environ)
    [flashinfer] = [f for f in found if "FLASHINFER_CUDA_ARCH_LIST" in f.summary]
    assert flashinfer.level == level


# --- GPUs and driver ----------------------------------------------------------------


@pytest.fixture(scope="module")
def nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(doctorpkg.stand_in_nvml(tmp_path_factory.mktemp("nvml")) / "libnvidia-ml.so.1")


def probe(nvml_lib: str, monkeypatch: pytest.MonkeyPatch, **environ: str) -> Any:
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    return m("gpus").probe(lambda: m("nvml").Nvml(nvml_lib))


def test_gpus_read_through_nvml(
    doctor: ModuleType, nvml_lib: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine = probe(
        nvml_lib,
        monkeypatch,
        **doctorpkg.faked_gpus(2, *SM120),
        SM120_GATE_NVML_POWER_LIMIT_W="300",
        SM120_GATE_NVML_DRIVER="580.82.07",
    )
    assert machine.driver == "580.82.07" and machine.cuda_driver == (13, 0)
    assert [(d.name, d.sm, d.memory_mib, d.power_limit_w) for d in machine.devices] == [
        (SM120[1], 120, 97887, 300.0)
    ] * 2
    found = m("gpus").check(machine)
    assert [f.level for f in found] == ["ok", "ok"]
    assert "sm_120 (12.0), 97887 MiB, 30 W of 300 W limit" in found[0].summary


def test_no_driver_is_a_failure(
    doctor: ModuleType, nvml_lib: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SM120_GATE_NVML_TOPOLOGY", raising=False)  # the stand-in: no driver
    machine = probe(nvml_lib, monkeypatch)
    [finding] = m("gpus").check(machine)
    assert finding.level == "fail" and finding.summary.startswith("no NVIDIA GPU: nvmlInit_v2")
    missing = m("gpus").probe(lambda: m("nvml").Nvml("libnvidia-ml-absent.so.1"))
    assert m("gpus").check(missing)[0].level == "fail"


def test_not_sm12x_is_upstream_behaviour(
    doctor: ModuleType, nvml_lib: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine = probe(nvml_lib, monkeypatch, **doctorpkg.faked_gpus(1, "9.0", "NVIDIA H200", 143771))
    found = m("gpus").check(machine)
    assert found[-1].summary == "not SM12x: sm_90 (NVIDIA H200); upstream behaviour"
    assert found[-1].level == "note"
    findings = m("findings")
    failing = [
        findings.Finding("driver", "fail", "x", "y"),
        findings.Finding("nccl", "slow", "a", "b"),
    ]
    assert findings.exit_status(findings.upstream_scope(failing)) == 0
    assert findings.exit_status(failing) == 2


def test_exit_status_is_the_worst_finding(doctor: ModuleType) -> None:
    f = m("findings")
    ok, note = f.Finding("gpus", "ok", "a"), f.Finding("gpus", "note", "b")
    slow, fail = f.Finding("nccl", "slow", "c", "fix"), f.Finding("driver", "fail", "d", "fix")
    assert [f.exit_status(x) for x in ([], [ok, note], [ok, slow], [slow, fail, ok])] == [
        0,
        0,
        1,
        2,
    ]
    with pytest.raises(ValueError, match="needs a fix"):
        f.Finding("driver", "fail", "no fix")


@pytest.mark.parametrize(
    ("cuda_driver", "torch_cuda", "level"),
    [
        ((13, 0), (13, 0), "ok"),
        ((13, 1), (12, 8), "ok"),
        ((12, 9), (13, 0), "fail"),
        ((12, 8), (12, 9), "note"),
    ],
)
def test_driver_against_torch_cuda(
    doctor: ModuleType, cuda_driver: tuple[int, int], torch_cuda: tuple[int, int], level: str
) -> None:
    machine = m("gpus").Machine(devices=[device(doctor)], driver="x", cuda_driver=cuda_driver)
    assert [f.level for f in m("driver").check(machine, torch_cuda)] == [level]


def test_torch_older_than_cuda_12_8_has_no_sm12x(doctor: ModuleType) -> None:
    machine = m("gpus").Machine(devices=[device(doctor)], driver="x", cuda_driver=(12, 8))
    assert [f.level for f in m("driver").check(machine, (12, 6))] == ["fail", "ok"]
    h200 = m("gpus").Machine(devices=[device(doctor, 9, 0)], driver="x", cuda_driver=(12, 8))
    assert [f.level for f in m("driver").check(h200, (12, 6))] == ["ok"]


def test_torch_cuda_is_read_without_importing_torch(doctor: ModuleType) -> None:
    import torch

    assert m("packages").torch_cuda() == tuple(int(x) for x in torch.version.cuda.split("."))


# --- topology, the real copy, NCCL ----------------------------------------------------


def links(count: int, p2p: bool = True, nvlink: bool = False) -> dict[tuple[int, int], Any]:
    return {
        (a, b): {"topology": "PHB", "p2p_write": p2p, "nvlink": nvlink}
        for a in range(count)
        for b in range(a + 1, count)
    }


def sm120_machine(doctor: ModuleType, count: int) -> Any:
    return m("gpus").Machine(devices=[device(doctor)] * count, driver="x", cuda_driver=(13, 0))


@pytest.mark.parametrize(
    ("tp", "pairs", "environ", "path"),
    [
        (4, links(4), {}, "pcie-ipc"),
        (3, links(3), {}, "nccl"),
        (4, links(4, p2p=False), {}, "nccl"),
        (4, links(4, nvlink=True), {}, "custom"),
        (4, links(4), {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "0"}, "nccl-or-custom"),
        (4, links(4, p2p=False), {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1"}, "pcie-ipc"),
        (1, {}, {}, "none"),
    ],
)
def test_the_all_reduce_the_fork_picks(
    doctor: ModuleType,
    tp: int,
    pairs: dict[tuple[int, int], Any],
    environ: dict[str, str],
    path: str,
) -> None:
    machine = sm120_machine(doctor, max(tp, 1))
    assert m("topology").allreduce_path(machine, tp, pairs, environ)[0] == path


def test_nccl_for_a_sm12x_group_is_slow(doctor: ModuleType) -> None:
    topology = m("topology")
    levels = {
        f.level for f in topology.check(sm120_machine(doctor, 4), 4, links(4, p2p=False), None, {})
    }
    assert "slow" in levels
    fast = topology.check(sm120_machine(doctor, 4), 4, links(4), None, {})
    assert {f.level for f in fast} == {"ok", "note"}  # the note: not tested by copying
    too_many = topology.check(sm120_machine(doctor, 2), 4, links(2), None, {})
    assert too_many[-1].level == "fail" and "--tp 4" in too_many[-1].summary


def test_a_failed_peer_copy_fails_where_nvml_says_p2p(doctor: ModuleType) -> None:
    topology = m("topology")
    machine = sm120_machine(doctor, 2)
    copies = {(0, 1): "ok"}
    assert [
        f.level for f in topology.check(machine, 2, links(2), copies, {}) if f.check == "p2p"
    ] == ["ok"]
    for result in ("wrong data", "hung or failed (timed out after 5 s)", "no-peer-access"):
        found = [
            f
            for f in topology.check(machine, 2, links(2), {(0, 1): result}, {})
            if f.check == "p2p"
        ]
        assert [f.level for f in found] == ["fail"], result
    no_p2p = topology.check(machine, 2, links(2, p2p=False), {(0, 1): "no-peer-access"}, {})
    assert [f.level for f in no_p2p if f.check == "p2p"] == ["note"]


def test_the_copy_child_that_hangs_is_a_verdict(doctor: ModuleType) -> None:
    child = (
        "import json, time\n"
        "print(json.dumps({'pair': [0, 1], 'result': 'ok'}), flush=True)\n"
        "time.sleep(60)\n"
    )
    results = m("p2pcopy").run([(0, 1), (0, 2)], timeout=3, command=[sys.executable, "-c", child])
    assert results[(0, 1)] == "ok"
    assert results[(0, 2)].startswith("hung or failed (timed out after 3 s")


@pytest.mark.parametrize(
    ("environ", "p2p", "levels"),
    [
        ({}, True, []),
        ({"NCCL_P2P_DISABLE": "1"}, True, ["slow"]),
        ({"NCCL_P2P_DISABLE": "1"}, False, ["note"]),
        ({"NCCL_P2P_DISABLE": "0"}, True, []),
        ({"NCCL_P2P_LEVEL": "LOC"}, True, ["slow"]),
        ({"NCCL_IB_DISABLE": "1"}, True, ["note"]),
    ],
)
def test_nccl_variables(
    doctor: ModuleType, environ: dict[str, str], p2p: bool, levels: list[str]
) -> None:
    assert [f.level for f in m("ncclenv").check(environ, p2p)] == levels


# --- decisions ------------------------------------------------------------------------


DECIDED = {"tp_size": 2, "attention_backend": "triton", "moe_runner_backend": "marlin"}


def test_decisions_report_refusals_warnings_and_choices(doctor: ModuleType) -> None:
    decide = m("decisions").decide

    def refuses(argv: list[str]) -> Any:
        raise ValueError("--moe-runner-backend trtllm has no SM12x kernels; use marlin\nmore")

    def warns(argv: list[str]) -> Any:
        logging.getLogger("sglang.srt.server_args").warning("falling back to triton: use fa3")
        logging.getLogger("transformers").warning("not ours")
        return {**DECIDED, "unshown_field": 1}

    values, found = decide(["--tp", "2"], refuses)
    assert values == {} and [f.level for f in found] == ["fail"]
    assert (
        found[0].summary
        == "sglang refuses: --moe-runner-backend trtllm has no SM12x kernels; use marlin"
    )
    values, found = decide([], warns)
    assert values == DECIDED
    assert [(f.level, f.summary) for f in found][1:] == [
        ("slow", "sglang warns: falling back to triton: use fa3")
    ]
    assert found[0].level == "ok" and "attention_backend=triton" in found[0].summary
    _, bad_flag = decide(["--nope"], lambda argv: sys.exit(2))
    assert bad_flag[0].level == "fail"


# --- the known-bad table --------------------------------------------------------------


def test_the_shipped_table_is_complete(doctor: ModuleType) -> None:
    table = m("knownbad").load()  # the copy beside the package, as the wheel ships it
    assert len(table) >= 3
    for entry in table:
        assert entry["level"] in ("fail", "slow", "note") and entry["summary"] and entry["fix"]
        assert entry["evidence"] and all(
            u.startswith("https://github.com/") for u in entry["evidence"]
        )
        assert entry["when"].get("arch") == ["sm120", "sm121"]


def test_known_bad_matches_machine_and_arguments(doctor: ModuleType) -> None:
    knownbad = m("knownbad")
    table = knownbad.load()
    base = {
        "archs": {"sm120"},
        "versions": {"flashinfer": "0.6.9", "sglang": "0.5.23"},
        "decided": {"fp4_gemm_runner_backend": "auto", "quantization": "modelopt_fp4"},
        "argv": ["--model-path", "x"],
        "environ": {},
        "facts": {"iommu": "passthrough", "tp": 1},
    }

    def ids(**change: Any) -> set[str]:
        found = knownbad.check(table, knownbad.Facts(**{**base, **change}))
        return {f.summary.split(":")[0] for f in found}

    assert ids() == {"cudnn-fp4-override-shape-nan", "pdl-cuda-graph-capture"}
    assert "cudnn-fp4-override-shape-nan" not in ids(
        versions={"flashinfer": "0.7.2", "sglang": "0.5.23"}
    )
    assert ids(archs={"sm90"}) == set()
    assert ids(decided=None, argv=None) == set()  # needs the serve arguments
    assert "pdl-cuda-graph-capture" not in ids(argv=["--disable-cuda-graph"])
    assert "p2p-iommu-acs-hang" in ids(facts={"iommu": "translated", "tp": 2})
    assert "p2p-iommu-acs-hang" not in ids(
        facts={"iommu": "translated", "tp": 2}, environ={"NCCL_P2P_DISABLE": "1"}
    )
    [fail] = [f for f in knownbad.check(table, knownbad.Facts(**base)) if f.level == "fail"]
    assert fail.evidence and fail.fix


@pytest.mark.parametrize(
    ("version", "spec", "expected"),
    [
        ("0.6.9", "<0.7.2", True),
        ("0.7.2", "<0.7.2", False),
        ("0.7.10", "<0.7.2", False),
        ("2.9.1+cu128", ">=2.9,<2.10", True),
        ("0.5.23", ">=0.5.23", True),
        ("0.5.9", ">=0.5.23", False),
    ],
)
def test_version_ranges(doctor: ModuleType, version: str, spec: str, expected: bool) -> None:
    assert m("knownbad").satisfies(version, spec) is expected


def test_iommu_mode_from_sysfs(doctor: ModuleType, tmp_path: Path) -> None:
    iommu_mode = m("knownbad").iommu_mode
    assert iommu_mode(tmp_path / "absent") == "off"
    for group, kind in (("0", "identity"), ("1", "identity")):
        (tmp_path / group).mkdir()
        (tmp_path / group / "type").write_text(kind + "\n")
    assert iommu_mode(tmp_path) == "passthrough"
    (tmp_path / "1" / "type").write_text("DMA-FQ\n")
    assert iommu_mode(tmp_path) == "translated"
