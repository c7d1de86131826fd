"""Import-only torchvision stand-in for CPU tests (see tests/sglang_shims/_shim_stub.py)."""
import _shim_stub

__version__ = "0.26.0"
_shim_stub.install(__import__(__name__))
