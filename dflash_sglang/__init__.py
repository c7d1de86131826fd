"""dflash-sglang: DFlash block-diffusion speculative decoding for SGLang.

`import dflash_sglang` needs neither sglang nor CUDA: heavy modules are imported lazily.
"""
from __future__ import annotations

__version__ = "0.1.0"
