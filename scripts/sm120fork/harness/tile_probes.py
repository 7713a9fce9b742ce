"""Child side, row 13: the Triton attention tile sizes each tree picks from the
(faked) CUDA capability, read from the first launch of each kernel on meta tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .probe_support import (
    UNAVAILABLE,
    Observation,
    Unavailable,
    call_by_name,
    describe,
    first_module,
    imp,
)


class _Launched(Exception):
    """Control flow: carries the constants of the caught kernel launch."""

    def __init__(self, constants: dict[str, Any]) -> None:
        super().__init__("launch caught")
        self.constants = constants


def _caught_launch(call: Callable[[], Any]) -> str:
    """Run ``call`` until its first Triton launch; return that launch's BLOCK_MxBLOCK_N."""
    jit = imp("triton.runtime.jit")
    original = jit.JITFunction.run

    def catch(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Launched(kwargs)

    jit.JITFunction.run = catch
    try:
        call()
    except _Launched as launched:
        return f"{launched.constants.get('BLOCK_M')}x{launched.constants.get('BLOCK_N')}"
    finally:
        jit.JITFunction.run = original
    return "no launch"


def _launch_tiles(call: Callable[[], Any]) -> Any:
    """BLOCK_MxBLOCK_N of ``call``'s first Triton launch, or the error raised before it."""
    try:
        return _caught_launch(call)
    except Unavailable as exc:
        return f"{UNAVAILABLE}{exc}"
    except Exception as exc:
        return describe(exc)


TRITON_OPS = "sglang.srt.layers.attention.triton_ops"  # 0.5.9
KERNEL_OPS = "sglang.kernels.ops.attention"  # 0.5.23 (double sparsity is gone there)
EXTEND = (f"{TRITON_OPS}.extend_attention", f"{KERNEL_OPS}.extend_attention")
PREFILL = (f"{TRITON_OPS}.prefill_attention", f"{KERNEL_OPS}.prefill_attention")
DOUBLE_SPARSITY = (f"{TRITON_OPS}.double_sparsity_attention",)


def _tiles_of(candidates: Sequence[str], function: str, call: Callable[[Any], Any]) -> Any:
    try:
        _, module = first_module(candidates, function)
    except Unavailable as exc:
        return f"{UNAVAILABLE}{exc}"
    return _launch_tiles(lambda: call(getattr(module, function)))


def probe_triton_tiles(_: Any) -> Observation:
    """Row 13: Triton attention tile sizes chosen from CUDA_CAPABILITY (meta tensors)."""
    torch = imp("torch")

    def meta(*shape: int, dtype: Any = None) -> Any:
        return torch.empty(*shape, device="meta", dtype=dtype or torch.bfloat16)

    def idx(*shape: int) -> Any:
        return meta(*shape, dtype=torch.int32)

    out: Observation = {}
    for lq, lv in ((128, 128), (192, 128), (576, 512)):

        def extend_fwd(fwd: Callable[..., Any], lq: int = lq, lv: int = lv) -> Any:
            q, o, kbuf, vbuf = meta(16, 8, lq), meta(16, 8, lv), meta(64, 8, lq), meta(64, 8, lv)
            indptr, indices = idx(2), idx(16)
            args = {
                "q_extend": q,
                "k_extend": q,
                "v_extend": o,
                "o_extend": o,
                "k_buffer": kbuf,
                "v_buffer": vbuf,
                "qo_indptr": indptr,
                "kv_indptr": indptr,
                "kv_indices": indices,
                "custom_mask": None,
                "is_causal": True,
                "mask_indptr": None,
                "max_len_extend": 16,
                "k_scale": 1.0,
                "v_scale": 1.0,
            }
            return call_by_name(fwd, args)

        out[f"triton.extend_attention[Lq={lq}]"] = _tiles_of(
            EXTEND, "extend_attention_fwd", extend_fwd
        )

    for lk in (128, 256):

        def prefill_fwd(fwd: Callable[..., Any], lk: int = lk) -> Any:
            x = meta(16, 8, lk)
            return fwd(x, x, x, x, idx(1), idx(1), 16)

        out[f"triton.prefill_attention[Lk={lk}]"] = _tiles_of(
            PREFILL, "context_attention_fwd", prefill_fwd
        )

    for lq in (128, 256):

        def sparse_fwd(fwd: Callable[..., Any], lq: int = lq) -> Any:
            x, buf = meta(16, 8, lq), meta(64, 8, lq)
            one = idx(1)
            return fwd(x, x, x, x, buf, buf, idx(1, 64), one, one, one, one, 16)

        out[f"triton.double_sparsity_extend[Lq={lq}]"] = _tiles_of(
            DOUBLE_SPARSITY, "extend_attention_fwd", sparse_fwd
        )
    return out
