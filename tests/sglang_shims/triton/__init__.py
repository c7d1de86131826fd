"""Import-only triton stand-in for CPU tests (see tests/sglang_shims/_shim_stub.py)."""
import importlib

import _shim_stub

__version__ = "3.5.0"


def cdiv(a, b):
    return -(-a // b)


def next_power_of_2(n):
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


class _NoDriver:
    """Like real triton on a machine without a GPU: asking for the active driver raises."""

    @property
    def active(self):
        raise RuntimeError("0 active drivers ([]). There should only be one.")


_shim_stub.install(__import__(__name__))
runtime = importlib.import_module(__name__ + ".runtime")
runtime.driver = _NoDriver()
