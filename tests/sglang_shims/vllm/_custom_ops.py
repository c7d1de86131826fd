"""Import-only `vllm._custom_ops`: every op is a stub that raises ShimUsed when called."""
import _shim_stub


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _shim_stub.Kernel(f"vllm._custom_ops.{name}")
