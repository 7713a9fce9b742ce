"""Child side of the gate harness: one interpreter, one faked GPU architecture.

Run by ``runner.py`` as ``python -P -m sm120fork.harness.child REQUEST.json RESULT.json``
in the gate environment (torch and sglang's pinned dependencies installed), the tool on
its PYTHONPATH. It uses the standard library, torch and its probe siblings only.

Order matters: the fakes go in before sglang is imported, so every ``lru_cache``,
module-level flag (``communicator._is_sm100_supported``, DeepGEMM flags, Triton
``CUDA_CAPABILITY``) and platform object (``get_platform()``) computes itself from
the fake hardware. Nothing of sglang is patched: the fakes sit at the torch.cuda /
torch.version boundary (here), the ``nvidia-smi`` executable, ``libcuda.so.1`` and
``libnvidia-ml.so.1`` (runner.py). Triton is touched only to catch a kernel launch
and read its tile constants.

Where a release decides: 0.5.9 resolves ServerArgs in ``__post_init__``; later
releases construct an unresolved record and decide in ``resolve_once()``, read
through ``resolved_dict()``. ``build_server_args`` detects which, and refuses
(exit 3, the run fails) when it cannot see a decision being made: reading raw
attributes of an unresolved record would pass every row vacuously.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import child_probes, probe_support
from .torch_fakes import fake_hardware

Observation = dict[str, Any]
MISSING = probe_support.MISSING
HARNESS_FAILURE_EXIT = 3

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
    "nsa_prefill_backend",  # 0.5.9; renamed dsa_* later
    "nsa_decode_backend",
    "dsa_prefill_backend",
    "dsa_decode_backend",
    "dsa_paged_mqa_logits_backend",  # the DSA indexer's kernel (DeepGEMM on CUDA)
    "enable_flashinfer_allreduce_fusion",  # 0.5.9; later a deprecated alias of the next
    "flashinfer_allreduce_fusion_backend",
    "fp4_gemm_runner_backend",
    "fp8_gemm_runner_backend",
    "sampling_backend",
    "disable_hybrid_swa_memory",
    "device",
)


class HarnessFailure(Exception):
    """The harness cannot observe this release faithfully: the child exits non-zero."""


# --------------------------------------------------------------------------- ServerArgs


def _declared_defaults(cls: Any) -> dict[str, Any]:
    if not dataclasses.is_dataclass(cls):
        return {}
    return {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }


def build_server_args(model_path: str, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """ServerArgs for a scenario, resolved, and its decided field values.

    Raises what sglang raises (an observation) or HarnessFailure when the release
    offers no resolution the harness can see act.
    """
    cls = importlib.import_module("sglang.srt.server_args").ServerArgs
    server_args = cls(model_path=model_path, **kwargs)
    resolve = getattr(server_args, "resolve_once", None)
    if callable(resolve):
        built = {name: getattr(server_args, name, MISSING) for name in SERVER_ARGS_FIELDS}
        resolve()
        resolved_dict = getattr(server_args, "resolved_dict", None)
        if not callable(resolved_dict):
            raise HarnessFailure(
                "ServerArgs has resolve_once() but no resolved_dict(): its decisions cannot "
                "be read (raw attributes stay unresolved)"
            )
        values = dict(resolved_dict())
        before, how = built, "resolve_once() / resolved_dict()"
    else:
        values = {name: getattr(server_args, name, MISSING) for name in SERVER_ARGS_FIELDS}
        before, how = _declared_defaults(cls), "ServerArgs(...) (no resolve_once())"
    decided = [
        name
        for name in SERVER_ARGS_FIELDS
        if name in values and name in before and values[name] != before[name]
    ]
    if not decided:
        raise HarnessFailure(
            f"{how} decided none of {', '.join(SERVER_ARGS_FIELDS)} for {model_path}: "
            "resolution is unavailable or a no-op here, and every row would pass vacuously"
        )
    return server_args, values


def platform_facts(arch: dict[str, Any]) -> dict[str, Any]:
    """What sglang itself reads as the GPU; refuse to run if it is not the faked one."""
    facts: dict[str, Any] = {}
    common = importlib.import_module("sglang.srt.utils.common")
    major, minor = arch["capability"]
    facts["device_sm"] = common.get_device_sm()
    if facts["device_sm"] != major * 10 + minor:
        raise HarnessFailure(
            f"sglang's get_device_sm() reads {facts['device_sm']}, the fake is "
            f"{major}.{minor}: sglang reads the GPU somewhere the fakes do not reach"
        )
    for helper in ("is_sm90_supported", "is_sm100_supported", "is_sm120_supported"):
        if hasattr(common, helper):
            facts[helper] = bool(getattr(common, helper)())
    if probe_support.module_exists("sglang.srt.runtime_context"):
        context = importlib.import_module("sglang.srt.runtime_context")
        if hasattr(context, "get_platform"):
            platform = context.get_platform()
            for fact in ("is_sm90", "is_sm100", "is_sm120", "is_blackwell"):
                facts[f"get_platform().{fact}"] = bool(getattr(platform, fact))
    return facts


# --------------------------------------------------------------------------- scenarios


class _Warnings(logging.Handler):
    """WARNING records sglang logs while it resolves the arguments: a slower
    fallback must say so once (the rows' field `log.warnings`)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Warnings:
        logging.getLogger("sglang").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("sglang").removeHandler(self)

    def text(self) -> str | None:
        # table.LOG_SEP (the child imports only its probe siblings of the harness)
        return " | ".join(self.messages) or None


def run_scenario(scenario: dict[str, Any]) -> Observation:
    """Build and resolve ServerArgs for the scenario (if it names a model), then probe."""
    environ = dict(os.environ)
    obs: Observation = {"error": None}
    server_args: Any = None
    warnings = _Warnings()
    try:
        if scenario.get("model_path"):
            try:
                with warnings:
                    server_args, values = build_server_args(
                        scenario["model_path"], dict(scenario.get("args", {}))
                    )
            except HarnessFailure:
                raise
            except Exception as exc:
                obs["error"] = probe_support.describe(exc)["raises"]
                return obs
            for name in SERVER_ARGS_FIELDS:
                obs[name] = probe_support.plain(values.get(name, MISSING))
            for key in sorted(set(os.environ) | set(environ)):
                if os.environ.get(key) != environ.get(key) and key.startswith("SGLANG_"):
                    obs[f"env.{key}"] = os.environ.get(key)
        # A load-time fallback warns while a probe resolves it: recorded as well.
        with warnings:
            for probe_name in scenario.get("probes", []):
                obs.update(child_probes.run_probe(probe_name, server_args))
        if server_args is not None:
            obs["log.warnings"] = warnings.text()
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
    sglang = importlib.import_module("sglang")
    where = str(Path(str(sglang.__file__)).resolve())
    if not where.startswith(sglang_path + os.sep):
        raise SystemExit(f"sglang imported from {where}, not from the tested tree {sglang_path}")
    meta["sglang_file"] = where
    meta["sglang_version"] = getattr(sglang, "__version__", None)
    meta["import_s"] = round(time.monotonic() - started, 2)

    scenarios: dict[str, Observation] = {}
    try:
        meta["platform"] = platform_facts(request["arch"])
        for scenario in request["scenarios"]:
            try:
                scenarios[scenario["name"]] = run_scenario(scenario)
            except HarnessFailure:
                raise
            except Exception:
                traceback.print_exc()
                error = "harness: " + traceback.format_exc(limit=1)
                scenarios[scenario["name"]] = {"error": error}
    except HarnessFailure as exc:
        print(f"gate harness: {meta['arch']}: {exc}", file=sys.stderr)
        return HARNESS_FAILURE_EXIT
    meta["total_s"] = round(time.monotonic() - started, 2)
    Path(argv[2]).write_text(json.dumps({"meta": meta, "scenarios": scenarios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
