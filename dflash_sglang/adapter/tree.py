"""The tree-specific pieces of a DFLASH decode step inside SGLang (tree mode: --speculative-eagle-topk > 1).

One drafter pass gives logits for block positions 1..B-1; `propose_tree` keeps each position's top-k and builds
the best-first tree of N nodes (`dflash_sglang.ops.build_tree`: kernel on CUDA, core reference on CPU). The
target verifies node i at position `seq_len + depth[i]` with its KV in the slot `req_to_token[req, seq_len + i]`
(all N slots are reserved for the request by `DFlashDraftInputV2.prepare_for_decode`). After acceptance,
`compact_path_slots` permutes the request's req_to_token entries inside `[seq_len, seq_len + N)` so that the
accepted path's slots sit at `seq_len + 0 .. accept_len` in order: the committed KV is then exactly what a
chain would have left, and the other slots stay reserved past the committed length, where the next step
overwrites them. A permutation inside the reserved window keeps slot ownership as SGLang tracks it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dflash_sglang import ops
from dflash_sglang.core.tree import DraftTree
from dflash_sglang.core.tree_verify import TreeAcceptResult


def propose_tree(bonus: Tensor, topk_tokens: Tensor, topk_logp: Tensor, nodes: int) -> DraftTree:
    """bonus [bs] int64 (the root), each draft position's top-k tokens [bs, B-1, k] int64 and log-probs [bs, B-1, k]
    float32 (adapter/tp.py `DraftVocab.topk`) -> best-first tree of `nodes` nodes."""
    return ops.build_tree(bonus.to(torch.int64), topk_tokens.contiguous(), topk_logp.contiguous(), nodes)


def fit_rows(out_tokens: Tensor, width: int) -> Tensor:
    """out_tokens [bs, D+1] (accepted tokens, bonus, then -1) -> [bs, width], cropped or -1 padded.

    SGLang reads row i of next_token_ids with stride `speculative_num_draft_tokens` (N) up to accept_lens[i],
    and a path never commits more than N tokens, so cropping drops only -1 padding.
    """
    have = out_tokens.shape[1]
    if have >= width:
        return out_tokens[:, :width]
    return torch.cat([out_tokens, out_tokens.new_full((out_tokens.shape[0], width - have), -1)], dim=1)


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
