from sglang.srt.disaggregation.nixl.conn import (
    NixlKVBootstrapServer,
    NixlKVManager,
    NixlKVReceiver,
    NixlKVSender,
)
