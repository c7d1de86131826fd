"""Draft proposals when the vocabulary is split across tensor-parallel ranks.

Under tensor parallelism the target's lm_head is vocab-parallel: rank r holds the rows of a contiguous id range
(plus padding rows). The drafter is small, so every rank runs it whole, but its logits through the local rows cover
only that range. Rather than gathering [bs, B-1, V] logits, each rank reduces its shard to k candidates and its
log-sum-exp, the ranks exchange those (k + 1 numbers per position), and every rank merges them to exactly the
full-vocabulary result: the argmax (a chain's drafts), the top-k tokens with their log-probabilities (a tree's
candidates, normalised by the global log-sum-exp) or with their logits (`merge_top`: a DFlash2 selector's candidates,
core/draft/selector.py). Ties go to the lowest id, as `argmax` does over the whole vocabulary, for k > 1 too
(`ordered_topk`: torch's topk leaves which of tied values it keeps unspecified), so the merge over any split equals one
process's top-k exactly; in bf16 draft logits ties are common. Every function here that returns token ids with their
scores returns the ids first, (ids, values); `ordered_topk`, torch's topk with a tie rule, keeps torch's (values,
indices).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of the draft vocabulary: local row i is token id start + i for i < size (or ids[i], with a
    reduced draft vocabulary: the token map's ids in this rank's range); rows past size are padding (or past the
    draft's vocabulary) and never proposed."""

    start: int
    size: int
    ids: Tensor | None = None  # [size] int64 token ids of the rows, ascending; None: start + row


def ordered_topk(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """values [..., n] -> (the k largest [..., k] float32, their indices [..., k] int64), best first, ties to the
    lowest index: a top-k over unique int64 keys (the value's float32 bits made order-preserving, then the index
    reversed), so whichever tied entries torch's topk would keep does not matter."""
    x = values.float() + 0.0  # -0.0 -> +0.0: the two compare equal, their bits do not
    bits = x.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: larger magnitude, smaller key
    low = (1 << 32) - 1
    keys = ordered * (1 << 32) + (low - torch.arange(x.shape[-1], device=x.device))
    index = low - (keys.topk(k, dim=-1).values & low)
    return x.gather(-1, index), index


def local_top(logits: Tensor, shard: VocabShard, k: int) -> tuple[Tensor, Tensor]:
    """logits [..., V_local] over this rank's rows -> (token ids [..., k] int64, values [..., k] float32): the shard's
    k best, best first, ties to the lowest id. A shard with fewer than k rows pads with -inf values (ids of padding:
    -1). One process's whole vocabulary is the shard VocabShard(0, V) (or VocabShard(0, K, token_map))."""
    valid = logits[..., : shard.size].float()
    if valid.shape[-1] < k:
        pad = valid.new_full((*valid.shape[:-1], k - valid.shape[-1]), float("-inf"))
        valid = torch.cat([valid, pad], dim=-1)
    if k > 1:
        values, rows = ordered_topk(valid, k)
    else:
        values, rows = valid.max(dim=-1, keepdim=True)  # the first maximum: the lowest id among ties
    if shard.ids is None:
        return rows + shard.start, values
    ids = torch.cat([shard.ids, shard.ids.new_full((max(k - shard.size, 0),), -1)])  # ids of the padded rows
    return ids[rows], values


def local_candidates(logits: Tensor, shard: VocabShard, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """logits [..., V_local] over this rank's rows -> `local_top`'s (ids, values) and the shard's log-sum-exp [...]
    float32 (what normalises the merged values to log-probabilities)."""
    ids, values = local_top(logits, shard, k)
    return ids, values, torch.logsumexp(logits[..., : shard.size].float(), dim=-1)


def merge_top(ids: Tensor, values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Every rank's `local_top`, stacked in rank order (ids / values [R, ..., k]) -> (token ids [..., k] int64, values
    [..., k] float32): the k best over the whole vocabulary, best first, ties to the lowest id."""
    flat_values = values.movedim(0, -2).flatten(-2)  # [..., R*k], rank-major: lower ids first, and so within a rank
    flat_ids = ids.movedim(0, -2).flatten(-2)
    if k == 1:
        best = flat_values.argmax(dim=-1, keepdim=True)  # the first maximum: the lowest id among ties
        top_values = flat_values.gather(-1, best)
    else:
        top_values, best = ordered_topk(flat_values, k)
    return flat_ids.gather(-1, best), top_values


def merge_candidates(ids: Tensor, values: Tensor, lse: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Every rank's `local_candidates`, stacked in rank order (ids / values [R, ..., k], lse [R, ...]) -> (token ids
    [..., k] int64, log-probabilities [..., k] float32) over the whole vocabulary, best first."""
    tokens, top_values = merge_top(ids, values, k)
    total = torch.logsumexp(lse, dim=0) if lse.shape[0] > 1 else lse[0]
    return tokens, top_values - total[..., None]


NOT_RANKED = 2**31 - 1  # the rank of a token the drafter cannot propose (outside its rows or token map)


def local_ranks(logits: Tensor, shard: VocabShard, tokens: Tensor) -> Tensor:
    """logits [bs, m, V_local] over the shard's rows, tokens [bs, m] int64 target ids -> [bs, m] int64: the
    drafter's rank of each token at its position (1 + the rows whose logit beats the token's; ties do not), or
    NOT_RANKED where the token has no row here. One process's whole vocabulary is the shard VocabShard(0, V)."""
    valid = logits[..., : shard.size].float()
    tokens = tokens.to(torch.int64)
    if shard.ids is None:
        rows = tokens - shard.start
        present = (rows >= 0) & (rows < shard.size)
    else:
        order = torch.argsort(shard.ids)
        ids = shard.ids[order]
        at = torch.searchsorted(ids, tokens).clamp_max(max(shard.size - 1, 0))
        present = ids[at] == tokens
        rows = order[at]
    value = valid.gather(-1, rows.clamp(0, max(shard.size - 1, 0))[..., None])
    ranks = (valid > value).sum(-1) + 1
    return torch.where(present, ranks, torch.full_like(ranks, NOT_RANKED))
