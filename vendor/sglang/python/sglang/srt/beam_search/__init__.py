from sglang.srt.beam_search.beam_group import BeamGroup, BeamResult, CompletedBeam
from sglang.srt.beam_search.history import BeamNode, materialize_tokens
from sglang.srt.beam_search.joint_select import (
    FinalSelect,
    SelectResult,
    joint_select,
    select_final_topk,
)

__all__ = [
    "BeamGroup",
    "BeamNode",
    "BeamResult",
    "CompletedBeam",
    "FinalSelect",
    "SelectResult",
    "joint_select",
    "materialize_tokens",
    "select_final_topk",
]
