"""Child-side probe of the tensor-parallel group's allreduce backends on faked hosts.

For each case a host is faked around one call: the NVML stand-in's topology
(fakes.py: "pcie" = P2P over PCIe without NVLink, "nvlink", "nop2p"), the GPU
count torch.cuda reports, and for custom allreduce rank 0's side of a one-host
torch.distributed group. Then the probe asks sglang what the "tp" group would
build: pcie_ipc_ar.eligible_group (FlashInfer PCIe-IPC) and custom allreduce.
Standalone like child_probes.py (standard library and torch only).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

Observation = dict[str, Any]

COMMUNICATORS = "sglang.srt.distributed.device_communicators"
PCIE_IPC = (f"{COMMUNICATORS}.pcie_ipc_ar",)
CUSTOM_AR = (f"{COMMUNICATORS}.custom_all_reduce",)
PCIE_IPC_ENV = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
# An opt-out of P2P collectives in a case: NCCL's switch, or the custom-allreduce flag
# (parallel_state.set_custom_all_reduce(False), as bootstrap.py does for it).
NCCL_P2P_OFF = "NCCL_P2P_DISABLE=1"
NO_CUSTOM_AR = "--disable-custom-all-reduce"
# (topology of the fake NVML (fakes.py) or "pcie-broken" (NVML reports PCIe P2P, the
#  driver's peer test fails, as behind an IOMMU or ACS), GPUs = TP size, PCIE_IPC_ENV or
#  None, deterministic, opt-out or "")
PCIE_IPC_CASES: tuple[tuple[str, int, str | None, bool, str], ...] = (
    *((topology, gpus, None, False, "") for topology in ("pcie", "nvlink") for gpus in (2, 4, 8)),
    ("pcie", 6, None, False, ""),
    ("nop2p", 4, None, False, ""),
    *(("pcie", 8, env, False, "") for env in ("0", "false", "1")),
    ("nvlink", 8, "1", False, ""),
    ("pcie", 8, None, True, ""),
    ("pcie-broken", 8, None, False, ""),
    ("pcie", 8, None, False, NCCL_P2P_OFF),
    ("pcie", 8, None, False, NO_CUSTOM_AR),
)
# the cases whose log lines are recorded
PCIE_IPC_LOGGED = (
    ("pcie", 8, None, False, ""),
    ("pcie-broken", 8, None, False, ""),
    ("pcie", 8, None, False, NCCL_P2P_OFF),
    ("pcie", 8, None, False, NO_CUSTOM_AR),
)
CUSTOM_AR_HOSTS = (("pcie", 2), ("pcie", 8), ("nvlink", 8))


def _case_label(
    topology: str, gpus: int, env: str | None, deterministic: bool, opt_out: str
) -> str:
    extra = (f", {PCIE_IPC_ENV}={env}" if env is not None else "") + (
        ", deterministic" if deterministic else ""
    )
    return f"{topology} x{gpus}{extra}" + (f", {opt_out}" if opt_out else "")


def _pcie_ipc_field(*case: Any) -> str:
    return f"pcie_ipc.eligible_group[{_case_label(*case)}]"


FIELDS = (
    *(_pcie_ipc_field(*case) for case in PCIE_IPC_CASES),
    *(f"pcie_ipc.log[{_case_label(*case)}]" for case in PCIE_IPC_LOGGED),
    *(f"custom_allreduce[{topology} x{gpus}]" for topology, gpus in CUSTOM_AR_HOSTS),
)


@contextlib.contextmanager
def _host(topology: str, gpus: int, environ: Mapping[str, str | None]) -> Iterator[None]:
    """A host of ``gpus`` GPUs linked as ``topology``: the NVML stand-in answers for
    it (fakes.py), torch.cuda counts them and reports peer access as NVML does."""
    cuda = importlib.import_module("torch").cuda
    names = ("SM120_GATE_NVML_TOPOLOGY", "SM120_GATE_NVML_COUNT", *environ)
    saved_env = {name: os.environ.get(name) for name in names}
    saved = (cuda.device_count, getattr(cuda, "can_device_access_peer", None))
    nvml = "pcie" if topology == "pcie-broken" else topology
    wanted = {"SM120_GATE_NVML_TOPOLOGY": nvml, "SM120_GATE_NVML_COUNT": str(gpus)}
    for name, value in {**wanted, **environ}.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    cuda.device_count = lambda: gpus
    cuda.can_device_access_peer = lambda device, peer: topology not in ("nop2p", "pcie-broken")
    try:
        yield
    finally:
        cuda.device_count, cuda.can_device_access_peer = saved
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _custom_ar_flag(enabled: bool) -> Iterator[None]:
    """parallel_state's custom-allreduce switch (--disable-custom-all-reduce)."""
    state = importlib.import_module("sglang.srt.distributed.parallel_state")
    saved = state._ENABLE_CUSTOM_ALL_REDUCE
    state.set_custom_all_reduce(enabled)
    try:
        yield
    finally:
        state.set_custom_all_reduce(saved)


@contextlib.contextmanager
def _one_host_group(gpus: int) -> Iterator[object]:
    """Rank 0's view of a gloo group of ``gpus`` ranks on one host, rank i on GPU i:
    the torch.distributed calls custom allreduce makes before it allocates anything."""
    dist = importlib.import_module("torch.distributed")

    def all_gather(tensors: list[Any], tensor: Any, group: Any = None, **_: Any) -> None:
        for rank, out in enumerate(tensors):
            out.fill_(rank)

    fakes: dict[str, Callable[..., Any]] = {
        "get_backend": lambda group=None: "gloo",
        "get_rank": lambda group=None: 0,
        "get_world_size": lambda group=None: gpus,
        "get_process_group_ranks": lambda group: list(range(gpus)),
        "all_gather": all_gather,
        "broadcast_object_list": lambda *args, **kwargs: None,
        "barrier": lambda *args, **kwargs: None,
        # in_the_same_node_as: every rank opened rank 0's shared memory
        "all_reduce": lambda tensor, *args, **kwargs: tensor.fill_(1),
    }
    saved = {name: getattr(dist, name) for name in fakes}
    for name, fake in fakes.items():
        setattr(dist, name, fake)
    try:
        yield object()
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def _custom_allreduce(topology: str, gpus: int, first_module: Any, describe: Any) -> Any:
    """What GroupCoordinator would build for custom allreduce, up to its allocation
    (CustomAllreduce.__init__'s checks); the P2P test trusts the faked driver
    (SGLANG_SKIP_P2P_CHECK: the real test opens CUDA IPC handles in subprocesses)."""
    _, custom_ar = first_module(CUSTOM_AR, "dispatch_custom_allreduce")
    device = importlib.import_module("torch").device("cuda", 0)
    try:
        with _host(topology, gpus, {"SGLANG_SKIP_P2P_CHECK": "1"}), _one_host_group(gpus) as group:
            chosen = custom_ar.dispatch_custom_allreduce(group=group, device=device)
            legacy = getattr(custom_ar, "CustomAllreduce", None)
            if legacy is None or chosen is not legacy:
                return str(getattr(chosen, "__name__", chosen))
            if not custom_ar.ops.IS_CUSTOM_AR_AVAILABLE:
                return "off (no custom allreduce ops)"
            full_nvlink = custom_ar.can_use_custom_all_reduce_with_nvlink(
                group=group,
                device=device,
                supported_world_size=legacy._SUPPORTED_WORLD_SIZES,
                cls_name="CustomAllreduce",
            )
    except Exception as exc:
        return describe(exc)
    return "off" if full_nvlink is None else f"CustomAllreduce(full_nvlink={full_nvlink})"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def pcie_allreduce(first_module: Any, call_by_name: Any, describe: Any, plain: Any) -> Observation:
    """Which allreduce backends a tensor-parallel group would build on faked hosts:
    pcie_ipc_ar.eligible_group (FlashInfer PCIe-IPC) and custom allreduce. The helpers
    are probe_support's (first_module, call_by_name, describe, plain)."""
    module_name, pcie_ipc = first_module(PCIE_IPC, "eligible_group")
    logger = logging.getLogger(module_name)
    out: Observation = {}
    for case in PCIE_IPC_CASES:
        topology, gpus, env, deterministic, opt_out = case
        # The P2P test trusts the faked driver, as for custom allreduce below.
        environ = {
            PCIE_IPC_ENV: env,
            "SGLANG_SKIP_P2P_CHECK": "1",
            "NCCL_P2P_DISABLE": "1" if opt_out == NCCL_P2P_OFF else None,
        }
        records, level = _Records(), logger.level
        logger.addHandler(records)
        logger.setLevel(logging.INFO)
        try:
            with _host(topology, gpus, environ), _custom_ar_flag(opt_out != NO_CUSTOM_AR):
                known = {"group_name": "tp", "world_size": gpus, "deterministic": deterministic}
                eligible = call_by_name(pcie_ipc.eligible_group, known)
        finally:
            logger.removeHandler(records)
            logger.setLevel(level)
        out[_pcie_ipc_field(*case)] = plain(eligible)
        if case in PCIE_IPC_LOGGED:
            out[f"pcie_ipc.log[{_case_label(*case)}]"] = " | ".join(records.messages) or None
    for topology, gpus in CUSTOM_AR_HOSTS:
        out[f"custom_allreduce[{topology} x{gpus}]"] = _custom_allreduce(
            topology, gpus, first_module, describe
        )
    return out
