"""The doctor as the series builds it: vendor/sglang with patches/series applied
(`sm120fork apply --out`), its sglang/sm120_doctor/ loaded under a name of its own
so that the test process never imports sglang."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

from sm120fork.harness import fakes, trees
from sm120fork.harness.spec import REPO_ROOT

NAME = "sm120_doctor_under_test"
KNOWN_BAD = REPO_ROOT / "patches" / "known-bad.toml"


def applied_doctor(scratch: Path) -> Path:
    """sglang/sm120_doctor/ of the patched tree, with the known-bad table beside it
    as the wheel ships it; $SM120_DOCTOR_UNDER_TEST names another copy (a mutated
    one, to see the tests fail)."""
    if os.environ.get("SM120_DOCTOR_UNDER_TEST"):
        return Path(os.environ["SM120_DOCTOR_UNDER_TEST"])
    tree = trees.build_patched_tree(scratch / "applied")
    package = tree.path / "sglang" / "sm120_doctor"
    shutil.copyfile(KNOWN_BAD, package / "known_bad.toml")
    return package


def load(package: Path) -> ModuleType:
    """The package imported as NAME; its modules as NAME.<module>."""
    if NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            NAME, package / "__init__.py", submodule_search_locations=[str(package)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[NAME]


def module(name: str) -> ModuleType:
    return importlib.import_module(f"{NAME}.{name}")


def stand_in_nvml(scratch: Path) -> Path:
    """The gate harness's NVML stand-in (a directory for LD_LIBRARY_PATH)."""
    return fakes.build_libnvidia_ml(scratch / "nvml")


def faked_gpus(
    count: int, cap: str, name: str, memory_mib: int, topology: str = "pcie", cuda: str = "13000"
) -> dict[str, str]:
    """The stand-in's environment for `count` GPUs of one kind."""
    return {
        "SM120_GATE_NVML_TOPOLOGY": topology,
        "SM120_GATE_NVML_COUNT": str(count),
        "SM120_GATE_SMI_COMPUTE_CAP": cap,
        "SM120_GATE_SMI_NAME": name,
        "SM120_GATE_SMI_MEMORY_MIB": str(memory_mib),
        "SM120_GATE_NVML_CUDA": cuda,
    }
