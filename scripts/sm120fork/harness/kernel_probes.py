"""Child side: every Triton kernel launch an SM12x decision selects for a scenario's
model, compiled for sm_120 on the CPU, with the shared memory the compiled kernel needs
(and the TileLang DSA kernels, lowered by ``dsa_launches``).

Loaded by ``child_probes.py`` (standard library and torch at import; sglang and Triton
inside the probe). The launches are enumerated, not listed: the scenario's resolved
ServerArgs say which backends run (Triton attention for prefill/decode, the Triton
fused-MoE runner, the FP8 block-GEMM dispatch), sglang's ModelConfig gives the shapes
(head dims, MLA ranks, heads and experts per rank, intermediate sizes, FP8 blocks), and
the tested tree's own launchers and config lookups (try_get_optimal_moe_config, the
w8a8 block-FP8 configs, the attention tile choices) are called on meta tensors under the
faked GPU. Each launch is caught at ``JITFunction.run``, bound with Triton's own binder
and compiled with ``triton.compile`` for GPUTarget("cuda", 120, 32); nothing runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import dsa_launches, gemm_launches
from .kernel_compile import Compiler, call_by_name, idx, imp, meta

FIELD = "kernel_fit.launches"
INPUTS = "kernel_fit.inputs"


# --------------------------------------------------------------------------- what is decided


def _resolved(server_args: Any) -> dict[str, Any]:
    resolved = getattr(server_args, "resolved_dict", None)
    return dict(resolved()) if callable(resolved) else dict(vars(server_args))


DECISIONS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
             "moe_runner_backend", "kv_cache_dtype", "tp_size", "ep_size",
             *dsa_launches.ROLES)  # fmt: skip


def _kv_dtype(values: dict[str, Any]) -> Any:
    torch = imp("torch")
    return {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(
        str(values.get("kv_cache_dtype")), torch.bfloat16
    )


def _attention_shapes(model: Any, tp: int) -> list[tuple[str, int, int, int, int]]:
    """(path, Lq, Lv, query heads, KV heads) per rank for the Triton attention backend."""
    heads = max(1, model.num_attention_heads // tp)
    if getattr(getattr(model, "attention_arch", None), "name", "") == "MLA":
        rope, rank = model.qk_rope_head_dim, model.kv_lora_rank
        return [
            ("mha", model.qk_nope_head_dim + rope, model.v_head_dim, heads, heads),
            ("mla", rank + rope, rank, heads, 1),
        ]
    kv = max(1, model.get_num_kv_heads(tp))
    dims = {(model.head_dim, model.v_head_dim)}
    swa = (getattr(model, "swa_head_dim", None), getattr(model, "swa_v_head_dim", None))
    if all(swa):
        dims.add(swa)
    return [("mha", lq, lv, heads, kv) for lq, lv in sorted(dims)]


def _extend(path: str, lq: int, lv: int, hq: int, hkv: int, kv: Any) -> None:
    fwd = imp("sglang.kernels.ops.attention.extend_attention").extend_attention_fwd
    q, o = meta(16, hq, lq), meta(16, hq, lv)
    args = {"q_extend": q, "k_extend": meta(16, hkv, lq), "v_extend": meta(16, hkv, lv),
            "o_extend": o, "k_buffer": meta(64, hkv, lq, dtype=kv),
            "v_buffer": meta(64, hkv, lv, dtype=kv), "qo_indptr": idx(2),
            "kv_indptr": idx(2), "kv_indices": idx(16), "custom_mask": None,
            "is_causal": True, "mask_indptr": None, "max_len_extend": 16,
            "k_scale": 1.0, "v_scale": 1.0}  # fmt: skip
    call_by_name(fwd, args)


def _decode(path: str, lq: int, lv: int, hq: int, hkv: int, kv: Any) -> None:
    torch = imp("torch")
    fwd = imp("sglang.kernels.ops.attention.decode_attention").decode_attention_fwd
    splits = 8
    args = {"q": meta(4, hq, lq), "k_buffer": meta(64, hkv, lq, dtype=kv),
            "v_buffer": meta(64, hkv, lv, dtype=kv), "o": meta(4, hq, lv),
            "kv_indptr": idx(5), "kv_indices": idx(64),
            "attn_logits": meta(4, hq, splits, lv, dtype=torch.float32),
            "attn_lse": meta(4, hq, splits, dtype=torch.float32),
            "num_kv_splits": idx(4), "max_kv_splits": splits, "sm_scale": 0.1,
            "k_scale": 1.0, "v_scale": 1.0, "has_mla": path == "mla"}  # fmt: skip
    call_by_name(fwd, args)


def _attention(compiler: Compiler, values: dict[str, Any], model: Any, tp: int) -> None:
    default = values.get("attention_backend")
    prefill = values.get("prefill_attention_backend") or default
    decode = values.get("decode_attention_backend") or default
    kv = _kv_dtype(values)
    for path, lq, lv, hq, hkv in _attention_shapes(model, tp):
        for phase, backend, launch in (("extend", prefill, _extend), ("decode", decode, _decode)):
            if backend == "triton":
                compiler.case = f"{phase}[{path},Lq={lq},Lv={lv},h={hq}/{hkv},{kv}]"
                launch(path, lq, lv, hq, hkv, kv)


def _vision(compiler: Compiler, model: Any) -> None:
    """The vision encoder's attention where its platform default is Triton
    (VisionAttention's choice; context_attention_fwd picks the tiles)."""
    vision = getattr(model.hf_config, "vision_config", None)
    fields: dict[str, Any] = {}
    if vision is not None:
        fields = vision if isinstance(vision, dict) else vars(vision)
    heads = fields.get("num_attention_heads") or fields.get("num_heads")
    dim = (fields.get("head_dim") or (fields.get("hidden_size") or 0) // heads) if heads else 0
    if not dim:
        return
    attention = imp("sglang.srt.layers.attention.vision").VisionAttention
    if attention._determine_attention_backend(None, None) != "triton_attn":
        return
    fwd = imp("sglang.kernels.ops.attention.prefill_attention").context_attention_fwd
    x = meta(64, 2, dim)
    compiler.case = f"vision_prefill[Lk={dim}]"
    fwd(x, x, x, meta(64, 2, dim), idx(1), idx(1), 64, is_causal=False)


def kernel_fit(server_args: Any, dispatch_fp8: Callable[[Any, list[int]], str]) -> dict[str, Any]:
    """Every selected Triton launch of the scenario, compiled for sm_120: a list of
    {kernel, tiles, num_warps, num_stages, shared, cases}, largest shared memory first."""
    values = _resolved(server_args)
    model_config = imp("sglang.srt.configs.model_config").ModelConfig
    model = model_config.from_server_args(server_args)
    tp = int(server_args.tp_size)
    compiler = Compiler()
    with compiler.catching():
        _attention(compiler, values, model, tp)
        _vision(compiler, model)
        dsa_launches.sparse_mla(compiler, values, model, tp)
        gemm_launches.moe(compiler, values, model, server_args)
        gemm_launches.fp8_gemm(compiler, model, tp, lambda block: dispatch_fp8(server_args, block))
    records = sorted(compiler.records.values(), key=lambda r: -r["shared"])
    inputs: dict[str, Any] = {name: str(values.get(name)) for name in DECISIONS}
    inputs["quantization(model)"] = str(model.quantization)
    inputs["attention(tp rank)"] = [list(shape) for shape in _attention_shapes(model, tp)]
    return {FIELD: records, INPUTS: inputs}
