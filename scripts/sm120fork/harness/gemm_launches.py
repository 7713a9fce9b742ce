"""Child side: the Triton GEMM launches of a family's SM12x decisions (issue 28): the
fused-MoE kernel at every config sglang's lookup returns, and the block-FP8 GEMM where
the dispatch can reach it. Loaded by ``kernel_probes.py``; see its docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .kernel_compile import Compiler, idx, imp, meta

# SM12x boards other than the faked one whose names select Triton config files
# (get_device_name() is part of the MoE and FP8-GEMM config lookups).
SM12X_BOARDS = (
    "NVIDIA GeForce RTX 5090",
    "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
    "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition",
    "NVIDIA GB10",
)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
MOE_TP_SIZES = (1, 2, 4, 8)  # expert shapes per rank as SM12x hosts shard them


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
    cuda = imp("torch").cuda
    original = cuda.get_device_name
    if name is not None:
        cuda.get_device_name = lambda device=None: name
    try:
        yield
    finally:
        cuda.get_device_name = original


def _boards() -> list[str | None]:
    own = imp("torch").cuda.get_device_name()
    return [None, *(name for name in SM12X_BOARDS if name != own)]


def moe(compiler: Compiler, values: dict[str, Any], model: Any, server_args: Any) -> None:
    """The Triton fused-MoE kernel at every config sglang's lookup returns for the
    family's expert shapes per rank (the scenario's TP and each of MOE_TP_SIZES), on
    each SM12x board name, for every batch size of TOKENS."""
    experts = _hf(model, "n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
    quant = model.quantization
    if not experts or values.get("moe_runner_backend") not in ("auto", "triton"):
        return
    if quant not in (None, "fp8", "modelopt_fp8"):
        return  # FP4/MXFP4/MXFP8 MoE run flashinfer or marlin kernels, not this one
    torch, tl = imp("torch"), imp("triton.language")
    cfg = imp("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config")
    kernels = imp("sglang.kernels.ops.moe.fused_moe_triton_kernels")
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
        a = meta(rows, k, dtype=weight if block else torch.bfloat16)
        if block:
            a_scale = meta(rows, -(-k // block[1]), dtype=f32)
            b_scale = meta(e, -(-out // block[0]), -(-k // block[1]), dtype=f32)
        else:
            a_scale, b_scale = (meta(1, dtype=f32), meta(e, dtype=f32)) if fp8 else (None, None)
        compiler.case = f"fused_moe[{side},E={e},N={n},K={hidden},{dtype},block={block}]"
        kernels.invoke_fused_moe_kernel(
            a, meta(e, out, k, dtype=weight), None, meta(16, topk, out), a_scale, b_scale,
            None, meta(16, topk, dtype=f32), idx(16, topk), idx(16 * topk + e * 64),
            idx(16 * topk), idx(1), side == "down", 1 if side == "down" else topk, config,
            tl.bfloat16, fp8, False, False, False, False, block,
        )  # fmt: skip


def fp8_gemm(compiler: Compiler, model: Any, tp: int, dispatch: Callable[[list[int]], str]) -> None:
    """The Triton block-FP8 GEMM, where the dispatch can reach it (chosen, or the
    fallback of a *_with_fallback GEMM), at every config its lookup returns for the
    family's dense linear shapes and for each SM12x board's tuned shapes."""
    block = _block_shape(model)
    if model.quantization != "fp8" or not block:
        return
    chosen = dispatch(block)
    if "triton" not in chosen and "fallback" not in chosen:
        return
    torch = imp("torch")
    fp8 = imp("sglang.kernels.ops.gemm.fp8_kernel")
    hidden = int(model.hf_text_config.hidden_size)
    heads, kv = max(1, model.num_attention_heads // tp), max(1, model.get_num_kv_heads(tp))
    inter = int(_hf(model, "intermediate_size", "moe_intermediate_size") or hidden) // tp
    shapes = {((heads + 2 * kv) * model.head_dim, hidden), (hidden, heads * model.head_dim),
              (2 * inter, hidden), (hidden, inter)}  # fmt: skip
    configs = Path(fp8.__file__).with_name("configs")
    for board in _boards():
        with _board(board):
            name = imp("torch").cuda.get_device_name().replace(" ", "_")
            suffix = f"device_name={name},dtype=fp8_w8a8,block_shape=[{block[0]}, {block[1]}].json"
            for path in configs.glob(f"N=*,K=*,{suffix}"):
                n_part, k_part = path.name.split(",")[:2]
                shapes.add((int(n_part[2:]), int(k_part[2:])))
            for n, k in sorted(shapes):
                compiler.case = f"w8a8_block_fp8[N={n},K={k},block={block},{name}]"
                for m in TOKENS:
                    fp8.w8a8_block_fp8_matmul_triton(
                        meta(m, k, dtype=torch.float8_e4m3fn),
                        meta(n, k, dtype=torch.float8_e4m3fn),
                        meta(m, -(-k // block[1]), dtype=torch.float32),
                        meta(-(-n // block[0]), -(-k // block[1]), dtype=torch.float32),
                        block, torch.bfloat16,
                    )  # fmt: skip
