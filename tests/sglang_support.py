"""Shared by the SGLang test files: the skip condition (sglang 0.5.17 must be installed)."""
from __future__ import annotations

import importlib.util
from importlib.metadata import version

import pytest


def sglang_skip_reason() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (bash .ci/install_sglang.sh)"
    if version("sglang") not in ("0.5.17", "0.5.23"):
        return f"needs sglang 0.5.17, found {version('sglang')}"
    return None


requires_sglang = pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))


def flashinfer_gpu_reason() -> str | None:
    """Why a FlashInfer GPU test cannot run here (no CUDA device or no flashinfer), else None."""
    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
        return "needs a CUDA GPU and flashinfer"
    return None


requires_flashinfer_gpu = pytest.mark.skipif(flashinfer_gpu_reason() is not None, reason=str(flashinfer_gpu_reason()))
