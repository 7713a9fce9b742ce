"""Child side: the TileLang sparse-MLA kernels a DSA scenario selects (`tilelang` as its
resolved --dsa-prefill-backend or --dsa-decode-backend), lowered for sm_120 on the CPU
with the tested tree's TileLang, with the dynamic shared memory each needs.

The tiles are upstream's own choice: the tested tree's `tilelang_sparse_fwd` (the call
dsa_backend's `_forward_tilelang` makes for both roles) runs on meta tensors shaped from
the model config (query heads per rank, kv_lora_rank + rope dims, index_topk, the KV
cache dtype) with each TileLang kernel factory replaced by a recorder: it lowers the real
factory's TIR for sm_120, records the result, and hands back a stand-in kernel. Nothing
runs. Standard library only at import; torch, sglang and TileLang inside.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:
    from .kernel_compile import TARGET_CAPABILITY, Compiler, imp, meta
else:  # loaded by child.py as a script: this directory is sys.path[0]
    from kernel_compile import TARGET_CAPABILITY, Compiler, imp, meta

MODULE = "sglang.kernels.ops.attention.dsa.tilelang_kernel"
# The factories tilelang_sparse_fwd may call (a name the tree lacks is skipped).
FACTORIES = (
    "sparse_attention_fwd_kernel_v1",
    "sparse_attention_fwd_kernel_v2",
    "sparse_mla_fwd_decode_partial",
    "sparse_mla_fwd_decode_partial_fp8",
    "sparse_mla_fwd_decode_combine",
)
ROLES = ("dsa_prefill_backend", "dsa_decode_backend")
# Tokens per forward: a decode step and a long prefill (inner_iter follows the count).
TOKENS = {"dsa_decode_backend": 1, "dsa_prefill_backend": 8192}
_SHARED: dict[str, int] = {}  # lowered kernel -> bytes, per child


def _lowered_shared(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The largest dynamic shared-memory buffer of the factory's kernel for sm_120."""
    tilelang = imp("tilelang")
    tvm = tilelang.tvm
    target = tvm.target.Target({"kind": "cuda", "arch": f"sm_{TARGET_CAPABILITY}"})
    tir = factory.get_tir(*args, **kwargs)
    with tvm.transform.PassContext(config=factory.pass_configs or {}), target:
        lowered = tilelang.lower(tir, target=target)
    sizes = re.findall(r'"dyn_shared_memory_buf": (\d+)', lowered.device_mod.script())
    return max((int(size) for size in sizes), default=0)


def _recorder(compiler: Compiler, name: str, factory: Any) -> Callable[..., Any]:
    def record(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        tiles = {k: v for k, v in kwargs.items() if k in ("block_I", "threads", "inner_iter")}
        key = repr((MODULE, name, args, sorted(kwargs.items())))
        if key in compiler.records:
            compiler.records[key]["cases"].append(compiler.case)
        else:
            if key not in _SHARED:
                _SHARED[key] = _lowered_shared(factory, args, kwargs)
            compiler.records[key] = {
                "kernel": f"{MODULE}.{name}",
                "tiles": {"args": list(args), **tiles},  # heads, d_v, ... as the factory takes them
                "num_warps": int(kwargs.get("threads", 128)) // 32,
                "num_stages": None,
                "shared": _SHARED[key],
                "cases": [compiler.case],
            }
        return lambda *_: (meta(1), meta(1)) if "partial" in name else meta(1)

    return record


@contextmanager
def _recording(compiler: Compiler, module: Any) -> Iterator[None]:
    torch = imp("torch")
    saved = {name: getattr(module, name) for name in FACTORIES if hasattr(module, name)}
    properties = torch.cuda.get_device_properties
    for name, factory in saved.items():
        setattr(module, name, _recorder(compiler, name, factory))
    # The kernel asks the (faked) GPU for its SM count through the meta tensor's device.
    torch.cuda.get_device_properties = lambda device=None: properties(0)
    try:
        yield
    finally:
        torch.cuda.get_device_properties = properties
        for name, factory in saved.items():
            setattr(module, name, factory)


def sparse_mla(compiler: Compiler, values: dict[str, Any], model: Any, tp: int) -> list[str]:
    """Record each TileLang kernel the scenario's DSA roles select; the cases it covered."""
    config_module = imp("sglang.srt.configs.model_config")
    hf = model.hf_config
    roles = [role for role in ROLES if values.get(role) == "tilelang"]
    if not roles or not config_module.is_deepseek_dsa(hf):
        return []
    torch = imp("torch")
    heads = max(1, model.num_attention_heads // tp)
    d_v, rope = model.kv_lora_rank, model.qk_rope_head_dim
    topk = -(-config_module.get_dsa_index_topk(hf) // 64) * 64  # dsa_backend pads to 64
    fp8 = str(values.get("kv_cache_dtype")).startswith("fp8")
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    module = imp(MODULE)
    cases = []
    with _recording(compiler, module):
        for role in roles:
            tokens = TOKENS[role]
            compiler.case = f"dsa_{role.split('_')[1]}[tilelang,T={tokens},h={heads},{kv_dtype}]"
            module.tilelang_sparse_fwd(
                q=meta(tokens, heads, d_v + rope),
                kv=meta(tokens, 1, d_v + rope, dtype=kv_dtype),
                indices=meta(tokens, 1, topk, dtype=torch.int32),
                sm_scale=0.1,
                d_v=d_v,
            )
            cases.append(compiler.case)
    return cases
