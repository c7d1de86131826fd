"""How a decode step's verify rows map onto SGLang's tables (the proposal and acceptance are core's).

A step's rows (a chain, or core's best-first tree of N nodes built by `dflash_sglang.ops.build_tree`) are verified
with node i at position `seq_len + depth[i]` (a chain: depth i) and its KV in the slot `req_to_token[req, seq_len +
i]` (all N slots are reserved for the request by `DFlashDraftInputV2.prepare_for_decode`). After a tree's
acceptance, `compact_path_slots` permutes the request's req_to_token entries inside `[seq_len, seq_len + N)` so that
the accepted path's slots sit at `seq_len + 0 .. accept_len` in order: the committed KV is then exactly what a
chain would have left, and the other slots stay reserved past the committed length, where the next step
overwrites them. A permutation inside the reserved window keeps slot ownership as SGLang tracks it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dflash_sglang.core.tree_verify import TreeAcceptResult


def fit_rows(out_tokens: Tensor, max_nodes: int) -> Tensor:
    """out_tokens [bs, D+1] (accepted tokens, bonus, then -1) -> [bs, N] (N = max_nodes), cropped or -1 padded.

    SGLang reads row i of next_token_ids with stride `speculative_num_draft_tokens` (N) up to accept_lens[i],
    and a path never commits more than N tokens, so cropping drops only -1 padding.
    """
    have = out_tokens.shape[1]
    if have >= max_nodes:
        return out_tokens[:, :max_nodes]
    return torch.cat([out_tokens, out_tokens.new_full((out_tokens.shape[0], max_nodes - have), -1)], dim=1)


def compact_path_slots(
    req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor, result: TreeAcceptResult
) -> None:
    """Permute req_to_token[req, seq_len : seq_len + N] in place: the accepted path's slots first, in path
    order, then the other nodes' slots in node order.

    req_to_token [R, W] int32 (SGLang's table), req_pool_indices [bs], seq_lens [bs] committed lengths before
    the step, result.commit_loc [bs, D+1] / free_loc [bs, N-1] (-1 padded, from the tree verify). Pure device
    ops (no host sync), so it runs on the overlap forward stream like the rest of the step.
    """
    assert result.commit_loc is not None and result.free_loc is not None, "verify the tree with out_cache_loc"
    nodes = result.free_loc.shape[1] + 1
    ordered = torch.cat([result.commit_loc, result.free_loc], dim=1)
    # Each row holds exactly N valid slots (accept_len + 1 kept, N - 1 - accept_len freed); a stable sort on
    # "is padding" moves them to the front in order.
    first = (ordered < 0).to(torch.int32).argsort(dim=1, stable=True)[:, :nodes]
    rows = req_pool_indices.to(torch.int64)[:, None]
    cols = seq_lens.to(torch.int64)[:, None] + torch.arange(nodes, device=seq_lens.device)
    req_to_token[rows, cols] = ordered.gather(1, first).to(req_to_token.dtype)
