"""The DFlash drafter inside SGLang: core weights over a paged draft KV pool.

The draft keeps one K/V row per target KV slot, under the target's slot ids (SGLang's allocator and
`req_to_token` table are shared), so radix-cache prefix hits, chunked prefill and request aborts need
no bookkeeping of their own: a slot's draft row is written whenever the slot's target KV is committed
and is dead when the slot is freed.

- `commit` turns target features of committed tokens into every layer's context K/V (fc + hidden_norm,
  then each layer's k_proj/k_norm/RoPE and v_proj, i.e. `DFlashDrafter.context_kv`) and writes them at
  the tokens' slots.
- `draft` runs one non-causal block pass whose keys/values are [the request's committed context rows |
  the block rows]. The attention here is plain torch over rows gathered through `req_to_token`
  (the CPU path, and a correct but memory-hungry fallback on GPU).

The weights come from the z-lab checkpoint through `dflash_sglang.core.checkpoint.load_drafter`, with
the same parameter names, so what SGLang serves is exactly what the reference decoder runs.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from dflash_sglang.core.checkpoint import load_drafter
from dflash_sglang.core.config import DraftConfig
from dflash_sglang.core.drafter import KV, DFlashDrafter


class DraftKVPool:
    """k, v [num_layers, rows, kv_heads, head_dim]; row i belongs to target KV slot i."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        shape = (num_layers, rows, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer_kv: list[KV], slots: Tensor) -> None:
        """layer_kv: per layer (k, v) [1, kvh, N, d] for N tokens; slots [N] int64 target KV slots."""
        for layer, (k, v) in enumerate(layer_kv):
            self.k[layer, slots] = k[0].transpose(0, 1)
            self.v[layer, slots] = v[0].transpose(0, 1)

    def gather(self, slots: Tensor) -> list[KV]:
        """slots [bs, S] int64 -> per layer (k, v) [bs, kvh, S, d]."""
        return [(self.k[layer, slots].transpose(1, 2), self.v[layer, slots].transpose(1, 2)) for layer in range(self.k.shape[0])]


@torch.no_grad()
def random_drafter(cfg: DraftConfig, device, dtype: torch.dtype) -> DFlashDrafter:
    """A drafter of cfg's shapes with small random weights (SGLang's dummy loader draws U(-1e-3, 1e-3)); norm
    weights stay at their init of ones, so activations stay finite at any depth."""
    with torch.device(device):
        model = DFlashDrafter(cfg).to(dtype)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            p.uniform_(-1e-3, 1e-3)
    return model.eval()


class PagedDrafter:
    """A `DFlashDrafter` whose context K/V live in a `DraftKVPool` indexed by target slot ids."""

    def __init__(self, drafter: DFlashDrafter, pool: DraftKVPool) -> None:
        self.drafter = drafter
        self.cfg = drafter.cfg
        self.pool = pool

    @classmethod
    def load(cls, draft_dir: str | Path, rows: int, dtype: torch.dtype, device, dummy: bool = False) -> PagedDrafter:
        """dummy: random weights of the checkpoint's config (`--speculative-draft-load-format dummy`), no weight
        files read, for capacity planning with simulated acceptance."""
        if dummy:
            drafter = random_drafter(DraftConfig.load(draft_dir), device, dtype)
        else:
            drafter = load_drafter(draft_dir, device=device, dtype=dtype).eval()
        cfg = drafter.cfg
        pool = DraftKVPool(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        return cls(drafter, pool)

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    @torch.inference_mode()
    def commit(self, target_hidden: Tensor, positions: Tensor, slots: Tensor) -> None:
        """Write the context K/V of committed tokens.

        target_hidden [N, n_features * H]  target layer outputs at the draft's layer ids, concatenated
        positions     [N] int64            absolute positions of the tokens
        slots         [N] int64            their target KV slots
        """
        if slots.numel() == 0:
            return
        ctx = self.drafter.fuse(target_hidden.to(self.dtype))[None]
        self.pool.write(self.drafter.context_kv(ctx, positions.to(torch.int64)[None]), slots.to(torch.int64))

    @torch.inference_mode()
    def draft(self, block_embeds: Tensor, positions: Tensor, ctx_slots: Tensor, ctx_lens: Tensor) -> Tensor:
        """One drafter pass per request.

        block_embeds [bs, B, H]  target embeddings of [bonus, MASK...] (times input_embedding_scale)
        positions    [bs, B] int64  absolute positions of the block rows (seq_len + j)
        ctx_slots    [bs, S] int64  KV slots of each request's committed tokens 0..S-1 (padded rows: any slot)
        ctx_lens     [bs] int64     committed tokens per request (rows >= ctx_len are padding)
        returns      [bs, B, H] final-normed drafter states
        """
        bs, s_len = ctx_slots.shape
        ctx_pos = torch.arange(s_len, device=ctx_slots.device).expand(bs, s_len)
        ctx_valid = ctx_pos < ctx_lens[:, None]
        ctx_kv = self.pool.gather(ctx_slots)
        return self.drafter(block_embeds.to(self.dtype), positions, ctx_kv, ctx_pos, ctx_valid=ctx_valid)

    @torch.inference_mode()
    def draft_logits(self, hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
        """hidden [bs, B, H] -> draft logits [bs, B-1, V] for block positions 1..B-1 (lm_head dtype).

        Proposals taken from them are point masses (the chain's argmax, the tree's top-k nodes), which keeps
        rejection sampling lossless for any target sampling settings.
        """
        return self.drafter.logits(hidden[:, 1:].to(lm_head_weight.dtype), lm_head_weight)
