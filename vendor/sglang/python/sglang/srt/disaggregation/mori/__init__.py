from sglang.srt.disaggregation.mori.conn import (
    MoriKVBootstrapServer,
    MoriKVManager,
    MoriKVReceiver,
    MoriKVSender,
)
