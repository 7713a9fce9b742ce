"""The MoE sweep (issue 28): every MoE architecture of the tested sglang, in every
expert format, on every faked architecture, each cell one decision.

The families are read from the vendored tree, not listed: every class a
``srt/models/*.py`` module that builds fused experts exports as ``EntryClass``, and
every architecture a model override (``model_overrides/*.py``, ``_register_for``)
names; crossed with the expert formats (``FORMATS``) and the SM100-only runners a user
can force (``FORCED``). A cell's config is its family's real one of ``gatetable/models/``
(or a sibling's, see ``_base``; quantization replaced), else a synthetic Mixtral-shaped
one (``SYNTHETIC_BASE``): the MoE decision reads the architecture, the model source
and the quantization, not the shapes. Standard library only.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spec import MODELS_DIR, VENDOR_PYTHON, Scenario

SRT = VENDOR_PYTHON / "sglang" / "srt"
# A models/ module that builds fused experts names one of these.
MOE_MARKERS = re.compile(r"\b(FusedMoE|get_moe_impl_class|EPMoE|DeepEPMoE|FlashInferFusedMoE)\b")

_NVFP4_GROUP = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
_CT_GROUP = {**_NVFP4_GROUP, "strategy": "tensor_group", "symmetric": True}
# expert format -> the quantization_config a checkpoint of it ships (None: bf16)
FORMATS: dict[str, dict[str, Any] | None] = {
    "bf16": None,
    "fp8": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "nvfp4": {  # NVIDIA ModelOpt (gatetable/models/glm4_moe_nvfp4)
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "config_groups": {"group_0": {"weights": _NVFP4_GROUP, "input_activations": _NVFP4_GROUP}},
        "ignore": ["lm_head"],
    },
    "nvfp4_ct": {  # llm-compressor (gatetable/models/llama4_scout_nvfp4_ct)
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "format": "nvfp4-pack-quantized",
                "targets": ["Linear"],
                "weights": _CT_GROUP,
                "input_activations": {**_CT_GROUP, "dynamic": "local"},
            }
        },
        "ignore": ["re:.*lm_head"],
        "quantization_status": "compressed",
    },
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]},
    "mxfp8": {  # gatetable/models/minimax_m3_mxfp8
        "quant_method": "mxfp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [1, 32],
        "scale_fmt": "ue8m0",
    },
}
# SM100-only runners a user can force (--moe-runner-backend), each with the format it
# serves upstream: flashinfer 0.7.2 fused_moe/cute_dsl/fused_moe.py
# supported_compute_capability([100, 103, 107]); trtllm-gen cubins are SM100-family only.
FORCED = dict.fromkeys(
    ("flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutedsl"), "nvfp4"
)

SYNTHETIC_BASE: dict[str, Any] = {
    "model_type": "mixtral",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    # MLA fields, read by the MLA families' attention defaults (unused by the others)
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "layer_types": ["full_attention", "full_attention"],
}


@dataclass(frozen=True)
class Family:
    architecture: str
    source: str  # "models/x.py", "override:x.py" or both, joined by " + "
    base: str | None  # the real config of gatetable/models it derives from, None: synthetic
    router_on_input: bool = False  # its experts scale the input by the router weight
    with_bias: bool = False  # its experts have GEMM biases (GPT-OSS)


@dataclass(frozen=True)
class Cell:
    family: Family
    fmt: str
    forced: str | None  # a forced --moe-runner-backend, None: auto

    @property
    def name(self) -> str:
        tail = f"{self.fmt}+{self.forced}" if self.forced else self.fmt
        return f"sweep:{self.family.architecture}:{tail}"


def _entry_classes(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets
        ):
            value = node.value
            values = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
            return [v.id for v in values if isinstance(v, ast.Name)]
    return []


def _registered(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_register_for":
            names += [a.value for a in node.args if isinstance(a, ast.Constant)]
    return [n for n in names if isinstance(n, str)]


def _real_bases(models_dir: Path = MODELS_DIR) -> dict[str, str]:
    """architecture -> the first (by name) real config of gatetable/models declaring it."""
    found: dict[str, str] = {}
    for config in sorted(models_dir.glob("*/config.json")):
        for arch in json.loads(config.read_text()).get("architectures") or []:
            found.setdefault(arch, config.parent.name)
    return found


def families(srt: Path = SRT, models_dir: Path = MODELS_DIR) -> tuple[Family, ...]:
    """Every MoE architecture of the tree and every overridden one, sorted."""
    sources: dict[str, list[str]] = {}
    for path in sorted((srt / "models").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if MOE_MARKERS.search(text):
            for arch in _entry_classes(ast.parse(text)):
                sources.setdefault(arch, []).append(f"models/{path.name}")
    for path in sorted((srt / "arg_groups" / "model_overrides").glob("*.py")):
        for arch in _registered(ast.parse(path.read_text(encoding="utf-8"))):
            sources.setdefault(arch, []).append(f"override:{path.name}")
    bases = _real_bases(models_dir)
    texts = {p.stem: p.read_text(encoding="utf-8") for p in (srt / "models").glob("*.py")}
    return tuple(
        Family(
            arch,
            " + ".join(dict.fromkeys(where)),
            _base(arch, where, sources, bases),
            _built_with(arch, texts, "apply_router_weight_on_input"),
            _built_with(arch, texts, "with_bias"),
        )
        for arch, where in sorted(sources.items())
    )


def _built_with(arch: str, texts: dict[str, str], keyword: str) -> bool:
    """Whether the module defining the class, or a sglang model module it imports,
    builds experts with `keyword`=True (Llama 4: apply_router_weight_on_input)."""
    defines = re.compile(rf"^class {re.escape(arch)}\b", re.M)
    for text in texts.values():
        if defines.search(text):
            imported = re.findall(r"from sglang\.srt\.models\.(\w+) import", text)
            sources = [text, *(texts[name] for name in imported if name in texts)]
            return any(re.search(rf"\b{keyword}\s*=\s*True", t) for t in sources)
    return False


def _base(
    arch: str, where: list[str], sources: dict[str, list[str]], bases: dict[str, str]
) -> str | None:
    """Its own real config; else a sibling's: an architecture its name extends (an MTP or
    variant class), then one sharing its override or model module; else None."""
    if arch in bases:
        return bases[arch]
    for other in sorted(bases, key=len, reverse=True):
        if arch.startswith(other):
            return bases[other]
    for module in sorted(where, key=lambda w: not w.startswith("override:")):
        for other in sorted(sources):
            if other in bases and module in sources[other]:
                return bases[other]
    return None


def cells(found: tuple[Family, ...] | None = None) -> tuple[Cell, ...]:
    found = families() if found is None else found
    out = [Cell(f, fmt, None) for f in found for fmt in FORMATS]
    out += [Cell(f, fmt, runner) for f in found for runner, fmt in FORCED.items()]
    return tuple(out)


def _config(family: Family, fmt: str) -> dict[str, Any]:
    if family.base is None:
        config = {**SYNTHETIC_BASE, "architectures": [family.architecture]}
    else:
        config = json.loads((MODELS_DIR / family.base / "config.json").read_text())
        config["architectures"] = [family.architecture]
        config.pop("quantization_config", None)
        if isinstance(config.get("text_config"), dict):
            config["text_config"].pop("quantization_config", None)
    if FORMATS[fmt] is not None:
        config["quantization_config"] = FORMATS[fmt]
    return config


def scenarios(chosen: tuple[Cell, ...], where: Path) -> list[Scenario]:
    """One scenario per cell, its config written under ``where`` (absolute model paths)."""
    out = []
    for cell in chosen:
        folder = where / re.sub(r"[^A-Za-z0-9_.+-]", "_", cell.name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(_config(cell.family, cell.fmt), indent=1))
        args = {"moe_runner_backend": cell.forced} if cell.forced else {}
        probes = ("nvfp4_moe",) if cell.fmt == "nvfp4" else ()
        out.append(Scenario(cell.name, str(folder.resolve()), args, probes))
    return out


# What ends an SM12x cell well: a runner with SM12x kernels for the format. auto: the
# load-time method decides (ModelOpt NVFP4: probe `nvfp4_moe`, one of NVFP4_LOAD_RUNNERS;
# compressed-tensors NVFP4: CUTLASS unless trtllm is asked for, use_flashinfer_trtllm in
# compressed_tensors_w4a4_nvfp4_moe.py). flashinfer 0.7.2 jit/fused_moe.py
# gen_cutlass_fused_moe_sm120_module builds CUTLASS MoE with ENABLE_BF16/FP8/FP4; triton,
# triton_kernel are Triton; Fp8MoEMethod runs triton_kernel on triton (fp8.py "has no %s
# path"); marlin and flashinfer_b12x are SM12x builds (sm120-b12x-moe-runner.patch).
SM12X_RUNNERS: dict[str, frozenset[str]] = {
    "bf16": frozenset({"auto", "triton", "triton_kernel", "flashinfer_cutlass"}),
    "fp8": frozenset({"auto", "triton", "deep_gemm", "triton_kernel", "flashinfer_cutlass"}),
    "nvfp4": frozenset({"auto", "flashinfer_cutlass", "flashinfer_b12x", "marlin"}),
    "nvfp4_ct": frozenset({"auto", "flashinfer_cutlass", "marlin"}),
    "mxfp4": frozenset({"auto", "triton_kernel", "flashinfer_mxfp4", "marlin"}),
    "mxfp8": frozenset({"triton"}),
}
# Families whose experts are one format whatever the checkpoint declares: DeepSeek V4
# ships FP4 (MXFP4) experts, and its override picks flashinfer_mxfp4 for them
# (model_overrides/deepseek_v4.py), SM120's CUTLASS MXFP4 MoE (mxfp4.py: cutlass_sm120).
FIXED_EXPERTS = {"DeepseekV4ForCausalLM": "mxfp4"}
NVFP4_LOAD_RUNNERS = frozenset({"flashinfer_cutlass", "flashinfer_b12x", "marlin"})
LOAD_FIELD = "modelopt_quant.nvfp4_moe_runner_backend"
# NVFP4 runners without apply_router_weight_on_input: flashinfer_cutlass asserts on it
# (modelopt_quant.py, compressed_tensors_w4a4_nvfp4_moe.py); marlin ignores it.
ROUTER_BLIND = frozenset({"flashinfer_cutlass", "marlin"})
# Formats whose MoE method creates no w13_weight_bias (ModelOpt and compressed-tensors
# NVFP4; fp8.py, mxfp4.py do), so biases are dropped: a biased family must be refused.
BIASLESS = frozenset({"nvfp4", "nvfp4_ct"})

# Findings not yet fixed: cell name -> what happens (test_moe_sweep expects a failure).
KNOWN_WRONG: dict[str, str] = {}


def verdict(cell: Cell, obs: Mapping[str, Any] | None) -> str | None:
    """None when an SM12x cell ends in a runner with SM12x kernels for its format or a
    one-line ValueError naming a flag or variable; else what went wrong."""
    if obs is None:
        return "not observed"
    error = obs.get("error")
    if error is not None:
        text = str(error)
        if (
            text.startswith("ValueError: ")
            and "\n" not in text
            and re.search(r"--[a-z][a-z-]+|SGLANG_[A-Z_]+", text)
        ):
            return None
        return f"not a clear refusal: {text[:300]}"
    runner = obs.get("moe_runner_backend")
    fmt = FIXED_EXPERTS.get(cell.family.architecture, cell.fmt)
    if runner not in SM12X_RUNNERS[fmt]:
        return f"moe_runner_backend {runner!r} has no SM12x {fmt} MoE kernels"
    if fmt == "nvfp4" and runner == "auto":
        runner = obs.get(LOAD_FIELD)
        if runner not in NVFP4_LOAD_RUNNERS:
            return f"auto resolves at load to {runner!r}, not an SM12x NVFP4 runner"
    if fmt == "nvfp4_ct" and runner == "auto":
        runner = "flashinfer_cutlass"  # the method's CUTLASS path unless trtllm is asked for
    if fmt.startswith("nvfp4") and cell.family.router_on_input and runner in ROUTER_BLIND:
        return f"{runner} cannot apply the router weight on the input ({cell.family.source})"
    if fmt in BIASLESS and cell.family.with_bias:
        return f"{fmt} experts would drop the biases of {cell.family.source}"
    return None
