"""Finding gates: every form of architecture test, on synthetic modules.

Archs are written sm80 sm89 sm90 sm100 sm103 sm120 sm121 (T/F/? = depends).
"""

from __future__ import annotations

from pathlib import Path

from sm120fork.gates.answer import NO, Answer
from test_gates_support import answers, conditions, only, scan

HELPERS = """
from sglang.srt.utils import (
    is_blackwell_supported, is_sm100_supported, is_sm120_supported, is_sm90_supported,
    is_hopper_with_cuda_12_3, is_ampere_with_cuda_12_3,
)

def pick():
    if is_sm100_supported():
        return "a"
    elif is_blackwell_supported():
        return "b"
    elif is_sm120_supported():
        return "c"
    elif is_sm90_supported():
        return "d"
    elif is_hopper_with_cuda_12_3():
        return "e"
    elif is_ampere_with_cuda_12_3():
        return "f"
"""


def test_helper_calls_mean_what_sglang_defines(tmp_path: Path) -> None:
    inventory = scan(tmp_path, {"srt/pick.py": HELPERS})
    got = {g.condition: (answers(g), g.kind, g.function) for g in inventory.gates}
    assert got == {
        "is_sm100_supported()": ("FFFTTFF", "if", "pick"),
        "is_blackwell_supported()": ("FFFTTTT", "elif", "pick"),
        "is_sm120_supported()": ("FFFFFTT", "elif", "pick"),
        "is_sm90_supported()": ("FFTFFFF", "elif", "pick"),
        "is_hopper_with_cuda_12_3()": ("FFTFFFF", "elif", "pick"),
        "is_ampere_with_cuda_12_3()": ("TTFFFFF", "elif", "pick"),
    }
    assert all(g.file == "python/sglang/srt/pick.py" for g in inventory.gates)
    assert [g.line for g in inventory.gates] == [7, 9, 11, 13, 15, 17]


def test_aliases_and_module_attributes(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/alias.py": """
                from sglang.srt.utils import is_sm100_supported as on_b200
                from sglang.srt import utils
                import sglang.srt.utils as u

                def f():
                    if on_b200():
                        pass
                    if utils.is_blackwell():
                        pass
                    if u.is_sm120_supported():
                        pass
            """,
            # `utils` is a module of the tree: its helpers, not a platform object's
            "srt/utils/__init__.py": "from sglang.srt.utils.common import *\n",
        },
    )
    assert answers(only(inventory, "on_b200()")) == "FFFTTFF"
    assert answers(only(inventory, "utils.is_blackwell()")) == "FFFTTTT"
    assert answers(only(inventory, "u.is_sm120_supported()")) == "FFFFFTT"


def test_cached_module_flags(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/layers/communicator.py": """
                from sglang.srt.utils import is_cuda, is_sm90_supported, is_sm100_supported

                _is_cuda = is_cuda()
                _is_sm90_supported = _is_cuda and is_sm90_supported()
                _is_sm100_supported = _is_cuda and is_sm100_supported()

                def apply_fusion(batch_size):
                    return (_is_sm90_supported or _is_sm100_supported) and batch_size > 0
            """
        },
    )
    assert answers(only(inventory, "_is_cuda and is_sm90_supported()")) == "FFTFFFF"
    flag = only(inventory, "_is_cuda and is_sm100_supported()")
    assert (flag.kind, flag.function) == ("flag", "<module>")
    fusion = only(inventory, "(_is_sm90_supported or _is_sm100_supported) and batch_size > 0")
    assert fusion.kind == "return"
    assert fusion.archs["sm120"] == NO
    assert fusion.archs["sm100"] == Answer.depends("batch_size")


def test_capability_comparisons(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/cap.py": """
                import torch
                from sglang.srt.utils import get_device_capability, get_device_sm

                CUDA_CAPABILITY = torch.cuda.get_device_capability()
                _is_hopper = CUDA_CAPABILITY[0] == 9

                def f():
                    major, minor = torch.cuda.get_device_capability()
                    if major >= 10:
                        pass
                    capability = get_device_capability()
                    if capability[0] in (10, 12):
                        pass
                    sm = get_device_sm()
                    if 90 <= sm < 120:
                        pass
                    if torch.cuda.get_device_capability()[0] == 9:
                        pass
                    if get_device_capability() >= (8, 9):
                        pass
                    if (major, minor) == (12, 1):
                        pass
                    if get_device_sm() >= 100:
                        pass
            """
        },
    )
    assert answers(only(inventory, "CUDA_CAPABILITY[0] == 9")) == "FFTFFFF"
    assert answers(only(inventory, "major >= 10")) == "FFFTTTT"
    assert answers(only(inventory, "capability[0] in (10, 12)")) == "FFFTTTT"
    assert answers(only(inventory, "90 <= sm < 120")) == "FFTTTFF"
    assert answers(only(inventory, "torch.cuda.get_device_capability()[0] == 9")) == "FFTFFFF"
    assert answers(only(inventory, "get_device_capability() >= (8, 9)")) == "FTTTTTT"
    assert answers(only(inventory, "(major, minor) == (12, 1)")) == "FFFFFFT"
    assert answers(only(inventory, "get_device_sm() >= 100")) == "FFFTTTT"


def test_platform_attributes(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/arg_groups/model_overrides/glm4_moe.py": """
                from sglang.srt.runtime_context import get_platform

                def _glm4_moe_overrides(server_args, hf_config):
                    if get_platform().is_sm100:
                        return {"moe_runner_backend": "flashinfer_trtllm"}
                    platform = get_platform()
                    if platform.is_cuda and platform.device_sm >= 120:
                        return {}
                    return {}
            """
        },
    )
    assert answers(only(inventory, "get_platform().is_sm100")) == "FFFTTFF"
    assert answers(only(inventory, "platform.is_cuda and platform.device_sm >= 120")) == "FFFFFTT"


def test_platform_class_methods_mean_their_own_thing(tmp_path: Path) -> None:
    """multimodal_gen's `current_platform.is_blackwell()` is major 10 only."""
    inventory = scan(
        tmp_path,
        {
            "multimodal_gen/select.py": """
                from sglang.multimodal_gen.runtime.platforms import current_platform

                def choose():
                    if current_platform.is_sm120():
                        return "sm120"
                    if current_platform.is_blackwell():
                        return "fa4"
                    if current_platform.is_hopper():
                        return "fa3"
            """
        },
    )
    assert answers(only(inventory, "current_platform.is_sm120()")) == "FFFFFTT"
    assert answers(only(inventory, "current_platform.is_blackwell()")) == "FFFTTFF"
    assert answers(only(inventory, "current_platform.is_hopper()")) == "FFTFFFF"


def test_every_site_kind(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/kinds.py": """
                from sglang.srt.utils import is_blackwell, is_sm100_supported, is_sm90_supported

                class Backend:
                    def choose(self, xs):
                        n = 32 if is_blackwell() else 3
                        while is_sm90_supported() and n:
                            n -= 1
                        assert is_sm100_supported(), "needs SM100"
                        self.run(use_fp4=is_blackwell())
                        return [x for x in xs if is_sm90_supported() or x]

                    def enabled(self):
                        def inner():
                            return is_sm100_supported() and self.ok
                        return inner
            """
        },
    )
    kinds = {(g.condition, g.kind, g.function) for g in inventory.gates}
    assert kinds == {
        ("is_blackwell()", "ternary", "Backend.choose"),
        ("is_sm90_supported() and n", "while", "Backend.choose"),
        ("is_sm100_supported()", "assert", "Backend.choose"),
        ("is_blackwell()", "expr", "Backend.choose"),
        ("is_sm90_supported() or x", "comprehension", "Backend.choose"),
        ("is_sm100_supported() and self.ok", "return", "Backend.enabled.inner"),
    }


def test_what_is_not_a_gate(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/plain.py": """
                import torch
                from sglang.srt.utils import get_device_capability, is_cuda

                def f(x, cache):
                    capability = get_device_capability()
                    if capability is None:  # a device or not: not which
                        return
                    key = (x, capability)
                    if key not in cache:  # a cache key holding the capability
                        cache[key] = 1
                    if kernel(x, capability):  # an opaque call decides for itself
                        pass
                    if is_cuda():  # the platform, not the architecture
                        pass
                    if x > 3:
                        pass
            """
        },
    )
    assert conditions(inventory) == []


def test_flags_imported_from_other_modules(tmp_path: Path) -> None:
    """A module without gate tokens that imports an architecture flag has gates."""
    inventory = scan(
        tmp_path,
        {
            "srt/layers/deep_gemm_wrapper/configurer.py": """
                from sglang.srt.environ import envs
                from sglang.srt.utils import get_device_sm, is_blackwell_supported

                def _compute_enable_deep_gemm():
                    sm_version = get_device_sm()
                    if sm_version < 90:
                        return False
                    try:
                        import deep_gemm
                    except ImportError:
                        return False
                    return envs.SGLANG_ENABLE_JIT_DEEPGEMM.get()

                ENABLE_JIT_DEEPGEMM = _compute_enable_deep_gemm()
                DEEPGEMM_BLACKWELL = ENABLE_JIT_DEEPGEMM and is_blackwell_supported()
            """,
            "srt/layers/deep_gemm_wrapper/__init__.py": """
                from .configurer import *
            """,
            "srt/layers/quantization/fp8_kernel.py": """
                from sglang.srt.layers import deep_gemm_wrapper
                from sglang.srt.layers.deep_gemm_wrapper.configurer import DEEPGEMM_BLACKWELL

                def matmul(c):
                    if deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM:
                        return 1
                    if DEEPGEMM_BLACKWELL:
                        return 2
            """,
        },
    )
    flag = only(inventory, "_compute_enable_deep_gemm()")
    assert flag.kind == "flag"
    assert answers(flag) == "FF?????"
    assert flag.archs["sm120"].to_json() == (
        "depends: envs.SGLANG_ENABLE_JIT_DEEPGEMM.get(), import deep_gemm"
    )
    use = only(inventory, "deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM")
    assert use.file == "python/sglang/srt/layers/quantization/fp8_kernel.py"
    assert answers(use) == "FF?????"
    assert answers(only(inventory, "DEEPGEMM_BLACKWELL")) == "FFF????"


def test_private_flag_imported_by_a_module_with_tokens(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/models/deepseek_common/utils.py": """
                from sglang.srt.utils import get_device_sm
                _device_sm = get_device_sm()
            """,
            "srt/models/deepseek_v2.py": """
                import torch
                from sglang.srt.models.deepseek_common.utils import _device_sm

                class Attention:
                    def __init__(self, w):
                        self.use_fused = w and 90 <= _device_sm < 120
                        self.cap = torch.cuda.get_device_capability()
            """,
        },
    )
    gate = only(inventory, "w and 90 <= _device_sm < 120")
    assert (gate.kind, gate.function) == ("assign", "Attention.__init__")
    assert answers(gate) == "FF???FF"


def test_parameters_take_the_callers_architecture_values(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/server_args.py": """
                import torch

                class ServerArgs:
                    def adjust(self):
                        major, _ = torch.cuda.get_device_capability()
                        self._set_default_nsa_kv_cache_dtype(major)

                    def _set_default_nsa_kv_cache_dtype(self, major):
                        if self.kv_cache_dtype == "auto":
                            self.kv_cache_dtype = "fp8_e4m3" if major >= 10 else "bfloat16"
            """
        },
    )
    gate = only(inventory, "major >= 10")
    assert (gate.kind, gate.function) == ("ternary", "ServerArgs._set_default_nsa_kv_cache_dtype")
    assert answers(gate) == "FFFTTTT"


def test_unknown_helper_of_the_family_is_a_gate_that_depends(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/new.py": """
                from sglang.srt.utils import is_sm130_supported_v2

                if is_sm130_supported_v2():
                    X = 1
            """
        },
    )
    gate = only(inventory, "is_sm130_supported_v2()")
    assert set(gate.archs.values()) == {Answer.depends("is_sm130_supported_v2()")}
    assert inventory.unknown_helpers == ("is_sm130_supported_v2",)


def test_helpers_added_in_0_5_23(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/new.py": """
                from sglang.test.test_utils import is_blackwell_system
                from sglang.srt.layers.attention.dsv4.v41_indexer import is_sm100_or_newer
                from sglang.srt.layers.moe.mega_moe_sm90 import is_sm90_fp8_mega_moe_available

                def f(experts):
                    if is_blackwell_system():
                        return 1
                    if is_sm100_or_newer():
                        return 2
                    if is_sm90_fp8_mega_moe_available(experts):
                        return 3
            """
        },
    )
    assert answers(only(inventory, "is_blackwell_system()")) == "FFFTTTT"
    assert answers(only(inventory, "is_sm100_or_newer()")) == "FFFTTTT"
    mega = only(inventory, "is_sm90_fp8_mega_moe_available(experts)")
    assert answers(mega) == "FF?FFFF"
    assert inventory.unknown_helpers == ()


def test_unparsable_files_become_problems(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/broken.py": "def f(:\n    is_sm100_supported()\n",
            "srt/fine.py": """
                from sglang.srt.utils import is_sm100_supported
                X = is_sm100_supported()
            """,
        },
    )
    assert conditions(inventory) == ["is_sm100_supported()"]
    assert [p.file for p in inventory.problems] == ["python/sglang/srt/broken.py"]
    assert "cannot parse" in inventory.problems[0].message


def test_parallel_scan_finds_the_same_gates(tmp_path: Path) -> None:
    from sm120fork.gates import scan_tree
    from test_gates_support import make_tree

    files = {f"srt/m{i}.py": HELPERS for i in range(120)}
    files["srt/reader.py"] = """
        from sglang.srt.m7 import FLAG_X
        if FLAG_X:
            pass
    """
    files["srt/m7.py"] = HELPERS + "\nFLAG_X = is_sm120_supported()\n"
    # a value that flows between modules in different shares
    files["srt/callee.py"] = "def tile(major):\n    return 256 if major >= 10 else 128\n"
    files["srt/caller.py"] = """
        import torch
        from sglang.srt.callee import tile
        def pick():
            return tile(torch.cuda.get_device_capability()[0])
    """
    root = make_tree(tmp_path, files)
    serial = scan_tree(root, workers=1)
    parallel = scan_tree(root, workers=2)
    assert [g.to_json() for g in serial.gates] == [g.to_json() for g in parallel.gates]
    assert answers(only(parallel, "FLAG_X")) == "FFFFFTT"
    assert answers(only(parallel, "major >= 10")) == "FFFTTTT"


def test_module_constants_and_imported_platform_probes(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "kernels/select.py": """
                import torch
                from sglang.srt.models.common import _is_cuda, _is_hip

                SUPPORTED_CUDA_ARCHS = {(9, 0), (10, 0)}
                BLOCKS = {9: 64, 10: 128}
                LIMIT = 100
                RESET = None

                def reset():
                    global RESET
                    RESET = 1

                def supported():
                    major, minor = torch.cuda.get_device_capability()
                    if (major, minor) in SUPPORTED_CUDA_ARCHS and _is_cuda:
                        return BLOCKS[major] >= 64
                    if _is_hip or major * 10 + minor >= LIMIT:
                        return True
                    if RESET is None and major == 12:
                        return False
            """
        },
    )
    assert answers(only(inventory, "(major, minor) in SUPPORTED_CUDA_ARCHS and _is_cuda")) == (
        "FFTTFFF"
    )
    blocks = only(inventory, "BLOCKS[major] >= 64")  # a per-major table
    assert answers(blocks) == "??TTT??"
    assert blocks.archs["sm120"].to_json() == "raises KeyError in BLOCKS[major]"
    assert answers(only(inventory, "_is_hip or major * 10 + minor >= LIMIT")) == "FFFTTTT"
    # RESET is rebound by a `global` statement: not a constant
    assert answers(only(inventory, "RESET is None and major == 12")) == "FFFFF??"


def test_a_parameter_is_architectural_only_if_every_call_says_so(tmp_path: Path) -> None:
    inventory = scan(
        tmp_path,
        {
            "srt/tiles.py": """
                import torch

                def pick(major):
                    if major >= 9:
                        return 128
                    return 64

                def first():
                    major, _ = torch.cuda.get_device_capability()
                    return pick(major)

                def second():
                    return pick(8)
            """
        },
    )
    assert inventory.gates == ()


def test_parameters_take_the_architecture_values_of_callers_in_other_modules(
    tmp_path: Path,
) -> None:
    """0.5.23 lora/utils.py: a module without gate tokens whose function is given
    the device's major by its callers elsewhere (by name, by keyword, through the
    module), and a class whose constructor is."""
    inventory = scan(
        tmp_path,
        {
            "srt/lora/utils.py": """
                def architecture_for_capability(major: int) -> str:
                    if major == 9:
                        return "sm90"
                    if major >= 10:
                        return "sm100"
                    return "default"
            """,
            "srt/lora/dense/runner.py": """
                import torch
                from sglang.srt.lora.utils import architecture_for_capability

                class DenseRunner:
                    def __init__(self, device):
                        major, _ = torch.cuda.get_device_capability(device)
                        self.architecture = architecture_for_capability(major)
            """,
            "srt/lora/moe/runner.py": """
                import torch
                from sglang.srt.lora import utils

                def build(device):
                    major, _ = torch.cuda.get_device_capability(device)
                    return utils.architecture_for_capability(major=major)
            """,
            "kernels/blocks.py": """
                class BlocksKernel:
                    def __init__(self, tile: int = 128, use_pdl: bool = False):
                        self.use_pdl = use_pdl

                    def launch(self):
                        return 2 if self.use_pdl else 1
            """,
            "kernels/interface.py": """
                from sglang.srt.utils import get_device_sm
                from sglang.kernels.blocks import BlocksKernel

                def compile_blocks():
                    return BlocksKernel(tile=64, use_pdl=get_device_sm() >= 90)
            """,
        },
    )
    gate = only(inventory, "major >= 10")
    assert (gate.file, gate.function) == (
        "python/sglang/srt/lora/utils.py",
        "architecture_for_capability",
    )
    assert answers(gate) == "FFFTTTT"
    assert answers(only(inventory, "major == 9")) == "FFTFFFF"
    assert answers(only(inventory, "self.use_pdl")) == "FFTTTTT"


def test_a_parameter_from_other_modules_needs_every_call_to_say_so(tmp_path: Path) -> None:
    """One caller passes the architecture, a test elsewhere a literal: no gate."""
    inventory = scan(
        tmp_path,
        {
            "srt/lora/utils.py": """
                def architecture_for_capability(major: int) -> str:
                    return "sm100" if major >= 10 else "default"
            """,
            "srt/lora/runner.py": """
                import torch
                from sglang.srt.lora.utils import architecture_for_capability

                def build(device):
                    major, _ = torch.cuda.get_device_capability(device)
                    return architecture_for_capability(major)
            """,
            "test/test_lora_plans.py": """
                from sglang.srt.lora.utils import architecture_for_capability

                def test_plans():
                    assert architecture_for_capability(9) == "default"
            """,
        },
    )
    assert conditions(inventory) == []


def test_a_mixin_reads_what_the_class_inheriting_it_assigns(tmp_path: Path) -> None:
    """0.5.23 dsa/dsa_backend_kpool.py: the mixin's `self.device_sm_major` is
    assigned by the backend class (another module) that inherits the mixin."""
    inventory = scan(
        tmp_path,
        {
            "srt/layers/attention/dsa/kpool.py": """
                class KPoolMixin:
                    def _resolve_tail_backend(self, impl):
                        if self.device_sm_major >= 10:
                            return "trtllm"
                        if self.device_sm_major == 9:
                            return "fa3"
                        return impl

                    def _schedule(self):
                        return self.page_major == 9
            """,
            "srt/layers/attention/dsa_backend.py": """
                from sglang.srt.layers.attention.dsa.kpool import KPoolMixin
                from sglang.srt.utils import get_device_capability

                class AttentionBackend:
                    pass

                class DsaBackend(AttentionBackend, KPoolMixin):
                    def __init__(self, page_major):
                        self.device_capability = get_device_capability()
                        self.device_sm_major = self.device_capability[0]
                        self.page_major = page_major
            """,
        },
    )
    gate = only(inventory, "self.device_sm_major >= 10")
    assert (gate.function, answers(gate)) == ("KPoolMixin._resolve_tail_backend", "FFFTTTT")
    assert answers(only(inventory, "self.device_sm_major == 9")) == "FFTFFFF"
    assert "self.page_major == 9" not in conditions(inventory)  # not architectural


def test_attributes_flow_along_inheritance_either_way(tmp_path: Path) -> None:
    """A subclass reads what its base (another module) assigns; within one
    module a base reads what every subclass assigns, if every one says so."""
    inventory = scan(
        tmp_path,
        {
            "srt/layers/base.py": """
                import torch

                class Base:
                    def __init__(self):
                        self.sm_major = torch.cuda.get_device_capability()[0]
            """,
            "srt/layers/kernels.py": """
                from sglang.srt.layers.base import Base

                class Kernel(Base):
                    def pick(self):
                        return "tcgen05" if self.sm_major == 10 else "mma"
            """,
            "srt/layers/local.py": """
                import torch

                class Mixin:
                    def wide(self):
                        if self.major >= 10:
                            return 256
                        return 128

                    def narrow(self):
                        if self.tiles > 2:
                            return 1

                class A(Mixin):
                    def __init__(self):
                        self.major = torch.cuda.get_device_capability()[0]
                        self.tiles = torch.cuda.get_device_capability()[0]

                class B(Mixin):
                    def __init__(self):
                        self.major = torch.cuda.get_device_capability()[0]
                        self.tiles = 4
            """,
        },
    )
    assert answers(only(inventory, "self.sm_major == 10")) == "FFFTTFF"
    assert answers(only(inventory, "self.major >= 10")) == "FFFTTTT"
    assert "self.tiles > 2" not in conditions(inventory)  # B assigns a literal
