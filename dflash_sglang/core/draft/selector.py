"""DFlash2's candidate selector: a block's drafts chosen as one path instead of independent per-position argmaxes.

At block position t = 1..D the candidates are the k best draft logits (the unary scores, after output_multiplier and
soft-capping; ties to the lowest id), over the whole draft vocabulary or, under tensor parallelism, merged exactly
over the ranks' vocab shards (core/step/vocab_parallel.py: the elementwise multiplier and cap commute with the split).
Candidate b after predecessor a scores

    s_t(b | a) = unary_t(b) + < P[a] * (W h_t), S[b] >

with h_t the drafter's final-normed state, W = hidden_projection [r, H], P / S the predecessor / successor codebooks
[V, r]. A chain walks left to right from the anchor (the bonus token, position 0): greedy takes argmax_b s_t(b | a);
at temperature T > 0 it draws b from q_t(. | a) = softmax(s_t(. | a) / T) over the k candidates (zero elsewhere). That
q, conditioned on the predecessor actually drawn, is the proposal the verify's rejection sampling divides by
(core/step/accept.py DraftQ). The request's top-k / top-p / min-p do not shape q (neither do the authors'); the verify
applies them to the target's p, and rejection sampling is exact for any q.

A tree scores each node's children with the node's own token as predecessor (core/step/tree.py `grow_tree`): the pair
term makes the scores path dependent. Its nodes are chosen by log q at temperature 1, deterministically, so the tree is
a set of point-mass drafts and core/step/tree_verify.py verifies it exactly, greedy or sampled.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..step.accept import DraftQ, SamplingParams, sample_from
from ..step.tree import DraftTree, check_tree_args, grow_tree
from ..step.vocab_parallel import NOT_RANKED, VocabShard, local_top

if TYPE_CHECKING:
    from .config import DraftConfig

# (draft logits [bs, D, rows], k) -> (target ids [bs, D, k] int64, logits [bs, D, k] float32): the k best over the whole
# draft vocabulary, best first, ties to the lowest id (adapter/scale/tp.py `DraftVocab.top_logits`: merged over TP
# ranks' shards)
TopLogits = Callable[[Tensor, int], tuple[Tensor, Tensor]]


class CandidateSelector(nn.Module):
    """Parameter names are the checkpoint's: `hidden_projection.weight` [r, H], and the codebooks `predecessor_codebook`
    / `successor_codebook` [V, r], stored as plain tensors (no `.weight`)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        assert cfg.dflash2 is not None, "a DFlash2 draft"
        rank, self.top_k = cfg.dflash2.selector_rank, cfg.dflash2.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, rank).normal_())
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, rank).normal_())

    def check_proposable(self, ids: int) -> None:
        """ids: how many ids the draft proposes (its vocabulary or token map); at least top-k are needed."""
        if ids < self.top_k:
            raise ValueError(f"DFlash2 selector_top_k={self.top_k} exceeds the {ids} ids the draft proposes (its "
                             f"token map)")

    def candidates(self, hidden: Tensor, logits: Tensor, token_map: Tensor | None = None,
                   top_logits: TopLogits | None = None) -> Candidates:
        """hidden [bs, D, H] drafter states at block positions 1..D, logits [bs, D, V] their draft logits (or [bs, D, K]
        over token_map's K ids; with `top_logits`, this rank's rows, merged by it) -> the positions' top-k candidates
        and what scoring them takes."""
        if top_logits is None:
            self.check_proposable(logits.shape[-1])
            tokens, unary = local_top(logits, VocabShard(0, logits.shape[-1], token_map), self.top_k)
        else:
            tokens, unary = top_logits(logits, self.top_k)
        return Candidates(tokens, unary, self.hidden_projection(hidden).float(),
                          self.successor_codebook[tokens].float(), self.predecessor_codebook)


@dataclass(frozen=True)
class Candidates:
    """One drafter pass's candidates at block positions 1..D (index t-1 holds position t)."""

    tokens: Tensor  # [bs, D, k] int64 target ids, best unary score first
    unary: Tensor  # [bs, D, k] float32 draft logits
    hidden: Tensor  # [bs, D, r] float32: W h_t
    successors: Tensor  # [bs, D, k, r] float32: S[candidate]
    predecessors: Tensor  # [V, r] the predecessor codebook P

    def scores(self, pos: Tensor, prev: Tensor) -> Tensor:
        """pos [bs, m] int64 position indices (0 .. D-1), prev [bs, m] int64 predecessor ids -> s [bs, m, k] float32:
        every candidate's score at pos after prev."""
        rows = torch.arange(pos.shape[0], device=pos.device)[:, None]
        pair = self.predecessors[prev].float() * self.hidden[rows, pos]  # [bs, m, r]
        return self.unary[rows, pos] + torch.einsum("bmr,bmkr->bmk", pair, self.successors[rows, pos])

    def walk(self, anchor: Tensor, temperature: Tensor, u: Tensor | None) -> tuple[Tensor, Tensor]:
        """The chain through every position. anchor [bs] int64 (the bonus), temperature [bs] float32 (0: greedy),
        u [bs, D] float32 uniforms (None: every row greedy) -> (tokens [bs, D] int64, q [bs, D, k] float32: the
        distribution each token was drawn from given its predecessor, one-hot on greedy rows)."""
        bs, depth, k = self.tokens.shape
        sampled = temperature > 0
        columns = torch.arange(k, device=self.tokens.device)
        prev, tokens, qs = anchor, [], []
        for t in range(depth):
            s = self.scores(torch.full_like(prev, t)[:, None], prev[:, None])[:, 0]  # [bs, k]
            pick = s.argmax(-1)
            q = (pick[:, None] == columns).float()  # one-hot (F.one_hot reads the ids' range on the host off CUDA)
            if u is not None:
                soft = torch.softmax(s / temperature.clamp_min(1e-6)[:, None], dim=-1)
                pick = torch.where(sampled, sample_from(soft, u[:, t]), pick)
                q = torch.where(sampled[:, None], soft, q)
            prev = self.tokens[:, t].gather(-1, pick[:, None])[:, 0]
            tokens.append(prev)
            qs.append(q)
        return torch.stack(tokens, 1), torch.stack(qs, 1)

    def children(self, token: Tensor, depth: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """A tree node's k best children: token [bs] int64 the node's, depth [bs] int64 its depth (the root, depth 0, is
        the bonus) -> (tokens [bs, k] int64, log q [bs, k] float32 at temperature 1), best first."""
        pos = depth.clamp_max(self.tokens.shape[1] - 1)[:, None]  # (a leaf at depth D: never used)
        logq = torch.log_softmax(self.scores(pos, token[:, None])[:, 0], dim=-1)
        best, at = logq.topk(k, dim=-1)
        rows = torch.arange(len(token), device=token.device)
        return self.tokens[rows, pos[:, 0]].gather(-1, at), best

    def ranks(self, anchor: Tensor, tokens: Tensor) -> Tensor:
        """tokens [bs, m] int64 a path from anchor [bs] at positions 1..m -> [bs, m] int64: each token's rank by score
        among its position's candidates after the path's previous token (1 + the candidates that beat it; ties do not),
        NOT_RANKED where it is not a candidate."""
        m = tokens.shape[1]
        prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
        pos = torch.arange(m, device=tokens.device).expand_as(tokens)
        s = self.scores(pos, prev)
        hit = self.tokens[:, :m] == tokens[..., None]
        mine = torch.where(hit, s, float("-inf")).amax(-1, keepdim=True)
        ranks = (s > mine).sum(-1) + 1
        return torch.where(hit.any(-1), ranks, torch.full_like(ranks, NOT_RANKED))


def some_row_samples(params: SamplingParams | None) -> bool | None:
    """Whether some request of the batch samples, as the host knows it: params None (every request greedy) or its
    `HostHints` (which rows sample; SGLang's worker builds them from the requests, adapter/step/verify.py) answer
    without reading the device; None where only the device's temperatures can tell (a host sync: the reference
    decoder)."""
    if params is None:
        return False
    if params.hints is None:
        return None
    return params.hints.sampled is None or params.hints.sampled.numel() > 0


def walk_uniforms(bs: int, depth: int, any_sampled: bool, generator: torch.Generator | None, device) -> Tensor | None:
    """The walk's uniforms [bs, depth] float32 from `generator` (None: torch's default) where some request samples
    (`any_sampled`), else None (nothing drawn: an all-greedy batch leaves the generator where it was)."""
    return torch.rand((bs, depth), generator=generator, device=device) if any_sampled else None


@dataclass(frozen=True)
class SelectorScores:
    """A DFlash2 drafter pass's scores for the decode step (core/speculate.py `PathScores`): a chain is the selector's
    walk, greedy or sampled per request; a tree grows with each node's children scored after its own token."""

    candidates: Candidates
    anchor: Tensor  # [bs] int64: the bonus token, every path's first predecessor
    temperature: Tensor  # [bs] float32, 0 = greedy
    uniforms: Tensor | None  # [bs, D] float32 for the sampled rows' walk; None: every row greedy
    # the walk (tokens [bs, D] int64, q [bs, D, k] float32) where it already ran (inside a draft graph,
    # adapter/draft/selector_graph.py); None: walked when first asked
    walked: tuple[Tensor, Tensor] | None = None

    @classmethod
    def of(cls, selector: CandidateSelector, hidden: Tensor, logits: Tensor, anchor: Tensor,
           temperature: Tensor | None, generator: torch.Generator | None = None,
           token_map: Tensor | None = None, top_logits: TopLogits | None = None,
           any_sampled: bool | None = None) -> SelectorScores:
        """hidden [bs, D, H], logits [bs, D, V | K] of one drafter pass (with `top_logits`: this TP rank's rows, the
        candidates merged over ranks); temperature [bs] (None: every request greedy); any_sampled: whether some request
        samples, as the host knows it (`some_row_samples`; None: read from the temperatures, a host sync); the walk's
        uniforms come from `generator` (None: torch's default) when some request samples."""
        if temperature is None:
            temperature, any_sampled = torch.zeros(anchor.shape[0], device=logits.device), False
        elif any_sampled is None:
            any_sampled = bool((temperature > 0).any())
        u = walk_uniforms(logits.shape[0], logits.shape[1], any_sampled, generator, logits.device)
        return cls(selector.candidates(hidden, logits, token_map, top_logits), anchor.to(torch.int64),
                   temperature.float(), u)

    @property
    def positions(self) -> int:
        """D: the draft positions these scores cover."""
        return self.candidates.tokens.shape[1]

    @cached_property
    def _path(self) -> tuple[Tensor, Tensor]:
        """The walk through every position: (tokens [bs, D] int64, q [bs, D, k] float32), run once."""
        if self.walked is not None:
            return self.walked
        return self.candidates.walk(self.anchor, self.temperature, self.uniforms)

    def walk(self, count: int) -> Tensor:
        """[bs, count] int64: the walk's first count drafts (a chain's): the best path on greedy rows, drawn from q at
        the request's temperature on sampling rows."""
        return self._path[0][:, :count]

    def chain_q(self, count: int) -> DraftQ | None:
        """The distribution each of the first count drafts was drawn from (None: every row greedy, point masses)."""
        if self.uniforms is None:
            return None
        return DraftQ(self.candidates.tokens[:, :count], self._path[1][:, :count])

    def tree(self, root: Tensor, nodes: int, topk: int) -> DraftTree:
        """The best-first tree of `nodes` nodes under root [bs] (the anchor), each node's `topk` best children."""
        tokens = self.candidates.tokens
        if topk > tokens.shape[-1]:
            raise ValueError(f"tree top-k {topk} exceeds the selector's {tokens.shape[-1]} candidates per position")
        check_tree_args(root, tokens[..., :topk], self.candidates.unary[..., :topk], nodes)
        return grow_tree(root, lambda token, depth: self.candidates.children(token, depth, topk), tokens.shape[1],
                         topk, nodes)

    def ranks(self, tokens: Tensor) -> Tensor:
        return self.candidates.ranks(self.anchor, tokens)
