"""Which MoE layer each sweep cell builds, and which cells share one forward dry run.

A cell of the MoE sweep (sm120fork.harness.moe_sweep) is decided at argument time;
its forward needs the layer its family builds: the keywords of the family's expert
constructor (``FusedMoE(...)`` / ``get_moe_impl_class(...)(...)``, found as the call
passing ``top_k`` and ``intermediate_size``) read from the model source, their
``config.X`` values read from the cell's config. A keyword whose value the source
computes (``self.gemm1_alpha``) is present with a stand-in value (``STAND_IN``): the
forward checks that the runner receives it, not its number. Families with another
real config of ``gatetable/models`` whose layer differs (Kimi-K3 with SiTU experts)
get a variant cell per such config. Standard library only.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from dataclasses import dataclass, replace
from typing import Any

from sm120fork.harness import moe_sweep
from sm120fork.harness.spec import MODELS_DIR

# Per-rank intermediate sizes tried for each expert format: real TP shards
# (Qwen3-30B-A3B 768/4 = 192, Nemotron-3-Nano 1856, ...) are not multiples of 128 or
# 256. Block FP8 keeps multiples of its 128-row block: sglang refuses other shards at
# load on every architecture (fp8.py create_weights), which is no SM12x decision.
SIZES: dict[str, tuple[int, ...]] = {
    "fp8": (128, 256, 384),
    "mxfp4": (128, 192, 256, 320),
}
DEFAULT_SIZES = (128, 192, 256, 320)
EXPERTS, HIDDEN, TOKENS = 8, 256, 5
STAND_IN = {"gemm1_alpha": 1.702, "gemm1_beta": 1.0, "gemm1_clamp_limit": 7.0, "swiglu_limit": 7.0}
_UNKNOWN = object()
LAYER_KEYS = ("activation", "is_gated", "with_bias", "apply_router_weight_on_input", "top_k")


@dataclass(frozen=True)
class Profile:
    """The MoE layer a family builds (the keywords of its expert constructor)."""

    activation: str = "silu"
    is_gated: bool = True
    with_bias: bool = False
    apply_router_weight_on_input: bool = False
    top_k: int = 2
    gemm1_alpha: float | None = None
    gemm1_beta: float | None = None
    gemm1_clamp_limit: float | None = None
    swiglu_limit: float | None = None

    def kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class ForwardCell:
    cell: moe_sweep.Cell
    name: str  # the sweep cell's name, plus "@<config>" for a variant
    profile: Profile
    sizes: tuple[int, ...]


def _config_value(config: dict[str, Any], key: str, default: Any = None) -> Any:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return text.get(key, config.get(key, default))


def _resolve(node: ast.expr, config: dict[str, Any], defaults: dict[str, Any] | None = None) -> Any:
    """A keyword's value: a literal, a config attribute, the enclosing function's
    default for a parameter passed on, or _UNKNOWN."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and defaults and node.id in defaults:
        return _resolve(defaults[node.id], config)
    if isinstance(node, ast.Attribute) and re.search(r"config$", ast.unparse(node.value)):
        return _config_value(config, node.attr)
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        if name in ("float", "bool", "int") and len(node.args) == 1:
            value = _resolve(node.args[0], config)
            return value if value is _UNKNOWN or value is None else eval(name)(value)
        if name == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            default = _resolve(node.args[2], config) if len(node.args) > 2 else None
            return _config_value(config, str(node.args[1].value), default)
    return _UNKNOWN


def _defaults(function: ast.FunctionDef) -> dict[str, Any]:
    args = function.args
    positional = args.args[len(args.args) - len(args.defaults) :]
    defaults = {a.arg: d for a, d in zip(positional, args.defaults)}
    return defaults | {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d}


@functools.lru_cache(maxsize=None)
def _expert_calls(text: str) -> list[tuple[ast.Call, dict[str, Any]]]:
    """Expert constructor calls in source order, each with the parameter defaults of
    its innermost enclosing function."""
    nodes = list(ast.walk(ast.parse(text)))
    functions = [n for n in nodes if isinstance(n, ast.FunctionDef)]
    found = []
    for node in nodes:
        if isinstance(node, ast.Call) and {"top_k", "intermediate_size"} <= {
            k.arg for k in node.keywords
        }:
            around = [
                f for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)
            ]
            inner = max(around, key=lambda f: f.lineno, default=None)
            found.append((node, _defaults(inner) if inner else {}))
    found.sort(key=lambda pair: (pair[0].lineno, pair[0].col_offset))
    return found


def _index(texts: dict[str, str]) -> dict[str, list[str]]:
    """class name -> the module defining it (first by name) and the sglang model
    modules that module imports."""
    index: dict[str, list[str]] = {}
    for name in sorted(texts):
        imported = re.findall(r"from sglang\.srt\.models\.(\w+) import", texts[name])
        sources = [texts[name], *(texts[other] for other in imported if other in texts)]
        for cls in re.findall(r"^class (\w+)\b", texts[name], re.M):
            index.setdefault(cls, sources)
    return index


def _config_activation(config: dict[str, Any]) -> str:
    """As sm120-moe-runner-fit reads the expert activation, plus Nemotron-H's key."""
    for key in ("moe_activation", "hidden_act", "hidden_activation", "mlp_hidden_act"):
        value = _config_value(config, key)
        if isinstance(value, str):
            return value
    return "silu"


def profile(config: dict[str, Any], sources: list[str]) -> Profile:
    """The layer the first expert constructor of `sources` builds for `config`."""
    calls = [call for text in sources for call in _expert_calls(text)]
    call, defaults = calls[0] if calls else (None, {})
    keywords = {k.arg: k.value for k in call.keywords if k.arg} if call else {}
    values: dict[str, Any] = {}
    for key, node in keywords.items():
        values[key] = _resolve(node, config, defaults)
    activation = values.get("activation", _UNKNOWN)
    if not isinstance(activation, str):
        activation = _config_activation(config)
    top_k = values.get("top_k")
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        top_k = _config_value(config, "num_experts_per_tok", 2)
    out: dict[str, Any] = {
        "activation": activation,
        "top_k": 1 if top_k == 1 else 2,  # one expert or several is what runners tell apart
    }
    for key in ("is_gated", "with_bias", "apply_router_weight_on_input"):
        value = values.get(key, _UNKNOWN)
        if isinstance(value, bool):
            out[key] = value
    for key, stand_in in STAND_IN.items():
        value = values.get(key)
        if value is _UNKNOWN:
            out[key] = stand_in
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    if "is_gated" not in out:
        out["is_gated"] = activation not in ("relu2", "relu2_no_mul")
    return Profile(**out)


def _texts() -> dict[str, str]:
    return {p.stem: p.read_text(encoding="utf-8") for p in (moe_sweep.SRT / "models").glob("*.py")}


@functools.lru_cache(maxsize=None)
def _real_configs(architecture: str) -> list[str]:
    found = []
    for path in sorted(MODELS_DIR.glob("*/config.json")):
        if architecture in (json.loads(path.read_text()).get("architectures") or []):
            found.append(path.parent.name)
    return found


def forward_cells() -> tuple[ForwardCell, ...]:
    """Every sweep cell, then a variant per other real config whose layer differs."""
    index = _index(_texts())
    out: list[ForwardCell] = []
    for cell in moe_sweep.cells():
        config = moe_sweep._config(cell.family, cell.fmt)
        sources = index.get(cell.family.architecture, [])
        prof = profile(config, sources)
        sizes = SIZES.get(cell.fmt, DEFAULT_SIZES)
        out.append(ForwardCell(cell, cell.name, prof, sizes))
        if cell.family.base is None:
            continue
        for other in _real_configs(cell.family.architecture):
            family = replace(cell.family, base=other)
            variant = profile(moe_sweep._config(family, cell.fmt), sources)
            if other != cell.family.base and variant != prof:
                name = f"{cell.name}@{other}"
                out.append(ForwardCell(moe_sweep.Cell(family, cell.fmt, cell.forced), name, variant, sizes))
    return tuple(out)
