"""Import-only vllm stand-in for CPU tests: only `vllm._custom_ops` is imported by SGLang."""
import _shim_stub

__version__ = "0.0.0"
_shim_stub.install(__import__(__name__))
