"""Import-only stand-ins for GPU packages that SGLang imports at module level.

SGLang 0.5.17 imports triton, torchvision and vllm._custom_ops at the top of modules that the CPU
path loads but never executes. These stubs satisfy the imports; anything that would actually run
one of them (a kernel launch `kernel[grid](...)`, a vllm op) raises, so a CPU test can never pass
through a stub by accident. Test-only: never shipped in the package.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class ShimUsed(RuntimeError):
    """A stubbed GPU package was executed (not just imported) on the CPU test path."""


_CLASSES: dict[str, type] = {}


class _StubMeta(type):
    def __getattr__(cls, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return Stub(f"{cls.__qualname__}.{item}")


def _stub_class(name: str) -> type:
    """CamelCase names (`JITFunction`, `Config`) become real classes, so isinstance/subclassing work."""
    if name not in _CLASSES:

        def __init__(self, *args, **kwargs):
            pass

        def __getattr__(self, item):
            if item.startswith("__") and item.endswith("__"):
                raise AttributeError(item)
            return Stub(f"{name}().{item}")

        _CLASSES[name] = _StubMeta(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__getattr__": __getattr__})
    return _CLASSES[name]


def _attr(owner: str, item: str):
    if item.startswith("__") and item.endswith("__"):
        raise AttributeError(item)
    full = f"{owner}.{item}"
    return _stub_class(full) if item[:1].isupper() and not item.isupper() else Stub(full)


class Stub:
    """Any attribute, call, subscript or decoration yields another Stub; a kernel launch raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str):
        return _attr(self._name, item)

    def __call__(self, *args, **kwargs):
        # `@jit` / `@autotune(...)(fn)`: decorating a function gives a launchable kernel stub.
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], Stub):
            return Kernel(getattr(args[0], "__name__", self._name))
        if len(args) == 1 and not kwargs and isinstance(args[0], Kernel):
            return args[0]
        return Stub(f"{self._name}()")

    def __getitem__(self, item):
        return Stub(f"{self._name}[]")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<shim {self._name}>"

    def __bool__(self) -> bool:
        return False

    def __iter__(self):
        return iter(())


class Kernel(Stub):
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise ShimUsed(f"kernel {self._name!r} launched on the CPU shim")

        return launch

    def __call__(self, *args, **kwargs):
        raise ShimUsed(f"{self._name!r} called on the CPU shim")


class StubModule(types.ModuleType):
    def __getattr__(self, item: str):
        return _attr(self.__name__, item)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every submodule `<root>.x.y` of a stubbed root package as a StubModule."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(self.root + ".") or fullname in sys.modules:
            return None
        if importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
            return None  # a real shim file (e.g. vllm/_custom_ops.py) wins
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        mod = StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


def install(root_module: types.ModuleType) -> None:
    """Make `root_module` (a package __init__) answer unknown attributes and submodules with stubs."""
    root_module.__class__ = StubModule
    if not any(isinstance(f, _Finder) and f.root == root_module.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(root_module.__name__))
