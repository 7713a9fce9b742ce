"""The fakes outside Python: stand-in ``libcuda.so.1`` and ``libnvidia-ml.so.1``, and
an ``nvidia-smi``.

All are generated at test-setup time into a scratch directory (never committed):

* ``libcuda.so.1``: sgl-kernel, DeepGEMM, FlashMLA and friends link the CUDA driver
  library. With torch.cuda faked as available, sglang imports them, and the dynamic
  loader needs every driver entry point they import. The stand-in defines exactly
  those (read with ``nm -D --undefined-only`` from every shared object in the gate
  environment that lists ``libcuda.so*`` as NEEDED), each returning
  CUDA_ERROR_NO_DEVICE (100). Nothing runs on a GPU here; the fakes only let the
  import succeed.
* ``libnvidia-ml.so.1``: later releases read the compute capability through NVML
  (pynvml) while torch.cuda is uninitialized (``get_device_sm``), and the custom
  allreduce asks NVML for P2P. On a machine with a real driver that would read the
  real GPU past the fakes. The stand-in answers ``nvmlInit*`` with
  NVML_ERROR_DRIVER_NOT_LOADED, so every NVML user takes its no-NVML path, as on a
  machine without a driver, and sglang falls back to torch.cuda (faked). Only while
  ``SM120_GATE_NVML_TOPOLOGY`` is set (by the ``pcie_allreduce`` probe, around one
  call, and by the doctor's tests) does it answer as a host of ``SM120_GATE_NVML_COUNT``
  GPUs: the GPU-to-GPU links (``nvmlDeviceGetP2PStatus``, the common ancestor) of that
  topology, the faked capability, and the name, memory, power and driver versions the
  doctor reads (``SM120_GATE_SMI_*`` and ``SM120_GATE_NVML_*``).
* ``nvidia-smi``: ``get_nvgpu_memory_capacity`` and ``get_device_sm_nvidia_smi`` run
  it. The fake answers ``--query-gpu=`` with the architecture's values, read from
  ``SM120_GATE_SMI_*`` environment variables the runner sets per child, and
  ``driver_version`` (``get_nvidia_driver_version``: GPT-OSS's bf16 MoE runner on
  Blackwell) with ``SMI_DRIVER``, an R580 driver (CUDA 13.0, the gate env's torch).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

CUDA_ERROR_NO_DEVICE = 100
_DRIVER_SYMBOL = re.compile(r"^cu[A-Z]\w*$")


class FakeBuildError(RuntimeError):
    """The environment cannot host the fakes (no gcc/binutils, nothing to stand in for)."""


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise FakeBuildError(
            f"{' '.join(cmd)} exited {proc.returncode}\n"
            f"stdout: {proc.stdout}\nstderr: {proc.stderr}"
        )
    return proc.stdout


_BATCH = 200  # shared objects per readelf / nm process (700 in the gate environment)
_LIBCUDA = re.compile(r"\[libcuda\.so[^\]]*\]")


def _needing_libcuda(shared_objects: list[Path]) -> list[Path]:
    """Those of `shared_objects` whose dynamic section lists libcuda.so* as NEEDED, read
    by one `readelf -d` per batch (a file readelf cannot read needs nothing)."""
    needing: list[Path] = []
    for start in range(0, len(shared_objects), _BATCH):
        batch = shared_objects[start : start + _BATCH]
        if len(batch) == 1:  # readelf heads its output with "File:" only for several
            batch = [*batch, batch[0]]
        proc = subprocess.run(
            ["readelf", "-d", *map(str, batch)], capture_output=True, text=True, check=False
        )
        current = None
        for line in proc.stdout.splitlines():
            if line.startswith("File: "):
                current = Path(line[len("File: ") :])
            elif current is not None and _LIBCUDA.search(line) and current not in needing:
                needing.append(current)
    return needing


def _shared_objects(site_packages: Iterable[Path]) -> Iterable[Path]:
    for root in site_packages:
        for path in root.rglob("*.so*"):
            if path.is_file() and not path.is_symlink():
                yield path


def driver_symbols(site_packages: Iterable[Path]) -> list[str]:
    """Every CUDA driver entry point that some shared object in the environment imports."""
    symbols: set[str] = set()
    needing = _needing_libcuda(list(_shared_objects(site_packages)))
    for start in range(0, len(needing), _BATCH):
        batch = [str(so) for so in needing[start : start + _BATCH]]
        for line in _run(["nm", "-D", "--undefined-only", *batch]).splitlines():
            fields = line.split()
            if fields and not line.endswith(":"):  # "FILE:" heads each file's symbols
                name = fields[-1].split("@")[0]
                if _DRIVER_SYMBOL.match(name):
                    symbols.add(name)
    return sorted(symbols)


def build_libcuda(site_packages: Iterable[Path], out_dir: Path) -> Path:
    """Compile the stand-in ``libcuda.so.1`` into ``out_dir``; return that directory."""
    symbols = driver_symbols(site_packages)
    if not symbols:
        raise FakeBuildError("no shared object in the gate environment imports the CUDA driver")
    out_dir.mkdir(parents=True, exist_ok=True)
    source = out_dir / "libcuda_standin.c"
    body = "\n".join(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}" for name in symbols)
    source.write_text(
        "/* Generated by sm120fork/harness/fakes.py: every CUDA driver entry point\n"
        " * the gate environment's extensions import, each returning CUDA_ERROR_NO_DEVICE. */\n"
        f"{body}\n"
    )
    library = out_dir / "libcuda.so.1"
    _run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(library), str(source)])
    alias = out_dir / "libcuda.so"
    if not alias.exists():
        alias.symlink_to(library.name)
    (out_dir / "symbols.txt").write_text("\n".join(symbols) + "\n")
    return out_dir


NVML_ERROR_DRIVER_NOT_LOADED = 9
# SM120_GATE_NVML_TOPOLOGY: "pcie" (P2P over PCIe, no NVLink), "nvlink" (every pair
# NVLinked) or "nop2p" (no peer access at all, as GeForce cards without P2P).
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_STATUS_NOT_SUPPORTED = 5
_NVML_STANDIN = f"""/* Generated by sm120fork/harness/fakes.py: NVML without a driver, or,
 * while SM120_GATE_NVML_TOPOLOGY is set, a host of SM120_GATE_NVML_COUNT GPUs. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
static const char *topology(void) {{
  const char *t = getenv("SM120_GATE_NVML_TOPOLOGY");
  return (t && *t) ? t : 0;
}}
static unsigned gpus(void) {{
  const char *n = getenv("SM120_GATE_NVML_COUNT");
  return n ? (unsigned)strtoul(n, 0, 10) : 0;
}}
static int init(void) {{ return topology() ? 0 : {NVML_ERROR_DRIVER_NOT_LOADED}; }}
int nvmlInit(void) {{ return init(); }}
int nvmlInit_v2(void) {{ return init(); }}
int nvmlInitWithFlags(unsigned int flags) {{ return init(); }}
int nvmlShutdown(void) {{ return topology() ? 0 : 1; }}  /* NVML_ERROR_UNINITIALIZED */
const char *nvmlErrorString(int result) {{ return "Driver Not Loaded (gate-test stand-in)"; }}
int nvmlDeviceGetCount_v2(unsigned *count) {{
  if (!topology()) return 1;
  *count = gpus();
  return 0;
}}
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void **device) {{
  if (!topology()) return 1;
  if (index >= gpus()) return 2;  /* NVML_ERROR_INVALID_ARGUMENT */
  *device = (void *)(uintptr_t)(index + 1);
  return 0;
}}
int nvmlDeviceGetP2PStatus(void *a, void *b, int caps, int *status) {{
  const char *t = topology();
  if (!t) return 1;
  if (!strcmp(t, "nvlink")) *status = 0;
  else if (!strcmp(t, "pcie"))
    *status = caps == {NVML_P2P_CAPS_INDEX_NVLINK} ? {NVML_P2P_STATUS_NOT_SUPPORTED} : 0;
  else *status = {NVML_P2P_STATUS_NOT_SUPPORTED};
  return 0;
}}
/* What the doctor (sglang/sm120_doctor/nvml.py) reads besides the links. */
static const char *env_or(const char *name, const char *fallback) {{
  const char *v = getenv(name);
  return (v && *v) ? v : fallback;
}}
static int copy_text(const char *text, char *out, unsigned length) {{
  if (strlen(text) + 1 > length) return 7;  /* NVML_ERROR_INSUFFICIENT_SIZE */
  strcpy(out, text);
  return 0;
}}
int nvmlSystemGetDriverVersion(char *out, unsigned length) {{
  if (!topology()) return 1;
  return copy_text(env_or("SM120_GATE_NVML_DRIVER", "580.95.05"), out, length);
}}
int nvmlSystemGetCudaDriverVersion_v2(int *version) {{
  if (!topology()) return 1;
  *version = (int)strtol(env_or("SM120_GATE_NVML_CUDA", "13000"), 0, 10);
  return 0;
}}
int nvmlDeviceGetName(void *device, char *out, unsigned length) {{
  if (!topology()) return 1;
  return copy_text(env_or("SM120_GATE_SMI_NAME", "NVIDIA GPU"), out, length);
}}
int nvmlDeviceGetMemoryInfo(void *device, unsigned long long *memory) {{
  if (!topology()) return 1;
  memory[0] = strtoull(env_or("SM120_GATE_SMI_MEMORY_MIB", "0"), 0, 10) << 20;
  memory[1] = memory[0];
  memory[2] = 0;
  return 0;
}}
static int watts(const char *name, const char *fallback, unsigned *milliwatts) {{
  if (!topology()) return 1;
  *milliwatts = (unsigned)strtoul(env_or(name, fallback), 0, 10) * 1000;
  return 0;
}}
int nvmlDeviceGetPowerManagementLimit(void *device, unsigned *mw) {{
  return watts("SM120_GATE_NVML_POWER_LIMIT_W", "600", mw);
}}
int nvmlDeviceGetPowerUsage(void *device, unsigned *mw) {{
  return watts("SM120_GATE_NVML_POWER_DRAW_W", "30", mw);
}}
int nvmlDeviceGetTopologyCommonAncestor(void *a, void *b, int *level) {{
  const char *t = topology();
  if (!t) return 1;
  /* NVLinked boards share a switch (PIX); PCIe peers a host bridge (PHB); else SYS */
  *level = !strcmp(t, "nvlink") ? 10 : !strcmp(t, "pcie") ? 30 : 50;
  return 0;
}}
int nvmlDeviceGetCudaComputeCapability(void *device, int *major, int *minor) {{
  const char *cap = getenv("SM120_GATE_SMI_COMPUTE_CAP");
  char *end;
  if (!topology() || !cap) return 1;
  *major = (int)strtol(cap, &end, 10);
  *minor = *end == '.' ? (int)strtol(end + 1, 0, 10) : 0;
  return 0;
}}
"""


def build_libnvidia_ml(out_dir: Path) -> Path:
    """Compile the stand-in ``libnvidia-ml.so.1`` into ``out_dir``; return that directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    source = out_dir / "libnvidia_ml_standin.c"
    source.write_text(_NVML_STANDIN)
    library = out_dir / "libnvidia-ml.so.1"
    _run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-Wl,-soname,libnvidia-ml.so.1",
            "-o",
            str(library),
            str(source),
        ]
    )
    alias = out_dir / "libnvidia-ml.so"
    if not alias.exists():
        alias.symlink_to(library.name)
    return out_dir


NVIDIA_SMI = """#!/bin/sh
# Generated by sm120fork/harness/fakes.py: a fake nvidia-smi for the gate tests.
# Answers --query-gpu=FIELD[,FIELD...] for SM120_GATE_SMI_COUNT GPUs; anything else
# is logged to SM120_GATE_SMI_LOG and fails, so an unexpected call shows up.
query=""
for arg in "$@"; do
  case "$arg" in --query-gpu=*) query="${arg#--query-gpu=}" ;; esac
done
if [ -z "$query" ]; then
  echo "fake nvidia-smi: unsupported call: $*" >&2
  [ -n "$SM120_GATE_SMI_LOG" ] && echo "$*" >> "$SM120_GATE_SMI_LOG"
  exit 9
fi
i=0
while [ "$i" -lt "${SM120_GATE_SMI_COUNT:-1}" ]; do
  line=""
  for field in $(echo "$query" | tr ',' ' '); do
    case "$field" in
      memory.total) value="$SM120_GATE_SMI_MEMORY_MIB" ;;
      compute_cap) value="$SM120_GATE_SMI_COMPUTE_CAP" ;;
      name) value="$SM120_GATE_SMI_NAME" ;;
      index) value="$i" ;;
      driver_version) value="$SM120_GATE_SMI_DRIVER" ;;
      *) echo "fake nvidia-smi: unknown field $field" >&2
         [ -n "$SM120_GATE_SMI_LOG" ] && echo "field $field" >> "$SM120_GATE_SMI_LOG"
         exit 9 ;;
    esac
    line="${line:+$line, }$value"
  done
  echo "$line"
  i=$((i + 1))
done
"""


def write_nvidia_smi(bin_dir: Path) -> Path:
    """Write the fake ``nvidia-smi`` into ``bin_dir`` (to go first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(0o755)
    return bin_dir
