"""Select and validate MoE LoRA plans and their launch tiles."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from typing import Any, Literal, Mapping

import pydantic
from pydantic.dataclasses import dataclass as pydantic_dataclass

from sglang.kernels.ops.lora.moe.activation import ActivationFn
from sglang.srt.lora.utils import Phase

logger = logging.getLogger(__name__)

_STRICT = pydantic.ConfigDict(strict=True, extra="forbid")


class Site(str, Enum):
    GATE_UP = "gate_up"
    DOWN = "down"


class BridgeLayout(str, Enum):
    PAIR_MAJOR = "pair_major"
    TOKEN_MAJOR = "token_major"


class RouteRequirement(str, Enum):
    RAW_PER_EXPERT = "raw_per_expert"
    RAW_SHARED_OUTER = "raw_shared_outer"
    ALIGNED_PER_EXPERT = "aligned_per_expert"
    ALIGNED_SHARED_OUTER = "aligned_shared_outer"
    SHARED_TOKEN_PLAN = "shared_token_plan"


class RouteBuilderFamily(str, Enum):
    STANDARD = "standard"
    # Build the shared route on the workspace side stream.
    PARALLEL_SHARED_OUTER = "parallel_shared_outer"


class AFamily(str, Enum):
    GROUPED = "grouped"
    PER_ROW = "per_row"
    TOKEN_GROUPED = "token_grouped"
    # Shared gate/up A writes one token-domain bridge plane per adapter slot.
    TOKEN_DENSE = "token_dense"


class BFamily(str, Enum):
    GROUPED = "grouped"
    PER_ROW = "per_row"


class ActFamily(str, Enum):
    MATERIALIZED = "materialized"
    B_ACTIVATION = "b_activation"


class FinalizeFamily(str, Enum):
    MATERIALIZED = "materialized"
    # Reduce in rank space before expanding the shared B once per token.
    SHARED_TOKEN_DELTA = "shared_token_delta"
    # Fuse the rank reduction, B expansion, and base reduction.
    SHARED_ONE_PASS = "shared_one_pass"


class GateUpOverlap(str, Enum):
    NONE = "none"
    GATE_UP_A = "gate_up_a"
    GATE_UP_A_B = "gate_up_a_b"


class DownOverlap(str, Enum):
    NONE = "none"
    DOWN_A = "down_a"
    DOWN_A_B = "down_a_b"


def _raw_requirement(is_shared_outer: bool) -> RouteRequirement:
    if is_shared_outer:
        return RouteRequirement.RAW_SHARED_OUTER
    return RouteRequirement.RAW_PER_EXPERT


def _aligned_requirement(is_shared_outer: bool) -> RouteRequirement:
    if is_shared_outer:
        return RouteRequirement.ALIGNED_SHARED_OUTER
    return RouteRequirement.ALIGNED_PER_EXPERT


def _check_down_bridge_layout(site: Site, layout: BridgeLayout) -> None:
    if site is Site.DOWN and layout is BridgeLayout.TOKEN_MAJOR:
        raise ValueError(
            "the down bridge is inherently pair-major: each routed expert "
            "produces a different activation"
        )


@pydantic_dataclass(frozen=True, slots=True, config=_STRICT)
class ASpec:
    site: Site
    family: AFamily
    is_shared_outer: bool = False
    output_layout: BridgeLayout = BridgeLayout.PAIR_MAJOR

    def __post_init__(self) -> None:
        _check_down_bridge_layout(self.site, self.output_layout)
        if self.family in (AFamily.GROUPED, AFamily.PER_ROW):
            if self.output_layout is not BridgeLayout.PAIR_MAJOR:
                raise ValueError(f"{self.family.value} A writes a pair-major bridge")
        else:
            if self.site is not Site.GATE_UP:
                raise ValueError(f"{self.family.value} is a shared gate/up-A family")
            if not self.is_shared_outer:
                raise ValueError(
                    f"{self.family.value} requires shared-outer A ownership"
                )
            if self.output_layout is not BridgeLayout.TOKEN_MAJOR:
                raise ValueError(f"{self.family.value} writes a token-major bridge")

    def route_requirements(self) -> frozenset[RouteRequirement]:
        if self.family in (
            AFamily.PER_ROW,
            AFamily.TOKEN_DENSE,
        ):
            return frozenset((_raw_requirement(self.is_shared_outer),))
        if self.family is AFamily.TOKEN_GROUPED:
            return frozenset((RouteRequirement.SHARED_TOKEN_PLAN,))
        return frozenset((_aligned_requirement(self.is_shared_outer),))


@pydantic_dataclass(frozen=True, slots=True, config=_STRICT)
class BSpec:
    site: Site
    family: BFamily
    is_shared_outer: bool = False
    input_layout: BridgeLayout = BridgeLayout.PAIR_MAJOR

    def __post_init__(self) -> None:
        _check_down_bridge_layout(self.site, self.input_layout)

    def route_requirements(self) -> frozenset[RouteRequirement]:
        if self.family is BFamily.PER_ROW:
            return frozenset((_raw_requirement(self.is_shared_outer),))
        return frozenset((_aligned_requirement(self.is_shared_outer),))


@pydantic_dataclass(frozen=True, slots=True, config=_STRICT)
class ActSpec:
    """B_ACTIVATION owns gate/up B and consumes the A bridge."""

    family: ActFamily
    activation: ActivationFn

    def route_requirements(self) -> frozenset[RouteRequirement]:
        if self.family is not ActFamily.B_ACTIVATION:
            return frozenset()
        return frozenset((_aligned_requirement(False),))


@pydantic_dataclass(frozen=True, slots=True, config=_STRICT)
class FinalizeSpec:
    family: FinalizeFamily
    is_shared_outer: bool = False

    def __post_init__(self) -> None:
        if (
            self.family
            in (FinalizeFamily.SHARED_TOKEN_DELTA, FinalizeFamily.SHARED_ONE_PASS)
            and not self.is_shared_outer
        ):
            raise ValueError(
                f"{self.family.value} requires shared-outer down-B ownership"
            )

    def route_requirements(self) -> frozenset[RouteRequirement]:
        if self.family is FinalizeFamily.MATERIALIZED:
            return frozenset()
        if self.family is FinalizeFamily.SHARED_TOKEN_DELTA:
            return frozenset(
                (
                    _raw_requirement(self.is_shared_outer),
                    RouteRequirement.SHARED_TOKEN_PLAN,
                )
            )
        return frozenset((_raw_requirement(self.is_shared_outer),))


@pydantic_dataclass(frozen=True, slots=True, kw_only=True, config=_STRICT)
class MoePlan:
    gate_up_a: ASpec
    gate_up_b: BSpec | None = None
    act: ActSpec
    down_a: ASpec
    down_b: BSpec | None = None
    finalize: FinalizeSpec
    gate_up_overlap: GateUpOverlap = GateUpOverlap.NONE
    down_overlap: DownOverlap = DownOverlap.NONE
    down_b_into_base: bool = False
    route_builder: RouteBuilderFamily = RouteBuilderFamily.STANDARD

    def __post_init__(self) -> None:
        if self.gate_up_a.site is not Site.GATE_UP:
            raise ValueError("gate_up_a must describe the gate/up site")
        if self.gate_up_b is not None and self.gate_up_b.site is not Site.GATE_UP:
            raise ValueError("gate_up_b must describe the gate/up site")
        if self.down_a.site is not Site.DOWN:
            raise ValueError("down_a must describe the down site")
        if self.down_b is not None and self.down_b.site is not Site.DOWN:
            raise ValueError("down_b must describe the down site")

        gate_up_b_consumed = self.act.family is ActFamily.B_ACTIVATION
        if gate_up_b_consumed == (self.gate_up_b is not None):
            raise ValueError(
                "gate/up B must have exactly one owner: standalone gate_up_b or the act stage"
            )
        down_b_consumed = self.finalize.family is not FinalizeFamily.MATERIALIZED
        if down_b_consumed == (self.down_b is not None):
            raise ValueError(
                "down B must have exactly one owner: standalone down_b or finalize"
            )

        # Fused consumers inherit A's layout; standalone B must match it.
        if (
            self.gate_up_b is not None
            and self.gate_up_a.output_layout is not self.gate_up_b.input_layout
        ):
            raise ValueError(
                "gate/up A output layout must match the gate/up B input layout"
            )
        if (
            self.down_b is not None
            and self.down_a.output_layout is not self.down_b.input_layout
        ):
            raise ValueError("down A output layout must match the down B input layout")
        if self.gate_up_a.family is AFamily.TOKEN_DENSE and (
            self.gate_up_b is None or self.gate_up_b.family is not BFamily.PER_ROW
        ):
            raise ValueError(
                "token_dense A writes one bridge plane per adapter slot; only a "
                "standalone per_row gate/up B selects planes"
            )

        if self.gate_up_overlap is GateUpOverlap.GATE_UP_A_B and self.gate_up_b is None:
            raise ValueError(
                "gate/up-A+B overlap requires standalone gate/up B; the act stage owns it"
            )
        if self.down_overlap is DownOverlap.DOWN_A_B and self.down_b is None:
            raise ValueError(
                f"{self.down_overlap.value} overlap requires standalone down B"
            )

        # In-place B must wait for the base down GEMM to finish writing.
        if self.down_b_into_base and not (
            self.down_b is not None
            and self.down_overlap in (DownOverlap.NONE, DownOverlap.DOWN_A)
        ):
            raise ValueError(
                "down-B into-base requires a standalone down-B stage and no "
                "late overlap window (it read-modify-writes the base down "
                "output)"
            )

    def route_requirements(self) -> frozenset[RouteRequirement]:
        requirements: set[RouteRequirement] = set()
        for stage in (
            self.gate_up_a,
            self.gate_up_b,
            self.act,
            self.down_a,
            self.finalize,
        ):
            if stage is not None:
                requirements.update(stage.route_requirements())
        if self.down_b is not None:
            # The in-place B kernel replaces the selected family with aligned rows.
            if self.down_b_into_base:
                requirements.add(_aligned_requirement(self.down_b.is_shared_outer))
            else:
                requirements.update(self.down_b.route_requirements())
        return frozenset(requirements)


def _a_default() -> dict[str, int]:
    return {
        "BLOCK_SIZE_N": 32,
        "BLOCK_SIZE_K": 64,
        "GROUP_SIZE_M": 8,
        "num_warps": 4,
        "num_stages": 2,
    }


def _b_default() -> dict[str, int]:
    return {
        "BLOCK_SIZE_M": 16,
        "BLOCK_SIZE_N": 64,
        "BLOCK_SIZE_K": 32,
        "GROUP_SIZE_M": 8,
        "num_warps": 4,
        "num_stages": 2,
    }


def _b_act_default() -> dict[str, int]:
    return {
        "BLOCK_SIZE_W": 64,
        "BLOCK_SIZE_K": 32,
        "GROUP_SIZE_M": 8,
        "num_warps": 4,
        "num_stages": 3,
    }


def _shared_token_delta_default() -> dict[str, dict[str, int]]:
    return {
        "reduce": {"BLOCK_SIZE_T": 32, "num_warps": 4, "num_stages": 2},
        "tail": {"BLOCK_SIZE_H": 128, "num_warps": 4, "num_stages": 3},
    }


def _shared_one_pass_default() -> dict[str, int]:
    return {"BLOCK_SIZE_H": 128, "num_warps": 4, "num_stages": 3}


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _validate_flat_config(
    name: str, config: Mapping[str, int], allowed: frozenset[str]
) -> None:
    if not config:
        raise ValueError(f"{name} must be a non-empty launch-config mapping")
    unknown = set(config) - allowed
    if unknown:
        raise ValueError(f"{name} has unknown launch keys: {sorted(unknown)}")
    required = allowed - {"GROUP_SIZE_M", "BLOCK_SIZE_M", "SPLIT_K"}
    missing = required - set(config)
    if missing:
        raise ValueError(f"{name} is missing launch keys: {sorted(missing)}")
    for key, value in config.items():
        if value <= 0:
            raise ValueError(f"{name}.{key} must be positive")
        if (
            key.startswith("BLOCK_SIZE_") or key in ("num_warps", "SPLIT_K")
        ) and not _is_power_of_two(value):
            raise ValueError(f"{name}.{key} must be a power of two")


_GEMM_LAUNCH_KEYS = frozenset(
    ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
)


@pydantic_dataclass(frozen=True, slots=True, kw_only=True, config=_STRICT)
class MoeLoraLaunchConfig:
    """Per-site Triton launch configs of one plan row."""

    # Shared row tile for aligned LoRA kernels; independent of base-GEMM tiles.
    routing_block_size: int = 16
    gate_up_a: dict[str, int] = field(default_factory=_a_default)
    gate_up_b: dict[str, int] = field(default_factory=_b_default)
    down_a: dict[str, int] = field(default_factory=_a_default)
    down_b: dict[str, int] = field(default_factory=_b_default)
    b_activation: dict[str, int] = field(default_factory=_b_act_default)
    shared_token_delta: dict[str, dict[str, int]] = field(
        default_factory=_shared_token_delta_default
    )
    shared_one_pass: dict[str, int] = field(default_factory=_shared_one_pass_default)

    def __post_init__(self) -> None:
        # tl.dot requires a power-of-two row tile of at least 16.
        if (
            not _is_power_of_two(self.routing_block_size)
            or self.routing_block_size < 16
        ):
            raise ValueError("routing_block_size must be a power of two >= 16")
        # MoE consumes the combined shrink output, so split-K is serial.
        for name in ("gate_up_a", "down_a"):
            _validate_flat_config(
                name, getattr(self, name), _GEMM_LAUNCH_KEYS | {"SPLIT_K"}
            )
        for name in ("gate_up_b", "down_b"):
            _validate_flat_config(
                name, getattr(self, name), _GEMM_LAUNCH_KEYS | {"BLOCK_SIZE_M"}
            )
        _validate_flat_config(
            "b_activation",
            self.b_activation,
            (_GEMM_LAUNCH_KEYS - {"BLOCK_SIZE_N"}) | {"BLOCK_SIZE_W"},
        )
        # Grouped B takes its row tile from the route, not its config section.
        for name in ("gate_up_b", "down_b"):
            declared = getattr(self, name).get("BLOCK_SIZE_M")
            if declared is not None and int(declared) != self.routing_block_size:
                raise ValueError(
                    f"{name} declares BLOCK_SIZE_M={declared}, but the aligned "
                    f"route uses routing_block_size={self.routing_block_size}"
                )
        if set(self.shared_token_delta) != {"reduce", "tail"}:
            raise ValueError(
                "shared_token_delta must contain exactly 'reduce' and 'tail'"
            )
        for name, tile_key in (("reduce", "BLOCK_SIZE_T"), ("tail", "BLOCK_SIZE_H")):
            _validate_flat_config(
                f"shared_token_delta.{name}",
                self.shared_token_delta[name],
                frozenset((tile_key, "num_warps", "num_stages")),
            )
        _validate_flat_config(
            "shared_one_pass",
            self.shared_one_pass,
            frozenset(("BLOCK_SIZE_H", "num_warps", "num_stages")),
        )

    def for_a(self, site: Site) -> Mapping[str, int]:
        return self.gate_up_a if site is Site.GATE_UP else self.down_a

    def for_b(self, site: Site) -> Mapping[str, int]:
        return self.gate_up_b if site is Site.GATE_UP else self.down_b

    def for_act(self, family: ActFamily) -> Mapping[str, int]:
        if family is ActFamily.B_ACTIVATION:
            return self.b_activation
        raise ValueError(f"{family.value} has no fused-act launch config")


class TileTable:
    """Launch configs of one bound plan row, picked per forward by token count."""

    def __init__(self, rules: list[tuple[int, MoeLoraLaunchConfig]]) -> None:
        self._rules = rules

    def config_for(self, num_tokens: int) -> MoeLoraLaunchConfig:
        for bound, config in self._rules:
            if num_tokens <= bound:
                return config
        return self._rules[-1][1]


def _validate_plan_launch_config(plan: MoePlan, config: MoeLoraLaunchConfig) -> None:
    dot_sites = {}
    for name, spec in (("gate_up_a", plan.gate_up_a), ("down_a", plan.down_a)):
        if spec.family in (AFamily.GROUPED, AFamily.TOKEN_GROUPED):
            dot_sites[name] = ("BLOCK_SIZE_N", "BLOCK_SIZE_K")
        if (
            spec.family is AFamily.TOKEN_GROUPED
            and getattr(config, name).get("SPLIT_K", 1) > 1
        ):
            raise ValueError(f"{name} token_grouped does not provide split-K scratch")
    for name, spec in (("gate_up_b", plan.gate_up_b), ("down_b", plan.down_b)):
        if spec is not None and spec.family is BFamily.GROUPED:
            dot_sites[name] = ("BLOCK_SIZE_N",)
    if plan.act.family is ActFamily.B_ACTIVATION:
        dot_sites["b_activation"] = ("BLOCK_SIZE_W", "BLOCK_SIZE_K")
    if plan.down_b_into_base:
        dot_sites["down_b"] = ("BLOCK_SIZE_N", "BLOCK_SIZE_K")
    elif plan.finalize.family is FinalizeFamily.SHARED_TOKEN_DELTA:
        dot_sites["down_b"] = ("BLOCK_SIZE_N",)
    for name, tile_keys in sorted(dot_sites.items()):
        tiles = getattr(config, name)
        if "GROUP_SIZE_M" not in tiles:
            raise ValueError(f"{name} requires GROUP_SIZE_M for its selected consumer")
        for key in tile_keys:
            if tiles[key] < 16:
                raise ValueError(
                    f"{name}.{key} must be at least 16 for its selected consumer"
                )


class _PlanSpecModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    gate_up_a_family: AFamily = AFamily.GROUPED
    down_a_family: AFamily = AFamily.GROUPED
    gate_up_b_family: BFamily = BFamily.GROUPED
    down_b_family: BFamily = BFamily.GROUPED
    act_family: ActFamily = ActFamily.MATERIALIZED
    finalize_family: FinalizeFamily = FinalizeFamily.MATERIALIZED
    gate_up_overlap: GateUpOverlap = GateUpOverlap.NONE
    down_overlap: DownOverlap = DownOverlap.NONE
    route_builder: RouteBuilderFamily = RouteBuilderFamily.STANDARD
    down_b_into_base: bool = False


class _TileRuleModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    max_rank: int | None = pydantic.Field(default=None, gt=0)
    max_tokens: int | None = pydantic.Field(default=None, gt=0)
    sites: dict[str, Any] = pydantic.Field(default_factory=dict)


class _PlanRowModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str
    layout: Literal["per_expert", "shared"] | None = None
    phase: Phase | None = None
    max_rank: int | None = None
    min_local_experts: int | None = None
    max_local_experts: int | None = None
    quant: list[str] | None = None
    base_gemm_rows: Literal["expert_major", "route_major"]
    plan: _PlanSpecModel
    # Rank rules precede token buckets; an unbounded rule ends the ladder.
    # Tiles are required. Use {"sites": {}} to select defaults explicitly.
    tiles: list[_TileRuleModel] = pydantic.Field(min_length=1)


class _DomainModel(pydantic.BaseModel):
    """Geometry covered by the tuned scenario rows."""

    model_config = pydantic.ConfigDict(extra="forbid")

    max_hidden: int | None = None
    max_local_experts: int | None = None

    def admits(self, *, hidden_size: int, num_local_experts: int) -> bool:
        return (self.max_hidden is None or hidden_size <= self.max_hidden) and (
            self.max_local_experts is None
            or num_local_experts <= self.max_local_experts
        )


class _PlansFileModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    domain: _DomainModel = pydantic.Field(default_factory=_DomainModel)
    scenarios: list[_PlanRowModel] = pydantic.Field(default_factory=list)
    fallback: list[_PlanRowModel]


_CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


def _validate_tile_ladder(rules: list[_TileRuleModel]) -> None:
    ranks = {1} | {rule.max_rank + 1 for rule in rules if rule.max_rank is not None}
    reachable = set()
    for rank in ranks:
        previous = 0
        for index, rule in enumerate(rules):
            if rule.max_rank is not None and rank > rule.max_rank:
                continue
            reachable.add(index)
            if rule.max_tokens is None:
                break
            if rule.max_tokens <= previous:
                raise ValueError(f"tile token bounds must increase for rank {rank}")
            previous = rule.max_tokens
    if len(reachable) != len(rules):
        raise ValueError("tile rules must not be shadowed for every rank")


def _read_table(name: str) -> dict | None:
    from sglang.srt.environ import envs

    override_dir = envs.SGLANG_LORA_MOE_CONFIG_DIR.get()
    for directory in filter(None, (override_dir, _CONFIG_DIR)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            if directory == override_dir:
                logger.info(
                    "MoE LoRA table %r loaded from override dir %s", name, directory
                )
            with open(path) as handle:
                return json.load(handle)
    return None


@cache
def _load_plans(architecture: str) -> _PlansFileModel:
    raw = _read_table(f"{architecture}.plans.json")
    if raw is None:
        logger.warning(
            "no MoE LoRA plan table for architecture %s; serving the "
            "conservative default plans",
            architecture,
        )
        raw = _read_table("default.plans.json")
    if raw is None:
        raise RuntimeError("MoE LoRA plan tables are missing from the package")
    table = _PlansFileModel.model_validate(raw)
    for row in (*table.scenarios, *table.fallback):
        layouts = (row.layout,) if row.layout is not None else ("per_expert", "shared")
        plans = [
            _build_plan(
                row.plan,
                activation=ActivationFn.SILU,
                is_shared_outer=layout == "shared",
            )
            for layout in layouts
        ]
        for rule in row.tiles:
            config = MoeLoraLaunchConfig(**rule.sites)
            for plan in plans:
                _validate_plan_launch_config(plan, config)
        _validate_tile_ladder(row.tiles)
    return table


@dataclass(frozen=True, slots=True)
class SelectedPlan:
    name: str
    base_gemm_rows: str
    plan: MoePlan
    tiles: TileTable


def _tile_table(rules: list[_TileRuleModel], physical_rank: int) -> TileTable:
    """Drop the rules the bound rank excludes; keep the token bounds for each forward."""
    resolved: list[tuple[int, MoeLoraLaunchConfig]] = []
    for rule in rules:
        if rule.max_rank is not None and physical_rank > rule.max_rank:
            continue
        bound = rule.max_tokens if rule.max_tokens is not None else 1 << 30
        resolved.append((bound, MoeLoraLaunchConfig(**rule.sites)))
        if rule.max_tokens is None:
            break  # An unbounded rule shadows all later rules.
    if not resolved:
        resolved.append((1 << 30, MoeLoraLaunchConfig()))
    return TileTable(resolved)


def _build_plan(
    spec: _PlanSpecModel,
    *,
    activation: ActivationFn,
    is_shared_outer: bool,
) -> MoePlan:
    gate_up_a_family = spec.gate_up_a_family
    gate_up_layout = (
        BridgeLayout.TOKEN_MAJOR
        if gate_up_a_family in (AFamily.TOKEN_GROUPED, AFamily.TOKEN_DENSE)
        else BridgeLayout.PAIR_MAJOR
    )
    act_family = spec.act_family
    finalize_family = spec.finalize_family
    consumes_gate_up_b = act_family is ActFamily.B_ACTIVATION
    consumes_down_b = finalize_family is not FinalizeFamily.MATERIALIZED
    plan = MoePlan(
        gate_up_a=ASpec(
            Site.GATE_UP, gate_up_a_family, is_shared_outer, gate_up_layout
        ),
        gate_up_b=(
            None
            if consumes_gate_up_b
            else BSpec(
                Site.GATE_UP,
                spec.gate_up_b_family,
                False,
                gate_up_layout,
            )
        ),
        act=ActSpec(act_family, activation),
        down_a=ASpec(
            Site.DOWN,
            spec.down_a_family,
            False,
            BridgeLayout.PAIR_MAJOR,
        ),
        down_b=(
            None
            if consumes_down_b
            else BSpec(
                Site.DOWN,
                spec.down_b_family,
                is_shared_outer,
                BridgeLayout.PAIR_MAJOR,
            )
        ),
        finalize=FinalizeSpec(
            finalize_family, is_shared_outer if consumes_down_b else False
        ),
        gate_up_overlap=spec.gate_up_overlap,
        down_overlap=spec.down_overlap,
        route_builder=spec.route_builder,
        down_b_into_base=spec.down_b_into_base,
    )
    return plan


@cache
def _warn_out_of_domain(
    architecture: str, hidden_size: int, num_local_experts: int
) -> None:
    logger.warning(
        "MoE LoRA geometry (hidden=%d, local_experts=%d) is outside the tuned "
        "domain of table %r; serving the fallback rows",
        hidden_size,
        num_local_experts,
        architecture,
    )


def resolve_plans(
    *,
    architecture: str,
    is_shared_outer: bool,
    physical_rank: int,
    activation: ActivationFn,
    hidden_size: int,
    num_local_experts: int,
    quant_family: str,
) -> dict[Phase, SelectedPlan]:
    table = _load_plans(architecture)
    layout_name = "shared" if is_shared_outer else "per_expert"
    in_domain = table.domain.admits(
        hidden_size=hidden_size, num_local_experts=num_local_experts
    )
    rows = table.scenarios if in_domain else []
    if not in_domain:
        _warn_out_of_domain(architecture, hidden_size, num_local_experts)
    selected: dict[Phase, SelectedPlan] = {}
    for phase in Phase:
        # Earlier rows take precedence, including wildcard rows.
        row = next(
            (
                candidate
                for candidate in (*rows, *table.fallback)
                if candidate.layout in (None, layout_name)
                and candidate.phase in (None, phase)
                and (candidate.max_rank is None or physical_rank <= candidate.max_rank)
                and (
                    candidate.min_local_experts is None
                    or num_local_experts >= candidate.min_local_experts
                )
                and (
                    candidate.max_local_experts is None
                    or num_local_experts <= candidate.max_local_experts
                )
                and (candidate.quant is None or quant_family in candidate.quant)
            ),
            None,
        )
        if row is None:
            raise RuntimeError(
                f"no MoE LoRA plan row matches ({layout_name}, {phase.value}) "
                f"on {architecture}"
            )
        selected[phase] = SelectedPlan(
            name=row.name,
            base_gemm_rows=row.base_gemm_rows,
            plan=_build_plan(
                row.plan,
                activation=activation,
                is_shared_outer=is_shared_outer,
            ),
            tiles=_tile_table(row.tiles, physical_rank),
        )
    return selected
