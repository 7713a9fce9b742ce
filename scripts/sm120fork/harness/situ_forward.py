"""Child-side probe: the first forward of a SiTU NVFP4 MoE layer (Kimi-K3 class) on
the runner the tested tree picks, up to the activation (issue 37, item 1).

The real ``ModelOptNvFp4FusedMoEMethod`` builds the layer as ``FusedMoE.__init__``
does (``create_weights``, then ``create_moe_runner``), random checkpoint tensors are
written into the created parameters, ``process_weights_after_loading`` runs, and
``apply()`` runs the resolved runner. No GPU here: the CUDA kernels of the marlin
path are replaced by stand-ins bound to their real signatures
(``inspect.signature(...).bind``): ``gptq_marlin_repack`` returns Marlin's repacked
shape, ``moe_wna16_marlin_gemm`` writes random values into its output,
``moe_align_block_size`` and ``moe_sum_reduce`` keep their shapes, and
``situ_and_mul`` (fused_marlin_moe's SiTU) records the parameters it is called with.
The observation is that record, so the row pins what reaches the activation:
``models/kimi_k3.py`` passes ``gemm1_alpha=activation_situ_beta`` and
``gemm1_clamp_limit=activation_situ_linear_beta``; the numbers of that kernel are
checked against sglang's SiTU in tests/gates/test_situ_marlin.py. Standalone like
child_probes.py (standard library at import, torch and sglang inside).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

FIELD = "nvfp4_moe_situ.first_forward"
E, HIDDEN, INTER, TOP_K, TOKENS = 4, 256, 192, 2, 5  # INTER: not a multiple of 128


def _bound(real: Any, impl: Any) -> Any:
    """A stand-in that refuses any call the real function would not accept."""
    signature = inspect.signature(real)

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return impl(bound.arguments)

    return stand_in


def _swap(module: Any, name: str, impl: Any, undo: list) -> None:
    real = getattr(module, name)
    undo.append((module, name, real))
    setattr(module, name, _bound(real, impl))


def _layer_config(server_args: Any) -> dict[str, Any]:
    hf = importlib.import_module("sglang.srt.configs.model_config").ModelConfig.from_server_args(
        server_args
    )
    text = hf.hf_text_config
    return {
        "activation": text.hidden_act,
        "gemm1_alpha": getattr(text, "activation_situ_beta", None),
        "gemm1_clamp_limit": getattr(text, "activation_situ_linear_beta", None),
    }


def situ_first_forward(server_args: Any, publish: Any) -> str:
    """What fused_marlin_moe's SiTU receives at the layer's first forward."""
    torch = importlib.import_module("torch")
    quant = importlib.import_module("sglang.srt.layers.quantization.modelopt_quant")
    moe_utils = importlib.import_module("sglang.srt.layers.moe.utils")
    base = importlib.import_module("sglang.srt.layers.moe.moe_runner.base")
    marlin_fp4 = importlib.import_module("sglang.srt.layers.quantization.marlin_utils_fp4")
    fmm = importlib.import_module("sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe")
    triton_moe = importlib.import_module("sglang.srt.layers.moe.fused_moe_triton")
    standard = importlib.import_module("sglang.srt.layers.moe.token_dispatcher.standard")
    topk = importlib.import_module("sglang.srt.layers.moe.topk")
    publish(server_args)
    moe_utils.initialize_moe_config()
    fields = _layer_config(server_args)
    seen: list[str] = []

    def repack(a: dict) -> Any:
        assert a["num_bits"] == 4 and a["size_k"] % 16 == 0, a
        return torch.zeros(a["size_k"] // 16, a["size_n"] * 2, dtype=torch.int32)

    def gemm(a: dict) -> Any:
        out, weight = a["c_or_none"], a["b_q_weight"]
        assert a["a"].shape[1] == a["size_k"], (a["a"].shape, a["size_k"])
        assert out.shape == (a["size_m"] * a["top_k"], a["size_n"]), (out.shape, a["size_n"])
        assert weight.shape[1:] == (a["size_k"] // 16, a["size_n"] * 2), weight.shape
        return out.normal_()

    def align(a: dict) -> Any:
        ids = torch.arange(TOKENS * TOP_K, dtype=torch.int32)
        return ids, torch.zeros(TOKENS * TOP_K, dtype=torch.int32), torch.tensor([ids.numel()])

    def situ(a: dict) -> None:
        seen.append(f"situ_and_mul(situ_beta={a['situ_beta']}, linear_beta={a['linear_beta']})")
        a["output"].zero_()

    undo: list = []
    try:
        _swap(marlin_fp4, "gptq_marlin_repack", repack, undo)
        # What a GPU runs in eager mode: the op's Python body (custom_op.py
        # _call_directly_in_eager); the registered op refuses CPU tensors.
        undo.append((fmm, "fused_marlin_moe", fmm.fused_marlin_moe))
        op = fmm.fused_marlin_moe
        fmm.fused_marlin_moe = getattr(op, "op_func", None) or op.__wrapped__
        _swap(fmm, "moe_wna16_marlin_gemm", gemm, undo)
        _swap(fmm, "situ_and_mul", situ, undo)
        _swap(fmm, "moe_sum_reduce", lambda a: a["output_tensor"].zero_(), undo)
        _swap(triton_moe, "moe_align_block_size", align, undo)
        config = base.MoeRunnerConfig(
            num_experts=E,
            num_local_experts=E,
            hidden_size=HIDDEN,
            intermediate_size_per_partition=INTER,
            top_k=TOP_K,
            params_dtype=torch.bfloat16,
            is_gated=True,
            **fields,
        )
        layer = torch.nn.Module()
        layer.moe_runner_config, layer.num_experts, layer.num_local_experts = config, E, E
        layer.moe_ep_rank, layer._mega_moe_nvfp4 = 0, False
        quant_config = quant.ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16)
        method = quant.ModelOptNvFp4FusedMoEMethod(quant_config)
        method.create_weights(layer, E, HIDDEN, INTER, torch.bfloat16, weight_loader=None)
        for param in layer.parameters():  # the checkpoint: any bytes of the right dtypes
            if param.dtype == torch.uint8:
                param.data.random_(0, 256)
            else:
                param.data.copy_(torch.rand(param.shape).add_(0.5).to(param.dtype))
        if layer.w13_weight_scale_2.dim() == 2:  # one global scale for w1 and w3
            layer.w13_weight_scale_2.data[:, 1] = layer.w13_weight_scale_2.data[:, 0]
        method.create_moe_runner(layer, config)
        runner = moe_utils.MoeRunnerBackend(method._moe_runner_backend).value
        if runner != "marlin":  # only marlin's CUDA kernels have stand-ins here
            return f"{runner}: not probed"
        method.process_weights_after_loading(layer)
        hidden = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
        weights, ids = torch.rand(TOKENS, TOP_K), torch.randint(0, E, (TOKENS, TOP_K))
        routed = topk.StandardTopKOutput(weights, ids.to(torch.int32), torch.zeros(TOKENS, E))
        with torch.no_grad():
            out = method.apply(layer, standard.StandardDispatchOutput(hidden, None, routed))
        assert out.hidden_states.shape == hidden.shape, out.hidden_states.shape
    finally:
        for module, name, real in reversed(undo):
            setattr(module, name, real)
    return f"{runner}: {' '.join(seen) or 'no SiTU call'}"
