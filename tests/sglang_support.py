"""Shared by the SGLang test files: the skip condition (a supported sglang must be installed) and what the version
seam's probes say about it, for test processes that do not import sglang."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SHIMS = Path(__file__).resolve().parent / "sglang_shims"
REPO = Path(__file__).resolve().parents[1]


def sglang_skip_reason() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (bash .ci/install_sglang.sh)"
    try:  # (metadata only: the version gate imports no sglang)
        import dflash_sglang.adapter.versions  # noqa: F401  (refuses a release outside the range)
    except ImportError as err:  # the adapter's own one-line refusal
        return str(err)
    return None


def in_child_env() -> dict[str, str]:
    """The environment of a child process that imports sglang: the import shims first, then this checkout."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIMS), str(REPO), os.environ.get("PYTHONPATH", "")])}


@functools.cache
def seam_probes() -> dict[str, bool]:
    """adapter/versions.py's probes of the installed SGLang, by name, asked in a child process (importing sglang
    changes the process it runs in)."""
    code = ("import json; from dflash_sglang.adapter import versions as v; "
            "print(json.dumps({name: getattr(v, name)() for name in v.PROBES}))")
    out = subprocess.run([sys.executable, "-c", code], env=in_child_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


requires_sglang = pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))


def flashinfer_gpu_reason() -> str | None:
    """Why a FlashInfer GPU test cannot run here (no CUDA device or no flashinfer), else None."""
    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
        return "needs a CUDA GPU and flashinfer"
    return None


requires_flashinfer_gpu = pytest.mark.skipif(flashinfer_gpu_reason() is not None, reason=str(flashinfer_gpu_reason()))
