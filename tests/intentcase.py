"""The Glm4Moe intent the intent and rebase tests share, as a record and as TOML:
widen the SM100 gate of the Glm4Moe override to SM12x, switch its MoE runner choice
there, and import the SM12x helper."""

from __future__ import annotations

import textwrap
import tomllib

from sm120fork.intent.model import Intent, parse_intent

SA = "python/sglang/srt/server_args.py"
INTENTS_TOML = """\
[[intent]]
patch = "0001-glm.patch"
says = "Glm4Moe on SM12x: quant auto-detect and flashinfer_cutlass"

[[intent.edit]]
model = "Glm4MoeForCausalLM"
condition = "is_sm100_supported()"
by = "is_sm100_supported() or is_sm120_supported()"

[[intent.edit]]
model = "Glm4MoeForCausalLM"
within = "is_sm100_supported()"
replace = '"flashinfer_trtllm"'
by = '("flashinfer_cutlass" if is_sm120_supported() else "flashinfer_trtllm")'

[[intent.edit]]
model = "Glm4MoeForCausalLM"
import_beside = "is_sm100_supported"
name = "is_sm120_supported"
"""
INTENT: Intent = parse_intent(tomllib.loads(INTENTS_TOML)["intent"][0], "intentcase")

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
