"""Verify/draft inputs for one DFlash step (the reference for the `block_inputs` CUDA op).

A draft block is `[last committed token, MASK x (B-1)]` at positions `seq_len .. seq_len + B - 1`, where
`seq_len` counts the committed tokens whose KV exists, so the bonus token sits at position `seq_len`.
A draft tree of N nodes is verified with node i at position `seq_len + depth[i]`; its KV goes to the slot
reserved for the i-th token after the prefix, `req_to_token[req, seq_len + i]`, and the accepted path is
compacted afterwards (see core/step/tree.py). The chain is the tree whose node i has depth i.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class BlockInputs:
    input_ids: Tensor  # [bs, n] int64: block (bonus, MASK...) or tree node tokens
    positions: Tensor  # [bs, n] int64: seq_len + j (block) or seq_len + depth (tree)
    out_cache_loc: Tensor | None  # [bs, n] int64: KV slot of each row (None without req_to_token)


def build_block_inputs(
    bonus: Tensor,
    seq_lens: Tensor,
    block_size: int,
    mask_token_id: int,
    req_to_token: Tensor | None = None,
    req_pool_indices: Tensor | None = None,
) -> BlockInputs:
    """Draft block inputs `[bonus, MASK x (B-1)]` for every request.

    bonus            [bs] int — last committed token of each request (its KV is not written yet)
    seq_lens         [bs] int — committed tokens with KV = position of the bonus token
    block_size       B >= 2
    mask_token_id    id written at block positions 1..B-1
    req_to_token     [R, W] int32 or None — SGLang's request -> KV slot table; None: no slot ids
    req_pool_indices [bs] int — row of req_to_token for each request (required with req_to_token)
    returns BlockInputs with input_ids / positions / out_cache_loc of shape [bs, B], int64
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    _check_batch(bonus=bonus, seq_lens=seq_lens)
    offs = torch.arange(block_size, device=bonus.device)
    ids = torch.full((bonus.shape[0], block_size), mask_token_id, dtype=torch.int64, device=bonus.device)
    ids[:, 0] = bonus
    positions = seq_lens.to(torch.int64)[:, None] + offs
    return BlockInputs(ids, positions, _slots(seq_lens, block_size, req_to_token, req_pool_indices))


def build_tree_inputs(
    tokens: Tensor,
    depth: Tensor,
    seq_lens: Tensor,
    req_to_token: Tensor | None = None,
    req_pool_indices: Tensor | None = None,
) -> BlockInputs:
    """Target verify inputs for a draft tree (node 0 = the bonus token at depth 0).

    tokens [bs, N] int64 — node tokens; depth [bs, N] int — node depths (core/step/tree.py DraftTree)
    seq_lens, req_to_token, req_pool_indices as in build_block_inputs
    returns BlockInputs [bs, N]: input_ids = tokens, positions = seq_len + depth,
    out_cache_loc = req_to_token[req, seq_len + node index]
    """
    check_tree_batch(tokens, depth, seq_lens)
    positions = seq_lens.to(torch.int64)[:, None] + depth.to(torch.int64)
    slots = _slots(seq_lens, tokens.shape[1], req_to_token, req_pool_indices)
    return BlockInputs(tokens.to(torch.int64), positions, slots)


def check_tree_batch(tokens: Tensor, depth: Tensor, seq_lens: Tensor) -> None:
    """build_tree_inputs' arguments, checked at the boundary (here and in ops/block.py before a kernel launch)."""
    if tokens.dim() != 2 or tokens.shape != depth.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and depth {tuple(depth.shape)} must both be [bs, N]")
    _check_batch(tokens=tokens[:, 0], seq_lens=seq_lens)


def _check_batch(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if any(len(s) != 1 for s in shapes.values()) or len(set(shapes.values())) != 1:
        raise ValueError(f"expected [bs] tensors of one batch size, got {shapes}")


def _slots(seq_lens: Tensor, n: int, req_to_token: Tensor | None, req_pool_indices: Tensor | None) -> Tensor | None:
    """[bs, n] int64 slot ids req_to_token[req, seq_len + j], or None without a table."""
    if req_to_token is None:
        return None
    if req_pool_indices is None or req_pool_indices.shape != seq_lens.shape:
        raise ValueError("req_pool_indices [bs] is required with req_to_token")
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be [R, W], got {tuple(req_to_token.shape)}")
    if len(seq_lens) and int(seq_lens.max()) + n > req_to_token.shape[1]:
        raise ValueError(f"seq_len + {n} exceeds req_to_token width {req_to_token.shape[1]}")
    cols = seq_lens.to(torch.int64)[:, None] + torch.arange(n, device=seq_lens.device)
    return req_to_token[req_pool_indices.to(torch.int64)[:, None], cols].to(torch.int64)


def draft_kv_indices(
    kv_indptr: Tensor, req_pool_indices: Tensor, req_to_token: Tensor | None, scratch_base: int, block: int,
    out: Tensor, seq_lens: Tensor | None = None, ring: int = 0,
) -> Tensor:
    """Key rows of one drafter pass over the paged draft pool (the reference for the `draft_layout` CUDA op).

    Request i's keys are its last ctx_len = kv_len - block committed context positions p = start + t, then its block
    rows: out[kv_indptr[i] + t] = the row of p for t < ctx_len, else scratch_base + r*block + (t - ctx_len), with
    r = req_pool_indices[i], kv_len = kv_indptr[i+1] - kv_indptr[i] and start = seq_lens[i] - ctx_len (a draft
    window's last W positions: ctx_len = min(seq_len, W)), or start = 0 without seq_lens (the whole context: ctx_len =
    seq_len). The row of position p: req_to_token[r, p] (the slot rows; -1 when r or p is outside the table), or, with
    ring = R > 0, r*R + p % R (a draft window's ring of R rows per request slot; -1 for r or p < 0; no table read).

    kv_indptr [bs+1] int (device), req_pool_indices [bs] int, req_to_token [R, W] int32 (None with a ring), out
    [capacity] int32 with capacity >= kv_indptr[bs]; rows past kv_indptr[bs] are left as they are; seq_lens [bs] int
    committed lengths (device) or None (required with a ring). Fixed shapes and no host read (this runs inside the draft
    CUDA graph's static replay), so the work is O(capacity).
    """
    assert ring == 0 or seq_lens is not None, "a ring's rows follow positions: seq_lens"
    cap, bs = out.numel(), req_pool_indices.numel()
    indptr = kv_indptr.to(torch.int64)
    row = torch.arange(cap, device=out.device)
    owner = torch.searchsorted(indptr[1:].contiguous(), row, right=True)  # request of each row; bs past the end
    req = owner.clamp(max=max(bs - 1, 0))
    offset = row - indptr[req]
    ctx_len = indptr[req + 1] - indptr[req] - block
    pool_row = req_pool_indices.to(torch.int64)[req] if bs else torch.zeros_like(req)
    position = offset if seq_lens is None or not bs else seq_lens.to(torch.int64)[req] - ctx_len + offset
    if ring:
        inside = (pool_row >= 0) & (position >= 0)
        ctx_row = pool_row * ring + position.remainder(ring)
    else:
        rows, width = req_to_token.shape
        ctx_row = req_to_token[pool_row.clamp(0, rows - 1), position.clamp(0, width - 1)].to(torch.int64)
        inside = (pool_row >= 0) & (pool_row < rows) & (position >= 0) & (position < width)
    ctx_row = torch.where(inside, ctx_row, -1)  # a context outside the table (or before position 0) reads as -1
    value = torch.where(offset < ctx_len, ctx_row, scratch_base + pool_row * block + offset - ctx_len)
    return out.copy_(torch.where(owner < bs, value.to(out.dtype), out))
