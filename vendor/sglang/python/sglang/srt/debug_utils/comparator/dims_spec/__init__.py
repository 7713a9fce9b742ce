from sglang.srt.debug_utils.comparator.dims_spec.dim_parser import parse_dim
from sglang.srt.debug_utils.comparator.dims_spec.dims_parser import (
    _SingletonDimUtil,
    parse_dims,
    resolve_dim_names,
)
from sglang.srt.debug_utils.comparator.dims_spec.tensor_naming import (
    apply_dim_names,
    find_dim_index,
    get_dim_names,
    resolve_dim_by_name,
    without_dim_names,
)
from sglang.srt.debug_utils.comparator.dims_spec.types import (
    _FUSED_NAME_SEP,
    BATCH_DIM_NAME,
    SEQ_DIM_NAME,
    SQUEEZE_DIM_NAME,
    TOKEN_DIM_NAME,
    DimSpec,
    DimsSpec,
    Ordering,
    ParallelAxis,
    ParallelModifier,
    Reduction,
    TokenLayout,
)

__all__ = [
    "BATCH_DIM_NAME",
    "SEQ_DIM_NAME",
    "SQUEEZE_DIM_NAME",
    "TOKEN_DIM_NAME",
    "DimsSpec",
    "DimSpec",
    "Ordering",
    "ParallelAxis",
    "ParallelModifier",
    "Reduction",
    "TokenLayout",
    "_FUSED_NAME_SEP",
    "_SingletonDimUtil",
    "apply_dim_names",
    "find_dim_index",
    "get_dim_names",
    "parse_dim",
    "parse_dims",
    "resolve_dim_by_name",
    "resolve_dim_names",
    "without_dim_names",
]
