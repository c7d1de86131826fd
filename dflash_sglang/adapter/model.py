"""The DFlash drafter inside SGLang: core weights over a paged draft KV pool.

The draft keeps one K/V row per target KV slot, under the target's slot ids (SGLang's allocator and
`req_to_token` table are shared), so radix-cache prefix hits, chunked prefill and request aborts need
no bookkeeping of their own: a slot's draft row is written whenever the slot's target KV is committed
and is dead when the slot is freed.

- `commit` turns target features of committed tokens into every layer's context K/V (fc + hidden_norm,
  then each layer's k_proj/k_norm/RoPE and v_proj, i.e. `DFlashDrafter.context_kv`) and writes them at
  the tokens' slots.
- `draft` runs one non-causal block pass whose keys/values are [the request's committed context rows |
  the block rows]: the block's K/V go to per-request scratch rows past the target's slots and each layer
  is one ragged paged prefill over the pool (adapter/draft_attention.py: FlashInfer on CUDA, torch on
  CPU). Drafters with causal or sliding-window layers take the dense path instead: context rows gathered
  through `req_to_token` into padded tensors and the core drafter's masked attention.

The weights come from the z-lab checkpoint through `dflash_sglang.core.checkpoint.load_drafter`, with
the same parameter names, so what SGLang serves is exactly what the reference decoder runs.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from dflash_sglang.core.checkpoint import load_drafter
from dflash_sglang.core.config import DraftConfig
from dflash_sglang.core.drafter import KV, Attend, DFlashDrafter

from .draft_attention import DraftLayout, build_layout, select_backend


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
    """A `DFlashDrafter` whose context K/V live in a `DraftKVPool` indexed by target slot ids.

    Pool rows [0, scratch_base) mirror the target's KV slots; rows scratch_base + r*B .. + B-1 are the block
    scratch of request-pool slot r (B = block size), written by every paged drafter pass.
    """

    def __init__(self, drafter: DFlashDrafter, pool: DraftKVPool, scratch_base: int, block: int) -> None:
        self.drafter = drafter
        self.cfg = drafter.cfg
        self.pool = pool
        self.scratch_base, self.block = scratch_base, block
        cfg = self.cfg
        plain = all(not cfg.layer_is_causal(i) and cfg.layer_window(i) is None for i in range(cfg.num_hidden_layers))
        self.attention = (select_backend(pool.k.device, cfg.num_attention_heads, cfg.num_key_value_heads,
                                         cfg.head_dim, pool.k.dtype) if plain else None)

    @classmethod
    def load(cls, draft_dir: str | Path, slots: int, req_slots: int, block: int, dtype: torch.dtype, device,
             dummy: bool = False) -> PagedDrafter:
        """slots: target KV slots (pool rows mirrored), req_slots: request-pool slots (block scratch owners).
        dummy: random weights of the checkpoint's config (`--speculative-draft-load-format dummy`), no weight
        files read, for capacity planning with simulated acceptance."""
        if dummy:
            drafter = random_drafter(DraftConfig.load(draft_dir), device, dtype)
        else:
            drafter = load_drafter(draft_dir, device=device, dtype=dtype).eval()
        cfg = drafter.cfg
        pool = DraftKVPool(cfg.num_hidden_layers, slots + req_slots * block, cfg.num_key_value_heads, cfg.head_dim,
                           dtype, device)
        return cls(drafter, pool, slots, block)

    @property
    def backend_name(self) -> str:
        return self.attention.name if self.attention is not None else "dense (causal / sliding-window layers)"

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
    def draft(self, block_embeds: Tensor, positions: Tensor, req_to_token: Tensor, req_pool_indices: Tensor,
              seq_lens: Tensor, seq_lens_cpu: Tensor | None = None) -> Tensor:
        """One drafter pass per request.

        block_embeds     [bs, B, H]  target embeddings of [bonus, MASK...] (times input_embedding_scale)
        positions        [bs, B] int64  absolute positions of the block rows (seq_len + j)
        req_to_token     SGLang's [pool_reqs, max_ctx] slot table; req_pool_indices [bs]
        seq_lens         [bs] committed tokens per request (the context is slots 0..seq_len-1)
        seq_lens_cpu     [bs] the same on the host when the scheduler has it (SGLang's exact mirror), else None
        returns          [bs, B, H] final-normed drafter states
        """
        assert block_embeds.shape[1] == self.block, "the block size the scratch rows were sized for"
        if seq_lens_cpu is None:
            seq_lens_cpu = seq_lens.to("cpu", torch.int64)  # a host sync: the ragged sizes plan the pass
        if self.attention is None:
            return self._draft_dense(block_embeds, positions, req_to_token, req_pool_indices, seq_lens_cpu)
        layout = build_layout(req_to_token, req_pool_indices, seq_lens_cpu, self.block, self.scratch_base)
        self.attention.plan(layout)
        bs, b, hidden = block_embeds.shape
        attends = [self._paged_attend(i, layout) for i in range(self.cfg.num_hidden_layers)]
        # The whole batch as one sequence of bs*B rows: the layout says which keys each row sees.
        out = self.drafter.run_layers(block_embeds.to(self.dtype).reshape(1, bs * b, hidden),
                                      positions.reshape(1, bs * b), attends)
        return out.view(bs, b, hidden)

    def _paged_attend(self, layer: int, layout: DraftLayout) -> Attend:
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]

        def attend(q: Tensor, k_blk: Tensor, v_blk: Tensor) -> Tensor:
            # q [1, h, T, d], k_blk / v_blk [1, kvh, T, d] -> [1, h, T, d]
            k_pool[layout.block_rows] = k_blk[0].transpose(0, 1)
            v_pool[layout.block_rows] = v_blk[0].transpose(0, 1)
            return self.attention.run(q[0].transpose(0, 1), k_pool, v_pool).transpose(0, 1)[None]

        return attend

    def _draft_dense(self, block_embeds: Tensor, positions: Tensor, req_to_token: Tensor, req_pool_indices: Tensor,
                     seq_lens_cpu: Tensor) -> Tensor:
        """Context rows gathered into [bs, S] padded tensors, the core drafter's masked attention (any layer
        type; memory grows with bs x the longest context)."""
        device = block_embeds.device
        bs, width = seq_lens_cpu.numel(), int(seq_lens_cpu.max()) if seq_lens_cpu.numel() else 0
        ctx_pos = torch.arange(width, device=device).expand(bs, width)
        ctx_slots = req_to_token[req_pool_indices.to(torch.int64)[:, None], ctx_pos].to(torch.int64)
        ctx_valid = ctx_pos < seq_lens_cpu.to(device)[:, None]
        ctx_kv = self.pool.gather(ctx_slots)
        return self.drafter(block_embeds.to(self.dtype), positions, ctx_kv, ctx_pos, ctx_valid=ctx_valid)

    @torch.inference_mode()
    def draft_logits(self, hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
        """hidden [bs, B, H] -> draft logits [bs, B-1, V] for block positions 1..B-1 (lm_head dtype).

        Proposals taken from them are point masses (the chain's argmax, the tree's top-k nodes), which keeps
        rejection sampling lossless for any target sampling settings.
        """
        return self.drafter.logits(hidden[:, 1:].to(lm_head_weight.dtype), lm_head_weight)
