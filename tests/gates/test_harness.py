"""The harness's own guards, without torch: resolution detection, blind cells, Markdown.

A release whose ServerArgs decides nothing where the harness looks must fail the run,
not pass every row (0.5.23 decides in resolve_once(), read through resolved_dict()).
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import logging
import re
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
from sm120fork.harness import child, fakes, report, runner, table, zygotes


@dataclasses.dataclass
class PostInitArgs:
    """0.5.9 style: decides in __post_init__."""

    model_path: str
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        self.attention_backend = "flashinfer"


@dataclasses.dataclass
class InertArgs:
    """Decides nothing at construction and offers no resolve_once()."""

    model_path: str
    attention_backend: str | None = None


class ResolveOnceArgs:
    """0.5.23 style: raw attributes stay as given; decisions only in resolved_dict()."""

    decide: ClassVar[dict[str, Any]] = {"attention_backend": "flashinfer"}

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        self.model_path = model_path
        self.attention_backend = kwargs.get("attention_backend")
        self._decided: dict[str, Any] = {}

    def resolve_once(self) -> None:
        if self.model_path == "raise":
            raise ValueError("TRTLLM MLA backend is only supported on Blackwell")
        self._decided = dict(self.decide)

    def resolved_dict(self) -> dict[str, Any]:
        return {"attention_backend": self.attention_backend, **self._decided}


class NoOpResolveArgs(ResolveOnceArgs):
    decide: ClassVar[dict[str, Any]] = {}


class NoDictArgs:
    def __init__(self, model_path: str) -> None:
        self.attention_backend: str | None = None

    def resolve_once(self) -> None:
        self.attention_backend = "flashinfer"


@pytest.fixture
def server_args_class(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(cls: type) -> None:
        module = types.ModuleType("sglang.srt.server_args")
        module.ServerArgs = cls  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "sglang.srt.server_args", module)

    return install


def test_post_init_release_is_read_from_attributes(server_args_class: Any) -> None:
    server_args_class(PostInitArgs)
    _, values = child.build_server_args("m", {})
    assert values["attention_backend"] == "flashinfer"


def test_resolve_once_release_is_read_from_resolved_dict(server_args_class: Any) -> None:
    server_args_class(ResolveOnceArgs)
    server_args, values = child.build_server_args("m", {})
    assert values["attention_backend"] == "flashinfer"
    assert server_args.attention_backend is None  # what a naive harness would have read


@pytest.mark.parametrize(
    ("cls", "says"),
    [
        (InertArgs, "resolution is unavailable or a no-op"),
        (NoOpResolveArgs, "resolution is unavailable or a no-op"),
        (NoDictArgs, "no resolved_dict()"),
    ],
)
def test_unseen_resolution_fails_the_run(server_args_class: Any, cls: type, says: str) -> None:
    server_args_class(cls)
    with pytest.raises(child.HarnessFailure, match=says.replace("(", r"\(").replace(")", r"\)")):
        child.build_server_args("m", {})
    with pytest.raises(child.HarnessFailure):
        child.run_scenario({"name": "s", "model_path": "m", "args": {}, "probes": []})


def test_resolution_error_is_an_observation(server_args_class: Any) -> None:
    server_args_class(ResolveOnceArgs)
    obs = child.run_scenario({"name": "s", "model_path": "raise", "args": {}, "probes": []})
    assert obs == {"error": "ValueError: TRTLLM MLA backend is only supported on Blackwell"}


class WarningArgs(ResolveOnceArgs):
    """Resolves like 0.5.23 and logs a fallback on an sglang logger while doing so."""

    def resolve_once(self) -> None:
        logging.getLogger("sglang.srt.arg_groups.x").warning("triton: %s", "fa3 has no kernels")
        logging.getLogger("sglang.srt.arg_groups.x").info("not a warning")
        super().resolve_once()


def test_resolution_warnings_are_an_observation(server_args_class: Any) -> None:
    server_args_class(WarningArgs)
    obs = child.run_scenario({"name": "s", "model_path": "m", "args": {}, "probes": []})
    assert obs["log.warnings"] == "triton: fa3 has no kernels"
    server_args_class(ResolveOnceArgs)
    obs = child.run_scenario({"name": "s", "model_path": "m", "args": {}, "probes": []})
    assert obs["log.warnings"] is None


@pytest.mark.parametrize(
    ("observed", "ok"),
    [
        ("a | triton: fa3 has no kernels", True),
        ("triton: once | triton: twice", False),  # a fallback warns exactly once
        ("something else", False),
        (None, False),
    ],
)
def test_warns_cell_wants_exactly_one_record(observed: str | None, ok: bool) -> None:
    assert table.matches("warns:triton:", observed) is ok


def test_unavailable_and_harness_cells_are_blind() -> None:
    row = table.Row(1, "s", "f", None, "x.patch", {"sm120": "64x64", "sm90": "128x64"})
    observations: table.Observations = {
        "sm120": {"s": {"error": None, "f": "unavailable:no module m"}},
        "sm90": {"s": {"error": "harness: Traceback"}},
    }
    cells = table.check_row(row, observations)
    assert [c.blind for c in cells] == [True, True]
    expected_unavailable = table.Row(2, "s", "f", None, None, {"sm120": "unavailable:no module m"})
    assert [c.ok for c in table.check_row(expected_unavailable, observations)] == [True]


def test_markdown_footnotes_errors_and_omits_missing_fields() -> None:
    observations: table.Observations = {
        "sm90": {"s": {"error": "ValueError: no", "f": "<missing>"}},
        "sm120": {"s": {"error": None, "f": "<missing>", "g": "x|y", "env.SGLANG_A": "0"}},
    }
    text = report.markdown(observations, ["sm90", "sm120"])
    assert "| error | E1 | null |" in text
    assert "| g | - | `x\\|y` |" in text
    assert "- E1: raises `ValueError: no`" in text
    assert "not in this release (`<missing>`): f" in text
    assert "same on every architecture (omitted): env.SGLANG_A" in text


def _sibling_imports(path: Path) -> tuple[set[str], set[str]]:
    """(siblings imported relatively, names imported plainly) of one harness module."""
    relative, plain = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            relative |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            plain.add(node.module)
        elif isinstance(node, ast.Import):
            plain |= {alias.name for alias in node.names}
    return relative, plain


def test_child_imports_only_its_probe_siblings() -> None:
    """The child runs as `python -m sm120fork.harness.child` (and its zygote imports it):
    every module it reaches imports its harness siblings relatively and nothing else of
    the tool, so a child costs torch and sglang, not the tool's own imports."""
    here = Path(child.__file__).parent
    pending, seen = ["child"], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        relative, plain = _sibling_imports(here / f"{name}.py")
        assert not {m for m in plain if m.startswith("sm120fork")}, f"{name}.py imports the tool"
        pending += sorted(relative)
    assert {"child_probes", "load_probes", "allreduce_probes", "kernel_probes"} <= seen


def test_nvml_standin_answers_a_topology_only_while_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No NVML (driver not loaded) unless SM120_GATE_NVML_TOPOLOGY names a host."""
    lib = ctypes.CDLL(str(fakes.build_libnvidia_ml(tmp_path) / "libnvidia-ml.so.1"))
    monkeypatch.delenv("SM120_GATE_NVML_TOPOLOGY", raising=False)
    assert lib.nvmlInit_v2() == fakes.NVML_ERROR_DRIVER_NOT_LOADED

    def links(topology: str) -> list[int]:
        monkeypatch.setenv("SM120_GATE_NVML_TOPOLOGY", topology)
        monkeypatch.setenv("SM120_GATE_NVML_COUNT", "2")
        assert lib.nvmlInit_v2() == 0
        handles = [ctypes.c_void_p(), ctypes.c_void_p()]
        assert [
            lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) for i, h in enumerate(handles)
        ] == [0, 0]
        assert lib.nvmlDeviceGetHandleByIndex_v2(2, ctypes.byref(ctypes.c_void_p())) != 0
        status = ctypes.c_uint()
        found = []
        for caps in (1, fakes.NVML_P2P_CAPS_INDEX_NVLINK):  # write, NVLink
            assert (
                lib.nvmlDeviceGetP2PStatus(handles[0], handles[1], caps, ctypes.byref(status)) == 0
            )
            found.append(status.value)
        return found

    not_supported = fakes.NVML_P2P_STATUS_NOT_SUPPORTED
    assert links("pcie") == [0, not_supported]
    assert links("nvlink") == [0, 0]
    assert links("nop2p") == [not_supported, not_supported]
    monkeypatch.setenv("SM120_GATE_SMI_COMPUTE_CAP", "12.1")
    major, minor = ctypes.c_int(), ctypes.c_int()
    assert (
        lib.nvmlDeviceGetCudaComputeCapability(None, ctypes.byref(major), ctypes.byref(minor)) == 0
    )
    assert (major.value, minor.value) == (12, 1)


def _arch_run(scenarios: dict[str, dict[str, Any]]) -> runner.ArchRun:
    return runner.ArchRun("sm120", scenarios, {}, 1.0, Path("child.log"))


def test_a_forked_child_that_observes_otherwise_is_named_field_by_field() -> None:
    forked = _arch_run({"a": {"error": None, "moe": "cutlass"}, "b": {"error": None}})
    fresh = _arch_run({"a": {"error": None, "moe": "trtllm"}, "b": {"error": None, "x": 1}})
    assert runner._differences(forked, forked) == []
    assert runner._differences(forked, fresh) == [
        "a.moe: 'cutlass' forked, 'trtllm' fresh",
        "b.x: None forked, 1 fresh",
    ]


def test_what_a_zygote_asked_the_fake_nvidia_smi_in_vain_fails_the_matrix(tmp_path: Path) -> None:
    zygotes.refuse_unexpected_queries(tmp_path)  # nothing asked
    (tmp_path / "nvidia-smi-unexpected.log").write_text("--query-gpu=clocks.max.sm\n")
    with pytest.raises(runner.HarnessError, match=re.escape("clocks.max.sm")):
        zygotes.refuse_unexpected_queries(tmp_path)
