"""The DFlash training objective: random anchors, the block-sparse mask, decay-weighted CE + logit distillation.

One drafter forward per sequence drafts N blocks at once (DFlash paper, arXiv 2602.06036, section 4). Keys are
laid out as `[context rows 0..T-1 | block_0 | ... | block_{N-1}]`, queries are the block rows. A query in block b
(anchor a_b) sees the context rows strictly before a_b (at inference the anchor's own target feature only
arrives with the next verify) and its own block bidirectionally, never another block.
Block position k (1..B-1) is trained to predict the token at a_b + k (same-position labels) with weight
exp(-(k-1)/gamma); each term is normalised by the sum of the weights of its rows.

Two terms, mixed by the distillation weight alpha: (1 - alpha) * CE on the label (the target's greedy token) +
alpha * KL(target || draft) against the target's whole next-token distribution at the same position (NVIDIA
ModelOpt trains DFlash drafters this way, `dflash_self_logit_distillation`): the soft targets say which other
tokens the target nearly picked, which a few thousand sequences of argmax labels do not. The teacher's logits are
the target's final hidden state (cached beside the features, shards.py) through the same head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# The paper's gamma per block size (Eq. 4 / App. A.3.1), for drafters that accept ~0.87 of each position.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# Default: a weighting that follows acceptance. A drafted position k only adds to tau when positions 1..k-1 were
# all accepted; for the shipped SmolLM2 drafter that probability is 1, 0.444, 0.120, 0.021 at k = 1..4 (held-out
# top-1 0.444 / 0.270 / 0.177, docs/benchmarks.md). exp(-(k-1)/gamma) matches it at k = 2 for gamma = 1.23; 1.25
# gives 1, 0.45, 0.20, 0.09 (the deeper positions a little more than today's acceptance, for a drafter that gets
# better). The paper's 7 for B = 16 is the same rule for its drafters (exp(-1/7) = 0.87 acceptance a position);
# with the SmolLM2 drafter it put 85% of the weight on positions 2..15, which add under 0.15 to tau.
ACCEPT_GAMMA = 1.25
DEFAULT_DISTILL_WEIGHT = 0.5


def loss_gamma(block_size: int, paper: bool = False) -> float:
    """The default decay: ACCEPT_GAMMA, or with paper=True the paper's value for the block size (others
    interpolate with gamma ~ B / 2)."""
    if not paper:
        return ACCEPT_GAMMA
    return PAPER_GAMMA.get(block_size, max(1.0, block_size / 2 - 1))


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


def anchor_candidates(prompt_len: int, seq_len: int) -> Tensor:
    """Every valid anchor, [prompt_len, seq_len - 2] int64 (each needs >= 1 label after it); may be empty.

    The first anchor at inference is the first generated token (position prompt_len), whose context is the
    whole prompt, so anchors start there.
    """
    return torch.arange(prompt_len, max(prompt_len, seq_len - 1))


def sample_anchors(prompt_len: int, seq_len: int, n: int, gen: torch.Generator) -> Tensor:
    """Up to n distinct anchor_candidates, drawn uniformly, sorted."""
    candidates = anchor_candidates(prompt_len, seq_len)
    if candidates.numel() == 0:
        return candidates
    pick = torch.randperm(candidates.numel(), generator=gen)[:n]
    return candidates[pick].sort().values


def build_block_batch(
    tokens: list[Tensor],
    anchors: list[Tensor],
    block_size: int,
    mask_token_id: int,
    gamma: float,
    device: torch.device | str | None = None,
) -> BlockBatch:
    """Assemble a padded BlockBatch from per-sequence tokens [T_i] and anchors [n_i] (n_i may be 0), on `device`.

    Vectorised over sequences and blocks (no per-block Python loop): on a GPU the batch, its [bs, N*B, T+N*B]
    mask included, is built where it is used instead of on the host and copied every step.
    """
    if len(tokens) != len(anchors) or not tokens:
        raise ValueError("need one anchor tensor per sequence and at least one sequence")
    dev = torch.device(device) if device is not None else tokens[0].device
    bs, big_b = len(tokens), block_size
    lens = torch.tensor([len(t) for t in tokens], device=dev)
    t_max = int(lens.max())
    n_max = max(1, max(len(a) for a in anchors))
    q = n_max * big_b
    tok = torch.nn.utils.rnn.pad_sequence([t.to(dev, torch.long) for t in tokens], batch_first=True)
    anc = torch.full((bs, n_max), -1, dtype=torch.long, device=dev)
    for r, a in enumerate(anchors):  # bs small copies; everything below is batched
        anc[r, : len(a)] = a.to(dev)
    valid = anc >= 0  # [bs, n]: unused block slots (n_i < n_max) keep weight 0
    a = anc.clamp_min(0)
    k = torch.arange(big_b, device=dev)
    pos = a[..., None] + k  # [bs, n, B]
    inside = (pos < lens[:, None, None]) & valid[..., None]
    labels = torch.where(inside, tok.gather(1, pos.clamp_max(t_max - 1).reshape(bs, -1)).view(bs, n_max, big_b), 0)
    weights = position_weights(big_b, gamma).to(dev) * inside
    block_ids = torch.full((bs, n_max, big_b), mask_token_id, dtype=torch.long, device=dev)
    block_ids[..., 0] = torch.where(valid, tok.gather(1, a), mask_token_id)
    block_pos = torch.where(valid[..., None], pos, 0)
    # Visibility: query row j of block b sees context rows strictly before its anchor and its own block
    # (bidirectionally); an unused block slot sees only its own first row, so its softmax stays finite.
    qb = torch.arange(q, device=dev) // big_b  # block of each query row
    ctx_vis = (torch.arange(t_max, device=dev)[None, None, :] < a[:, qb, None]) & valid[:, qb, None]
    kb = torch.arange(q, device=dev)
    own = (kb[None, None, :] // big_b == qb[None, :, None]) & (valid[:, qb, None] | (kb % big_b == 0)[None, None, :])
    mask = torch.cat([ctx_vis, own], dim=2)
    ctx_pos = torch.arange(t_max, device=dev).expand(bs, t_max).clone()
    return BlockBatch(ctx_pos, block_ids.view(bs, q), block_pos.view(bs, q), labels.view(bs, q),
                      weights.view(bs, q), mask, block_size)


@dataclass
class BlockLossTerms:
    """Sums over the labelled block positions of one forward, so several forwards add up exactly.

    ce_sum [] weighted CE sum, weight_sum [] sum of the weights, hits [B] / counts [B] top-1 hits and labelled
    rows per block position (0 at position 0, the anchor); kl_sum [] / kl_weight_sum [] the weighted
    KL(target || draft) sum and its weights (zero when the forward had no teacher).
    """

    ce_sum: Tensor
    weight_sum: Tensor
    hits: Tensor
    counts: Tensor
    kl_sum: Tensor | None = None
    kl_weight_sum: Tensor | None = None

    @property
    def loss(self) -> Tensor:
        """The CE term (what held-out loss always reports, comparable between recipes)."""
        return self.ce_sum / self.weight_sum.clamp_min(1e-8)

    @property
    def kl(self) -> Tensor | None:
        return None if self.kl_sum is None else self.kl_sum / self.kl_weight_sum.clamp_min(1e-8)

    def mixed(self, distill_weight: float) -> Tensor:
        """(1 - w) * CE + w * KL: the training loss."""
        if distill_weight == 0:
            return self.loss
        assert self.kl_sum is not None, "distillation needs the teacher's hidden states"
        return (1 - distill_weight) * self.loss + distill_weight * self.kl

    @property
    def accuracy(self) -> Tensor:
        return self.hits / self.counts.clamp_min(1)

    def __add__(self, other: BlockLossTerms) -> BlockLossTerms:
        def add(a, b):
            return None if a is None or b is None else a + b

        return BlockLossTerms(self.ce_sum + other.ce_sum, self.weight_sum + other.weight_sum,
                              self.hits + other.hits, self.counts + other.counts,
                              add(self.kl_sum, other.kl_sum), add(self.kl_weight_sum, other.kl_weight_sum))


def distill_kl(draft_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """[n, V'] logits -> [n] KL(softmax(teacher / T) || softmax(draft / T)) * T^2 (Hinton's scaling keeps the
    gradient's size independent of T). Both over the same V' columns: with a token map, the K mapped ids, so the
    teacher is renormalised over them (the mass it puts outside the map is dropped: the drafter cannot propose
    those tokens, and they already count as misses in accuracy and tau)."""
    log_q = F.log_softmax(draft_logits / temperature, dim=-1)
    with torch.no_grad():
        log_p = F.log_softmax(teacher_logits / temperature, dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1) * temperature**2


def teacher_rows(final_hidden: Tensor, block_pos: Tensor) -> Tensor:
    """final_hidden [bs, T, H] (the target's last hidden state of every token), block_pos [bs, N*B] int64 ->
    [bs, N*B, H]: for block row (anchor, k), labelled with token anchor + k, the row of token anchor + k - 1, whose
    logits are the target's distribution over that label. Rows past the end (weight 0) read the last row."""
    idx = (block_pos - 1).clamp(0, final_hidden.shape[1] - 1)
    return final_hidden.gather(1, idx[..., None].expand(-1, -1, final_hidden.shape[2]))


def block_loss_terms(hidden: Tensor, lm_head_weight: Tensor, batch: BlockBatch, logits_fn,
                     label_map: Tensor | None = None, teacher_hidden: Tensor | None = None,
                     temperature: float = 1.0) -> BlockLossTerms:
    """hidden [bs, N*B, H] -> BlockLossTerms. Only rows with weight > 0 reach the (expensive) vocabulary
    projection; hits/counts carry no gradient.

    Reduced draft vocabulary: lm_head_weight is the head's K token-map rows [K, H] and label_map [V] int64 the
    draft row of each target token (-1 outside the map, core/draft/token_map.py `inverse_map`). A label outside the
    map can never be drafted: it is left out of the CE (and of weight_sum; the restricted softmax has no row for
    it) but still counts as a labelled row the drafter misses, so accuracy and the tau estimate stay comparable
    with a full-vocabulary drafter's.

    teacher_hidden [bs, N*B, H]: the target's final hidden state that predicts each row's label (the row of token
    anchor + k - 1); its logits through the same head (and logits_fn's scale / soft cap, which a drafter shares
    with its target) give the KL term on every weighted row, in-map label or not (the teacher's renormalised
    distribution over the K ids is defined either way).
    """
    sel = batch.weights > 0
    h = hidden[sel]
    logits = logits_fn(h, lm_head_weight).float()
    w0 = batch.weights[sel].to(logits.device)
    w = w0
    y = batch.labels[sel].to(logits.device)
    if label_map is not None:
        y = label_map.to(y.device)[y]
        w = w * (y >= 0)
    ce = F.cross_entropy(logits, y, reduction="none", ignore_index=-1)
    kl_sum = kl_w = None
    if teacher_hidden is not None:
        with torch.no_grad():
            teacher = logits_fn(teacher_hidden[sel].to(h.dtype), lm_head_weight).float()
        kl_sum, kl_w = (distill_kl(logits, teacher, temperature) * w0).sum(), w0.sum()
    with torch.no_grad():
        big_b = batch.block_size
        kpos = (torch.arange(batch.weights.shape[1], device=batch.weights.device) % big_b).expand_as(batch.weights)
        kpos = kpos[sel].to(logits.device)
        hit = (logits.argmax(-1) == y).float()
        hits = torch.zeros(big_b, device=logits.device).index_add_(0, kpos, hit)
        counts = torch.zeros(big_b, device=logits.device).index_add_(0, kpos, torch.ones_like(hit))
    return BlockLossTerms((ce * w).sum(), w.sum(), hits, counts, kl_sum, kl_w)


def all_anchors(prompt_len: int, seq_len: int, limit: int | None = None) -> Tensor:
    """Every anchor_candidate, or `limit` of them evenly spaced: the fixed anchor set of a validation pass."""
    candidates = anchor_candidates(prompt_len, seq_len)
    count = candidates.numel()
    if limit is None or count <= limit:
        return candidates
    return candidates[torch.linspace(0, count - 1, limit).round().long().unique()]


def expected_accept_length(acc: Tensor) -> float:
    """tau estimate from per-position accuracies: 1 + sum_k prod_{j<=k} acc_j (assumes independence)."""
    return 1.0 + float(torch.cumprod(acc[1:], 0).sum()) if math.isfinite(float(acc.sum())) else 1.0
