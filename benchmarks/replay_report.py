"""The replay's result (benchmarks/replay.py) as JSON and Markdown.

Per release and patch: the status, the strategy that carried it (the rebase
report's `strategy` of the step where the tool records one, else the status's
own route), whether a person did it; then every stop with its class, the tool's
reason and the person's note; the stops counted by class; the wall time.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The route a status implies, where the report names no strategy.
_ROUTE = {
    "clean": "exact",
    "offset": "offset",
    "merged": "3-way",
    "resolved": "intent",
    "upstreamed": "upstreamed",
    "dropped": "person",
    "conflict": "none",
}


def walk(data: dict[str, Any]) -> list[dict[str, Any]]:
    """[{release, patches: [{name, status, strategy, by_hand, detail}]}] from the report."""
    releases: dict[str, list[dict[str, Any]]] = {v: [] for v in data.get("releases", [])}
    for patch in data["patches"]:
        for step in patch.get("steps", []):
            strategy = step.get("strategy") or _ROUTE.get(step["status"], step["status"])
            releases.setdefault(step["version"], []).append(
                {
                    "name": patch["name"],
                    "status": step["status"],
                    "strategy": "person" if step.get("by_hand") else strategy,
                    "by_hand": bool(step.get("by_hand")),
                    "detail": step["detail"],
                    "verified": step.get("verified", ""),
                }
            )
    return [{"release": version, "patches": found} for version, found in releases.items()]


_DECIDED = re.compile(r"decided in (/\S+)|could not run: .*?(/\S+/gate-env-\S+)")


def add_costs(
    result: dict[str, Any], seconds: dict[str, float], disk: Callable[[str], float | None]
) -> None:
    """Per release of the walk: the tool's wall time there, the environment that decided
    its rows (`environment`, from the verdicts) and that venv's size (`disk_gb`)."""
    for release in result["walk"]:
        release["seconds"] = round(seconds.get(release["release"], 0.0), 1)
        said = " ".join(f"{p['verified']} {p['detail']}" for p in release["patches"])
        found = _DECIDED.search(said)
        venv = (found[1] or found[2]).rstrip(";,)") if found else None
        release["environment"] = venv
        release["disk_gb"] = disk(venv) if venv else None


def build(
    base: str,
    to: str,
    data: dict[str, Any],
    stops: list[dict[str, Any]],
    seconds: float,
    rows: dict[str, Any] | None = None,
) -> dict[str, Any]:
    counted = [s for s in stops if s["class"] != "unrecorded"]
    return {
        "from": base,
        "to": to,
        "result": data["result"],
        "reached": data["releases"][-1] if data.get("releases") else base,
        "stops": len(counted),
        "stops_by_class": dict(Counter(s["class"] for s in counted)),
        "unresolved": [s for s in stops if s["class"] == "unrecorded"],
        "seconds": round(seconds, 1),
        "stop_list": counted,
        "walk": walk(data),
        "final_rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Replay of the {result['from']} series to sglang {result['to']}",
        "",
        f"Result **{result['result']}**; **{result['stops']} stops for a person**; "
        f"the tool's wall time {result['seconds'] / 60:.1f} min, a person's time left out "
        "(benchmarks/replay.py).",
        "",
        "| class | stops |",
        "|---|---|",
    ]
    lines += [f"| {k} | {n} |" for k, n in sorted(result["stops_by_class"].items())]
    lines += ["", "## Stops", "", "| # | release | patch | class | why |", "|---|---|---|---|---|"]
    for number, stop in enumerate(result["stop_list"], start=1):
        why = " ".join(f"{stop['reason']} — person: {stop['note']}".split()).replace("|", "\\|")
        lines.append(
            f"| {number} | {stop['release']} | `{stop['patch']}` | {stop['class']} | {why} |"
        )
    for stop in result["unresolved"]:
        lines += [
            "",
            f"Stopped without a recorded resolution: `{stop['patch']}` at "
            f"{stop['release']}: {stop['reason']}",
        ]
    if result.get("final_rows") is not None:
        lines += ["", f"## The landed series' own rows on the patched {result['to']}", ""]
        lines += ["| patch | SM12x cells | wrong |", "|---|---|---|"]
        for name, got in result["final_rows"].items():
            wrong = "; ".join(got["wrong"]).replace("|", "\\|") or "none"
            lines.append(f"| `{name}` | {got['cells']} | {wrong} |")
    if any("environment" in r for r in result["walk"]):
        lines += _costs_markdown(result)
    lines += ["", "## Strategy per release", ""]
    names = sorted({p["name"] for r in result["walk"] for p in r["patches"]})
    lines += [
        "| release | "
        + " | ".join(n.removeprefix("sm120-").removesuffix(".patch") for n in names)
        + " |"
    ]
    lines += ["|---|" + "---|" * len(names)]
    for release in result["walk"]:
        got = {p["name"]: p for p in release["patches"]}
        cells = [_cell(got.get(n)) for n in names]
        lines.append(f"| {release['release']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _costs_markdown(result: dict[str, Any]) -> list[str]:
    lines = ["", "## Verification per release", ""]
    lines += [
        "| release | verified | stops | decided in | wall s | venv GB |",
        "|---|---|---|---|---|---|",
    ]
    for release in result["walk"]:
        verified = sum(p["verified"].startswith("verified") for p in release["patches"])
        stops = sum(s["release"] == release["release"] for s in result["stop_list"])
        stops += sum(s["release"] == release["release"] for s in result["unresolved"])
        env = f"`{release['environment']}`" if release["environment"] else "-"
        disk = "-" if release["disk_gb"] is None else f"{release['disk_gb']}"
        lines.append(
            f"| {release['release']} | {verified} of {len(release['patches'])} | {stops} | "
            f"{env} | {release['seconds']:.0f} | {disk} |"
        )
    return lines


def _cell(patch: dict[str, Any] | None) -> str:
    if patch is None:
        return ""
    if patch["status"] == "clean":
        return "clean"
    return f"{patch['status']} ({patch['strategy']})"


def write(out: Path, result: dict[str, Any]) -> str:
    """`result` (what `build` gives) as <out>/replay-<from>-to-<to>.{json,md}."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"replay-{result['from']}-to-{result['to']}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    Path(f"{stem}.md").write_text(markdown(result))
    return f"{stem}.json, {stem}.md"
