"""How the drafter's K/V are stored between being projected and being attended to: the draft KV format.

The drafter attends to K/V it wrote earlier (the context rows, written at commit; in SGLang also the block's own rows,
written to the pool's scratch by the pass). A quantized draft KV cache changes what attention reads, so the format
belongs to the definition of the drafter, not to the server: `DFlashDrafter.kv_format` (core/draft/drafter.py) makes the
reference drafter read every K/V row through `roundtrip`, exactly what a pool stored in `dtype` returns.

Storage follows SGLang's own quantized KV (`MHATokenToKVPool.set_kv_buffer`): k / k_scale and v / v_scale cast with
torch's `.to(dtype)` (e4m3fn saturates at +-448 on the CPU), and read back as `x.to(compute dtype) * scale`. SGLang's
per-layer k_scale / v_scale are 1.0 unless a checkpoint ships them, and DFlash drafts ship none, so 1.0 is the
default; with scales of 1.0 a stored value re-stored after a read is unchanged (fp8 and bf16 values are exact in any
wider float), which is what lets the SGLang pool take K/V from the reference projection and quantize them again.

Names are SGLang's `--kv-cache-dtype` / `--speculative-draft-kv-cache-dtype` values (`parse_kv_dtype`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# SGLang's KV dtype names -> torch storage dtype; "auto" (None here) = the model dtype, no quantization
KV_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def parse_kv_dtype(name: str | None) -> torch.dtype | None:
    """An SGLang KV dtype name -> its torch storage dtype; None or "auto" -> None (the model dtype). Raises ValueError
    naming the accepted values (callers add the flag)."""
    if name is None or name == "auto":
        return None
    if name not in KV_DTYPES:
        raise ValueError(f"{name!r} is not a draft KV dtype (accepted: auto, {', '.join(KV_DTYPES)})")
    return KV_DTYPES[name]


@dataclass(frozen=True)
class DraftKVFormat:
    """K/V stored in `dtype` as x / scale, read back as stored.to(compute dtype) * scale."""

    dtype: torch.dtype
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        assert self.dtype.is_floating_point, self.dtype
        assert self.k_scale > 0 and self.v_scale > 0, (self.k_scale, self.v_scale)

    @property
    def element_size(self) -> int:
        """Bytes per stored element."""
        return torch.empty((), dtype=self.dtype).element_size()

    def quantizes(self, compute: torch.dtype) -> bool:
        """Whether storing in this format changes values computed in `compute` (False: a plain copy)."""
        return self.dtype != compute or self.k_scale != 1.0 or self.v_scale != 1.0

    def store(self, x: Tensor, scale: float) -> Tensor:
        """x [...] in the compute dtype -> the stored tensor [...] (self.dtype)."""
        return (x if scale == 1.0 else x / scale).to(self.dtype)

    def load(self, stored: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
        """stored [...] (self.dtype) -> the values attention reads [...] in `dtype`."""
        x = stored.to(dtype)
        return x if scale == 1.0 else x * scale

    def roundtrip(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [...] -> what a pool in this format returns for them, same shapes and dtype."""
        return (self.load(self.store(k, self.k_scale), self.k_scale, k.dtype),
                self.load(self.store(v, self.v_scale), self.v_scale, v.dtype))


def kv_format(name: str | None, compute: torch.dtype) -> DraftKVFormat | None:
    """The format of a draft KV dtype name for a drafter computing in `compute`; None when it stores values as they
    are ("auto", or the compute dtype itself)."""
    dtype = parse_kv_dtype(name)
    if dtype is None or dtype == compute:
        return None
    return DraftKVFormat(dtype)
