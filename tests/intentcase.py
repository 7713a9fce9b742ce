"""The Glm4Moe intent the intent and rebase tests share, as a record and as TOML."""

from __future__ import annotations

import textwrap

from sm120fork.intent.model import Intent, Switch

SA = "python/sglang/srt/server_args.py"
INTENTS_TOML = f"""\
[[intent]]
patch = "0001-glm.patch"
says = "Glm4Moe on SM12x: quant auto-detect and flashinfer_cutlass"
anchor = "Glm4MoeForCausalLM"
gate_admits = "sm100"
include = "sm120"
files = ["{SA}"]
[[intent.switch]]
old = "flashinfer_trtllm"
new = "flashinfer_cutlass"
"""
INTENT = Intent(
    patch="0001-glm.patch",
    says="Glm4Moe on SM12x: quant auto-detect and flashinfer_cutlass",
    anchor="Glm4MoeForCausalLM",
    gate_admits="sm100",
    include="sm120",
    switches=(Switch("flashinfer_trtllm", "flashinfer_cutlass"),),
    files=(SA,),
)

IMPORTS = textwrap.dedent("""\
    from sglang.srt.utils import (
        is_hip,
        is_sm100_supported,
    )


    class ServerArgs:
        def _handle_model_specific_adjustments(self, model_arch):
""")
GLM_BLOCK = """\
        if model_arch in ["Glm4MoeForCausalLM"]:
            if is_sm100_supported():
                self.quantization = "modelopt_fp4"  # auto-detected
                self.moe_runner_backend = "flashinfer_trtllm"
"""
# server_args.py with only the Glm4Moe override.
GLM_ONLY = IMPORTS + GLM_BLOCK
# ... and a DeepSeek override with the same gate before it.
WITH_DEEPSEEK = (
    IMPORTS
    + """\
        if model_arch in ["DeepseekV3ForCausalLM"]:
            if is_sm100_supported():
                self.moe_runner_backend = "flashinfer_trtllm"
"""
    + GLM_BLOCK.replace("        if model_arch", "        elif model_arch", 1)
)
