"""Child side: every Triton kernel launch an SM12x decision selects for a scenario's
model, compiled for sm_120 on the CPU, with the shared memory the compiled kernel needs.

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

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# SM12x boards other than the faked one whose names select Triton config files
# (get_device_name() is part of the MoE and FP8-GEMM config lookups).
SM12X_BOARDS = (
    "NVIDIA GeForce RTX 5090",
    "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
    "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition",
    "NVIDIA GB10",
)
TARGET_CAPABILITY = 120  # SM120 and SM121 share the 101376-byte per-block limit
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
MOE_TP_SIZES = (1, 2, 4, 8)  # expert shapes per rank as SM12x hosts shard them
FIELD = "kernel_fit.launches"
INPUTS = "kernel_fit.inputs"


def _imp(name: str) -> Any:
    return importlib.import_module(name)


class _Compiler:
    """Replaces JITFunction.run: binds the launch as Triton would, compiles it for
    sm_120 (once per distinct specialization) and records its shared memory."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self.case = ""
        compiler, backends = _imp("triton.compiler"), _imp("triton.backends.compiler")
        self.target = backends.GPUTarget("cuda", TARGET_CAPABILITY, 32)
        self.backend = compiler.make_backend(self.target)

    def run(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        triton, knobs = _imp("triton"), _imp("triton.knobs")
        jit = _imp("triton.runtime.jit")
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = jit.create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(
            self.backend, kwargs, bound, specialization, options
        )
        names = [p.name for p in fn.params]
        tiles = {
            names[path[0]]: value
            for path, value in constexprs.items()
            if len(path) == 1 and isinstance(value, int | bool) and "BLOCK" in names[path[0]]
        }
        kernel = f"{fn.module}.{fn.fn.__qualname__}"
        key = repr((kernel, sorted(signature.items()), sorted(constexprs.items()), attrs,
                    options.num_warps, options.num_stages))  # fmt: skip
        if key in self.records:
            self.records[key]["cases"].append(self.case)
            return
        src = _imp("triton.compiler").ASTSource(fn, signature, constexprs, attrs)
        compiled = triton.compile(src, target=self.target, options=options.__dict__)
        self.records[key] = {
            "kernel": kernel,
            "tiles": tiles,
            "num_warps": options.num_warps,
            "num_stages": options.num_stages,
            "shared": int(compiled.metadata.shared),
            "cases": [self.case],
        }

    @contextmanager
    def catching(self) -> Iterator[None]:
        jit = _imp("triton.runtime.jit")
        original = jit.JITFunction.run
        compiler = self

        def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> None:
            compiler.run(self, args, kwargs)

        jit.JITFunction.run = run
        try:
            yield
        finally:
            jit.JITFunction.run = original


def _meta(*shape: int, dtype: Any = None) -> Any:
    torch = _imp("torch")
    return torch.empty(*shape, device="meta", dtype=dtype or torch.bfloat16)


def _idx(*shape: int) -> Any:
    return _meta(*shape, dtype=_imp("torch").int32)


def _call_by_name(function: Callable[..., Any], known: dict[str, Any]) -> Any:
    params = inspect.signature(function).parameters
    return function(**{name: value for name, value in known.items() if name in params})


# --------------------------------------------------------------------------- what is decided


def _resolved(server_args: Any) -> dict[str, Any]:
    resolved = getattr(server_args, "resolved_dict", None)
    return dict(resolved()) if callable(resolved) else dict(vars(server_args))


DECISIONS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
             "moe_runner_backend", "kv_cache_dtype", "tp_size", "ep_size")  # fmt: skip


def _kv_dtype(values: dict[str, Any]) -> Any:
    torch = _imp("torch")
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
        dims.add(swa)  # type: ignore[arg-type]
    return [("mha", lq, lv, heads, kv) for lq, lv in sorted(dims)]


def _extend(path: str, lq: int, lv: int, hq: int, hkv: int, kv: Any) -> None:
    fwd = _imp("sglang.kernels.ops.attention.extend_attention").extend_attention_fwd
    q, o = _meta(16, hq, lq), _meta(16, hq, lv)
    args = {"q_extend": q, "k_extend": _meta(16, hkv, lq), "v_extend": _meta(16, hkv, lv),
            "o_extend": o, "k_buffer": _meta(64, hkv, lq, dtype=kv),
            "v_buffer": _meta(64, hkv, lv, dtype=kv), "qo_indptr": _idx(2),
            "kv_indptr": _idx(2), "kv_indices": _idx(16), "custom_mask": None,
            "is_causal": True, "mask_indptr": None, "max_len_extend": 16,
            "k_scale": 1.0, "v_scale": 1.0}  # fmt: skip
    _call_by_name(fwd, args)


def _decode(path: str, lq: int, lv: int, hq: int, hkv: int, kv: Any) -> None:
    torch = _imp("torch")
    fwd = _imp("sglang.kernels.ops.attention.decode_attention").decode_attention_fwd
    splits = 8
    args = {"q": _meta(4, hq, lq), "k_buffer": _meta(64, hkv, lq, dtype=kv),
            "v_buffer": _meta(64, hkv, lv, dtype=kv), "o": _meta(4, hq, lv),
            "kv_indptr": _idx(5), "kv_indices": _idx(64),
            "attn_logits": _meta(4, hq, splits, lv, dtype=torch.float32),
            "attn_lse": _meta(4, hq, splits, dtype=torch.float32),
            "num_kv_splits": _idx(4), "max_kv_splits": splits, "sm_scale": 0.1,
            "k_scale": 1.0, "v_scale": 1.0, "has_mla": path == "mla"}  # fmt: skip
    _call_by_name(fwd, args)


def _attention(compiler: _Compiler, values: dict[str, Any], model: Any, tp: int) -> None:
    default = values.get("attention_backend")
    prefill = values.get("prefill_attention_backend") or default
    decode = values.get("decode_attention_backend") or default
    kv = _kv_dtype(values)
    for path, lq, lv, hq, hkv in _attention_shapes(model, tp):
        for phase, backend, launch in (("extend", prefill, _extend), ("decode", decode, _decode)):
            if backend == "triton":
                compiler.case = f"{phase}[{path},Lq={lq},Lv={lv},h={hq}/{hkv},{kv}]"
                launch(path, lq, lv, hq, hkv, kv)


def _vision(compiler: _Compiler, model: Any) -> None:
    """The vision encoder's attention where its platform default is Triton
    (VisionAttention's choice; context_attention_fwd picks the tiles)."""
    vision = getattr(model.hf_config, "vision_config", None)
    get = vision.get if isinstance(vision, dict) else lambda key: getattr(vision, key, None)
    heads = get("num_attention_heads") or get("num_heads") if vision is not None else None
    dim = (get("head_dim") or (get("hidden_size") or 0) // heads) if heads else 0
    if not dim:
        return
    attention = _imp("sglang.srt.layers.attention.vision").VisionAttention
    if attention._determine_attention_backend(None, None) != "triton_attn":
        return
    fwd = _imp("sglang.kernels.ops.attention.prefill_attention").context_attention_fwd
    x = _meta(64, 2, dim)
    compiler.case = f"vision_prefill[Lk={dim}]"
    fwd(x, x, x, _meta(64, 2, dim), _idx(1), _idx(1), 64, is_causal=False)


# --------------------------------------------------------------------------- MoE and FP8 GEMM


def _hf(model: Any, *keys: str) -> Any:
    for key in keys:
        value = getattr(model.hf_text_config, key, None)
        if value:
            return value
    return None


def _block_shape(model: Any) -> list[int] | None:
    for config in (model.hf_config, model.hf_text_config):
        quant = getattr(config, "quantization_config", None)
        quant = quant if isinstance(quant, dict) else getattr(quant, "__dict__", {}) or {}
        if quant.get("weight_block_size"):
            return [int(x) for x in quant["weight_block_size"]]
    return None


@contextmanager
def _board(name: str | None) -> Iterator[None]:
    """The config lookups as on board ``name`` (None: the faked one)."""
    cuda = _imp("torch").cuda
    original = cuda.get_device_name
    if name is not None:
        cuda.get_device_name = lambda device=None: name
    try:
        yield
    finally:
        cuda.get_device_name = original


def _boards() -> list[str | None]:
    own = _imp("torch").cuda.get_device_name()
    return [None, *(name for name in SM12X_BOARDS if name != own)]


def _moe(compiler: _Compiler, values: dict[str, Any], model: Any, server_args: Any) -> None:
    """The Triton fused-MoE kernel at every config sglang's lookup returns for the
    family's expert shapes per rank (the scenario's TP and each of MOE_TP_SIZES), on
    each SM12x board name, for every batch size of TOKENS."""
    experts = _hf(model, "n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
    quant = model.quantization
    if not experts or values.get("moe_runner_backend") not in ("auto", "triton"):
        return
    if quant not in (None, "fp8", "modelopt_fp8"):
        return  # FP4/MXFP4/MXFP8 MoE run flashinfer or marlin kernels, not this one
    torch, tl = _imp("torch"), _imp("triton.language")
    cfg = _imp("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config")
    kernels = _imp("sglang.kernels.ops.moe.fused_moe_triton_kernels")
    ep = int(getattr(server_args, "ep_size", 1) or 1)
    e, inter = int(experts) // ep, int(_hf(model, "moe_intermediate_size", "intermediate_size"))
    hidden = int(model.hf_text_config.hidden_size)
    topk = int(_hf(model, "num_experts_per_tok", "moe_topk", "top_k") or 1)
    fp8 = quant is not None
    block = _block_shape(model) if fp8 else None
    dtype = "fp8_w8a8" if fp8 else None
    ranks = {int(server_args.tp_size) // ep, *MOE_TP_SIZES}
    chosen: dict[str, tuple[str, int, dict[str, Any]]] = {}
    for board in _boards():
        with _board(board):
            for n in sorted({inter // tp for tp in ranks if inter % tp == 0}):
                cfg.get_moe_configs.cache_clear()
                for m in TOKENS:
                    up, (down, _) = cfg.try_get_optimal_moe_config(
                        (e, 2 * n, hidden), (e, hidden, n), topk, dtype, m,
                        block_shape=block, return_down_config=True,
                    )  # fmt: skip
                    for side, config in (("up", up), ("down", down or up)):
                        config = {k: v for k, v in config.items() if k != "USE_TMA"}
                        key = repr((side, n % 16 == 0, sorted(config.items())))
                        chosen.setdefault(key, (side, n, config))
        cfg.get_moe_configs.cache_clear()
    weight, f32 = (torch.float8_e4m3fn if fp8 else torch.bfloat16), torch.float32
    for side, n, config in chosen.values():
        k, out = (hidden, 2 * n) if side == "up" else (n, hidden)
        rows = 16 if side == "up" else 16 * topk
        a = _meta(rows, k, dtype=weight if block else torch.bfloat16)
        if block:
            a_scale = _meta(rows, -(-k // block[1]), dtype=f32)
            b_scale = _meta(e, -(-out // block[0]), -(-k // block[1]), dtype=f32)
        else:
            a_scale, b_scale = (_meta(1, dtype=f32), _meta(e, dtype=f32)) if fp8 else (None, None)
        compiler.case = f"fused_moe[{side},E={e},N={n},K={hidden},{dtype},block={block}]"
        kernels.invoke_fused_moe_kernel(
            a, _meta(e, out, k, dtype=weight), None, _meta(16, topk, out), a_scale, b_scale,
            None, _meta(16, topk, dtype=f32), _idx(16, topk), _idx(16 * topk + e * 64),
            _idx(16 * topk), _idx(1), side == "down", 1 if side == "down" else topk, config,
            tl.bfloat16, fp8, False, False, False, False, block,
        )  # fmt: skip


def _fp8_gemm(compiler: _Compiler, model: Any, tp: int, dispatch: Callable[[list[int]], str]) -> None:
    """The Triton block-FP8 GEMM, where the dispatch can reach it (chosen, or the
    fallback of a *_with_fallback GEMM), at every config its lookup returns for the
    family's dense linear shapes and for each SM12x board's tuned shapes."""
    block = _block_shape(model)
    if model.quantization != "fp8" or not block:
        return
    chosen = dispatch(block)
    if "triton" not in chosen and "fallback" not in chosen:
        return
    torch = _imp("torch")
    fp8 = _imp("sglang.kernels.ops.gemm.fp8_kernel")
    hidden = int(model.hf_text_config.hidden_size)
    heads, kv = max(1, model.num_attention_heads // tp), max(1, model.get_num_kv_heads(tp))
    inter = int(_hf(model, "intermediate_size", "moe_intermediate_size") or hidden) // tp
    shapes = {((heads + 2 * kv) * model.head_dim, hidden), (hidden, heads * model.head_dim),
              (2 * inter, hidden), (hidden, inter)}  # fmt: skip
    configs = __import__("pathlib").Path(fp8.__file__).with_name("configs")
    for board in _boards():
        with _board(board):
            name = _imp("torch").cuda.get_device_name().replace(" ", "_")
            suffix = f"device_name={name},dtype=fp8_w8a8,block_shape=[{block[0]}, {block[1]}].json"
            for path in configs.glob(f"N=*,K=*,{suffix}"):
                n_part, k_part = path.name.split(",")[:2]
                shapes.add((int(n_part[2:]), int(k_part[2:])))
            for n, k in sorted(shapes):
                compiler.case = f"w8a8_block_fp8[N={n},K={k},block={block},{name}]"
                for m in TOKENS:
                    fp8.w8a8_block_fp8_matmul_triton(
                        _meta(m, k, dtype=torch.float8_e4m3fn),
                        _meta(n, k, dtype=torch.float8_e4m3fn),
                        _meta(m, -(-k // block[1]), dtype=torch.float32),
                        _meta(-(-n // block[0]), -(-k // block[1]), dtype=torch.float32),
                        block, torch.bfloat16,
                    )  # fmt: skip


def kernel_fit(server_args: Any, dispatch_fp8: Callable[[Any, list[int]], str]) -> dict[str, Any]:
    """Every selected Triton launch of the scenario, compiled for sm_120: a list of
    {kernel, tiles, num_warps, num_stages, shared, cases}, largest shared memory first."""
    values = _resolved(server_args)
    model_config = _imp("sglang.srt.configs.model_config").ModelConfig
    model = model_config.from_server_args(server_args)
    tp = int(server_args.tp_size)
    compiler = _Compiler()
    with compiler.catching():
        _attention(compiler, values, model, tp)
        _vision(compiler, model)
        _moe(compiler, values, model, server_args)
        _fp8_gemm(compiler, model, tp, lambda block: dispatch_fp8(server_args, block))
    records = sorted(compiler.records.values(), key=lambda r: -r["shared"])
    inputs = {name: str(values.get(name)) for name in DECISIONS}
    inputs["quantization(model)"] = str(model.quantization)
    inputs["attention(tp rank)"] = [list(shape) for shape in _attention_shapes(model, tp)]
    return {FIELD: records, INPUTS: inputs}
