"""The draft KV pool: K and V of every draft layer per pool row, in the model dtype or fp8 (core/draft/draft_kv.py).

Rows: the context rows first (one per target KV slot, or a draft window's rings: draft/context_rows.py), then one
block of scratch rows per request-pool slot and one for the padded requests of a graph replay.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dflash_sglang.core.draft.config import DraftConfig
from dflash_sglang.core.draft.draft_kv import DraftKVFormat, kv_format
from dflash_sglang.core.draft.drafter import KV


class DraftKVPool:
    """k, v [num_layers, rows, kv_heads, head_dim]; context rows first (row i: target KV slot i, or a window ring's row,
    adapter/draft_window.py), then the block scratch.

    Stored in `dtype` (the drafter's compute dtype) or, with a `kv_format` (core/draft/draft_kv.py: fp8 draft KV), in
    the format's dtype: `write` quantizes, `gather` and the attention backends read the stored values back in `dtype`.
    """

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 kv_format: DraftKVFormat | None = None) -> None:
        assert kv_format is None or kv_format.quantizes(dtype), "a format that stores values as computed is None"
        shape = (num_layers, rows, kv_heads, head_dim)
        self.dtype, self.kv_format = dtype, kv_format  # compute dtype, storage format
        store = dtype if kv_format is None else kv_format.dtype
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def store(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [..., kvh, d] in the compute dtype -> as stored (the pool's dtype)."""
        fmt = self.kv_format
        if fmt is None:
            return k, v
        return fmt.store(k, fmt.k_scale), fmt.store(v, fmt.v_scale)

    def load(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Stored rows k, v [...] -> the values attention reads, in the compute dtype."""
        fmt = self.kv_format
        if fmt is None:
            return k, v
        return fmt.load(k, fmt.k_scale, self.dtype), fmt.load(v, fmt.v_scale, self.dtype)

    def write(self, layer_kv: list[KV], slots: Tensor) -> None:
        """layer_kv: per layer (k, v) [1, kvh, N, d] for N tokens; slots [N] int64 target KV slots."""
        for layer, (k, v) in enumerate(layer_kv):
            k, v = self.store(k[0].transpose(0, 1), v[0].transpose(0, 1))
            self.k[layer, slots] = k
            self.v[layer, slots] = v

    def gather(self, slots: Tensor) -> list[KV]:
        """slots [bs, S] int64 -> per layer (k, v) [bs, kvh, S, d] (compute dtype)."""
        out = []
        for layer in range(self.k.shape[0]):
            k, v = self.load(self.k[layer, slots], self.v[layer, slots])
            out.append((k.transpose(1, 2), v.transpose(1, 2)))
        return out


def pool_rows(slots: int, req_slots: int, block: int) -> int:
    """Rows of a draft pool: `slots` context rows (mirrored target KV slots, or the window rings), then one block of
    scratch per request-pool slot and one for the padded requests of a graph replay (`PagedDrafter`)."""
    return slots + (req_slots + 1) * block


def new_pool(cfg: DraftConfig, context_rows: int, req_slots: int, block: int, dtype: torch.dtype, device,
             kv_dtype: str | None = None) -> DraftKVPool:
    """A draft pool of `pool_rows(context_rows, req_slots, block)` rows for a draft of config cfg, stored in kv_dtype
    (SGLang's name; None / "auto": dtype)."""
    return DraftKVPool(cfg.num_hidden_layers, pool_rows(context_rows, req_slots, block), cfg.num_key_value_heads,
                       cfg.head_dim, dtype, device, kv_format(kv_dtype, dtype))
