"""Child side: the fake GPU at the torch.cuda / torch.version boundary, from one
architecture of archs.toml. Standard library only at import (torch inside).
"""

from __future__ import annotations

import importlib
from typing import Any


class FakeDeviceProperties:
    """Stands in for torch._C._CudaDeviceProperties (same attribute names)."""

    def __init__(self, arch: dict[str, Any]) -> None:
        major, minor = arch["capability"]
        self.name: str = arch["device_name"]
        self.major: int = major
        self.minor: int = minor
        self.total_memory: int = arch["total_memory_mib"] * 1024 * 1024
        self.multi_processor_count: int = arch["sm_count"]
        self.shared_memory_per_block: int = 48 * 1024
        self.shared_memory_per_block_optin: int = arch["smem_per_block_optin_kib"] * 1024
        self.shared_memory_per_multiprocessor: int = arch["smem_per_sm_kib"] * 1024
        self.L2_cache_size: int = arch["l2_cache_mib"] * 1024 * 1024
        self.max_threads_per_multi_processor: int = 2048 if major < 12 else 1536
        self.regs_per_multiprocessor: int = 65536
        self.warp_size: int = 32
        self.is_integrated: bool = bool(arch.get("integrated", False))
        self.is_multi_gpu_board: bool = False
        self.gcnArchName: str = "NVIDIA"
        self.uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
        self.pci_bus_id: int = 0
        self.pci_device_id: int = 0
        self.pci_domain_id: int = 0

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
            f"minor={self.minor}, total_memory={self.total_memory // 2**20}MB, "
            f"multi_processor_count={self.multi_processor_count})"
        )


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


def fake_hardware(arch: dict[str, Any]) -> dict[str, Any]:
    """Install the fake GPU at the torch.cuda / torch.version boundary."""
    torch = importlib.import_module("torch")
    major, minor = arch["capability"]
    props = FakeDeviceProperties(arch)
    count = int(arch["device_count"])
    total = props.total_memory

    installed = torch.version.cuda
    # torchvision refuses a torch.version.cuda whose major differs from its build:
    # keep the installed build's value whenever it already satisfies the arch.
    if installed and _version_tuple(installed) >= _version_tuple(arch["min_cuda"]):
        cuda_version = installed
    else:
        cuda_version = arch["min_cuda"]

    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: count
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.get_device_capability = lambda device=None: (major, minor)
    cuda.get_device_name = lambda device=None: props.name
    cuda.get_device_properties = lambda device=None: props
    cuda.mem_get_info = lambda device=None: (total, total)
    cuda.get_arch_list = lambda: ["sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    cuda.synchronize = lambda device=None: None
    torch.version.cuda = cuda_version
    torch.version.hip = None
    return {"torch": torch.__version__, "torch.version.cuda": cuda_version}
