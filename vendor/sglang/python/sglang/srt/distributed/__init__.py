from sglang.srt.distributed.communication_op import *
from sglang.srt.distributed.parallel_state import *
from sglang.srt.distributed.utils import *
