from sglang.srt.debug_utils.comparator.aligner.entrypoint.traced_types import (  # noqa: F401
    TracedAlignerPlan,
)
from sglang.srt.debug_utils.comparator.aligner.entrypoint.types import (  # noqa: F401
    AlignerPlan,
)
from sglang.srt.debug_utils.comparator.output_types import ComparisonTensorRecord

ComparisonTensorRecord.model_rebuild()
