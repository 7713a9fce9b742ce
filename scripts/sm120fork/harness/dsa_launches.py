"""Child side: the sparse-MLA kernels a DSA scenario's resolved backends select, with
the shared memory each needs on sm_120, measured on the CPU. Nothing runs.

The tiles are upstream's own choice: the tested tree's entry points (the calls
dsa_backend makes) run on meta tensors shaped from the model config (query heads per
rank, kv_lora_rank + rope dims, index_topk, the KV cache dtype) under the faked GPU:
- `tilelang` (either role): `tilelang_sparse_fwd`, each TileLang kernel factory
  replaced by a recorder that lowers the real factory's TIR for sm_120 and hands back a
  stand-in kernel;
- `triton_sparse_mla` (prefill): `sparse_mla_prefill`, its Triton launches compiled by
  the Compiler. That launcher steps down to smaller tiles on OutOfResources, so here a
  launch over the GPU's per-block limit fails as it would on the GPU: the tiles it
  stepped down from are dropped, the one that fits is recorded, and when none fits the
  overflowing launches stay recorded (the request would fail).
The indexer's Triton FP8 quantization (`act_quant`) runs for every DSA model. Another
DSA backend with a Triton or TileLang kernel (`triton`) fails the probe until it
is modelled here. Standard library only at import; torch, sglang, Triton and TileLang
inside.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from .kernel_compile import TARGET_CAPABILITY, Compiler, imp, meta

MODULE = "sglang.kernels.ops.attention.dsa.tilelang_kernel"
PREFILL = "sglang.kernels.ops.attention.dsa.triton_sparse_mla_prefill"
INDEXER_QUANT = "sglang.kernels.ops.quantization.act_quant_triton"
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
    saved = {name: getattr(module, name) for name in FACTORIES if hasattr(module, name)}
    for name, factory in saved.items():
        setattr(module, name, _recorder(compiler, name, factory))
    try:
        yield
    finally:
        for name, factory in saved.items():
            setattr(module, name, factory)


def _stepping_down(compiler: Compiler, launch: Callable[[], Any]) -> None:
    """Run a launcher that catches OutOfResources and retries smaller tiles."""
    errors = imp("triton.runtime.errors")
    limit = int(imp("torch").cuda.get_device_properties(0).shared_memory_per_block_optin)
    before = {key: len(record["cases"]) for key, record in compiler.records.items()}
    compiler.raise_over = limit
    try:
        launch()
    except errors.OutOfResources:
        return  # no tile fits: the overflowing launches stay recorded
    finally:
        compiler.raise_over = None
    for key, record in list(compiler.records.items()):
        if record["shared"] > limit:  # stepped down from: never runs
            if key in before:
                del record["cases"][before[key] :]
            else:
                del compiler.records[key]


def _indexer_quant(compiler: Compiler, hf: Any) -> None:
    """The indexer's FP8 quantization of its query and keys (act_quant_triton on CUDA,
    whatever the attention backends): every DSA model runs it."""
    heads, dim = int(hf.index_n_heads), int(hf.index_head_dim)
    act_quant = imp(INDEXER_QUANT).act_quant
    compiler.case = f"dsa_indexer[act_quant,heads={heads},d={dim}]"
    act_quant(meta(64, heads, dim), 128, None)
    act_quant(meta(64, dim), 128, None)


def sparse_mla(compiler: Compiler, values: dict[str, Any], model: Any, tp: int) -> list[str]:
    """Record each kernel the scenario's DSA roles select; the cases it covered."""
    config_module = imp("sglang.srt.configs.model_config")
    hf = model.hf_config
    roles = {role: values.get(role) for role in ROLES}
    if not config_module.is_deepseek_dsa(hf):
        return []
    _indexer_quant(compiler, hf)
    unmodelled = {role: b for role, b in roles.items() if b == "triton" or (
        b == "triton_sparse_mla" and role != "dsa_prefill_backend")}  # fmt: skip
    if unmodelled:
        raise NotImplementedError(f"kernel_fit does not model the DSA kernels of {unmodelled}")
    torch = imp("torch")
    heads = max(1, model.num_attention_heads // tp)
    d_v, rope = model.kv_lora_rank, model.qk_rope_head_dim
    topk = -(-config_module.get_dsa_index_topk(hf) // 64) * 64  # dsa_backend pads to 64
    fp8 = str(values.get("kv_cache_dtype")).startswith("fp8")
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cases = []
    for role, backend in roles.items():
        tokens = TOKENS[role]
        phase = role.split("_")[1]
        if backend == "tilelang":
            module = imp(MODULE)
            compiler.case = f"dsa_{phase}[tilelang,T={tokens},h={heads},{kv_dtype}]"
            with _recording(compiler, module):
                module.tilelang_sparse_fwd(
                    q=meta(tokens, heads, d_v + rope),
                    kv=meta(tokens, 1, d_v + rope, dtype=kv_dtype),
                    indices=meta(tokens, 1, topk, dtype=torch.int32),
                    sm_scale=0.1,
                    d_v=d_v,
                )
        elif backend == "triton_sparse_mla":  # the KV cache reaches it dequantized: bf16
            union = int(values.get("dsa_triton_union") or 0)
            compiler.case = f"dsa_{phase}[triton_sparse_mla,T={tokens},h={heads},union={union}]"
            q, kv = meta(tokens, heads, d_v + rope), meta(tokens, 1, d_v + rope)
            indices = meta(tokens, 1, topk, dtype=torch.int32)
            prefill = imp(PREFILL).sparse_mla_prefill
            _stepping_down(compiler, partial(prefill, q, kv, indices, 0.1, d_v, union=union))
        else:
            continue
        cases.append(compiler.case)
    return cases
