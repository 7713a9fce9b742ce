from sglang.srt.debug_utils.comparator.aligner.token_aligner.concat_steps.executor import (
    execute_token_aligner_concat_steps,
)

__all__ = [
    "execute_token_aligner_concat_steps",
]
