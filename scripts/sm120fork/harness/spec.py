"""The gate table's data files: architectures, scenarios, where they live. Standard
library only, but for the series parser."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm120fork.patches.series import read_series

# The fork the harness judges: the checkout it runs from (pytest, `python -m
# sm120fork.harness`, the rebase's row checks all run from the fork's root), or
# $SM120_FORK_ROOT. The harness's own code comes from the tool, the data from there.
_MARKERS = ("patches/series", "vendor/sglang.lock")


def _fork_root() -> Path:
    named = os.environ.get("SM120_FORK_ROOT")
    start = Path(named) if named else Path.cwd()
    for candidate in (start, *start.parents):
        if any((candidate / marker).is_file() for marker in _MARKERS):
            return candidate.resolve()
    return start.resolve()


REPO_ROOT = _fork_root()
TABLE_DIR = REPO_ROOT / "gatetable"
ARCHS_FILE = TABLE_DIR / "archs.toml"
SCENARIOS_FILE = TABLE_DIR / "scenarios.toml"
EXPECTATIONS_FILE = TABLE_DIR / "expectations.toml"
MODELS_DIR = TABLE_DIR / "models"
TOOL_SCRIPTS = Path(__file__).resolve().parents[2]  # what holds sm120fork/
SERIES_FILE = REPO_ROOT / "patches" / "series"
VENDOR_PYTHON = REPO_ROOT / "vendor" / "sglang" / "python"


# The driver the fake nvidia-smi reports: R580 ships CUDA 13.0 (the gate env's torch).
SMI_DRIVER = "580.95.05"


class SpecError(ValueError):
    """A data file of the gate tests is malformed; the message says where."""


@dataclass(frozen=True)
class Arch:
    """One faked GPU architecture (a table of archs.toml)."""

    name: str
    values: Mapping[str, Any]

    @property
    def capability(self) -> tuple[int, int]:
        major, minor = self.values["capability"]
        return int(major), int(minor)

    def child_request(self) -> dict[str, Any]:
        """The architecture as child.py reads it."""
        return {"name": self.name, **self.values}

    def smi_environ(self) -> dict[str, str]:
        """Environment for the fake nvidia-smi (see fakes.NVIDIA_SMI)."""
        major, minor = self.capability
        return {
            "SM120_GATE_SMI_COUNT": str(self.values["device_count"]),
            "SM120_GATE_SMI_MEMORY_MIB": str(self.values["smi_memory"]),
            "SM120_GATE_SMI_COMPUTE_CAP": f"{major}.{minor}",
            "SM120_GATE_SMI_NAME": str(self.values["device_name"]),
            "SM120_GATE_SMI_DRIVER": SMI_DRIVER,
        }


@dataclass(frozen=True)
class Scenario:
    """(model config dir, extra ServerArgs kwargs, probes): a table of scenarios.toml."""

    name: str
    model: str | None
    args: Mapping[str, Any] = field(default_factory=dict)
    probes: tuple[str, ...] = ()
    doc: str = ""

    def child_request(self) -> dict[str, Any]:
        model_path = str(MODELS_DIR / self.model) if self.model else None
        return {
            "name": self.name,
            "model_path": model_path,
            "args": dict(self.args),
            "probes": list(self.probes),
        }


_ARCH_KEYS = {
    "capability",
    "device_name",
    "min_cuda",
    "device_count",
    "total_memory_mib",
    "smi_memory",
    "sm_count",
    "smem_per_block_optin_kib",
    "smem_per_sm_kib",
    "l2_cache_mib",
}


def _load(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SpecError(f"{path}: {exc}") from exc


def load_archs(path: Path = ARCHS_FILE) -> tuple[Arch, ...]:
    archs = []
    for name, values in _load(path).items():
        missing = _ARCH_KEYS - set(values)
        if missing:
            raise SpecError(f"{path}: [{name}] lacks {', '.join(sorted(missing))}")
        archs.append(Arch(name, values))
    return tuple(archs)


def load_scenarios(path: Path = SCENARIOS_FILE) -> dict[str, Scenario]:
    scenarios: dict[str, Scenario] = {}
    for name, values in _load(path).items():
        unknown = set(values) - {"model", "args", "probes", "doc"}
        if unknown:
            raise SpecError(f"{path}: [{name}] has unknown keys {', '.join(sorted(unknown))}")
        model = values.get("model")
        if model is not None and not (MODELS_DIR / model / "config.json").is_file():
            raise SpecError(
                f"{path}: [{name}] model {model!r} has no {MODELS_DIR / model}/config.json"
            )
        scenarios[name] = Scenario(
            name=name,
            model=model,
            args=dict(values.get("args", {})),
            probes=tuple(values.get("probes", ())),
            doc=str(values.get("doc", "")).strip(),
        )
    return scenarios


def series_patches(path: Path = SERIES_FILE) -> tuple[str, ...]:
    """Patch names of patches/series in order (none without a series)."""
    return tuple(read_series(path).names) if path.is_file() else ()
