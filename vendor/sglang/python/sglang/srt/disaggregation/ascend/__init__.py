from sglang.srt.disaggregation.ascend.conn import (
    AscendKVBootstrapServer,
    AscendKVManager,
    AscendKVReceiver,
    AscendKVSender,
)
