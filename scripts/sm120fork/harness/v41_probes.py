"""Child side, issue 13: the DeepSeek V4.1 indexer's DeepGEMM choices, as the installed
DeepGEMM allows and with the DeepGEMM configurer turned off.
"""

from __future__ import annotations

import importlib
from typing import Any

from .probe_support import (
    DEEP_GEMM,
    Observation,
    describe,
    first_module,
    imp,
    module_exists,
    plain,
)

V41_INDEXER = ("sglang.srt.layers.attention.dsv4.v41_indexer",)
JIT_DEEPGEMM_OFF = "v41_indexer[SGLANG_ENABLE_JIT_DEEPGEMM=0]"
FIELDS = (
    "v41_indexer.use_deep_gemm_prefill",
    "v41_indexer.use_deep_gemm_decode",
    f"{JIT_DEEPGEMM_OFF}.use_deep_gemm_prefill",
    f"{JIT_DEEPGEMM_OFF}.use_deep_gemm_decode",
    f"{JIT_DEEPGEMM_OFF}.candidates",
)


def _clear_caches(module: Any) -> None:
    """Let the module's functools.cache'd probes read the state afresh."""
    for value in vars(module).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def _v41_choices(v41: Any, prefix: str, *, candidates: bool) -> Observation:
    """What the V4.1 index layers' factories decide (no tensors are touched)."""
    _clear_caches(v41)
    full = v41.make_full_topk_indexer(token_to_kv_pool=None, req_to_token=None)
    obs: Observation = {
        f"{prefix}.use_deep_gemm_prefill": plain(full.use_deep_gemm_prefill),
        f"{prefix}.use_deep_gemm_decode": plain(full.use_deep_gemm_decode),
    }
    if candidates:
        try:
            prefill, decode = v41.make_candidate_indexer(
                token_to_kv_pool=None,
                req_to_token=None,
                page_size=64,
                candidate_topk_blocks=8,
                candidate_block_size=8,
            )
            obs[f"{prefix}.candidates"] = f"{type(prefill).__name__}/{type(decode).__name__}"
        except Exception as exc:
            obs[f"{prefix}.candidates"] = describe(exc)
    return obs


def probe_v41_indexer(_: Any) -> Observation:
    """The DeepSeek V4.1 indexer's DeepGEMM choices: as the installed DeepGEMM allows,
    and with the DeepGEMM configurer turned off (SGLANG_ENABLE_JIT_DEEPGEMM=0, the
    same answer a DeepGEMM build without SM120 kernels gets on SM12x)."""
    v41_name, v41 = first_module(V41_INDEXER, "make_full_topk_indexer")
    name, configurer = first_module(DEEP_GEMM, "ENABLE_JIT_DEEPGEMM")
    for lazy in ("dense_blocks", "sparse_table"):  # imported before the flags change
        if module_exists(f"{v41_name}.{lazy}"):
            imp(f"{v41_name}.{lazy}")
    os = imp("os")
    obs = _v41_choices(v41, "v41_indexer", candidates=False)
    before = os.environ.get("SGLANG_ENABLE_JIT_DEEPGEMM")
    os.environ["SGLANG_ENABLE_JIT_DEEPGEMM"] = "0"
    try:
        off = importlib.reload(configurer)
        obs[f"{JIT_DEEPGEMM_OFF}.ENABLE_JIT_DEEPGEMM"] = plain(off.ENABLE_JIT_DEEPGEMM)
        obs.update(_v41_choices(v41, JIT_DEEPGEMM_OFF, candidates=True))
    finally:
        if before is None:
            os.environ.pop("SGLANG_ENABLE_JIT_DEEPGEMM", None)
        else:
            os.environ["SGLANG_ENABLE_JIT_DEEPGEMM"] = before
        importlib.reload(imp(name))
        _clear_caches(v41)
    return obs
