"""Build and load the kernel library: cuda/*.cu -> one C-ABI shared library, called through ctypes.

torch.utils.cpp_extension cannot build CUDA against a CPU torch, and the ops need no torch C++ API anyway:
the launchers take raw pointers and a cudaStream_t. The library is built at first use with nvcc for the
current device's architecture (sm_90a / sm_100a / sm_XY), cached under
`$DFLASH_SGLANG_HOME/kernels` (default ~/.cache/dflash_sglang/kernels) in a directory keyed by the sources'
hash, the arch and the compiler version, so concurrent processes (TP ranks) build once and reuse it.

NOTE: the wrappers call ctypes directly instead of registering torch.library.custom_op ops: a custom_op's
dispatch costs more per call than the kernels themselves (`scripts/bench_ops.py --dispatch`; numbers in
docs/benchmarks.md). Nothing in the decode loop is traced by torch.compile;
CUDA graphs capture the ctypes launches as they are (the stream comes from torch.cuda.current_stream()).
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from . import _abi



def _cuda_dir() -> Path:
    """The kernel sources: the checkout's cuda/ (editable installs), else the copy shipped as dflash_sglang._cuda."""
    checkout = Path(__file__).resolve().parents[2] / "cuda"
    if (checkout / "common.cuh").is_file():
        return checkout
    return Path(__file__).resolve().parents[1] / "_cuda"


CUDA_DIR = _cuda_dir()
NVCC_FLAGS = ("-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")
HOST_FLAGS = ("-std=c++17", "-O2", "-ffp-contract=off", "-shared", "-fPIC")


class KernelLibrary:
    """A loaded library: `call(op, params, *extra)` runs `dflash_<op>` and raises on a non-zero status."""

    def __init__(self, path: Path, prefix: str):
        self.path, self._prefix = path, prefix
        self._lib = ctypes.CDLL(str(path))
        self._lib.dflash_last_error.restype = ctypes.c_char_p
        for name, struct in _abi.PARAMS.items():
            fn = getattr(self._lib, f"dflash_{name}_params_size")
            fn.restype = ctypes.c_int64
            if fn() != ctypes.sizeof(struct):
                raise RuntimeError(f"{path}: {name} params are {fn()} bytes in C but {ctypes.sizeof(struct)} in "
                                   f"dflash_sglang/ops/_abi.py; the two definitions have drifted")

    def call(self, op: str, params: ctypes.Structure, *extra) -> None:
        fn = getattr(self._lib, f"{self._prefix}{op}")
        if fn(ctypes.byref(params), *extra) != 0:
            raise ValueError(self._lib.dflash_last_error().decode())


BACKENDS = ("auto", "reference", "cuda", "host")


def resolve_backend(backend: str, device) -> str:
    """auto: the kernel on CUDA tensors, the core/ reference otherwise. host: the kernels' C++ logic on CPU."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "cuda" if device.type == "cuda" else "reference"
    if (backend == "cuda" and device.type != "cuda") or (backend == "host" and device.type != "cpu"):
        raise ValueError(f"backend {backend!r} cannot run on {device} tensors")
    return backend


def launch(backend: str, op: str, params: ctypes.Structure, device) -> None:
    """Run `op` on the CUDA library (current stream of `device`) or on the host harness."""
    if backend == "cuda":
        import torch

        lib = cuda_library(torch.cuda.get_device_capability(device))
        lib.call(op, params, ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream))
    else:
        assert backend == "host", backend
        host_library().call(op, params)


def load_kernels(device) -> Path | None:
    """Build (or find cached) and load the CUDA library for `device` now, e.g. at server start-up, so the first
    decode step neither compiles nor fails on a missing compiler. None on non-CUDA devices (the references run)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return cuda_library(torch.cuda.get_device_capability(device)).path


def cuda_arch(capability: tuple[int, int]) -> str:
    """sm_90a / sm_100a on Hopper / Blackwell (arch-specific SASS, no PTX JIT), sm_XY elsewhere."""
    major, minor = capability
    return f"sm_{major}{minor}{'a' if (major, minor) in ((9, 0), (10, 0)) else ''}"


@functools.cache
def cuda_library(capability: tuple[int, int]) -> KernelLibrary:
    nvcc = find_nvcc()
    arch = cuda_arch(capability)
    flags = (*NVCC_FLAGS, f"-gencode=arch=compute_{arch[3:]},code={arch}")
    sources = sorted(CUDA_DIR.glob("*.cu"))
    if not sources:
        raise RuntimeError(f"no CUDA kernel sources in {CUDA_DIR}: reinstall dflash-sglang (the wheel ships them)")
    lib = KernelLibrary(_build([nvcc, *flags], sources, arch, _version(nvcc)), "dflash_")
    for op in ("block_inputs", "build_tree", "verify_tree"):
        getattr(lib._lib, f"dflash_{op}").argtypes = [ctypes.POINTER(_abi.PARAMS[op]), ctypes.c_void_p]
    return lib


@functools.cache
def host_library() -> KernelLibrary:
    """The kernels' per-request logic compiled for the CPU (cuda/host_harness.cpp), for tests without a GPU."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) to build cuda/host_harness.cpp")
    lib = KernelLibrary(_build([cxx, *HOST_FLAGS], [CUDA_DIR / "host_harness.cpp"], "host", _version(cxx)),
                        "dflash_host_")
    for op in ("block_inputs", "build_tree", "verify_tree"):
        getattr(lib._lib, f"dflash_host_{op}").argtypes = [ctypes.POINTER(_abi.PARAMS[op])]
    return lib


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_SGLANG_HOME", "~/.cache/dflash_sglang")).expanduser() / "kernels"


def find_nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = str(Path(home) / "bin" / "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not Path(nvcc).exists():
        raise RuntimeError("dflash_sglang CUDA ops need nvcc (set CUDA_HOME or put nvcc on PATH) to build cuda/*.cu")
    return nvcc


def _version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout


def _build(command: list[str], sources: list[Path], tag: str, compiler_version: str) -> Path:
    digest = hashlib.sha256(compiler_version.encode() + " ".join(command).encode())
    for path in sorted(CUDA_DIR.glob("*.cu*")) + sorted(CUDA_DIR.glob("*.cpp")):
        digest.update(path.name.encode() + path.read_bytes())
    out_dir = cache_dir() / f"{tag}-{digest.hexdigest()[:16]}"
    target = out_dir / "libdflash_ops.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per directory; the others wait, then reuse
        if not target.exists():
            tmp = out_dir / f".{os.getpid()}.so"
            proc = subprocess.run([*command, *map(str, sources), "-o", str(tmp)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building {target} failed:\n{proc.stdout}{proc.stderr}")
            os.replace(tmp, target)  # atomic: readers never see a half-written library
    return target
