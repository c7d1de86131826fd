"""Chain acceptance: greedy (longest matching prefix + bonus) and lossless rejection sampling.

Conventions shared with the tree version (core/step/tree.py) and the CUDA kernels, so they compare bit-exactly:
- `accept_len [bs]` counts accepted DRAFT tokens (0..B-1); the step commits accept_len + 1 tokens
  (tau counts the bonus token).
- `out_tokens [bs, B]`: accepted drafts, then the bonus token at index accept_len, then -1.
- Randomness is passed in as uniforms (`coins`, `resample_u`), never drawn inside.
- Draft k is accepted iff `coins[k] * q_k(d_k) < p_k(d_k)`; with the default point-mass (argmax) proposal
  q_k(d_k) = 1, so the test is `coins[k] < p_k(d_k)`. On the first rejection j the bonus is drawn from the
  residual max(p_j - q_j, 0) (point mass: p_j with d_j zeroed); if every draft is accepted, from p_{B-1}.
  This is Leviathan et al.'s rule: the emitted tokens are distributed exactly as the target's samples. It stays
  exact when q_k depends on the drafts before k (DFlash2's selector walk), as long as q_k is the distribution d_k
  was actually drawn from given them (`DraftQ`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class HostHints:
    """What the caller knows of a batch's sampling settings on the host (SGLang: each request's params), so the
    accept step skips work no row needs without reading the device: greedy rows are verified greedily instead of
    through a one-hot distribution, and target_probs sorts the vocabulary only where some row asks for top-p.

    sampled [m] int64 on the device: the rows that sample (temperature > 0), None: every row samples; top_p: some
    sampling row has top_p < 1; top_k: the largest top-k among the sampling rows (0: no row uses top-k).
    """

    sampled: Tensor | None
    top_p: bool
    top_k: int

    @classmethod
    def of(cls, temperature: list[float], top_k: list[int], top_p: list[float], device=None) -> HostHints:
        """From host lists [bs] in SamplingParams' conventions (temperature 0 = greedy, top_k 0 = off)."""
        rows = [i for i, t in enumerate(temperature) if t > 0]
        sampled = None
        if len(rows) < len(temperature):
            host = torch.tensor(rows, dtype=torch.int64)
            on_cuda = device is not None and torch.device(device).type == "cuda"
            # pinned + non_blocking: the copy is queued on the stream, the host does not wait for the device
            sampled = (host.pin_memory() if on_cuda else host).to(device, non_blocking=on_cuda)
        return cls(sampled, any(top_p[i] < 1 for i in rows), max((top_k[i] for i in rows), default=0))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; a batch may mix greedy and sampled requests.

    temperature [bs] float32 (0 = greedy), top_k [bs] int64 (0 = off), top_p [bs] float32 (1 = off),
    min_p [bs] float32 (0 = off; None: off for every request, nothing computed); hints: what the host knows of them
    (None: nothing, every row takes the general path).
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor | None = None
    hints: HostHints | None = None

    @classmethod
    def full(cls, bs: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             device=None) -> SamplingParams:
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1 or not 0 <= min_p <= 1:
            raise ValueError(f"invalid sampling params: temperature={temperature} top_k={top_k} top_p={top_p} "
                             f"min_p={min_p}")
        return cls(
            torch.full((bs,), float(temperature), device=device),
            torch.full((bs,), int(top_k), dtype=torch.int64, device=device),
            torch.full((bs,), float(top_p), device=device),
            torch.full((bs,), float(min_p), device=device) if min_p > 0 else None,
        )

    @property
    def greedy(self) -> Tensor:
        return self.temperature == 0

    def select(self, rows: Tensor) -> SamplingParams:
        """The params of `rows` [m] int64 (hints kept as bounds: what holds for every row holds for a subset)."""
        min_p = self.min_p[rows] if self.min_p is not None else None
        hints = self.hints
        if hints is not None and hints.sampled is not None:
            hints = None  # which of `rows` sample is not known on the host
        return SamplingParams(self.temperature[rows], self.top_k[rows], self.top_p[rows], min_p, hints)

    def sampling_rows(self) -> SamplingParams:
        """The params of the sampling rows alone (hints.sampled must be set): every row of the result samples."""
        rows = self.hints.sampled
        min_p = self.min_p[rows] if self.min_p is not None else None
        return SamplingParams(self.temperature[rows], self.top_k[rows], self.top_p[rows], min_p,
                              HostHints(None, self.hints.top_p, self.hints.top_k))


@dataclass(frozen=True)
class DraftQ:
    """The distribution each sampled draft was drawn from, over k candidate ids per position (zero elsewhere).

    tokens [bs, D, k] int64, distinct within a position; probs [bs, D, k] float32, summing to 1 at each position.
    """

    tokens: Tensor
    probs: Tensor

    @classmethod
    def dense(cls, q: Tensor) -> DraftQ:
        """q [bs, D, V] over the whole vocabulary."""
        return cls(torch.arange(q.shape[-1], device=q.device).expand(q.shape), q)

    def of(self, draft: Tensor) -> Tensor:
        """draft [bs, D] int64 -> [bs, D] float32: each draft's probability at its position."""
        return torch.where(self.tokens == draft[..., None], self.probs, 0.0).sum(-1)

    def row(self, pos: Tensor, vocab: int) -> Tensor:
        """pos [bs] int64 -> [bs, V] float32: each request's q at position pos over the vocabulary."""
        rows = torch.arange(len(pos), device=pos.device)
        dense = torch.zeros(len(pos), vocab, dtype=self.probs.dtype, device=self.probs.device)
        return dense.scatter_add_(-1, self.tokens[rows, pos], self.probs[rows, pos])


@dataclass(frozen=True)
class AcceptResult:
    accept_len: Tensor  # [bs] int64, accepted draft tokens
    out_tokens: Tensor  # [bs, B] int64, accepted drafts, bonus at accept_len, then -1
    bonus: Tensor  # [bs] int64


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [bs, n, V] -> probabilities [bs, n, V] float32 after temperature, top-k, top-p, then min-p (tokens
    below min_p times the row's largest probability dropped, as SGLang's sampler applies it after top-k/top-p).

    Greedy rows become one-hot at the argmax, so rejection sampling on them reduces to greedy acceptance. With host
    hints that no row asks for top-p, nothing is sorted: top-k keeps the logits >= the k-th largest (a partial top-k of
    the largest k in the batch), the same set the sort finds.
    """
    logits = logits.float()
    bs, n, vocab = logits.shape
    temp = params.temperature.clamp_min(1e-6)[:, None, None]
    scaled = logits / temp
    hints = params.hints
    if hints is None or hints.top_p:
        sorted_l, order = scaled.sort(dim=-1, descending=True)
        k = torch.where(params.top_k > 0, params.top_k.clamp_max(vocab), vocab)[:, None, None]
        kth = sorted_l.gather(-1, (k - 1).expand(bs, n, 1))
        keep_sorted = sorted_l >= kth  # ties with the k-th logit are kept
        probs_sorted = torch.softmax(sorted_l.masked_fill(~keep_sorted, float("-inf")), dim=-1)
        # top-p keeps the smallest prefix whose mass reaches p: drop a token when the mass before it already does.
        before = probs_sorted.cumsum(-1) - probs_sorted
        keep_sorted &= before < params.top_p[:, None, None]
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    elif hints.top_k > 0:
        largest = min(hints.top_k, vocab)
        top = scaled.topk(largest, dim=-1).values  # [bs, n, largest], descending
        k = params.top_k.clamp(1, largest)[:, None, None].expand(bs, n, 1)
        kth = torch.where(params.top_k[:, None, None] > 0, top.gather(-1, k - 1), float("-inf"))
        probs = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)  # ties with the k-th kept
    else:
        probs = torch.softmax(scaled, dim=-1)
    if params.min_p is not None:
        floor = params.min_p.float()[:, None, None] * probs.amax(-1, keepdim=True)
        probs = torch.where(probs >= floor, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if hints is not None and hints.sampled is None:
        return probs  # every row samples
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(params.greedy[:, None, None], onehot, probs)


def sample_from(weights: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sample: weights [..., V] >= 0 (unnormalised), u [...] in [0, 1) -> index [...] int64.

    The first index whose running sum exceeds u * total; clamped to the last index with weight > 0 so
    rounding can never pick a zero-probability token. The running sum is torch's CPU float32 cumsum, which
    accumulates sequentially in double and rounds each prefix to float32; the CUDA sampler (cuda/sample.cuh)
    reproduces exactly that (tests/test_tree.py pins it).
    """
    w = weights.float()
    c = w.cumsum(-1)
    idx = (c <= (u.float() * c[..., -1])[..., None]).sum(-1)
    last_nz = w.shape[-1] - 1 - (w > 0).flip(-1).int().argmax(-1)
    return torch.minimum(idx, last_nz)


def _finish(draft: Tensor, accept_len: Tensor, bonus: Tensor) -> AcceptResult:
    bs, n_draft = draft.shape
    j = torch.arange(n_draft + 1, device=draft.device)[None]
    padded = torch.cat([draft, draft.new_full((bs, 1), -1)], dim=1)
    out = torch.where(j < accept_len[:, None], padded, -1)
    out = torch.where(j == accept_len[:, None], bonus[:, None], out)
    return AcceptResult(accept_len, out, bonus)


def greedy_accept(draft: Tensor, target_argmax: Tensor) -> AcceptResult:
    """draft [bs, B-1] int64, target_argmax [bs, B] int64 (target choice after each block position)."""
    match = (draft == target_argmax[:, :-1]).long()
    accept_len = match.cumprod(dim=1).sum(dim=1)
    bonus = target_argmax.gather(1, accept_len[:, None]).squeeze(1)
    return _finish(draft, accept_len, bonus)


def rejection_accept(
    draft: Tensor, target_p: Tensor, coins: Tensor, resample_u: Tensor, draft_q: DraftQ | None = None
) -> AcceptResult:
    """Lossless speculative sampling along a chain.

    draft [bs, B-1] int64, target_p [bs, B, V] float32 (already temperature/top-k/top-p processed),
    coins [bs, B-1] float32 uniforms, resample_u [bs] float32 uniform,
    draft_q the drafts' proposal distribution (DraftQ over [bs, B-1] positions), or None for point-mass (argmax)
    proposals.
    """
    bs, n_draft = draft.shape
    if n_draft == 0:  # nothing drafted (plain decoding step): sample the target directly
        return _finish(draft, draft.new_zeros(bs), sample_from(target_p[:, 0], resample_u))
    p_d = target_p[:, :-1].gather(-1, draft[..., None]).squeeze(-1)
    q_d = torch.ones_like(p_d) if draft_q is None else draft_q.of(draft)
    accepted = (coins * q_d < p_d).long()
    accept_len = accepted.cumprod(dim=1).sum(dim=1)
    rows = torch.arange(bs, device=draft.device)
    p_j = target_p[rows, accept_len]  # [bs, V]: target dist at the first rejection (or after the last draft)
    rejected = accept_len < n_draft
    d_j = draft.gather(1, accept_len.clamp_max(n_draft - 1)[:, None])  # [bs, 1]
    if draft_q is None:
        residual = p_j.scatter(-1, d_j, 0.0)
    else:
        residual = (p_j - draft_q.row(accept_len.clamp_max(n_draft - 1), p_j.shape[-1])).clamp_min(0.0)
    # A residual with no mass can only come from rounding (p == q); the target distribution itself is exact then.
    residual = torch.where(rejected[:, None] & (residual.sum(-1, keepdim=True) > 0), residual, p_j)
    bonus = sample_from(residual, resample_u)
    return _finish(draft, accept_len, bonus)


def draw_uniforms(bs: int, n: int, generator: torch.Generator | None, device) -> tuple[Tensor, Tensor]:
    """coins [bs, n] and resample_u [bs], from one generator so runs are reproducible by seed."""
    u = torch.rand(bs, n + 1, generator=generator, device=device)
    return u[:, :n], u[:, n]


def cap_commits(result: AcceptResult, budget: Tensor) -> AcceptResult:
    """The same step with request i committing at most budget[i] >= 1 tokens (what its max_new_tokens still
    allows): a longer run is cut to its first budget[i] tokens, the last of them the new bonus, as if the target had
    rejected the draft after them. Greedy or sampled, those tokens are a prefix of the uncut run, so the output stays
    the target's; the request ends by length on them.

    result: accept_len [bs], out_tokens [bs, W], bonus [bs]; budget [bs] int64.
    """
    commit = torch.minimum(result.accept_len + 1, budget.clamp_min(1))
    accept_len = commit - 1
    j = torch.arange(result.out_tokens.shape[1], device=budget.device)[None]
    out = torch.where(j < commit[:, None], result.out_tokens, -1)
    bonus = result.out_tokens.gather(1, accept_len[:, None]).squeeze(1)
    return AcceptResult(accept_len, out, bonus)
