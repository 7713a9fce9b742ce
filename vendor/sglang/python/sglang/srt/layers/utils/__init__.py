# Temp workaround, make layer utils more fine-grained later
from sglang.srt.layers.utils.common import *
