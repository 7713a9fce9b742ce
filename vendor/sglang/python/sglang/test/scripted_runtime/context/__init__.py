from sglang.test.scripted_runtime.context.api import ScriptedContext

__all__ = ["ScriptedContext"]
