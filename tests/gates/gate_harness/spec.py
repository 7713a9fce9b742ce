"""The gate tests' data files: architectures, scenarios, locations. Standard library only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

GATES_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = GATES_DIR.parents[1]
ARCHS_FILE = GATES_DIR / "archs.toml"
SCENARIOS_FILE = GATES_DIR / "scenarios.toml"
EXPECTATIONS_FILE = GATES_DIR / "expectations.toml"
MODELS_DIR = GATES_DIR / "models"
CHILD_SCRIPT = Path(__file__).resolve().with_name("child.py")
SERIES_FILE = REPO_ROOT / "patches" / "series"
VENDOR_PYTHON = REPO_ROOT / "vendor" / "sglang" / "python"


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
    """Patch names of patches/series in order (comments and blank lines skipped)."""
    if not path.is_file():
        return ()
    names = []
    for line in path.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            names.append(text.split()[0])
    return tuple(names)
