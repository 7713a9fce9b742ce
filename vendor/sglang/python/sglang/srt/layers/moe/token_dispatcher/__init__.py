from sglang.srt.layers.moe.token_dispatcher.ascend_tp import (
    AscendTPCombineInput,
    AscendTPDispatcher,
    AscendTPDispatchOutput,
)
from sglang.srt.layers.moe.token_dispatcher.base import (
    BaseDispatcher,
    BaseDispatcherConfig,
    CombineInput,
    CombineInputChecker,
    CombineInputFormat,
    DispatchOutput,
    DispatchOutputChecker,
    DispatchOutputFormat,
    RoutewiseCombineInput,
    RoutewiseLayout,
)
from sglang.srt.layers.moe.token_dispatcher.deepep import (
    DeepEPConfig,
    DeepEPDispatcher,
    DeepEPLLCombineInput,
    DeepEPLLDispatchOutput,
    DeepEPNormalCombineInput,
    DeepEPNormalDispatchOutput,
)
from sglang.srt.layers.moe.token_dispatcher.deepep_v2 import (
    DeepEPv2CombineInput,
    DeepEPv2Dispatcher,
    DeepEPv2DispatchOutput,
)
from sglang.srt.layers.moe.token_dispatcher.flashinfer import (
    FlashinferDispatcher,
    FlashinferDispatchOutput,
)
from sglang.srt.layers.moe.token_dispatcher.mooncake import (
    MooncakeCombineInput,
    MooncakeDispatchOutput,
    MooncakeEPDispatcher,
)
from sglang.srt.layers.moe.token_dispatcher.moriep import (
    MoriEPDispatcher,
    MoriEPLLCombineInput,
    MoriEPLLDispatchOutput,
    MoriEPNormalCombineInput,
    MoriEPNormalDispatchOutput,
)
from sglang.srt.layers.moe.token_dispatcher.nixl import (
    NixlEPCombineInput,
    NixlEPDispatcher,
    NixlEPDispatchOutput,
)
from sglang.srt.layers.moe.token_dispatcher.pplx import (
    PplxCombineInput,
    PplxDispatcher,
    PplxDispatchOutput,
)
from sglang.srt.layers.moe.token_dispatcher.standard import (
    StandardCombineInput,
    StandardDispatcher,
    StandardDispatchOutput,
)

__all__ = [
    "BaseDispatcher",
    "BaseDispatcherConfig",
    "CombineInput",
    "CombineInputChecker",
    "CombineInputFormat",
    "DispatchOutput",
    "DispatchOutputFormat",
    "DispatchOutputChecker",
    "RoutewiseCombineInput",
    "RoutewiseLayout",
    "FlashinferDispatchOutput",
    "FlashinferDispatcher",
    "MooncakeCombineInput",
    "MooncakeDispatchOutput",
    "MooncakeEPDispatcher",
    "MoriEPNormalDispatchOutput",
    "MoriEPNormalCombineInput",
    "MoriEPLLDispatchOutput",
    "MoriEPLLCombineInput",
    "MoriEPDispatcher",
    "DeepEPv2Dispatcher",
    "DeepEPv2DispatchOutput",
    "DeepEPv2CombineInput",
    "NixlEPCombineInput",
    "NixlEPDispatchOutput",
    "NixlEPDispatcher",
    "PplxCombineInput",
    "PplxDispatchOutput",
    "PplxDispatcher",
    "StandardDispatcher",
    "StandardDispatchOutput",
    "StandardCombineInput",
    "DeepEPConfig",
    "DeepEPDispatcher",
    "DeepEPNormalDispatchOutput",
    "DeepEPLLDispatchOutput",
    "DeepEPLLCombineInput",
    "DeepEPNormalCombineInput",
    "AscendTPDispatcher",
    "AscendTPDispatchOutput",
    "AscendTPCombineInput",
]
