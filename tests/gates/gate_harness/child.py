"""Child side of the gate harness: one interpreter, one faked GPU architecture.

Run by ``runner.py`` as ``python child.py REQUEST.json RESULT.json`` in the gate
environment (torch and sglang's pinned dependencies installed). It uses only the
standard library and torch, and must stay a standalone script: no imports from the
harness package.

Order matters: the fakes go in before sglang is imported, so every ``lru_cache``,
module-level flag (``communicator._is_sm100_supported``, DeepGEMM flags, Triton
``CUDA_CAPABILITY``) and platform object computes itself from the fake hardware.
Nothing of sglang is patched: the fakes sit at the torch.cuda / torch.version
boundary (here), the ``nvidia-smi`` executable and ``libcuda.so.1`` (runner.py).
Triton is touched only to catch a kernel launch and read its tile constants.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

Observation = dict[str, Any]
Probe = Callable[[Any], Observation]

# ServerArgs fields recorded for every scenario that builds ServerArgs. A field
# missing in the tested release is recorded as "<missing>".
SERVER_ARGS_FIELDS = (
    "quantization",
    "dtype",
    "moe_runner_backend",
    "moe_a2a_backend",
    "speculative_moe_runner_backend",
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "kv_cache_dtype",
    "page_size",
    "nsa_prefill_backend",
    "nsa_decode_backend",
    "enable_flashinfer_allreduce_fusion",
    "fp4_gemm_runner_backend",
    "fp8_gemm_runner_backend",
    "sampling_backend",
    "disable_hybrid_swa_memory",
    "device",
)
MISSING = "<missing>"
DEEP_GEMM_FLAGS = ("ENABLE_JIT_DEEPGEMM", "DEEPGEMM_BLACKWELL", "DEEPGEMM_SCALE_UE8M0")


def describe(exc: BaseException) -> dict[str, str]:
    """An observed error: ``{"raises": "<Type>: <first line of the message>"}``."""
    lines = str(exc).strip().splitlines()
    return {"raises": f"{type(exc).__name__}: {lines[0] if lines else ''}"}


def plain(value: Any) -> Any:
    """JSON-able, comparable form of an observed value."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "value") and isinstance(value.value, str):  # an Enum
        return value.value
    return str(value)


# --------------------------------------------------------------------------- fakes


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


# --------------------------------------------------------------------------- probes


def _import(name: str) -> Any:
    return importlib.import_module(name)


def probe_allreduce_fusion(server_args: Any) -> Observation:
    """Row 1: the runtime gate, asked with the scenario's ServerArgs installed."""
    sa_mod = _import("sglang.srt.server_args")
    sa_mod.set_global_server_args_for_scheduler(server_args)
    communicator = _import("sglang.srt.layers.communicator")
    return {
        "communicator.apply_flashinfer_allreduce_fusion": bool(
            communicator.apply_flashinfer_allreduce_fusion(128)
        )
    }


def probe_fp8_gemm(server_args: Any) -> Observation:
    """Row 10: which block-FP8 GEMM the dispatcher picks for the scenario's args."""
    fp8_utils = _import("sglang.srt.layers.quantization.fp8_utils")
    fp8_utils.initialize_fp8_gemm_config(server_args)
    chosen = fp8_utils.dispatch_w8a8_block_fp8_linear()
    return {"fp8_utils.dispatch_w8a8_block_fp8_linear": chosen.__name__}


def probe_fp4_gemm(server_args: Any) -> Observation:
    """Row 12: the FP4 GEMM runner after fp4_utils has read the scenario's args."""
    fp4_utils = _import("sglang.srt.layers.quantization.fp4_utils")
    fp4_utils.initialize_fp4_gemm_config(server_args)
    return {"fp4_utils.fp4_gemm_runner_backend": plain(fp4_utils.get_fp4_gemm_runner_backend())}


def probe_deep_gemm(_: Any) -> Observation:
    """Row 11: DeepGEMM module flags, frozen at import."""
    configurer = _import("sglang.srt.layers.deep_gemm_wrapper.configurer")
    return {
        f"deep_gemm.{flag}": plain(getattr(configurer, flag, MISSING)) for flag in DEEP_GEMM_FLAGS
    }


class _Launched(Exception):
    """Control flow: carries the constants of the caught kernel launch."""

    def __init__(self, constants: dict[str, Any]) -> None:
        super().__init__("launch caught")
        self.constants = constants


def _caught_launch(call: Callable[[], Any]) -> str:
    """Run ``call`` until its first Triton launch; return that launch's BLOCK_MxBLOCK_N."""
    jit = _import("triton.runtime.jit")
    original = jit.JITFunction.run

    def catch(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Launched(kwargs)

    jit.JITFunction.run = catch
    try:
        call()
    except _Launched as launched:
        return f"{launched.constants.get('BLOCK_M')}x{launched.constants.get('BLOCK_N')}"
    finally:
        jit.JITFunction.run = original
    return "no launch"


def _launch_tiles(call: Callable[[], Any]) -> Any:
    """BLOCK_MxBLOCK_N of ``call``'s first Triton launch, or the error raised before it."""
    try:
        return _caught_launch(call)
    except Exception as exc:
        return describe(exc)


def probe_triton_tiles(_: Any) -> Observation:
    """Row 13: Triton attention tile sizes chosen from CUDA_CAPABILITY (meta tensors)."""
    torch = _import("torch")

    def meta(*shape: int, dtype: Any = None) -> Any:
        return torch.empty(*shape, device="meta", dtype=dtype or torch.bfloat16)

    def idx(*shape: int) -> Any:
        return meta(*shape, dtype=torch.int32)

    out: Observation = {}
    extend = _import("sglang.srt.layers.attention.triton_ops.extend_attention")
    for lq, lv in ((128, 128), (192, 128), (576, 512)):

        def extend_fwd(lq: int = lq, lv: int = lv) -> Any:
            q, o, kbuf, vbuf = meta(16, 8, lq), meta(16, 8, lv), meta(64, 8, lq), meta(64, 8, lv)
            indptr, indices = idx(2), idx(16)
            return extend.extend_attention_fwd(
                q, q, o, o, kbuf, vbuf, indptr, indptr, indices, None, True, None, 16
            )

        out[f"triton.extend_attention[Lq={lq}]"] = _launch_tiles(extend_fwd)

    prefill = _import("sglang.srt.layers.attention.triton_ops.prefill_attention")

    for lk in (128, 256):

        def prefill_fwd(lk: int = lk) -> Any:
            x = meta(16, 8, lk)
            return prefill.context_attention_fwd(x, x, x, x, idx(1), idx(1), 16)

        out[f"triton.prefill_attention[Lk={lk}]"] = _launch_tiles(prefill_fwd)

    sparse = _import("sglang.srt.layers.attention.triton_ops.double_sparsity_attention")

    for lq in (128, 256):

        def sparse_fwd(lq: int = lq) -> Any:
            x, buf = meta(16, 8, lq), meta(64, 8, lq)
            one = idx(1)
            return sparse.extend_attention_fwd(
                x, x, x, x, buf, buf, idx(1, 64), one, one, one, one, 16
            )

        out[f"triton.double_sparsity_extend[Lq={lq}]"] = _launch_tiles(sparse_fwd)
    return out


# name -> (probe, the fields it reports: all of them record the error if it raises)
PROBES: dict[str, tuple[Probe, tuple[str, ...]]] = {
    "allreduce_fusion": (
        probe_allreduce_fusion,
        ("communicator.apply_flashinfer_allreduce_fusion",),
    ),
    "fp8_gemm": (probe_fp8_gemm, ("fp8_utils.dispatch_w8a8_block_fp8_linear",)),
    "fp4_gemm": (probe_fp4_gemm, ("fp4_utils.fp4_gemm_runner_backend",)),
    "deep_gemm": (probe_deep_gemm, tuple(f"deep_gemm.{f}" for f in DEEP_GEMM_FLAGS)),
    "triton_tiles": (probe_triton_tiles, ()),
}


# --------------------------------------------------------------------------- scenarios


def run_scenario(scenario: dict[str, Any]) -> Observation:
    """Build ServerArgs for the scenario (if it names a model), then run its probes."""
    environ = dict(os.environ)
    obs: Observation = {"error": None}
    server_args: Any = None
    try:
        if scenario.get("model_path"):
            server_args_mod = _import("sglang.srt.server_args")
            try:
                server_args = server_args_mod.ServerArgs(
                    model_path=scenario["model_path"], **scenario.get("args", {})
                )
            except Exception as exc:
                obs["error"] = describe(exc)["raises"]
                return obs
            for name in SERVER_ARGS_FIELDS:
                obs[name] = plain(getattr(server_args, name, MISSING))
            for key in sorted(set(os.environ) | set(environ)):
                if os.environ.get(key) != environ.get(key) and key.startswith("SGLANG_"):
                    obs[f"env.{key}"] = os.environ.get(key)
        for probe_name in scenario.get("probes", []):
            probe, fields = PROBES[probe_name]
            try:
                obs.update(probe(server_args))
            except Exception as exc:
                obs.update({field: describe(exc) for field in fields})
                obs[f"probe.{probe_name}"] = describe(exc)
        return obs
    finally:
        os.environ.clear()
        os.environ.update(environ)


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[1]).read_text())
    started = time.monotonic()
    meta: dict[str, Any] = {"arch": request["arch"]["name"]}
    meta.update(fake_hardware(request["arch"]))

    sglang_path = str(Path(request["sglang_path"]).resolve())
    sys.path.insert(0, sglang_path)
    sglang = _import("sglang")
    where = str(Path(sglang.__file__).resolve())
    if not where.startswith(sglang_path + os.sep):
        raise SystemExit(f"sglang imported from {where}, not from the tested tree {sglang_path}")
    meta["sglang_file"] = where
    meta["sglang_version"] = getattr(sglang, "__version__", None)
    meta["import_s"] = round(time.monotonic() - started, 2)

    scenarios: dict[str, Observation] = {}
    for scenario in request["scenarios"]:
        try:
            scenarios[scenario["name"]] = run_scenario(scenario)
        except Exception:
            traceback.print_exc()
            scenarios[scenario["name"]] = {"error": "harness: " + traceback.format_exc(limit=1)}
    meta["total_s"] = round(time.monotonic() - started, 2)
    Path(argv[2]).write_text(json.dumps({"meta": meta, "scenarios": scenarios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
