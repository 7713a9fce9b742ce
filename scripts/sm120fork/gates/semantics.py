"""What sglang's architecture helpers mean, per architecture.

Taken from sglang's `srt/utils/common.py` (0.5.9 and 0.5.23): every
`is_*_supported` helper is `_check_cuda_device_version(majors, min_cuda)`,
i.e. "the device's major is one of `majors`", assuming a CUDA new enough
(12.8 for Blackwell). `multimodal_gen`'s platform classes have methods of
the same names with other meanings (`is_blackwell()` is major 10 only), so
a method call on an object is looked up in `PLATFORM_METHODS` first.
`get_platform().<fact>` (0.5.19+) maps each fact to a helper
(`runtime_context._PLATFORM_PROBES`).

Every architecture evaluated is an NVIDIA GPU under CUDA, so the platform
probes (`is_cuda()`, `is_hip()`, ...) have known values too; they are facts,
not architecture tests.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from sm120fork.gates.model import Arch

# A helper's meaning: the architecture -> its answer; None where the answer
# depends on more than the architecture (an installed package, a model flag).
Test = Callable[[Arch], bool | None]


def majors(*values: int) -> Test:
    return lambda arch: arch.major in values


def exactly(major: int, minor: int) -> Test:
    return lambda arch: (arch.major, arch.minor) == (major, minor)


def at_least(major: int) -> Test:
    return lambda arch: arch.major >= major


def only_sm(sm: int) -> Test:
    """False except on `sm` (major * 10 + minor), where it depends on more."""
    return lambda arch: None if arch.sm == sm else False


# Module-level helpers of srt/utils/common.py (called by name or as utils.X).
HELPERS: dict[str, Test] = {
    "is_ampere_with_cuda_12_3": majors(8),
    "is_hopper_with_cuda_12_3": majors(9),
    "is_blackwell_supported": majors(10, 11, 12),
    "is_blackwell": majors(10, 11, 12),
    "is_sm80_supported": majors(8),
    "is_sm90_supported": majors(9),
    "is_sm100_supported": majors(10),
    "is_sm100_or_sm110_supported": majors(10, 11),
    "is_sm110_supported": majors(11),
    "is_sm120_supported": majors(12),
    "is_sm120": exactly(12, 0),  # 0.5.23: RTX Blackwell, not GB10
    "is_sm121": exactly(12, 1),  # 0.5.23: GB10
    # 0.5.23, test/test_utils.py: `return is_blackwell()` (majors 10, 11, 12).
    "is_blackwell_system": majors(10, 11, 12),
    # 0.5.23, srt/layers/attention/dsv4/v41_indexer: `is_cuda() and major >= 10`
    # (SM12x included: its DeepGEMM fp8_fp4 mqa-logits path).
    "is_sm100_or_newer": at_least(10),
    # 0.5.23, srt/layers/moe/mega_moe_sm90.py: `_device_sm == 90` and DeepGEMM has
    # fp8_mega_moe / mega_moe_pre_dispatch_sm90 and the experts hold SM90 FP8 weights.
    "is_sm90_fp8_mega_moe_available": only_sm(90),
}

# Methods of multimodal_gen's platform classes (current_platform.is_hopper()).
PLATFORM_METHODS: dict[str, Test] = {
    "is_blackwell": majors(10),
    "is_hopper": exactly(9, 0),
    "is_sm120": majors(12),
}

# get_platform().<fact> (0.5.19+): runtime_context._PLATFORM_PROBES.
PLATFORM_FACTS: dict[str, str] = {
    "is_sm90": "is_sm90_supported",
    "is_sm100": "is_sm100_supported",
    "is_sm100_or_sm110": "is_sm100_or_sm110_supported",
    "is_sm110": "is_sm110_supported",
    "is_sm120": "is_sm120_supported",
    "is_blackwell": "is_blackwell_supported",
    "is_hopper_with_cuda_12_3": "is_hopper_with_cuda_12_3",
}
# ... and back: the helper -> the platform fact that stands for it.
HELPER_FACTS: dict[str, str] = {helper: fact for fact, helper in PLATFORM_FACTS.items()}

# Helper families the brief names; a member with no entry above is still an
# architecture gate, evaluated as "depends" on itself and reported.
HELPER_FAMILY = re.compile(r"^(is_sm\d+\w*|is_blackwell\w*|is_hopper\w*|is_ampere_with\w*)$")

# Calls returning the capability (major, minor) / the sm number.
# (get_jit_cuda_arch, 0.5.23, returns an object with .major / .minor.)
CAPABILITY_FUNCS = frozenset(
    {"get_device_capability", "get_device_sm_nvidia_smi", "get_jit_cuda_arch"}
)
SM_FUNCS = frozenset({"get_device_sm"})
# platform.has_device_capability(80 | (8, 0)): capability >= the argument.
HAS_CAPABILITY_FUNCS = frozenset({"has_device_capability"})
PLATFORM_GETTERS = frozenset({"get_platform"})
PLATFORM_VALUES = {"device_sm": "sm", "device_capability": "capability"}

# Platform probes: known on every architecture evaluated (all CUDA).
PLATFORM_PROBES: dict[str, bool] = {
    "is_cuda": True,
    "is_cuda_alike": True,
    "is_cuda_static": True,
    "is_nvidia_cuda": True,
    "is_hip": False,
    "is_rocm": False,
    "is_rocm_static": False,
    "is_npu": False,
    "is_xpu": False,
    "is_cpu": False,
    "is_musa": False,
    "is_hpu": False,
    "is_mps": False,
    "is_tpu": False,
    "is_hip_runtime": False,  # kernels/jit (0.5.23)
    "is_musa_runtime": False,
}

# Substrings a file must contain to hold a gate: the pre-filter.
TOKENS: tuple[bytes, ...] = (
    b"is_sm",
    b"is_blackwell",
    b"is_hopper",
    b"is_ampere_with",
    b"device_capability",  # also get_device_capability, has_device_capability
    b"device_sm",  # also get_device_sm
    b"cuda_arch",  # get_jit_cuda_arch (0.5.23)
)


def helper_test(name: str, *, method: bool) -> Test | None:
    """The meaning of helper `name`, called as a function or as a method."""
    if method and name in PLATFORM_METHODS:
        return PLATFORM_METHODS[name]
    return HELPERS.get(name)


def named(name: str) -> bool:
    """Is `name` one the evaluator knows by name (helper, probe, source)?"""
    return name in PLATFORM_PROBES or architectural(name)


def architectural(name: str) -> bool:
    """Is `name` a helper or a source of the architecture (not a platform probe)?"""
    return (
        is_helper_name(name)
        or name in CAPABILITY_FUNCS
        or name in SM_FUNCS
        or name in HAS_CAPABILITY_FUNCS
        or name in PLATFORM_GETTERS
    )


def is_helper_name(name: str) -> bool:
    return name in HELPERS or name in PLATFORM_METHODS or bool(HELPER_FAMILY.match(name))


class Capability(tuple[int, int]):
    """(major, minor) as torch returns it, with the platform classes' extras."""

    __slots__ = ()

    def __new__(cls, major: int, minor: int) -> Capability:
        return super().__new__(cls, (major, minor))

    def __getnewargs__(self) -> tuple[int, int]:
        return (self[0], self[1])

    @property
    def major(self) -> int:
        return self[0]

    @property
    def minor(self) -> int:
        return self[1]

    def to_int(self) -> int:
        return self[0] * 10 + self[1]

    def as_version_str(self) -> str:
        return f"{self[0]}.{self[1]}"


def has_capability(arch: Arch, wanted: object) -> bool | None:
    cap = Capability(arch.major, arch.minor)
    if isinstance(wanted, tuple):
        return cap >= wanted
    if isinstance(wanted, int):
        return cap.to_int() >= wanted
    return None
