"""The DFlash training objective: random anchors, the block-sparse training mask, decay-weighted CE.

One drafter forward per sequence drafts N blocks at once (dflash_spec.md 4). Keys are laid out as
`[context rows 0..T-1 | block_0 | ... | block_{N-1}]`, queries are the block rows. A query in block b
(anchor a_b) sees the context rows strictly before a_b (at inference the anchor's own target feature only
arrives with the next verify) and its own block bidirectionally, never another block.
Block position k (1..B-1) is trained to predict the token at a_b + k (same-position labels) with weight
exp(-(k-1)/gamma); the loss is normalised by the sum of the weights of the labelled positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Paper Eq. 4 / App. A.3.1: gamma per block size; other sizes interpolate with gamma ~ B / 2.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def loss_gamma(block_size: int) -> float:
    return DEFAULT_GAMMA.get(block_size, max(1.0, block_size / 2 - 1))


def position_weights(block_size: int, gamma: float) -> Tensor:
    """[B] weights: 0 for the anchor (position 0), exp(-(k-1)/gamma) for k = 1..B-1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


@dataclass
class BlockBatch:
    """Training inputs for bs sequences padded to T context rows and N blocks of size B each.

    ctx_pos    [bs, T] int64     absolute positions of the context rows (0..T-1)
    block_ids  [bs, N*B] int64   [x_anchor, MASK x (B-1)] per block
    block_pos  [bs, N*B] int64   anchor + k
    labels     [bs, N*B] int64   token at anchor + k (0 beyond the sequence end)
    weights    [bs, N*B] float   loss weight (0 for the anchor column, padding, beyond the sequence end)
    mask       [bs, N*B, T+N*B] bool  visibility (True = attend)
    """

    ctx_pos: Tensor
    block_ids: Tensor
    block_pos: Tensor
    labels: Tensor
    weights: Tensor
    mask: Tensor
    block_size: int


def sample_anchors(prompt_len: int, seq_len: int, n: int, gen: torch.Generator) -> Tensor:
    """Up to n distinct anchors in [prompt_len, seq_len - 2], sorted (each needs >= 1 label after it).

    The first anchor at inference is the first generated token (position prompt_len), whose context is the
    whole prompt, so anchors start there.
    """
    lo, hi = prompt_len, seq_len - 2
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    count = hi - lo + 1
    pick = torch.randperm(count, generator=gen)[: min(n, count)]
    return (pick + lo).sort().values


def build_block_batch(
    tokens: list[Tensor],
    anchors: list[Tensor],
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> BlockBatch:
    """Assemble a padded BlockBatch from per-sequence tokens [T_i] and anchors [n_i] (n_i may be 0)."""
    if len(tokens) != len(anchors) or not tokens:
        raise ValueError("need one anchor tensor per sequence and at least one sequence")
    bs, big_b = len(tokens), block_size
    t_max = max(len(t) for t in tokens)
    n_max = max(1, max(len(a) for a in anchors))
    q = n_max * big_b
    w_pos = position_weights(big_b, gamma)
    k = torch.arange(big_b)
    ctx_pos = torch.arange(t_max).expand(bs, t_max).clone()
    block_ids = torch.full((bs, q), mask_token_id, dtype=torch.long)
    block_pos = torch.zeros(bs, q, dtype=torch.long)
    labels = torch.zeros(bs, q, dtype=torch.long)
    weights = torch.zeros(bs, q)
    mask = torch.zeros(bs, q, t_max + q, dtype=torch.bool)
    for r, (tok, anc) in enumerate(zip(tokens, anchors)):
        seq_len = len(tok)
        for b, a in enumerate(anc.tolist()):
            sl = slice(b * big_b, (b + 1) * big_b)
            pos = a + k
            inside = pos < seq_len
            block_ids[r, b * big_b] = tok[a]
            block_pos[r, sl] = pos
            labels[r, sl] = torch.where(inside, tok[pos.clamp_max(seq_len - 1)], 0)
            weights[r, sl] = w_pos * inside
            mask[r, sl, :a] = True  # context strictly before the anchor
            mask[r, sl, t_max + b * big_b : t_max + (b + 1) * big_b] = True  # own block, bidirectional
        # Unused block slots (n_i < n_max) keep weight 0; give them one visible key so softmax stays finite.
        for b in range(len(anc), n_max):
            mask[r, b * big_b : (b + 1) * big_b, t_max + b * big_b] = True
    return BlockBatch(ctx_pos, block_ids, block_pos, labels, weights, mask, block_size)


def weighted_block_loss(hidden: Tensor, lm_head_weight: Tensor, batch: BlockBatch, logits_fn) -> tuple[Tensor, Tensor]:
    """Decay-weighted CE over labelled block positions; returns (loss, per-position top-1 accuracy [B]).

    hidden [bs, N*B, H]. Only rows with weight > 0 reach the (expensive) vocabulary projection.
    """
    sel = batch.weights > 0
    h = hidden[sel]
    logits = logits_fn(h, lm_head_weight).float()
    w = batch.weights[sel].to(logits.device)
    y = batch.labels[sel].to(logits.device)
    ce = F.cross_entropy(logits, y, reduction="none")
    loss = (ce * w).sum() / w.sum().clamp_min(1e-8)
    with torch.no_grad():
        big_b = batch.block_size
        kpos = (torch.arange(batch.weights.shape[1], device=batch.weights.device) % big_b).expand_as(batch.weights)[sel].to(logits.device)
        hit = (logits.argmax(-1) == y).float()
        acc = torch.zeros(big_b, device=logits.device).index_add_(0, kpos, hit)
        cnt = torch.zeros(big_b, device=logits.device).index_add_(0, kpos, torch.ones_like(hit))
        acc = acc / cnt.clamp_min(1)
    return loss, acc


def expected_accept_length(acc: Tensor) -> float:
    """tau estimate from per-position accuracies: 1 + sum_k prod_{j<=k} acc_j (assumes independence)."""
    return 1.0 + float(torch.cumprod(acc[1:], 0).sum()) if math.isfinite(float(acc.sum())) else 1.0
